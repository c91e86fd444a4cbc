"""``ncclpy check``: cross-check torch.distributed, ncclpy and the numpy reference.

``main(argv) -> int``.  Without RANK/WORLD_SIZE in the environment it starts ``-n`` ranks itself
(:func:`ncclpy.spawn`, or multiprocessing where that is missing); under ``ncclpy run`` or
torchrun it runs as the rank the environment names.  With a GPU the torch side uses the NCCL
backend and the ncclpy column is filled; without one torch's gloo backend is checked against the
reference on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import cases as C

__all__ = ["main", "build_parser", "fairness_env", "PINS"]

#: variables both sides must share, with the value set when the user has not set them
PINS: Tuple[Tuple[str, str, str], ...] = (
    ("NCCL_ALGO", "Ring", "same algorithm on both sides"),
    ("NCCL_PROTO", "Simple", "same protocol on both sides"),
    ("NCCL_NVLS_ENABLE", "0", "no NVLS (NVLink SHARP) unless --nvls"),
    ("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0", "torch: no buffer registration hook"),
    ("ENABLE_INTRA_NODE_COMM", "0", "torch: no intra-node custom all-reduce"),
    ("TORCH_NCCL_INTRA_NODE_COMM", "0", "torch: no intra-node custom all-reduce (newer name)"),
    ("TORCH_NCCL_NAN_CHECK", "0", "torch: no NaN check (data-movement inputs carry NaN bits)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ncclpy check",
        description="Run every collective through torch.distributed and ncclpy on identical "
                    "seeded inputs; compare byte for byte with each other and with ncclpy's "
                    "numpy reference.  Exit status 1 on any mismatch that is not a documented "
                    "torch divergence.")
    p.add_argument("-n", "--nprocs", type=int, default=None,
                   help="ranks to start (default: WORLD_SIZE under a launcher, else 2)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="torch backend: nccl (GPU, with the ncclpy column) or gloo (CPU); "
                        "auto picks nccl when a GPU is visible")
    p.add_argument("--collectives", default=None,
                   help=f"comma list (default all: {','.join(C.COLLECTIVES)})")
    p.add_argument("--dtypes", default=None, help="comma list (default: every dtype the backend "
                                                  "supports)")
    p.add_argument("--ops", default=None, help=f"comma list of {','.join(C.REDUCING_OPS)}")
    p.add_argument("--sizes", default=None,
                   help=f"comma list of element counts or byte sizes with a unit (default CPU "
                        f"{C.DEFAULT_SIZES_CPU}; GPU {C.DEFAULT_SIZES_GPU})")
    p.add_argument("--roots", default=None, help="comma list of roots (default 0 and n-1)")
    p.add_argument("--inplace", choices=("both", "yes", "no", "auto"), default="auto",
                   help="in-place variants (auto: where they differ for the side tested)")
    p.add_argument("--premul-scalar", type=float, default=C.PREMUL_SCALAR,
                   help="premul_sum factor (a power of two keeps results exact)")
    p.add_argument("--seed", type=int, default=1234, help="input seed (per rank and case)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every case as JSON")
    p.add_argument("--nvls", action="store_true", help="allow NVLS (do not pin NCCL_NVLS_ENABLE=0)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only cases that did not pass")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--list-skips", action="store_true",
                   help="list what the backend cannot run (with reasons) and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of errors")
    return p


def _csv(s: Optional[str]) -> Optional[List[str]]:
    return None if s is None else [t.strip() for t in s.split(",") if t.strip()]


def fairness_env(nvls: bool, env: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str],
                                                                            List[str], List[str]]:
    """(variables to set, 'K=V' pinned, 'K=V' kept from the user) for the GPU comparison."""
    env = os.environ if env is None else env
    out: Dict[str, str] = {}
    pinned: List[str] = []
    kept: List[str] = []
    for k, v, _why in PINS:
        if k == "NCCL_NVLS_ENABLE" and nvls:
            continue
        if k in env:
            kept.append(f"{k}={env[k]}")
        else:
            out[k] = v
            pinned.append(f"{k}={v}")
    return out, pinned, kept


def _gpu_available() -> Tuple[bool, str]:
    try:
        from ..launch.placement import visible_gpu_count
        n = visible_gpu_count()
    except Exception as e:  # noqa: BLE001
        return False, f"cannot count GPUs: {e}"
    if n < 1:
        return False, "no CUDA GPU visible"
    return True, ""


def _config(ns: argparse.Namespace, n: int, backend: str, no_gpu: str) -> Dict[str, Any]:
    roots = None if ns.roots is None else [int(r) for r in _csv(ns.roots) or []]
    inplace = {"both": [False, True], "yes": [True], "no": [False], "auto": None}[ns.inplace]
    cfg: Dict[str, Any] = {
        "world_size": n, "backend": backend, "collectives": _csv(ns.collectives),
        "dtypes": _csv(ns.dtypes), "ops": _csv(ns.ops), "sizes": ns.sizes, "roots": roots,
        "in_place": inplace, "premul_scalar": ns.premul_scalar, "seed": ns.seed,
        "json": os.path.abspath(ns.json) if ns.json and ns.json != "-" else ns.json,
        "quiet": ns.quiet, "timeout": ns.timeout, "verbose": ns.verbose,
        "no_gpu_reason": no_gpu, "env": {}, "pinned": [], "kept": []}
    if backend == "nccl":
        cfg["env"], cfg["pinned"], cfg["kept"] = fairness_env(ns.nvls)
    return cfg


def _list(cfg: Dict[str, Any], skips: bool) -> int:
    cases, skipped = C.build_matrix(
        cfg["world_size"], backend=cfg["backend"], collectives=cfg["collectives"],
        dtypes=cfg["dtypes"], ops=cfg["ops"], sizes=cfg["sizes"], roots=cfg["roots"],
        in_place=cfg["in_place"], premul_scalar=cfg["premul_scalar"])
    if skips:
        for s in skipped:
            print(f"{s['collective']:<14} {s['dtype'] or '-':<11} {s['op'] or '-':<10} "
                  f"{s['reason']}")
        print(f"{len(skipped)} combinations skipped on {cfg['backend']}")
        return 0
    for c in cases:
        print(c.key)
    print(f"{len(cases)} cases on {cfg['world_size']} ranks ({cfg['backend']})")
    return 0


def _spawn(n: int, cfg: Dict[str, Any]) -> int:
    """Start n ranks; rank 0 reports the exit code through a file."""
    from .runner import spawn_entry
    fd, path = tempfile.mkstemp(prefix="ncclpy-check-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cfg = dict(cfg, result_file=path)
    try:
        try:
            from ..launch.spawn import spawn
        except ImportError:
            spawn = None
        if spawn is not None:
            spawn(spawn_entry, n, args=(cfg,), env=cfg.get("env") or None,
                  timeout=None)
        else:  # pragma: no cover - only before ncclpy.spawn existed
            _mp_spawn(n, cfg)
        with open(path) as f:
            return int(json.load(f)["exit_code"])
    except FileNotFoundError:
        print("ncclpy check: rank 0 reported no result", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a crashed rank: say which and why
        print(f"ncclpy check: {type(e).__name__}: {e}", file=sys.stderr)
        tb = getattr(e, "traceback", None)
        if tb:
            print(tb, file=sys.stderr)
        return 2
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _mp_spawn(n: int, cfg: Dict[str, Any]) -> None:  # pragma: no cover
    import multiprocessing as mp
    import socket
    from .runner import spawn_entry
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(n):
        env = {"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "LOCAL_RANK": str(r)}
        c = dict(cfg, env={**(cfg.get("env") or {}), **env})
        p = ctx.Process(target=spawn_entry, args=(r, c))
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode]
    if bad:
        raise RuntimeError(f"ranks {bad} exited with {[procs[i].exitcode for i in bad]}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ncclpy check`` with ``argv``; the exit code."""
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    n = ns.nprocs or (int(os.environ["WORLD_SIZE"]) if launched else 2)
    if n < 1:
        parser.error(f"-n: expected >= 1 ranks, got {n}")
    if launched and int(os.environ["WORLD_SIZE"]) != n:
        parser.error(f"-n {n} disagrees with WORLD_SIZE={os.environ['WORLD_SIZE']} set by the "
                     f"launcher")
    gpu, why = _gpu_available()
    backend = ns.backend if ns.backend != "auto" else ("nccl" if gpu else "gloo")
    if backend == "nccl" and not gpu:
        parser.error(f"--backend nccl: {why}")
    try:
        cfg = _config(ns, n, backend, "" if backend == "nccl" else (why or "backend gloo"))
        if ns.list or ns.list_skips:
            return _list(cfg, ns.list_skips)
        C.build_matrix(n, backend=backend, collectives=cfg["collectives"], dtypes=cfg["dtypes"],
                       ops=cfg["ops"], sizes=cfg["sizes"], roots=cfg["roots"])
    except ValueError as e:  # ArgumentError from a filter
        parser.error(str(e))
    if launched:
        from .runner import worker
        return worker(int(os.environ["RANK"]), cfg)
    return _spawn(n, cfg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
