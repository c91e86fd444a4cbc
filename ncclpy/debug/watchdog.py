"""The watchdog: follow a communicator's Work, detect dead or silent peers, abort, say why.

Two parts:

* :mod:`ncclpy.debug.verdicts` -- the decisions, pure (no GPU, no thread, no store):
  :class:`WatchState` and its rule (a death aborts at once; a peer's published abort is
  followed with its cause; silence names a suspect only while a call waits on it, and only
  once a fresh read confirms it; an NCCL error; the communicator's timeout).
* :class:`Watchdog` -- a daemon thread per communicator: every ``tick`` it drains the deque the
  executor appends each Work to (``comm._watch``: the only per-call cost), drops completed
  Works from the front, and every ``interval`` sends one heartbeat (its progress, and its
  progress counter: the calls it issued) to the store's heartbeat table of the communicator
  (:mod:`ncclpy.debug.heartbeat`): one request per rank per interval, which answers with the
  stale and never-seen peers, the first peer that aborted and the death epoch.  Peers are
  judged only from replies that came on time (a slow store is logged as such, never taken for
  dead peers), with ages taken as of the reply's arrival.  Between beats a tick extrapolates;
  when a silence would become a verdict (a call waits) it reads the table once more (a peek)
  and judges from that.  On the way to a timeout it asks once who has not issued the call
  (BEAT_BEHIND: O(listed), never the whole table).  On a verdict it publishes it in the table
  (BEAT_ABORT) before aborting, so that peers follow it instead of naming this rank's silence.
  It shares the process's store client.  A store without the table (torch's) gets the older
  per-key heartbeats (``ncclpy/<name>/hb/<rank>``, N-1 reads per beat).  On a decision it calls
  ``comm._watchdog_abort(decision)``: ncclCommAbort, and every blocked or later call on the
  communicator raises :class:`~ncclpy.errors.CommAbortedError` with the decision's message.
  The thread never touches the NCCL handle itself: a host wait that reads an async error hands
  it over (:meth:`Watchdog.verdict_on`) and waits, boundedly, for the verdict.  A tick that
  fails is counted and said (the watchdog is blind meanwhile): ``ncclpy status`` shows it.
  Its talk with the store (connecting, the beats, the fresh and BEAT_BEHIND reads, the dead
  ranks, leaving the table) is :mod:`ncclpy.debug.watchbeat`, a mixin it inherits.

When it stops, the Works it still holds and its deque (the call path keeps appending to it)
go to the process's reaper (:mod:`ncclpy.debug.reaper`), exactly once, and only once the
thread drains no more: :meth:`Watchdog.stop` joins the thread for at most :data:`STOP_JOIN`
seconds; one lock orders the thread's end (its loop returned) against stop's look at it, so
that either stop hands over (the loop had ended) or the thread does, at its end (stop asked
it to): never neither, never both.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

__all__ = ["default_timeout", "env_flag", "WatchState", "Decision", "Peer", "Published",
           "Watchdog", "heartbeat_key", "dead_key", "peers_from_beat", "report_after",
           "QUEUE_MAX", "INTERVAL", "BLIND_LOG_EVERY", "BUSY", "STOP_JOIN"]

from .. import errors as _errors
from .deaths import dead_key
from .heartbeat import Heart, Throttle
from .verdicts import (CONFIRM, Decision, Peer, Published, WatchState, carried_out,
                       peers_from_beat, report_after, waits_on)
from .watchbeat import HeartbeatMixin, heartbeat_key

log = logging.getLogger(__name__)

#: Works kept by the deque between two drains: no bound (a dropped Work would keep its
#: event and buffers forever); a drain per tick empties it
QUEUE_MAX = None
#: seconds between two heartbeats (default); silence limit: max(3 intervals, 3 s)
INTERVAL = 1.0
#: seconds between two "the watchdog is blind" warnings (the failed ticks between are counted)
BLIND_LOG_EVERY = 60.0
#: Works taken by a drain at which the next tick comes ten times sooner: a busy caller's Works
#: are let go young (before the garbage collector's oldest generation holds them)
BUSY = 256
#: seconds stop() waits for the thread to end (a thread still running then hands its Works to
#: the reaper itself, at its end)
STOP_JOIN = 5.0


class Watchdog(HeartbeatMixin):
    """The thread of one communicator (see the module docstring).  ``comm`` needs ``_watch``
    (set here), ``rank``, ``world_size``, ``name``, ``_timeout``, ``_device`` and
    ``_watchdog_abort``; ``store`` may be None (no heartbeats: timeouts only).  ``grace``: how
    long a peer may never have beaten (start-up allowance; default the communicator's timeout);
    ``group``: the heartbeat table's name (default from the name and bootstrap generation)."""

    def __init__(self, comm: Any, store: Any = None, *, interval: float = INTERVAL,
                 dead_after: Optional[float] = None, tick: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, grace: Optional[float] = None,
                 group: Optional[str] = None) -> None:
        self.comm = comm
        self.queue: Deque[Any] = collections.deque(maxlen=QUEUE_MAX)
        self.interval, self.tick, self.clock = float(interval), float(tick), clock
        if dead_after is None:
            dead_after = max(3.0 * self.interval, 3.0)
        if grace is None:
            grace = max(float(comm._timeout), dead_after)
        self.state = WatchState(comm.rank, comm.world_size, comm.name, comm._timeout,
                                dead_after, clock(), never_grace=grace)
        self._store = store
        self._client: Any = None
        gen = getattr(getattr(comm, "bootstrap", None), "generation", 0)
        self.group = group or f"ncclpy/{comm.name}/{gen}/hb"
        self._heart: Optional[Heart] = None
        #: the suspicious peers of the last on-time reply (a fresh peer needs no entry); with
        #: per-key heartbeats (torch's store), every peer
        self.peers: Dict[int, Peer] = {}
        self._raw: Dict[int, bytes] = {}
        self._epoch = 0
        self._dead: List[int] = []
        #: the first abort a peer published (followed at once)
        self.published: Optional[Published] = None
        #: (seq, rank -> calls issued) of the peers behind the oldest call (read once per call
        #: on the way to its timeout)
        self._behind: Optional[Tuple[int, Dict[int, int]]] = None
        self._confirm_ok = True           # False after a late confirmation, until a beat
        #: (seq, when) BEAT_BEHIND was last asked (a late reply: asked again an interval later)
        self._behind_asked: Tuple[int, float] = (-1, 0.0)
        self.confirms = 0                 # fresh reads a silence asked for
        #: Works not seen complete, oldest first (``issued - len(pending)``: the oldest's
        #: sequence number); ``_seen``: (issued count, when) of each drain that took Works
        self.pending: List[Any] = []
        self.taken = 0                    # Works the last drain took (many: drain sooner)
        #: the hand-over to the reaper (:meth:`stop`): under ``_exit_lock``, ``_ended`` (the
        #: thread's loop returned: it drains no more), ``_hand_over_at_exit`` (stop found it
        #: still running: the thread hands over at its end) and ``_handed`` (done: once)
        self._exit_lock = threading.Lock()
        self._ended = False
        self._hand_over_at_exit = False
        self._handed = False
        self._seen: Deque[Tuple[int, float]] = collections.deque()
        self.issued = 0
        self._last: Any = None            # the last drained Work's plan (for the status)
        self._last_rec: Optional[list] = None   # its recorder entry (until the call path
        self._last_work: Any = None             # attached it: the Work, weakly)
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.decision: Optional[Decision] = None
        #: (text, clock) of an async error a host wait read (set once, by that thread)
        self.nccl_error: Optional[Tuple[str, float]] = None
        self._decided = threading.Event()     # set when the thread aborted, or ended
        self._next_beat = 0.0
        self._in_call: Optional[Tuple[int, float]] = None   # (life.entered, first seen)
        self._left = False                # this rank closed or published its abort
        #: ticks that failed (the watchdog was blind for each), and when that was last said
        self.blind = 0
        self._blind_said = Throttle(BLIND_LOG_EVERY, clock)
        comm._watch = self.queue

    def start(self) -> "Watchdog":
        """Connect, beat once (so every rank whose watchdog started has been seen: a peer
        that never beat is judged only after the start-up grace), start the thread."""
        self._connect()
        try:
            self.beat(self.clock())
        except Exception:
            log.debug("watchdog: the first heartbeat failed", exc_info=True)
        self._next_beat = self.clock() + self.interval
        t = threading.Thread(target=self._run, daemon=True,
                             name=f"ncclpy-watchdog-{self.comm.name}-{self.comm.rank}")
        self._thread = t
        try:
            t.start()
        except BaseException:
            self._thread = None          # never ran: stop() hands over itself
            raise
        return self

    def stop(self, closed: bool = True, verdict: Optional[Published] = None) -> None:
        """Stop the thread (not from itself: it then just ends); ``closed``: tell the peers
        this rank closed the communicator, so its silence is not a death; ``verdict``: this
        rank aborted it (peers follow that verdict).  Bounded: waits at most
        :data:`STOP_JOIN` seconds for the thread; the Works it holds go to the reaper, now or
        (a thread still running) at its end."""
        self._stop.set()
        t = self._thread
        me = threading.current_thread()
        if t is not None and t is not me:
            t.join(timeout=STOP_JOIN)
        with self._exit_lock:       # against the thread's end (_run): exactly one hands over
            later = t is not None and t is not me and not self._ended
            if later:               # it may drain again: it hands over after its last drain
                self._hand_over_at_exit = True
        if not later:               # no thread, its loop ended, or this is the thread (in act)
            self._hand_over()
        if verdict is not None:
            self.publish(verdict)
        elif closed:
            self._leave(b"closed", aborted=False)
        self._client = None

    def verdict_on(self, error: BaseException) -> Optional[Decision]:
        """Hand the thread an async error NCCL reported to a host wait; wait (at most
        ``dead_after`` + 2 ``interval`` + 1 s) for its decision, which names the peer whose
        heartbeat stopped.  None: no decision (the thread is not running, or it timed out)."""
        if self.nccl_error is None:
            self.nccl_error = (str(error), self.clock())
        t = self._thread
        if t is None or not t.is_alive() or t is threading.current_thread():
            return self.decision
        self._decided.wait(self.state.dead_after + 2 * self.interval + 1.0)
        return self.decision

    def _hand_over(self) -> None:
        """The Works this watchdog still holds, and its deque (the communicator keeps
        appending to it), go to the process's reaper, which releases them once complete
        (once: a second call does nothing)."""
        from .reaper import reaper
        with self._exit_lock:
            if self._handed:
                return
            self._handed = True
        pending, self.pending = self.pending, []
        reaper().adopt(self.queue, pending)

    # -- one tick (driven by the thread; callable directly) ----------------------------------
    def drain(self, now: float) -> None:
        """Take the newly issued Works, release the completed ones at the front."""
        from ..comm.work import release_done, take   # (the call path imports this module)
        p = self.pending
        n = self.taken = take(self.queue, p)
        if n:
            self.issued += n
            w = p[-1]
            self._last, self._last_rec = w.plan, getattr(w, "_rec", None)
            self._last_work = weakref.ref(w) if self._last_rec is None and hasattr(
                w, "__weakref__") else None
            self._seen.append((self.issued, now))   # Works up to this count: first seen now
        release_done(p)             # (a captured call, marked by the call, is let go: a
        seen = self._seen           # replay is the user's stream sync, not a Work)
        head = self.issued - len(p)
        while seen and seen[0][0] <= head:
            seen.popleft()

    def head(self) -> Optional[Tuple[int, Any, float]]:
        """(sequence number, Work, first seen) of the oldest call not seen complete."""
        p = self.pending
        seq = self.issued - len(p)
        seen = self._seen
        while seen and seen[0][0] <= seq:
            seen.popleft()
        if not p or not seen:
            return None
        return (seq, p[0], seen[0][1])

    def blocked(self, now: float) -> Optional[Tuple[Any, ...]]:
        """(seq, call, first seen, the peers it waits on or None) of a call inside NCCL on the
        host: the lifecycle's ``calls``/``entered`` sampled once per tick (the same entry seen
        again is the same call, still inside); None when no call is inside."""
        life = getattr(self.comm, "_life", None)
        hot = getattr(life, "hot", None)
        if life is None or (life.calls <= 0 and hot is None):
            self._in_call = None
            return None
        if life.calls > 0:
            e, what, plan = life.entered, life._what or "?", getattr(life, "plan", None)
        else:                       # the fast path's in-call marker (ncclpy.comm.hot)
            plan = getattr(hot, "plan", None)
            e, what = -life.hot_n, getattr(plan, "collective", "?")
        if self._in_call is None or self._in_call[0] != e:
            self._in_call = (e, now)
        return (self.issued, what, self._in_call[1], waits_on(plan))

    def decide(self, now: float, dead: Iterable[int] = ()) -> Optional[Decision]:
        """One tick's verdict (see :mod:`ncclpy.debug.verdicts`): at most one fresh read of
        the table when a silence would be a verdict, one BEAT_BEHIND read per call on the way
        to its timeout."""
        dead = list(dead)
        h = self.head()
        head = None if h is None else (h[0], getattr(h[1].plan, "collective", "?"), h[2],
                                       waits_on(h[1].plan))
        pend = [head] if head is not None else []
        blk = self.blocked(now)
        oldest = min([p[2] for p in pend] + ([blk[2]] if blk else []), default=now)
        seq = (blk[0] if blk is not None and (head is None or blk[2] < head[2])
               else head[0] if head is not None else -1)
        asked = self._behind is not None and self._behind[0] == seq
        if now - oldest > self.state.timeout and self._heart is not None and not asked and \
                (self._behind_asked[0] != seq or
                 now - self._behind_asked[1] >= self.interval):
            self._behind_asked = (seq, now)   # a late store is asked again an interval later
            self.read_behind(seq)        # who issued the call: one request, O(listed)
        behind = (self._behind[1] if self._behind is not None and self._behind[0] == seq
                  else None)
        known = self._heart is None      # per-key heartbeats carry every peer's count
        peers = self.peers if self._client is not None else {}
        d = self.state.step(now, pend, peers, dead, self.nccl_error, self.interval, blk,
                            self.published, behind=behind, issued_known=known)
        if d != CONFIRM:
            return d                     # type: ignore[return-value]
        if not self._confirm_ok or not self.confirm():
            # a late store judges nobody's silence; the other rules still hold
            d = self.state.step(now, pend, peers, dead, self.nccl_error, self.interval, blk,
                                self.published, behind=behind, silence=False,
                                issued_known=known)
            return None if d == CONFIRM else d   # type: ignore[return-value]
        at = self._heart.replied_at if self._heart is not None else self.clock()
        d = self.state.step(max(at, now), pend, self.peers, self.dead() or dead,
                            self.nccl_error, self.interval, blk, self.published,
                            confirmed=True, behind=behind, issued_known=known)
        return None if d == CONFIRM else d    # type: ignore[return-value]

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._exit_lock:     # against stop(): exactly one hands over
                self._ended = True    # no drain after this
                mine = self._hand_over_at_exit
            self._decided.set()       # a host wait in verdict_on never outwaits the thread
            if mine:
                self._hand_over()

    def _loop(self) -> None:
        try:
            from .._nccl.cuda import cuda
            cu = cuda()
            cu.set_device(self.comm._device)   # never a context on another device
            # its event queries must neither fail nor invalidate another thread's capture in
            # CUDA's default global mode (torch.cuda.graph's): this thread interacts with
            # captures as ThreadLocal
            if not cu.thread_capture_mode_local():
                log.info("watchdog of %r: could not set its capture mode to thread-local; a "
                         "CUDA graph captured in global mode while it runs may be invalidated",
                         self.comm.name)
        except Exception:
            log.debug("watchdog: could not set up its CUDA thread state", exc_info=True)
        if self._client is None and self._store is not None:
            self._connect()
        while not self._stop.wait(self.tick if self.taken < BUSY else self.tick / 10):
            now = self.clock()
            try:
                self.drain(now)
                if now >= self._next_beat:
                    self._next_beat = now + self.interval
                    self.beat(now)
                d = self.decide(now, self.dead())
            except Exception as e:  # noqa: BLE001 - said, counted, and the loop goes on
                self._blind_tick(e)
                continue
            if d is not None:
                self.act(d)
                return

    def act(self, d: Decision) -> Decision:
        """Carry out verdict ``d``: publish it (peers hear it before this rank falls
        silent), report the first verdict instead when another rank published one first (its
        cause and suspects: every rank then says the same, e.g. whom a shrink excludes), log
        it, abort the communicator.  Returns the verdict carried out."""
        try:
            first = self.publish(self.state.published(d))
            if first is not None and d.reason != "peer_dead":
                self.published = first
                d = self.decide(self.clock()) or d
        except Exception:  # noqa: BLE001 - the abort matters more
            log.debug("watchdog: could not publish the verdict", exc_info=True)
        self.decision = d
        log.error("%s", carried_out(d.message,
                                    getattr(self.comm, "_on_failure", "abort") == "revoke"))
        try:
            self.comm._watchdog_abort(d)
        except Exception:
            log.warning("watchdog: abort failed", exc_info=True)
        return d

    def _blind_tick(self, e: BaseException) -> None:
        """A tick raised: the watchdog saw nothing this tick.  Said at WARNING the first
        time and then at most once a minute (with how many failed between), counted for
        ``ncclpy status``."""
        self.blind += 1
        log.debug("watchdog tick failed", exc_info=True)
        quiet = self._blind_said.due()
        if quiet is None:
            return
        more = f" ({quiet} more failed since the last such line)" if quiet else ""
        log.warning("watchdog of %r rank %d: a tick failed (%s: %s): it saw nothing this tick "
                    "and detects nothing while this goes on; %d ticks failed so far%s (ncclpy "
                    "status shows the count)", self.comm.name, self.comm.rank,
                    type(e).__name__, e, self.blind, more)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def default_timeout(timeout: Any = None) -> float:
    """``timeout`` checked (positive seconds), or ``$NCCLPY_TIMEOUT``, or 300."""
    src = "timeout"
    if timeout is None:
        env = os.environ.get("NCCLPY_TIMEOUT")
        if env is None or not env.strip():
            return 300.0
        src = "NCCLPY_TIMEOUT"
        try:
            timeout = float(env)
        except ValueError:
            raise _errors.ArgumentError(f"NCCLPY_TIMEOUT: expected a positive number of "
                                        f"seconds, got {env!r}") from None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
            not 0 < timeout < float("inf"):
        raise _errors.ArgumentError(f"{src}: expected a positive number of seconds, got "
                                    f"{timeout!r}")
    return float(timeout)


def env_flag(arg: str, value: Optional[bool], var: str, default: bool) -> bool:
    """``value`` when given (a bool), else the environment variable ``var`` (1/0, true/false,
    yes/no, on/off), else ``default``."""
    if value is not None:
        if not isinstance(value, bool):
            raise _errors.ArgumentTypeError(f"{arg}: expected True, False or None, got "
                                    f"{type(value).__name__} {value!r}")
        return value
    env = os.environ.get(var)
    if env is None:
        return default
    v = env.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _errors.ArgumentError(f"{var}: expected 1/0, true/false, yes/no or on/off, got {env!r}")
