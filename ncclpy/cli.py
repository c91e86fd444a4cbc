"""The ``ncclpy`` command line: ``run`` (launcher), ``info`` (environment report), ``check``,
``plan`` (the NCCL calls of one call, without a GPU), ``order`` (the order NCCL adds in), ``trace``
(what went wrong, from the flight-recorder dumps), ``status`` (where every rank of a running job
is), ``bench`` (the nccl-tests-style sweep of ``python -m bench``, from any directory).

``main(argv)`` returns the exit code; the console script and ``python -m ncclpy`` call it.
Subcommand modules are imported lazily so ``ncclpy info`` works even where a colleague module
(``ncclpy.check``) is missing or broken.  Usage errors are one line naming the flag as typed
(exit status 2); Ctrl-C ends a command with one line and exit status 130, a closed output pipe
(``ncclpy info | head -3``) quietly with 141 (:mod:`ncclpy.cli_util`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import List, Optional, Sequence

from .cli_util import OneLineParser, run_cli

__all__ = ["main", "build_parser", "bench_package"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with the ``run``, ``info`` and ``check`` subcommands."""
    from ._version import __version__
    from .launch.runcli import add_run_arguments

    p = OneLineParser(
        prog="ncclpy", description="ncclpy: a Python layer over NVIDIA NCCL.")
    p.add_argument("--version", action="version", version=f"ncclpy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run", help="start N ranks with the rendezvous environment (like torchrun)",
        description="Start N local ranks of PROGRAM with the ncclpy/torchrun rendezvous "
                    "environment; rank-prefixed output, SIGINT/SIGTERM forwarding, fail-fast. "
                    "Without a GPU: ncclpy run --cpu -n 4 python x.py (the CPU backend).")
    add_run_arguments(run)
    info = sub.add_parser("info", help="report ncclpy, CuPy, NCCL, CUDA, GPUs and environment",
                          description="Report versions, the libnccl loaded, CUDA, visible GPUs "
                                      "and the NCCL_*/rendezvous variables in force.")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument("--torch", action="store_true",
                      help="also import torch and report its CUDA and NCCL versions")
    info.add_argument("--all-ranks", "--all_ranks", dest="all_ranks", action="store_true",
                      help="under a launcher (ncclpy run, torchrun, mpirun, srun): compare every "
                           "rank's NCCL, versions and NCCL_* settings; rank 0 prints the "
                           "differences (exit 1 when one changes NCCL's behaviour)")
    info.add_argument("--params", action="store_true",
                      help="print NCCL's effective parameters (its parameter API, NCCL >= "
                           "2.30.4; no GPU needed): NAME = value, as NCCL resolved them")
    sub.add_parser("check", help="cross-check ncclpy against references (see 'ncclpy check -h')",
                   add_help=False)
    sub.add_parser("order", help="the order in which NCCL adds the ranks' contributions, "
                                 "predicted from NCCL's source (see 'ncclpy order -h')",
                   add_help=False)
    sub.add_parser("plan", help="print the exact NCCL calls each rank would make for one call, "
                                "without a GPU (see 'ncclpy plan -h')", add_help=False)
    sub.add_parser("trace", help="say what went wrong from the ranks' flight-recorder dumps "
                                 "(see 'ncclpy trace -h')", add_help=False)
    sub.add_parser("status", help="where is every rank of a running job, now (see "
                                  "'ncclpy status -h')", add_help=False)
    sub.add_parser("bench", help="nccl-tests-style collective benchmark, python -m bench's "
                                 "(see 'ncclpy bench -h')", add_help=False)
    p.subs = {"run": run, "info": info}  # type: ignore[attr-defined]
    return p


def _check(argv: Sequence[str]) -> int:
    try:
        mod = importlib.import_module("ncclpy.check.cli")
    except ImportError as e:
        print(f"ncclpy check: not available in this installation "
              f"(could not import ncclpy.check.cli: {e})", file=sys.stderr)
        return 2
    rc = mod.main(list(argv))
    return int(rc or 0)


def bench_package() -> str:
    """The bench's package name: ``bench`` where ncclpy runs from a checkout whose bench/
    folder is importable as ``bench`` (the repository's own, found without importing anything
    else of that name), else ``ncclpy_bench``, the name pip installs it under (so that a user's
    own ``bench`` package never clashes with ncclpy's)."""
    import importlib.util
    import os
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        spec = importlib.util.find_spec("bench")
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    if origin and os.path.dirname(os.path.abspath(origin)) == os.path.join(checkout, "bench"):
        return "bench"
    return "ncclpy_bench"


def _bench(argv: Sequence[str]) -> int:
    """``ncclpy bench ...``: the bench's command line (``python -m bench`` in a checkout,
    ``python -m ncclpy_bench`` installed: :func:`bench_package`), named ``ncclpy bench`` in its
    messages."""
    name = f"{bench_package()}.cli"
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        print(f"ncclpy bench: not available in this installation "
              f"(could not import {name}: {e})", file=sys.stderr)
        return 2
    return int(mod.main(list(argv), prog="ncclpy bench") or 0)


