"""One lock and one state per communicator: who may touch its NCCL handle, and when.

States::

    usable --finalize()--> finalized --close()--> closing --> closed
       |                                  ^
       +------------------close()---------+
    usable --suspend()--> suspended --resume()--> usable     (close() resumes first, bounded)
    usable --revoke(), shrink(abort=True), a revoking watchdog--> revoked
    any of usable, finalized, closing, suspended, revoked --abort()--> aborting --> aborted
                                               (close() of a revoked one aborts it)

A thread that is about to call NCCL with the handle (a collective, a group end, a poll of
``ncclCommGetAsyncError``, a registration, a split, finalize ...) *enters* (:meth:`enter`: the
state must allow it, else the precise refusal is raised: the watchdog's
:class:`~ncclpy.errors.CommAbortedError` with its reason, or "closed"), takes the handle's
API lock (``api``: one thread at a time inside NCCL with a handle, as NCCL requires) and
*leaves* right after the C call returns.  A thread's open group *holds* the handle
(:meth:`hold`, counted in ``inflight`` like a call, so an abort waits for it) from its first
call to the group end, whose ``ncclGroupEnd`` is marked as a call (:meth:`mark_call`).
``calls`` (the calls :meth:`enter` and :meth:`mark_call` let in, still inside NCCL) and
``entered`` (how many were let in so far) are what the watchdog samples to time a call
blocked inside NCCL on the host -- a send/recv whose first use connects to a peer that never
makes its side, a split a peer never joins -- which no CUDA event can show.  A nonblocking
communicator's wait for completion is one marked call whose polls (:meth:`enter_poll`) take
the API lock one by one without counting as new calls: the watchdog times the wait, and an
abort from another thread ends it at its next poll, with the abort's error.

:meth:`begin_abort` moves to ``aborting`` under the lock -- so no new call enters and a second
abort is a no-op: exactly one ``ncclCommAbort`` per handle -- then waits for the calls in
flight to leave, at most ``grace`` seconds.  ``ncclCommAbort`` frees the communicator, so it is
never called while another thread is inside NCCL with the handle: a call still inside after
the grace (a blocking communicator's call blocked on a peer) defers it
(:meth:`defer_until_idle`) until that call leaves.  ``close`` moves to ``closing`` the same
way, so finalize and destroy never run on a handle that an abort freed, and ``abort`` during
a ``close`` still works (it is the escape from a finalize that cannot finish).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from ..errors import CommAbortedError, NcclpyError

__all__ = ["Lifecycle", "BUSY", "USABLE", "FINALIZED", "CLOSING", "CLOSED",
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


#: what :meth:`Lifecycle.try_call` returns when it would have to wait
BUSY = object()


def _depth(api: Any) -> int:
    """How many times this thread holds RLock ``api`` (0: not at all)."""
    rc = getattr(api, "_recursion_count", None)
    if rc is not None:
        return rc()
    return 1 if api._is_owned() else 0      # (before 3.11: re-entry is not told apart)


def _run_deferred(fn: Callable[[], None], owner: str) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the abort's error is already every call's
        log.warning("the deferred abort of the communicator (%s) failed: %s", owner, e)


class Lifecycle:
    """The state, the lock and the count of threads inside NCCL with this handle."""

    __slots__ = ("lock", "cond", "state", "inflight", "waiters", "abort_error", "owner", "_what",
                 "calls", "entered", "api", "on_idle", "deferred", "plan", "hot", "hot_n",
                 "holder", "nhold")

    def __init__(self, owner: str) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)   # for the rare waits: aborts, close
        self.state = USABLE
        self.inflight = 0
        self.waiters = 0
        self.abort_error: Optional[CommAbortedError] = None
        self.owner = owner           # "rank 0 of 'job'": for the messages
        self._what = ""              # the call last entered (for an abort's warning)
        #: the plan of the call last entered by the executor (the watchdog reads which peers
        #: a call blocked inside NCCL waits on); None for a group end or another step
        self.plan: object = None
        self.calls = 0               # calls let in by enter/mark_call, still inside NCCL
        self.entered = 0             # calls let in by enter/mark_call so far
        #: the API lock: one thread at a time inside NCCL with this handle (NCCL's rule; its
        #: ncclCommGetAsyncError completes and frees a nonblocking job, init.cc), re-entrant
        #: for a call that polls its own completion
        self.api = threading.RLock()
        #: an abort deferred until no call is inside NCCL (see :meth:`defer_until_idle`)
        self.on_idle: Optional[Callable[[], None]] = None
        self.deferred = False        # an abort waited for a call inside NCCL
        #: the in-call marker of the fast path (:mod:`ncclpy.comm.hot`): the entry of the call
        #: inside NCCL now (its ``plan``), set and cleared under the API lock only; ``hot_n``
        #: counts those calls (the watchdog tells a new one from the same one still inside)
        self.hot: object = None
        self.hot_n = 0
        #: the thread whose open group holds the handle (NCCL launches a communicator's calls
        #: at the end of the group it joined, group.cc: another thread's call would join it)
        self.holder: Optional[int] = None
        self.nhold = 0

    # -- calls: interrupt-safe (tests/test_interrupts.py) -------------------------------------
    def call(self, what: str, fn: Callable[..., Any], *args: Any, states: tuple = (),
             timed: bool = True, poll: bool = False) -> Any:
        """``fn(*args)`` -- a C call with the handle -- holding the API lock and counted
        inside NCCL, or the refusal (a state not usable nor in ``states``).  ``timed``: a new
        call for the watchdog (``calls``, ``entered``); ``poll``: one poll of a wait (its
        name is not the call's).  Safe against an interrupt at any point: the API lock is
        held by ``with`` (no check between its acquire and the block), the counts are taken
        and ``counted`` set, and given back, each under the state lock with nothing
        interruptible between; a missed wake-up of an abort is :meth:`_poll_idle`'s."""
        with self.api:
            counted = False
            try:
                with self.lock:
                    st = self.state
                    if st is not USABLE and st not in states:
                        raise self.refusal(what)
                    self.inflight += 1
                    if timed:
                        self.calls += 1
                        self.entered += 1
                    if not poll:
                        self._what = what
                        self.plan = None
                    counted = True
                return fn(*args)
            finally:
                if counted:
                    with self.lock:
                        self.inflight -= 1
                        if timed:
                            self.calls -= 1
                        idle = not self.inflight and (self.waiters or self.on_idle is not None)
                        counted = False
                    if idle:
                        self.idle()

    def try_call(self, what: str, fn: Callable[..., Any], *args: Any,
                 states: tuple = ()) -> Any:
        """:meth:`call` (a poll: not timed) without waiting for the API lock: :data:`BUSY`
        when another thread is inside NCCL with the handle or the state refuses; then
        nothing is held.  The non-blocking acquire cannot be interrupted while waiting (it
        does not wait): an interrupt after it finds the lock one level deeper, and gives it
        back."""
        api = self.api
        depth = None
        try:
            depth = _depth(api)
            if not api.acquire(blocking=False):
                return BUSY
        except BaseException:
            if depth is not None and _depth(api) > depth:
                api.release()
            raise
        try:
            with self.lock:
                st = self.state
                if st is not USABLE and st not in states:
                    return BUSY
            return self.call(what, fn, *args, states=states, timed=False, poll=True)
        finally:
            api.release()

    # -- calls (the hot path: the state lock, then the API lock) ------------------------------
    def enter(self, what: str) -> None:
        """A call may touch the handle (usable state), or raise why not; the caller holds the
        API lock until :meth:`leave`."""
        with self.lock:
            if self.state is not USABLE:
                raise self.refusal(what)
            self.inflight += 1
            self.calls += 1
            self.entered += 1
            self._what = what
        self._take_api(what, (), timed=True)

    def _take_api(self, what: str, states: tuple = (), timed: bool = True) -> None:
        """The API lock, after another thread's call; refused (and left) if the state
        changed meanwhile (an abort took the handle while this thread waited its turn).
        ``timed``: the call was counted in ``calls`` too."""
        api = self.api
        depth = _depth(api)
        try:
            api.acquire()
        except BaseException:        # interrupted while waiting, or just after: nothing
            if _depth(api) > depth:  # stays held or counted
                api.release()
            self._leave_counts(timed)
            raise
        st = self.state
        if st is not USABLE and st not in states:
            self.api.release()
            self._leave_counts(timed)
            raise self.refusal(what)

    def enter_poll(self, what: str, *states: str) -> None:
        """One poll of a wait for completion (``ncclCommGetAsyncError``): like :meth:`enter`
        (refused once aborted; the API lock held until :meth:`release`) but not a new call
        for the watchdog, whose timer runs from the wait's :meth:`mark_call`."""
        with self.lock:
            if self.state is not USABLE and self.state not in states:
                raise self.refusal(what)
            self.inflight += 1
        self._take_api(what, states, timed=False)

    def try_enter_poll(self, what: str, *states: str) -> bool:
        """:meth:`enter_poll` without waiting: False when another thread is inside NCCL with
        the handle (or the state refuses); then nothing is held."""
        with self.lock:
            if self.state is not USABLE and self.state not in states:
                return False
            if not self.api.acquire(blocking=False):
                return False
            self.inflight += 1
            return True

    def hold(self, what: str = "group", into: Optional[dict] = None, key: Any = None,
             comm: Any = None) -> None:
        """A thread's open group takes the handle (usable state), or raises why not; ended
        by :meth:`release_hold` at the group end.  Refused while another thread's open group
        holds it (:meth:`foreign_group`).  ``into[key] = comm`` (the group's list of what it
        holds, which its end releases) is set with the counts, nothing interruptible
        between: an interrupt never leaves a hold nobody releases."""
        me = threading.get_ident()
        with self.lock:
            if self.state is USABLE:
                if self.holder is not None and self.holder != me:
                    raise self.foreign_group(what)
                self.inflight += 1
                self.holder = me
                self.nhold += 1
                if into is not None:
                    into[key] = comm
                return
        raise self.refusal(what)

    def release_hold(self) -> None:
        """End of a :meth:`hold` (no API lock taken): the hold and its count given back in
        one step under the state lock (nothing interruptible between), then an abort waiting
        for it woken (a missed wake-up is :meth:`_poll_idle`'s)."""
        with self.lock:
            self.nhold -= 1
            if self.nhold <= 0:
                self.nhold, self.holder = 0, None
            self.inflight -= 1
            idle = not self.inflight and (self.waiters or self.on_idle is not None)
        if idle:
            self.idle()

    def foreign_group(self, what: str) -> NcclpyError:
        """The error of a call made while another thread's open group holds the handle: NCCL
        keeps one group per thread and a communicator in one group at a time (group.cc
        ncclGroupCommJoin), so the call would join that group and run at its end, launched
        by the other thread, while this one's Work completed at once."""
        return NcclpyError(
            f"{what}: the communicator ({self.owner}) is in an open group() of another thread "
            f"(thread {self.holder}); NCCL would launch this call at the end of that group, "
            f"not now: make the call inside that group, on that thread, or after it ended")

    def idle(self) -> None:
        """A call left and nothing else is inside: wake an abort waiting for it, and run the
        abort it deferred (on a thread of its own: see :meth:`defer_until_idle`)."""
        with self.lock:
            if self.inflight:
                return
            if self.waiters:
                self.cond.notify_all()
            run = None
            if self.hot is None:
                run, self.on_idle = self.on_idle, None
        if run is not None:
            threading.Thread(target=_run_deferred, args=(run, self.owner), daemon=True,
                             name=f"ncclpy-abort ({self.owner})").start()

    def release(self) -> None:
        """End of :meth:`enter_as` / :meth:`enter_poll`: the API lock, then the counts."""
        self.api.release()
        self._leave_counts(timed=False)

    def mark_call(self, what: str) -> None:
        """A call made under a :meth:`hold` (the group end), or a wait for a nonblocking
        call's completion: timed like an entered call until :meth:`unmark_call`."""
        with self.lock:
            self.calls += 1
            self.entered += 1
            self._what = what
            self.plan = None

    def unmark_call(self) -> None:
        with self.lock:
            self.calls -= 1

    def enter_as(self, what: str, *states: str, timed: bool = False) -> None:
        """:meth:`enter` for steps allowed in other states too (``finalized``: close's own
        steps; ``closing``: what close does after it took the communicator) and for the short
        queries of a Work's check; ended by :meth:`release` (or :meth:`leave` if ``timed``:
        then the watchdog times it, as a collective step that can wait on peers)."""
        with self.lock:
            if self.state is USABLE or self.state in states:
                self.inflight += 1
                self._what = what
                self.plan = None
                if timed:
                    self.calls += 1
                    self.entered += 1
            else:
                raise self.refusal(what)
        if timed:
            self._take_api(what, (USABLE,) + states)
        else:
            self._take_api(what, states, timed=False)

    def leave(self) -> None:
        """End of :meth:`enter` (or a timed :meth:`enter_as`)."""
        self.api.release()
        self._leave_counts(timed=True)

    def _leave_counts(self, timed: bool) -> None:
        with self.lock:
            self.inflight -= 1
            if timed:
                self.calls -= 1
            if self.inflight:
                return
            if self.waiters:
                self.cond.notify_all()
            run = None
            if self.hot is None:      # a fast-path call inside runs it when it leaves
                run, self.on_idle = self.on_idle, None
        if run is not None:          # the deferred abort: the last call has left NCCL
            threading.Thread(target=_run_deferred, args=(run, self.owner), daemon=True,
                             name=f"ncclpy-abort ({self.owner})").start()

    def hot_left(self) -> None:
        """A fast-path call left NCCL while the state is no longer usable: wake an abort
        waiting for it, and run the abort it deferred once nothing else is inside."""
        with self.lock:
            if self.waiters:
                self.cond.notify_all()
            run = None
            if not self.inflight and self.hot is None:
                run, self.on_idle = self.on_idle, None
        if run is not None:
            threading.Thread(target=_run_deferred, args=(run, self.owner), daemon=True,
                             name=f"ncclpy-abort ({self.owner})").start()

    def _busy(self) -> bool:
        return self.inflight > 0 or self.hot is not None

    def _busy_what(self) -> str:
        if self.inflight > 0:
            return self._what
        h = self.hot
        plan = getattr(h, "plan", None)
        return getattr(plan, "collective", None) or self._what

    def defer_until_idle(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` once the last call in flight has left (True), or now if none is (False:
        the caller runs it).  The abort of a handle a call is still inside: NCCL frees the
        communicator in ncclCommAbort, and no other thread may be inside NCCL with it then
        (docs/reference/concepts/lifecycle.rst).  It runs on a thread of its own: the thread
        that leaves last may hold locks of its own (a window's) that the abort takes, and its
        caller gets its own result or error, not the abort's."""
        with self.lock:
            if not self._busy():
                return False
            self.on_idle = fn
            self.deferred = True
        threading.Thread(target=self._poll_idle, daemon=True,
                         name=f"ncclpy-abort-wait ({self.owner})").start()
        return True

    def _poll_idle(self) -> None:
        """The deferred abort's backstop: the call that leaves last runs it, but one
        interrupted between leaving and that step (a KeyboardInterrupt) would not; this
        thread finds the handle idle within a moment and runs it (once: whoever takes
        ``on_idle`` under the lock runs it)."""
        delay = 0.02
        while True:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            with self.lock:
                if self.on_idle is None:
                    return
                if self._busy():
                    continue
                run, self.on_idle = self.on_idle, None
            _run_deferred(run, self.owner)
            return

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
                while self._busy():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(min(left, 0.05))   # a fast-path call wakes it (hot_left)
            finally:
                self.waiters -= 1
            return self._busy_what() if self._busy() else ""

    def end_abort(self) -> None:
        with self.cond:
            self.state = ABORTED

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in flight (True), at most ``timeout`` seconds (False)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.waiters += 1
            try:
                while self._busy():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self.cond.wait(min(left, 0.05))
                return True
            finally:
                self.waiters -= 1

    def __repr__(self) -> str:
        return f"<Lifecycle {self.owner} {self.state} inflight={self.inflight}>"
