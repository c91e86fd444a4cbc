"""Pure planners: user arguments -> the exact NCCL calls, one planner per registry entry.

Each ``plan_<name>(ctx, ...)`` takes a :class:`~ncclpy.plan.types.PlanContext` and parsed
buffers (:class:`~ncclpy.buffers.buffer.BufferSpec`, lists of them for list forms, or None; anything
else is parsed with :func:`~ncclpy.buffers.buffer.as_buffer`) and returns a
:class:`~ncclpy.plan.types.Plan`.  Nothing here touches a GPU.

Counts are in elements of the logical dtype; NCCL counts are wire elements (x2 for complex).

Path rules (they depend only on what every rank has in common -- NCCL version,
``force_fallback``, the form of the call -- never on one rank's memory layout, so all ranks
always issue matching NCCL calls):

* all_reduce, reduce, broadcast, all_gather, reduce_scatter: always their NCCL collective.
  List forms whose entries are adjacent views of one region (in rank order) are passed as that
  region; other lists are staged through scratch (Copy in before / Copy out after the call).
* gather, scatter, even all_to_all on single buffers: the native ncclGather/ncclScatter/
  ncclAlltoAll where ``ctx.has_native`` (NCCL >= 2.28, no ``force_fallback``), else grouped
  Send/Recv ("p2p").  Lists on root: as above (adjacent -> direct, else staged) on the native
  path; the p2p path sends/receives each entry directly.
* all_to_all with ``send_counts``/``recv_counts`` or lists: always grouped Send/Recv (so a rank
  whose counts happen to be even still matches its peers).  In the p2p paths the rank's own
  block is a Copy (issued before the group), zero-count pairs are skipped.
* in-place all_to_all: the input is first copied into scratch ("staged").

What the executor must honour: ``NcclCall(fn, args)`` is ``nccl<fn>(*args, comm, stream)``;
``Scratch(offset)`` is ``offset`` bytes into one device allocation of ``plan.scratch_bytes``
(none when 0); ``PREMUL_OP`` is the op created from ``plan.premul``; ``Copy`` is a
device-to-device ``cudaMemcpyAsync`` on the call's stream.  Steps run in order; copies only
ever come before or after all NCCL calls of a plan, and ``plan.group`` wraps those calls in
ncclGroupStart/End.  A plan may have no step at all (p2p plans where every count is 0).
``Plan.meta`` carries ``in_place``, ``dtype``, ``op`` (effective RedOp), ``root``/``peer``,
``via`` ("native"/"p2p" beneath a "staged" path) and the all_to_all counts, for logs and tests.
"""
from __future__ import annotations

import logging
from typing import Any, List, Union

from ..errors import ArgumentError
from .checks import buf as _buf
from .checks import (adjacent, buf_list, check_ctx, disjoint_outputs, divisible, expect_count,
                     overlaps, rank_arg, reduction, region, same_dtype, sub, wire)
from .checks import is_list as _is_list
from .checks import make_plan as _mk
from .checks import same_list as _same_list
from .rooted import plan_all_to_all, plan_gather, plan_scatter
from .types import Copy, NcclCall, Plan, PlanContext, Scratch, Step, one_call_plan

__all__ = ["plan_all_reduce", "plan_reduce", "plan_broadcast", "plan_all_gather",
           "plan_reduce_scatter", "plan_all_to_all", "plan_gather", "plan_scatter",
           "plan_send", "plan_recv", "plan_send_recv", "plan_barrier", "plan_call"]

log = logging.getLogger(__name__)

Ptr = Union[int, Scratch]  #: a pointer argument of a planned call


def _in_place_or_disjoint(coll: str, a: str, a_ptr: int, a_bytes: int, b: str, b_ptr: int,
                          b_bytes: int, in_place_ptr: int, rule: str) -> bool:
    """True when ``b_ptr`` is the in-place position; error when the buffers overlap otherwise."""
    if b_ptr == in_place_ptr:
        return True
    if overlaps(a_ptr, a_bytes, b_ptr, b_bytes):
        raise ArgumentError(f"{coll}: {b} overlaps {a} without being in place; NCCL's in-place "
                            f"rule is {rule}; expected that exact pointer or disjoint buffers")
    return False


