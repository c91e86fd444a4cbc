"""The watchdog's heartbeats: publish this rank's, read its peers'.

:class:`HeartbeatMixin` is the part of :class:`ncclpy.debug.watchdog.Watchdog` that talks to
the store: connecting (the heartbeat table of :mod:`ncclpy.debug.heartbeat` where the store
serves it, else the older per-key heartbeats of :func:`heartbeat_key`), one beat per interval
(this rank's progress, :mod:`ncclpy.debug.status`), the fresh read a silence asks for
(:meth:`HeartbeatMixin.confirm`), the BEAT_BEHIND read on the way to a timeout, the dead
ranks, and leaving the table (closed, or an abort published for the peers to follow).  It is
kept apart from the thread, its hand-over to the reaper and its rule so that each file stays
readable; it holds no state of its own (:class:`~ncclpy.debug.watchdog.Watchdog` sets every
attribute it reads) and never imports the watchdog module (imports point down).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

from . import deaths as _deaths
from .heartbeat import Heart, on_time_limit
from .verdicts import Peer, Published, WatchState, peers_from_beat, report_after

__all__ = ["HeartbeatMixin", "heartbeat_key"]

#: the watchdog's logger (its records keep the name they always had)
log = logging.getLogger("ncclpy.debug.watchdog")


def heartbeat_key(group: str, rank: int) -> str:
    """A rank's heartbeat key on a store without the table (torch's): under its table's group,
    which carries the bootstrap generation (a verdict left by an earlier communicator of the
    same name is never read as this one's)."""
    return f"{group}/{rank}"


class HeartbeatMixin:
    """The heartbeats of a :class:`~ncclpy.debug.watchdog.Watchdog` (see the module
    docstring): every attribute below is set by the watchdog's ``__init__``."""

    comm: Any
    clock: Callable[[], float]
    interval: float
    state: WatchState
    group: str
    _store: Any
    _client: Any
    _heart: Optional[Heart]
    peers: Dict[int, Peer]
    _raw: Dict[int, bytes]
    _epoch: int
    _dead: List[int]
    published: Optional[Published]
    _behind: Optional[Tuple[int, Dict[int, int]]]
    _confirm_ok: bool
    confirms: int
    pending: List[Any]
    issued: int
    blind: int
    _beat: int
    _last: Any
    _last_rec: Optional[list]
    _last_work: Any
    _left: bool

    if TYPE_CHECKING:   # the watchdog's own (the call being waited on), read by progress()
        def head(self) -> Optional[Tuple[int, Any, float]]: ...

        def blocked(self, now: float) -> Optional[Tuple[Any, ...]]: ...

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
                    register(self._store, self.comm.name, self.group, self.comm.world_size,
                             self.state.dead_after)
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

    def publish(self, verdict: Published) -> Optional[Published]:
        """Publish this rank's abort in the heartbeat table (once): peers follow it instead of
        taking this rank's silence for a new verdict.  Returns the verdict another rank
        published first, if one did (the table keeps the first: every rank then reports its
        suspects, so that survivors agree, e.g. on whom a shrink excludes)."""
        value = self.progress(self.clock()) + b"\n" + verdict.encode()
        if self._heart is None:       # per-key heartbeats: the key says closed, and why
            value = b"closed\n" + verdict.encode()
        rep = self._leave(value, aborted=True)
        first = getattr(rep, "first_aborted", None)
        if first is None or first[0] == self.comm.rank:
            return None
        return Published.decode(first[1])

    def _leave(self, value: bytes, aborted: bool) -> Any:
        if self._left or self._client is None:
            return None
        self._left = True
        if self._heart is not None:
            return self._heart.close(value, aborted=aborted, count=self.issued)
        try:
            self._client.set(heartbeat_key(self.group, self.comm.rank), value)
        except Exception:
            log.debug("watchdog: could not publish the close", exc_info=True)
        return None

    def beat(self, now: float) -> None:
        """Publish this rank's heartbeat; learn of stale, never-seen, aborted and dead peers."""
        c = self._client
        if c is None:
            return
        self._beat += 1
        value = self.progress(now)
        if self._heart is None:
            self._beat_keys(c, now, value)
            return
        rep = self._heart.beat(value, count=self.issued)
        if rep is None:              # late: judge nobody from it, forget older suspicions
            self.peers = {}
            return
        self._confirm_ok = True
        self._heard(rep)

    def confirm(self) -> bool:
        """Read the table afresh (a peek): the peers' ages now.  False when the store was late
        (no verdict from it; no other confirmation until the next on-time beat)."""
        self.confirms += 1
        if self._heart is None:
            return self._confirm_keys()
        rep = self._heart.peek()
        if rep is None:
            self._confirm_ok = False
            return False
        self._heard(rep)
        return True

    def _heard(self, rep: Any) -> None:
        """What an on-time reply says: the death epoch, a published abort, the stale peers."""
        if rep.epoch != self._epoch:
            self._epoch = rep.epoch
            self._read_dead(self._client)
        if rep.first_aborted is not None and self.published is None:
            r, raw = rep.first_aborted
            if r != self.comm.rank:
                self.published = Published.decode(raw) or Published(
                    r, "abort", (r,), "its verdict could not be read")
        at = self._heart.replied_at if self._heart is not None else self.clock()
        self.peers = peers_from_beat(rep, at, self.comm.rank,
                                     at - self.state.start > self.state.never_grace)

    def progress(self, now: float) -> bytes:
        """This rank's heartbeat value: its progress (:mod:`ncclpy.debug.status`)."""
        from .recorder import installed_signal, site_text
        from .status import Progress, encode
        h = self._heart
        p = Progress(self._beat, self.issued, self.issued - len(self.pending),
                     signal=installed_signal(), late=h.late if h else 0,
                     refused=h.errors if h else 0, blind=self.blind)
        h = self.head()
        if h is not None:
            p.wait = max(now - h[2], 0.0)
        rec = getattr(self.comm, "_recorder", None)
        blk = self.blocked(now)
        stuck = blk is not None and now > blk[2]  # inside since an earlier tick: blocked there
        # shown: the call blocked inside NCCL (the newest recorded), else the last one issued
        # (numbered issued - 1: never a newer one in checked mode's compare, or refused)
        e = (rec.last() if rec is not None else None) if stuck else self._last_entry(rec)
        if e is not None:
            p.call, p.site = e[1].plan.collective, site_text(e[2], e[3]) or ""
        elif self._last is not None:
            p.call = getattr(self._last, "collective", "?")
        if stuck:
            p.blocked, p.wait = True, max(p.wait, now - blk[2])
            if e is None or e[1].plan.collective != blk[1]:  # no recorder entry for it
                p.call, p.site = blk[1], ""
        return encode(p)

    def _last_entry(self, rec: Any) -> Optional[list]:
        """The recorder entry of the last Work drained (its call path attaches it just after
        the Work was handed over: looked up again until then)."""
        if rec is None or self._last is None:
            return None
        if self._last_rec is None and self._last_work is not None:
            w = self._last_work()
            self._last_rec = getattr(w, "_rec", None)
            if self._last_rec is not None or w is None:
                self._last_work = None
        return self._last_rec if self._last_rec is not None else rec.last()

    def read_behind(self, seq: int) -> bool:
        """Ask once who has not issued call ``seq`` (one BEAT_BEHIND peek: O(listed)); False
        when the store was late."""
        if self._heart is None:
            return False
        rep = self._heart.behind(seq)
        if rep is None or rep.behind is None:
            return False
        counts = {r: n for r, n in rep.behind if r != self.comm.rank}
        counts.update((r, 0) for r in rep.never_listed if r != self.comm.rank)  # never beat
        self._behind = (seq, counts)
        return True

    def _read_dead(self, c: Any) -> None:
        try:
            self._dead = sorted(_deaths.read_deaths(c))
        except Exception as e:
            self._epoch = -1         # read it again at the next beat
            log.debug("watchdog: could not read the dead ranks: %s", e)

    def _beat_keys(self, c: Any, now: float, value: bytes) -> None:
        """Heartbeats as keys, for a store without the table (torch's): N-1 reads per beat."""
        c.set(heartbeat_key(self.group, self.comm.rank), value)
        if not self.peers:
            self.peers = {r: Peer() for r in range(self.comm.world_size) if r != self.comm.rank}
        self._read_keys(c, now, list(self.peers))
        try:
            epoch = _deaths.read_epoch(c)
        except Exception:
            return
        if epoch != self._epoch:
            self._epoch = epoch
            self._read_dead(c)

    def _read_keys(self, c: Any, now: float, ranks: Iterable[int]) -> bool:
        """Read the ranks' keys; False when a read failed (no news of that rank)."""
        ok = True
        for r in ranks:
            peer = self.peers[r]
            try:
                raw = c.get(heartbeat_key(self.group, r), timeout=0.05)
            except Exception:
                ok = False
                continue            # not yet written, or a slow read: no news
            if raw.startswith(b"closed"):
                peer.closed = True
                pub = Published.decode(raw)
                if pub is not None and self.published is None:
                    self.published = pub
            elif raw != self._raw.get(r):
                self._raw[r] = raw
                peer.seen = now
                try:
                    peer.issued = int(raw.split(b":")[1])
                except (IndexError, ValueError):
                    pass
        return ok

    def _confirm_keys(self) -> bool:
        """Per-key heartbeats: read the suspects' keys again (a changed value is a beat)."""
        c = self._client
        if c is None:
            return False
        now = self.clock()
        return self._read_keys(c, now, [r for r, p in self.peers.items() if not p.closed])

    def dead(self) -> List[int]:
        """Ranks the launcher published as dead."""
        return [r for r in self._dead if r != self.comm.rank and 0 <= r < self.comm.world_size]
