"""``ncclpy check``: cross-check torch.distributed, ncclpy and the numpy reference.

``main(argv) -> int``.  Without RANK/WORLD_SIZE in the environment it starts ``-n`` ranks itself
(:func:`ncclpy.spawn`, bounded by ``--run-timeout``); under ``ncclpy run`` or torchrun it runs as
the rank the environment names (under torchrun, which places nothing, the placement of
``ncclpy run`` is applied first: :func:`ncclpy.check.fairness.apply_launcher_placement`).  With a
GPU the torch side uses the NCCL backend and the ncclpy column is filled; without one torch's
gloo backend is checked against the reference on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import cases as C
from .fairness import PINS, apply_launcher_placement, fairness_env

__all__ = ["main", "build_parser", "fairness_env", "PINS"]

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
                   help="premul_sum factor (any finite value: the inputs keep results exact)")
    p.add_argument("--seed", type=int, default=1234, help="input seed (per rank and case)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write every case as JSON ('-': stdout, the table then goes to stderr)")
    p.add_argument("--nvls", action="store_true", help="allow NVLS (do not pin NCCL_NVLS_ENABLE=0)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only cases that did not pass")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any one collective, init or wait may take (default 300)")
    p.add_argument("--run-timeout", type=float, default=3600.0,
                   help="seconds the whole run may take when check starts the ranks itself "
                        "(default 3600; 0: no limit)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--list-skips", action="store_true",
                   help="list what the backend cannot run (with reasons) and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of errors")
    return p


def _csv(s: Optional[str]) -> Optional[List[str]]:
    return None if s is None else [t.strip() for t in s.split(",") if t.strip()]


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
        "run_timeout": ns.run_timeout,
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
                  timeout=cfg.get("run_timeout") or None)
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
    if ns.timeout <= 0 or ns.run_timeout < 0:
        parser.error("--timeout must be > 0 and --run-timeout >= 0 seconds")
    gpu, why = _gpu_available()
    backend = ns.backend if ns.backend != "auto" else ("nccl" if gpu else "gloo")
    if backend == "nccl" and not gpu:
        parser.error(f"--backend nccl: {why}")
    try:
        cfg = _config(ns, n, backend, "" if backend == "nccl" else (why or "backend gloo"))
        if ns.list or ns.list_skips:
            return _list(cfg, ns.list_skips)
        cases, skipped = C.build_matrix(
            n, backend=backend, collectives=cfg["collectives"], dtypes=cfg["dtypes"],
            ops=cfg["ops"], sizes=cfg["sizes"], roots=cfg["roots"], in_place=cfg["in_place"],
            premul_scalar=cfg["premul_scalar"])
    except ValueError as e:  # ArgumentError from a filter
        parser.error(str(e))
    if not cases:
        sys.stderr.write(f"ncclpy check: no case to run: the filters leave nothing the {backend} "
                         f"backend can run on {n} ranks ({len(skipped)} combinations skipped; "
                         f"see --list-skips)\n")
        return 2
    if launched:
        from .runner import worker
        if backend == "nccl":
            cfg["placement"] = apply_launcher_placement()
        return worker(int(os.environ["RANK"]), cfg)
    return _spawn(n, cfg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
