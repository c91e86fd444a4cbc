"""NCCL's host-side planning of one Ring/Tree collective: how many channels it gets, how its
elements are split over them, and each channel's chunk size.  A port of NCCL's own code; each
function cites the lines it ports (at ``v2.28.9-1``; :mod:`ncclpy.order.versions` says where
2.29+ differs).

Pure integer arithmetic, no numpy: the answer for one call is a :class:`Split`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from .versions import Port

__all__ = ["Split", "Part", "GRAIN", "DEFAULT_BUFFSIZES", "DEFAULT_MAX_THREADS",
           "default_thresholds", "traffic_per_byte", "tuned_channels", "cbd_split",
           "chunk_bytes", "div_up", "align_up", "PROTOS", "ALGOS", "COLLECTIVES"]

PROTOS = ("ll", "ll128", "simple")
ALGOS = ("ring", "tree")
COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce")

NCCL_STEPS = 8                                   # src/include/device.h:24
WARP_SIZE = 32                                   # src/include/device.h:85
LL128_LINEELEMS = 16                             # device.h:106 (128-byte line / 8)
LL128_DATAELEMS = 15                             # device.h:107
LL128_SHMEM_ELEMS_PER_THREAD = 8                 # device.h:112

#: ncclProtoGrainSize (src/include/device.h:309-314): LL 16 B, LL128
#: WARP_SIZE*8/16*15*8 = 1920 B, Simple 512 B
GRAIN: Dict[str, int] = {
    "ll": 16,
    "ll128": WARP_SIZE * LL128_SHMEM_ELEMS_PER_THREAD // LL128_LINEELEMS * LL128_DATAELEMS * 8,
    "simple": 512,
}

#: computeBuffSizes' defaults (src/init.cc:697-699, 710-714): DEFAULT_LL_BUFFSIZE =
#: NCCL_LL_LINES_PER_THREAD(8) * NCCL_LL_MAX_NTHREADS(512) * NCCL_STEPS(8) * 16-byte line;
#: DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD(120) * NCCL_LL128_MAX_NTHREADS(640) *
#: NCCL_STEPS * 8; DEFAULT_BUFFSIZE = 4 MiB.  NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE and
#: NCCL_BUFFSIZE replace them.
DEFAULT_BUFFSIZES: Dict[str, int] = {
    "ll": 8 * 512 * NCCL_STEPS * 16,
    "ll128": 120 * 640 * NCCL_STEPS * 8,
    "simple": 1 << 22,
}

#: comm->maxThreads (src/graph/tuning.cc:231-243): Ring/Simple is 256 instead of 512 when the
#: ring graph's bwIntra*nChannels <= PCI_BW (NCCL prints the table under NCCL_DEBUG_SUBSYS=TUNING
#: as "Max NThreads"); NCCL_NTHREADS / NCCL_LL128_NTHREADS change them.
DEFAULT_MAX_THREADS: Dict[Tuple[str, str], int] = {
    ("ring", "ll"): 512, ("ring", "ll128"): 640, ("ring", "simple"): 512,
    ("tree", "ll"): 512, ("tree", "ll128"): 640, ("tree", "simple"): 512,
}

#: per-collective chunk steps (src/include/collectives.h:17-32; src/collectives.cc):
#: ALLREDUCE_CHUNKSTEPS = REDUCESCATTER_CHUNKSTEPS = NCCL_STEPS/2, REDUCE_CHUNKSTEPS = 1
_CHUNK_STEPS = {"all_reduce": NCCL_STEPS // 2, "reduce_scatter": NCCL_STEPS // 2, "reduce": 1}


def div_up(x: int, y: int) -> int:
    """NCCL's DIVUP / divUp for non-negative integers."""
    return (x + y - 1) // y


def align_up(x: int, a: int) -> int:
    """NCCL's alignUp: ``x`` rounded up to a multiple of ``a``."""
    return div_up(x, a) * a


def default_thresholds(nranks: int) -> Dict[Tuple[str, str], int]:
    """comm->threadThresholds (src/graph/tuning.cc:542-547; src/include/comm.h:41-43): LL 8,
    LL128 8, Simple 64 per thread, Ring/LL times nRanks.  NCCL_THREAD_THRESHOLDS replaces them
    (tuning.cc:552-561; NCCL prints the result as "threadThresholds").
    """
    return {("tree", "ll"): 8, ("tree", "ll128"): 8, ("tree", "simple"): 64,
            ("ring", "ll"): 8 * nranks, ("ring", "ll128"): 8, ("ring", "simple"): 64}


