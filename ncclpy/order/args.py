"""The ``ncclpy order`` command line's flags and the checked :class:`OrderConfig` they describe
(shared by the prediction, :mod:`ncclpy.order.cli`, and the GPU run, :mod:`ncclpy.order.observe`).
Usage errors are one line naming the flag as typed (exit status 2)."""
from __future__ import annotations

import argparse
import os
from typing import Any, List, Sequence

from ..cli_util import OneLineParser, int_at_least
from .config import DEFAULT_VERSION, OPS, OrderConfig
from .pins import c_strtoll
from .split import ALGOS, COLLECTIVES, PROTOS
from .versions import parse_version

__all__ = ["PROG", "build_parser", "config_from_args", "c_strtoll"]

PROG = "ncclpy order"
_BUFF_ENV = {"simple": "NCCL_BUFFSIZE", "ll": "NCCL_LL_BUFFSIZE", "ll128": "NCCL_LL128_BUFFSIZE"}
#: the first paragraph of ncclpy.order.cli's docstring, for -h
_DESCRIPTION = ("ncclpy order: the order in which NCCL folds the ranks' contributions, "
                "without a GPU.")


def _count(text: str) -> int:
    from ..plan.cli import parse_count
    return parse_count(text)


def _version(text: str) -> int:
    try:
        return parse_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ring(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks in ring order such as 0,2,1,3, got "
                                         f"{text!r}") from None


def _choice(options: Sequence[str], what: str) -> Any:
    def parse(text: str) -> str:
        key = text.strip().lower().replace("-", "_")
        for o in options:
            if key in (o, o.replace("_", "")):
                return o
        raise argparse.ArgumentTypeError(f"expected {what} ({', '.join(options)}), got "
                                         f"{text!r}")
    return parse


def _collective(text: str) -> str:
    key = text.strip()
    if key.lower().startswith("nccl"):
        key = key[4:]
    key = key.lower().replace("-", "_")
    if key.endswith("_perf"):
        key = key[:-5]
    for c in COLLECTIVES:
        if key in (c, c.replace("_", "")):
            return c
    raise argparse.ArgumentTypeError(
        f"the model covers {', '.join(COLLECTIVES)} (the reductions; the other collectives "
        f"move data without adding), got {text!r}")


