"""A communicator's GPU memory: ``suspend`` / ``resume`` / ``mem_stats`` (NCCL >= 2.29.7).

A mixin of :class:`ncclpy.Communicator`.  ``suspend()`` (``ncclCommSuspend`` with
``NCCL_SUSPEND_MEM``) releases the memory NCCL can give back; the communicator is then
``suspended``: every call but ``resume``, ``mem_stats``, ``close`` and ``abort`` is refused
precisely, and nothing may be in flight when it is suspended.  ``mem_stats()`` reads
``ncclCommMemStats`` for the four statistics of ``ncclCommMemStat_t``.

Suspend and resume are COLLECTIVE (every rank calls them, in the same order) and may be
asynchronous: NCCL synchronizes the device and meets the other ranks in a bootstrap barrier
(mem_manager.cc ncclCommMemSuspend / ncclCommMemResume): inside the call in 2.29.x, in a group
task from 2.30, which on a nonblocking communicator returns ncclInProgress.  ncclpy waits for
completion (bounded by the communicator's timeout, the wait timed by the watchdog like a call:
a rank that never joins shows as BLOCKED), and ``close()`` of a suspended communicator resumes
it within the same bound (then aborts it, never hanging).
"""
from __future__ import annotations

from typing import Any, Dict

from .._nccl.flags import MEM_STATS, SUSPEND_MEM
from .._nccl.group import group_depth
from .._nccl.lib import NCCL_IN_PROGRESS, require_version
from ..errors import CommAbortedError, NcclpyError, NcclTimeoutError, UnsupportedError
from .lifecycle import SUSPENDED, USABLE

__all__ = ["CommMemory"]


class CommMemory:
    """suspend / resume / mem_stats of a Communicator (uses ``_lib``, ``_handle``, ``_life``,
    ``_nccl``, ``_resolver``, ``_nonblocking``, ``_wait_ready``, ``_bounded``)."""

    _lib: Any
    _handle: int
    _life: Any
    _nccl: Any
    _resolver: Any
    _nonblocking: bool
    _wait_ready: Any
    _bounded: Any
    _timeout: float

    def suspend(self) -> None:
        """``ncclCommSuspend(NCCL_SUSPEND_MEM)``: give back NCCL's suspendable GPU memory.
        Collective: every rank calls it (NCCL meets the ranks in a barrier).  Every call made
        before must be complete (``Work.wait()``); until :meth:`resume`, calls are refused.
        Waits for completion on a nonblocking communicator.  NCCL >= 2.29.7."""
        lib = self._lib
        require_version("ncclCommSuspend", lib.version, lib.path)
        if group_depth():
            raise UnsupportedError("suspend: called inside a group (comm.group()); NCCL runs "
                                   "it at the group's end: call it outside any group")
        life = self._life
        with life.cond:
            if life.state is not USABLE:
                raise life.refusal("suspend")
            if life._busy():
                raise NcclpyError(f"suspend: another thread's {life._busy_what()} is inside NCCL on "
                                  f"this communicator ({life.owner}); suspend when it is idle")
            life.state = SUSPENDED
        try:
            self._collective_step("ncclCommSuspend", lib.ncclCommSuspend, SUSPEND_MEM)
        except BaseException:
            life.move((SUSPENDED,), USABLE)
            raise
        self._resolver.clear()

    def resume(self) -> None:
        """``ncclCommResume``: take the memory back; the communicator is usable again.
        Collective, like :meth:`suspend`.  A no-op on a communicator that is not
        suspended."""
        life = self._life
        if life.state is not SUSPENDED:
            return
        self._collective_step("ncclCommResume", self._lib.ncclCommResume)
        life.move((SUSPENDED,), USABLE)

    def _collective_step(self, name: str, fn: Any, *args: Any) -> None:
        """``fn(handle, *args)`` timed by the watchdog, then (nonblocking) its completion.
        Refused inside a group: from NCCL 2.30 each is a group task, run only at the group's
        end."""
        if group_depth():
            raise UnsupportedError(f"{name}: called inside a group (comm.group()); NCCL runs it "
                                   f"at the group's end: call it outside any group")
        with self._life.api:      # the call and its wait: no other thread's call between
            self._step_and_wait(name, fn, *args)

    def _step_and_wait(self, name: str, fn: Any, *args: Any) -> None:
        lib = self._lib
        code = self._nccl(name, fn, self._handle, *args, states=(SUSPENDED,), timed=True)
        lib.check(code, name, self._handle, in_progress_ok=True)
        if code == NCCL_IN_PROGRESS or self._nonblocking:
            try:
                self._wait_ready(name, SUSPENDED)
            except NcclTimeoutError as e:    # NCCL refuses every call until it completes
                self._abort_now(CommAbortedError(   # type: ignore[attr-defined]
                    f"{name}: not complete after {self._timeout:g} s (it is collective: a "
                    f"peer may not have called it); the communicator ({self._life.owner}) is "
                    f"aborted (ncclCommAbort)", collective=name,
                    reason="suspend_timeout" if name == "ncclCommSuspend"
                    else "resume_timeout"), grace=0.0)
                raise self._life.abort_error from e

    def _resume_bounded(self, who: str) -> None:
        """close() of a suspended communicator: resume within the timeout, else abort (the
        other ranks may not be closing, and a resume waits for them in a barrier)."""
        def overdue(t: float) -> str:
            return (f"{who}: ncclCommResume of the suspended communicator ({self._life.owner}) "
                    f"did not finish within {t:g} s; resume is collective and a peer may not "
                    f"be resuming or closing; the communicator is aborted (ncclCommAbort)")
        self._bounded(who, "resume", self.resume, overdue, "resume_timeout")

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
