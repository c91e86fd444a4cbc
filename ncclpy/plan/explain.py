"""What each rank would call: the exact NCCL calls, copies and scratch of one collective, from
the very planners the communicator runs, without a GPU (``ncclpy plan``).

:func:`rank_plans` plans ``collective`` for every rank of a world on made-up device addresses
(nothing is ever dereferenced) and :func:`format_plans` / :func:`list_lines` /
:func:`plans_doc` say it with the addresses named after the buffers (``sendbuf+0x400``,
``scratch+0x0``).  ``count`` is NCCL's count for the call: the elements of each rank's block
(all_gather's ``sendcount``, reduce_scatter's ``recvcount``, all_to_all's per-peer count,
gather/scatter's per-rank block) or of the whole buffer (all_reduce, reduce, broadcast,
send_recv).  Pure: planning only, no CUDA, no store.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..buffers.buffer import Buffer
from ..semantics.dtypes import C_NAMES, LOGICAL, NCCL_DTYPE_NAMES, dtype_name
from ..errors import ArgumentError, NcclpyError, UnsupportedError, as_int
from ..semantics.ops import NCCL_OPS, format_version, parse_op, premul_sum
from .types import PREMUL_OP, Copy, NcclCall, Plan, PlanContext, Scratch

__all__ = ["SEND_BASE", "RECV_BASE", "RankPlan", "rank_plans", "format_plans", "list_lines",
           "plans_doc", "COLLECTIVES"]

#: made-up device addresses of the send and receive buffers (never dereferenced)
SEND_BASE = 0x7F00_0000_0000
RECV_BASE = 0x7F80_0000_0000
#: the collectives ``ncclpy plan`` explains (the registry's, barrier included)
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter", "send_recv", "barrier")
_OP_NAMES = {v: k for k, v in NCCL_OPS.items()}
_C_TYPES = C_NAMES       # ncclDataType_t enumerator names (nccl.h)


def _ctype(v: Any) -> str:
    name = NCCL_DTYPE_NAMES.get(v)
    return f"{_C_TYPES.get(name, name)} ({v})" if name else str(v)


@dataclass(frozen=True)
class RankPlan:
    """One rank's plan with the sizes of the buffers it was planned on (bytes, 0: absent)."""

    rank: int
    plan: Plan
    send_bytes: int
    recv_bytes: int


def _buffers(coll: str, rank: int, n: int, count: int, dtype: str, root: int,
             in_place: bool) -> Tuple[Optional[Buffer], Optional[Buffer]]:
    """(sendbuf, recvbuf) as a user would pass them, on :data:`SEND_BASE` / :data:`RECV_BASE`;
    in place as the communicator documents it (None on the overwritten side, NCCL's aliasing
    for gather/scatter's root)."""
    item = LOGICAL[dtype].itemsize

    def buf(base: int, elems: int) -> Buffer:
        return Buffer(base, elems, dtype, 0)
    whole = n * count
    if coll in ("all_reduce", "reduce", "broadcast", "send_recv"):
        if in_place and coll != "send_recv":
            return buf(SEND_BASE, count), None
        return buf(SEND_BASE, count), buf(RECV_BASE, count)
    if coll == "all_gather":
        return (None if in_place else buf(SEND_BASE, count)), buf(RECV_BASE, whole)
    if coll in ("reduce_scatter", "all_to_all"):
        if coll == "reduce_scatter" and not in_place:
            return buf(SEND_BASE, whole), buf(RECV_BASE, count)
        return buf(SEND_BASE, whole), (None if in_place else buf(RECV_BASE, whole))
    if coll == "gather":
        if rank != root:
            return buf(SEND_BASE, count), None
        if in_place:
            return Buffer(RECV_BASE + root * count * item, count, dtype, 0), buf(RECV_BASE, whole)
        return buf(SEND_BASE, count), buf(RECV_BASE, whole)
    if coll == "scatter":
        if rank != root:
            return None, buf(RECV_BASE, count)
        if in_place:
            return buf(SEND_BASE, whole), Buffer(SEND_BASE + root * count * item, count, dtype, 0)
        return buf(SEND_BASE, whole), buf(RECV_BASE, count)
    raise ArgumentError(f"collective: {coll!r} is not one ncclpy plan explains; expected one of "
                        f"{', '.join(COLLECTIVES)}")


