"""One lock and one state per communicator: who may touch its NCCL handle, and when.

States::

    usable --finalize()--> finalized --close()--> closing --> closed
       |                                  ^
       +------------------close()---------+
    usable --suspend()--> suspended --resume()--> usable     (close() resumes first)
    usable --revoke(), shrink(abort=True), a revoking watchdog--> revoked
    any of usable, finalized, closing, suspended, revoked --abort()--> aborting --> aborted
                                               (close() of a revoked one aborts it)

A thread that is about to call NCCL with the handle (a collective, a group end, a poll of
``ncclCommGetAsyncError``, a registration, a split, finalize ...) *enters* (:meth:`enter`: the
state must allow it, else the precise refusal is raised: the watchdog's
:class:`~ncclpy.errors.CommAbortedError` with its reason, or "closed") and *leaves* right
after the C call returns.  A thread's open group *holds* the handle (:meth:`hold`, counted in
``inflight`` like a call, so an abort waits for it) from its first call to the group end,
whose ``ncclGroupEnd`` is marked as a call (:meth:`mark_call`).  ``calls`` (the calls
:meth:`enter` and :meth:`mark_call` let in, still inside NCCL) and ``entered`` (how many
were let in so far) are what the watchdog samples to time a call blocked inside NCCL on the
host -- a send/recv whose first use connects to a peer that never makes its side, a split
a peer never joins -- which no CUDA event can show.  A nonblocking communicator's poll loop
enters for every poll, so an abort from another thread ends the loop at its next poll, with the
abort's error.
:meth:`begin_abort` moves to ``aborting`` under the lock -- so no new call enters
and a second abort is a no-op: exactly one ``ncclCommAbort`` per handle -- then waits for the
calls in flight to leave, at most ``grace`` seconds: a call still inside NCCL after that is
blocked there (a blocking communicator waiting on a dead peer), and NCCL's own abort is what
ends it.  ``close`` moves to ``closing`` the same way, so finalize and destroy never run on a
handle that an abort freed, and ``abort`` during a ``close`` still works (it is the escape
from a finalize that cannot finish).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from .._nccl.lib import NCCL_IN_PROGRESS
from ..errors import CommAbortedError, NcclpyError, NcclTimeoutError

__all__ = ["Lifecycle", "CommLifecycle", "USABLE", "FINALIZED", "CLOSING", "CLOSED",
           "ABORTING", "ABORTED", "REVOKED", "SUSPENDED", "ABORT_GRACE", "ABORT_JOIN"]

USABLE, FINALIZED, CLOSING, CLOSED, ABORTING, ABORTED = (
    "usable", "finalized", "closing", "closed", "aborting", "aborted")
#: revoked (ncclCommRevoke, or a shrink with NCCL_SHRINK_ABORT): only shrink, split, close and
#: abort; suspended (ncclCommSuspend): only resume, mem_stats, close and abort
REVOKED, SUSPENDED = "revoked", "suspended"

log = logging.getLogger("ncclpy.comm")

#: seconds an abort waits for calls in flight on other threads before it calls ncclCommAbort
ABORT_GRACE = 2.0
#: seconds a bounded finalize waits for the abort it started (an abort can block as well)
ABORT_JOIN = 5.0


class Lifecycle:
    """The state, the lock and the count of threads inside NCCL with this handle."""

    __slots__ = ("lock", "cond", "state", "inflight", "waiters", "abort_error", "owner", "_what",
                 "calls", "entered")

    def __init__(self, owner: str) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)   # for the rare waits: aborts, close
        self.state = USABLE
        self.inflight = 0
        self.waiters = 0
        self.abort_error: Optional[CommAbortedError] = None
        self.owner = owner           # "rank 0 of 'job'": for the messages
        self._what = ""              # the call last entered (for an abort's warning)
        self.calls = 0               # calls let in by enter/mark_call, still inside NCCL
        self.entered = 0             # calls let in by enter/mark_call so far

    # -- calls (the hot path: a plain lock, two acquisitions per call) --------------------------
    def enter(self, what: str) -> None:
        """A call may touch the handle (usable state), or raise why not."""
        lock = self.lock
        lock.acquire()
        if self.state is USABLE:
            self.inflight += 1
            self.calls += 1
            self.entered += 1
            self._what = what
            lock.release()
            return
        lock.release()
        raise self.refusal(what)

    def hold(self, what: str = "group") -> None:
        """A thread's open group takes the handle (usable state), or raises why not; ended
        by :meth:`release` at the group end."""
        with self.lock:
            if self.state is USABLE:
                self.inflight += 1
                return
        raise self.refusal(what)

    def release(self) -> None:
        with self.lock:
            self.inflight -= 1
            if self.waiters and not self.inflight:
                self.cond.notify_all()

    def mark_call(self, what: str) -> None:
        """A call made under a :meth:`hold` (the group end): timed like an entered call."""
        with self.lock:
            self.calls += 1
            self.entered += 1
            self._what = what

    def unmark_call(self) -> None:
        with self.lock:
            self.calls -= 1

    def enter_as(self, what: str, *states: str) -> None:
        """:meth:`enter` for steps allowed in other states too (``finalized``: close's own
        steps; ``closing``: what close does after it took the communicator) and for the short
        queries of a Work's check; not timed by the watchdog; ended by :meth:`release`."""
        with self.lock:
            if self.state is USABLE or self.state in states:
                self.inflight += 1
                self._what = what
                return
        raise self.refusal(what)

    def leave(self) -> None:
        lock = self.lock
        lock.acquire()
        self.inflight -= 1
        self.calls -= 1
        if self.waiters and not self.inflight:
            self.cond.notify_all()
        lock.release()

    def refusal(self, what: str) -> NcclpyError:
        """The error a call gets in the current state."""
        st = self.state
        if self.abort_error is not None:
            return self.abort_error
        if st is FINALIZED:
            return NcclpyError(f"{what}: the communicator ({self.owner}) is finalized; only "
                               f"close() is allowed")
        if st is SUSPENDED:
            return NcclpyError(f"{what}: the communicator ({self.owner}) is suspended "
                               f"(ncclCommSuspend); call resume() first")
        if st is REVOKED:
            return NcclpyError(f"{what}: the communicator ({self.owner}) is revoked "
                               f"(ncclCommRevoke); only shrink(), split(), close() and abort() "
                               f"are allowed")
        how = {CLOSING: "being closed", CLOSED: "closed", ABORTING: "being aborted",
               ABORTED: "aborted"}.get(st, st)
        return NcclpyError(f"{what}: the communicator ({self.owner}) is {how}")

    @property
    def usable(self) -> bool:
        return self.state is USABLE

    # -- transitions --------------------------------------------------------------------------
    def finalized(self) -> None:
        with self.cond:
            if self.state is USABLE:
                self.state = FINALIZED

    def begin_close(self) -> bool:
        """usable/finalized -> closing; False when already closing, closed or aborting/ed."""
        with self.cond:
            if self.state not in (USABLE, FINALIZED):
                return False
            self.state = CLOSING
            return True

    def end_close(self) -> bool:
        """closing -> closed; False when an abort took over meanwhile (then no destroy)."""
        with self.cond:
            if self.state is not CLOSING:
                return False
            self.state = CLOSED
            return True

    def move(self, frm: tuple, to: str) -> bool:
        """``frm`` -> ``to`` under the lock; False (nothing changed) from another state."""
        with self.cond:
            if self.state not in frm:
                return False
            self.state = to
            return True

    def begin_revoke(self, error: CommAbortedError,
                     grace: Optional[float] = None) -> Optional[str]:
        """usable -> revoked, once, like :meth:`begin_abort` (None: not usable, nothing to
        do); the handle stays valid for shrink, split and abort."""
        return self._quiesce((USABLE,), REVOKED, error, grace)

    def begin_abort(self, error: Optional[CommAbortedError] = None,
                    grace: Optional[float] = None) -> Optional[str]:
        """-> aborting, once.  Returns None when an abort already happened or the handle is
        already destroyed (nothing to do), else the name of a call still in flight after
        ``grace`` seconds ("" when none was).  ``error``, if given and none is set yet, is what
        every later call raises."""
        return self._quiesce((USABLE, FINALIZED, CLOSING, SUSPENDED, REVOKED), ABORTING, error,
                             grace)

    def _quiesce(self, frm: tuple, to: str, error: Optional[CommAbortedError],
                 grace: Optional[float]) -> Optional[str]:
        with self.cond:
            if self.state not in frm:
                return None
            self.state = to
            if error is not None and self.abort_error is None:
                self.abort_error = error
            deadline = time.monotonic() + (ABORT_GRACE if grace is None else grace)
            self.waiters += 1
            try:
                while self.inflight > 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
            finally:
                self.waiters -= 1
            return self._what if self.inflight > 0 else ""

    def end_abort(self) -> None:
        with self.cond:
            self.state = ABORTED

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in flight (True), at most ``timeout`` seconds (False)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.waiters += 1
            try:
                while self.inflight > 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self.cond.wait(left)
                return True
            finally:
                self.waiters -= 1

    def __repr__(self) -> str:
        return f"<Lifecycle {self.owner} {self.state} inflight={self.inflight}>"



