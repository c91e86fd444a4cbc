"""CuPy arrays, one non-blocking stream, graphs, events: shared by the ncclpy, cupy and nccl4py
backends; :class:`SharedCuda`, the one stream and buffers bench.overhead gives every backend."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ncclpy.semantics.dtypes import DTYPES
from ncclpy.errors import MissingDependencyError, NcclpyError, UnsupportedError
from ncclpy.semantics.ops import format_version

from . import Backend, Buffers, host_dtype, layout

__all__ = ["CupyStreamBackend", "import_cupy", "SharedCuda", "StreamTimeout"]


#: cudaErrorNotReady: what cudaStreamQuery answers while work is pending (driver_types.h)
_CUDA_ERROR_NOT_READY = 600


class StreamTimeout(NcclpyError, TimeoutError):
    """A stream synchronisation outlasted nccl-tests' ``-T`` bound (the communicator was
    aborted)."""


def import_cupy():
    """CuPy, or MissingDependencyError naming the extra to install."""
    try:
        import cupy
    except ImportError as e:
        raise MissingDependencyError(
            f"the ncclpy and cupy backends need CuPy ({e}); install ncclpy[cu12] or "
            f"ncclpy[cu13]") from None
    return cupy


class CupyStreamBackend(Backend):
    """Device buffers are CuPy arrays; every call goes on ``self.stream``.

    The life cycle is shared: ``setup`` picks the device, makes the stream, shares an NCCL
    unique id through the harness's store and asks the subclass for its communicator
    (:meth:`open_comm`); ``teardown`` drains the stream and hands it back (:meth:`close_comm`).
    """

    supports_graphs = True
    supports_events = True
    stream_form = "the raw handle (int) of the stream"
    comm: Any = None
    #: what ``run`` passes as the stream: ``self.stream`` itself for the sweep, its raw handle
    #: after :meth:`use_stream`
    stream_arg: Any = None
    #: the generation of the unique id the communicator was made from (its store keys)
    generation = 0
    #: nccl-tests' -T: seconds a stream synchronisation may take (None: no bound)
    sync_timeout: Optional[float] = None

    def setup(self, rank: int, world: int, device: Optional[int], store: Any, *,
              master_addr: str = "127.0.0.1", timeout: float = 300.0) -> None:
        super().setup(rank, world, device, store, master_addr=master_addr, timeout=timeout)
        self._setup_device(device)
        from ncclpy.rendezvous.bootstrap import exchange_uid
        uid, self.generation = exchange_uid(store, rank, name=f"bench-{self.name}",
                                            timeout=timeout, world_size=world)
        self.comm = self.open_comm(uid)

    def open_comm(self, uid: bytes) -> Any:
        """This backend's communicator of ``self.world`` ranks from the shared unique id."""
        raise NotImplementedError

    def close_comm(self, comm: Any) -> None:
        """Destroy ``comm`` (the stream is already drained)."""
        raise NotImplementedError

    def teardown(self) -> None:
        if self.comm is not None:
            self.stream.synchronize()
            self.close_comm(self.comm)
            self.comm = None

    def _setup_device(self, device: Optional[int]) -> None:
        if device is None:
            raise UnsupportedError(f"backend {self.name} needs a CUDA device (--device cuda)")
        cp = self.cp = import_cupy()
        cp.cuda.Device(device).use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream_arg = self.stream

    def use_stream(self, stream: Any) -> None:
        self.stream = stream
        self.stream_arg = int(stream.ptr)

    def adopt(self, bufs: Buffers) -> Buffers:
        return bufs

    def unsupported(self, collective: str, dtype: str, op: str) -> Optional[str]:
        need = DTYPES[dtype].min_nccl
        if need and self.nccl_version() < need:
            return f"dtype {dtype} needs NCCL >= {format_version(need)}"
        if dtype.startswith("float8"):
            cc = int(self.cp.cuda.Device(self.device).compute_capability)
            if cc < 90:  # nccl-tests drops fp8 below Hopper too
                return f"dtype {dtype} needs compute capability >= 9.0, this GPU has {cc}"
        return None

    def device_info(self) -> Dict[str, str]:
        cp = self.cp
        try:
            bus = cp.cuda.runtime.deviceGetPCIBusId(self.device)
            props = cp.cuda.runtime.getDeviceProperties(self.device)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # pragma: no cover - informational only
            bus, name = "?", "?"
        return {"device_hex": bus, "device_info": name}

    def empty(self, n: int, dtype: str) -> Any:
        with self.stream:
            return self.cp.zeros(max(n, 0), dtype=host_dtype(dtype))

    def zero(self, arr: Any) -> None:
        if arr.size:
            with self.stream:
                arr.fill(0)

    def upload(self, arr: Any, host: np.ndarray) -> None:
        if arr.size:
            arr.set(np.ascontiguousarray(host).view(arr.dtype), stream=self.stream)

    def download(self, arr: Any) -> np.ndarray:
        out = arr.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def sync(self) -> None:
        """Wait for the stream; with ``sync_timeout`` (nccl-tests' ``-T``) poll it as nccl-tests'
        ``testStreamSynchronize`` does (common.cu): ``cudaStreamQuery`` until it is done, a CUDA
        error other than ``cudaErrorNotReady`` raised at once, the communicator's asynchronous
        error checked on every poll (an NCCL error aborts at once), and past the bound abort
        the communicator and raise :class:`StreamTimeout`."""
        if self.sync_timeout is None:
            self.stream.synchronize()
            return
        runtime = self.cp.cuda.runtime
        deadline = time.monotonic() + self.sync_timeout
        while True:
            st = runtime.streamQuery(self.stream.ptr)
            if st == 0:
                return
            if st != _CUDA_ERROR_NOT_READY:        # a sticky fault is not a slow stream
                raise runtime.CUDARuntimeError(st)
            try:
                self.check_comm()
            except Exception:
                self.abort_comm()
                raise
            if time.monotonic() > deadline:
                self.abort_comm()
                raise StreamTimeout(
                    f"-T/--timeout {self.sync_timeout:g}: rank {self.rank}'s {self.label} "
                    f"stream did not finish within {self.sync_timeout:g} s; its communicator "
                    f"was aborted")
            time.sleep(0)

    def check_comm(self) -> None:
        """Raise the communicator's asynchronous NCCL error, if any (CuPy's
        ``check_async_error``: ``ncclCommGetAsyncError``); a backend may override it."""
        check = getattr(self.comm, "check_async_error", None)
        if check is not None:
            check()

    def abort_comm(self) -> None:
        """Abort the communicator (after a ``-T`` timeout); the stream is not drained."""
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()

    def capture(self, fn: Callable[[], None]) -> Any:
        with self.stream:  # anything the library enqueues on the current stream is captured too
            self.stream.begin_capture()
            try:
                fn()
            finally:
                graph = self.stream.end_capture()
        return graph

    def replay(self, graph: Any) -> None:
        graph.launch(self.stream)

    def event_timer(self) -> Tuple[Callable[[], None], Callable[[], float]]:
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()

        def begin() -> None:
            start.record(self.stream)

        def stop() -> float:
            end.record(self.stream)
            self.sync()                 # bounded by -T, as the stream syncs are
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) / 1e3

        return begin, stop

    def event_marks(self, n: int) -> Tuple[Callable[[int], None], Callable[[int, int], float]]:
        cp = self.cp
        events = [cp.cuda.Event() for _ in range(n)]

        def record(k: int) -> None:
            events[k].record(self.stream)

        def elapsed(j: int, k: int) -> float:
            events[k].synchronize()
            return cp.cuda.get_elapsed_time(events[j], events[k]) / 1e3

        return record, elapsed


class SharedCuda:
    """One non-blocking CuPy stream on ``device`` and the buffers of each size, made once per
    rank and handed to every backend of ``python -m bench.overhead`` (:meth:`Backend.use_stream`,
    :meth:`Backend.adopt`), so that no backend is timed on other memory or another stream."""

    def __init__(self, device: int) -> None:
        cp = self.cp = import_cupy()
        cp.cuda.Device(device).use()
        self.device = device
        self.stream = cp.cuda.Stream(non_blocking=True)

    def alloc(self, collective: str, total: int, dtype: str, world: int, rank: int) -> Buffers:
        """Zeroed CuPy buffers laid out as :func:`bench.backends.layout` says (the in-place
        sides are views of ``whole``)."""
        lay = layout(collective, total, world, rank)
        with self.stream:
            send, recv, whole = (self.cp.zeros(max(n, 0), dtype=host_dtype(dtype))
                                 for n in (lay.send, lay.recv, lay.whole))
        self.stream.synchronize()
        s0, sn = lay.ip_send
        r0, rn = lay.ip_recv
        return Buffers(collective, dtype, lay, send, recv, whole, whole[s0:s0 + sn],
                       whole[r0:r0 + rn])