def _info_all_ranks(as_json: bool) -> int:
    """``ncclpy info --all-ranks``: rank 0 prints the comparison; 0 (the ranks agree, or
    differ only in what is noted), 1 (a behaviour difference), 2 (one line: not under a
    launcher, or the store failed)."""
    import dataclasses
    from .debug.agree import compare_all_ranks
    from .errors import RendezvousError, StoreError
    prog = "ncclpy info --all-ranks"
    try:
        rank, world, cmp = compare_all_ranks()
    except RendezvousError as e:
        first = str(e).split(" - ")[0].split(":")[0]
        print(f"{prog}: not under a launcher ({first}: no rank, world size or store address "
              f"in the environment); start it with 'ncclpy run -n N -m ncclpy info "
              f"--all-ranks' (or torchrun, mpirun, srun)", file=sys.stderr)
        return 2
    except (StoreError, OSError) as e:
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if rank == 0:
        if as_json:
            print(json.dumps({"world_size": world, **dataclasses.asdict(cmp)}, indent=1))
        else:
            print(f"{prog}: {world} ranks compared")
            print(cmp.text(world))
    return 1 if cmp.errors else 0


def _info_params(as_json: bool) -> int:
    """``ncclpy info --params``: NCCL's parameters (0), or one line why not (2).  A value NCCL
    cannot give is said as what it is ("not set", a refused environment value); the footer
    says what the list holds and what NCCL_PARAM_DUMP_ALL=true adds."""
    from ._nccl.params import has_param_api, param_rows, private_keys
    from .errors import MissingDependencyError, NcclError, VersionError
    from .semantics.ops import format_version
    try:
        from ._nccl.lib import get_lib
        lib = get_lib()
        if not has_param_api(lib):
            raise VersionError(f"the loaded NCCL {format_version(lib.version)} ({lib.path}) has "
                               f"no parameter API; it needs NCCL >= 2.30.4")
        rows = param_rows(lib=lib)
        private = private_keys(lib=lib)
    except (MissingDependencyError, VersionError, NcclError) as e:
        print(f"ncclpy info --params: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({r.key: r.value for r in rows}, indent=1))
        return 0
    width = max((len(r.key) for r in rows), default=0)
    for r in rows:
        print(f"{r.key:<{width}} = {r.shown}")
    what = (f"{len(rows)} parameters, published and private (NCCL_PARAM_DUMP_ALL is set),"
            if private is None else f"{len(rows)} published parameters")
    more = ("" if private is None else
            f"; NCCL_PARAM_DUMP_ALL=true adds its {len(private)} private one"
            f"{'s' if len(private) != 1 else ''}" + (f": {', '.join(private)}" if private else ""))
    print(f"# {what} of the parameter registry of NCCL {format_version(lib.version)} "
          f"({lib.path}){more}")
    print("# NCCL reads its other NCCL_* variables (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) outside "
          "this registry: 'ncclpy info' lists those set")
    return 0


def _info(ns: argparse.Namespace) -> int:
    if ns.all_ranks and ns.params:
        print("ncclpy info: --params and --all-ranks are separate reports: give one (the "
              "all-ranks comparison includes NCCL's parameters)", file=sys.stderr)
        return 2
    if ns.all_ranks:
        return _info_all_ranks(ns.json)
    if ns.params:
        return _info_params(ns.json)
    from .info import collect, format_info
    d = collect(import_torch=ns.torch)
    if ns.json:
        print(json.dumps(d, indent=2, sort_keys=False, default=str))
    else:
        print(format_info(d))
    return 0


def _main(argv: List[str]) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:        # named by the subcommand that got them: 'ncclpy info: error: ...'
        sub = getattr(parser, "subs", {}).get(ns.command, parser)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command == "run":
        from .launch.runcli import run_from_args
        return run_from_args(ns, parser=parser)
    if ns.command == "info":
        return _info(ns)
    parser.print_help(sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``ncclpy`` command line with ``argv`` (default ``sys.argv[1:]``); the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":   # pass everything through untouched
        return _check(argv[1:])        # (ncclpy check handles Ctrl-C and closed pipes itself)
    if argv and argv[0] == "plan":
        from .plan.cli import main as plan_main
        return plan_main(argv[1:])
    if argv and argv[0] == "order":
        from .order.cli import main as order_main
        return order_main(argv[1:])
    if argv and argv[0] == "trace":
        from .debug.tracecli import main as trace_main
        return trace_main(argv[1:])
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "status":
        from .debug.statuscli import main as status_main
        return status_main(argv[1:])
    prog = f"ncclpy {argv[0]}" if argv and argv[0] in ("run", "info") else "ncclpy"
    return run_cli(prog, lambda: _main(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