def build_parser() -> OneLineParser:
    """The ``ncclpy order`` parser."""
    p = OneLineParser(prog=PROG, description=_DESCRIPTION)
    p.add_argument("collective", type=_collective, nargs="?", default=None,
                   help=f"one of {', '.join(COLLECTIVES)} (ncclAllReduce and nccl-tests "
                        f"names work too); not with --observe --matrix")
    p.add_argument("--ranks", "-n", type=int_at_least(1, "a number of ranks >= 1"),
                   default=None, metavar="N", help="world size")
    p.add_argument("--count", type=_count, default=None, metavar="C",
                   help="NCCL's count (reduce_scatter: each rank's output); K/M/G = 1024^k")
    p.add_argument("--dtype", default="float32",
                   help="float32/f32, bfloat16/bf16, float16/f16, float64, float8_e4m3, "
                        "float8_e5m2 or an integer type (default float32)")
    p.add_argument("--op", default="sum",
                   help=f"{', '.join(OPS[:-1])} or premul_sum:X (default sum)")
    p.add_argument("--root", type=int_at_least(0, "a rank >= 0"), default=0,
                   help="reduce's root (default 0)")
    p.add_argument("--algo", type=_choice(ALGOS, "an algorithm the model covers"),
                   default="ring", help="ring or tree (NCCL_ALGO; default ring)")
    p.add_argument("--proto", type=_choice(PROTOS, "an NCCL protocol"), default="simple",
                   help="ll, ll128 or simple (NCCL_PROTO; default simple)")
    p.add_argument("--channels", type=int_at_least(1, "a channel count >= 1"), default=1,
                   metavar="K", help="the communicator's channels (NCCL_MIN_NCHANNELS = "
                                     "NCCL_MAX_NCHANNELS = K; default 1)")
    p.add_argument("--ring", type=_ring, default=None, metavar="R0,R1,...",
                   help="channel 0's ring, ranks in ring order (every channel, as one search "
                        "channel copied; default 0,1,...,N-1)")
    p.add_argument("--nccl-version", type=_version, default=None, metavar="X.Y.Z",
                   help="the NCCL whose code to follow (default 2.28.9)")
    for proto, env in _BUFF_ENV.items():
        flag = "--buffsize" if proto == "simple" else f"--{proto}-buffsize"
        p.add_argument(flag, dest=f"buff_{proto}", type=int_at_least(1, "bytes >= 1"),
                       default=None, metavar="BYTES",
                       help=f"{env} (default: ${env} if set, else NCCL's default)")
    p.add_argument("--nthreads", type=int_at_least(32, "threads >= 32"), default=None,
                   metavar="N", help="NCCL's thread count for --algo/--proto (the 'Max "
                   "NThreads' row NCCL prints under NCCL_DEBUG_SUBSYS=TUNING; it decides how "
                   "many channels a small call uses). Default 512 (640 for LL128); NCCL uses "
                   "256 for Ring/Simple where the ring's bandwidth is at most PCI's")
    p.add_argument("--rank", type=int_at_least(0, "a rank >= 0"), default=None,
                   help="whose output to show (reduce_scatter; default rank 0, reduce: the "
                        "root)")
    p.add_argument("--element", type=int_at_least(0, "an element index >= 0"), nargs="+",
                   action="extend", default=None, metavar="E",
                   help="print the fold of these output elements")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", default=None, metavar="SIZES",
                   help="instead of --count: the sizes at which the channels, the chunking and "
                        "the folds change, for bytes per rank as nccl-tests counts them "
                        "(reduce_scatter: each rank's input): a list 1K,64K,4M or a range "
                        "8..256M (doubling, nccl-tests' -b 8 -e 256M -f 2) or 8..256M:4 (times "
                        "4); K/M/G are powers of 1024; the exact counts between two sizes where "
                        "the tuned channel count changes or a second loop begins are found by "
                        "bisection; --element E adds E's fold")
    p.add_argument("--observe", action="store_true",
                   help="run on a GPU with order-revealing inputs and judge NCCL's bits "
                        "(under ncclpy run, or spawning --ranks ranks)")
    p.add_argument("--matrix", default=None, metavar="NAME",
                   help="with --observe: a named set of configurations ('proof': the GPU "
                        "proof's) instead of the one the flags give")
    p.add_argument("--timeout", type=int_at_least(10, "seconds >= 10"), default=None,
                   metavar="S", help="with --observe: stop after S seconds (the rest is "
                                     "reported NOT_RUN; default: each job 200 s)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="with --observe: keep NCCL's logs and the JSON report here")
    return p


def _op(p: OneLineParser, text: str) -> tuple:
    t = text.strip().lower()
    if t.startswith("premul_sum:") or t.startswith("premulsum:"):
        try:
            return "premul_sum", float(t.split(":", 1)[1])
        except ValueError:
            p.error(f"{p.flag('op')}: expected premul_sum:X with a number X, got {text!r}")
    if t in OPS and t != "premul_sum":
        return t, None
    p.error(f"{p.flag('op')}: expected one of {', '.join(OPS[:-1])} or premul_sum:X, got "
            f"{text!r}")
    raise AssertionError  # p.error exits


def config_from_args(p: OneLineParser, ns: argparse.Namespace) -> OrderConfig:
    """The checked config the flags describe (usage errors name the flag)."""
    from ..semantics.dtypes import DTYPES, dtype_name
    from ..errors import NcclpyError
    if ns.ranks is None:
        p.error("--ranks: required (the world size)")
    if ns.count is None:
        p.error("--count: required (NCCL's count of elements)")
    try:
        dtype = dtype_name(ns.dtype)
    except NcclpyError as e:
        p.error(f"{p.flag('dtype')}: {e}")
    if dtype not in DTYPES:
        p.error(f"{p.flag('dtype')}: {dtype} travels through NCCL as another type; give one of "
                f"NCCL's: {', '.join(DTYPES)}")
    op, scalar = _op(p, ns.op)
    buffs = {}
    for proto, env in _BUFF_ENV.items():
        val = getattr(ns, f"buff_{proto}")
        if val is None and os.environ.get(env):
            val, why = c_strtoll(os.environ[env])
            if why:
                p.error(f"${env}: NCCL reads {os.environ[env]!r} with strtoll as {val} "
                        f"({why}); set bytes as a plain integer")
        if val is not None:
            buffs[proto] = val
    threads = {(ns.algo, ns.proto): ns.nthreads} if ns.nthreads else None
    try:
        return OrderConfig.make(ns.collective, ns.ranks, ns.count, dtype=dtype, algo=ns.algo,
                                proto=ns.proto, op=op, scalar=scalar, root=ns.root,
                                version=ns.nccl_version or DEFAULT_VERSION, channels=ns.channels,
                                ring=ns.ring, buffsizes=buffs, max_threads=threads)
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        flag = {"nranks": "ranks", "ring": "ring", "root": "root", "channels": "channels",
                "count": "count", "dtype": "dtype", "op": "op", "scalar": "op",
                "max_threads": "nthreads"}.get(field)
        p.error(f"{p.flag(flag)}: {str(e).split(':', 1)[1].strip()}" if flag else str(e))
    raise AssertionError


