"""Plans of the one-sided RMA calls (NCCL >= 2.29): put_signal, signal, wait_signal.

Pure, like every planner: the buffer, peer, window offset, signal index and context are checked
here, and each plan is exactly one NCCL call (``ncclPutSignal``, ``ncclSignal``,
``ncclWaitSignal``).  The window is passed as NCCL's handle of this rank's registration (NCCL
names the peer's memory by the local handle of the same collective registration).
``wait_signal``'s descriptors are an ``ncclWaitSignalDesc_t`` array the caller keeps alive
until the call completes; its address is the plan's argument.

NCCL's own refusals are checked first (enqueue.cc ``rmaTaskAppend``, 2.29.2-2.30.7): the
signal index and the context must be 0 ("Signal index %d is invalid (must be 0)", "Context %d
is invalid (must be 0)"); from NCCL 2.32 they index the communicator's ``num_rma_sig`` signals
and ``num_rma_ctx`` contexts (:class:`RmaLimits`: checked where the Config sets them, else NCCL
judges); ``num_rma_ctx=0`` disables RMA; put_signal's source must lie in a window of this
communicator registered with ``symmetric=True`` ("srcWinHost is not in a valid symmetric
window": :func:`source_window`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError, ArgumentTypeError, as_int
from .checks import buf as _buf
from .checks import check_ctx, rank_arg, wire
from .types import Plan, PlanContext, one_call_plan

__all__ = ["plan_put_signal", "plan_signal", "plan_wait_signal", "wait_descriptors",
           "RMA_CALLS", "MAX_SIGNAL", "RmaLimits", "rma_limits", "source_window",
           "INDEXED_FROM"]

#: the user calls this module plans (one-sided: never compared or paired across ranks)
RMA_CALLS = frozenset(("put_signal", "signal", "wait_signal"))
#: signal indices and contexts are C ints
MAX_SIGNAL = 2 ** 31 - 1

#: the first NCCL whose signal index and context may be other than 0 (nccl.h 2.32 numRmaSig)
INDEXED_FROM = 23200

WaitSpec = Union[Mapping[int, int], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class RmaLimits:
    """How many signal indices and contexts the communicator has (None: NCCL judges), and
    what the numbers come from, for the messages."""
    signals: Optional[int] = 1
    contexts: Optional[int] = 1
    why: str = "NCCL < 2.32 takes only 0 (enqueue.cc rmaTaskAppend)"


def rma_limits(version: int, num_rma_sig: Optional[int] = None,
               num_rma_ctx: Optional[int] = None) -> RmaLimits:
    """The limits for the loaded NCCL ``version`` and the communicator's Config values."""
    if num_rma_ctx == 0:
        return RmaLimits(0, 0, "Config(num_rma_ctx=0) disables one-sided RMA on this "
                               "communicator")
    if version < INDEXED_FROM:
        return RmaLimits()
    return RmaLimits(num_rma_sig, num_rma_ctx,
                     "the communicator's Config(num_rma_sig=..., num_rma_ctx=...)")


def _index(coll: str, what: str, value: Any, n: Optional[int], limits: RmaLimits) -> int:
    v = as_int(f"{coll}: {what}", value, 0, MAX_SIGNAL)
    if n is not None and v >= n:
        if n == 0:
            raise ArgumentError(f"{coll}: {limits.why}")
        raise ArgumentError(f"{coll}: {what}: expected " + ("0" if n == 1 else f"0..{n - 1}")
                            + f", got {v} ({limits.why})")
    return v


def _sig(coll: str, signal: Any, ctx_id: Any, limits: RmaLimits) -> Tuple[int, int]:
    return (_index(coll, "signal", signal, limits.signals, limits),
            _index(coll, "ctx", ctx_id, limits.contexts, limits))


def source_window(ptr: int, nbytes: int,
                  windows: Iterable[Tuple[int, int, bool]]) -> Optional[int]:
    """The index of the window (``(ptr, nbytes, symmetric)`` rows) NCCL reads a put's source
    through, else None.  As NCCL finds it (dev_runtime.cc ncclDevrFindWindow: the window with
    the highest start at or below ``ptr``, holding ``ptr``), which must be symmetric
    ("srcWinHost is not in a valid symmetric window"); ncclpy asks also that it hold all
    ``nbytes``."""
    rows = list(windows)
    below = [i for i, (wp, _wn, _s) in enumerate(rows) if wp <= ptr]
    if not below:
        return None
    i = max(below, key=lambda k: rows[k][0])
    wp, wn, sym = rows[i]
    if not sym or ptr - wp >= wn or ptr + nbytes > wp + wn:
        return None
    return i


def plan_put_signal(ctx: PlanContext, buf: Any, peer: Any, window: int, offset: Any = 0,
                    signal: Any = 0, ctx_id: Any = 0,
                    limits: RmaLimits = RmaLimits()) -> Plan:
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
    sig, cx = _sig(C, signal, ctx_id, limits)
    w = wire(ctx, C, b.dtype)
    return one_call_plan(C, "PutSignal", (b.ptr, w.count(b.count), w.nccl, peer, window, off,
                                          sig, cx, 0), b.nbytes,
                         {"dtype": b.dtype, "peer": peer, "offset": off, "signal": sig,
                          "ctx": cx}, path="rma")


def plan_signal(ctx: PlanContext, peer: Any, signal: Any = 0, ctx_id: Any = 0,
                limits: RmaLimits = RmaLimits()) -> Plan:
    """ncclSignal: raise ``peer``'s signal ``signal`` of context ``ctx_id``, no data."""
    C = "signal"
    check_ctx(ctx, C)
    peer = rank_arg(ctx, C, "peer", peer)
    sig, cx = _sig(C, signal, ctx_id, limits)
    return one_call_plan(C, "Signal", (peer, sig, cx, 0), 0,
                         {"peer": peer, "signal": sig, "ctx": cx}, path="rma")


def wait_descriptors(ctx: PlanContext, waits: Any,
                     limits: RmaLimits = RmaLimits()) -> List[Tuple[int, int, int, int]]:
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
        sig, cx = _sig(C, it[2] if len(it) > 2 else 0, it[3] if len(it) > 3 else 0, limits)
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
