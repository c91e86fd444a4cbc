"""nccl-tests' flags that ``python -m bench`` takes beyond the sizes, iterations and types:
each is honoured with nccl-tests' meaning where ncclpy can, and refused in one line saying why
where it cannot (a pasted nccl-tests line either runs as nccl-tests would run it or says what
differs; it is never silently ignored).

The meanings are nccl-tests' (NVIDIA/nccl-tests, ``src/common.cu``: the ``longopts`` table,
``startColl``, ``completeColl``, ``BenchTime``, ``TimeTest``; ``src/util.cu``:
``writeDeviceReport`` and ``writeBenchmarkLineBody``; README "Arguments"):

=====================  =========================================================================
``-t,--nthreads N``    threads per process, each driving ``-g`` GPUs.  Here one rank is one
                       process on one thread: ``-t 1`` is accepted, more is refused (``--nproc``).
``-g,--ngpus N``       GPUs per thread, one rank each (``ncclGroupStart`` around their calls).
                       Here one GPU per rank: ``-g 1`` is accepted, more is refused (``--nproc``).
``-m,--agg_iters N``   each timed iteration issues N collectives inside one
                       ``ncclGroupStart/End``; time per call = elapsed / (iters * N).  Honoured
                       by the backends that drive NCCL's group calls (ncclpy, cupy).
``-N,--run_cycles N``  the size sweep runs N times, each cycle's rows printed; ``0`` runs forever
                       (refused here: the footer, JSON, CSV and plot are written at the end).
``-p,--parallel_init``  0/1: threads call ``ncclCommInitRank`` concurrently.  Ranks here are
                       processes, which always initialise concurrently: both values accepted.
``-z,--blocking M``    0: calls back to back, one stream sync at the end; 1: stream sync and a
                       barrier after each call; 2: stream sync after each call; 3: sync and
                       barrier after each outer iteration, the reported time excluding the
                       barriers.  Honoured (not with ``-G``, which nccl-tests refuses for 3 too).
``-y,--stream_null``   0/1: run on the default (NULL) stream.  Here every backend runs on its own
                       stream: ``-y 0`` accepted, ``-y 1`` refused.
``-T,--timeout S``     abort a test whose stream synchronisation takes longer than S seconds
                       (0: no limit; common.cu ``testStreamSynchronize``).  The same here for
                       the ncclpy (GPU and CPU backend) and cupy backends, whose communicator is
                       then aborted; the waits for the other ranks (rendezvous, store, barriers,
                       torch's process group) keep their own 300 s bound.
``-C,--report_cputime``  0/1: report the host time of issuing the calls (before the final stream
                       sync) instead of the latency; the JSON side says ``cpu_time``.  Honoured
                       (not with ``--timer events``, which times the device).
``-S,--report_timestamps``  0/1: a timestamp after each row.  Honoured.
``-u,--unalign N``     misalign the send and receive buffers by N elements (nccl-tests'
                       ``TimeTest``: each pointer moved by N x the type's size); every backend
                       that takes an offset pointer or a view honours it, the check included.
``-I,--per_iter_timing``  0/1: time each of the ``-n`` iterations (CUDA events on a GPU, the
                       host clock on the CPU backend and gloo, said in the header) and report
                       nccl-tests' ``computeIterStats`` (min, max, p99, cv; the JSON also avg,
                       p50, p95, stdev and the samples).  Refused with ``-G`` (nccl-tests
                       warns that they are incompatible and runs without ``-I``).
``-K,--per_iter_skip N``  leave the first N samples out of ``-I``'s statistics (0 <= N <
                       ``-n``; needs ``-I 1``).
``-D,--device_implementation``, ``-V,--device_cta_count``  nccl-tests' own device-API kernels
                       (NCCL >= 2.28): ``-D 0`` and ``-V 16`` (their defaults) accepted.
``-x,--cta_policy``    0/1/2 (default, efficiency, zero): ``--cta-policy`` (see its help).
=====================  =========================================================================
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence

from ncclpy.errors import ArgumentError

__all__ = ["add_nccl_tests_flags", "check_nccl_tests_flags", "NcclTestsFlags",
           "GROUPING_BACKENDS", "BLOCKING_LINES"]

#: backends whose calls can be aggregated in NCCL group calls (-m > 1)
GROUPING_BACKENDS = ("ncclpy", "cupy")

#: nccl-tests' header line for each -z mode (src/util.cu, writeDeviceReport)
BLOCKING_LINES = {
    1: "# Blocking Enabled: wait and barrier after each inner iteration (-m)",
    2: "# Blocking Enabled: wait after each inner iteration (-m), no barrier",
    3: "# Blocking Enabled: wait and barrier after each outer iteration (-n); time excludes "
       "barrier",
}


@dataclass
class NcclTestsFlags:
    """The checked values of the flags this module adds (the base of
    :class:`bench.config.SweepConfig`, which holds them under the same names)."""

    agg_iters: int = 1
    run_cycles: int = 1
    blocking: int = 0
    parallel_init: int = 0
    report_cputime: bool = False
    report_timestamps: bool = False
    #: -u: the buffers' misalignment in elements
    unalign: int = 0
    #: -I 1: per-iteration timing; -K: leading samples its statistics leave out
    per_iter_timing: bool = False
    per_iter_skip: int = 0


def _int(text: str) -> int:
    try:
        return int(text, 0)             # strtol(optarg, NULL, 0), as nccl-tests reads them
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_nccl_tests_flags(g: Any) -> None:
    """Add nccl-tests' -t -g -m -N -p -z -y -C -S -u -I -K -D -V to the argument group ``g``."""
    g.add_argument("-t", "--nthreads", type=_int, default=1, metavar="1",
                   help="threads per process: 1 (one rank per process here; --nproc N for N)")
    g.add_argument("-g", "--ngpus", type=_int, default=1, metavar="1",
                   help="GPUs per thread: 1 (one GPU per rank here; --nproc N for N GPUs)")
    g.add_argument("-m", "--agg_iters", type=_int, default=1, metavar="N",
                   help="collectives per timed iteration, aggregated in one NCCL group "
                        "(--backend ncclpy or cupy; default 1)")
    g.add_argument("-N", "--run_cycles", type=_int, default=1, metavar="N",
                   help="run the size sweep N times, printing each cycle (default 1)")
    g.add_argument("-p", "--parallel_init", type=_int, default=0, metavar="0|1",
                   help="initialise the communicators concurrently: ranks here are processes, "
                        "which always do (default 0)")
    g.add_argument("-z", "--blocking", type=_int, default=0, metavar="0|1|2|3",
                   help="0: back to back; 1: stream sync and barrier after each call; 2: sync "
                        "after each call; 3: sync and barrier after each iteration, barrier "
                        "time excluded (default 0)")
    g.add_argument("-y", "--stream_null", type=_int, default=0, metavar="0",
                   help="0: each backend runs on its own stream (1, the NULL stream, is not "
                        "offered)")
    g.add_argument("-C", "--report_cputime", type=_int, default=0, metavar="0|1",
                   help="1: report the host time of issuing the calls instead of the latency "
                        "(default 0)")
    g.add_argument("-S", "--report_timestamps", type=_int, default=0, metavar="0|1",
                   help="1: a timestamp after each row (default 0)")
    g.add_argument("-u", "--unalign", type=_int, default=0, metavar="N",
                   help="misalign the send and receive buffers by N elements (default 0)")
    g.add_argument("-I", "--per_iter_timing", type=_int, default=0, metavar="0|1",
                   help="1: time each iteration (CUDA events; the host clock on cpu) and report "
                        "min, max, p99 and cv per row (default 0)")
    g.add_argument("-K", "--per_iter_skip", type=_int, default=0, metavar="N",
                   help="leave the first N iterations out of -I's statistics (default 0)")
    g.add_argument("-D", "--device_implementation", type=_int, default=0, metavar="0",
                   help="0: NCCL's host API (nccl-tests' own device kernels are not offered)")
    g.add_argument("-V", "--device_cta_count", type=_int, default=16, metavar="16",
                   help="16 (goes with -D)")


