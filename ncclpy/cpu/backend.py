"""Switching a process to the CPU backend: :func:`install` puts the CPU engine in place of libnccl
and the CUDA runtime for the whole process (``ncclpy.init(device="cpu")``, ``NCCLPY_DEVICE=cpu``,
``ncclpy run --cpu`` come here).  A process is either on the GPU or on the CPU: once its
communicators run on one, the other is refused in one line.
"""
from __future__ import annotations

import os
import platform
import sys
import threading
from typing import Any, Mapping, Optional

from .._nccl import lib as _lib
from ..errors import ArgumentError, UnsupportedError

__all__ = ["install", "installed", "get_engine", "wants_cpu", "cannot_run", "MODELLED_VERSION",
           "DEVICE_COUNT", "MACHINES"]

#: the NCCL whose semantics the engine models, checked line by line (ncclpy/cpu/RULES.md)
MODELLED_VERSION = 22809
#: "devices" a CPU process reports: each rank labels its memory with its local rank
DEVICE_COUNT = 1024

#: what ``platform.machine()`` says on the machines the CPU backend runs on: 64-bit x86
#: (its ranks share memory relying on x86-64's store ordering and 8-byte stores, no fences)
MACHINES = ("x86_64", "amd64")

_lock = threading.Lock()


def cannot_run(machine: Optional[str] = None, system: Optional[str] = None,
               bits64: Optional[bool] = None) -> Optional[str]:
    """Why the CPU backend cannot run here (None: it can): it needs 64-bit x86 Linux with
    POSIX shared memory (a 64-bit Python: its 8-byte fields are written in one store).
    ``machine``, ``system``, ``bits64``: this process's unless given."""
    machine = platform.machine() if machine is None else machine
    system = sys.platform if system is None else system
    bits64 = sys.maxsize > 2 ** 32 if bits64 is None else bits64
    need = "it runs on 64-bit x86 (x86-64) Linux only"
    if not system.startswith("linux"):
        return f"{need}, and this system is {system}"
    if machine.lower() not in MACHINES:
        return (f"{need}: its processes share memory relying on x86-64's store ordering (no "
                f"fences from Python), and this machine is {machine or 'unknown'}")
    if not bits64:
        return (f"{need}: its processes share 8-byte fields written in one store, which a "
                f"32-bit Python does not do, and this Python is 32-bit")
    from .shm import available
    return available()


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
    """Whether this process runs on the CPU backend (the fact lives in
    :func:`ncclpy._nccl.lib.cpu_backend`, below everything that asks it)."""
    return _lib.cpu_backend()


def get_engine() -> Any:
    """The process's CPU engine (:func:`install` first)."""
    if _lib._cpu_engine is None:
        raise UnsupportedError("the CPU backend is not installed in this process; "
                               "ncclpy.init(device='cpu') installs it")
    return _lib._cpu_engine


def install() -> Any:
    """Make this process's communicators CPU ones (idempotent); the engine."""
    with _lock:
        if _lib._cpu_engine is not None:
            return _lib._cpu_engine
        from .._nccl import cuda as _cuda
        if type(_cuda._backend).__name__ == "CupyRuntime":
            raise ArgumentError("device='cpu': this process already uses the CUDA runtime (a "
                                "GPU communicator or buffer); a process runs either on the "
                                "GPU or on the CPU backend, not both")
        why = cannot_run()
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
        from ..buffers import buffer as buffers
        if hasattr(buffers, "set_host_memory"):
            buffers.set_host_memory(True)
        _lib._cpu_engine = eng
        return eng
