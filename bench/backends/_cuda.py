"""CuPy arrays, one non-blocking stream, graphs, events: shared by the ncclpy and cupy backends."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ncclpy.dtypes import DTYPES
from ncclpy.errors import MissingDependencyError, UnsupportedError
from ncclpy.ops import format_version

from bench.backends import Backend, host_dtype

__all__ = ["CupyStreamBackend", "import_cupy"]


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
    comm: Any = None

    def setup(self, rank: int, world: int, device: Optional[int], store: Any, *,
              master_addr: str = "127.0.0.1", timeout: float = 300.0) -> None:
        super().setup(rank, world, device, store, master_addr=master_addr, timeout=timeout)
        self._setup_device(device)
        from ncclpy.bootstrap import exchange_uid
        uid, _ = exchange_uid(store, rank, name=f"bench-{self.name}", timeout=timeout,
                              world_size=world)
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
        self.stream.synchronize()

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
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) / 1e3

        return begin, stop
