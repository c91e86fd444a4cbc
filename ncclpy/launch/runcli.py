"""``ncclpy run``'s command line: its options (torchrun's names where the concept is the same)
and the call of :func:`ncclpy.launch.launcher.launch` with the flags as the user typed them.

Usage errors exit :data:`~ncclpy.launch.launcher.EXIT_USAGE` (2) with one line naming the flag.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..cli_util import EXIT_CLOSED_PIPE
from ..errors import ArgumentError, LaunchError
from .launcher import _FLAGS, DEFAULT_GRACE, EXIT_TIMEOUT, EXIT_USAGE, build_command, launch
from .mps import MPS_ENV, MPS_MODES

__all__ = ["add_run_arguments", "run_from_args"]


def _timeout_seconds(text: str) -> float:
    """``--timeout``'s value: seconds > 0 (finite); no limit is the flag left out."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r} (expected seconds > 0; "
                                         f"for no limit, leave --timeout out)") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r} (for no limit, "
                                         f"leave --timeout out)")
    return v


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``ncclpy run``'s options to ``p`` (torchrun's names where the concept is the same)."""
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", "--nprocs", "--nproc",
                   dest="nproc",
                   type=int, required=True, metavar="N", help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   metavar="K", help="this node's index, 0..M-1 (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="H",
                   help="address of the store (rank 0); default 127.0.0.1 on one node")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   metavar="P", help="port of ncclpy's store, 1..65534 (torch's store gets P+1); "
                                     "default: a free port on one node")
    p.add_argument("--ranks-per-gpu", "--ranks_per_gpu", dest="ranks_per_gpu", type=int,
                   default=None, metavar="R",
                   help="share each GPU among R ranks: N ranks use ceil(N/R) GPUs, rank r -> "
                        "GPU r mod ceil(N/R) (default: one rank per GPU while they suffice)")
    p.add_argument("--mps", choices=MPS_MODES, default=None,
                   help=f"CUDA MPS while ranks share a GPU: auto starts a daemon for the run when "
                        f"nvidia-cuda-mps-control is on PATH, on requires it, off never starts "
                        f"one (default: ${MPS_ENV}, else auto)")
    p.add_argument("--cpu", action="store_true",
                   help="run every rank on ncclpy's CPU backend (sets NCCLPY_DEVICE=cpu in each: "
                        "the same API on host buffers such as numpy arrays; no GPU used, not "
                        "NCCL); one machine only, so not with --nnodes > 1, --ranks-per-gpu or "
                        "--mps on.  NCCLPY_DEVICE=cpu already in this environment does the same")
    p.add_argument("--no-prefix", "--no_prefix", dest="no_prefix", action="store_true",
                   help="do not prefix output lines with '[rank R] '")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                   help=f"seconds between SIGTERM and SIGKILL when stopping ranks "
                        f"(default {DEFAULT_GRACE:g})")
    p.add_argument("--timeout", type=_timeout_seconds, default=None, metavar="SECONDS",
                   help=f"stop the job when ranks are still running SECONDS after the start; "
                        f"the summary names them; exit code {EXIT_TIMEOUT} (default: no limit)")
    p.add_argument("--checked", action="store_true",
                   help="checked mode in every rank (sets NCCLPY_CHECKED=1)")
    p.add_argument("--keep-going", "--keep_going", dest="keep_going", action="store_true",
                   help="a failed rank does not stop the others (its death is still published "
                        "for their watchdogs: recover with comm.shrink); the exit code is still "
                        "the first failure's")
    p.add_argument("-m", "--module", action="store_true",
                   help="PROGRAM is a Python module, run as 'python -m PROGRAM'")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM [ARGS...]",
                   help="the program (a *.py script runs with this Python) and its arguments")
    p.epilog = (f"exit codes: 0 every rank succeeded; a failed rank's code (128+N for signal N); "
                f"{EXIT_TIMEOUT} --timeout passed; 128+N when the launcher got signal N (SIGINT: "
                f"130); {EXIT_CLOSED_PIPE} its output's reader went away (| head): the ranks "
                f"were stopped; {EXIT_USAGE} a usage error")


def _typed(parser: Optional[argparse.ArgumentParser], key: str) -> str:
    """The flag of ``launch()`` keyword ``key`` as the user typed it (else its usual spelling)."""
    spelled = _FLAGS.get(key, key)
    argv = getattr(parser, "_argv", None)
    if not argv or not spelled.startswith("-"):
        return spelled
    from ..cli_util import typed_flag
    names = {"nproc": ["-n", "--nproc-per-node", "--nproc_per_node", "--nprocs", "--nproc"],
             "node_rank": ["--node-rank", "--node_rank"],
             "master_addr": ["--master-addr", "--master_addr"],
             "master_port": ["--master-port", "--master_port"],
             "ranks_per_gpu": ["--ranks-per-gpu", "--ranks_per_gpu"]}.get(key, [spelled])
    argv = list(argv)
    if "run" in argv:
        argv = argv[argv.index("run") + 1:]
    return typed_flag(names, argv) if any(
        a.split("=", 1)[0] in names or a.startswith(tuple(n for n in names if len(n) == 2))
        for a in argv) else spelled


def run_from_args(ns: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run ``ncclpy run`` from parsed arguments; usage errors exit 2 with one line naming the
    flag as typed."""
    flags = {k: _typed(parser, k) for k in _FLAGS}
    try:
        command = build_command(ns.program, ns.module)
        return launch(command, ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
                      master_addr=ns.master_addr, master_port=ns.master_port,
                      ranks_per_gpu=ns.ranks_per_gpu, prefix=not ns.no_prefix, grace=ns.grace,
                      mps=getattr(ns, "mps", None), timeout=getattr(ns, "timeout", None),
                      checked=bool(getattr(ns, "checked", False)),
                      keep_going=bool(getattr(ns, "keep_going", False)),
                      cpu=bool(getattr(ns, "cpu", False)), _flags=flags)
    except (ArgumentError, LaunchError) as e:
        text = " ".join(str(e).split())   # one line, as argparse's own errors
        sys.stderr.write(f"ncclpy run: error: {text}\n")
        return EXIT_USAGE
