"""``ncclpy check``: cross-check torch.distributed, ncclpy and the numpy reference.

``main(argv) -> int``.  Without RANK/WORLD_SIZE in the environment it starts ``-n`` ranks itself
(:func:`ncclpy.spawn`, bounded by ``--run-timeout``); under ``ncclpy run`` or torchrun it runs as
the rank the environment names (under torchrun, which places nothing, the placement of
``ncclpy run`` is applied first: :func:`ncclpy.check.fairness.apply_launcher_placement`), and
says so at once, first on stderr; a failure to meet the other ranks is one line, exit status 2
(:mod:`ncclpy.check.launched`: the variables are often left over from another job).  With a
GPU the torch side uses the NCCL backend and the ncclpy column is filled; without one
(``--backend auto``, and under ``NCCLPY_DEVICE=cpu`` as ``ncclpy run --cpu`` sets it) ncclpy
runs on its CPU backend (``ncclpy.init(device="cpu")``: NCCL's semantics and order, not NCCL,
no GPU) against torch's gloo and the reference (:mod:`ncclpy.check.cpu_side`), where that
backend can run (x86-64 Linux with POSIX shared memory; elsewhere torch's gloo alone is
checked against the reference, as ``--backend gloo`` always does).

Every argument is checked before anything starts (the ``--json`` file included); a bad one is
one line naming the flag as typed, exit status 2.  Ctrl-C: one line, exit status 130; a closed
output pipe (``ncclpy check | head``): quiet, exit status 141 (:mod:`ncclpy.cli_util`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..cli_util import (EXIT_CLOSED_PIPE, OneLineParser, check_output_path, int_at_least,
                        run_main, silence_stdout)
from ..errors import ArgumentError, ArgumentTypeError
from . import cases as C
from . import torch_backends as TB
from .fairness import PINS, apply_launcher_placement, fairness_env
from .report import plural

__all__ = ["main", "build_parser", "fairness_env", "PINS", "check_output_path"]

PROG = "ncclpy check"


def _seconds(lo: float, strict: bool, what: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (strict and v == lo):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r} (the check's "
                                         f"inputs keep results exact for finite scalars only)")
    return v


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def build_parser() -> OneLineParser:
    """The ``ncclpy check`` parser (errors: one line naming the flag, exit status 2)."""
    p = OneLineParser(
        prog=PROG,
        description="Run every collective through torch.distributed and ncclpy on identical "
                    "seeded inputs; compare byte for byte with each other and with ncclpy's "
                    "numpy reference.  Exit status 1 on any mismatch that is not a documented "
                    "torch divergence.  Prints a progress line (on a terminal), a matrix of "
                    "collective x dtype, what did not pass and why, and a summary.")
    p.add_argument("-n", "--nprocs", type=int_at_least(1, "a number of ranks >= 1"),
                   default=None, metavar="N",
                   help="ranks to start (default: WORLD_SIZE under a launcher, else 2)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo", "cpu"), default="auto",
                   help="nccl: ncclpy on a GPU vs torch's NCCL; gloo: torch's gloo vs the "
                        "reference (ncclpy does not run); cpu: ncclpy's CPU backend "
                        "(ncclpy.init(device='cpu'): NCCL's semantics and order, not NCCL, no "
                        "GPU) vs torch's gloo and the reference; auto picks cpu under "
                        "NCCLPY_DEVICE=cpu (ncclpy run --cpu), else nccl when a GPU is "
                        "visible, else cpu where the CPU backend can run, else gloo")
    p.add_argument("--torch-backend", default=None, metavar="NAMES",
                   help=f"GPU: torch's NCCL backends to check, each against ncclpy and the "
                        f"reference (comma list of {', '.join(TB.TORCH_NCCL_BACKENDS)}; default "
                        f"{TB.DEFAULT}); torch 2.15's nccl is a new implementation and "
                        f"nccl-legacy its previous one: --torch-backend nccl,nccl-legacy")
    p.add_argument("--collectives", default=None,
                   help=f"comma list (default all: {','.join(C.COLLECTIVES)})")
    p.add_argument("--dtypes", default=None, help="comma list of names or the matrix's short "
                                                  "names (float32 or f32, int8 or i8, bf16, c64, "
                                                  "...; default: every dtype the backend supports)")
    p.add_argument("--ops", default=None,
                   help=f"comma list of {','.join(C.REDUCING_OPS)}; without --collectives only "
                        f"the reducing collectives run (data movement has no op)")
    p.add_argument("--sizes", default=None,
                   help=f"comma list of element counts or byte sizes with a unit (default gloo "
                        f"{C.DEFAULT_SIZES_CPU}; cpu {C.DEFAULT_SIZES_CPU_BACKEND}; GPU "
                        f"{C.DEFAULT_SIZES_GPU}); sizes whose largest case cannot fit in this "
                        f"machine's memory are refused before the run")
    p.add_argument("--inputs", default=None, metavar="KINDS",
                   help=f"comma list of {', '.join(C.INPUT_KINDS)}: verifiable inputs (every "
                        f"order gives the same bits), seeded normals, NCCL-order-revealing "
                        f"inputs (the last two for float sums of all_reduce, reduce and "
                        f"reduce_scatter); default: all three where ncclpy runs (nccl, cpu), "
                        f"verifiable on gloo")
    p.add_argument("--roots", default=None, help="comma list of roots (default 0 and n-1)")
    p.add_argument("--inplace", choices=("both", "yes", "no", "auto"), default="auto",
                   help="in-place variants (auto: where they differ for the side tested)")
    p.add_argument("--premul-scalar", type=_finite, default=C.PREMUL_SCALAR, metavar="X",
                   help="premul_sum factor (any finite value: the inputs keep results exact)")
    p.add_argument("--seed", type=_seed, default=1234, help="input seed (per rank and case)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write every case as JSON ('-': stdout, the report then goes to "
                        "stderr); the file's directory must exist; its schema is "
                        "ncclpy/check/schema.json")
    p.add_argument("--require-ncclpy", action="store_true",
                   help="fail (exit 1) unless ncclpy itself ran every case: without it a machine "
                        "with no GPU checks only torch (gloo) against the reference, and says so")
    p.add_argument("--nvls", action="store_true", help="allow NVLS (do not pin NCCL_NVLS_ENABLE=0)")
    p.add_argument("--window", action="store_true",
                   help="run ncclpy's side of all_reduce, reduce, broadcast, all_gather, "
                        "reduce_scatter and all_to_all on symmetric windows (NCCL memory, "
                        "ncclCommWindowRegister; NCCL >= 2.27): its symmetric kernels bit for "
                        "bit against torch and the reference (--backend nccl)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no matrix: only what did not pass and the summary (with -v: only the "
                        "rows of cases that did not pass)")
    p.add_argument("--timeout", type=_seconds(0.0, True, "seconds > 0"), default=300.0,
                   help="seconds any one collective, init or wait may take (default 300)")
    p.add_argument("--run-timeout", type=_seconds(0.0, False, "seconds >= 0"), default=3600.0,
                   help="seconds the whole run may take when check starts the ranks itself "
                        "(default 3600; 0: no limit)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--list-skips", action="store_true",
                   help="list what the backend cannot run (with reasons) and exit")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the full table (one row per case, as it runs) and the "
                        "tracebacks of errors")
    return p


def _csv(s: Optional[str]) -> Optional[List[str]]:
    return None if s is None else [t.strip() for t in s.split(",") if t.strip()]


def _gpu_available() -> Tuple[bool, str]:
    """(a GPU is visible, why not): the reason in the words of ``ncclpy info``."""
    try:
        from ..launch.placement import visible_gpu_count
        n = visible_gpu_count()
    except Exception as e:  # noqa: BLE001
        return False, f"cannot count GPUs: {e}"
    if n >= 1:
        return True, ""
    try:
        from ..info import gpu_device_reason
        why = gpu_device_reason()
    except Exception:  # noqa: BLE001 - the count already said no
        why = ""
    return False, why or "no CUDA GPU visible"


def _names(parser: OneLineParser, dest: str, text: Optional[str], what: str,
           canon: Any, allowed: Sequence[str]) -> Optional[List[str]]:
    """A checked comma list of ``--dest`` (None: not given)."""
    items = _csv(text)
    if items is None:
        return None
    flag = parser.flag(dest)
    if not items:
        parser.error(f"{flag}: no {what} given; expected a comma list of {', '.join(allowed)}")
    out = []
    for it in items:
        try:
            name = canon(it)
        except (ArgumentError, ArgumentTypeError, KeyError) as e:
            parser.error(f"{flag}: {e}")
        if name not in allowed:
            article = "an" if what[0] in "aeiou" else "a"
            parser.error(f"{flag}: {it!r} is not {article} {what} of ncclpy check; expected one of "
                         f"{', '.join(allowed)}")
        out.append(name)
    return out


def _roots(parser: OneLineParser, text: Optional[str], n: int) -> Optional[List[int]]:
    items = _csv(text)
    if items is None:
        return None
    flag = parser.flag("roots")
    if not items:
        parser.error(f"{flag}: no root given; expected a comma list of ranks in 0..{n - 1}")
    out = []
    for it in items:
        try:
            r = int(it)
        except ValueError:
            parser.error(f"{flag}: {it!r} is not a rank; expected a comma list of ranks in "
                         f"0..{n - 1}")
        if not 0 <= r < n:
            parser.error(f"{flag}: {r} is not a rank of this run; expected ranks in 0..{n - 1} "
                         f"({plural(n, 'rank')})")
        out.append(r)
    return out


def _torch_backends(parser: OneLineParser, ns: argparse.Namespace, backend: str,
                    why: str) -> Optional[List[str]]:
    """The checked ``--torch-backend`` list (default: torch's ``nccl`` on a GPU run; None on
    gloo): names torch's NCCL backends, each one this torch offers, on a GPU run."""
    text = ns.torch_backend
    if text is None:
        return [TB.DEFAULT] if backend == "nccl" else None
    flag = parser.flag("torch_backend")
    try:
        names = TB.parse_torch_backends(text)
    except ValueError as e:
        parser.error(f"{flag}: {e}")
    if backend == "cpu":            # the run's choice first: its torch side is gloo
        from ..cpu.backend import wants_cpu
        chosen = "--backend cpu" if ns.backend == "cpu" else (
            "NCCLPY_DEVICE=cpu" if wants_cpu(None) else f"no GPU: {why}")
        parser.error(f"{flag} {text}: torch's NCCL backends run on a GPU (--backend nccl); "
                     f"this run's backend is cpu ({chosen}), whose torch side is gloo")
    version, offered = TB.offered_backends()
    bad = TB.refusal(names, version, offered)
    if bad:
        parser.error(f"{flag} {text}: {bad}")
    if backend != "nccl":
        because = f"--backend {ns.backend}" if ns.backend != "auto" else (why or "no GPU")
        parser.error(f"{flag} {text}: torch's NCCL backends run on a GPU (--backend nccl); "
                     f"this run's backend is {backend} ({because}), whose torch side is gloo")
    return names


