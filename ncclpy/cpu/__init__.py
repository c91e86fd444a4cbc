"""ncclpy without a GPU: NCCL's semantics on host memory (``ncclpy.init(device="cpu")``).

The engine (:mod:`ncclpy.cpu.engine`) plays libnccl and the CUDA runtime at ncclpy's native
boundary; everything above it is ncclpy's own code, as on a GPU.  It is for learning, testing
code written against ncclpy and debugging it; it is not NCCL and makes no performance claim.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .backend import get_engine, install, installed, wants_cpu

if TYPE_CHECKING:
    from ..order.pins import Choice

__all__ = ["install", "installed", "get_engine", "wants_cpu", "synchronize", "order_choice"]


def order_choice(comm: Any, collective: str, dtype: str = "float32",
                 op: str = "sum") -> "Choice":
    """What the CPU-backend communicator ``comm`` (a :class:`ncclpy.Communicator` made with
    ``device="cpu"``, or its handle) runs for ``collective`` (``all_reduce``,
    ``reduce_scatter``, ``reduce``, ``broadcast``, ``all_gather``) of ``dtype``: a
    :class:`ncclpy.order.Choice` (``algo``, ``proto``, ``channels``, ``buffsizes``, ``why``), as
    its init read NCCL_ALGO, NCCL_PROTO, NCCL_MIN/MAX_NCHANNELS and the buffer sizes.  Its
    reductions fold in that configuration's order: ``predict(choice.config(collective, nranks,
    count, dtype=..., op=...))`` is what they give (``op`` matters where PAT is enabled: NCCL
    has no PAT reduce_scatter for avg and premul_sum).  :class:`ncclpy.order.PinError` with NCCL's
    text where NCCL refuses that call (nothing enabled for it); ValueError naming the argument
    for anything else."""
    from .algo import comm_choice
    return comm_choice(get_engine(), comm, collective, dtype, op)


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