# -- reductions and broadcast ------------------------------------------------------------------
def plan_all_reduce(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None,
                    op: Any = "sum") -> Plan:
    """AllReduce; in place when ``recvbuf`` is None or the same pointer."""
    C = "all_reduce"
    check_ctx(ctx, C)
    s = _buf(ctx, C, "sendbuf", sendbuf, output=recvbuf is None)
    r = s if recvbuf is None else _buf(ctx, C, "recvbuf", recvbuf, output=True)
    if r is not s:   # (recvbuf None: one buffer, nothing to compare)
        same_dtype(C, "sendbuf", s, "recvbuf", r)
        expect_count(C, "recvbuf", r.count, s.count, "the count of sendbuf ({want})")
    w = wire(ctx, C, s.dtype)
    opv, pre, o = reduction(ctx, C, op, w)
    nb = s.count * w.itemsize   # == r's: same dtype and count
    inplace = r is s or _in_place_or_disjoint(C, "sendbuf", s.ptr, nb, "recvbuf", r.ptr, nb,
                                              s.ptr, "recvbuff == sendbuff")
    return one_call_plan(C, "AllReduce", (s.ptr, r.ptr, w.count(s.count), w.nccl, opv), nb,
                         {"in_place": inplace, "op": o, "dtype": s.dtype}, pre)


def plan_reduce(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None, root: Any = 0,
                op: Any = "sum") -> Plan:
    """Reduce to ``root``; ``recvbuf`` matters on root only (in place when None there)."""
    C = "reduce"
    check_ctx(ctx, C)
    root = rank_arg(ctx, C, "root", root)
    is_root = ctx.rank == root
    s = _buf(ctx, C, "sendbuf", sendbuf, output=is_root and recvbuf is None)
    r = s if recvbuf is None else _buf(ctx, C, "recvbuf", recvbuf, output=is_root)
    same_dtype(C, "sendbuf", s, "recvbuf", r)
    expect_count(C, "recvbuf", r.count, s.count, "the count of sendbuf ({want})")
    w = wire(ctx, C, s.dtype)
    opv, pre, o = reduction(ctx, C, op, w)
    inplace = r.ptr == s.ptr
    if is_root:
        inplace = _in_place_or_disjoint(C, "sendbuf", s.ptr, s.nbytes, "recvbuf", r.ptr,
                                        r.nbytes, s.ptr, "recvbuff == sendbuff")
    return one_call_plan(C, "Reduce", (s.ptr, r.ptr, w.count(s.count), w.nccl, opv, root),
                         s.nbytes, {"in_place": inplace, "op": o, "dtype": s.dtype,
                                    "root": root}, pre)


def plan_broadcast(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None, root: Any = 0) -> Plan:
    """Broadcast from ``root``; in place when one of the buffers is None or both coincide."""
    C = "broadcast"
    check_ctx(ctx, C)
    root = rank_arg(ctx, C, "root", root)
    if sendbuf is None and recvbuf is None:
        raise ArgumentError(f"{C}: sendbuf is required (or recvbuf alone, for in place)")
    is_root = ctx.rank == root
    s = None if sendbuf is None else _buf(ctx, C, "sendbuf", sendbuf,
                                         output=recvbuf is None and not is_root)
    r = s if recvbuf is None else _buf(ctx, C, "recvbuf", recvbuf, output=True)
    s = r if s is None else s
    same_dtype(C, "sendbuf", s, "recvbuf", r)
    expect_count(C, "recvbuf", r.count, s.count, "the count of sendbuf ({want})")
    w = wire(ctx, C, s.dtype)
    inplace = _in_place_or_disjoint(C, "sendbuf", s.ptr, s.nbytes, "recvbuf", r.ptr, r.nbytes,
                                    s.ptr, "recvbuff == sendbuff")
    return one_call_plan(C, "Broadcast", (s.ptr, r.ptr, w.count(s.count), w.nccl, root),
                         s.nbytes, {"in_place": inplace, "dtype": s.dtype, "root": root})


