"""Command line of ``python -m bench``: nccl-tests' flags, plus ncclpy's launch and backend options.

The flags that mean the same as nccl-tests' have the same letters, long names, defaults and size
syntax (``K``/``M``/``G`` are powers of 1024), so an ``all_reduce_perf`` command line works with
``python -m bench all_reduce`` in front of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import Any, List, Optional, Sequence

from ncclpy.semantics import registry
from ncclpy.cli_util import (EXIT_CLOSED_PIPE, OneLineParser, check_output_path, run_main,
                             silence_stdout, stdout_reader_gone)
from ncclpy.semantics.dtypes import DTYPES, SHORT_NAMES, TESTS_NAMES, dtype_name
from ncclpy.errors import ArgumentError, NcclpyError

from .combos import add_combo_flags, check_combo_flags
from .config import SweepConfig
from .nccl_tests_flags import add_nccl_tests_flags, check_nccl_tests_flags
from .sweep import launched_world

__all__ = ["PROG", "parse_size", "size_list", "build_parser", "parse_args", "main",
           "TESTS_TYPE_NAMES", "parse_collectives", "parse_dtypes", "parse_ops",
           "parse_backends", "BACKENDS"]

#: ncclpy dtype name -> nccl-tests' type name (the "type" column and ``-d`` values): the one
#: table of :mod:`ncclpy.dtypes`, which parses each of them back
TESTS_TYPE_NAMES = dict(TESTS_NAMES)
OPS = ("sum", "prod", "max", "min", "avg")
BACKENDS = ("ncclpy", "cupy", "torch")
#: the bound on every wait for the other ranks (rendezvous, store, barriers, torch's process
#: group): not -T's, which bounds only the stream synchronisations as nccl-tests' does
STORE_TIMEOUT_S = 300.0
_BACKEND_ALIASES = {"cupy_raw": "cupy", "torch_dist": "torch", "gloo": "torch",
                    "torch-gloo": "torch", "torch.distributed": "torch"}
#: what each backend is with --device cpu (cupy has no CPU form)
CPU_FORMS = {"ncclpy": "ncclpy's CPU backend, ncclpy.init(device='cpu')",
             "torch": "torch.distributed's gloo"}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str, name: str = "size") -> int:
    """Bytes from nccl-tests' size syntax: ``8``, ``1K``, ``1.5M``, ``2G`` (powers of 1024).

    Like nccl-tests only the first letter of the unit counts, so ``1KB``/``1KiB`` also mean 1024.
    """
    m = _SIZE.match(str(text))
    unit = m.group(2)[:1].lower() if m else None
    if m is None or unit not in _UNITS:
        raise ArgumentError(f"{name}: expected a size such as 8, 64K, 1.5M or 2G (K/M/G are "
                            f"powers of 1024), got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def size_list(minbytes: int, maxbytes: int, stepfactor: int = 1, stepbytes: int = 1 << 20,
              ) -> List[int]:
    """The sizes nccl-tests visits: from ``minbytes`` while ``<= maxbytes``, multiplying by
    ``stepfactor`` when it is > 1, else adding ``stepbytes``."""
    if minbytes < 0 or maxbytes < 0:
        raise ArgumentError(f"sizes must be >= 0, got minbytes={minbytes} maxbytes={maxbytes}")
    if minbytes > maxbytes:
        raise ArgumentError(f"invalid sizes for 'minbytes' and 'maxbytes': {minbytes} > "
                            f"{maxbytes}")
    if stepfactor > 1 and minbytes == 0 and maxbytes > 0:
        raise ArgumentError("-f/--stepfactor with -b/--minbytes 0 never grows; start at 1 or more")
    if stepfactor <= 1 and stepbytes <= 0 and maxbytes > minbytes:
        raise ArgumentError("-i/--stepbytes must be > 0 when -f/--stepfactor is not > 1")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        if maxbytes == minbytes:
            break
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return out


def parse_collectives(text: str) -> List[str]:
    """Registry names from a collective, a comma-separated list, or ``all``."""
    if text.strip().lower() == "all":
        return list(registry.names())
    out = []
    for part in text.split(","):
        coll = registry.get(part)
        if not coll.data:
            raise ArgumentError(f"collective {coll.name!r} moves no data and has no bandwidth; "
                                f"expected one of {', '.join(registry.names())}")
        if coll.name not in out:
            out.append(coll.name)
    return out


def parse_dtypes(text: str) -> List[str]:
    """``-d`` values: nccl-tests names (float, half, f8e4m3, ...), ncclpy names and short names
    (float32, f32, bf16, i8 = int8, ...: :mod:`ncclpy.dtypes`' one table), ``all``."""
    if text.strip().lower() == "all":
        return list(DTYPES)
    out = []
    for part in text.split(","):
        try:
            name = dtype_name(part.strip())
        except NcclpyError as e:
            raise ArgumentError(f"-d/--datatype: {e}") from None
        if name not in DTYPES:
            raise ArgumentError(f"-d/--datatype: {part!r} is not an NCCL type; expected one of "
                                f"{', '.join(TESTS_TYPE_NAMES.values())} (or ncclpy's names: "
                                f"{', '.join(SHORT_NAMES[d] for d in DTYPES)}) or all")
        out.append(name)
    return out


def parse_ops(text: str) -> List[str]:
    """``-o`` values: sum, prod, max, min, avg (comma-separated) or ``all``."""
    if text.strip().lower() == "all":
        return list(OPS)
    out = []
    for part in text.split(","):
        key = part.strip().lower()
        if key in ("mulsum", "premul_sum"):
            raise ArgumentError("-o/--op: mulsum (premul_sum) is not benchmarked; use sum, prod, "
                                "max, min, avg or all")
        if key not in OPS:
            raise ArgumentError(f"-o/--op: expected sum, prod, max, min, avg or all, got {part!r}")
        out.append(key)
    return out


def parse_backends(text: str) -> List[str]:
    """``--backend`` values: ncclpy, cupy, torch (aliases cupy_raw, torch_dist, gloo), comma-
    separated, in the order given (the first is the numerator of the ratios), duplicates once."""
    out = []
    for part in text.split(","):
        key = part.strip().lower()
        key = _BACKEND_ALIASES.get(key, key)
        if key not in BACKENDS:
            raise ArgumentError(f"--backend: expected a comma-separated list of "
                                f"{', '.join(BACKENDS)}, got {part!r}")
        if key not in out:
            out.append(key)
    return out


#: the command's name in its messages (``ncclpy bench`` when started that way)
PROG = "python -m bench"


def build_parser(prog: str = PROG) -> OneLineParser:
    """The argparse parser: nccl-tests' flags, then ncclpy's (a usage error is one line naming
    the flag as typed, exit status 2)."""
    p = OneLineParser(
        prog=prog,
        description="nccl-tests-compatible collective benchmark over ncclpy, raw CuPy NCCL and "
                    "torch.distributed. Sizes take K/M/G suffixes (powers of 1024). With "
                    "--device cpu: ncclpy's CPU backend and torch's gloo (CPU figures, not "
                    "NCCL's).",
        epilog=f"Examples: {prog} all_reduce -b 8 -e 128M -f 2 --nproc 2 | "
               f"{prog} all_gather --backend ncclpy,torch -J out.json --plot out.png | "
               f"{prog} all_reduce --device cpu --backend ncclpy,torch --nproc 2 -b 1K -e 1M "
               f"-f 4 | {prog} all_reduce --nproc 4 --algo ring,tree --proto ll,ll128,simple "
               f"--repeat-bits 3")
    p.add_argument("collective", help="collective to run: " + ", ".join(registry.names())
                   + " (nccl-tests stems such as all_reduce_perf or alltoall also work); a "
                   "comma-separated list or 'all' runs several in turn, one table each, and "
                   "-J/--plot files get the collective's name before their extension")
    g = p.add_argument_group("nccl-tests options")
    g.add_argument("-b", "--minbytes", default="32M", help="minimum size (default 32M)")
    g.add_argument("-e", "--maxbytes", default="32M", help="maximum size (default 32M)")
    g.add_argument("-i", "--stepbytes", default="1M",
                   help="fixed increment between sizes when -f is not > 1 (default 1M)")
    g.add_argument("-f", "--stepfactor", type=_int, default=1,
                   help="multiplication factor between sizes (default: disabled)")
    g.add_argument("-n", "--iters", type=_int, default=20, help="timed iterations (default 20)")
    g.add_argument("-w", "--warmup_iters", type=_int, default=1,
                   help="warm-up iterations per size, not timed (default 1)")
    g.add_argument("-c", "--check", type=_int, default=1,
                   help="check iterations: 0 disables the correctness check (default 1)")
    g.add_argument("-o", "--op", default="sum",
                   help="sum, prod, max, min, avg or all (default sum)")
    g.add_argument("-d", "--datatype", default="float",
                   help="nccl-tests type name (int8 uint8 int32 uint32 int64 uint64 half float "
                        "double bfloat16 f8e4m3 f8e5m2), ncclpy name (float32, f32, bf16, i8 = "
                        "int8, ...), or all (default float)")
    g.add_argument("-r", "--root", default="0", help="root rank, or all (default 0)")
    g.add_argument("-G", "--cudagraph", type=_int, default=0,
                   help="capture the iterations into a CUDA graph and replay it this many times "
                        "(GPU only; default 0: no graph)")
    g.add_argument("-a", "--average", type=_average, default=1,
                   help="time reported across ranks: 0=rank 0, 1=average, 2=min, 3=max (default 1)")
    g.add_argument("-J", "--output_file", default=None, metavar="FILE",
                   help="write results as JSON in nccl-tests' schema (see bench/schema.json)")
    add_nccl_tests_flags(g)
    x = p.add_argument_group("ncclpy options")
    x.add_argument("--nproc", type=_int, default=None, metavar="N",
                   help="start N ranks here (ncclpy.spawn); without it, run as the ranks of an "
                        "outer launcher (ncclpy run, torchrun, mpirun, srun) or as a single rank")
    x.add_argument("--backend", default=None,
                   help="comma-separated backends: ncclpy (on cpu: its CPU backend, "
                        "ncclpy.init(device='cpu'), not NCCL), cupy (raw cupy.cuda.nccl; cuda "
                        "only), torch (torch.distributed: NCCL on cuda, gloo on cpu; alias "
                        "gloo, torch-gloo). Several alternate per size and ratios are printed. "
                        "Default: ncclpy on cuda, under NCCLPY_DEVICE=cpu (ncclpy run --cpu) "
                        "and with --algo/--proto/--repeat-bits; torch on cpu")
    x.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where buffers live (default auto: cpu under NCCLPY_DEVICE=cpu, as "
                        "ncclpy run --cpu sets it, else cuda when a GPU is visible)")
    x.add_argument("--timer", default="host", choices=("host", "events"),
                   help="host: wall clock around the iterations and a stream sync, as nccl-tests; "
                        "events: CUDA events recorded on the stream (GPU only)")
    add_combo_flags(x)
    g.add_argument("-R", "--local_register", type=_int, default=0, metavar="0|1|2",
                   help="register the buffers: 0 none, 1 ncclCommRegister, 2 symmetric windows "
                        "(ncclMemAlloc + ncclCommWindowRegister, NCCL >= 2.27); ncclpy backend "
                        "(default 0)")
    g.add_argument("-M", "--memory_report", type=_int, default=0, metavar="0|1",
                   help="report NCCL's memory of each communicator after the sweep "
                        "(ncclCommMemStats, NCCL >= 2.29.7); ncclpy backend (default 0)")
    x.add_argument("-x", "--cta-policy", "--cta_policy", dest="cta_policy", default=None,
                   metavar="POLICY",
                   help="the communicator's CTA policy: default, efficiency or zero (nccl-tests' "
                        "-x 0, 1, 2) "
                        "(Config(cta_policy=); zero with -R 2 runs the copy-engine "
                        "collectives); ncclpy backend")
    x.add_argument("--predict", action="store_true",
                   help="add NCCL's predicted time of each out-of-place call "
                        "(ncclGroupSimulateEnd, NCCL >= 2.22) beside the measured one "
                        "(--backend ncclpy)")
    x.add_argument("--csv", default=None, metavar="FILE", help="also write results as CSV")
    x.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot bus bandwidth and latency against size (needs matplotlib)")
    x.add_argument("-T", "--timeout", type=_timeout, default=None, metavar="S",
                   help="as nccl-tests' -T: bound each stream synchronisation of the ncclpy "
                        "and cupy backends to S seconds, then abort the communicator (0 or "
                        "absent: no limit); it bounds only the stream syncs: the waits for the "
                        "other ranks (rendezvous, store, barriers, torch's process group) keep "
                        "their own bound of %g s" % STORE_TIMEOUT_S)
    x.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    # test-only hook: corrupt elements of the checked output (never in a real run): N on rank 0,
    # or RANK:N[,RANK:N...] on those ranks
    x.add_argument("--test-corrupt", type=_corrupt, default={}, help=argparse.SUPPRESS)
    return p


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _corrupt(text: str) -> dict:
    """--test-corrupt: ``N`` (rank 0) or ``RANK:N[,RANK:N...]`` -> {rank: elements}."""
    if ":" not in text:
        n = _int(text)
        return {0: n} if n else {}
    out = {}
    for item in text.split(","):
        rank, _, n = item.partition(":")
        out[_int(rank)] = _int(n)
    return out


def _average(text: str) -> int:
    v = _int(text)
    if v not in AVERAGE_CHOICES:
        raise argparse.ArgumentTypeError(f"expected 0 (rank 0), 1 (average), 2 (min) or 3 (max), "
                                         f"got {text!r}")
    return v


#: nccl-tests' -a values
AVERAGE_CHOICES = (0, 1, 2, 3)


def _timeout(text: str) -> float:
    """-T/--timeout: seconds >= 0, 0 meaning no limit, as nccl-tests' (common.cu
    ``testStreamSynchronize`` checks ``timeout > 0``); it bounds the stream syncs only."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if v == 0:
        return 0.0
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: no limit), got {text!r}")
    return v


_FLAG_PREFIX = re.compile(r"^(?:-[A-Za-z]/)?--?[A-Za-z_][\w-]*: ")


def _typed_error(p: OneLineParser, dest: str, e: Exception) -> ArgumentError:
    """``e`` re-worded to start with the flag of ``dest`` as the user typed it."""
    return ArgumentError(f"{p.flag(dest)}: {_FLAG_PREFIX.sub('', str(e), count=1)}")


def _plot_problem(path: str) -> str:
    """'' when matplotlib can write ``path`` (importable, a format it knows, a writable place)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "needs matplotlib (pip install matplotlib)"
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    kinds = Figure().canvas.get_supported_filetypes()
    if ext not in kinds:
        what = f".{ext} files" if ext else "a file without an extension"
        known = ", ".join("." + k for k in sorted(kinds))
        return f"{path!r}: matplotlib cannot write {what}; expected one of {known}"
    return check_output_path(path)


def _env_wants_cpu() -> bool:
    """Whether ``NCCLPY_DEVICE=cpu`` (``ncclpy run --cpu``) asks for ncclpy's CPU backend."""
    from ncclpy.cpu.backend import wants_cpu
    return wants_cpu(None)


def _gpu_visible() -> bool:
    try:
        from ncclpy.launch.placement import visible_gpu_count
        return visible_gpu_count() > 0
    except Exception:  # pragma: no cover - placement absent or broken: assume none
        return False


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> SweepConfig:
    """Parse and check a command line into a :class:`~bench.sweep.SweepConfig`, before anything
    starts: ArgumentError naming the flag as typed (a malformed flag value: SystemExit 2, one
    line).  The output files (``-J``, ``--csv``, ``--plot``), the root against the ranks that
    will run and the GPU for ``--device cuda`` are checked here, not after the sweep."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser(prog)
    a = p.parse_args(argv)

    def flagged(dest: str, fn, *args):
        try:
            return fn(*args)
        except ArgumentError as e:
            raise _typed_error(p, dest, e) from None
    collectives = parse_collectives(a.collective)
    minb = flagged("minbytes", parse_size, a.minbytes, "-b/--minbytes")
    maxb = flagged("maxbytes", parse_size, a.maxbytes, "-e/--maxbytes")
    stepb = flagged("stepbytes", parse_size, a.stepbytes, "-i/--stepbytes")
    for dest, val, lo in (("iters", a.iters, 1), ("warmup_iters", a.warmup_iters, 0),
                          ("check", a.check, 0), ("cudagraph", a.cudagraph, 0),
                          ("stepfactor", a.stepfactor, 0)):
        if val < lo:
            raise ArgumentError(f"{p.flag(dest)}: expected an integer >= {lo}, got {val}")
    if minb > maxb:
        raise ArgumentError(f"{p.flag('minbytes')} {a.minbytes} is larger than "
                            f"{p.flag('maxbytes')} {a.maxbytes} ({minb} > {maxb} bytes); "
                            f"expected the smallest size first")
    sizes = flagged("stepfactor" if a.stepfactor > 1 else "stepbytes", size_list, minb, maxb,
                    a.stepfactor, stepb)
    root_text = str(a.root).strip().lower()
    if root_text == "all":
        root = -1
    else:
        try:
            root = int(root_text, 0)
        except ValueError:
            raise ArgumentError(f"{p.flag('root')}: expected a rank or all, got "
                                f"{a.root!r}") from None
        if root < 0:
            raise ArgumentError(f"{p.flag('root')}: expected a rank >= 0 or all, got {a.root!r}")
    if a.nproc is not None and a.nproc < 1:
        raise ArgumentError(f"{p.flag('nproc')}: expected N >= 1, got {a.nproc}")
    world = a.nproc if a.nproc is not None else launched_world()
    if root >= 0 and world is not None and any(registry.get(c).rooted for c in collectives):
        if root >= world:
            raise ArgumentError(f"{p.flag('root')}: {root} is not a rank of a run of {world} "
                                f"rank{'s' if world != 1 else ''}; expected 0..{world - 1} or all")
    device = a.device
    if device == "auto":            # NCCLPY_DEVICE=cpu (ncclpy run --cpu): the CPU backend
        device = "cpu" if _env_wants_cpu() else ("cuda" if _gpu_visible() else "cpu")
    elif device == "cuda":
        why = _no_gpu_reason()
        if why:
            raise ArgumentError(f"{p.flag('device')} cuda: no usable GPU here ({why}); use "
                                f"--device cpu (the torch backend on gloo) or a GPU machine")
    combo_flags = a.algo is not None or a.proto is not None or bool(a.repeat_bits)
    backends = flagged("backend", parse_backends, a.backend) if a.backend else (
        ["ncclpy"] if device == "cuda" or _env_wants_cpu() or combo_flags else ["torch"])
    if device == "cpu":
        _refuse_on_cpu(p, a, backends)
        if a.cudagraph:
            raise ArgumentError(f"{p.flag('cudagraph')}: CUDA graphs are unsupported with "
                                f"--device cpu")
        if a.timer == "events":
            raise ArgumentError(f"{p.flag('timer')} events: CUDA events are unsupported with "
                                f"--device cpu")
    if a.predict:
        bad = [b for b in backends if b != "ncclpy"]
        if bad:
            raise ArgumentError(f"{p.flag('predict')}: needs --backend ncclpy (ncclpy's "
                                f"group(simulate=True)); {', '.join(bad)} cannot")
    combos, repeat_bits = check_combo_flags(p, a, backends, device)
    register, memory_report, cta_policy = _ncclpy_flags(p, a, backends, collectives)
    nt = check_nccl_tests_flags(p, a, backends, device)
    for dest, path, check in (("output_file", a.output_file, check_output_path),
                              ("csv", a.csv, check_output_path), ("plot", a.plot, _plot_problem)):
        why = check(path) if path else ""
        if why:
            raise ArgumentError(f"{p.flag(dest)}: {why}")
    return SweepConfig(
        collectives=collectives, sizes=sizes, minbytes=minb, maxbytes=maxb, stepbytes=stepb,
        stepfactor=a.stepfactor, iters=a.iters, warmup_iters=a.warmup_iters, check=a.check,
        ops=flagged("op", parse_ops, a.op), dtypes=flagged("datatype", parse_dtypes, a.datatype),
        root=root, cudagraph=a.cudagraph, average=a.average, output_file=a.output_file,
        nproc=a.nproc, backends=backends, device=device, timer=a.timer, csv=a.csv,
        plot=a.plot, timeout=STORE_TIMEOUT_S,
        sync_timeout=a.timeout or None, quiet=a.quiet, test_corrupt=a.test_corrupt,
        combos=combos, repeat_bits=repeat_bits, predict=a.predict, register=register,
        memory_report=memory_report, cta_policy=cta_policy, argv=[prog, *argv],
        **dataclasses.asdict(nt))


def _refuse_on_cpu(p: Any, a: Any, backends: Sequence[str]) -> None:
    """With --device cpu: the backends without a CPU form (cupy), and the flags that drive
    NCCL itself (estimate, registration, memory statistics, CTA policy), refused in
    one line naming the flag as typed."""
    where = "--device cpu" if a.device == "cpu" else (
        "NCCLPY_DEVICE=cpu" if _env_wants_cpu() else "--device auto (cpu: no GPU here)")
    bad = [b for b in backends if b not in CPU_FORMS]
    if bad:
        forms = "; ".join(f"{k}: {v}" for k, v in CPU_FORMS.items())
        raise ArgumentError(f"{p.flag('backend')} {a.backend}: {', '.join(bad)} needs a GPU "
                            f"(raw CuPy NCCL has no CPU form); with {where} expected "
                            f"{' or '.join(CPU_FORMS)} ({forms})")
    nccl_only = (("predict", a.predict, "adds NCCL's estimate"),
                 ("local_register", a.local_register != 0, "registers buffers with NCCL"),
                 ("memory_report", a.memory_report != 0, "reports NCCL's memory"),
                 ("cta_policy", a.cta_policy is not None, "sets NCCL's CTA policy"))
    if a.device == "auto" and "ncclpy" in backends and not _env_wants_cpu():
        # never CPU figures by accident: --device cpu or NCCLPY_DEVICE=cpu asks for them
        raise ArgumentError(f"{p.flag('backend')} {a.backend}: no usable GPU here "
                            f"({_no_gpu_reason() or 'none visible'}); --device cpu runs "
                            f"ncclpy's CPU backend (CPU figures, not NCCL's)")
    for dest, given, what in nccl_only:
        if given:
            value = {"local_register": a.local_register,
                     "memory_report": a.memory_report, "cta_policy": a.cta_policy}.get(dest)
            shown = p.flag(dest) + ("" if value is None else f" {value}")
            raise ArgumentError(f"{shown}: {what}, and {where} runs no NCCL (ncclpy's CPU "
                                f"backend, torch's gloo); expected --device cuda on a GPU")


def _ncclpy_flags(p: Any, a: Any, backends: Sequence[str], collectives: Sequence[str]) -> tuple:
    """-R, -M and --cta-policy checked: (register, memory_report, cta_policy)."""
    if a.local_register not in (0, 1, 2):
        raise ArgumentError(f"{p.flag('local_register')}: expected 0 (none), 1 "
                            f"(ncclCommRegister) or 2 (symmetric windows), got "
                            f"{a.local_register}")
    if a.memory_report not in (0, 1):
        raise ArgumentError(f"{p.flag('memory_report')}: expected 0 or 1, got "
                            f"{a.memory_report}")
    flags = [("local_register", a.local_register, 0), ("memory_report", a.memory_report, 0),
             ("cta_policy", a.cta_policy, None)]
    for dest, val, off in flags:
        if val != off and [b for b in backends if b != "ncclpy"]:
            raise ArgumentError(f"{p.flag(dest)}: needs --backend ncclpy only (ncclpy's "
                                f"register, windows, Config and mem_stats); "
                                f"{', '.join(b for b in backends if b != 'ncclpy')} cannot")
    uneven = [c for c in collectives if c in ("gather", "scatter")]
    if a.local_register == 2 and uneven:
        raise ArgumentError(f"{p.flag('local_register')} 2: {', '.join(uneven)} has buffers "
                            f"only on the root, and a window is registered by every rank; "
                            f"drop it or use -R 1")
    policy = None
    if a.cta_policy is not None:
        from ncclpy._nccl.config import cta_policy_value
        text = a.cta_policy.strip().lower()
        text = {"0": "default", "1": "efficiency", "2": "zero"}.get(text, text)   # -x 0/1/2
        cta_policy_value(p.flag("cta_policy"), text)     # ArgumentError, as typed
        policy = text
    need = {2: ("ncclCommWindowRegister", "local_register")}.get(a.local_register)
    checks = [need] if need else []
    if a.memory_report:
        checks.append(("ncclCommMemStats", "memory_report"))
    for fn, dest in checks:
        try:
            from ncclpy._nccl.lib import get_lib, require_version
            lib = get_lib()
        except NcclpyError:
            continue                   # no libnccl here: the ranks say so when they start
        try:
            require_version(fn, lib.version, lib.path)
        except NcclpyError as e:
            raise ArgumentError(f"{p.flag(dest)}: {e}") from None
    return a.local_register, bool(a.memory_report), policy


def _no_gpu_reason() -> str:
    """'' when a GPU and NCCL are usable here, else why not (``ncclpy info``'s words)."""
    try:
        from ncclpy.info import no_gpu_reason
        return no_gpu_reason()
    except Exception as e:  # noqa: BLE001 - the probe itself failed: say how
        return f"{type(e).__name__}: {e}"


def _spawn_ranks(cfg: SweepConfig, prog: str = PROG) -> int:
    """:func:`bench.sweep.spawn_ranks`, except that a closed stdout (``| head``) is quiet (141)."""
    import tempfile
    from . import sweep
    from ncclpy.launch.spawn import spawn
    fd, path = tempfile.mkstemp(prefix="ncclpy-bench-", suffix=".rc")
    os.close(fd)
    os.unlink(path)
    try:
        try:
            spawn(sweep._spawned, cfg.nproc, args=(dataclasses.replace(cfg, result_file=path),))
        except Exception as e:
            if stdout_reader_gone():           # rank 0 lost its reader: not an error to report
                silence_stdout()
                return EXIT_CLOSED_PIPE
            print(f"{prog}: a rank failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        try:
            with open(path) as f:
                return int(f.read().strip())     # the verdict the footer gave
        except (OSError, ValueError):
            print(f"{prog}: rank 0 reported no result", file=sys.stderr)
            return 1
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """Parse, then run as this process's rank or spawn ``--nproc`` ranks."""
    from . import sweep
    try:
        cfg = parse_args(argv, prog)
    except ArgumentError as e:
        print(f"{prog}: error: {e} (see '{prog} -h')", file=sys.stderr)
        return 2
    world = launched_world()
    if cfg.nproc is not None and world is None and cfg.nproc > 1:
        try:
            return _spawn_ranks(cfg, prog)
        except NcclpyError as e:
            print(f"{prog}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    if cfg.nproc is not None and world is not None and world != cfg.nproc:
        print(f"{prog}: error: --nproc {cfg.nproc} but the launcher started "
              f"{world} ranks; drop --nproc under a launcher", file=sys.stderr)
        return 2
    try:
        return sweep.run_rank(cfg)
    except NcclpyError as e:
        print(f"{prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """Entry point (``python -m bench``, and ``ncclpy bench`` with ``prog="ncclpy bench"``):
    :func:`_main` with Ctrl-C (130, one line) and a closed stdout (141, quiet) handled as
    command-line tools do."""
    return run_main(prog, lambda: _main(argv, prog))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
