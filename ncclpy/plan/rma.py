"""Plans of the one-sided RMA calls (NCCL >= 2.29): put_signal, signal, wait_signal.

Pure, like every planner: the buffer, peer, window offset, signal index and context are checked
here, and each plan is exactly one NCCL call (``ncclPutSignal``, ``ncclSignal``,
``ncclWaitSignal``).  The window is passed as NCCL's handle of this rank's registration (NCCL
names the peer's memory by the local handle of the same collective registration).
``wait_signal``'s descriptors are an ``ncclWaitSignalDesc_t`` array the caller keeps alive
until the call completes; its address is the plan's argument.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence, Tuple, Union

from ..errors import ArgumentError, ArgumentTypeError, as_int
from .checks import buf as _buf
from .checks import check_ctx, rank_arg, wire
from .types import Plan, PlanContext, one_call_plan

__all__ = ["plan_put_signal", "plan_signal", "plan_wait_signal", "wait_descriptors",
           "RMA_CALLS", "MAX_SIGNAL"]

#: the user calls this module plans (one-sided: never compared or paired across ranks)
RMA_CALLS = frozenset(("put_signal", "signal", "wait_signal"))
#: signal indices and contexts are C ints
MAX_SIGNAL = 2 ** 31 - 1

WaitSpec = Union[Mapping[int, int], Sequence[Sequence[int]]]


def _sig(coll: str, signal: Any, ctx_id: Any) -> Tuple[int, int]:
    return (as_int(f"{coll}: signal", signal, 0, MAX_SIGNAL),
            as_int(f"{coll}: ctx", ctx_id, 0, MAX_SIGNAL))


def plan_put_signal(ctx: PlanContext, buf: Any, peer: Any, window: int, offset: Any = 0,
                    signal: Any = 0, ctx_id: Any = 0) -> Plan:
    """ncclPutSignal: write the whole ``buf`` into ``peer``'s window (``window``: this rank's
    handle of it) at byte ``offset``, then raise signal ``signal`` of context ``ctx_id``."""
    C = "put_signal"
    check_ctx(ctx, C)
    b = _buf(ctx, C, "buf", buf)
    peer = rank_arg(ctx, C, "peer", peer)
    off = as_int(f"{C}: offset", offset, 0)
    if type(window) is not int or window <= 0:
        raise ArgumentError(f"{C}: window: expected a registered window (NCCL returned no "
                            f"window for this registration), got handle {window!r}")
    sig, cx = _sig(C, signal, ctx_id)
    w = wire(ctx, C, b.dtype)
    return one_call_plan(C, "PutSignal", (b.ptr, w.count(b.count), w.nccl, peer, window, off,
                                          sig, cx, 0), b.nbytes,
                         {"dtype": b.dtype, "peer": peer, "offset": off, "signal": sig,
                          "ctx": cx}, path="rma")


def plan_signal(ctx: PlanContext, peer: Any, signal: Any = 0, ctx_id: Any = 0) -> Plan:
    """ncclSignal: raise ``peer``'s signal ``signal`` of context ``ctx_id``, no data."""
    C = "signal"
    check_ctx(ctx, C)
    peer = rank_arg(ctx, C, "peer", peer)
    sig, cx = _sig(C, signal, ctx_id)
    return one_call_plan(C, "Signal", (peer, sig, cx, 0), 0,
                         {"peer": peer, "signal": sig, "ctx": cx}, path="rma")


def wait_descriptors(ctx: PlanContext, waits: Any) -> List[Tuple[int, int, int, int]]:
    """``waits`` -- ``{peer: count}``, or ``[(peer, count[, signal[, ctx]]), ...]`` -- as
    (opCnt, peer, sigIdx, ctx) rows, checked."""
    C = "wait_signal"
    if isinstance(waits, Mapping):
        items: List[Any] = [(p, n) for p, n in waits.items()]
    elif isinstance(waits, (list, tuple)):
        items = list(waits)
    else:
        raise ArgumentTypeError(f"{C}: waits: expected {{peer: count}} or a list of (peer, "
                                f"count[, signal[, ctx]]), got {type(waits).__name__}")
    if not items:
        raise ArgumentError(f"{C}: waits: expected at least one (peer, count), got none")
    rows = []
    for i, it in enumerate(items):
        if not isinstance(it, (list, tuple)) or not 2 <= len(it) <= 4:
            raise ArgumentTypeError(f"{C}: waits[{i}]: expected (peer, count[, signal[, "
                                    f"ctx]]), got {it!r}")
        peer = rank_arg(ctx, C, f"waits[{i}] peer", it[0])
        count = as_int(f"{C}: waits[{i}] count", it[1], 1, MAX_SIGNAL)
        sig, cx = _sig(C, it[2] if len(it) > 2 else 0, it[3] if len(it) > 3 else 0)
        rows.append((count, peer, sig, cx))
    return rows


def plan_wait_signal(ctx: PlanContext, rows: Sequence[Tuple[int, int, int, int]],
                     desc_ptr: int) -> Plan:
    """ncclWaitSignal on the ``rows`` of :func:`wait_descriptors`, whose ncclWaitSignalDesc_t
    array is at ``desc_ptr``."""
    C = "wait_signal"
    check_ctx(ctx, C)
    if type(desc_ptr) is not int or desc_ptr <= 0:
        raise ArgumentError(f"{C}: the descriptor array's address must be a pointer, got "
                            f"{desc_ptr!r}")
    return one_call_plan(C, "WaitSignal", (len(rows), desc_ptr), 0,
                         {"waits": [list(r) for r in rows]}, path="rma")