def traffic_per_byte(collective: str, nranks: int) -> int:
    """ncclFuncTrafficPerByte (src/enqueue.cc:86-93): all_reduce 2, reduce_scatter nRanks,
    reduce 1."""
    return {"all_reduce": 2, "reduce_scatter": nranks, "reduce": 1}[collective]


def _send_recv_count(collective: str, nranks: int, count: int) -> int:
    """ncclFuncMaxSendRecvCount (src/include/enqueue.h:36-38): reduce_scatter's count is
    per rank, so its buffers hold nRanks*count."""
    return nranks * count if collective == "reduce_scatter" else count


def tuned_channels(collective: str, algo: str, proto: str, nranks: int, count: int,
                   elem_size: int, comm_channels: int, max_threads: int, threshold: int) -> int:
    """The channels a lone call may use: topoGetAlgoInfo's Ring/Tree tuning (src/enqueue.cc:
    1864-1890): ``nc = comm->nChannels``, lowered while ``nBytes < nc*nt*threadThreshold``
    (never below 1), with ``nBytes`` = element size x ncclFuncMaxSendRecvCount (getAlgoInfo,
    enqueue.cc:1920).  A tuner plugin may replace the result (enqueue.cc:1973)."""
    nbytes = elem_size * _send_recv_count(collective, nranks, count)
    nc = comm_channels
    while nbytes < nc * max_threads * threshold:
        if nc >= 2:
            nc -= 1
        else:
            break
    return nc


@dataclass(frozen=True)
class Part:
    """One channel's share of the elements: ``channel``, its first element ``offset`` and
    ``count`` (ncclCollCbdPart's partOffset/partCount), and ``chunk`` (its chunkCount, in
    elements)."""

    channel: int
    offset: int
    count: int
    chunk: int


@dataclass(frozen=True)
class Split:
    """The ncclDevWorkColl of a lone Ring/Tree call: channelLo..channelHi and the cbd counts,
    with each channel's part (``parts``, in channel order)."""

    channel_lo: int
    channel_hi: int
    count_lo: int
    count_mid: int
    count_hi: int
    parts: Tuple[Part, ...]
    task_channels: int

    def describe(self) -> str:
        """``channels 0..1: 4096 + 4000 elements, chunks of 131072`` (for summaries)."""
        sizes = " + ".join(str(p.count) for p in self.parts)
        chunks = sorted({p.chunk for p in self.parts})
        return (f"channels {self.channel_lo}..{self.channel_hi}: {sizes} element"
                f"{'s' if sum(p.count for p in self.parts) != 1 else ''}, chunk"
                f"{'s' if len(chunks) > 1 else ''} of {'/'.join(str(c) for c in chunks)}")