def _params(coll: str, rank: int, n: int, op: Any, root: int) -> Tuple[Any, ...]:
    if coll in ("all_reduce", "reduce_scatter"):
        return (op,)
    if coll == "reduce":
        return (root, op)
    if coll in ("broadcast", "gather", "scatter"):
        return (root,)
    if coll == "send_recv":
        return ((rank + 1) % n, (rank - 1) % n)
    return ()


def rank_plans(collective: str, world_size: int, count: int, dtype: Any = "float32", *,
               op: Any = "sum", root: int = 0, in_place: bool = False,
               ranks: Optional[Sequence[int]] = None, nccl_version: int = 23203,
               force_fallback: bool = False, version_note: str = "the planned NCCL is {}"
               ) -> List[RankPlan]:
    """Each rank's :class:`RankPlan` for one call (``ranks``: which; default all), planned by
    the registry's planner on a :class:`PlanContext` of ``nccl_version`` (``version_note``:
    what a refusal calls that version, ``{}`` its number).  ``op`` may be a premul_sum
    spelled ``premul_sum:X``.  Planning errors are the communicator's own.  A barrier is
    NCCL's 1-element float32 all_reduce whatever ``count``, ``dtype`` and ``op``."""
    from ..semantics import registry
    n = as_int("world_size", world_size, 1)
    count = as_int("count", count, 0, (1 << 63) - 1)
    root = as_int("root", root, 0)
    try:
        coll = registry.get(collective).name
    except NcclpyError as e:
        raise type(e)(f"collective: {e}") from None
    if coll not in COLLECTIVES:
        raise ArgumentError(f"collective: {collective!r}; expected one of {', '.join(COLLECTIVES)}")
    if registry.get(coll).rooted and root >= n:
        raise ArgumentError(f"root: {root} is not a rank of a world of {n}; expected 0..{n - 1}")
    try:
        dt = dtype_name(dtype)
    except NcclpyError as e:
        raise type(e)(f"dtype: {e}") from None
    if isinstance(op, str) and op.strip().lower() == "premul_sum":
        raise ArgumentError(f"op: {op!r} needs its scalar: write premul_sum:X with a number X "
                            f"(e.g. premul_sum:0.5)")
    if isinstance(op, str) and not op.strip().lower().startswith("premul_sum:"):
        try:
            parse_op(op)
        except UnsupportedError as e:   # its message starts "op 'band': ": said once, after
            why = str(e).removeprefix(f"op {op!r}: ")     # the flag the CLI puts first
            raise UnsupportedError(f"op: {op!r}: {why}") from None
        except NcclpyError:
            raise ArgumentError(f"op: unknown reduction {op!r}; expected sum, prod, max, min, "
                                f"avg or premul_sum:X with a number X") from None
    if isinstance(op, str) and op.strip().lower().startswith("premul_sum:"):
        try:
            scalar = float(op.split(":", 1)[1])
        except ValueError:
            raise ArgumentError(f"op: {op!r}: expected premul_sum:X with a number X") from None
        try:
            op = premul_sum(scalar)
        except NcclpyError as e:
            raise type(e)(f"op: {e}") from None
    out = []
    for r in (range(n) if ranks is None else ranks):
        r = as_int("rank", r, 0)
        if r >= n:
            raise ArgumentError(f"rank: {r} is not a rank of a world of {n}; expected 0..{n - 1}")
        ctx = PlanContext(r, n, 0, int(nccl_version), force_fallback=force_fallback,
                          version_note=version_note)
        if coll == "barrier":
            a: Optional[Buffer] = Buffer(SEND_BASE, 1, "float32", 0)
            b: Optional[Buffer] = None
            plan = registry.get(coll).plan(ctx, a)
        else:
            a, b = _buffers(coll, r, n, count, dt, root, in_place)
            plan = registry.get(coll).plan(ctx, a, b, *_params(coll, r, n, op, root))
        out.append(RankPlan(r, plan, 0 if a is None else a.count * LOGICAL[a.dtype].itemsize,
                            0 if b is None else b.count * LOGICAL[b.dtype].itemsize))
    return out