# -- all_gather / reduce_scatter ----------------------------------------------------------------
def plan_all_gather(ctx: PlanContext, sendbuf: Any, recvbuf: Any) -> Plan:
    """AllGather into one buffer of world_size*count or a list of world_size buffers;
    ``sendbuf`` None: in place (block ``rank`` of the output is the input)."""
    C = "all_gather"
    check_ctx(ctx, C)
    N, me = ctx.world_size, ctx.rank
    if recvbuf is None:
        raise ArgumentError(f"{C}: recvbuf is required (one buffer of world_size*count "
                            f"elements or a list of world_size buffers)")
    if _is_list(recvbuf):
        rl = buf_list(ctx, C, "recvbuf", recvbuf, output=True)
        s = rl[me] if sendbuf is None else _buf(ctx, C, "sendbuf", sendbuf)
        _same_list(C, "recvbuf", rl, s, "sendbuf" if sendbuf is not None else f"recvbuf[{me}]")
        disjoint_outputs(C, "recvbuf", rl)
        w = wire(ctx, C, s.dtype)
        if not adjacent(rl):   # staged: gather into scratch, then copy each block out
            cb = s.nbytes
            steps: List[Step] = [NcclCall("AllGather", (s.ptr, Scratch(0), w.count(s.count),
                                                        w.nccl))]
            steps += [Copy(b.ptr, Scratch(i * cb), cb) for i, b in enumerate(rl)
                      if cb and not (i == me and b.ptr == s.ptr)]
            return _mk(C, steps, scratch=N * cb, path="staged", nbytes=N * cb,
                       in_place=s.ptr == rl[me].ptr, dtype=s.dtype, via="native")
        r = region(rl)
    else:
        r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
        if sendbuf is None:
            c = divisible(C, "recvbuf", r.count, N, "in-place all_gather splits recvbuf into "
                          "world_size equal blocks")
            s = sub(r, me * c, c)
        else:
            s = _buf(ctx, C, "sendbuf", sendbuf)
            same_dtype(C, "sendbuf", s, "recvbuf", r)
            expect_count(C, "recvbuf", r.count, N * s.count,
                         f"world_size({N}) * sendbuf count({s.count}) = {N * s.count}")
    w = wire(ctx, C, s.dtype)
    inplace = _in_place_or_disjoint(C, "recvbuf", r.ptr, r.nbytes, "sendbuf", s.ptr, s.nbytes,
                                    r.offset(me * s.count), "sendbuff == recvbuff + rank*count")
    return one_call_plan(C, "AllGather", (s.ptr, r.ptr, w.count(s.count), w.nccl), r.nbytes,
                         {"in_place": inplace, "dtype": s.dtype})


def plan_reduce_scatter(ctx: PlanContext, sendbuf: Any, recvbuf: Any = None,
                        op: Any = "sum") -> Plan:
    """ReduceScatter from one buffer of world_size*count or a list of world_size buffers;
    ``recvbuf`` None: in place (the result lands in block ``rank`` of the input)."""
    C = "reduce_scatter"
    check_ctx(ctx, C)
    N, me = ctx.world_size, ctx.rank
    if sendbuf is None:
        raise ArgumentError(f"{C}: sendbuf is required (one buffer of world_size*count "
                            f"elements or a list of world_size buffers)")
    if _is_list(sendbuf):
        sl = buf_list(ctx, C, "sendbuf", sendbuf)
        if recvbuf is None:
            r = _buf(ctx, C, f"sendbuf[{me}]", sl[me], output=True)
            _same_list(C, "sendbuf", sl, r, f"sendbuf[{me}]")
        else:
            r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
            _same_list(C, "sendbuf", sl, r, "recvbuf")
        w = wire(ctx, C, r.dtype)
        opv, pre, o = reduction(ctx, C, op, w)
        if not adjacent(sl):   # staged: copy the blocks into scratch, reduce-scatter from it
            cb = r.nbytes
            steps: List[Step] = [Copy(Scratch(i * cb), b.ptr, cb) for i, b in enumerate(sl)
                                 if cb]
            steps.append(NcclCall("ReduceScatter", (Scratch(0), r.ptr, w.count(r.count),
                                                    w.nccl, opv)))
            return _mk(C, steps, premul=pre, scratch=N * cb, path="staged", nbytes=N * cb,
                       in_place=r.ptr == sl[me].ptr, op=o, dtype=r.dtype, via="native")
        s = region(sl)
    else:
        s = _buf(ctx, C, "sendbuf", sendbuf, output=recvbuf is None)
        if recvbuf is None:
            c = divisible(C, "sendbuf", s.count, N, "in-place reduce_scatter splits sendbuf "
                          "into world_size equal blocks")
            r = sub(s, me * c, c)
        else:
            r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
            same_dtype(C, "sendbuf", s, "recvbuf", r)
            expect_count(C, "sendbuf", s.count, N * r.count,
                         f"world_size({N}) * recvbuf count({r.count}) = {N * r.count}")
        w = wire(ctx, C, s.dtype)
        opv, pre, o = reduction(ctx, C, op, w)
    inplace = _in_place_or_disjoint(C, "sendbuf", s.ptr, s.nbytes, "recvbuf", r.ptr, r.nbytes,
                                    s.offset(me * r.count),
                                    "recvbuff == sendbuff + rank*recvcount")
    return one_call_plan(C, "ReduceScatter", (s.ptr, r.ptr, w.count(r.count), w.nccl, opv),
                         s.nbytes, {"in_place": inplace, "op": o, "dtype": s.dtype}, pre)


