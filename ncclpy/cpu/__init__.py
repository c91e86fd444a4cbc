"""ncclpy without a GPU: NCCL's semantics on host memory (``ncclpy.init(device="cpu")``).

The engine (:mod:`ncclpy.cpu.engine`) plays libnccl and the CUDA runtime at ncclpy's native
boundary; everything above it is ncclpy's own code, as on a GPU.  It is for learning, testing
code written against ncclpy and debugging it; it is not NCCL and makes no performance claim.
"""
from __future__ import annotations

from typing import Optional

from .backend import get_engine, install, installed, wants_cpu

__all__ = ["install", "installed", "get_engine", "wants_cpu", "synchronize"]


def synchronize(timeout: Optional[float] = None) -> None:
    """Wait until everything queued on this process's CPU streams ran (the CPU backend's
    ``cudaDeviceSynchronize``: what ``cupy.cuda.Device().synchronize()`` is on a GPU).

    ``timeout`` (default ``$NCCLPY_TIMEOUT``, else 300 s): past it, :class:`ncclpy.NcclTimeoutError`
    says how many stream items still wait (a peer that never made its call)."""
    import time
    from ..debug.watchdog import default_timeout
    from ..errors import NcclTimeoutError
    eng = get_engine()
    limit = default_timeout(timeout)
    deadline = time.monotonic() + limit
    delay = 1e-5
    while True:
        with eng.lock:
            eng.progress()
            left = sum(1 for q in eng.streams.values() for it in q if not it.done)
        if not left:
            return
        if time.monotonic() > deadline:
            raise NcclTimeoutError(8, "ncclpy.cpu.synchronize",
                                   f"{left} stream item(s) not complete after {limit:g} s; a "
                                   f"peer may never have made its call")
        eng.kick()
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
