"""``Work``: the handle every communicator call returns, built on a CUDA event.

The event is recorded on the call's stream right after the NCCL work was enqueued (for calls
made inside ``group()``: right after the outermost group end).  ``wait()`` blocks the host on
it, ``wait(stream)`` makes another stream wait for it (no host block), ``is_completed()`` queries
it.  A Work keeps the call's scratch memory and buffers alive until it has seen completion; for
nonblocking communicators (and on every host wait) it also checks ``ncclCommGetAsyncError``.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from .errors import NcclpyError, NcclTimeoutError

__all__ = ["Work"]


class Work:
    """Completion handle of one communicator call (see module docstring)."""

    __slots__ = ("_comm", "_device", "_stream", "_event", "_keep", "_error", "plan",
                 "__weakref__")

    def __init__(self, comm: Any, device: int, stream: int, plan: Any = None,
                 keep: Any = ()) -> None:
        self._comm = comm
        self._device = device
        self._stream = stream
        self._event = None
        self._keep = keep
        self._error: Optional[BaseException] = None
        self.plan = plan

    # -- set up by the executor ---------------------------------------------------------
    def _record(self) -> None:
        """Create the event and record it on the call's stream."""
        import cupy
        from cupy.cuda import runtime
        with cupy.cuda.Device(self._device):
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            runtime.eventRecord(ev.ptr, self._stream)
        self._event = ev

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._keep = ()

    def _completed(self) -> None:
        self._keep = ()

    # -- public -------------------------------------------------------------------------
    @property
    def stream(self) -> int:
        """The raw ``cudaStream_t`` the call was enqueued on."""
        return self._stream

    @property
    def event(self):
        """The ``cupy.cuda.Event`` (None while the enclosing group is still open)."""
        return self._event

    def _ready_event(self):
        if self._error is not None:
            raise self._error
        if self._event is None:
            raise NcclpyError("this Work comes from a call made inside group(): its NCCL work "
                              "is launched when the outermost group ends; wait after the "
                              "'with group()' block")
        return self._event

    def wait(self, stream: Any = None, *, timeout: Optional[float] = None) -> None:
        """Host-block until done (``stream`` None), or make ``stream`` wait (no host block).

        ``timeout`` (seconds, host wait only): poll instead of blocking and raise
        NcclTimeoutError when exceeded; the communicator's async error is checked while polling,
        so a failed peer surfaces as an NcclError instead of a hang.
        """
        ev = self._ready_event()
        if stream is not None:
            from cupy.cuda import runtime

            from .streams import as_stream_handle
            runtime.streamWaitEvent(as_stream_handle(stream), ev.ptr, 0)
            return
        if timeout is None:
            ev.synchronize()
        else:
            deadline = time.monotonic() + timeout
            delay = 1e-5
            while not ev.done:
                self._check_comm()
                if time.monotonic() > deadline:
                    raise NcclTimeoutError(8, "Work.wait",
                                           f"not complete after {timeout:g} s (stream "
                                           f"{self._stream:#x})")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        self._completed()
        self._check_comm()

    def is_completed(self) -> bool:
        """Whether the work is done (never blocks)."""
        if self._error is not None:
            raise self._error
        if self._event is None:
            return False
        if self._comm is not None and getattr(self._comm, "nonblocking", False):
            self._check_comm()
        if self._event.done:
            self._completed()
            return True
        return False

    def _check_comm(self) -> None:
        comm = self._comm
        if comm is not None:
            comm._raise_async_error()

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "pending group end"
                 if self._event is None else "recorded")
        name = getattr(self.plan, "collective", "?")
        return f"<ncclpy.Work {name} stream={self._stream:#x} {state}>"
