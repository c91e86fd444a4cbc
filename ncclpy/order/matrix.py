"""The configurations ``ncclpy order --observe`` runs: one :class:`Job` per (world size, channel
count), since NCCL reads NCCL_MIN/MAX_NCHANNELS once per process; within a job one communicator
per (algorithm, protocol), each running its :class:`Case` list.

``proof_matrix()`` is the GPU proof's ``order`` stage: ranks 3 and 4, Ring and Tree, LL, LL128
and Simple, 1 and 2 channels, float32, bfloat16 and float16, counts on the alignment path
(1-67), one loop, several loops, and on both sides of the counts where the split starts using a
second channel; reduce_scatter and reduce on Ring.  Pure: sizes come from the model's own
chunk and split arithmetic (:mod:`ncclpy.order.split`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..semantics.dtypes import DTYPES
from .split import DEFAULT_BUFFSIZES, cbd_split, chunk_bytes, tuned_channels
from .split import DEFAULT_MAX_THREADS, default_thresholds
from .versions import PORTS

__all__ = ["Case", "Group", "Job", "proof_matrix", "single_job", "ALIGN_COUNTS"]

#: the alignment path: counts below one 16-byte group per rank and around it
ALIGN_COUNTS = (1, 2, 3, 5, 8, 13, 31, 64, 67)
_SHORT_ALIGN = (1, 3, 8, 31, 67)


@dataclass(frozen=True)
class Case:
    """One call: ``inputs`` "reveal" (order-revealing, run twice) or "random" (normals)."""

    collective: str
    dtype: str
    count: int
    inputs: str = "reveal"
    op: str = "sum"
    root: int = 0

    def name(self) -> str:
        root = f" root {self.root}" if self.collective == "reduce" else ""
        return f"{self.collective} {self.count} {self.dtype} {self.op}{root} ({self.inputs})"


@dataclass(frozen=True)
class Group:
    """One communicator: NCCL_ALGO and NCCL_PROTO pinned, its cases."""

    algo: str
    proto: str
    cases: Tuple[Case, ...]


@dataclass(frozen=True)
class Job:
    """One set of rank processes: world size, channels pinned, communicators in order."""

    nranks: int
    channels: Optional[int]
    groups: Tuple[Group, ...]

    def name(self) -> str:
        ch = "unpinned" if self.channels is None else str(self.channels)
        return f"n{self.nranks}-c{ch}"

    def calls(self) -> int:
        return sum(2 * (c.inputs == "reveal") + (c.inputs == "random")
                   for g in self.groups for c in g.cases)


def _chunk_elems(collective: str, algo: str, proto: str, dtype: str) -> int:
    return chunk_bytes(collective, algo, proto, DEFAULT_BUFFSIZES[proto]) // DTYPES[dtype].itemsize


def _second_channel_count(n: int, proto: str, algo: str, channels: int,
                          nt: int) -> Optional[int]:
    """The smallest float32 all_reduce count whose split uses two channels (port 2.26-2.28)
    with NCCL's thread count ``nt``."""
    port = next(p for p in PORTS if p.name == "2.26-2.28")
    thr = default_thresholds(n)[(algo, proto)]
    cb = chunk_bytes("all_reduce", algo, proto, DEFAULT_BUFFSIZES[proto])
    lo, hi = 1, 1 << 24
    def used(c: int) -> int:
        nc = tuned_channels("all_reduce", algo, proto, n, c, 4, channels, nt, thr)
        s = cbd_split(port, "all_reduce", proto, n, c, 4, nc, channels,
                      {"lo": cb, "mid": cb, "hi": cb})
        return s.channel_hi - s.channel_lo + 1
    if used(hi) < 2:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if used(mid) >= 2:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _all_reduce_cases(n: int, algo: str, proto: str, channels: int) -> List[Case]:
    cases = [Case("all_reduce", "float32", c) for c in ALIGN_COUNTS]
    for dt in ("bfloat16", "float16"):
        cases += [Case("all_reduce", dt, c) for c in _SHORT_ALIGN]
    k = _chunk_elems("all_reduce", algo, proto, "float32")
    if algo == "ring":
        cases.append(Case("all_reduce", "float32", n * k - 5))             # one loop, short
        if proto != "simple" or channels == 1:                            # several loops
            cases.append(Case("all_reduce", "float32", channels * (2 * n * k) + 1000))
        cases.append(Case("all_reduce", "bfloat16", n * 2 * k + 77))      # over one loop
    else:
        cases.append(Case("all_reduce", "float32", 100003))
    if channels > 1:
        # Ring/Simple runs 256 threads where the ring is no faster than PCI (tuning.cc:231):
        # what NCCL printed decides which edge is the real one, so both are run
        nts = {DEFAULT_MAX_THREADS[(algo, proto)]} | ({256} if (algo, proto) == (
            "ring", "simple") else set())
        for nt in sorted(nts):
            edge = _second_channel_count(n, proto, algo, channels, nt)
            if edge:
                cases += [Case("all_reduce", "float32", c) for c in (edge - 1, edge, edge + 1)]
    cases += [Case("all_reduce", "float32", 4099, inputs="random"),
              Case("all_reduce", "bfloat16", 4099, inputs="random")]
    return cases


def _ring_only_cases(n: int, proto: str) -> List[Case]:
    k = _chunk_elems("reduce_scatter", "ring", proto, "float32")
    cases = [Case("reduce_scatter", "float32", c) for c in (1, 7, 67, 1000)]
    cases += [Case("reduce_scatter", "bfloat16", 67),
              Case("reduce_scatter", "float32", min(k + 13, 300000)),
              Case("reduce_scatter", "float32", 999, inputs="random")]
    cases += [Case("reduce", "float32", c, root=(c % n)) for c in (1, 7, 67, 5000)]
    cases += [Case("reduce", "float16", 67, root=n - 1),
              Case("reduce", "float32", 3001, inputs="random", root=1)]
    return cases


def proof_matrix(worlds: Tuple[int, ...] = (3, 4),
                 channel_counts: Tuple[int, ...] = (1, 2)) -> List[Job]:
    """The GPU proof's matrix (see the module docstring)."""
    jobs = []
    for channels in channel_counts:
        for n in worlds:
            groups = []
            for algo in ("ring", "tree"):
                for proto in ("ll", "ll128", "simple"):
                    cases = _all_reduce_cases(n, algo, proto, channels)
                    if algo == "ring":
                        cases += _ring_only_cases(n, proto)
                    groups.append(Group(algo, proto, tuple(cases)))
            jobs.append(Job(n, channels, tuple(groups)))
    return jobs


def single_job(nranks: int, channels: Optional[int], algo: str, proto: str, collective: str,
               dtype: str, count: int, op: str, root: int) -> Job:
    """The one configuration the flags give: revealing inputs for a float sum, and random
    inputs in every case."""
    cases = []
    if op == "sum" and DTYPES[dtype].kind == "float" and nranks >= 2:
        cases.append(Case(collective, dtype, count, "reveal", op, root))
    cases.append(Case(collective, dtype, count, "random", op, root))
    return Job(nranks, channels, (Group(algo, proto, tuple(cases)),))
