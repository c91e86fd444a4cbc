"""Planners for the collectives NCCL only recently made native: gather, scatter, all_to_all.

Native ncclGather/ncclScatter/ncclAlltoAll where ``ctx.has_native`` says the loaded NCCL has them
(and the call is even and on single buffers for all_to_all); grouped ncclSend/ncclRecv
otherwise.  See :mod:`ncclpy.plan.collectives` for the path rules.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, List, Optional, Sequence, Tuple

from ..buffers.buffer import BufferSpec
from ..errors import ArgumentError
from .checks import Wire
from .checks import buf as _buf
from .checks import (adjacent, buf_list, check_ctx, counts_arg, cross_overlap,
                     disjoint_outputs, divisible, expect_count, overlaps, rank_arg, region,
                     same_dtype, self_overlap, sub, wire)
from .checks import is_list as _is_list
from .checks import make_plan as _mk
from .checks import same_list as _same_list
from .types import Copy, NcclCall, Plan, PlanContext, Scratch, Step

__all__ = ["plan_gather", "plan_scatter", "plan_all_to_all"]

log = logging.getLogger(__name__)


def _check_rooted_in_place(coll: str, whole: BufferSpec, whole_name: str, part: BufferSpec,
                           part_name: str, in_place_ptr: int, rule: str) -> bool:
    if part.ptr == in_place_ptr:
        return True
    if overlaps(whole.ptr, whole.nbytes, part.ptr, part.nbytes):
        raise ArgumentError(f"{coll}: {part_name} overlaps {whole_name} without being in "
                            f"place; NCCL's in-place rule is {rule}; expected that exact "
                            f"pointer or disjoint buffers")
    return False


# -- gather ------------------------------------------------------------------------------------
def plan_gather(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None, root: Any = 0) -> Plan:
    """Gather to ``root``: ``recvbuf`` (world_size*count or a list of world_size) on root only;
    ``sendbuf`` None on root: in place (block ``root`` of recvbuf is the input)."""
    C = "gather"
    check_ctx(ctx, C)
    root = rank_arg(ctx, C, "root", root)
    N, me = ctx.world_size, ctx.rank
    native = ctx.has_native("Gather")
    via = "native" if native else "p2p"
    if me != root:
        if sendbuf is None:
            raise ArgumentError(f"{C}: sendbuf is required on non-root rank {me} (only root "
                                f"{root} may pass None, for in place)")
        if recvbuf is not None:
            log.debug("gather: recvbuf ignored on non-root rank %d", me)
        s = _buf(ctx, C, "sendbuf", sendbuf)
        w = wire(ctx, C, s.dtype)
        if native:
            steps: List[Step] = [NcclCall("Gather", (s.ptr, s.ptr, w.count(s.count), w.nccl,
                                                     root))]
        else:
            steps = [NcclCall("Send", (s.ptr, w.count(s.count), w.nccl, root))] if s.count \
                else []
        return _mk(C, steps, group=not native, path=via, nbytes=s.nbytes, in_place=False,
                   dtype=s.dtype, root=root, via=via)
    if recvbuf is None:
        raise ArgumentError(f"{C}: recvbuf is required on the root rank ({root}): one buffer "
                            f"of world_size*count elements or a list of world_size buffers")
    if _is_list(recvbuf):
        rl = buf_list(ctx, C, "recvbuf", recvbuf, output=True)
        s = rl[root] if sendbuf is None else _buf(ctx, C, "sendbuf", sendbuf)
        _same_list(C, "recvbuf", rl, s, "sendbuf" if sendbuf is not None else f"recvbuf[{root}]")
        disjoint_outputs(C, "recvbuf", rl)
        inplace = s.ptr == rl[root].ptr
        if not inplace and cross_overlap([(s.ptr, s.nbytes)], [(b.ptr, b.nbytes) for b in rl]):
            raise ArgumentError(f"{C}: sendbuf overlaps the recvbuf list without being "
                                f"recvbuf[root]; expected that buffer or disjoint buffers")
        if not adjacent(rl):
            return _gather_list(ctx, C, s, rl, root, inplace, native)
        r = region(rl)
    else:
        r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
        if sendbuf is None:
            c = divisible(C, "recvbuf", r.count, N, "in-place gather splits recvbuf into "
                          "world_size equal blocks")
            s = sub(r, root * c, c)
        else:
            s = _buf(ctx, C, "sendbuf", sendbuf)
            same_dtype(C, "sendbuf", s, "recvbuf", r)
            expect_count(C, "recvbuf", r.count, N * s.count,
                         f"world_size({N}) * sendbuf count({s.count}) = {N * s.count}")
    c = s.count
    inplace = _check_rooted_in_place(C, r, "recvbuf", s, "sendbuf", r.offset(root * c),
                                     "sendbuff == recvbuff + root*count")
    w = wire(ctx, C, s.dtype)
    if native:
        steps = [NcclCall("Gather", (s.ptr, r.ptr, w.count(c), w.nccl, root))]
    else:
        own = r.offset(root * c)
        steps = [Copy(own, s.ptr, s.nbytes)] if s.nbytes and own != s.ptr else []
        steps += [NcclCall("Recv", (r.offset(p * c), w.count(c), w.nccl, p))
                  for p in range(N) if p != root and c]
    return _mk(C, steps, group=not native, path=via, nbytes=r.nbytes, in_place=inplace,
               dtype=s.dtype, root=root, via=via)


def _gather_list(ctx: PlanContext, C: str, s: BufferSpec, rl: List[BufferSpec], root: int,
                 inplace: bool, native: bool) -> Plan:
    N, cb = ctx.world_size, s.nbytes
    w = wire(ctx, C, s.dtype)
    if native:   # gather into scratch, copy each block out
        steps: List[Step] = [NcclCall("Gather", (s.ptr, Scratch(0), w.count(s.count), w.nccl,
                                                 root))]
        steps += [Copy(b.ptr, Scratch(i * cb), cb) for i, b in enumerate(rl)
                  if cb and not (i == root and b.ptr == s.ptr)]
        return _mk(C, steps, scratch=N * cb, path="staged", nbytes=N * cb, in_place=inplace,
                   dtype=s.dtype, root=root, via="native")
    steps = [Copy(rl[root].ptr, s.ptr, cb)] if cb and not inplace else []
    steps += [NcclCall("Recv", (b.ptr, w.count(b.count), w.nccl, p)) for p, b in enumerate(rl)
              if p != root and b.count]
    return _mk(C, steps, group=True, path="p2p", nbytes=N * cb, in_place=inplace,
               dtype=s.dtype, root=root, via="p2p")


# -- scatter -----------------------------------------------------------------------------------
def plan_scatter(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None, root: Any = 0) -> Plan:
    """Scatter from ``root``: ``sendbuf`` (world_size*count or a list of world_size) on root
    only; ``recvbuf`` None on root: in place (block ``root`` of sendbuf is the output)."""
    C = "scatter"
    check_ctx(ctx, C)
    root = rank_arg(ctx, C, "root", root)
    N, me = ctx.world_size, ctx.rank
    native = ctx.has_native("Scatter")
    via = "native" if native else "p2p"
    if me != root:
        if recvbuf is None:
            raise ArgumentError(f"{C}: recvbuf is required on non-root rank {me} (only root "
                                f"{root} may pass None, for in place)")
        if sendbuf is not None:
            log.debug("scatter: sendbuf ignored on non-root rank %d", me)
        r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
        w = wire(ctx, C, r.dtype)
        if native:
            steps: List[Step] = [NcclCall("Scatter", (r.ptr, r.ptr, w.count(r.count), w.nccl,
                                                      root))]
        else:
            steps = [NcclCall("Recv", (r.ptr, w.count(r.count), w.nccl, root))] if r.count \
                else []
        return _mk(C, steps, group=not native, path=via, nbytes=r.nbytes, in_place=False,
                   dtype=r.dtype, root=root, via=via)
    if sendbuf is None:
        raise ArgumentError(f"{C}: sendbuf is required on the root rank ({root}): one buffer "
                            f"of world_size*count elements or a list of world_size buffers")
    if _is_list(sendbuf):
        sl = buf_list(ctx, C, "sendbuf", sendbuf, output=recvbuf is None)
        r = sl[root] if recvbuf is None else _buf(ctx, C, "recvbuf", recvbuf, output=True)
        _same_list(C, "sendbuf", sl, r, "recvbuf" if recvbuf is not None else f"sendbuf[{root}]")
        inplace = r.ptr == sl[root].ptr
        if not inplace and cross_overlap([(r.ptr, r.nbytes)], [(b.ptr, b.nbytes) for b in sl]):
            raise ArgumentError(f"{C}: recvbuf overlaps the sendbuf list without being "
                                f"sendbuf[root]; expected that buffer or disjoint buffers")
        if not adjacent(sl):
            return _scatter_list(ctx, C, sl, r, root, inplace, native)
        s = region(sl)
    else:
        s = _buf(ctx, C, "sendbuf", sendbuf, output=recvbuf is None)
        if recvbuf is None:
            c = divisible(C, "sendbuf", s.count, N, "in-place scatter splits sendbuf into "
                          "world_size equal blocks")
            r = sub(s, root * c, c)
        else:
            r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
            same_dtype(C, "sendbuf", s, "recvbuf", r)
            expect_count(C, "sendbuf", s.count, N * r.count,
                         f"world_size({N}) * recvbuf count({r.count}) = {N * r.count}")
    c = r.count
    inplace = _check_rooted_in_place(C, s, "sendbuf", r, "recvbuf", s.offset(root * c),
                                     "recvbuff == sendbuff + root*count")
    w = wire(ctx, C, r.dtype)
    if native:
        steps = [NcclCall("Scatter", (s.ptr, r.ptr, w.count(c), w.nccl, root))]
    else:
        own = s.offset(root * c)
        steps = [Copy(r.ptr, own, r.nbytes)] if r.nbytes and own != r.ptr else []
        steps += [NcclCall("Send", (s.offset(p * c), w.count(c), w.nccl, p))
                  for p in range(N) if p != root and c]
    return _mk(C, steps, group=not native, path=via, nbytes=s.nbytes, in_place=inplace,
               dtype=r.dtype, root=root, via=via)


def _scatter_list(ctx: PlanContext, C: str, sl: List[BufferSpec], r: BufferSpec, root: int,
                  inplace: bool, native: bool) -> Plan:
    N, cb = ctx.world_size, r.nbytes
    w = wire(ctx, C, r.dtype)
    if native:   # copy the blocks into scratch, scatter from it
        steps: List[Step] = [Copy(Scratch(i * cb), b.ptr, cb) for i, b in enumerate(sl) if cb]
        steps.append(NcclCall("Scatter", (Scratch(0), r.ptr, w.count(r.count), w.nccl, root)))
        return _mk(C, steps, scratch=N * cb, path="staged", nbytes=N * cb, in_place=inplace,
                   dtype=r.dtype, root=root, via="native")
    steps = [Copy(r.ptr, sl[root].ptr, cb)] if cb and not inplace else []
    steps += [NcclCall("Send", (b.ptr, w.count(b.count), w.nccl, p)) for p, b in enumerate(sl)
              if p != root and b.count]
    return _mk(C, steps, group=True, path="p2p", nbytes=N * cb, in_place=inplace,
               dtype=r.dtype, root=root, via="p2p")


# -- all_to_all --------------------------------------------------------------------------------
def _prefix(counts: Sequence[int]) -> List[int]:
    return [0, *itertools.accumulate(counts)][:-1]


def _blocks(b: BufferSpec, counts: Sequence[int]) -> List[Tuple[int, int]]:
    return [(b.offset(d), c) for d, c in zip(_prefix(counts), counts)]


def _split(ctx: PlanContext, C: str, name: str, b: BufferSpec, counts: Any,
           counts_name: str) -> List[int]:
    """Per-rank counts of a single buffer: explicit (summing to its count) or an even split."""
    N = ctx.world_size
    if counts is None:
        c = divisible(C, name, b.count, N, f"without {counts_name} all_to_all splits {name} "
                      f"into world_size equal blocks")
        return [c] * N
    cs = counts_arg(ctx, C, counts_name, counts)
    if sum(cs) != b.count:
        raise ArgumentError(f"{C}: sum({counts_name}) = {sum(cs)} but {name} has {b.count} "
                            f"elements; expected them equal")
    return cs


def plan_all_to_all(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None,
                    send_counts: Any = None, recv_counts: Any = None) -> Plan:
    """Block ``d`` of this rank's input goes to rank ``d``; block ``s`` of the output comes from
    rank ``s``.  Even (counts None), uneven (``send_counts``/``recv_counts``, elements of the
    logical dtype, displacements are their prefix sums) or list forms; ``recvbuf`` None (or
    the very same buffer): in place, staged through scratch."""
    C = "all_to_all"
    check_ctx(ctx, C)
    me = ctx.rank
    if sendbuf is None:
        raise ArgumentError(f"{C}: sendbuf is required (a buffer or a list of world_size "
                            f"buffers)")
    inplace = recvbuf is None
    r = None if inplace or _is_list(recvbuf) else _buf(ctx, C, "recvbuf", recvbuf, output=True)
    # -- the send side: (ptr, count) per destination rank
    if _is_list(sendbuf):
        if send_counts is not None:
            raise ArgumentError(f"{C}: send_counts cannot be combined with a list sendbuf; "
                                f"the list entries give the counts")
        sl: Optional[List[BufferSpec]] = buf_list(ctx, C, "sendbuf", sendbuf, output=inplace)
        for i, b in enumerate(sl):
            same_dtype(C, "sendbuf[0]", sl[0], f"sendbuf[{i}]", b)
        ref, ref_name, s = sl[0], "sendbuf[0]", None
        sblocks = [(b.ptr, b.count) for b in sl]
    else:
        s = _buf(ctx, C, "sendbuf", sendbuf, output=inplace)
        ref, ref_name, sl = s, "sendbuf", None
        if r is not None:
            same_dtype(C, "sendbuf", s, "recvbuf", r)
            if send_counts is None and recv_counts is None:
                expect_count(C, "recvbuf", r.count, s.count,
                             f"the count of sendbuf ({s.count})")
        sblocks = _blocks(s, _split(ctx, C, "sendbuf", s, send_counts, "send_counts"))
    # -- the receive side: (ptr, count) per source rank
    if inplace and sl is not None:
        if recv_counts is not None:
            raise ArgumentError(f"{C}: recv_counts cannot be combined with a list sendbuf; "
                                f"the list entries give the counts")
        rblocks, rspecs = list(sblocks), list(sl)
    elif inplace:
        rblocks, rspecs = _blocks(s, _split(ctx, C, "sendbuf", s, recv_counts,
                                            "recv_counts")), [s]
    elif r is None:
        if recv_counts is not None:
            raise ArgumentError(f"{C}: recv_counts cannot be combined with a list recvbuf; "
                                f"the list entries give the counts")
        rspecs = buf_list(ctx, C, "recvbuf", recvbuf, output=True)
        for i, b in enumerate(rspecs):
            same_dtype(C, ref_name, ref, f"recvbuf[{i}]", b)
        rblocks = [(b.ptr, b.count) for b in rspecs]
    else:
        same_dtype(C, ref_name, ref, "recvbuf", r)
        rblocks, rspecs = _blocks(r, _split(ctx, C, "recvbuf", r, recv_counts,
                                            "recv_counts")), [r]
        inplace = s is not None and r.ptr == s.ptr and r.nbytes == s.nbytes
    sc = [c for _, c in sblocks]
    rc = [c for _, c in rblocks]
    if sc[me] != rc[me]:
        raise ArgumentError(f"{C}: rank {me} sends {sc[me]} elements to itself but receives "
                            f"{rc[me]} from itself (send_counts[{me}] vs recv_counts[{me}]); "
                            f"expected them equal")
    isz = ref.itemsize
    if self_overlap([(b.ptr, b.nbytes) for b in rspecs]):
        raise ArgumentError(f"{C}: the recvbuf buffers overlap each other; expected disjoint "
                            f"output buffers")
    if not inplace and cross_overlap([(p, c * isz) for p, c in sblocks],
                                     [(p, c * isz) for p, c in rblocks]):
        raise ArgumentError(f"{C}: recvbuf overlaps sendbuf without being the same buffer; "
                            f"expected disjoint buffers (or recvbuf None / the same buffer "
                            f"for in place)")
    even = sl is None and r is not None or (inplace and sl is None)
    even = even and send_counts is None and recv_counts is None
    stage = [] if not inplace else [(b.ptr, b.nbytes) for b in (sl if sl is not None else [s])]
    return _a2a_steps(ctx, C, wire(ctx, C, ref.dtype), isz, sblocks, rblocks, stage, even,
                      ref.dtype, inplace)


def _a2a_steps(ctx: PlanContext, C: str, w: Wire, isz: int, sblocks: List[Tuple[int, int]],
               rblocks: List[Tuple[int, int]], stage: List[Tuple[int, int]], even: bool,
               dtype: str, inplace: bool) -> Plan:
    """Steps for all_to_all.  ``stage``: regions copied (in order, back to back) into scratch
    first, the input then being read from there."""
    N, me = ctx.world_size, ctx.rank
    steps: List[Step] = []
    scratch = sum(n for _, n in stage)
    src: List[Any] = [p for p, _ in sblocks]
    if scratch:
        off = 0
        for p, n in stage:
            if n:
                steps.append(Copy(Scratch(off), p, n))
            off += n
        src = [Scratch(d * isz) for d in _prefix([c for _, c in sblocks])]
    meta = dict(in_place=inplace, dtype=dtype, send_counts=[c for _, c in sblocks],
                recv_counts=[c for _, c in rblocks])
    nbytes = max(sum(c for _, c in sblocks), sum(c for _, c in rblocks)) * isz
    path = "staged" if scratch else None
    if even and ctx.has_native("AlltoAll"):
        c = sblocks[0][1]
        steps.append(NcclCall("AlltoAll", (src[0], rblocks[0][0], w.count(c), w.nccl)))
        return _mk(C, steps, scratch=scratch, path=path or "native", nbytes=nbytes,
                   via="native", **meta)
    own_c = sblocks[me][1]
    own_in_place = sblocks[me][0] == rblocks[me][0]     # original pointers: data already there
    if own_c and not own_in_place:
        steps.append(Copy(rblocks[me][0], src[me], own_c * isz))
    for p in range(N):
        if p == me:
            continue
        if sblocks[p][1]:
            steps.append(NcclCall("Send", (src[p], w.count(sblocks[p][1]), w.nccl, p)))
        if rblocks[p][1]:
            steps.append(NcclCall("Recv", (rblocks[p][0], w.count(rblocks[p][1]), w.nccl, p)))
    return _mk(C, steps, group=True, scratch=scratch, path=path or "p2p", nbytes=nbytes,
               via="p2p", **meta)
