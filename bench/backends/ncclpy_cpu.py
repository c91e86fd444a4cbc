"""ncclpy's Communicator on its CPU backend (``--backend ncclpy --device cpu``): what a user of
``ncclpy.init(device="cpu")`` runs, timed.

The process installs the CPU engine (:func:`ncclpy.cpu.install`: libnccl and the CUDA runtime
replaced for the whole process, ranks meeting through shared memory), then makes the
communicator as the GPU sweep does (:class:`~bench.backends.ncclpy.NcclpyBackend`: a unique id
through the harness's store, ``ncclpy.Communicator``, no watchdog).  Buffers are numpy arrays,
passed as they are; bfloat16 and float8 (which numpy lacks) travel as
``ncclpy.Buffer(ptr, count, dtype, device="cpu")`` over a uint view.  Calls go on the
communicator's default stream; a synchronisation is :func:`ncclpy.cpu.synchronize`.

These are CPU-backend figures: no NCCL and no GPU run.  :attr:`NcclpyCpuBackend.nccl_version`
is 0 (no NCCL library ran), and the sweep's header and JSON say what ran (:data:`NOTE`).
"""
from __future__ import annotations

import platform
from typing import Any, Callable, Dict, Optional

import numpy as np

from ncclpy.semantics.dtypes import DTYPES

from . import Backend, Buffers, host_dtype
from ._cuda import StreamTimeout
from .ncclpy import NcclpyBackend

__all__ = ["NcclpyCpuBackend", "NOTE", "LABEL"]

#: the backend's label in the header, the rows and the JSON
LABEL = "ncclpy/cpu-backend"
#: what the header and the JSON say about its figures
NOTE = ("ncclpy ran on its CPU backend (ncclpy.init(device='cpu'): host memory, ranks meeting "
        "through shared memory): these are CPU-backend figures, not NCCL figures; no NCCL and "
        "no GPU ran")


class NcclpyCpuBackend(NcclpyBackend):
    """The sweep's ncclpy backend on the CPU engine (see the module docstring)."""

    name = "ncclpy"
    label = LABEL
    note = NOTE
    supports_graphs = False
    supports_events = False
    stream_form = "the communicator's default stream (the CPU engine's queue)"

    def _setup_device(self, device: Optional[int]) -> None:
        import ncclpy
        from ncclpy.cpu import install
        install()
        self.ncclpy = ncclpy
        self.stream = None
        self.stream_arg = None

    def open_comm(self, uid: bytes) -> Any:
        # each rank's "device" is a label on the CPU backend: its rank, as init's local rank
        self.device = self.rank
        return super().open_comm(uid)

    def teardown(self) -> None:
        if self.comm is not None:
            self.sync()
            self.close_comm(self.comm)
            self.comm = None

    def nccl_version(self) -> int:
        """0: no NCCL library ran (the engine models NCCL's semantics, :meth:`models`)."""
        return 0

    def bits_version(self) -> int:
        """The NCCL version the engine models (its communicator's ``nccl_version``)."""
        return int(self.comm.nccl_version) if self.comm is not None else 0

    def models(self) -> str:
        """The NCCL version whose semantics the engine models (e.g. ``2.28.9``)."""
        from ncclpy.semantics.ops import format_version
        return format_version(int(self.comm.nccl_version)) if self.comm is not None else "?"

    def device_info(self) -> Dict[str, str]:
        return {"device_hex": "0000:00:00",
                "device_info": f"cpu ({platform.machine()}), ncclpy CPU backend"}

    def unsupported(self, collective: str, dtype: str, op: str) -> Optional[str]:
        return None                      # the engine has every dtype and op NCCL has

    # ---- buffers: numpy ---------------------------------------------------------------------
    def empty(self, n: int, dtype: str) -> Any:
        return np.zeros(max(n, 0), dtype=host_dtype(dtype))

    def zero(self, arr: Any) -> None:
        arr.view(np.uint8)[...] = 0

    def upload(self, arr: Any, host: np.ndarray) -> None:
        if arr.size:
            arr[...] = np.ascontiguousarray(host).view(arr.dtype)

    def download(self, arr: Any) -> np.ndarray:
        return np.array(arr, copy=True)

    def alloc(self, collective: str, total: int, dtype: str) -> Buffers:
        bufs = Backend.alloc(self, collective, total, dtype)
        bufs.extra["regs"] = []
        return self._with_args(bufs)

    def _with_args(self, bufs: Buffers) -> Buffers:
        """``bufs.extra["args"]``: the numpy arrays themselves, or raw typed host
        :class:`ncclpy.Buffer` for bfloat16 / float8 (which numpy lacks)."""
        keys = ("send", "recv", "whole", "ip_send", "ip_recv")
        dtype = bufs.dtype
        if DTYPES[dtype].numpy is None:
            B = self.ncclpy.Buffer
            bufs.extra["args"] = {k: B(getattr(bufs, k).ctypes.data, int(getattr(bufs, k).size),
                                       dtype, "cpu") for k in keys}
        else:
            bufs.extra["args"] = {k: getattr(bufs, k) for k in keys}
        return bufs

    def sync(self) -> None:
        """Wait for this process's CPU streams (:func:`ncclpy.cpu.synchronize`); past ``-T``,
        abort the communicator and raise :class:`~bench.backends._cuda.StreamTimeout`."""
        from ncclpy.cpu import synchronize
        from ncclpy.errors import NcclTimeoutError
        if self.comm is not None:
            self.check_comm()
        try:
            synchronize(self.sync_timeout)
        except NcclTimeoutError:
            if self.sync_timeout is None:
                raise
            self.abort_comm()
            raise StreamTimeout(
                f"-T/--timeout {self.sync_timeout:g}: rank {self.rank}'s {self.label} queue "
                f"did not finish within {self.sync_timeout:g} s; its communicator was "
                f"aborted") from None

    def capture(self, fn: Callable[[], None]) -> Any:
        return Backend.capture(self, fn)        # refused: no CUDA graphs on the CPU backend

    def event_timer(self) -> Any:
        return Backend.event_timer(self)        # refused: no CUDA events on the CPU backend

    def event_marks(self, n: int) -> Any:
        return Backend.event_marks(self, n)     # refused: the sweep's -I uses the host clock

    def settings(self) -> Dict[str, Any]:
        out = super().settings()
        out["cpu_backend"] = True
        out["models_nccl"] = self.models()
        return out
