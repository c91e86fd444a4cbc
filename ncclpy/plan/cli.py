"""``ncclpy plan``: the exact NCCL calls each rank would make for one call, without a GPU.

``ncclpy plan all_gather --count 1M --dtype bf16 -n 4`` plans the call for every rank with the
planners the communicator runs (:mod:`ncclpy.plan.explain`) and prints, per rank, the path
chosen and every step in order: ``ncclGroupStart``/``End``, each NCCL call with its arguments
in C order (pointers named after the buffers: ``sendbuf+0x400``), the device copies and the
scratch ncclpy allocates, the PreMulSum op it creates.  ``--list``: one line per step
(``rank<TAB>step<TAB>call``); ``--json FILE`` (``-``: stdout): the same as JSON.  The NCCL
version decides the path (native ncclGather/ncclScatter/ncclAlltoAll or grouped send/recv):
the loaded libnccl's, else ``--nccl-version``.  Usage errors: one line naming the flag, exit 2.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import List, Optional, Sequence

from ..cli_util import OneLineParser, check_output_path, int_at_least, run_main
from ..errors import NcclpyError
from . import explain as X

__all__ = ["main", "build_parser", "parse_count", "parse_version"]

PROG = "ncclpy plan"
_COUNT = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_count(text: str) -> int:
    """Elements: ``1024``, ``64K``, ``1M``, ``2G`` (powers of 1024, as nccl-tests' sizes)."""
    m = _COUNT.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number of elements such as 1024, 64K or "
                                         f"1M (K/M/G are powers of 1024), got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_version(text: str) -> int:
    """NCCL's version code from ``2.28.9`` / ``2.28`` / ``22809``."""
    t = text.strip()
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?$", t)
    if m:
        from .._nccl.lib import nccl_version_code
        return nccl_version_code(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    if t.isdigit() and int(t) >= 20000:
        return int(t)
    raise argparse.ArgumentTypeError(f"expected an NCCL version such as 2.28.9, got {text!r}")


def _ranks(text: str) -> List[int]:
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of ranks, got "
                                             f"{text!r}") from None
    return out


def build_parser() -> OneLineParser:
    """The ``ncclpy plan`` parser."""
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("collective", help=f"one of {', '.join(X.COLLECTIVES)} (nccl-tests stems "
                                      f"such as all_gather_perf and NCCL names such as "
                                      f"ncclAllGather work too; a barrier is NCCL's 1-element "
                                      f"float32 all_reduce, whatever --count/--dtype/--op)")
    p.add_argument("-n", "--nprocs", "--nproc", dest="nprocs",
                   type=int_at_least(1, "a number of ranks >= 1"), default=2, metavar="N",
                   help="world size (default 2)")
    p.add_argument("--count", type=parse_count, default=None, metavar="ELEMENTS",
                   help="NCCL's count: elements of each rank's block (all_gather's sendcount, "
                        "reduce_scatter's recvcount, all_to_all's per-peer count, gather/"
                        "scatter's block) or of the whole buffer (all_reduce, reduce, "
                        "broadcast, send_recv); K/M/G = 1024^k (default 1M)")
    p.add_argument("--dtype", default=None,
                   help="a name or short name: float32/f32, bfloat16/bf16, int8/i8, int64/i64, "
                        "complex64/c64, ... (torch's, nccl-tests' and ncclFloat32-style names "
                        "work too; default float32)")
    p.add_argument("--op", default=None,
                   help="sum, prod, max, min, avg or premul_sum:X (default sum)")
    p.add_argument("--root", type=int, default=0, help="root rank (default 0)")
    p.add_argument("--in-place", action="store_true",
                   help="plan the in-place form (the communicator's documented one)")
    p.add_argument("--rank", type=_ranks, default=None, metavar="R[,R...]",
                   help="only these ranks (default: every rank)")
    p.add_argument("--nccl-version", type=parse_version, default=None, metavar="X.Y.Z",
                   help="plan for this NCCL (default: the loaded libnccl's, else 2.32.3)")
    p.add_argument("--fallback", action="store_true",
                   help="force grouped send/recv where NCCL has a native call (what an older "
                        "NCCL gets)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--list", action="store_true",
                     help="one line per step: rank, step, call (tab-separated)")
    out.add_argument("--json", metavar="FILE", default=None,
                     help="write the plans as JSON ('-': stdout)")
    return p


def _loaded_version() -> Optional[int]:
    try:
        from .._nccl.lib import get_lib
        return int(get_lib().version)
    except Exception:  # noqa: BLE001 - no CuPy / libnccl here: the default is said
        return None


def _main(argv: List[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.json and ns.json != "-":
        why = check_output_path(ns.json)
        if why:
            p.error(f"{p.flag('json')}: {why}")
    version, source = ns.nccl_version, "--nccl-version"
    if version is None:
        version = _loaded_version()
        source = "the loaded libnccl"
        if version is None:
            version, source = 23203, "assumed: no libnccl here (--nccl-version to choose)"
    given = [f for f in ("count", "dtype", "op") if getattr(ns, f) is not None]
    count = (1 << 20) if ns.count is None else ns.count
    dtype = "float32" if ns.dtype is None else ns.dtype
    op = "sum" if ns.op is None else ns.op
    try:
        plans = X.rank_plans(ns.collective, ns.nprocs, count, dtype, op=op,
                             root=ns.root, in_place=ns.in_place, ranks=ns.rank,
                             nccl_version=version, force_fallback=ns.fallback,
                             version_note=f"the planned NCCL is {{}} ({_short(source)})")
    except NcclpyError as e:
        msg = str(e)
        for dest in ("rank", "root", "count", "dtype", "op", "collective"):
            if msg.startswith(f"{dest}: "):
                msg = msg[len(dest) + 2:]
                p.error(msg if dest == "collective" else f"{p.flag(dest)}: {msg}")
        p.error(msg)
    from ..semantics.dtypes import dtype_name
    from ..semantics.ops import format_version
    coll = plans[0].plan.collective
    if coll == "barrier":       # NCCL's 1-element float32 all_reduce, whatever was asked
        count, dtype, op = 1, "float32", "sum"
        what = "barrier (a 1-element float32 all_reduce)"
        if given:
            print(f"{PROG}: note: {', '.join(p.flag(f) for f in given)} do"
                  f"{'es' if len(given) == 1 else ''} not apply to a barrier (a 1-element "
                  f"float32 all_reduce)", file=sys.stderr)
    else:
        dtype = dtype_name(dtype)
        what = f"{coll} of {count} element{'s' if count != 1 else ''}, {dtype}"
    header = (f"ncclpy plan: {what}, {ns.nprocs} rank"
              f"{'s' if ns.nprocs != 1 else ''}; NCCL {format_version(version)} ({source}); "
              f"pointers named after made-up buffers, nothing runs")
    if ns.json:
        doc = X.plans_doc(plans, {"collective": coll, "count": count,
                                  "dtype": dtype, "op": op, "root": ns.root,
                                  "in_place": ns.in_place, "world_size": ns.nprocs,
                                  "nccl_version": version, "nccl_version_from": source,
                                  "fallback": ns.fallback})
        text = json.dumps(doc, indent=1)
        if ns.json == "-":
            print(text)
        else:
            with open(ns.json, "w") as f:
                f.write(text + "\n")
            print(f"{PROG}: wrote {ns.json}", file=sys.stderr)
        return 0
    lines = X.list_lines(plans) if ns.list else X.format_plans(plans, header)
    for ln in lines:
        print(ln)
    return 0


def _short(source: str) -> str:
    """The version's source for a refusal: ``--nccl-version``, the loaded libnccl, assumed."""
    return source.split(":")[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ncclpy plan``; the exit code (usage errors 2, Ctrl-C 130, closed pipe 141)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_main(PROG, lambda: _main(args))
