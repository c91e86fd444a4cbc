"""``-I 1`` / ``-K N``: each of the ``-n`` iterations timed on its own, and nccl-tests 2.19's
statistics of those samples.

What nccl-tests does (``src/common.cu``, ``BenchTime``, ``initEvents``/``recordEvents``/
``getElapsedTimes``; ``src/util.cu``, ``computeIterStats``/``writePerIterReport``), and so this
module does:

* a mark at every iteration boundary on the stream: ``iters + 1`` shared boundary events, or
  with ``-z 3`` a start and a stop event per iteration (the stop recorded after the iteration's
  stream sync, before its barrier), so that the barrier stays out of the samples;
* a sample = the time between an iteration's marks / ``-m`` (the calls of one iteration);
* per iteration the max over the GPUs of a process, then over the process rows
  (``GatherProcessMaxIterTimes``/``ReduceProcessMaxIterTimes``): every rank is a process here,
  so the max over ranks, and ``per_process_max_times_us`` holds every rank's own samples when
  there is more than one;
* statistics over the samples after the first ``-K``: min, max, avg, p50 = sorted[n/2],
  p95/p99 = sorted[min(n-1, (n*p+99)/100-1)] (nearest rank: p99 is the max below 100
  samples), the population standard deviation and cv = stdev/avg in percent.

The marks are CUDA events where the backend has them (:attr:`Backend.supports_events`,
:meth:`Backend.event_marks`); elsewhere (ncclpy's CPU backend, torch on gloo) a read of the
sweep's clock at each boundary after a sync of the backend's stream or queue (one per iteration;
none added with ``-z 3``, whose iterations end in a sync already), which the header line says
(:func:`header_line`) with what it costs: those syncs are inside the reported time.  The row's
own time is still the whole window's, as in nccl-tests (its -I events leave ``deltaSec`` alone;
``-C 1`` still reports the host's time of issuing, the samples stay the marks' times).  The
text's four columns per side are :data:`TEXT_COLUMNS` (bench.output writes them); with ``-S 1``
the timestamp follows the in-place side's columns, as nccl-tests writes it once per row.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .backends import Backend
    from .nccl_tests_flags import NcclTestsFlags

__all__ = ["IterStats", "percentile_index", "iter_stats", "report", "gather_report",
           "Recorder", "header_line", "TEXT_COLUMNS"]

#: the four columns each side gets after its #wrong (util.cu, writeResultHeader's per-iteration
#: branch and writePerIterReport): heading, key of :func:`report`'s dict, unit
TEXT_COLUMNS: Tuple[Tuple[str, str, str], ...] = (
    ("i_min", "min_us", "(us)"), ("i_max", "max_us", "(us)"), ("i_p99", "p99_us", "(us)"),
    ("i_cv%", "cv_pct", "(%)"))


@dataclass(frozen=True)
class IterStats:
    """nccl-tests' ``struct IterStats`` (util.h), in the unit of the samples."""

    min: float
    max: float
    avg: float
    p50: float
    p95: float
    p99: float
    stdev: float

    @property
    def cv_pct(self) -> float:
        """stdev / avg in percent, 0 when avg is not positive (writePerIterReport)."""
        return self.stdev / self.avg * 100.0 if self.avg > 0 else 0.0