def _ptr(p: Any, rp: RankPlan) -> str:
    if isinstance(p, Scratch):
        return f"scratch+{p.offset:#x}"
    if p == 0:
        return "NULL"
    for name, base, size in (("sendbuf", SEND_BASE, rp.send_bytes),
                             ("recvbuf", RECV_BASE, rp.recv_bytes)):
        if base <= p <= base + max(size, 0):
            return f"{name}+{p - base:#x}"
    return f"{p:#x}"


def _arg(name: str, v: Any, rp: RankPlan) -> str:
    if name in ("sendbuff", "recvbuff"):
        return f"{name}={_ptr(v, rp)}"
    if name == "datatype":
        return f"datatype={_ctype(v)}"
    if name == "op":
        if v is PREMUL_OP:
            return "op=<the PreMulSum op created above>"
        return f"op=nccl{_OP_NAMES.get(v, str(v)).capitalize()} ({v})"
    return f"{name}={v}"


def _step_text(step: Any, rp: RankPlan) -> str:
    if isinstance(step, NcclCall):
        from .types import NCCL_FUNCTIONS
        args = ", ".join(_arg(nm, v, rp) for nm, v in zip(NCCL_FUNCTIONS[step.fn], step.args))
        return f"nccl{step.fn}({args}, comm, stream)"
    assert isinstance(step, Copy)
    return (f"cudaMemcpyAsync(dst={_ptr(step.dst, rp)}, src={_ptr(step.src, rp)}, "
            f"{step.nbytes} bytes, DeviceToDevice, stream)")


def _lines(rp: RankPlan) -> List[str]:
    """The calls of one rank's plan, in order, as C calls."""
    p = rp.plan
    out: List[str] = []
    if p.scratch_bytes:
        out.append(f"scratch: {p.scratch_bytes} bytes of device memory (ncclpy allocates them)")
    if p.premul is not None:
        out.append(f"ncclRedOpCreatePreMulSum(&op, scalar=0x{p.premul.scalar.hex()} "
                   f"(little-endian), datatype={_ctype(p.premul.datatype)}, "
                   f"ncclScalarHostImmediate, comm)")
    calls = [s for s in p.steps if isinstance(s, NcclCall)]
    first = p.steps.index(calls[0]) if calls else -1
    last = p.steps.index(calls[-1]) if calls else -1
    for i, s in enumerate(p.steps):
        if p.group and i == first:
            out.append("ncclGroupStart()")
        out.append(("  " if p.group and first <= i <= last else "") + _step_text(s, rp))
        if p.group and i == last:
            out.append("ncclGroupEnd()")
    if p.premul is not None:
        out.append("ncclRedOpDestroy(op, comm)")
    return out


def format_plans(plans: Sequence[RankPlan], header: str = "") -> List[str]:
    """Readable blocks: per rank, its path and calls."""
    out = [header] if header else []
    for rp in plans:
        p = rp.plan
        ncalls = len(p.calls)
        out.append(f"rank {rp.rank}: {p.collective}, path {p.path}, {ncalls} NCCL "
                   f"call{'s' if ncalls != 1 else ''}"
                   + _copies(sum(isinstance(s, Copy) for s in p.steps))
                   + (f", {p.scratch_bytes} bytes of scratch" if p.scratch_bytes else ""))
        out += [f"  {ln}" for ln in _lines(rp)]
    return out


def _copies(k: int) -> str:
    return "" if not k else f", {k} cop{'y' if k == 1 else 'ies'}"


def list_lines(plans: Sequence[RankPlan]) -> List[str]:
    """One line per step, ``rank<TAB>step<TAB>call`` (for grep and diff)."""
    return [f"{rp.rank}\t{i}\t{ln.strip()}" for rp in plans for i, ln in enumerate(_lines(rp))]


def plans_doc(plans: Sequence[RankPlan], config: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON form: the configuration and, per rank, path, scratch and every step."""
    ranks = []
    for rp in plans:
        p = rp.plan
        ranks.append({"rank": rp.rank, "path": p.path, "group": p.group,
                      "scratch_bytes": p.scratch_bytes, "nbytes": p.nbytes,
                      "steps": [ln.strip() for ln in _lines(rp)]})
    return {"config": dict(config), "nccl": format_version(int(config.get("nccl_version", 0))),
            "ranks": ranks}
