"""The CUDA side of ncclpy's native boundary: every CUDA runtime call the call path makes.

The communicator, its Works, the executor and the stream defaults reach CUDA only through the
object :func:`cuda` returns: by default :class:`CupyRuntime` (CuPy's runtime bindings, CuPy's
memory pool, CuPy's current stream, and the driver's ``cuThreadExchangeStreamCaptureMode``).
One object, so that a CPU test can put a stand-in in its place (:func:`use`) and run the
communicator's own logic -- lifecycle, Works, groups, copies, scratch -- without a GPU; a
stand-in never makes a GPU test pass.

Events and streams are raw handles (ints).  ``event_query`` returns True (done) or False (not
ready), raises :class:`CapturedEventError` for an event last recorded in a capturing stream
(``cudaErrorCapturedEvent``: how a call learns it was captured into a graph, see
docs/reference/concepts/graphs.rst) and CuPy's ``CUDARuntimeError`` for anything else.
``event_record`` is CuPy's own binding (no Python frame of ncclpy's around it: the call path
makes it on every call).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any, Iterator, Optional

__all__ = ["CupyRuntime", "cuda", "use", "CAPTURE_MODE_GLOBAL", "CAPTURE_MODE_THREAD_LOCAL",
           "CAPTURE_MODE_RELAXED", "CapturedEventError", "CAPTURED_EVENT", "INVALID_HANDLE",
           "LEGACY_STREAMS", "cupy_stream_for"]

log = logging.getLogger(__name__)

_NOT_READY = 600                  # cudaErrorNotReady
CAPTURED_EVENT = 907              # cudaErrorCapturedEvent: last recorded in a capturing stream
INVALID_VALUE = 1                 # cudaErrorInvalidValue: a captured event once its capture ended
INVALID_HANDLE = 400              # cudaErrorInvalidResourceHandle (event and stream: 2 contexts)
#: handles that name a stream of the *current* device: the legacy default stream (0) and the
#: per-thread default stream (2); a record on them needs the event's device current
LEGACY_STREAMS = (0, 1, 2)
CAPTURE_MODE_GLOBAL = 0           # CUstreamCaptureMode: CU_STREAM_CAPTURE_MODE_GLOBAL
CAPTURE_MODE_THREAD_LOCAL = 1     # ... _THREAD_LOCAL
CAPTURE_MODE_RELAXED = 2          # ... _RELAXED
_MEMCPY_D2D = 3                   # cudaMemcpyDeviceToDevice


class CapturedEventError(RuntimeError):
    """A query of an event last recorded in a capturing stream: the call it follows was
    captured into a CUDA graph (and runs at each replay).  CUDA answers
    ``cudaErrorCapturedEvent`` (907) while the capture is under way and
    ``cudaErrorInvalidValue`` (1) once it has ended (seen on an H200, driver 580, CUDA 13.0,
    2026-11-26: ``docs/gpu-runs.md``); ``status`` says which."""

    status = CAPTURED_EVENT

    def __init__(self, message: str, status: int = CAPTURED_EVENT) -> None:
        super().__init__(message)
        self.status = status


def status_of(exc: BaseException) -> Optional[int]:
    """The ``cudaError_t`` of a CUDA runtime error (CuPy's CUDARuntimeError, the stand-in's),
    or None."""
    st = getattr(exc, "status", None)
    return st if isinstance(st, int) else None


class CupyRuntime:
    """The real CUDA runtime, through CuPy (imported on first use: ``import ncclpy`` stays
    light)."""

    name = "cupy"

    def __init__(self) -> None:
        from cupy.cuda import runtime
        self.rt = runtime
        self._driver: Any = None
        self._get_current_stream: Any = None
        #: CuPy's Cython bindings themselves: the two CUDA calls a steady-state call makes
        self.event_record = runtime.eventRecord
        self.capture_status = runtime.streamIsCapturing   # cudaStreamCaptureStatus: 0 none

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

    def capture_status(self, stream: int) -> int:   # replaced in __init__
        """``cudaStreamIsCapturing``: 0 none, 1 active, 2 invalidated."""
        return int(self.rt.streamIsCapturing(stream))

    def event_create(self) -> int:
        return self.rt.eventCreateWithFlags(self.rt.eventDisableTiming)

    def event_record(self, event: int, stream: int) -> None:   # replaced in __init__
        self.rt.eventRecord(event, stream)

    def event_query(self, event: int) -> bool:
        status = self.rt.eventQuery(event)
        if status == 0:
            return True
        try:                           # raises, and clears the thread's last error (which a
            self.rt.check_status(status)   # later launch check, torch's, would report)
        except Exception:  # noqa: BLE001 - said below, as what it means here
            if status == _NOT_READY:
                return False
            if status == CAPTURED_EVENT:
                raise CapturedEventError("cudaErrorCapturedEvent: the event was last recorded "
                                         "in a capturing stream") from None
            if status == INVALID_VALUE:   # a pooled event is never destroyed while queried:
                raise CapturedEventError(   # recorded in a capture that has ended
                    "cudaErrorInvalidValue: the event was last recorded in a stream capture "
                    "that has ended", INVALID_VALUE) from None
            raise
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
_backend_lock = threading.Lock()    # the first CupyRuntime vs a stand-in put in place meanwhile


def cuda() -> Any:
    """The CUDA runtime object of this process (:class:`CupyRuntime` unless :func:`use` put a
    stand-in in its place)."""
    b = _backend
    if b is None:
        with _backend_lock:
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
    with _backend_lock:
        prev = _backend
        _set(backend)
    try:
        yield backend
    finally:
        with _backend_lock:
            _set(prev)


class _StreamProto:
    __slots__ = ("h",)

    def __init__(self, h: int) -> None:
        self.h = h

    def __cuda_stream__(self):
        return (0, self.h)


def cupy_stream_for(handle: int, device: int) -> Any:
    """A CuPy stream object for a raw handle (made current while allocating scratch, so CuPy's
    pool reuses that memory in the order of this stream)."""
    import cupy
    S = cupy.cuda.Stream
    if handle == 0:
        return S.null
    if handle == 2 and hasattr(S, "ptds"):
        return S.ptds
    if hasattr(S, "from_external"):
        return S.from_external(_StreamProto(handle))
    return cupy.cuda.ExternalStream(handle, device)
