"""The CPU engine's CUDA runtime (``ncclpy._nccl.cuda``'s object): devices, streams as ordered
queues, events, copies and stream-capture modes on host memory (see :mod:`ncclpy.cpu.engine`)."""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from .._nccl.cuda import CapturedEventError
from .core import EngineCore, Graph, _Item, _Mem

__all__ = ["CpuRuntime", "CpuCudaError"]


class CpuCudaError(RuntimeError):
    """What the CPU runtime raises (CuPy's CUDARuntimeError's stand-in, with its
    ``status``: the cudaError_t)."""

    def __init__(self, msg: str, status: Optional[int] = None) -> None:
        super().__init__(msg)
        self.status = status


# -- the CUDA runtime ---------------------------------------------------------------------------
def _captured(deps: Any) -> bool:
    """An event's state says it was last recorded in a capture: ("captured", its capture)."""
    return type(deps) is tuple and len(deps) == 2 and deps[0] == "captured"


class CpuRuntime:
    """``ncclpy._nccl.cuda``'s object, on host memory and queues (see the module docstring)."""

    name = "standin"

    def __init__(self, eng: EngineCore) -> None:
        self.e = eng
        self.local_capture_threads: List[int] = []
        self.modes: Dict[int, int] = {}            # thread -> CUstreamCaptureMode (0 global)
        self.captures: Dict[Tuple[int, int], Dict[str, Any]] = {}   # stream key -> capture
        self.event_device: Dict[int, int] = {}     # event -> the device it was made on

    def device_count(self) -> int:
        return self.e.ndev

    def get_device(self) -> int:
        return self.e.tls().device

    def set_device(self, device: int) -> None:
        if not 0 <= device < self.e.ndev:
            raise CpuCudaError(f"invalid device {device}")
        self.e.tls().device = device

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        t = self.e.tls()
        prev, t.device = t.device, device
        try:
            yield
        finally:
            t.device = prev

    def use_device(self, device: int) -> None:
        self.set_device(device)

    def new_stream(self) -> int:
        return self.e.new_id()

    def current_stream(self, device: int) -> int:
        return self.e.tls().stream

    def stream_is_capturing(self, stream: int) -> bool:
        return self._capturing(stream)

    def _capturing(self, stream: int) -> bool:
        return self.e.skey(stream) in self.e.capturing

    def capture_status(self, stream: int) -> int:
        """cudaStreamIsCapturing's status (0 none, 1 active, 2 invalidated)."""
        if not self._capturing(stream):
            return 0
        info = self.captures.get(self.e.skey(stream))
        return 2 if info is not None and info["invalid"] else 1

    def begin_capture(self, stream: int, mode: int = 0) -> None:
        """cudaStreamBeginCapture in ``mode`` (0 global: torch.cuda.graph's default)."""
        key = self.e.skey(stream)
        self.e.capturing[key] = []
        self.captures[key] = {"thread": threading.get_ident(), "mode": mode, "invalid": ""}

    def end_capture(self, stream: int) -> Graph:
        key = self.e.skey(stream)
        info = self.captures.pop(key, None)
        makers = self.e.capturing.pop(key)
        if info is not None and info["invalid"]:
            raise CpuCudaError(f"cudaErrorStreamCaptureInvalidated: {info['invalid']}")
        return Graph(makers)

    # CUDA's stream-capture interaction modes (cudaThreadExchangeStreamCaptureMode): a thread
    # in the global mode is prohibited from potentially unsafe calls (cudaEventQuery among
    # them) while any thread captures in the global mode, or while it captures itself; the
    # thread-local mode only while it captures itself; the relaxed mode never.  A prohibited
    # call fails with cudaErrorStreamCaptureUnsupported and invalidates the capture.
    def exchange_capture_mode(self, mode: int) -> int:
        t = threading.get_ident()
        prev = self.modes.get(t, 0)
        self.modes[t] = int(mode)
        return prev

    def _prohibited(self, call: str) -> None:
        me = threading.get_ident()
        mode = self.modes.get(me, 0)
        if mode == 2:
            return
        hit = [info for info in self.captures.values() if info["mode"] != 2 and (
            info["thread"] == me or (mode == 0 and info["mode"] == 0))]
        for info in hit:
            info["invalid"] = info["invalid"] or f"{call} from a thread in the global mode"
        if hit:
            raise CpuCudaError(f"cudaErrorStreamCaptureUnsupported: {call} during a "
                                   f"stream capture")

    def launch(self, graph: Graph, stream: int) -> None:
        for make in graph.makers:
            self.e.enqueue(stream, make)

    def event_create(self) -> int:
        ev = self.e.new_id()
        self.e.events[ev] = ()
        self.event_device[ev] = self.e.tls().device   # the current device's context
        return ev

    def event_record(self, event: int, stream: int) -> None:
        e = self.e
        # cuEventRecord: "hEvent and hStream must be from the same context otherwise
        # CUDA_ERROR_INVALID_HANDLE is returned"; the legacy (0, 1) and per-thread (2) default
        # streams are the current device's
        if stream in (0, 1, 2) and self.event_device.get(event, e.tls().device) != \
                e.tls().device:
            raise CpuCudaError(f"cudaErrorInvalidResourceHandle: event {event} of device "
                                   f"{self.event_device[event]} on the default stream of "
                                   f"device {e.tls().device}", 400)
        with e.lock:
            key = e.skey(stream)
            if key in e.capturing:
                e.events[event] = ("captured", self.captures.get(key))
                return
            q = e.streams[e.skey(stream)]
            e.events[event] = tuple(it for it in q if not it.done)

    def event_query(self, event: int) -> bool:
        e = self.e
        self._prohibited("cudaEventQuery")
        with e.lock:
            deps = e.events.get(event)
            if deps is None:
                raise CpuCudaError(f"cudaErrorInvalidResourceHandle: event {event}")
            if _captured(deps):
                # last recorded in a capturing stream.  While that capture is under way: 907,
                # and the capture is invalidated, whatever the thread's mode (an H200, CUDA
                # 13.0: a watchdog's query in the thread-local mode broke torch.cuda.graph's
                # capture, docs/gpu-runs.md 2026-11-26); once it ended: cudaErrorInvalidValue
                info = deps[1]
                if info is not None and any(i is info for i in self.captures.values()):
                    info["invalid"] = info["invalid"] or "cudaEventQuery of an event " \
                        "recorded in this capture"
                    raise CapturedEventError("cudaErrorCapturedEvent: the event was last "
                                             "recorded in a capturing stream")
                raise CapturedEventError("cudaErrorInvalidValue: the event was last recorded "
                                         "in a stream capture that has ended", 1)
            e.progress()
            return all(it.done for it in deps)

    def event_destroy(self, event: int) -> None:
        self.e.events.pop(event, None)

    def stream_wait_event(self, stream: int, event: int) -> None:
        deps = self.e.events.get(event, ())
        if _captured(deps):
            deps = ()
        self.e.enqueue(stream, lambda: _Item("wait", ready=lambda: all(i.done for i in deps)))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.e.enqueue(stream, lambda: _Item("copy", run=lambda: ctypes.memmove(dst, src, nbytes)))

    def alloc(self, nbytes: int, stream: int, device: int) -> Any:
        return _Mem(nbytes)

    def malloc_async(self, nbytes: int, stream: int) -> int:
        m = _Mem(nbytes)
        self.e.async_allocs[m.ptr] = m
        return m.ptr

    def free_async(self, ptr: int, stream: int) -> None:
        self.e.enqueue(stream, lambda: _Item("free", run=lambda: self.e.async_allocs.pop(ptr,
                                                                                     None)))

    def device_array(self, arr: np.ndarray, device: int) -> Any:
        """``arr`` as memory of ``device``: ``arr`` itself, host memory being the device's here.
        A hook: the tests' GPU-posing runtime (tests/nccl_standin.py) wraps it as device
        memory (``__cuda_array_interface__``)."""
        return arr

    def zeros_float32(self, count: int, device: int) -> Any:
        return self.device_array(np.zeros(count, np.float32), device)

    def thread_capture_mode_local(self) -> bool:
        self.local_capture_threads.append(threading.get_ident())
        self.exchange_capture_mode(1)
        return True