# -- point to point ----------------------------------------------------------------------------
def plan_send(ctx: PlanContext, buf: Any, peer: Any) -> Plan:
    """ncclSend of the whole buffer to ``peer`` (to self only inside a group)."""
    C = "send"
    check_ctx(ctx, C)
    b = _buf(ctx, C, "buf", buf)
    peer = rank_arg(ctx, C, "peer", peer)
    _no_self(ctx, C, peer)
    w = wire(ctx, C, b.dtype)
    return one_call_plan(C, "Send", (b.ptr, w.count(b.count), w.nccl, peer), b.nbytes,
                         {"dtype": b.dtype, "peer": peer}, path="p2p")


def plan_recv(ctx: PlanContext, buf: Any, peer: Any) -> Plan:
    """ncclRecv into the whole buffer from ``peer`` (from self only inside a group)."""
    C = "recv"
    check_ctx(ctx, C)
    b = _buf(ctx, C, "buf", buf, output=True)
    peer = rank_arg(ctx, C, "peer", peer)
    _no_self(ctx, C, peer)
    w = wire(ctx, C, b.dtype)
    return one_call_plan(C, "Recv", (b.ptr, w.count(b.count), w.nccl, peer), b.nbytes,
                         {"dtype": b.dtype, "peer": peer}, path="p2p")


def _no_self(ctx: PlanContext, coll: str, peer: int) -> None:
    if peer == ctx.rank and not ctx.in_group:
        raise ArgumentError(
            f"{coll}: peer {peer} is this rank; NCCL can only {coll} "
            f"{'to' if coll == 'send' else 'from'} self inside a group that also holds the "
            f"matching {'recv' if coll == 'send' else 'send'} (alone it would hang): use "
            f"send_recv or 'with comm.group():'")


def plan_send_recv(ctx: PlanContext, sendbuf: Any, recvbuf: Any, send_peer: Any,
                   recv_peer: Any) -> Plan:
    """Grouped ncclSend to ``send_peer`` and ncclRecv from ``recv_peer`` (self allowed)."""
    C = "send_recv"
    check_ctx(ctx, C)
    if sendbuf is None or recvbuf is None:
        raise ArgumentError(f"{C}: both sendbuf and recvbuf are required (got "
                            f"{'sendbuf' if sendbuf is None else 'recvbuf'} None)")
    s = _buf(ctx, C, "sendbuf", sendbuf)
    r = _buf(ctx, C, "recvbuf", recvbuf, output=True)
    sp = rank_arg(ctx, C, "send_peer", send_peer)
    rp = rank_arg(ctx, C, "recv_peer", recv_peer)
    if overlaps(s.ptr, s.nbytes, r.ptr, r.nbytes):
        raise ArgumentError(f"{C}: recvbuf overlaps sendbuf; the send reads while the recv "
                            f"writes: expected disjoint buffers")
    ws, wr = wire(ctx, C, s.dtype), wire(ctx, C, r.dtype)
    steps = [NcclCall("Send", (s.ptr, ws.count(s.count), ws.nccl, sp)),
             NcclCall("Recv", (r.ptr, wr.count(r.count), wr.nccl, rp))]
    return _mk(C, steps, group=True, path="p2p", nbytes=max(s.nbytes, r.nbytes),
               dtype=s.dtype, send_peer=sp, recv_peer=rp)


def plan_barrier(ctx: PlanContext, buf: Any) -> Plan:
    """An in-place AllReduce SUM of the communicator's 1-element buffer."""
    C = "barrier"
    check_ctx(ctx, C)
    b = _buf(ctx, C, "barrier buffer", buf, output=True)
    if b.count < 1:
        raise ArgumentError(f"{C}: the barrier buffer has {b.count} elements; expected >= 1")
    w = wire(ctx, C, b.dtype)
    opv, _, o = reduction(ctx, C, "sum", w)
    return one_call_plan(C, "AllReduce", (b.ptr, b.ptr, w.count(1), w.nccl, opv), 0,
                         {"in_place": True, "op": o, "dtype": b.dtype})


def plan_call(name: str, ctx: PlanContext, *args: Any, **kw: Any) -> Plan:
    """Plan collective ``name`` (registry names, nccl-tests stems, NCCL names; also 'send'
    and 'recv')."""
    if name in ("send", "recv"):
        return {"send": plan_send, "recv": plan_recv}[name](ctx, *args, **kw)
    from ..semantics import registry
    return registry.get(name).plan(ctx, *args, **kw)