def chunk_bytes(collective: str, algo: str, proto: str, buffsize: int) -> int:
    """calcCollChunking's chunkSize for Ring and Tree (src/enqueue.cc:2021-2028, 2093):
    ``stepSize = buffSize/NCCL_STEPS``; times chunkSteps for Ring/Simple only; LL halves it
    (half of each 16-byte line is a flag); LL128 keeps 15 of each 16 words; then aligned down
    to the protocol's grain.  The Tree/LL128 halving loop (enqueue.cc:2069-2078) only changes
    Tree's chunks, which do not decide any order (a tree folds every chunk the same way), so it
    is not ported."""
    step = buffsize // NCCL_STEPS
    steps = _CHUNK_STEPS[collective] if (proto == "simple" and algo == "ring") else 1
    size = step * steps
    if proto == "ll":
        size //= 2
    elif proto == "ll128":
        size = (size // LL128_LINEELEMS) * LL128_DATAELEMS
    grain = GRAIN[proto]
    return size // grain * grain


def cbd_split(port: Port, collective: str, proto: str, nranks: int, count: int,
              elem_size: int, task_channels: int, comm_channels: int,
              chunk: Dict[str, int]) -> Split:
    """scheduleCollTasksToPlan's split of a lone, non-CollNet, non-NVLS collective (src/
    enqueue.cc:519-686 at v2.28.9-1), starting on channel 0 with no traffic before it.

    ``task_channels``: the task's nMaxChannels (:func:`tuned_channels`); ``comm_channels``:
    comm->nChannels (nMaxChannels[kind]); ``chunk``: chunk bytes for ``"lo"``/``"mid"``/``"hi"``
    parts (the same for Ring; calcCollChunking is called per part, enqueue.cc:640-655).
    """
    if count < 1:
        raise ValueError(f"count: expected >= 1, got {count}")
    min_traffic = port.min_traffic
    tpb = traffic_per_byte(collective, nranks)
    x4 = 4 if (proto == "ll" and port.ll_x4) else 1
    # task->trafficBytes (enqueue.cc:2481), times 4 for LL (ncclPrepareTasks, enqueue.cc:419)
    task_traffic = count * elem_size * tpb * x4
    traffic = max(min_traffic, task_traffic) if port.traffic_floor else task_traffic  # :541
    nch = min(task_channels, comm_channels)                        # enqueue.cc:542-543
    # enqueue.cc:562 (max(MinTrafficPerChannel, traffic/nChannels)) or, from 2.29, v2.30.7-1
    # :618 (divUp(traffic/nChannels, 16)*16).  For a lone task the two give the same cells:
    # trafficPerCell is a multiple of 16 and at least MinTrafficPerChannel, so divUp(x,
    # trafficPerCell) is the same for x, roundUp16(x) and max(MinTraffic, x): 2.29 changes a
    # lone call only through the larger MinTrafficPerChannel (its cells).
    if port.traffic_rule == "max":
        per_channel = max(min_traffic, traffic // nch)
    else:
        per_channel = div_up(traffic // nch, 16) * 16
    channel_id = 0            # a lone task starts on channel 0 with no traffic before it
    traffic_per_byte_ = tpb * x4                                   # enqueue.cc:599-600
    if port.cell_rule == "fixed16":                                # v2.22.3-1: cellSize = 16
        cell_size = 16
    else:                                                          # enqueue.cc:601
        cell_size = div_up(div_up(min_traffic, traffic_per_byte_), 16) * 16
    per_cell = cell_size // elem_size
    cells = div_up(count * elem_size, cell_size)
    traffic_per_cell = cell_size * traffic_per_byte_
    cells_per_channel = min(cells, div_up(per_channel, traffic_per_cell))
    if channel_id + 1 == comm_channels:                            # enqueue.cc:608-612
        cells_lo = cells
    elif port.lo_divup:
        cells_lo = min(cells, div_up(per_channel, traffic_per_cell))
    else:                                                          # v2.22.3-1: a floor
        cells_lo = min(cells, per_channel // traffic_per_cell)
    n_mid = (cells - cells_lo) // cells_per_channel                # enqueue.cc:613-615
    cells_hi = (cells - cells_lo) % cells_per_channel
    n_used = (1 if cells_lo else 0) + n_mid + (1 if cells_hi else 0)
    # enqueue.cc:616-620: the plan overflowed the channels (cellsPerChannel's rounding can
    # leave one cell over: int8, 2 ranks, 131073 elements on 4 channels)
    if comm_channels < channel_id + n_used:
        n_mid = comm_channels - channel_id - 2
        cells_per_channel = (cells - cells_lo) // (n_mid + 1)
        cells_hi = cells_per_channel + (cells - cells_lo) % (n_mid + 1)
    if cells_hi == 0 and n_mid != 0:                               # enqueue.cc:621-624
        cells_hi = cells_per_channel
        n_mid -= 1
    if cells_lo == 0:                                              # enqueue.cc:625-629
        channel_id += 1
        if n_mid == 0:
            cells_lo, cells_hi = cells_hi, 0
        else:
            cells_lo = cells_per_channel
            n_mid -= 1
    count_mid = cells_per_channel * per_cell if n_mid != 0 else 0  # enqueue.cc:630-633
    count_lo = cells_lo * per_cell
    count_hi = cells_hi * per_cell
    excess = cells * per_cell - count
    if count_hi != 0:
        count_hi -= excess
    else:
        count_lo -= excess
    n_used = (1 if count_lo else 0) + n_mid + (1 if cells_hi else 0)   # enqueue.cc:635
    lo, hi = channel_id, channel_id + n_used - 1
    parts: List[Part] = []
    for c in range(lo, hi + 1):                                    # ncclCollCbdPart, device.h:317
        if c == lo:
            off, cnt, key = 0, count_lo, "lo"
        elif c == hi:
            off, cnt, key = count_lo + n_mid * count_mid, count_hi, "hi"
        else:
            off, cnt, key = count_lo + (c - lo - 1) * count_mid, count_mid, "mid"
        parts.append(Part(c, off, cnt, chunk[key] // elem_size))
    return Split(lo, hi, count_lo, count_mid, count_hi, tuple(parts), task_channels)