def check_nccl_tests_flags(p: Any, a: Any, backends: Sequence[str], device: str
                           ) -> NcclTestsFlags:
    """The flags' values, or ArgumentError naming the flag as typed and why it is refused."""
    def bad(dest: str, why: str) -> ArgumentError:
        return ArgumentError(f"{p.flag(dest)} {getattr(a, dest)}: {why}")

    if a.nthreads != 1:
        raise bad("nthreads", "one rank per process here, each on one thread; start N ranks "
                              "with --nproc N (or a launcher: ncclpy run -n N)")
    if a.ngpus != 1:
        raise bad("ngpus", "one GPU per rank here; for N GPUs start N ranks with --nproc N "
                           "(or a launcher: ncclpy run -n N)")
    for dest, lo in (("agg_iters", 1), ("run_cycles", 0)):
        if getattr(a, dest) < lo:
            raise bad(dest, f"expected an integer >= {lo}")
    if a.run_cycles == 0:
        raise bad("run_cycles", "0 (run forever) is not offered: the footer, -J, --csv and "
                                "--plot are written at the end of the run; give a count")
    if a.agg_iters > 1:
        other = [b for b in backends if b not in GROUPING_BACKENDS]
        if other:
            raise bad("agg_iters", f"aggregates the calls in one NCCL group (ncclGroupStart/"
                                   f"End): --backend ncclpy or cupy; {', '.join(other)} cannot")
    if a.unalign < 0:
        raise bad("unalign", "expected an integer >= 0 (elements to move each buffer by)")
    for dest, ok in (("parallel_init", (0, 1)), ("blocking", (0, 1, 2, 3)),
                     ("report_cputime", (0, 1)), ("report_timestamps", (0, 1)),
                     ("per_iter_timing", (0, 1))):
        if getattr(a, dest) not in ok:
            raise bad(dest, f"expected {' or '.join(map(str, ok))}")
    if a.blocking and a.cudagraph:
        raise bad("blocking", "waits between the calls, which a CUDA graph (-G) cannot hold; "
                              "drop one of them")
    if a.blocking in (1, 2) and a.agg_iters > 1:
        raise bad("blocking", "waits after each call, inside the -m group where NCCL has "
                              "launched nothing yet; use -z 3 or -m 1")
    if a.blocking == 3 and a.timer == "events":
        raise bad("blocking", "excludes the barriers from a host-timed window; --timer events "
                              "cannot exclude them: drop one of them")
    # nccl-tests (common.cu, after getopt) prints these and carries on with -I or -K off; a
    # flag that would be dropped is refused here instead, with nccl-tests' reason
    if a.per_iter_timing and a.cudagraph:
        raise bad("per_iter_timing", f"per-iteration timing is incompatible with CUDA graph "
                                     f"mode ({p.flag('cudagraph')}), as in nccl-tests (which "
                                     f"warns and runs without -I): drop one of them")
    if not 0 <= a.per_iter_skip < a.iters:
        raise bad("per_iter_skip", f"expected 0 to {a.iters - 1} (fewer than -n/--iters "
                                   f"{a.iters} samples)")
    if a.per_iter_skip and not a.per_iter_timing:
        raise bad("per_iter_skip", "leaves samples out of -I's statistics: it needs "
                                   "-I/--per_iter_timing 1")
    if a.report_cputime and a.timer == "events":
        raise bad("report_cputime", "reports the host's time; --timer events times the device: "
                                    "drop one of them")
    refusals = (
        ("stream_null", 0, "every backend here runs on its own stream; the NULL stream is not "
                           "offered"),
        ("device_implementation", 0, "nccl-tests' own device-API kernels are not offered; "
                                     "ncclpy runs NCCL's host API"),
        ("device_cta_count", 16, "goes with -D (nccl-tests' device-API kernels), which is not "
                                 "offered"),
    )
    for dest, default, why in refusals:
        if getattr(a, dest) != default:
            raise bad(dest, why)
    return NcclTestsFlags(agg_iters=a.agg_iters, run_cycles=a.run_cycles, blocking=a.blocking,
                          parallel_init=a.parallel_init, report_cputime=bool(a.report_cputime),
                          report_timestamps=bool(a.report_timestamps), unalign=a.unalign,
                          per_iter_timing=bool(a.per_iter_timing),
                          per_iter_skip=a.per_iter_skip)
