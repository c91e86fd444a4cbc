"""A transliteration of NCCL's code for one Ring/Tree reduction, sharing nothing with
ncclpy.order: every rank's device loop runs as a generator over FIFO connections carrying
symbolic values, so what each output element holds is the expression NCCL's kernels build,
operand placement included.  Used by tests/test_order_translit.py to check the model.

Ported line by line from NCCL v2.28.9-1 (file:line in comments; where v2.22.3, v2.23.4, v2.26.2
and v2.29.2 differ, the version decides):
host: scheduleCollTasksToPlan (enqueue.cc:519-686), topoGetAlgoInfo's channel tuning
(enqueue.cc:1864-1890), calcCollChunking (enqueue.cc:1979-2093), ncclCollCbdPart (device.h:
317-342); device: all_reduce.h runRing (13-83) and runTreeSplit (149-229), reduce_scatter.h
runRing (13-54), reduce.h runRing (13-52); the primitives' reduce operand order: Simple
acc = src[0] (the input) then op(acc, peer_i) (common_kernel.h:93-146, prims_simple.h:233),
LL op(peer0, local) then op(peer_i, acc) (prims_ll.h:252-266), LL128 likewise
(prims_ll128.h:223-252).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, Generator, List, Optional, Sequence, Tuple

import numpy as np

NCCL_STEPS = 8
GRAIN = {"ll": 16, "ll128": 32 * 8 // 16 * 15 * 8, "simple": 512}


# -- symbolic values ------------------------------------------------------------------------
class Val:
    """A message or buffer slice: per element a structure id (the expression with the inputs'
    indices left out) and the input index every leaf of it reads (-2: leaves disagree)."""

    __slots__ = ("sid", "idx")

    def __init__(self, sid: np.ndarray, idx: np.ndarray) -> None:
        self.sid, self.idx = sid, idx


class Syms:
    """Hash-consed expression structures: id -> ('x', rank) | ('+', left_id, right_id)."""

    def __init__(self) -> None:
        self.nodes: List[tuple] = []
        self.ids: Dict[tuple, int] = {}

    def make(self, node: tuple) -> int:
        i = self.ids.get(node)
        if i is None:
            i = self.ids[node] = len(self.nodes)
            self.nodes.append(node)
        return i

    def leaves(self, rank: int, start: int, n: int) -> Val:
        leaf = self.make(("x", rank))
        return Val(np.full(n, leaf, dtype=np.int64), np.arange(start, start + n, dtype=np.int64))

    def add(self, left: Val, right: Val) -> Val:
        """Element-wise op(left, right), interning each distinct pair of structures once; an
        add of two different input indices marks the element (-2)."""
        if left.sid.size == 0:
            return Val(left.sid.copy(), left.idx.copy())
        key = left.sid * (1 << 31) + right.sid
        first = key[0]
        if (key == first).all():                 # the common case: one structure per chunk
            uniq, inv = key[:1], np.zeros(key.size, dtype=np.int64)
        else:
            uniq, inv = np.unique(key, return_inverse=True)
        ids = np.array([self.make(("+", int(k) >> 31, int(k) & ((1 << 31) - 1)))
                        for k in uniq], dtype=np.int64)
        idx = np.where(left.idx == right.idx, left.idx, -2)
        return Val(ids[inv.reshape(-1)], idx)

    def canon(self, i: int, memo: Dict[int, tuple]) -> tuple:
        """Commutative canonical form (operand order forgotten: IEEE + does not see it)."""
        if i in memo:
            return memo[i]
        node = self.nodes[i]
        if node[0] == "x":
            out: tuple = ("x", node[1])
        else:
            a, b = self.canon(node[1], memo), self.canon(node[2], memo)
            out = ("+",) + tuple(sorted((a, b)))
        memo[i] = out
        return out


# -- host side -------------------------------------------------------------------------------
def div_up(x: int, y: int) -> int:
    return (x + y - 1) // y


def traffic_per_byte(func: str, nranks: int) -> int:             # enqueue.cc:86-93
    if func == "AllReduce":
        return 2
    if func == "ReduceScatter":
        return nranks
    return 1


def topo_nc(func: str, nranks: int, count: int, elt: int, comm_nch: int, nt: int,
            thr: int) -> int:                                       # enqueue.cc:1864-1890
    nBytes = elt * (nranks * count if func == "ReduceScatter" else count)
    nc = comm_nch
    while nBytes < nc * nt * thr:
        if nc >= 2:
            nc -= 1
        else:
            break
    return nc


def calc_coll_chunking(func: str, algo: str, proto: str, buff: int, nBytes: int,
                       nNodes: int, nRanks: int) -> int:          # enqueue.cc:1979-2093
    grainSize = GRAIN[proto]
    stepSize = buff // NCCL_STEPS
    chunkSteps = ({"AllReduce": 4, "ReduceScatter": 4, "Reduce": 1}[func]
                  if (proto == "simple" and algo == "ring") else 1)
    chunkSize = stepSize * chunkSteps
    if proto == "ll":
        chunkSize //= 2
    if proto == "ll128":
        chunkSize = (chunkSize // 16) * 15
    if algo == "tree" and proto == "ll128":
        ppn = np.float32(nRanks / np.float32(nNodes))
        nstepsLL128 = np.float32(1 + int(math.log2(nNodes)) + 0.1 * float(ppn))
        nChannels = 1
        while nBytes // (nChannels * chunkSize) < np.float32(nstepsLL128 * 64 / ppn) \
                and chunkSize > 131072:
            chunkSize //= 2
        while nBytes // (nChannels * chunkSize) < np.float32(nstepsLL128 * 16 / ppn) \
                and chunkSize > 32768:
            chunkSize //= 2
    chunkSize = chunkSize // grainSize * grainSize
    return chunkSize


def schedule(func: str, algo: str, proto: str, nranks: int, count: int, elt: int,
             task_nch: int, comm_nch: int, buff: int, version: int, nNodes: int) -> dict:
    """The devWork of a lone task (enqueue.cc:519-686 at v2.28.9-1; v2.22.3-1, v2.23.4-1,
    v2.26.2-1 and v2.29.2-1 as marked)."""
    if version >= 22902:
        MinTrafficPerChannel = 32 << 10                             # v2.30.7-1 :585
    elif version >= 22304:
        MinTrafficPerChannel = 16 << 10                             # :529
    else:
        MinTrafficPerChannel = 512                                  # v2.22.3-1
    trafficBytes_task = count * elt * traffic_per_byte(func, nranks)
    if proto == "ll" and version >= 22602:
        trafficBytes_task *= 4                                       # enqueue.cc:419
    if version >= 22304:
        trafficBytes = max(MinTrafficPerChannel, trafficBytes_task)  # :541
    else:
        trafficBytes = trafficBytes_task                             # v2.22.3-1
    nChannels = min(task_nch, comm_nch)
    nMaxChannels = comm_nch
    if version >= 22902:
        trafficPerChannel = div_up(trafficBytes // nChannels, 16) * 16   # v2.30.7-1 :618
    else:
        trafficPerChannel = max(MinTrafficPerChannel, trafficBytes // nChannels)  # :562
    channelId = 0
    currentTraffic = 0
    trafficPerByte = traffic_per_byte(func, nranks)
    if proto == "ll" and version >= 22602:
        trafficPerByte *= 4                                          # :600
    if version >= 22304:
        cellSize = div_up(div_up(MinTrafficPerChannel, trafficPerByte), 16) * 16   # :601
    else:
        cellSize = 16
    elementsPerCell = cellSize // elt
    cells = div_up(count * elt, cellSize)
    trafficPerCell = cellSize * trafficPerByte
    cellsPerChannel = min(cells, div_up(trafficPerChannel, trafficPerCell))
    if channelId + 1 == nMaxChannels:
        cellsLo = cells
    elif version >= 22304:
        cellsLo = min(cells, div_up((trafficPerChannel - currentTraffic), trafficPerCell))
    else:
        cellsLo = min(cells, (trafficPerChannel - currentTraffic) // trafficPerCell)
    nMidChannels = (cells - cellsLo) // cellsPerChannel
    cellsHi = (cells - cellsLo) % cellsPerChannel
    nCh = (1 if cellsLo != 0 else 0) + nMidChannels + (1 if cellsHi != 0 else 0)
    if nMaxChannels < channelId + nCh:
        nMidChannels = nMaxChannels - channelId - 2
        cellsPerChannel = (cells - cellsLo) // (nMidChannels + 1)
        cellsHi = cellsPerChannel + (cells - cellsLo) % (nMidChannels + 1)
    if cellsHi == 0 and nMidChannels != 0:
        cellsHi = cellsPerChannel
        nMidChannels -= 1
    if cellsLo == 0:
        channelId += 1
        if nMidChannels == 0:
            cellsLo, cellsHi = cellsHi, 0
        else:
            cellsLo = cellsPerChannel
            nMidChannels -= 1
    countMid = cellsPerChannel * elementsPerCell if nMidChannels != 0 else 0
    countLo = cellsLo * elementsPerCell
    countHi = cellsHi * elementsPerCell
    if countHi != 0:
        countHi -= cells * elementsPerCell - count
    else:
        countLo -= cells * elementsPerCell - count
    nCh = (1 if countLo != 0 else 0) + nMidChannels + (1 if cellsHi != 0 else 0)
    gbpe = elt * (nranks if func == "ReduceScatter" else 1)
    grain = GRAIN[proto]
    work = {"channelLo": channelId, "channelHi": channelId + nCh - 1, "countLo": countLo,
            "countMid": countMid, "countHi": countHi}
    for key, cnt in (("Lo", countLo), ("Hi", countHi), ("Mid", countMid)):
        work["chunkGrains" + key] = calc_coll_chunking(func, algo, proto, buff, gbpe * cnt,
                                                       nNodes, nranks) // grain
    return work


def cbd_part(work: dict, channelId: int, proto: str, eltSize: int) -> Tuple[int, int, int]:
    """ncclCollCbdPart (device.h:317-342): (partOffset, partCount, chunkCount)."""
    eltPerGrain = GRAIN[proto] // eltSize
    nMidChannels = work["channelHi"] - work["channelLo"] - 1
    if channelId == work["channelLo"]:
        return 0, work["countLo"], work["chunkGrainsLo"] * eltPerGrain
    if channelId == work["channelHi"]:
        return (work["countLo"] + nMidChannels * work["countMid"], work["countHi"],
                work["chunkGrainsHi"] * eltPerGrain)
    mid = channelId - work["channelLo"] - 1
    return (work["countLo"] + mid * work["countMid"], work["countMid"],
            work["chunkGrainsMid"] * eltPerGrain)


# -- device side -----------------------------------------------------------------------------
Msg = Val
Gen = Generator[Tuple[str, tuple], Optional[Msg], None]


class Net:
    """FIFO connections: (channel, src, dst, tag) -> queue of messages (arrays of sym ids)."""

    def __init__(self) -> None:
        self.q: Dict[tuple, Deque[Msg]] = {}

    def send(self, key: tuple, msg: Msg) -> None:
        self.q.setdefault(key, deque()).append(msg)

    def ready(self, key: tuple) -> bool:
        return bool(self.q.get(key))

    def take(self, key: tuple) -> Msg:
        return self.q[key].popleft()


class Prims:
    """One thread group's Primitives: recv peers, send peers, the rank's buffers."""

    def __init__(self, rank: "Rank", ch: int, recv: Sequence[int], send: Sequence[int],
                 tag: str) -> None:
        # the constructors count peers up to the first -1 (prims_simple.h:602-604,
        # prims_ll.h:342-348, prims_ll128.h:372-377)
        self.r, self.ch, self.tag = rank, ch, tag
        self.recv = [p for p in _until_neg(recv)]
        self.send_to = [p for p in _until_neg(send)]

    # the data-moving steps; nelem <= 0 still makes a (empty) step, as NCCL posts steps
    def _n(self, nelem: int) -> int:
        return max(0, nelem)

    def _input(self, ix: int, nelem: int) -> Val:
        sl = slice(ix, ix + self._n(nelem))
        return Val(self.r.inp.sid[sl], self.r.inp.idx[sl])

    def _recv_all(self) -> Gen:
        msgs = []
        for p in self.recv:
            msg = yield ("recv", (self.ch, p, self.r.rank, self.tag))
            msgs.append(msg)
        return msgs

    def _reduce(self, local: Msg, peers: List[Msg]) -> Msg:
        sy = self.r.sy
        if self.r.proto == "simple":        # acc = src[0]; acc = op(acc, src[i])
            acc = local
            for m in peers:
                acc = sy.add(acc, m)
            return acc
        acc = sy.add(peers[0], local)       # LL/LL128: op(peer0, local), op(peer_i, acc)
        for m in peers[1:]:
            acc = sy.add(m, acc)
        return acc

    def _send(self, msg: Msg) -> None:
        for p in self.send_to:
            self.r.net.send((self.ch, self.r.rank, p, self.tag), msg)

    def send(self, ix: int, nelem: int) -> Gen:
        self._send(self._input(ix, nelem))
        return
        yield

    def recv_reduce_send(self, ix: int, nelem: int) -> Gen:
        peers = yield from self._recv_all()
        self._send(self._reduce(self._input(ix, nelem), peers))

    def recv_reduce_copy(self, ix: int, ox: int, nelem: int, send: bool) -> Gen:
        peers = yield from self._recv_all()
        acc = self._reduce(self._input(ix, nelem), peers)
        self.r.write(ox, acc)
        if send:
            self._send(acc)

    def recv_copy(self, ox: int, nelem: int, send: bool) -> Gen:
        (msg,) = yield from self._recv_all()
        self.r.write(ox, msg)
        if send:
            self._send(msg)


def _until_neg(peers: Sequence[int]) -> List[int]:
    out = []
    for p in peers:
        if p < 0:
            break
        out.append(p)
    return out


class Rank:
    """One rank: its buffers, per-channel ring (index, prev, next, userRanks) and tree."""

    def __init__(self, rank: int, nranks: int, sy: Syms, net: Net, proto: str, inp_count: int,
                 out_count: int) -> None:
        self.rank, self.nranks, self.sy, self.net, self.proto = rank, nranks, sy, net, proto
        self.inp = sy.leaves(rank, 0, inp_count)
        self.out = Val(np.full(out_count, -1, dtype=np.int64),
                       np.full(out_count, -1, dtype=np.int64))

    def write(self, ox: int, v: Val) -> None:
        n = v.sid.size
        self.out.sid[ox:ox + n] = v.sid
        self.out.idx[ox:ox + n] = v.idx


def setup_ring(ring_ranks: Sequence[int], rank: int) -> dict:
    """setupChannel (init.cc:679-694)."""
    n = len(ring_ranks)
    ixZero = ixRank = 0
    for i in range(n):
        if ring_ranks[i] == 0:
            ixZero = i
        if ring_ranks[i] == rank:
            ixRank = i
    return {"index": (ixRank - ixZero + n) % n,
            "userRanks": [ring_ranks[(i + ixRank) % n] for i in range(n)],
            "prev": ring_ranks[(ixRank - 1) % n], "next": ring_ranks[(ixRank + 1) % n]}


def ring_all_reduce(r: Rank, ch: int, ring: dict, work: dict, proto: str, elt: int) -> Gen:
    """all_reduce.h:13-83."""
    ringIx = ring["index"]
    nranks = r.nranks
    gridOffset, channelCount, chunkCount = cbd_part(work, ch, proto, elt)
    loopCount = nranks * chunkCount
    prims = Prims(r, ch, [ring["prev"]], [ring["next"]], "ring")
    for elemOffset in range(0, channelCount, loopCount):
        remCount = channelCount - elemOffset
        if remCount < loopCount:
            chunkCount = div_up(div_up(remCount, nranks), 16 // elt) * (16 // elt)

        def mod_ranks(x: int) -> int:
            return x - (nranks if x >= nranks else 0)

        def where(chunk: int) -> Tuple[int, int]:
            chunkOffset = chunk * chunkCount
            return gridOffset + elemOffset + chunkOffset, min(chunkCount, remCount - chunkOffset)
        offset, nelem = where(mod_ranks(ringIx + nranks - 1))
        yield from prims.send(offset, nelem)
        for j in range(2, nranks):
            offset, nelem = where(mod_ranks(ringIx + nranks - j))
            yield from prims.recv_reduce_send(offset, nelem)
        offset, nelem = where(ringIx + 0)
        yield from prims.recv_reduce_copy(offset, offset, nelem, send=True)
        for j in range(1, nranks - 1):
            offset, nelem = where(mod_ranks(ringIx + nranks - j))
            yield from prims.recv_copy(offset, nelem, send=True)
        offset, nelem = where(mod_ranks(ringIx + 1))
        yield from prims.recv_copy(offset, nelem, send=False)


def tree_split(r: Rank, ch: int, tree: Tuple[int, Tuple[int, ...]], work: dict, proto: str,
               elt: int, group: str) -> Gen:
    """runTreeSplit (all_reduce.h:149-229); ``group``: "reduce" or "bcast" (the two thread
    groups of a non-root rank run at once, each on its own connections)."""
    up, downs = tree
    down = list(downs) + [-1] * (3 - len(downs))
    gridOffset, channelCount, chunkCount = cbd_part(work, ch, proto, elt)
    if up == -1:
        if group != "reduce":
            return
        prims = Prims(r, ch, down[:2], down[:2], "")   # FanSymmetric<NCCL_MAX_TREE_ARITY_TOP>
        for elemOffset in range(0, channelCount, chunkCount):
            offset = gridOffset + elemOffset
            nelem = min(chunkCount, channelCount - elemOffset)
            yield from _tree_root_step(prims, offset, nelem)
    elif group == "reduce":
        prims = Prims(r, ch, down, [up], "up")
        for elemOffset in range(0, channelCount, chunkCount):
            offset = gridOffset + elemOffset
            nelem = min(chunkCount, channelCount - elemOffset)
            if down[0] == -1:
                yield from prims.send(offset, nelem)
            else:
                yield from prims.recv_reduce_send(offset, nelem)
    else:
        prims = Prims(r, ch, [up], down, "down")
        for elemOffset in range(0, channelCount, chunkCount):
            offset = gridOffset + elemOffset
            nelem = min(chunkCount, channelCount - elemOffset)
            yield from prims.recv_copy(offset, nelem, send=down[0] != -1)


def _tree_root_step(prims: Prims, offset: int, nelem: int) -> Gen:
    """The root's directRecvReduceCopyDirectSend: recv from the children on the "up" tag,
    send the result to them on the "down" tag."""
    peers = []
    for p in prims.recv:
        msg = yield ("recv", (prims.ch, p, prims.r.rank, "up"))
        peers.append(msg)
    acc = prims._reduce(prims._input(offset, nelem), peers)
    prims.r.write(offset, acc)
    for p in prims.send_to:
        prims.r.net.send((prims.ch, prims.r.rank, p, "down"), acc)


def ring_reduce_scatter(r: Rank, ch: int, ring: dict, work: dict, proto: str, elt: int,
                        count: int) -> Gen:
    """reduce_scatter.h:13-54 (count: ncclCollCbdPart's total, each rank's block)."""
    ringRanks = ring["userRanks"]
    nranks = r.nranks
    gridOffset, channelCount, chunkCount = cbd_part(work, ch, proto, elt)
    prims = Prims(r, ch, [ring["prev"]], [ring["next"]], "ring")
    for elemOffset in range(0, channelCount, chunkCount):
        nelem = min(chunkCount, channelCount - elemOffset)
        dataOffset = gridOffset + elemOffset
        rankDest = ringRanks[nranks - 1]
        yield from prims.send(dataOffset + rankDest * count, nelem)
        for j in range(2, nranks):
            rankDest = ringRanks[nranks - j]
            yield from prims.recv_reduce_send(dataOffset + rankDest * count, nelem)
        rankDest = ringRanks[0]
        yield from prims.recv_reduce_copy(dataOffset + rankDest * count, dataOffset, nelem,
                                          send=False)


def ring_reduce(r: Rank, ch: int, ring: dict, work: dict, proto: str, elt: int,
                root: int) -> Gen:
    """reduce.h:13-52."""
    prevRank = ring["userRanks"][r.nranks - 1]
    gridOffset, channelCount, chunkCount = cbd_part(work, ch, proto, elt)
    prims = Prims(r, ch, [ring["prev"]], [ring["next"]], "ring")
    for elemOffset in range(0, channelCount, chunkCount):
        offset = gridOffset + elemOffset
        nelem = min(chunkCount, channelCount - elemOffset)
        if prevRank == root:
            yield from prims.send(offset, nelem)
        elif r.rank == root:
            yield from prims.recv_reduce_copy(offset, offset, nelem, send=False)
        else:
            yield from prims.recv_reduce_send(offset, nelem)


def run_all(net: Net, gens: List[Gen]) -> None:
    """Round-robin the generators; a recv waits until its FIFO has a message."""
    waiting: List[Tuple[Gen, Optional[tuple]]] = [(g, None) for g in gens]
    while waiting:
        progressed = False
        nxt = []
        for g, want in waiting:
            try:
                if want is None:
                    req = next(g)
                elif net.ready(want):
                    req = g.send(net.take(want))
                else:
                    nxt.append((g, want))
                    continue
                progressed = True
                nxt.append((g, req[1]))
            except StopIteration:
                progressed = True
        waiting = nxt
        if not progressed:
            raise RuntimeError(f"deadlock: {len(waiting)} groups wait for messages")


def simulate(func: str, algo: str, proto: str, nranks: int, count: int, elt: int,
             comm_nch: int, rings: Sequence[Sequence[int]],
             trees: Sequence[Sequence[Tuple[int, Tuple[int, ...]]]], buff: int, version: int,
             nt: int, thr: int, root: int = 0, nNodes: int = 1
             ) -> Tuple[List[Optional[Val]], dict, Syms]:
    """Run every rank of one call; (each rank's output, or None where the collective writes
    no reduction; the devWork; the structures its ids name)."""
    task_nch = topo_nc(func, nranks, count, elt, comm_nch, nt, thr)
    work = schedule(func, algo, proto, nranks, count, elt, task_nch, comm_nch, buff, version,
                    nNodes)
    sy, net = Syms(), Net()
    inp = nranks * count if func == "ReduceScatter" else count
    ranks = [Rank(r, nranks, sy, net, proto, inp, count) for r in range(nranks)]
    gens: List[Gen] = []
    for r in ranks:
        for ch in range(work["channelLo"], work["channelHi"] + 1):
            ring = setup_ring(rings[ch], r.rank)
            if func == "AllReduce" and algo == "ring":
                gens.append(ring_all_reduce(r, ch, ring, work, proto, elt))
            elif func == "AllReduce":
                for group in ("reduce", "bcast"):
                    gens.append(tree_split(r, ch, trees[ch][r.rank], work, proto, elt, group))
            elif func == "ReduceScatter":
                gens.append(ring_reduce_scatter(r, ch, ring, work, proto, elt, count))
            else:
                gens.append(ring_reduce(r, ch, ring, work, proto, elt, root))
    run_all(net, gens)
    outs: List[Optional[Val]] = []
    for r in ranks:
        if func == "Reduce" and r.rank != root:
            outs.append(None)
            continue
        if (r.out.sid < 0).any():
            raise RuntimeError(f"rank {r.rank}: output elements never written: "
                               f"{np.flatnonzero(r.out.sid < 0)[:5].tolist()}")
        outs.append(r.out)
    return outs, work, sy


def canon_of_expr(expr) -> tuple:
    """The canonical form of a model fold (nested tuples, a tuple a left fold of its items)."""
    if isinstance(expr, int):
        return ("x", expr)
    acc = canon_of_expr(expr[0])
    for item in expr[1:]:
        acc = ("+",) + tuple(sorted((acc, canon_of_expr(item))))
    return acc
