"""The watchdog: follow a communicator's Work, detect dead or silent peers, abort, say why.

Two parts:

* :class:`WatchState` -- the decisions, pure (no GPU, no thread, no store): ``step(now,
  pending, peers, dead)`` returns a :class:`Decision` (abort, and why) or None.  Rules, in
  order: a rank the launcher published as dead (``ncclpy/dead/<rank>``); a peer whose heartbeat
  has not changed for ``dead_after`` seconds (closed peers excepted); an error NCCL reported
  (``ncclCommGetAsyncError``, e.g. a peer's socket closed), once the heartbeats had
  ``dead_after`` + ``interval`` seconds to name the peer behind it; the oldest unfinished call
  older than ``timeout``.  Suspects of a timeout are the peers that have not issued that call
  yet (their heartbeat carries how many calls they issued), else every peer.  The decisions
  after an NCCL error say its text too.
* :class:`Watchdog` -- a daemon thread per communicator: every ``tick`` it drains the deque the
  executor appends each Work to (``comm._watch``: the only per-call cost), drops completed
  Works from the front, and every ``interval`` sets this rank's heartbeat
  ``ncclpy/<name>/hb/<rank>`` (``"<beat>:<issued>"``) and reads the others', through a store
  connection of its own (never behind the main thread's store calls).  On a decision it calls
  ``comm._watchdog_abort(decision)``: ncclCommAbort, and every blocked or later call on the
  communicator raises :class:`~ncclpy.errors.CommAbortedError` with the decision's message.
  The thread never touches the NCCL handle itself: a host wait that reads an async error hands
  it over (:meth:`Watchdog.verdict_on`) and waits, boundedly, for the verdict.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["default_timeout", "env_flag", "WatchState", "Decision", "Peer", "Watchdog",
           "heartbeat_key", "dead_key", "QUEUE_MAX"]

from . import errors as _errors

log = logging.getLogger(__name__)

#: Works kept by the deque between two drains (a bound, never reached at one drain per tick)
QUEUE_MAX = 1 << 16


def heartbeat_key(name: str, rank: int) -> str:
    return f"ncclpy/{name}/hb/{rank}"


def dead_key(rank: int) -> str:
    """The key the launcher sets when ``rank`` died."""
    return f"ncclpy/dead/{rank}"


@dataclass
class Peer:
    """What this rank knows of a peer: local time its heartbeat last changed (None: never
    seen), calls it has issued on the communicator, and whether it closed it."""

    seen: Optional[float] = None
    issued: int = 0
    closed: bool = False


@dataclass(frozen=True)
class Decision:
    """Abort the communicator: ``reason`` ("peer_dead", "peer_silent", "nccl_error", "timeout"),
    the oldest
    unfinished call (``collective``, ``seq``; "" and -1 when none), ``suspects`` and the
    message every blocked call raises."""

    reason: str
    collective: str
    seq: int
    suspects: Tuple[int, ...]
    message: str = field(compare=False)


class WatchState:
    """The watchdog's decisions (pure; see the module docstring)."""

    def __init__(self, rank: int, world_size: int, name: str, timeout: float,
                 dead_after: float = 5.0, start: float = 0.0) -> None:
        self.rank, self.world_size, self.name = rank, world_size, name
        self.timeout, self.dead_after, self.start = float(timeout), float(dead_after), start

    def _head(self) -> str:
        return f"ncclpy watchdog: communicator {self.name!r} rank {self.rank}/{self.world_size}"

    def step(self, now: float, pending: Sequence[Tuple[int, str, float]],
             peers: Mapping[int, Peer], dead: Iterable[int] = (),
             nccl_error: Optional[Tuple[str, float]] = None,
             interval: float = 1.0) -> Optional[Decision]:
        """``pending``: unfinished calls oldest first as (seq, collective, first seen);
        ``peers``: rank -> :class:`Peer`; ``dead``: ranks the launcher published as dead;
        ``nccl_error``: (its text, when it was reported) when NCCL reported an async error;
        ``interval``: the heartbeat period (how long a fresh heartbeat may take to change)."""
        seq, coll, since = pending[0] if pending else (-1, "", now)
        what = (f"{coll} (sequence {seq}, in flight for {now - since:.1f} s)" if pending
                else "no call in flight")
        if nccl_error is not None:
            what += f", after NCCL reported: {nccl_error[0]}"
        tail = "; the communicator was aborted (ncclCommAbort)"
        dead = sorted(set(dead) - {self.rank})
        if dead:
            return Decision("peer_dead", coll, seq, tuple(dead),
                            f"{self._head()}: rank(s) {_ranks(dead)} died (the launcher says "
                            f"so) while {what}; suspected: rank(s) {_ranks(dead)}{tail}")
        silent = []
        for r, p in sorted(peers.items()):
            if r == self.rank or p.closed:
                continue
            last = self.start if p.seen is None else p.seen
            if now - last > self.dead_after:
                silent.append((r, now - last, p.seen is None))
        if silent:
            ranks = [r for r, _, _ in silent]
            how = ", ".join(f"rank {r} " + ("never sent one" if never else f"silent {age:.1f} s")
                            for r, age, never in silent)
            return Decision("peer_silent", coll, seq, tuple(ranks),
                            f"{self._head()}: no heartbeat for more than {self.dead_after:g} s "
                            f"from rank(s) {_ranks(ranks)} ({how}; dead or hung) while {what}; "
                            f"suspected: rank(s) {_ranks(ranks)}{tail}")
        if nccl_error is not None and now - nccl_error[1] > self.dead_after + interval:
            others = [r for r in range(self.world_size) if r != self.rank]
            return Decision("nccl_error", coll, seq, tuple(others),
                            f"{self._head()}: {what}; every peer's heartbeat is still fresh, so "
                            f"none is singled out; suspected: every peer ({_ranks(others)})"
                            f"{tail}")
        if pending and now - since > self.timeout:
            behind = sorted(r for r, p in peers.items() if r != self.rank and p.issued <= seq)
            others = [r for r in range(self.world_size) if r != self.rank]
            if behind:
                why = ", ".join(f"rank {r} issued {peers[r].issued}" for r in behind)
                sus = f"rank(s) {_ranks(behind)}, which never issued it ({why} calls)"
            else:
                behind = others
                sus = f"every peer ({_ranks(others)}): all issued it, none is known dead"
            return Decision("timeout", coll, seq, tuple(behind),
                            f"{self._head()}: {coll} (sequence {seq}) did not complete within "
                            f"the communicator's timeout of {self.timeout:g} s; suspected: "
                            f"{sus}{tail}")
        return None