def _config(parser: OneLineParser, ns: argparse.Namespace, n: int, backend: str,
            no_gpu: str) -> Dict[str, Any]:
    """The run's configuration, every list argument checked (one-line errors)."""
    from ..semantics import registry
    from ..semantics.dtypes import dtype_name
    from .session import verdict_batch
    ops = _names(parser, "ops", ns.ops, "op", lambda s: s.lower(), C.REDUCING_OPS)
    sizes = ns.sizes
    if sizes is not None:
        try:
            C.parse_sizes(sizes)
        except ArgumentError as e:
            msg = str(e)
            msg = msg[len("--sizes: "):] if msg.startswith("--sizes: ") else msg
            parser.error(f"{parser.flag('sizes')}: {msg}")
    inplace = {"both": [False, True], "yes": [True], "no": [False], "auto": None}[ns.inplace]
    inputs = None
    if ns.inputs is not None:
        try:
            inputs = list(C.parse_inputs(ns.inputs))
        except ArgumentError as e:
            parser.error(f"{parser.flag('inputs')}: {str(e)[len('--inputs: '):]}")
    cfg: Dict[str, Any] = {
        "world_size": n, "backend": backend,
        "collectives": _names(parser, "collectives", ns.collectives, "collective",
                              lambda s: registry.get(s).name, C.COLLECTIVES),
        "dtypes": _names(parser, "dtypes", ns.dtypes, "dtype", dtype_name, C.ALL_DTYPES),
        "ops": ops, "sizes": sizes, "roots": _roots(parser, ns.roots, n), "inputs": inputs,
        "in_place": inplace, "premul_scalar": ns.premul_scalar, "seed": ns.seed,
        "json": os.path.abspath(ns.json) if ns.json and ns.json != "-" else ns.json,
        "quiet": ns.quiet, "timeout": ns.timeout, "verbose": ns.verbose,
        "run_timeout": ns.run_timeout, "require_ncclpy": ns.require_ncclpy,
        "no_gpu_reason": no_gpu, "env": {}, "pinned": [], "kept": [],
        "window": bool(getattr(ns, "window", False)), "verdict_batch": verdict_batch()}
    if cfg["window"] and backend != "nccl":
        parser.error(f"{parser.flag('window')}: needs --backend nccl (windows are NCCL "
                     f"memory on a GPU); this run's backend is {backend}"
                     + (f" ({no_gpu})" if no_gpu else ""))
    if backend == "nccl":
        cfg["env"], cfg["pinned"], cfg["kept"] = fairness_env(ns.nvls)
    return cfg