def percentile_index(n: int, percentile: int) -> int:
    """util.cu's ``percentileIndex``: the nearest-rank index, ``min(n-1, ceil(n*p/100)-1)``."""
    return min(n - 1, (n * percentile + 99) // 100 - 1)


def iter_stats(samples: Sequence[float]) -> IterStats:
    """util.cu's ``computeIterStats`` over ``samples`` (at least one), summed in sorted order
    left to right as its loops sum them."""
    s = sorted(float(x) for x in samples)
    n = len(s)
    if not n:
        raise ValueError("per-iteration statistics need at least one sample")
    total = 0.0
    for x in s:
        total += x
    avg = total / n
    var = 0.0
    for x in s:
        var += (x - avg) * (x - avg)
    return IterStats(min=s[0], max=s[-1], avg=avg, p50=s[n // 2],
                     p95=s[percentile_index(n, 95)], p99=s[percentile_index(n, 99)],
                     stdev=math.sqrt(var / n))


def report(per_rank: Sequence[Sequence[float]], skip: int) -> Dict[str, Any]:
    """One side's ``*_per_iter`` object as writePerIterReport writes it, from every rank's
    samples in seconds (rank order): per iteration the max over ranks, statistics over the
    samples after the first ``skip``, every figure in microseconds; ``times_us`` holds all
    the samples (the skipped ones too) and, with more than one rank,
    ``per_process_max_times_us`` each rank's own."""
    rows = [[float(t) for t in r] for r in per_rank]
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"per-iteration samples: every rank needs the same count, got "
                         f"{[len(r) for r in rows]}")
    times = [max(col) for col in zip(*rows)]
    st = iter_stats(times[skip:])
    out: Dict[str, Any] = {
        "skipped_iterations": skip, "min_us": st.min * 1e6, "max_us": st.max * 1e6,
        "avg_us": st.avg * 1e6, "p50_us": st.p50 * 1e6, "p95_us": st.p95 * 1e6,
        "p99_us": st.p99 * 1e6, "stdev_us": st.stdev * 1e6, "cv_pct": st.cv_pct,
        "times_us": [t * 1e6 for t in times]}
    if len(rows) > 1:
        out["per_process_max_times_us"] = [[t * 1e6 for t in r] for r in rows]
    return out


def gather_report(coord: Any, samples: Sequence[float], skip: int) -> Dict[str, Any]:
    """:func:`report` over every rank's ``samples``: rank 0 gathers them through the sweep's
    host store (``coord``: :class:`bench.sweep.Coord`) and computes it, every rank gets rank 0's
    result, so all ranks hold the same figures."""
    got = coord.gather(json.dumps([float(x) for x in samples]).encode())
    mine = json.dumps(report([json.loads(x) for x in got], skip)) if got else None
    return json.loads(coord.any(mine) or "null")


class Recorder:
    """The marks of one measurement's ``-n`` iterations on one rank.

    The sweep calls :meth:`begin` at the start of each iteration, :meth:`end` after a ``-z 3``
    iteration's stream sync (before its barrier), :meth:`close` after the last iteration, and
    :meth:`seconds` once the window is over.  With CUDA events each mark is an event recorded
    on the backend's stream; without, a sync of the backend's stream or queue (where it is not
    idle already) and a read of ``clock``."""

    def __init__(self, backend: "Backend", iters: int, agg_iters: int, blocking: int,
                 clock: Callable[[], float]) -> None:
        self.backend, self.iters, self.agg_iters, self.clock = backend, iters, agg_iters, clock
        self.paired = blocking == 3                 # common.cu: getEventCount
        count = 2 * iters if self.paired else iters + 1
        self.events = bool(backend.supports_events)
        self._record: Optional[Callable[[int], None]] = None
        self._elapsed: Optional[Callable[[int, int], float]] = None
        if self.events:
            self._record, self._elapsed = backend.event_marks(count)
        self._stamps: List[float] = [0.0] * count
        self._next = 0

    def _mark(self, synced: bool = False) -> None:
        k = self._next
        self._next += 1
        if self._record is not None:
            self._record(k)
            return
        if not synced:
            self.backend.sync()
        self._stamps[k] = self.clock()

    def begin(self) -> None:
        """An iteration starts (before its ``-m`` group).  The stream is idle here at the first
        iteration (the sweep synchronised it before its barrier) and at every ``-z 3`` one (the
        last one ended in a sync): the host clock needs no sync of its own there."""
        self._mark(synced=self.paired or self._next == 0)

    def end(self) -> None:
        """A ``-z 3`` iteration's calls are done and synchronised; its barrier follows."""
        if self.paired:
            self._mark(synced=True)

    def close(self) -> None:
        """The last iteration was issued: the boundary after it (not with ``-z 3``)."""
        if not self.paired:
            self._mark()

    def seconds(self) -> List[float]:
        """Each iteration's seconds per call (its marks' distance / ``-m``), after the stream
        has finished them."""
        if self._next != len(self._stamps):
            raise RuntimeError(f"per-iteration timing: {self._next} of {len(self._stamps)} "
                               f"marks were made")
        out = []
        for i in range(self.iters):
            a, z = (2 * i, 2 * i + 1) if self.paired else (i, i + 1)
            if self._elapsed is not None:
                dt = self._elapsed(a, z)
            else:
                dt = self._stamps[z] - self._stamps[a]
            out.append(dt / self.agg_iters)
        return out


def header_line(backends: Sequence["Backend"], flags: "NcclTestsFlags") -> str:
    """The preamble's ``-I`` line ("" without ``-I 1``): nccl-tests' words (writeDeviceReport)
    where the marks are CUDA events, what they are instead where a backend has none, and
    ``-K``'s skip."""
    if not flags.per_iter_timing:
        return ""
    skip, blocking = flags.per_iter_skip, flags.blocking
    events = [b.label for b in backends if b.supports_events]
    host = list(dict.fromkeys(b.label for b in backends if not b.supports_events))
    if blocking == 3:
        how = ("a clock read at each iteration's start and after its sync, before its "
               "barrier, as -z 3's paired events; no sync added")
    else:
        how = ("a sync of the stream or queue and a clock read at each iteration boundary; "
               "the reported time includes those syncs")
    parts = []
    if events:
        parts.append("CUDA event timing" + (f" on {', '.join(dict.fromkeys(events))}"
                                            if host else ""))
    if host:
        parts.append(f"host clock timing on {', '.join(host)} (no CUDA events there: {how})")
    line = f"# Per-Iteration Report: {'; '.join(parts)}; i_* uses max over process rows"
    if skip:
        line += f"; summary skips first {skip} iterations"
    return line + " "
