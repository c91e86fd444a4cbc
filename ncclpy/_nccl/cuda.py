"""The CUDA side of ncclpy's native boundary: every CUDA runtime call the call path makes.

The communicator, its Works, the executor and the stream defaults reach CUDA only through the
object :func:`cuda` returns: by default :class:`CupyRuntime` (CuPy's runtime bindings, CuPy's
memory pool, CuPy's current stream, and the driver's ``cuThreadExchangeStreamCaptureMode``).
One object, so that a CPU test can put a stand-in in its place (:func:`use`) and run the
communicator's own logic -- lifecycle, Works, groups, copies, scratch -- without a GPU; a
stand-in never makes a GPU test pass.

Events and streams are raw handles (ints).  ``event_query`` returns True (done) or False (not
ready) and raises CuPy's ``CUDARuntimeError`` for anything else.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any, Iterator, Optional

__all__ = ["CupyRuntime", "cuda", "use", "CAPTURE_MODE_GLOBAL", "CAPTURE_MODE_THREAD_LOCAL",
           "CAPTURE_MODE_RELAXED"]

log = logging.getLogger(__name__)

_NOT_READY = 600                  # cudaErrorNotReady
CAPTURE_MODE_GLOBAL = 0           # CUstreamCaptureMode: CU_STREAM_CAPTURE_MODE_GLOBAL
CAPTURE_MODE_THREAD_LOCAL = 1     # ... _THREAD_LOCAL
CAPTURE_MODE_RELAXED = 2          # ... _RELAXED
_MEMCPY_D2D = 3                   # cudaMemcpyDeviceToDevice


class CupyRuntime:
    """The real CUDA runtime, through CuPy (imported on first use: ``import ncclpy`` stays
    light)."""

    name = "cupy"

    def __init__(self) -> None:
        from cupy.cuda import runtime
        self.rt = runtime
        self._driver: Any = None
        self._get_current_stream: Any = None

    # -- devices ----------------------------------------------------------------------------
    def device_count(self) -> int:
        return int(self.rt.getDeviceCount())

    def get_device(self) -> int:
        return self.rt.getDevice()

    def set_device(self, device: int) -> None:
        self.rt.setDevice(device)

    def device(self, device: int) -> Any:
        """A context manager making ``device`` current (CuPy's Device)."""
        import cupy
        return cupy.cuda.Device(device)

    def use_device(self, device: int) -> None:
        """Make ``device`` CuPy's current device for this thread (outside any block)."""
        import cupy
        cupy.cuda.Device(device).use()

    # -- streams and events -----------------------------------------------------------------
    def stream_is_capturing(self, stream: int) -> bool:
        return bool(self.rt.streamIsCapturing(stream))

    def event_create(self) -> int:
        return self.rt.eventCreateWithFlags(self.rt.eventDisableTiming)

    def event_record(self, event: int, stream: int) -> None:
        self.rt.eventRecord(event, stream)

    def event_query(self, event: int) -> bool:
        status = self.rt.eventQuery(event)
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        self.rt.check_status(status)   # raises CUDARuntimeError
        return False                   # pragma: no cover

    def event_destroy(self, event: int) -> None:
        self.rt.eventDestroy(event)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.rt.streamWaitEvent(stream, event, 0)

    def current_stream(self, device: int) -> int:
        """CuPy's current stream on ``device`` (a call's default stream: kept cheap)."""
        get = self._get_current_stream
        if get is None:
            import cupy
            get = self._get_current_stream = cupy.cuda.get_current_stream
        try:
            return get(device).ptr
        except TypeError:  # older CuPy: no device argument
            import cupy
            with cupy.cuda.Device(device):
                return int(get().ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, _MEMCPY_D2D, stream)

    # -- memory -----------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: int, device: int) -> Any:
        """``nbytes`` from CuPy's pool, in the order of ``stream`` (an object with ``.ptr``
        that frees the memory when dropped)."""
        import cupy
        from .dispatch import cupy_stream_for
        with cupy.cuda.Device(device), cupy_stream_for(stream, device):
            return cupy.cuda.alloc(nbytes)

    def malloc_async(self, nbytes: int, stream: int) -> int:
        """Stream-ordered allocation (``cudaMallocAsync``): legal inside a graph capture, where
        it becomes an allocation node."""
        return int(self.rt.mallocAsync(nbytes, stream))

    def free_async(self, ptr: int, stream: int) -> None:
        self.rt.freeAsync(ptr, stream)

    def zeros_float32(self, count: int, device: int) -> Any:
        """A zeroed float32 device array (CuPy) of ``count`` elements on ``device``."""
        import cupy
        with cupy.cuda.Device(device):
            return cupy.zeros(count, dtype=cupy.float32)

    # -- capture interaction ------------------------------------------------------------------
    def thread_capture_mode_local(self) -> bool:
        """Give this thread the ``ThreadLocal`` stream-capture interaction mode: its CUDA calls
        (event queries) are then not prohibited by, and cannot invalidate, another thread's
        capture in the default global mode (torch.cuda.graph's).  False where the driver API
        cannot be reached."""
        return self.exchange_capture_mode(CAPTURE_MODE_THREAD_LOCAL) is not None

    def exchange_capture_mode(self, mode: int) -> Optional[int]:
        """``cuThreadExchangeStreamCaptureMode``: this thread's capture interaction mode
        becomes ``mode``; returns the previous one (None where the driver API cannot be
        reached: nothing changed)."""
        drv = self._driver
        if drv is None:
            try:
                drv = ctypes.CDLL("libcuda.so.1")
                drv.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
                drv.cuThreadExchangeStreamCaptureMode.restype = ctypes.c_int
            except (OSError, AttributeError) as e:
                log.debug("no cuThreadExchangeStreamCaptureMode: %s", e)
                self._driver = False
                return None
            self._driver = drv
        if drv is False:
            return None
        m = ctypes.c_int(int(mode))
        if drv.cuThreadExchangeStreamCaptureMode(ctypes.byref(m)) != 0:
            return None
        return int(m.value)


_backend: Optional[Any] = None


def cuda() -> Any:
    """The CUDA runtime object of this process (:class:`CupyRuntime` unless :func:`use` put a
    stand-in in its place)."""
    b = _backend
    if b is None:
        b = _set(CupyRuntime())
    return b


def _set(b: Any) -> Any:
    global _backend
    _backend = b
    return b


@contextlib.contextmanager
def use(backend: Any) -> Iterator[Any]:
    """Put ``backend`` in place of the CUDA runtime for the block (tests' stand-ins)."""
    prev = _backend
    _set(backend)
    try:
        yield backend
    finally:
        _set(prev)