def _list(cfg: Dict[str, Any], skips: bool) -> int:
    cases, skipped = C.build_matrix(
        cfg["world_size"], backend=cfg["backend"], collectives=cfg["collectives"],
        dtypes=cfg["dtypes"], ops=cfg["ops"], sizes=cfg["sizes"], roots=cfg["roots"],
        in_place=cfg["in_place"], premul_scalar=cfg["premul_scalar"], inputs=cfg["inputs"])
    if skips:
        for s in skipped:
            print(f"{s['collective']:<14} {s['dtype'] or '-':<11} {s['op'] or '-':<10} "
                  f"{s['reason']}")
        print(f"{plural(len(skipped), 'combination')} skipped on {cfg['backend']}")
        return 0
    for c in cases:
        print(c.key)
    print(f"{plural(len(cases), 'case')} on {plural(cfg['world_size'], 'rank')} "
          f"({cfg['backend']})")
    return 0


def _spawn(n: int, cfg: Dict[str, Any]) -> int:
    """Start n ranks; rank 0 reports the exit code through a file."""
    from ..launch.spawn import spawn
    from .session import spawn_entry
    fd, path = tempfile.mkstemp(prefix="ncclpy-check-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cfg = dict(cfg, result_file=path)
    try:
        try:
            spawn(spawn_entry, n, args=(cfg,), env=cfg.get("env") or None,
                  timeout=cfg.get("run_timeout") or None)
        except Exception as e:  # noqa: BLE001 - a crashed rank: say which and why
            if _result(path).get("output_closed"):     # rank 0 lost its reader: quiet
                silence_stdout()
                return EXIT_CLOSED_PIPE
            print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
            tb = getattr(e, "traceback", None)
            if tb:
                print(tb, file=sys.stderr)
            return 2
        res = _result(path)
        if "exit_code" not in res:
            print(f"{PROG}: rank 0 reported no result", file=sys.stderr)
            return 2
        return int(res["exit_code"])
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _result(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError, TypeError):
        return {}


def _main(argv: List[str]) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    job = _launched_job(ns)
    n = ns.nprocs if ns.nprocs is not None else (job.world_size if job else 2)
    if job is not None and job.world_size != n:
        parser.error(f"{parser.flag('nprocs')} {n} disagrees with "
                     f"WORLD_SIZE={os.environ['WORLD_SIZE']} set by the launcher")
    if ns.json and ns.json != "-":
        why = check_output_path(ns.json)
        if why:
            parser.error(f"{parser.flag('json')}: {why}")
    gpu, why = _gpu_available()
    backend, no_cpu = (ns.backend, "") if ns.backend != "auto" else _auto_backend(gpu)
    if no_cpu:
        why = f"{why}; {no_cpu}"
    if backend == "nccl" and not gpu:
        parser.error(f"{parser.flag('backend')} nccl: {why}")
    if backend == "cpu" and not (ns.list or ns.list_skips):
        from .cpu_side import unavailable
        cpu_why = unavailable()
        if cpu_why:
            parser.error(f"{parser.flag('backend')} cpu: {cpu_why}")
    if ns.require_ncclpy and backend == "gloo":
        if ns.backend == "gloo":
            parser.error(f"{parser.flag('require_ncclpy')} with {parser.flag('backend')} gloo: "
                         f"the gloo run never runs ncclpy; expected --backend nccl, cpu or auto")
        if not (ns.list or ns.list_skips):
            sys.stderr.write(f"{PROG}: FAILED: {parser.flag('require_ncclpy')}: ncclpy cannot run "
                             f"on this machine ({why}); nothing was run\n")
            return 1
    torch_backends = _torch_backends(parser, ns, backend, why)
    cfg = _config(parser, ns, n, backend,
                  "" if backend in ("nccl", "cpu") else (why or "backend gloo"))
    cfg["torch_backends"] = torch_backends
    if ns.list or ns.list_skips:
        return _list(cfg, ns.list_skips)
    cases, skipped = C.build_matrix(
        n, backend=backend, collectives=cfg["collectives"], dtypes=cfg["dtypes"],
        ops=cfg["ops"], sizes=cfg["sizes"], roots=cfg["roots"], in_place=cfg["in_place"],
        premul_scalar=cfg["premul_scalar"], inputs=cfg["inputs"])
    if not cases:
        sys.stderr.write(f"{PROG}: no case to run: the filters leave nothing the {backend} "
                         f"backend can run on {plural(n, 'rank')} "
                         f"({plural(len(skipped), 'combination')} skipped; see --list-skips)\n")
        return 2
    _refuse_what_cannot_fit(parser, ns, cases, n, backend, job)
    if job is not None:
        from .launched import store_problem
        why = store_problem(job)
        if why:
            sys.stderr.write(f"{PROG}: error: {why}\n")
            return 2
        from .session import worker
        if backend == "nccl":
            cfg["placement"] = apply_launcher_placement()
        cfg["launched"] = job.to_cfg()
        return worker(job.rank, cfg)
    return _spawn(n, cfg)


def _auto_backend(gpu: bool) -> Tuple[str, str]:
    """``--backend auto``: (backend, why not cpu where it is gloo): cpu where the environment
    asks for ncclpy's CPU backend (``NCCLPY_DEVICE=cpu``, as ``ncclpy run --cpu`` sets it),
    else nccl with a GPU, else cpu where the CPU backend can run here, else gloo."""
    from ..cpu.backend import wants_cpu
    if wants_cpu(None):
        return "cpu", ""
    if gpu:
        return "nccl", ""
    from .cpu_side import unavailable
    why = unavailable()
    return ("gloo", why) if why else ("cpu", "")


def _refuse_what_cannot_fit(parser: OneLineParser, ns: argparse.Namespace, cases: List[Any],
                            n: int, backend: str, job: Any) -> None:
    """A usage error (one line naming --sizes as typed) when the largest case needs more
    memory than this machine has (:mod:`ncclpy.check.memory`), before any rank starts."""
    from .memory import check_memory
    local = n
    if job is not None:         # under a launcher: the ranks on this host
        text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        local = min(int(text), n) if text.isdigit() and int(text) >= 1 else n
    value = ns.sizes if ns.sizes is not None else f"(default {C.default_sizes(backend)})"
    why = check_memory(cases, n, backend, parser.flag("sizes"), value, local)
    if why:
        parser.error(why)


def _launched_job(ns: argparse.Namespace) -> Any:
    """The launched job RANK/WORLD_SIZE name (None: none, check starts its ranks); said at
    once on stderr, before anything waits (a leftover environment waited silently)."""
    from .launched import announce, from_env
    try:
        job = from_env(os.environ)
    except ValueError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        raise SystemExit(2) from None
    if job is not None and not (ns.list or ns.list_skips):
        sys.stderr.write(announce(job, ns.timeout) + "\n")
        sys.stderr.flush()
    return job


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ncclpy check`` with ``argv``; the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_main(PROG, lambda: _main(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
