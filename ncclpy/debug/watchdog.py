"""The watchdog: follow a communicator's Work, detect dead or silent peers, abort, say why.

Two parts:

* :class:`WatchState` -- the decisions, pure (no GPU, no thread, no store): ``step(now,
  pending, peers, dead)`` returns a :class:`Decision` (abort, and why) or None.  Rules, in
  order: a rank the launcher published as dead (:mod:`ncclpy.debug.deaths`); a peer whose
  heartbeat has not changed for ``dead_after`` seconds (closed peers excepted; a peer that never
  beat gets ``never_grace``, the start-up allowance, instead); an error NCCL reported
  (``ncclCommGetAsyncError``, e.g. a peer's socket closed), once the heartbeats had
  ``dead_after`` + ``interval`` seconds to name the peer behind it; the oldest unfinished call
  older than ``timeout`` -- a call whose launch is still blocked inside NCCL on the host (a
  send/recv's first use connecting to a peer that never makes its side) counts as unfinished
  from the tick that first saw it inside.  Suspects of a timeout are the peers that have not
  issued that call yet (their heartbeat carries how many calls they issued), else every peer.
  The decisions after an NCCL error say its text too.
* :class:`Watchdog` -- a daemon thread per communicator: every ``tick`` it drains the deque the
  executor appends each Work to (``comm._watch``: the only per-call cost), drops completed
  Works from the front, and every ``interval`` sends one heartbeat (``"<beat>:<issued>"``) to
  the store's heartbeat table of the communicator (:mod:`ncclpy.debug.heartbeat`): one request
  per rank per interval, which answers with the stale and never-seen peers and the death epoch.
  Peers are judged only from replies that came on time (a slow store is logged as such, never
  taken for dead peers); the whole table is read (one request) only on the way to a verdict.
  It shares the process's store client (a second connection only while another thread's call
  is parked).  A store without the table (torch's) gets the older per-key heartbeats
  (``ncclpy/<name>/hb/<rank>``, N-1 reads per beat).  On a decision it calls
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
           "heartbeat_key", "dead_key", "peers_from_beat", "report_after", "QUEUE_MAX",
           "INTERVAL"]

from .. import errors as _errors
from . import deaths as _deaths
from .deaths import dead_key
from .heartbeat import Heart, on_time_limit

log = logging.getLogger(__name__)

#: Works kept by the deque between two drains (a bound, never reached at one drain per tick)
QUEUE_MAX = 1 << 16
#: seconds between two heartbeats (default); silence limit: max(3 intervals, 3 s)
INTERVAL = 1.0


def heartbeat_key(name: str, rank: int) -> str:
    return f"ncclpy/{name}/hb/{rank}"


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
                 dead_after: float = 5.0, start: float = 0.0,
                 never_grace: Optional[float] = None) -> None:
        self.rank, self.world_size, self.name = rank, world_size, name
        self.timeout, self.dead_after, self.start = float(timeout), float(dead_after), start
        self.never_grace = self.dead_after if never_grace is None else float(never_grace)

    def _head(self) -> str:
        return f"ncclpy watchdog: communicator {self.name!r} rank {self.rank}/{self.world_size}"

    def step(self, now: float, pending: Sequence[Tuple[int, str, float]],
             peers: Mapping[int, Peer], dead: Iterable[int] = (),
             nccl_error: Optional[Tuple[str, float]] = None,
             interval: float = 1.0,
             blocked: Optional[Tuple[int, str, float]] = None) -> Optional[Decision]:
        """``pending``: unfinished calls oldest first as (seq, collective, first seen);
        ``peers``: rank -> :class:`Peer`; ``dead``: ranks the launcher published as dead;
        ``nccl_error``: (its text, when it was reported) when NCCL reported an async error;
        ``interval``: the heartbeat period (how long a fresh heartbeat may take to change);
        ``blocked``: (seq, call, first seen) of a call still inside NCCL on the host (its
        launch never returned: no event to wait on), timed like a pending call."""
        in_call = False
        if blocked is not None and (not pending or blocked[2] < pending[0][2]):
            in_call = True
            seq, coll, since = blocked
            what = f"{coll} (sequence {seq}, blocked inside NCCL for {now - since:.1f} s)"
        else:
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
            if now - last > (self.dead_after if p.seen is not None else self.never_grace):
                silent.append((r, now - last, p.seen is None))
        if silent:
            ranks = [r for r, _, _ in silent]
            how = ", ".join(f"rank {r} " + (f"never sent one in {age:.1f} s" if never
                                            else f"silent {age:.1f} s")
                            for r, age, never in silent[:8])
            if len(silent) > 8:
                how += f", and {len(silent) - 8} more"
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
        if (pending or in_call) and now - since > self.timeout:
            behind = sorted(r for r, p in peers.items() if r != self.rank and p.issued <= seq)
            others = [r for r in range(self.world_size) if r != self.rank]
            if behind:
                why = ", ".join(f"rank {r} issued {peers[r].issued}" for r in behind)
                sus = f"rank(s) {_ranks(behind)}, which never issued it ({why} calls)"
            else:
                behind = others
                sus = f"every peer ({_ranks(others)}): all issued it, none is known dead"
            how = ("was still blocked inside its NCCL call on the host (the launch never "
                   "returned: a peer never made the matching call, e.g. a send/recv's first "
                   "use, which connects the pair) after" if in_call
                   else "did not complete within")
            return Decision("timeout", coll, seq, tuple(behind),
                            f"{self._head()}: {coll} (sequence {seq}) {how} the communicator's "
                            f"timeout of {self.timeout:g} s; suspected: {sus}{tail}")
        return None


def report_after(dead_after: float, interval: float) -> float:
    """The age past which the store lists a peer in a beat's reply: one interval before the
    silence limit, so that the thread's ticks judge it the moment it passes ``dead_after``
    (not up to an interval later, at the next beat)."""
    return max(dead_after - interval, interval)


def peers_from_beat(rep: Any, now: float, rank: int,
                    never_due: bool) -> Optional[Dict[int, Peer]]:
    """The peers to judge after an on-time BEAT reply ``rep``: the stale ones (seen ``age`` ago
    on the store's clock) and, once the start-up grace is over (``never_due``), those that never
    beat; the others are fresh and need no entry.  None when the reply counts more suspects
    than it lists: read the whole table then."""
    if rep.nstale > len(rep.stale) or (never_due and rep.never > len(rep.never_listed)):
        return None
    peers = {r: Peer(seen=now - age) for r, age in rep.stale if r != rank}
    if never_due:
        peers.update((r, Peer()) for r in rep.never_listed if r != rank)
    return peers


def _ranks(rs: Sequence[int], most: int = 32) -> str:
    """``"1, 4-9, 12"``: runs of consecutive ranks as ranges, at most ``most`` items shown."""
    items: List[str] = []
    rs = sorted(rs)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        items.append(str(rs[i]) if j == i else f"{rs[i]}, {rs[j]}" if j == i + 1
                     else f"{rs[i]}-{rs[j]}")
        i = j + 1
    if len(items) > most:
        return ", ".join(items[:most]) + f", ... ({len(rs)} ranks in all)"
    return ", ".join(items)


class Watchdog:
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
        #: what this rank knows of its peers: the suspicious ones of the last on-time beat, or
        #: every peer after a full read (the way to a verdict)
        self.peers: Dict[int, Peer] = {}
        self._raw: Dict[int, bytes] = {}
        self._epoch = 0
        self._dead: List[int] = []
        self.pending: Deque[List[Any]] = collections.deque()   # [seq, work, first seen]
        self.issued = 0
        self._last: Any = None            # the last drained Work's plan (for the status)
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.decision: Optional[Decision] = None
        #: (text, clock) of an async error a host wait read (set once, by that thread)
        self.nccl_error: Optional[Tuple[str, float]] = None
        self._decided = threading.Event()     # set when the thread aborted, or ended
        self._next_beat = 0.0
        self._in_call: Optional[Tuple[int, float]] = None   # (life.entered, first seen)
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
        client, self._client = self._client, None
        if not closed or client is None:
            return
        if self._heart is not None:
            self._heart.close()
            return
        try:
            client.set(heartbeat_key(self.comm.name, self.comm.rank), b"closed")
        except Exception:
            log.debug("watchdog: could not publish the close", exc_info=True)

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
            self._last = w.plan
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

    # -- heartbeats ----------------------------------------------------------------------------
    def beat(self, now: float) -> None:
        """Publish this rank's heartbeat; learn of stale, never-seen and dead peers."""
        c = self._client
        if c is None:
            return
        self._beat += 1
        value = self.progress(now)
        if self._heart is None:
            self._beat_keys(c, now, value)
            return
        rep = self._heart.beat(value)
        if rep is None:              # late: judge nobody from it, forget older suspicions
            self.peers = {}
            return
        if rep.epoch != self._epoch:
            self._epoch = rep.epoch
            self._read_dead(c)
        peers = peers_from_beat(rep, now, self.comm.rank,
                                now - self.state.start > self.state.never_grace)
        if peers is None:
            self.read_all(now)       # more suspects than one reply lists: read them all
        else:
            self.peers = peers

    def progress(self, now: float) -> bytes:
        """This rank's heartbeat value: its progress (:mod:`ncclpy.debug.status`)."""
        from .recorder import installed_signal, site_text
        from .status import Progress, encode
        p = Progress(self._beat, self.issued, self.issued - len(self.pending),
                     signal=installed_signal())
        if self.pending and self.pending[0][2] is not None:
            p.wait = max(now - self.pending[0][2], 0.0)
        rec = getattr(self.comm, "_recorder", None)
        e = rec.last() if rec is not None else None
        if e is not None:
            p.call, p.site = e[1].plan.collective, site_text(e[2], e[3]) or ""
        elif self._last is not None:
            p.call = getattr(self._last, "collective", "?")
        blk = self.blocked(now)
        if blk is not None and now > blk[2]:  # inside since an earlier tick: blocked there
            p.blocked, p.wait = True, max(p.wait, now - blk[2])
            if e is None or e[1].plan.collective != blk[1]:  # no recorder entry for it
                p.call, p.site = blk[1], ""
        return encode(p)

    def read_all(self, now: float) -> bool:
        """Read every peer's heartbeat (one request); False when the store was late."""
        if self._heart is None:
            return False
        rep = self._heart.full()
        if rep is None or rep.full is None:
            return False
        peers = {}
        for r, (age, closed, value) in enumerate(rep.full):
            if r == self.comm.rank:
                continue
            p = Peer(seen=None if age is None else now - age, closed=closed)
            try:
                p.issued = int(value.split(b":")[1])
            except (IndexError, ValueError):
                pass
            peers[r] = p
        self.peers = peers
        return True

    def _read_dead(self, c: Any) -> None:
        try:
            self._dead = sorted(_deaths.read_deaths(c))
        except Exception as e:
            self._epoch = -1         # read it again at the next beat
            log.debug("watchdog: could not read the dead ranks: %s", e)

    def _beat_keys(self, c: Any, now: float, value: bytes) -> None:
        """Heartbeats as keys, for a store without the table (torch's): N-1 reads per beat."""
        name = self.comm.name
        c.set(heartbeat_key(name, self.comm.rank), value)
        if not self.peers:
            self.peers = {r: Peer() for r in range(self.comm.world_size) if r != self.comm.rank}
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
        try:
            epoch = _deaths.read_epoch(c)
        except Exception:
            return
        if epoch != self._epoch:
            self._epoch = epoch
            self._read_dead(c)

    def dead(self) -> List[int]:
        """Ranks the launcher published as dead."""
        return [r for r in self._dead if r != self.comm.rank and 0 <= r < self.comm.world_size]

    def blocked(self, now: float) -> Optional[Tuple[int, str, float]]:
        """(seq, call, first seen) of a call inside NCCL on the host: the lifecycle's
        ``calls``/``entered`` sampled once per tick (the same entry seen again is the same
        call, still inside); None when no call is inside."""
        life = getattr(self.comm, "_life", None)
        if life is None or life.calls <= 0:
            self._in_call = None
            return None
        e = life.entered
        if self._in_call is None or self._in_call[0] != e:
            self._in_call = (e, now)
        return (self.issued, life._what or "?", self._in_call[1])

    def decide(self, now: float, dead: Iterable[int] = ()) -> Optional[Decision]:
        pend = [(s, getattr(w.plan, "collective", "?"), t) for s, w, t in self.pending
                if t is not None]
        blk = self.blocked(now)
        oldest = min([p[2] for p in pend[:1]] + ([blk[2]] if blk else []), default=now)
        if now - oldest > self.state.timeout and self._heart is not None \
                and len(self.peers) < self.comm.world_size - 1:
            self.read_all(now)       # who issued the call: every peer's count
        return self.state.step(now, pend, self.peers if self._client is not None else {},
                               dead, self.nccl_error, self.interval, blk)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._decided.set()       # a host wait in verdict_on never outwaits the thread

    def _connect(self) -> None:
        """Use the process's store client; the heartbeat table where the store serves it."""
        if self._client is not None:
            return
        if self._store is None:
            log.info("watchdog of %r: no rendezvous store (uid exchanged over MPI): timeouts "
                     "only; peer deaths are not detected by heartbeats", self.comm.name)
            return
        self._client = self._store
        if getattr(self._store, "supports_tables", False):
            if self.comm.rank == 0:
                try:             # list the table for ncclpy status (one add, one set)
                    from .status import register
                    register(self._store, self.comm.name, self.group, self.comm.world_size)
                except Exception as e:  # noqa: BLE001 - the status is a view, not a duty
                    log.debug("watchdog: could not register for ncclpy status: %s", e)
            self._heart = Heart(
                self._store, self.group, self.comm.rank, self.comm.world_size,
                stale_after=report_after(self.state.dead_after, self.interval),
                on_time=on_time_limit(self.interval),
                call_timeout=max(self.interval, 1.0), watch=_deaths.EPOCH_KEY,
                what=f"watchdog of {self.comm.name!r} rank {self.comm.rank}", clock=self.clock)
        else:
            log.info("watchdog of %r: the store has no heartbeat table (torch's store?): "
                     "heartbeats as keys, %d reads per beat", self.comm.name,
                     self.comm.world_size - 1)

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
        while not self._stop.wait(self.tick):
            now = self.clock()
            try:
                self.drain(now)
                if now >= self._next_beat:
                    self._next_beat = now + self.interval
                    self.beat(now)
                d = self.decide(now, self.dead())
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