_GONE = (CLOSING, CLOSED, ABORTING, ABORTED)


class CommLifecycle:
    """The communicator's side of :class:`Lifecycle`: guarded NCCL calls, the polls of a
    nonblocking communicator, ``finalize``, ``abort`` and ``close`` (a mixin of
    :class:`ncclpy.Communicator`; it uses ``_life``, ``_lib``, ``_handle``, ``_nc``,
    ``_timeout``, ``_nonblocking``, ``_resolver``, ``_watchdog``, ``_registrations``,
    ``_premul_ops``, ``_allocations``, ``_captured_calls``, ``_device``)."""

    _life: Lifecycle
    _lib: Any
    _handle: int
    _nc: Any
    _timeout: float
    _nonblocking: bool
    _resolver: Any
    _watchdog: Any
    _watch: Any
    _registrations: Any
    _premul_ops: Any
    _allocations: Any
    _captured_calls: int
    _did_finalize: bool
    _device: int
    _barrier_buf: Any

    # -- state (read-only views of the Lifecycle) -------------------------------------------
    @property
    def state(self) -> str:
        """``usable``, ``finalized``, ``closing``, ``closed``, ``aborting`` or ``aborted``."""
        return self._life.state

    @property
    def closed(self) -> bool:
        """True once closing, closed, aborting or aborted."""
        return self._life.state in _GONE

    @property
    def _closed(self) -> bool:
        return self._life.state in _GONE

    @property
    def _aborted(self) -> bool:
        return self._life.state is ABORTING or self._life.state is ABORTED

    @property
    def _finalized(self) -> bool:
        return self._life.state is FINALIZED

    @property
    def _abort_error(self) -> Optional[CommAbortedError]:
        return self._life.abort_error

    def _check_usable(self, what: str) -> None:
        if self._life.state is not USABLE:
            raise self._life.refusal(what)

    def _nccl(self, what: str, fn: Any, *args: Any, states: tuple = ()) -> Any:
        """``fn(*args)`` -- a C call with this communicator's handle -- while entered in the
        lifecycle (refused with the precise error once aborted or closed)."""
        life = self._life
        if states:
            life.enter_as(what, *states)
            try:
                return fn(*args)
            finally:
                life.release()
        life.enter(what)
        try:
            return fn(*args)
        finally:
            life.leave()

    # -- nonblocking communicators ------------------------------------------------------------
    def _wait_ready(self, call: str, *states: str) -> None:
        """Poll ncclCommGetAsyncError until not in progress (nonblocking communicators),
        within the timeout.  Every poll enters the lifecycle: an abort from another thread
        (the watchdog's) ends the wait at once with its error, and nothing polls a freed
        handle."""
        deadline = time.monotonic() + self._timeout
        delay = 1e-5
        lib, h = self._lib, self._handle
        while True:
            st = self._nccl(call, lib.async_error, h, states=states)
            if st != NCCL_IN_PROGRESS:
                break
            if time.monotonic() > deadline:
                raise NcclTimeoutError(8, call, f"communicator still in progress after "
                                       f"{self._timeout:g} s (ncclCommGetAsyncError)")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        if st:
            raise lib.error(st, call, h)

    def _raise_async_error(self) -> None:
        """A Work's check: the watchdog's error, or an async error NCCL reported (handed to
        the watchdog for a named verdict first); nothing once closed."""
        life = self._life
        if life.abort_error is not None:
            raise life.abort_error
        try:
            life.enter_as("ncclCommGetAsyncError", FINALIZED)
        except NcclpyError:
            if life.state is ABORTING or life.state is ABORTED:
                raise
            return                   # closing or closed: nothing left to check
        try:
            st = self._lib.async_error(self._handle)
        finally:
            life.release()
        if st not in (0, NCCL_IN_PROGRESS):
            err = self._lib.error(st, "ncclCommGetAsyncError", self._handle)
            wd = self._watchdog
            if wd is not None and wd.verdict_on(err) is not None and \
                    life.abort_error is not None:
                raise life.abort_error from err   # names the call and the peer behind it
            raise err

    # -- finalize, abort, close ---------------------------------------------------------------
    def finalize(self) -> None:
        """ncclCommFinalize: flush outstanding work (collective); then only close() is
        allowed.  Bounded by the timeout: past it the communicator is aborted and the
        CommAbortedError says why."""
        self._check_usable("finalize")
        self._finalize_bounded("finalize", ())
        self._did_finalize = True
        self._life.finalized()
        self._resolver.clear()

    def _finalize_bounded(self, who: str, states: tuple) -> None:
        """ncclCommFinalize, then (nonblocking) its polls, on a thread of its own that the
        caller waits for at most the timeout (+1 s).  A finalize that has not finished by then
        is blocked -- on a peer that is gone or, since NCCL 2.26, on a CUDA graph that captured
        calls of this communicator and is still alive -- so the communicator is aborted (from
        yet another thread, waited for at most ABORT_JOIN seconds: an abort that blocks too
        cannot hold the caller) and CommAbortedError says why.  The caller never hangs."""
        t = self._timeout
        box: dict = {}

        def run() -> None:
            try:
                lib, h = self._lib, self._handle
                code = self._nccl("ncclCommFinalize", lib.ncclCommFinalize, h, states=states)
                lib.check(code, "ncclCommFinalize", h, in_progress_ok=True)
                if code == NCCL_IN_PROGRESS or self._nonblocking:
                    self._wait_ready("ncclCommFinalize", *states)
            except BaseException as e:  # noqa: B902 - handed to the caller
                box["error"] = e
        worker = threading.Thread(target=run, daemon=True,
                                  name=f"ncclpy-finalize ({self._life.owner})")
        worker.start()
        worker.join(t + 1.0)
        e = box.get("error")
        if worker.is_alive() or isinstance(e, NcclTimeoutError):
            err = CommAbortedError(self._finalize_overdue(who, t), reason="finalize_timeout")
            aborter = threading.Thread(target=self._abort_now, args=(err,), daemon=True,
                                       name=f"ncclpy-abort ({self._life.owner})")
            aborter.start()
            aborter.join(ABORT_GRACE + ABORT_JOIN)
            if aborter.is_alive():
                log.warning("%s: ncclCommAbort of the communicator (%s) has not returned "
                            "after %g s either; it is left to finish on its own", who,
                            self._life.owner, ABORT_JOIN)
            raise (self._life.abort_error or err) from e
        if e is not None:
            raise e

    def _finalize_overdue(self, who: str, t: float) -> str:
        n = self._captured_calls
        why = (f"{n} call(s) of this communicator were captured into CUDA graphs, and NCCL's "
               f"finalize waits until every graph holding them is destroyed: destroy the "
               f"graphs (e.g. 'del graph') before {who}()" if n else
               "a peer may be gone, or may not have called close()/finalize()")
        return (f"{who}: ncclCommFinalize of the communicator ({self._life.owner}) did not "
                f"finish within {t:g} s; {why}; the communicator was aborted (ncclCommAbort)")

    def abort(self) -> None:
        """ncclCommAbort: stop outstanding work and free the communicator (local; never hangs;
        idempotent; from any thread, also while another thread is blocked in NCCL)."""
        self._abort_now(None)

    def _abort_now(self, error: Optional[CommAbortedError]) -> None:
        life = self._life
        busy = life.begin_abort(error)
        if busy is None:
            return                       # aborted already, or destroyed: one abort per handle
        if busy:
            log.warning("abort of the communicator (%s): %s is still inside NCCL on another "
                        "thread after %g s; calling ncclCommAbort anyway, which is what ends a "
                        "blocked NCCL call", life.owner, busy, ABORT_GRACE)
        self._resolver.clear()
        self._stop_watchdog(closed=False)
        try:
            if self._nc is not None:
                from .._nccl.dispatch import call_cupy
                call_cupy(self._lib, "ncclCommAbort", self._handle, self._nc.abort)
            else:
                self._lib.check(self._lib.ncclCommAbort(self._handle), "ncclCommAbort")
        finally:
            life.end_abort()
            rec = getattr(self, "_recorder", None)
            if rec is not None:
                rec.mark_aborted()
            self._lose_windows()          # type: ignore[attr-defined]
            self._registrations.clear()
            self._premul_ops.clear()
            self._free_owned()

    def close(self) -> None:
        """Free what the communicator owns, finalize and destroy it.  Idempotent, and never
        hangs: a finalize that cannot finish within the timeout (a peer gone, a live CUDA
        graph that captured its calls) aborts the communicator and raises CommAbortedError
        saying which.  Every rank should call it; after an abort it does nothing.  Its
        windows are deregistered first; a suspended communicator is resumed first; a revoked
        one (or the parent of a shrink with ``abort=True``) is aborted instead: NCCL forbids
        finalizing it, and its destroy's barrier can wait forever for the ranks that are
        gone."""
        life = self._life
        if life.state is SUSPENDED:
            self.resume()                 # type: ignore[attr-defined]
        if life.state is REVOKED:
            try:
                self._settled("close")    # type: ignore[attr-defined]
            finally:
                self._abort_now(None)
            return
        if not life.begin_close():
            return
        self._stop_watchdog(closed=True)
        rec = getattr(self, "_recorder", None)
        if rec is not None:
            rec.retire()
        if not life.wait_idle(self._timeout):
            err = CommAbortedError(f"close: another thread's {life._what} was still inside NCCL "
                                   f"after {self._timeout:g} s; the communicator was aborted "
                                   f"(ncclCommAbort)", reason="close_timeout")
            self._abort_now(err)
            raise err
        self._close_windows()             # type: ignore[attr-defined]
        for reg in list(self._registrations.values()):
            try:
                self._deregister(reg, (CLOSING,))
            except Exception as e:
                log.warning("close: deregistering %s failed: %s", reg, e)
        self._registrations.clear()
        for op in list(self._premul_ops):
            try:
                self._premul_destroy(op, (CLOSING,))
            except Exception as e:
                log.warning("close: ncclRedOpDestroy(%s) failed: %s", op, e)
        if not self._did_finalize:
            try:
                self._finalize_bounded("close", (CLOSING,))
            except BaseException:
                self._abort_now(None)
                raise
        self._resolver.clear()
        if not life.end_close():         # an abort took over: never destroy after it
            self._free_owned()
            return
        lib, h = self._lib, self._handle
        try:
            if self._nc is not None:
                from .._nccl.dispatch import call_cupy
                call_cupy(lib, "ncclCommDestroy", h, self._nc.destroy)
            else:
                lib.check(lib.ncclCommDestroy(h), "ncclCommDestroy", h)
        finally:
            self._free_owned()

    def _stop_watchdog(self, closed: bool) -> None:
        wd, self._watchdog = self._watchdog, None
        self._watch = None
        if wd is not None:
            try:
                wd.stop(closed=closed)
            except Exception:
                log.debug("stopping the watchdog failed", exc_info=True)

    def _watchdog_abort(self, decision: Any) -> None:
        """The watchdog's verdict: every blocked or later call raises CommAbortedError (its
        message names the flight-recorder dump written first)."""
        msg = decision.message
        revoke = getattr(self, "_on_failure", "abort") == "revoke"
        if revoke:       # comm.on_failure = "revoke": the handle stays for shrink
            msg = msg.replace("was aborted (ncclCommAbort)",
                              "was revoked (ncclCommRevoke; on_failure='revoke'): shrink it "
                              "to the survivors (comm.shrink(exclude=err.suspects)), or close "
                              "it")
        rec = getattr(self, "_recorder", None)
        if rec is not None:
            path = rec.try_dump(f"watchdog {'revoke' if revoke else 'abort'} "
                                f"({decision.reason})")
            if path:
                msg += f"; flight-recorder dump: {path}"
        err = CommAbortedError(msg, collective=decision.collective, seq=decision.seq,
                               suspects=decision.suspects, reason=decision.reason)
        if revoke:
            self._revoke_now(err)         # type: ignore[attr-defined]
        else:
            self._abort_now(err)

    def _free_owned(self) -> None:
        from .._nccl.cuda import cuda
        allocations = list(self._allocations)
        self._allocations.clear()
        self._barrier_buf = None
        if not allocations:
            return
        with cuda().device(self._device):
            for ptr in allocations:
                code = self._lib.ncclMemFree(ptr)
                if code:
                    log.warning("ncclMemFree(%#x) failed: %s", ptr, self._lib.error_string(code))

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # peers may be gone: a collective close() could hang
            self.abort()
