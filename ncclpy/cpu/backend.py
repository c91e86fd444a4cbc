"""Switching a process to the CPU backend: :func:`install` puts the CPU engine in place of libnccl
and the CUDA runtime for the whole process (``ncclpy.init(device="cpu")``, ``NCCLPY_DEVICE=cpu``,
``ncclpy run --cpu`` come here).  A process is either on the GPU or on the CPU: once its
communicators run on one, the other is refused in one line.
"""
from __future__ import annotations

import os
import platform
import threading
from typing import Any, Mapping, Optional

from ..errors import ArgumentError, UnsupportedError

__all__ = ["install", "installed", "get_engine", "wants_cpu", "MODELLED_VERSION", "DEVICE_COUNT"]

#: the NCCL whose semantics the engine models, checked line by line (ncclpy/cpu/RULES.md)
MODELLED_VERSION = 22809
#: "devices" a CPU process reports: each rank labels its memory with its local rank
DEVICE_COUNT = 1024

_lock = threading.Lock()
_engine: Optional[Any] = None


def wants_cpu(device: Any, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``device`` (an ``init``/``resolve`` argument), else ``$NCCLPY_DEVICE``, asks for
    the CPU backend."""
    if isinstance(device, str):
        return device.strip().lower() == "cpu"
    if device is not None:
        return False
    env = os.environ if env is None else env
    return env.get("NCCLPY_DEVICE", "").strip().lower() == "cpu"


def installed() -> bool:
    """Whether this process runs on the CPU backend."""
    return _engine is not None


def get_engine() -> Any:
    """The process's CPU engine (:func:`install` first)."""
    if _engine is None:
        raise UnsupportedError("the CPU backend is not installed in this process; "
                               "ncclpy.init(device='cpu') installs it")
    return _engine


def install() -> Any:
    """Make this process's communicators CPU ones (idempotent); the engine."""
    global _engine
    with _lock:
        if _engine is not None:
            return _engine
        from .._nccl import cuda as _cuda
        from .._nccl import lib as _lib
        from .shm import available
        if type(_cuda._backend).__name__ == "CupyRuntime":
            raise ArgumentError("device='cpu': this process already uses the CUDA runtime (a "
                                "GPU communicator or buffer); a process runs either on the "
                                "GPU or on the CPU backend, not both")
        why = available()
        if why is None and platform.machine().lower() not in ("x86_64", "amd64", "i686",
                                                              "i386"):
            why = (f"its processes share memory relying on x86's store ordering (no fences "
                   f"from Python), and this machine is {platform.machine()}")
        if why:
            raise UnsupportedError(f"the CPU backend cannot run here: {why}")
        from .channel import sweep
        from .transport import ProcEngine
        sweep()
        eng = ProcEngine(ndev=DEVICE_COUNT, version=MODELLED_VERSION)
        eng.nccl.path = (f"{_lib.CPU_BACKEND_PATH} (models NCCL {MODELLED_VERSION // 10000}."
                         f"{MODELLED_VERSION // 100 % 100}.{MODELLED_VERSION % 100}; not NCCL)")
        with _lib._lock:
            _lib._lib = eng.nccl
        with _cuda._backend_lock:
            _cuda._set(eng.cuda)
        from .. import buffers
        if hasattr(buffers, "set_host_memory"):
            buffers.set_host_memory(True)
        _engine = eng
        return eng
