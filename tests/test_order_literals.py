"""Literal cases for :mod:`ncclpy.order`, each derived by hand from NCCL's source.

Every expected value below was worked out from NCCL's code (github.com/NVIDIA/nccl, its tags),
not by running the model; the arithmetic is written next to each assertion.  "2.28.9" means
v2.28.9-1 and "2.30.7" means v2.30.7-1. Line numbers are at 2.28.9 unless they are marked
otherwise.

The rules the derivations use:

* Ring all_reduce, src/device/all_reduce.h:13-83.  A channel's part is cut into loops of
  ``nranks*chunkCount``.  In a loop shorter than that, ``chunkCount = alignUp(divUp(rem,
  nranks), 16/sizeof(T))`` (:36).  Step 0 sends ``chunk = ringIx-1`` (:43), step j reduces
  ``chunk = ringIx-j`` (:51), and ``chunk = ringIx`` is finished (postOp) (:60).  Chunk c is
  therefore folded by ring positions c+1, c+2, ..., c+n (mod n).  ``ring->index`` is the
  distance from rank 0 along next[] (init.cc:690).
* reduce_scatter.h:39-52 sends the block of ``userRanks[n-1]`` (prev) first and ends at
  ``userRanks[0]`` (self).  Rank r's block folds positions idx(r)+1 .. idx(r)+n.
  reduce.h:32-45: the rank whose prev is root sends, root ends; same positions for the root.
* Tree (all_reduce.h:149-229, connect.cc:125-172): a rank folds its own input, then down[0],
  down[1].  One rank per node: down = [d0, d1] of ncclGetDtree, skipping -1.  The model writes
  a leaf as its rank and a subtree as a nested tuple.
* Split: enqueue.cc scheduleCollTasksToPlan (2.28.9 :519-686, 2.30.7 :576-752).  Tuning:
  enqueue.cc:1888 ``while (nBytes < nc*nt*threadThreshold) nc--``.  Chunk: calcCollChunking
  :2023-2028 and :2093.  Parts: ncclCollCbdPart, include/device.h:317-342.
* AllReduce trafficPerByte = 2, ReduceScatter = nRanks, Reduce = 1 (enqueue.cc:86-93).
  Task traffic = count*elemSize*trafficPerByte (:2481).  LL does ``*= 4`` on both from
  2.26.2 (:419, :600).
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest

from ncclpy.order.config import OrderConfig
from ncclpy.order.model import OrderMap, predict
from ncclpy.order.split import Part, Split, chunk_bytes, tuned_channels
from ncclpy.order.topology import btree, default_trees, dtree, format_expr, tree_expr
from ncclpy.order.versions import CannotPredict

# On ring 0,1,2,3 (ring->index == rank), chunk c of a loop folds positions c+1 .. c+n:
C0 = (1, 2, 3, 0)
C1 = (2, 3, 0, 1)
C2 = (3, 0, 1, 2)
C3 = (0, 1, 2, 3)
# Simple Ring AR/RS chunk: 4194304/8 = 524288 B per step, x ALLREDUCE_CHUNKSTEPS (4) =
# 2097152 B = 4096 grains of 512 B; a float32 grain holds 128 -> chunkCount 524288 elements.
SIMPLE_F32 = 524288
# LL chunk: 524288/8 = 65536, /2 (flags) = 32768 B = 2048 grains of 16 B x 4 floats = 8192.
LL_F32 = 8192
BIG = float(2 ** 30)  # float32 ulp is 128 at 2^30 and 64 just below it, so 2^30 +- 1 rounds back


def runs(m: OrderMap) -> List[Tuple[int, int, object]]:
    """(first, last, fold) of each maximal run of elements that share a fold."""
    return [(s, e, m.exprs[g]) for s, e, g in m.runs()]


def cfg(coll: str, n: int, count: int, **kw: object) -> OrderConfig:
    return OrderConfig.make(coll, n, count, **kw)  # type: ignore[arg-type]


def const_inputs(values: List[float], count: int) -> List[np.ndarray]:
    return [np.full(count, v, dtype=np.float32) for v in values]


# --- 1. one channel, 3 ranks, the remainder chunk, and the values it gives -----------------
def test_three_ranks_twelve_floats_one_channel() -> None:
    # Split: channels=1, so nMaxChannels = 1 and channelId+1 == 1; all cells go to Lo
    # (enqueue.cc:608-609).  countLo = cells*epc - (cells*epc - 12) = 12.
    # Loop: loopCount = 3*524288 > 12, so chunkCount = alignUp(divUp(12,3)=4, 16/4=4) = 4
    # (:36).  Chunk 0 = 0-3 folds 1,2,0; chunk 1 = 4-7 folds 2,0,1; chunk 2 = 8-11 folds 0,1,2.
    p = predict(cfg("all_reduce", 3, 12, ring=[0, 1, 2], channels=1, version=22809))
    assert p.split == Split(0, 0, 12, 0, 0, (Part(0, 0, 12, SIMPLE_F32),), 1)
    m = p.order_map(0)
    assert runs(m) == [(0, 3, (1, 2, 0)), (4, 7, (2, 0, 1)), (8, 11, (0, 1, 2))]
    assert all(p.order_map(r) is m or runs(p.order_map(r)) == runs(m) for r in range(3))
    # x0=2^30, x1=-2^30, x2=1:  (x1+x2)+x0 = -2^30+2^30 = 0 (x1+x2 = -(2^30-1) rounds to
    # -2^30);  (x2+x0)+x1 = 2^30-2^30 = 0;  (x0+x1)+x2 = 0+1 = 1.
    outs = p.outputs(const_inputs([BIG, -BIG, 1.0], 12))
    want = np.array([0.0] * 8 + [1.0] * 4, dtype=np.float32)
    for o in outs:
        assert o.dtype == np.float32 and np.array_equal(o, want)


# --- 2. a permuted ring: positions come from setupChannel ---------------------------------
@pytest.mark.parametrize("ring", [[0, 2, 1, 3], [1, 3, 0, 2]])
def test_permuted_ring_positions(ring: List[int]) -> None:
    # next[] = 0->2->1->3->0 (both lists are the same ring).  init.cc:690 gives
    # index = (ixRank - ixZero) mod 4, the distance from rank 0, so rank 0 is at 0, rank 2 at 1,
    # rank 1 at 2 and rank 3 at 3.  16 floats: chunkCount = alignUp(divUp(16,4)=4,4) = 4.
    # chunk 0: positions 1,2,3,0 = ranks 2,1,3,0; chunk 1: 2,3,0,1 = 1,3,0,2;
    # chunk 2: 3,0,1,2 = 3,0,2,1; chunk 3: 0,1,2,3 = 0,2,1,3.
    p = predict(cfg("all_reduce", 4, 16, ring=ring, version=22809))
    assert runs(p.order_map(0)) == [(0, 3, (2, 1, 3, 0)), (4, 7, (1, 3, 0, 2)),
                                    (8, 11, (3, 0, 2, 1)), (12, 15, (0, 2, 1, 3))]
    # x0=0, x1=1, x2=2^30, x3=-2^30:
    # chunk 0 ((2^30+1)->2^30) - 2^30 + 0 = 0;  chunk 1 ((1-2^30)->-2^30) + 0 + 2^30 = 0;
    # chunk 2 (-2^30+0) + 2^30 + 1 = 1;  chunk 3 (0+2^30) + 1 -> 2^30, - 2^30 = 0.
    out = p.outputs(const_inputs([0.0, 1.0, BIG, -BIG], 16))[2]
    assert np.array_equal(out, np.array([0] * 8 + [1] * 4 + [0] * 4, dtype=np.float32))


# --- 3. the last-loop chunk is aligned to 16 bytes ----------------------------------------
def test_remainder_chunk_alignment_per_dtype() -> None:
    # float32, 4 ranks, 10 elements: alignUp(divUp(10,4)=3, 4) = 4.  Chunks 0-3, 4-7, then 8-9
    # (nelem = min(4, 10-8) = 2).  Chunk 3 has chunkOffset 12 > 10, so nelem < 0 and it is empty.
    p = predict(cfg("all_reduce", 4, 10, version=22809))
    assert runs(p.order_map(0)) == [(0, 3, C0), (4, 7, C1), (8, 9, C2)]
    # float16, 3 ranks, 20: alignUp(divUp(20,3)=7, 16/2=8) = 8 -> 0-7, 8-15, 16-19.
    # Simple chunk 2097152 B / 512 = 4096 grains x 256 halves per grain = 1048576.
    p = predict(cfg("all_reduce", 3, 20, dtype="float16", version=22809))
    assert p.split.parts == (Part(0, 0, 20, 1048576),)
    assert runs(p.order_map(0)) == [(0, 7, (1, 2, 0)), (8, 15, (2, 0, 1)), (16, 19, (0, 1, 2))]
    # float64, 3 ranks, 7: alignUp(divUp(7,3)=3, 16/8=2) = 4 -> 0-3, 4-6 (nelem = 3). Chunk 2
    # (offset 8) is empty, so fold (0,1,2) never occurs.  4096 grains x 64 doubles = 262144.
    p = predict(cfg("all_reduce", 3, 7, dtype="float64", version=22809))
    assert p.split.parts == (Part(0, 0, 7, 262144),)
    assert runs(p.order_map(0)) == [(0, 3, (1, 2, 0)), (4, 6, (2, 0, 1))]


# --- 4. several loops -----------------------------------------------------------------------
def test_ll_several_loops_one_channel() -> None:
    # 4 ranks, LL, 65636 float32, 1 channel: chunkCount 8192, loopCount 4*8192 = 32768.
    # Loops 0 and 1 (0..65535) are full, chunk c = [loop + c*8192, +8191].
    # Loop 2: rem = 65636-65536 = 100 < 32768, so chunkCount = alignUp(divUp(100,4)=25, 4) = 28.
    # The chunks start at 65536, 65564, 65592 and 65620.  The last has min(28, 100-84) = 16.
    p = predict(cfg("all_reduce", 4, 65636, proto="ll", version=22809))
    assert p.split == Split(0, 0, 65636, 0, 0, (Part(0, 0, 65636, LL_F32),), 1)
    m = p.order_map(0)
    assert runs(m) == [
        (0, 8191, C0), (8192, 16383, C1), (16384, 24575, C2), (24576, 32767, C3),
        (32768, 40959, C0), (40960, 49151, C1), (49152, 57343, C2), (57344, 65535, C3),
        (65536, 65563, C0), (65564, 65591, C1), (65592, 65619, C2), (65620, 65635, C3)]
    assert [m.expr(e) for e in (0, 8191, 8192, 32768)] == [C0, C0, C1, C0]


def test_ll128_several_loops_three_ranks() -> None:
    # LL128 chunk: 4915200/8 = 614400, /16*15 = 576000 B = 300 grains of 1920 B; a grain holds
    # 480 float32, so chunkCount = 144000 and loopCount = 3*144000 = 432000.
    # Loop 1: rem = 500000-432000 = 68000.  divUp(68000,3) = 22667, aligned to 4 gives 22668.
    # Chunks at 432000, 454668 and 477336; the last has min(22668, 68000-45336) = 22664.
    p = predict(cfg("all_reduce", 3, 500000, proto="ll128", version=22809))
    assert p.split.parts == (Part(0, 0, 500000, 144000),)
    assert runs(p.order_map(0)) == [
        (0, 143999, (1, 2, 0)), (144000, 287999, (2, 0, 1)), (288000, 431999, (0, 1, 2)),
        (432000, 454667, (1, 2, 0)), (454668, 477335, (2, 0, 1)), (477336, 499999, (0, 1, 2))]


def test_custom_simple_buffsize_sets_the_chunk() -> None:
    # NCCL_BUFFSIZE=65536: stepSize 8192, x4 = 32768 B = 64 grains x 128 = 8192 float32.
    # 3 ranks, 40000 elements: loop 0 covers 0..24575.  The rest is 15424 elements:
    # divUp(15424,3) = 5142, aligned to 4 gives 5144.  Chunks at 24576, 29720 and 34864; the
    # last has 15424-10288 = 5136.
    p = predict(cfg("all_reduce", 3, 40000, buffsizes={"simple": 65536}, version=22809))
    assert p.split.parts == (Part(0, 0, 40000, 8192),)
    assert runs(p.order_map(0)) == [
        (0, 8191, (1, 2, 0)), (8192, 16383, (2, 0, 1)), (16384, 24575, (0, 1, 2)),
        (24576, 29719, (1, 2, 0)), (29720, 34863, (2, 0, 1)), (34864, 39999, (0, 1, 2))]


# --- 7. chunk sizes (calcCollChunking :2023-2028, :2093) ------------------------------------
@pytest.mark.parametrize("coll,algo,proto,buff,want", [
    # 4194304/8 = 524288 x chunkSteps 4 (collectives.h:18, only Ring+Simple) = 2097152
    ("all_reduce", "ring", "simple", 4194304, 2097152),
    ("reduce_scatter", "ring", "simple", 4194304, 2097152),  # REDUCESCATTER_CHUNKSTEPS 4
    ("reduce", "ring", "simple", 4194304, 524288),            # REDUCE_CHUNKSTEPS 1
    ("all_reduce", "tree", "simple", 4194304, 524288),        # Tree: chunkSteps = 1
    ("all_reduce", "ring", "ll", 524288, 32768),              # 65536 / 2
    ("all_reduce", "tree", "ll", 524288, 32768),
    ("all_reduce", "ring", "ll128", 4915200, 576000),         # 614400/16*15 = 300 x 1920
    # custom sizes: 1000000/8 = 125000; x4 = 500000; aligned down to 512 B: 976*512 = 499712
    ("all_reduce", "ring", "simple", 1000000, 499712),
    ("reduce", "ring", "simple", 1000000, 124928),            # 125000 -> 244*512
    ("all_reduce", "ring", "ll", 100000, 6240),               # 12500/2 = 6250 -> 390*16
    ("all_reduce", "ring", "ll128", 1000000, 117120),         # 7812*15 = 117180 -> 61*1920
])
def test_chunk_bytes(coll: str, algo: str, proto: str, buff: int, want: int) -> None:
    assert chunk_bytes(coll, algo, proto, buff) == want


# --- channel tuning (topoGetAlgoInfo, enqueue.cc:1888; nBytes :1923) ------------------------
def test_tuned_channels_boundaries() -> None:
    # Ring Simple: nt 512, threshold 64 -> one channel per 32768 bytes.
    # 16383 floats = 65532 B < 2*32768, so nc drops to 1.  16384 floats = 65536 B is not <.
    assert tuned_channels("all_reduce", "ring", "simple", 4, 16383, 4, 2, 512, 64) == 1
    assert tuned_channels("all_reduce", "ring", "simple", 4, 16384, 4, 2, 512, 64) == 2
    # reduce_scatter: ncclFuncMaxSendRecvCount = nRanks*count (enqueue.h:36-38).
    # 4*4*4096 = 65536 keeps 2 channels; 4*4*4095 = 65520 drops to 1.
    assert tuned_channels("reduce_scatter", "ring", "simple", 4, 4096, 4, 2, 512, 64) == 2
    assert tuned_channels("reduce_scatter", "ring", "simple", 4, 4095, 4, 2, 512, 64) == 1
    # LL128 tree, 1000 floats = 4000 B < 1*640*8 -> nc goes down to 1 and stops there
    assert tuned_channels("all_reduce", "tree", "ll128", 8, 1000, 4, 4, 640, 8) == 1
    # The default tables wired through OrderConfig.  Ring LL threshold = 8*nRanks = 32
    # (tuning.cc:553): 40000 B against nc*512*32 = 16384*nc gives nc = 2 (3 would need 49152).
    # Tree LL threshold = 8: 40000 >= 8*512*8 = 32768, so all 8 channels stay.
    ll = dict(proto="ll", channels=8, version=22809)
    assert predict(cfg("all_reduce", 4, 10000, **ll)).split.task_channels == 2
    assert predict(cfg("all_reduce", 4, 10000, algo="tree", **ll)).split.task_channels == 8


# --- 4. the channel split, 4 ranks, float32 all_reduce --------------------------------------
# Per version: MinTraffic M (2.28.9 16K :529, 2.30.7 32K :585), cellSize =
# divUp(divUp(M, tpb),16)*16, epc = cellSize/4, cells = divUp(4*count, cellSize),
# trafficPerCell = cellSize*tpb; trafficPerChannel T = max(M, traffic/nc) (2.28.9 :562) or
# divUp(traffic/nc,16)*16 (2.30.7 :618) with traffic = max(M, task traffic) (:541).
S = SIMPLE_F32
SPLITS = [
    # (a) 4096, Simple, 2 channels, 2.28.9: nBytes 16384 < 2*512*64 -> nc 1.  traffic
    # 32768, T = 32768, cellSize 8192, epc 2048, cells 2, cellsPerChannel = min(2,
    # divUp(32768,16384)=2) = 2, cellsLo = min(2,2) = 2 -> nMid 0, hi 0: all 4096 on ch 0.
    ("2.28.9", 4096, "simple", 2, None, Split(0, 0, 4096, 0, 0, (Part(0, 0, 4096, S),), 1)),
    # (b) 2.30.7: T = divUp(32768/1,16)*16 = 32768, cellSize 16384, cells 1 -> all on ch 0.
    ("2.30.7", 4096, "simple", 2, None, Split(0, 0, 4096, 0, 0, (Part(0, 0, 4096, S),), 1)),
    # (c) tuner-forced 2 channels, 2.28.9: T = max(16384, 32768/2) = 16384, cells 2,
    # cellsPerChannel = divUp(16384,16384) = 1, cellsLo 1, nMid = 1/1 = 1, hi 0 -> Hi-fix
    # (:621) hi = 1, nMid 0 -> 2048 + 2048.
    ("2.28.9", 4096, "simple", 2, 2,
     Split(0, 1, 2048, 0, 2048, (Part(0, 0, 2048, S), Part(1, 2048, 2048, S)), 2)),
    # (d) same at 2.30.7: T = divUp(16384,16)*16 = 16384, cells = divUp(16384,16384) = 1,
    # trafficPerCell 32768, cellsLo = min(1, divUp(16384,32768)=1) = 1 -> one channel.
    ("2.30.7", 4096, "simple", 2, 2, Split(0, 0, 4096, 0, 0, (Part(0, 0, 4096, S),), 2)),
    # (e) 5000 Simple 2.28.9: 20000 B < 65536 -> nc 1; traffic 40000 = T; cells =
    # divUp(20000,8192) = 3; cellsLo = min(3, divUp(40000,16384)=3) = 3; countLo = 6144 -
    # (6144-5000) = 5000.
    ("2.28.9", 5000, "simple", 2, None, Split(0, 0, 5000, 0, 0, (Part(0, 0, 5000, S),), 1)),
    # (f) 2.30.7: cells = divUp(20000,16384) = 2, cellsLo = min(2, divUp(40000,32768)=2) = 2.
    ("2.30.7", 5000, "simple", 2, None, Split(0, 0, 5000, 0, 0, (Part(0, 0, 5000, S),), 1)),
    # (g) 5000 LL 2.28.9: 20000 < 2*512*32 = 32768 -> nc 1; traffic 40000*4 = 160000 = T;
    # tpb 2*4 = 8, cellSize 2048, epc 512, cells 10, trafficPerCell 16384, cellsLo =
    # divUp(160000,16384) = 10 -> countLo = 5120 - 120 = 5000.
    ("2.28.9", 5000, "ll", 2, None, Split(0, 0, 5000, 0, 0, (Part(0, 0, 5000, LL_F32),), 1)),
    # (h) 100000 Simple 2.28.9: 400000 B -> nc 2; traffic 800000, T = 400000; cells =
    # divUp(400000,8192) = 49; cellsPerChannel = divUp(400000,16384) = 25 = cellsLo;
    # nMid = 24/25 = 0, hi = 24 -> countLo 25*2048 = 51200, countHi 24*2048 - (49*2048 -
    # 100000 = 352) = 48800.
    ("2.28.9", 100000, "simple", 2, None,
     Split(0, 1, 51200, 0, 48800, (Part(0, 0, 51200, S), Part(1, 51200, 48800, S)), 2)),
    # (i) 2.30.7: cellSize 16384, epc 4096, cells = divUp(400000,16384) = 25,
    # trafficPerCell 32768, cellsPerChannel = divUp(400000,32768) = 13 = cellsLo; hi 12 ->
    # countLo 53248, countHi 49152 - (102400-100000) = 46752.
    ("2.30.7", 100000, "simple", 2, None,
     Split(0, 1, 53248, 0, 46752, (Part(0, 0, 53248, S), Part(1, 53248, 46752, S)), 2)),
    # (j) 20000 Simple 2.28.9: 80000 B -> nc 2; T = 80000; cells = divUp(80000,8192) = 10;
    # cellsPerChannel = divUp(80000,16384) = 5 = cellsLo; nMid 1, hi 0 -> Hi-fix hi 5;
    # countLo 10240, countHi 10240 - (20480-20000) = 9760.
    ("2.28.9", 20000, "simple", 2, None,
     Split(0, 1, 10240, 0, 9760, (Part(0, 0, 10240, S), Part(1, 10240, 9760, S)), 2)),
    # (k) 2.30.7: cells = divUp(80000,16384) = 5; cellsPerChannel = divUp(80000,32768) = 3
    # = cellsLo; nMid = 2/3 = 0, hi = 2 -> countLo 12288, countHi 8192 - 480 = 7712.
    ("2.30.7", 20000, "simple", 2, None,
     Split(0, 1, 12288, 0, 7712, (Part(0, 0, 12288, S), Part(1, 12288, 7712, S)), 2)),
    # (l) 10000 LL, 2.25.1 (no LL x4): 40000 B >= 32768 -> nc 2; traffic 80000, T 40000;
    # tpb 2, cellSize 8192, cells 5, cellsPerChannel = divUp(40000,16384) = 3 = cellsLo;
    # hi 2 -> countLo 6144, countHi 4096 - (10240-10000) = 3856.
    ("2.25.1", 10000, "ll", 2, None,
     Split(0, 1, 6144, 0, 3856, (Part(0, 0, 6144, LL_F32), Part(1, 6144, 3856, LL_F32)), 2)),
    # (m) 2.28.9 (LL x4): traffic 320000, T 160000; tpb 8, cellSize 2048, epc 512, cells
    # = divUp(40000,2048) = 20; cellsPerChannel = divUp(160000,16384) = 10 = cellsLo; nMid 1,
    # hi 0 -> hi 10 -> countLo 5120, countHi 5120 - (10240-10000) = 4880.
    ("2.28.9", 10000, "ll", 2, None,
     Split(0, 1, 5120, 0, 4880, (Part(0, 0, 5120, LL_F32), Part(1, 5120, 4880, LL_F32)), 2)),
    # (n) 2.30.7: cellSize = divUp(32768/8,16)*16 = 4096, cells 10, trafficPerCell 32768,
    # cellsPerChannel = divUp(160000,32768) = 5 = cellsLo; Hi-fix -> 5120 / 4880 again.
    ("2.30.7", 10000, "ll", 2, None,
     Split(0, 1, 5120, 0, 4880, (Part(0, 0, 5120, LL_F32), Part(1, 5120, 4880, LL_F32)), 2)),
    # (o) 100000 Simple, 4 channels, 2.28.9: 400000 >= 4*32768 -> nc 4; T = 200000;
    # cells 49, cellsPerChannel = divUp(200000,16384) = 13 = cellsLo; nMid = 36/13 = 2,
    # hi = 36%13 = 10 -> countLo = countMid = 26624, countHi = 20480 - 352 = 20128;
    # mid offsets 26624, 53248; hi offset 26624 + 2*26624 = 79872 (device.h:331-340).
    ("2.28.9", 100000, "simple", 4, None,
     Split(0, 3, 26624, 26624, 20128, (Part(0, 0, 26624, S), Part(1, 26624, 26624, S),
                                       Part(2, 53248, 26624, S), Part(3, 79872, 20128, S)), 4)),
    # (p) 2.30.7: cells 25, cellsPerChannel = divUp(200000,32768) = 7 = cellsLo; nMid =
    # 18/7 = 2, hi 4 -> 28672 x 3 and 16384 - 2400 = 13984 at 86016.
    ("2.30.7", 100000, "simple", 4, None,
     Split(0, 3, 28672, 28672, 13984, (Part(0, 0, 28672, S), Part(1, 28672, 28672, S),
                                       Part(2, 57344, 28672, S), Part(3, 86016, 13984, S)), 4)),
    # (q) 20001 Simple at 2.25.1: T = 80004, cells = divUp(80004,8192) = 10, cellsLo =
    # divUp(80004,16384) = 5 -> Hi-fix -> 10240 / 10240 - (20480-20001) = 9761.
    ("2.25.1", 20001, "simple", 2, None,
     Split(0, 1, 10240, 0, 9761, (Part(0, 0, 10240, S), Part(1, 10240, 9761, S)), 2)),
]


@pytest.mark.parametrize("version,count,proto,channels,forced,want", SPLITS)
def test_split(version: str, count: int, proto: str, channels: int, forced: object,
               want: Split) -> None:
    c = cfg("all_reduce", 4, count, proto=proto, channels=channels, version=version,
            task_channels=forced)
    assert predict(c).split == want


def test_split_folds_two_channels_simple() -> None:
    # Case (h): ch 0 = 0..51199 with chunkCount alignUp(51200/4,4) = 12800; ch 1 = 51200..
    # 99999 with alignUp(48800/4,4) = 12200 (each channel restarts its chunks at its offset).
    m = predict(cfg("all_reduce", 4, 100000, channels=2, version=22809)).order_map(0)
    assert runs(m) == [(0, 12799, C0), (12800, 25599, C1), (25600, 38399, C2),
                       (38400, 51199, C3), (51200, 63399, C0), (63400, 75599, C1),
                       (75600, 87799, C2), (87800, 99999, C3)]
    # Case (i) at 2.30.7: 53248/4 = 13312 and 46752/4 = 11688.
    m = predict(cfg("all_reduce", 4, 100000, channels=2, version="2.30.7")).order_map(0)
    assert runs(m) == [(0, 13311, C0), (13312, 26623, C1), (26624, 39935, C2),
                       (39936, 53247, C3), (53248, 64935, C0), (64936, 76623, C1),
                       (76624, 88311, C2), (88312, 99999, C3)]


def test_split_folds_forced_two_channels_differ_by_version() -> None:
    # Case (c): 2048 per channel, chunk alignUp(2048/4,4) = 512.  Case (d): 4096 on ch 0, 1024.
    kw = dict(channels=2, task_channels=2)
    m = predict(cfg("all_reduce", 4, 4096, version=22809, **kw)).order_map(0)
    assert runs(m) == [(0, 511, C0), (512, 1023, C1), (1024, 1535, C2), (1536, 2047, C3),
                       (2048, 2559, C0), (2560, 3071, C1), (3072, 3583, C2), (3584, 4095, C3)]
    m = predict(cfg("all_reduce", 4, 4096, version=23007, **kw)).order_map(0)
    assert runs(m) == [(0, 1023, C0), (1024, 2047, C1), (2048, 3071, C2), (3072, 4095, C3)]


def test_split_folds_ll_two_channels_with_loops() -> None:
    # 100000 LL, 2.28.9: nc 2; traffic 800000*4 = 3200000, T = 1600000; cellSize 2048, epc
    # 512, cells = divUp(400000,2048) = 196; cellsPerChannel = divUp(1600000,16384) = 98 =
    # cellsLo; nMid 1, hi 0 -> Hi-fix: 50176 / 50176 - (100352-100000) = 49824.
    p = predict(cfg("all_reduce", 4, 100000, proto="ll", channels=2, version=22809))
    assert p.split == Split(0, 1, 50176, 0, 49824,
                            (Part(0, 0, 50176, LL_F32), Part(1, 50176, 49824, LL_F32)), 2)
    # ch 0: loop 0 = 0..32767 in 8192s; rem 17408 -> chunk 4352 (32768, 37120, 41472, 45824).
    # ch 1 from 50176: loop 0 to 82943; rem 49824-32768 = 17056 -> chunk 4264 (82944, 87208,
    # 91472, 95736).
    assert runs(p.order_map(3)) == [
        (0, 8191, C0), (8192, 16383, C1), (16384, 24575, C2), (24576, 32767, C3),
        (32768, 37119, C0), (37120, 41471, C1), (41472, 45823, C2), (45824, 50175, C3),
        (50176, 58367, C0), (58368, 66559, C1), (66560, 74751, C2), (74752, 82943, C3),
        (82944, 87207, C0), (87208, 91471, C1), (91472, 95735, C2), (95736, 99999, C3)]


# --- 5. reduce_scatter and reduce --------------------------------------------------------------
def test_reduce_scatter_two_channels_two_rings() -> None:
    # 2.28.9, 4 ranks, 5000 per rank: nBytes 4*4*5000 = 80000 -> nc 2.  traffic 5000*4*4 =
    # 80000, T 40000; tpb 4 -> cellSize 4096, epc 1024, cells = divUp(20000,4096) = 5;
    # cellsPerChannel = divUp(40000,16384) = 3 = cellsLo; hi 2 -> 3072 / 2048 - 120 = 1928.
    rings = [[0, 1, 2, 3], [0, 2, 3, 1]]
    p = predict(cfg("reduce_scatter", 4, 5000, rings=rings, channels=2, version=22809))
    assert p.split == Split(0, 1, 3072, 0, 1928, (Part(0, 0, 3072, S), Part(1, 3072, 1928, S)), 2)
    # Rank r's block folds positions idx(r)+1 .. idx(r)+4.  Ring B (0,2,3,1): idx 0:0 2:1 3:2
    # 1:3.  r0: B positions 1,2,3,0 = 2,3,1,0.  r1 (idx 3): 0,1,2,3 = 0,2,3,1.
    # r2 (idx 1): 2,3,0,1 = 3,1,0,2.  r3 (idx 2): 3,0,1,2 = 1,0,2,3.
    want = {0: ((1, 2, 3, 0), (2, 3, 1, 0)), 1: ((2, 3, 0, 1), (0, 2, 3, 1)),
            2: ((3, 0, 1, 2), (3, 1, 0, 2)), 3: ((0, 1, 2, 3), (1, 0, 2, 3))}
    for r, (a, b) in want.items():
        assert runs(p.order_map(r)) == [(0, 3071, a), (3072, 4999, b)]
    # Block 0 values x0=0, x1=1, x2=2^30, x3=-2^30:
    # ring A ((1+2^30)->2^30) - 2^30 + 0 = 0;  ring B (2^30-2^30) + 1 + 0 = 1.
    ins = [np.zeros(20000, dtype=np.float32) for _ in range(4)]
    for k, v in enumerate([0.0, 1.0, BIG, -BIG]):
        ins[k][:5000] = v
    out0 = p.outputs(ins)[0]
    assert np.array_equal(out0, np.array([0] * 3072 + [1] * 1928, dtype=np.float32))


def test_reduce_scatter_split_2307() -> None:
    # traffic 80000, T = divUp(40000,16)*16 = 40000; cellSize divUp(32768/4,16)*16 = 8192,
    # epc 2048, cells = divUp(20000,8192) = 3, trafficPerCell 32768, cellsPerChannel =
    # divUp(40000,32768) = 2 = cellsLo; hi 1 -> 4096 / 2048 - (6144-5000) = 904.
    p = predict(cfg("reduce_scatter", 4, 5000, channels=2, version="2.30.7"))
    assert p.split == Split(0, 1, 4096, 0, 904, (Part(0, 0, 4096, S), Part(1, 4096, 904, S)), 2)


def test_reduce_root_fold() -> None:
    # Ring 0,2,1,3, root 1 (idx 2): rank 3 (prev == root) sends (reduce.h:32), then 0, 2, and
    # root 1 finishes: (3,0,2,1).  Reduce Simple chunk 524288 B -> 131072 floats.  tpb 1,
    # cellSize 16384, cells 1, one channel -> countLo 1000.  Non-roots have no reduction.
    p = predict(cfg("reduce", 4, 1000, ring=[0, 2, 1, 3], root=1, version=22809))
    assert p.split == Split(0, 0, 1000, 0, 0, (Part(0, 0, 1000, 131072),), 1)
    assert runs(p.order_map(1)) == [(0, 999, (3, 0, 2, 1))]
    assert [p.order_map(r) for r in (0, 2, 3)] == [None, None, None]
    # Two channels, root 0, rings 0,1,2,3 and 3,2,1,0.  nc 2; traffic 400000, T 200000;
    # cellSize 16384, epc 4096, cells 25; cellsLo = divUp(200000,16384) = 13, hi 12 ->
    # 53248 / 49152 - 2400 = 46752.  Ring B: next[0] = 3, so 3 sends, then 2, 1, and 0.
    p = predict(cfg("reduce", 4, 100000, rings=[[0, 1, 2, 3], [3, 2, 1, 0]], channels=2,
                    version=22809))
    assert p.split == Split(0, 1, 53248, 0, 46752,
                            (Part(0, 0, 53248, 131072), Part(1, 53248, 46752, 131072)), 2)
    assert runs(p.order_map(0)) == [(0, 53247, (1, 2, 3, 0)), (53248, 99999, (3, 2, 1, 0))]


# --- 6. trees (trees.cc:31-109, connect.cc:125-172) ------------------------------------------
def test_btree_and_dtree_4_and_5_ranks() -> None:
    # btree(4): r1 bit 1, up = 0|2 = 2, leaf, type 0 (1<2).  r2 bit 2, up = 0|4 = 4 >= 4, so
    # up = 2^2 = 0, type 1, downs 2-1 = 1 and 2+1 = 3.  r3 up = 2|2 = 2, type 1.
    # r0: bit runs to 4, d1 = 4>>1 = 2.
    assert [btree(4, r) for r in (1, 2, 3)] == [(2, -1, -1, 0), (0, 1, 3, 1), (2, -1, -1, 1)]
    assert btree(4, 0)[:3] == (-1, -1, 2)
    # tree 1 for an even count mirrors: btree(4, 3-r) mapped x -> 3-x.
    assert [dtree(4, r) for r in range(4)] == [
        ((-1, -1, 2), (1, -1, -1)), ((2, -1, -1), (3, 2, 0)),
        ((0, 1, 3), (1, -1, -1)), ((2, -1, -1), (-1, -1, 1))]
    # btree(5): r0 d1 = 8>>1 = 4.  r4: up 8 >= 5 -> 0, d0 = 2, d1 = 6 -> 5 -> -1 (the lowbit
    # loop).  r2: up 4, downs 1, 3.  An odd count shifts: btree(5, r-1), then +1 mod 5.
    assert [dtree(5, r) for r in range(5)] == [
        ((-1, -1, 4), (1, 3, -1)), ((2, -1, -1), (-1, -1, 0)), ((4, 1, 3), (3, -1, -1)),
        ((2, -1, -1), (0, 2, 4)), ((0, 2, -1), (3, -1, -1))]


def test_default_trees_and_their_folds() -> None:
    # Channel c has tree 0; its copy c+nChannels has tree 1 (connect.cc:72, :150-162).  One
    # rank per node has no intra-node child, so setTreeDown appends d0, then d1, skipping -1.
    t4 = default_trees(4, 2)
    assert t4[0] == ((-1, (2,)), (2, ()), (0, (1, 3)), (2, ()))
    assert t4[1] == ((1, ()), (3, (2, 0)), (1, ()), (-1, (1,)))
    # Fold: own input first, then down[0], down[1].
    assert tree_expr(t4[0]) == (0, (2, 1, 3))   # x0 + ((x2+x1)+x3)
    assert tree_expr(t4[1]) == (3, (1, 2, 0))   # x3 + ((x1+x2)+x0)
    t5 = default_trees(5, 2)
    assert tree_expr(t5[0]) == (0, (4, (2, 1, 3)))
    assert tree_expr(t5[1]) == (1, (0, (3, 2, 4)))
    assert format_expr((2, 3, 0, 1)) == "((2 + 3) + 0) + 1"


def test_tree_two_channels_split_and_values() -> None:
    # Tree Simple: nt 512, threshold 64, so 400000 B keeps nc 2.  The split does not depend on
    # the algorithm (AllReduce tpb 2): 51200 / 48800 as in case (h).  Tree chunk 524288 B
    # (chunkSteps 1) -> 131072 floats.
    p = predict(cfg("all_reduce", 4, 100000, algo="tree", channels=2, version=22809))
    assert p.split == Split(0, 1, 51200, 0, 48800,
                            (Part(0, 0, 51200, 131072), Part(1, 51200, 48800, 131072)), 2)
    assert runs(p.order_map(2)) == [(0, 51199, (0, (2, 1, 3))), (51200, 99999, (3, (1, 2, 0)))]
    # 5 ranks: same split.  x0=x4=0, x1=1, x2=2^30, x3=-2^30.
    # Tree 0: ((x2+x1)->2^30) + x3 = 0, then x4 + 0 = 0, x0 + 0 = 0.
    # Tree 1: (x3+x2) = 0, + x4 = 0, x0 + 0 = 0, x1 + 0 = 1.
    p = predict(cfg("all_reduce", 5, 100000, algo="tree", channels=2, version=22809))
    outs = p.outputs(const_inputs([0.0, 1.0, BIG, -BIG, 0.0], 100000))
    want = np.array([0] * 51200 + [1] * 48800, dtype=np.float32)
    assert all(np.array_equal(o, want) for o in outs)


# --- 8. the 2.22.3 port --------------------------------------------------------------------
def test_port_2223_cells_of_16_bytes_and_floor() -> None:
    # v2.22.3-1 enqueue.cc:604 traffic += 160008 (no floor); :614 MinTraffic 512; :626
    # T = max(512, 160008/2) = 80004; :657 cellSize 16 -> epc 4, cells = divUp(80004,16) =
    # 5001, trafficPerCell 32; :663 cellsPerChannel = divUp(80004,32) = 2501; :668 cellsLo =
    # min(5001, 80004/32 = 2500) (a floor); nMid = 2501/2501 = 1, hi 0 -> Hi-fix hi 2501
    # -> countLo 10000, countHi 10004 - (20004-20001) = 10001.
    p = predict(cfg("all_reduce", 4, 20001, channels=2, version="2.22.3"))
    assert p.split == Split(0, 1, 10000, 0, 10001,
                            (Part(0, 0, 10000, S), Part(1, 10000, 10001, S)), 2)
    # ch 0: chunk alignUp(2500,4) = 2500.  ch 1: divUp(10001,4) = 2501, aligned to 4 gives
    # 2504; chunks at 10000, 12504, 15008, 17512 (the last has 10001-7512 = 2489).
    assert runs(p.order_map(0)) == [
        (0, 2499, C0), (2500, 4999, C1), (5000, 7499, C2), (7500, 9999, C3),
        (10000, 12503, C0), (12504, 15007, C1), (15008, 17511, C2), (17512, 20000, C3)]


# --- 9. refusals ----------------------------------------------------------------------------
def test_refusals() -> None:
    # 2.21.5 splits on the host without ncclCollCbdPart (survey §1, §6), so it is not ported.
    with pytest.raises(CannotPredict):
        predict(cfg("all_reduce", 4, 1000, version="2.21.5"))
    # There is no Tree kernel for reduce_scatter or reduce (survey §3).
    with pytest.raises(CannotPredict):
        predict(cfg("reduce_scatter", 4, 1000, algo="tree", version=22809))
    with pytest.raises(CannotPredict):
        predict(cfg("reduce", 4, 1000, algo="tree", version=22809))
