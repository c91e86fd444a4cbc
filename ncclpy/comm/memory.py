"""A communicator's GPU memory: ``suspend`` / ``resume`` / ``mem_stats`` (NCCL >= 2.29.7).

A mixin of :class:`ncclpy.Communicator`.  ``suspend()`` (``ncclCommSuspend`` with
``NCCL_SUSPEND_MEM``) releases the memory NCCL can give back; the communicator is then
``suspended``: every call but ``resume``, ``mem_stats``, ``close`` and ``abort`` is refused
precisely, and nothing may be in flight when it is suspended.  ``mem_stats()`` reads
``ncclCommMemStats`` for the four statistics of ``ncclCommMemStat_t``.
"""
from __future__ import annotations

from typing import Any, Dict

from .._nccl.flags import MEM_STATS, SUSPEND_MEM
from .._nccl.lib import require_version
from ..errors import NcclpyError
from .lifecycle import SUSPENDED, USABLE

__all__ = ["CommMemory"]


class CommMemory:
    """suspend / resume / mem_stats of a Communicator (uses ``_lib``, ``_handle``, ``_life``,
    ``_nccl``, ``_resolver``)."""

    _lib: Any
    _handle: int
    _life: Any
    _nccl: Any
    _resolver: Any

    def suspend(self) -> None:
        """``ncclCommSuspend(NCCL_SUSPEND_MEM)``: give back NCCL's suspendable GPU memory.
        Every call made before must be complete (``Work.wait()``); until :meth:`resume`,
        calls are refused.  NCCL >= 2.29.7."""
        lib = self._lib
        require_version("ncclCommSuspend", lib.version, lib.path)
        life = self._life
        with life.cond:
            if life.state is not USABLE:
                raise life.refusal("suspend")
            if life.inflight:
                raise NcclpyError(f"suspend: another thread's {life._what} is inside NCCL on "
                                  f"this communicator ({life.owner}); suspend when it is idle")
            life.state = SUSPENDED
        try:
            code = self._nccl("ncclCommSuspend", lib.ncclCommSuspend, self._handle,
                              SUSPEND_MEM, states=(SUSPENDED,))
            lib.check(code, "ncclCommSuspend", self._handle)
        except BaseException:
            life.move((SUSPENDED,), USABLE)
            raise
        self._resolver.clear()

    def resume(self) -> None:
        """``ncclCommResume``: take the memory back; the communicator is usable again.  A
        no-op on a communicator that is not suspended."""
        life = self._life
        if life.state is not SUSPENDED:
            return
        lib = self._lib
        code = self._nccl("ncclCommResume", lib.ncclCommResume, self._handle,
                          states=(SUSPENDED,))
        lib.check(code, "ncclCommResume", self._handle)
        life.move((SUSPENDED,), USABLE)

    @property
    def suspended(self) -> bool:
        """True between :meth:`suspend` and :meth:`resume`."""
        return self._life.state is SUSPENDED

    def mem_stats(self) -> Dict[str, int]:
        """``ncclCommMemStats``: ``suspendable_bytes``, ``suspended`` (0 or 1),
        ``persistent_bytes``, ``total_bytes`` of this communicator.  NCCL >= 2.29.7;
        allowed while suspended."""
        import ctypes
        lib = self._lib
        require_version("ncclCommMemStats", lib.version, lib.path)
        out: Dict[str, int] = {}
        v = ctypes.c_uint64(0)
        for key, stat in MEM_STATS.items():
            code = self._nccl("ncclCommMemStats", lib.ncclCommMemStats, self._handle, stat,
                              ctypes.byref(v), states=(SUSPENDED,))
            lib.check(code, "ncclCommMemStats", self._handle)
            out[key] = int(v.value)
        return out