def _ranks(rs: Sequence[int]) -> str:
    return ", ".join(map(str, rs))


def _own_client(store: Any, timeout: float) -> Any:
    """A store connection of the watchdog's own (ncclpy's store), else ``store`` itself."""
    try:
        from .store import TCPStore
    except ImportError:  # pragma: no cover
        return store
    if isinstance(store, TCPStore):
        return TCPStore(store.host, store.port, token=getattr(store, "_token", None),
                        timeout=timeout, connect_timeout=timeout)
    return store


class Watchdog:
    """The thread of one communicator (see the module docstring).  ``comm`` needs ``_watch``
    (set here), ``rank``, ``world_size``, ``name``, ``_timeout``, ``_device`` and
    ``_watchdog_abort``; ``store`` may be None (no heartbeats: timeouts only)."""

    def __init__(self, comm: Any, store: Any = None, *, interval: float = 1.0,
                 dead_after: Optional[float] = None, tick: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.comm = comm
        self.queue: Deque[Any] = collections.deque(maxlen=QUEUE_MAX)
        self.interval, self.tick, self.clock = float(interval), float(tick), clock
        if dead_after is None:
            dead_after = max(3.0 * self.interval, 3.0)
        self.state = WatchState(comm.rank, comm.world_size, comm.name, comm._timeout,
                                dead_after, clock())
        self._store = store
        self._client: Any = None
        self.peers: Dict[int, Peer] = {r: Peer() for r in range(comm.world_size)
                                       if r != comm.rank}
        self._raw: Dict[int, bytes] = {}
        self.pending: Deque[List[Any]] = collections.deque()   # [seq, work, first seen]
        self.issued = 0
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.decision: Optional[Decision] = None
        #: (text, clock) of an async error a host wait read (set once, by that thread)
        self.nccl_error: Optional[Tuple[str, float]] = None
        self._decided = threading.Event()     # set when the thread aborted, or ended
        comm._watch = self.queue

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ncclpy-watchdog-{self.comm.name}-{self.comm.rank}")
        self._thread.start()
        return self

    def stop(self, closed: bool = True) -> None:
        """Stop the thread (not from itself: it then just ends); ``closed``: tell the peers
        this rank closed the communicator, so its silence is not a death."""
        self._stop.set()
        self.comm._watch = None
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)
        client = self._client
        if closed and client is not None:
            try:
                client.set(heartbeat_key(self.comm.name, self.comm.rank), b"closed")
            except Exception:
                log.debug("watchdog: could not publish the close", exc_info=True)
        if client is not None and client is not self._store:
            try:
                client.close()
            except Exception:
                pass
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

    # -- one tick (driven by the thread; callable directly) ----------------------------------
    def drain(self, now: float) -> None:
        """Take the newly issued Works, drop completed ones from the front."""
        q = self.queue
        while q:
            try:
                w = q.popleft()
            except IndexError:
                break
            self.pending.append([self.issued, w, None])
            self.issued += 1
        p = self.pending
        while p:
            w = p[0][1]
            if w._owned:            # recorded in a CUDA-graph capture: never queried (an
                p.popleft()         # event query can invalidate a capture); a replay is
                continue            # the user's stream sync, not a Work
            try:
                done = w.is_completed()
            except Exception:       # failed (its error reaches whoever waits on it)
                done = True
            if not done:
                break
            p.popleft()
        for item in p:
            if item[2] is None and (item[1]._event is not None or item[1]._error is not None):
                item[2] = now       # timed from when its event was recorded (group end)

    def beat(self, now: float) -> None:
        """Publish this rank's heartbeat, read the peers'."""
        c = self._client
        if c is None:
            return
        name = self.comm.name
        self._beat += 1
        c.set(heartbeat_key(name, self.comm.rank), f"{self._beat}:{self.issued}")
        for r, peer in self.peers.items():
            try:
                raw = c.get(heartbeat_key(name, r), timeout=0.05)
            except Exception:
                continue            # not yet written, or a slow read: no news
            if raw == b"closed":
                peer.closed = True
            elif raw != self._raw.get(r):
                self._raw[r] = raw
                peer.seen = now
                try:
                    peer.issued = int(raw.split(b":")[1])
                except (IndexError, ValueError):
                    pass

    def dead(self) -> List[int]:
        """Ranks the launcher published as dead."""
        c = self._client
        if c is None or not hasattr(c, "check"):
            return []
        out = []
        for r in self.peers:
            try:
                if c.check([dead_key(r)]):
                    out.append(r)
            except Exception:
                return out
        return out

    def decide(self, now: float, dead: Iterable[int] = ()) -> Optional[Decision]:
        pend = [(s, getattr(w.plan, "collective", "?"), t) for s, w, t in self.pending
                if t is not None]
        return self.state.step(now, pend, self.peers if self._client is not None else {},
                               dead, self.nccl_error, self.interval)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._decided.set()       # a host wait in verdict_on never outwaits the thread

    def _loop(self) -> None:
        try:
            from ._nccl.cuda import cuda
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
        if self._store is None:
            log.info("watchdog of %r: no rendezvous store (uid exchanged over MPI): timeouts "
                     "only; peer deaths are not detected by heartbeats", self.comm.name)
        else:
            try:
                self._client = _own_client(self._store, max(self.interval, 1.0))
            except Exception as e:
                log.warning("watchdog of %r: no store connection of its own (%s): timeouts "
                            "only, no heartbeats", self.comm.name, e)
        next_beat = 0.0
        while not self._stop.wait(self.tick):
            now = self.clock()
            try:
                self.drain(now)
                dead: List[int] = []
                if now >= next_beat:
                    next_beat = now + self.interval
                    self.beat(now)
                    dead = self.dead()
                d = self.decide(now, dead)
            except Exception:
                log.debug("watchdog tick failed", exc_info=True)
                continue
            if d is not None:
                self.decision = d
                log.error("%s", d.message)
                try:
                    self.comm._watchdog_abort(d)
                except Exception:
                    log.warning("watchdog: abort failed", exc_info=True)
                return


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
