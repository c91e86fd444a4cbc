"""One-sided RMA on a communicator (NCCL >= 2.29): ``put_signal``, ``signal``, ``wait_signal``.

A mixin of :class:`ncclpy.Communicator`.  Each call is planned (:mod:`ncclpy.plan.rma`: every
argument checked before NCCL) and issued like a collective: it returns a
:class:`~ncclpy.comm.work.Work`, goes through the flight recorder and the watchdog, and may
be made inside ``with comm.group():`` (NCCL launches the group's calls together).  One-sided
calls have no partner call on the peer, so checked mode neither compares nor pairs them.

NCCL's rules are checked first (:mod:`ncclpy.plan.rma`): the source of a put must lie in a
window of this communicator registered with ``symmetric=True``; the signal index and context
are 0 before NCCL 2.32.  The usual exchange, rank 0 writing its window ``src`` into rank 1's
window ``dst``::

    src_buf, dst_buf = ncclpy.nccl_empty(n, "float32"), ncclpy.nccl_empty(n, "float32")
    with comm.register_window(src_buf) as src, comm.register_window(dst_buf) as dst:
        if comm.rank == 0:                           # (every rank registers, same order)
            comm.put_signal(src_buf, peer=1, window=dst).wait()
        else:
            comm.wait_signal({0: 1}).wait()          # one signal from rank 0: data is there
"""
from __future__ import annotations

import os
from typing import Any

from .._nccl.functions import WaitSignalDescStruct
from .._nccl.group import group_depth
from .._nccl.lib import require_version
from ..errors import ArgumentError, ArgumentTypeError
from ..plan import rma as _plan
from .execute import issue
from .resolver import Resolved
from .streams import default_stream, default_stream_of, stream_handle

__all__ = ["CommRMA"]


class CommRMA:
    """put_signal / signal / wait_signal of a Communicator (uses ``_lib``, ``_device``,
    ``_resolver``, ``_check_usable``)."""

    _lib: Any
    _device: int
    _resolver: Any
    _check_usable: Any

    def put_signal(self, buf: Any, peer: int, window: Any, offset: int = 0, *,
                   signal: int = 0, ctx: int = 0, stream: Any = None) -> Any:
        """``ncclPutSignal``: write all of ``buf`` into ``peer``'s part of ``window`` (a
        :class:`~ncclpy.Window` of this communicator) at byte ``offset``, then raise the
        peer's signal ``signal`` of context ``ctx``; the peer learns the data arrived from
        ``wait_signal``.  ``buf`` must lie in a window of this communicator registered with
        ``symmetric=True`` (NCCL reads the source through it); the peer's window must hold
        ``offset + buf's bytes`` (NCCL checks its own side).  Returns a Work."""
        self._check_usable("put_signal")
        handle = self._window_handle(window)
        spec = self._resolver.parse("send", buf)[0]
        plan = _plan.plan_put_signal(self._resolver._ctx, spec, peer, handle, offset, signal,
                                     ctx, self._rma_limits())
        self._check_source(spec)
        s = default_stream_of(buf, self._device) if stream is None else stream_handle(stream)
        return self._rma("ncclPutSignal", plan, s, (buf, window))

    def signal(self, peer: int, *, signal: int = 0, ctx: int = 0, stream: Any = None) -> Any:
        """``ncclSignal``: raise ``peer``'s signal ``signal`` of context ``ctx`` (no data).
        Returns a Work."""
        self._check_usable("signal")
        plan = _plan.plan_signal(self._resolver._ctx, peer, signal, ctx, self._rma_limits())
        s = default_stream((), self._device) if stream is None else stream_handle(stream)
        return self._rma("ncclSignal", plan, s, ())

    def wait_signal(self, waits: Any, *, stream: Any = None) -> Any:
        """``ncclWaitSignal``: the stream waits until each peer's signals arrived --
        ``waits`` is ``{peer: count}`` or ``[(peer, count[, signal[, ctx]]), ...]``.  Returns
        a Work (complete once every awaited signal came)."""
        self._check_usable("wait_signal")
        rows = _plan.wait_descriptors(self._resolver._ctx, waits, self._rma_limits())
        arr = (WaitSignalDescStruct * len(rows))()
        for d, (count, peer, sig, cx) in zip(arr, rows):
            d.opCnt, d.peer, d.sigIdx, d.ctx = count, peer, sig, cx
        from ctypes import addressof
        plan = _plan.plan_wait_signal(self._resolver._ctx, rows, addressof(arr))
        s = default_stream((), self._device) if stream is None else stream_handle(stream)
        return self._rma("ncclWaitSignal", plan, s, (arr,))   # the array lives with the Work

    def _rma_limits(self) -> Any:
        """The Config's num_rma_sig / num_rma_ctx, ``NCCL_NUM_RMA_CTX`` winning where set and
        not negative, as NCCL applies it (init.cc envConfigOverride)."""
        cfg = getattr(self, "_config", None)
        n_ctx = getattr(cfg, "num_rma_ctx", None)
        env = os.environ.get("NCCL_NUM_RMA_CTX", "").strip()
        if env.lstrip("-").isdigit() and int(env) >= 0:
            n_ctx = int(env)
        return _plan.rma_limits(self._lib.version, getattr(cfg, "num_rma_sig", None), n_ctx)

    def _check_source(self, spec: Any) -> None:
        """NCCL reads a put's source through a symmetric window of this communicator
        (enqueue.cc rmaTaskAppend: "srcWinHost is not in a valid symmetric window")."""
        from ..semantics.dtypes import logical
        nbytes = int(spec.count) * logical(spec.dtype).itemsize
        wins = [w for w in self.windows() if w.registered]      # type: ignore[attr-defined]
        # (every registered window: NCCL looks the address up among all of them)
        if _plan.source_window(spec.ptr, nbytes, [(w.ptr, w.nbytes, w.symmetric)
                                                  for w in wins]) is None:
            raise ArgumentError(
                f"put_signal: buf: expected memory inside a window of this communicator "
                f"registered with symmetric=True (NCCL reads the source through it), got "
                f"{nbytes} bytes at {spec.ptr:#x}, which no such window holds; register the "
                f"source too (comm.register_window(src))")

    def _window_handle(self, window: Any) -> int:
        from .window import OPEN, Window
        if not isinstance(window, Window):
            raise ArgumentTypeError(f"put_signal: window: expected an ncclpy.Window from "
                                    f"comm.register_window, got {type(window).__name__}")
        if window._comm is not self:
            raise ArgumentError("put_signal: window: it was registered on another "
                                "communicator; expected one of this communicator's windows")
        if window.state != OPEN:
            window._check_open("put_signal")
        if not window.handle:
            raise ArgumentError("put_signal: window: NCCL registered no window here (this "
                                "communicator has no symmetric support, e.g. ranks sharing a "
                                "GPU); one-sided puts need a registered window")
        return window.handle

    def _rma(self, fn: str, plan: Any, stream: int, keep: Any) -> Any:
        lib = self._lib
        require_version(fn, lib.version, lib.path)
        return issue(self, Resolved(plan, stream, group_depth() > 0), keep)
