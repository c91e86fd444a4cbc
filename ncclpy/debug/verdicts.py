"""The watchdog's verdicts, pure: what this rank knows -> abort (and why), confirm first, or nothing.

The rule (docs/reference/concepts/hangs.rst, "What the watchdog aborts for"):

* a **death** aborts at once, whatever this rank is doing: the launcher's notice that a rank
  died (:mod:`ncclpy.debug.deaths`: ``ncclpy run`` saw its process exit, or its node's
  launcher stopped answering), or an NCCL error whose text says which peers died
  (:func:`died_text`: ncclpy's CPU backend saw their processes end), which suspects them alone;
* an NCCL error whose text says it is this rank's own failure (:data:`LOCAL`, e.g. the CPU
  backend's /dev/shm full) aborts at once and suspects no peer;
* a peer's **published abort** -- a communicator one member aborted can complete no call any
  more -- is followed, with that verdict's cause and suspects, as soon as this rank has a call
  in flight on it (at once if one is; an idle communicator is left alone: NCCL may share its
  resources with a child of a split or shrink that is still in use), instead of taking the
  aborted rank's silence for a new cause (no cascade);
* **silence** (a peer's heartbeat older than ``dead_after``) names a suspect only while this
  rank has a call that waits on that peer -- unfinished, or still blocked inside NCCL on the
  host -- and has waited longer than ``dead_after`` (or NCCL reported an error to a wait), and
  only once a fresh read of the table confirms it (:data:`CONFIRM`): a silence extrapolated from
  an older reply is never a verdict, and the verdict states the silence the store measured.
  A rank paused (a debugger, a long computation holding the GIL, swap, a checkpoint) while
  nobody waits on it is never named, however long the pause;
* an NCCL **error** a wait read: once the heartbeats had ``dead_after`` + ``interval`` to name
  the peer behind it, every peer is suspected;
* the oldest call past the communicator's **timeout**: its suspects are the peers that have not
  issued it yet (from their progress counters), else every peer.

A call waits on every peer, except a plan made of sends and receives only, which waits on its
peers (:func:`waits_on`).  ``ncclpy status`` shows silent ranks at any time; only the watchdog
of a waiting rank acts on them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["Peer", "Decision", "Published", "WatchState", "CONFIRM", "report_after",
           "peers_from_beat", "waits_on", "ranks_text", "carried_out", "died_text",
           "LOCAL", "known_from_error"]

#: what :meth:`WatchState.step` returns when a silence would be a verdict: read the table once
#: more (fresh ages), then step again with ``confirmed=True``
CONFIRM = "confirm"
_CAUSE_MAX = 400
#: what an NCCL error's text says of a failure that is this rank's own (no peer suspected)
LOCAL = "a failure of this rank's own, no peer is at fault"
_DIED = re.compile(r"\brank\(s\) (\d+(?:, \d+)*) died\b")


def died_text(ranks: Iterable[int]) -> str:
    """How an NCCL error's text names peers known dead for certain (their processes ended):
    ``"rank(s) 0, 2 died"``; :func:`known_from_error` reads it back."""
    return f"rank(s) {', '.join(str(int(r)) for r in sorted(ranks))} died"


def known_from_error(text: str) -> Tuple[Tuple[int, ...], bool]:
    """What an NCCL error's text says for certain: the ranks it names dead (:func:`died_text`),
    and whether the failure is this rank's own (:data:`LOCAL`)."""
    m = _DIED.search(text)
    dead = tuple(int(r) for r in m.group(1).split(", ")) if m else ()
    return dead, LOCAL in text


@dataclass
class Peer:
    """What this rank knows of a peer: local time its heartbeat last changed (None: never
    seen), calls it has issued on the communicator, and whether it closed it."""

    seen: Optional[float] = None
    issued: int = 0
    closed: bool = False


@dataclass(frozen=True)
class Decision:
    """Abort the communicator: ``reason`` ("peer_dead", "peer_aborted", "peer_silent",
    "nccl_error", "timeout"), the oldest unfinished call (``collective``, ``seq``; "" and -1
    when none), ``suspects`` and the message every blocked call raises."""

    reason: str
    collective: str
    seq: int
    suspects: Tuple[int, ...]
    message: str = field(compare=False)


@dataclass(frozen=True)
class Published:
    """A verdict a rank published in the heartbeat table when it aborted: who aborted,
    ``reason`` (a :class:`Decision`'s, or "abort": ``comm.abort()``), its ``suspects`` and
    ``cause`` (one line)."""

    rank: int
    reason: str
    suspects: Tuple[int, ...]
    cause: str

    def encode(self) -> bytes:
        return json.dumps({"rank": self.rank, "reason": self.reason,
                           "suspects": list(self.suspects),
                           "cause": self.cause[:_CAUSE_MAX]}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Optional["Published"]:
        """The verdict in a table value (after its progress line), None when there is none."""
        _, sep, tail = raw.partition(b"\n")
        if not sep:
            return None
        try:
            d = json.loads(tail)
            return cls(int(d["rank"]), str(d["reason"]),
                       tuple(int(r) for r in d["suspects"]), str(d["cause"]))
        except (ValueError, KeyError, TypeError):
            return None


Pending = Tuple[Any, ...]   # (seq, collective, first seen[, waits_on])


def waits_on(plan: Any) -> Optional[FrozenSet[int]]:
    """The peers a call of ``plan`` waits on: those of its sends and receives when it makes
    nothing else, else None (every peer: a collective)."""
    calls = getattr(plan, "calls", None)
    if not calls:
        return None
    peers = set()
    for c in calls:
        if c.fn not in ("Send", "Recv"):
            return None
        peers.add(int(c.args[3]))
    return frozenset(peers)


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

    def published(self, d: Decision) -> Published:
        """What this rank publishes of its verdict ``d``: the reason, the suspects and the
        cause (the message without its head and its "suspected: ..." tail)."""
        cause = d.message
        head = self._head() + ": "
        if cause.startswith(head):
            cause = cause[len(head):]
        cause = cause.split("; suspected:", 1)[0]
        return Published(self.rank, d.reason, tuple(d.suspects), cause)

    def step(self, now: float, pending: Sequence[Pending], peers: Mapping[int, Peer],
             dead: Iterable[int] = (), nccl_error: Optional[Tuple[str, float]] = None,
             interval: float = 1.0, blocked: Optional[Pending] = None,
             aborted: Optional[Published] = None, confirmed: bool = False,
             behind: Optional[Mapping[int, int]] = None, silence: bool = True,
             issued_known: bool = True) -> Union[Decision, str, None]:
        """``pending``: unfinished calls oldest first as (seq, collective, first seen[, the
        peers it waits on or None]); ``peers``: rank -> :class:`Peer` (the suspicious ones:
        a fresh peer needs no entry); ``dead``: ranks the
        launcher published as dead; ``nccl_error``: (its text, when it was reported; a text that
        names dead peers or says the failure is this rank's own decides at once:
        :func:`known_from_error`);
        ``interval``: the heartbeat period; ``blocked``: the call still inside NCCL on the
        host, like a pending one; ``aborted``: a peer's published abort; ``confirmed``: the
        peers' ages were just read afresh; ``behind``: rank -> calls issued of the peers that
        have not issued the oldest call (read once on the way to a timeout; default: the
        ``issued`` of ``peers``); ``silence``: False when a confirmation could not be read
        (the store was late: no silence is judged, the other rules are); ``issued_known``:
        False when nobody could say which peers issued the call (a timeout then suspects
        every peer, saying so).  Returns a :class:`Decision`, :data:`CONFIRM`
        (a silence would be a verdict: read the table and step again, confirmed) or None."""
        in_call = False
        head: Optional[Pending] = pending[0] if pending else None
        if blocked is not None and (head is None or blocked[2] < head[2]):
            in_call, head = True, blocked
        if head is not None:
            seq, coll, since = head[0], head[1], head[2]
            on = head[3] if len(head) > 3 else None
            what = (f"{coll} (sequence {seq}, blocked inside NCCL for {now - since:.1f} s)"
                    if in_call else f"{coll} (sequence {seq}, in flight for {now - since:.1f} s)")
        else:
            seq, coll, since, on, what = -1, "", now, None, "no call in flight"
        if nccl_error is not None:
            what += f", after NCCL reported: {nccl_error[0]}"
        tail = "; the communicator was aborted (ncclCommAbort)"
        said, local = known_from_error(nccl_error[0]) if nccl_error is not None else ((), False)
        said = sorted(set(said) - set(dead) - {self.rank})
        dead = sorted(set(dead) - {self.rank})
        if dead or said:
            how = "; ".join(([f"rank(s) {ranks_text(dead)}: the launcher says so"] if dead else [])
                            + ([f"rank(s) {ranks_text(said)}: the process ended, seen on "
                                f"this machine"] if said else []))
            both = sorted(set(dead) | set(said))
            if not said or not dead:
                how = how.split(": ", 1)[1]
            return Decision("peer_dead", coll, seq, tuple(both),
                            f"{self._head()}: rank(s) {ranks_text(both)} died ({how}) while "
                            f"{what}; suspected: rank(s) {ranks_text(both)}{tail}")
        if local:
            return Decision("nccl_error", coll, seq, (),
                            f"{self._head()}: {what}; no peer is suspected{tail}")
        if aborted is not None and aborted.rank != self.rank and \
                (head is not None or nccl_error is not None):
            sus = tuple(sorted(aborted.suspects)) or (aborted.rank,)
            return Decision("peer_aborted", coll, seq, sus,
                            f"{self._head()}: rank {aborted.rank} aborted the communicator "
                            f"({aborted.reason}: {aborted.cause}) while this rank had {what}; "
                            f"no call on it can complete; suspected: rank(s) "
                            f"{ranks_text(sus)}{tail}")
        waited = now - since if head is not None else 0.0
        if silence and (waited > self.dead_after or nccl_error is not None):
            silent = self._silent(now, peers, on)
            if silent:
                if not confirmed:
                    return CONFIRM
                ranks = [r for r, _, _ in silent]
                how = ", ".join(f"rank {r} " + (f"never sent one in {age:.1f} s" if never
                                                else f"silent {age:.1f} s")
                                for r, age, never in silent[:8])
                if len(silent) > 8:
                    how += f", and {len(silent) - 8} more"
                return Decision("peer_silent", coll, seq, tuple(ranks),
                                f"{self._head()}: no heartbeat for more than "
                                f"{self.dead_after:g} s from rank(s) {ranks_text(ranks)} ({how}, "
                                f"read afresh from the store; dead or hung) while {what}, "
                                f"which waits on it; suspected: rank(s) {ranks_text(ranks)}"
                                f"{tail}")
        if nccl_error is not None and now - nccl_error[1] > self.dead_after + interval:
            others = [r for r in range(self.world_size) if r != self.rank]
            return Decision("nccl_error", coll, seq, tuple(others),
                            f"{self._head()}: {what}; every peer's heartbeat is still fresh, so "
                            f"none is singled out; suspected: every peer ({ranks_text(others)})"
                            f"{tail}")
        if head is not None and waited > self.timeout:
            counts = behind if behind is not None else {r: p.issued for r, p in peers.items()}
            late = sorted(r for r, n in counts.items() if r != self.rank and n <= seq
                          and (on is None or r in on))
            others = [r for r in range(self.world_size) if r != self.rank and
                      (on is None or r in on)]
            if not issued_known and behind is None:
                late = others
                sus = (f"every peer ({ranks_text(others)}): the store did not say in time "
                       f"which ranks issued it")
            elif late:
                why = ", ".join(f"rank {r} issued {counts[r]}" for r in late[:8])
                sus = f"rank(s) {ranks_text(late)}, which never issued it ({why} calls)"
            else:
                late = others
                sus = (f"every peer ({ranks_text(others)}): all issued it, none is known dead"
                       if on is None else f"its peer(s) {ranks_text(others)}")
            how = ("was still blocked inside its NCCL call on the host (the launch never "
                   "returned: a peer never made the matching call, e.g. a send/recv's first "
                   "use, which connects the pair) after" if in_call
                   else "did not complete within")
            return Decision("timeout", coll, seq, tuple(late),
                            f"{self._head()}: {coll} (sequence {seq}) {how} the communicator's "
                            f"timeout of {self.timeout:g} s; suspected: {sus}{tail}")
        return None

    def _silent(self, now: float, peers: Mapping[int, Peer],
                on: Optional[FrozenSet[int]]) -> List[Tuple[int, float, bool]]:
        """(rank, silence, never beat) of the peers the call waits on past their limit."""
        out = []
        for r, p in sorted(peers.items()):
            if r == self.rank or p.closed or (on is not None and r not in on):
                continue
            last = self.start if p.seen is None else p.seen
            if now - last > (self.dead_after if p.seen is not None else self.never_grace):
                out.append((r, now - last, p.seen is None))
        return out


def report_after(dead_after: float, interval: float) -> float:
    """The age past which the store lists a peer in a beat's reply: one interval before the
    silence limit, so that the thread's ticks see it coming and confirm it the moment it
    passes ``dead_after`` (not up to an interval later, at the next beat)."""
    return max(dead_after - interval, interval)


def peers_from_beat(rep: Any, at: float, rank: int, never_due: bool) -> dict:
    """The peers to judge after an on-time BEAT reply ``rep`` that arrived at ``at`` (local
    clock: a round trip never adds to a silence): the listed stale ones (seen ``age`` ago on
    the store's clock) and, once the start-up grace is over (``never_due``), the listed ones
    that never beat; the others are fresh and need no entry.  A reply lists at most
    :data:`~ncclpy.store.tablewire.MAX_LISTED` of each, the oldest: a verdict names those."""
    peers = {r: Peer(seen=at - age) for r, age in rep.stale if r != rank}
    if never_due:
        peers.update((r, Peer()) for r in rep.never_listed if r != rank)
    return peers


def ranks_text(rs: Sequence[int], most: int = 32) -> str:
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


def carried_out(message: str, revoke: bool) -> str:
    """A verdict's message as carried out: with ``on_failure = "revoke"`` the communicator is
    revoked (its handle kept for shrink), not aborted -- the log and the error say so alike."""
    if not revoke:
        return message
    return message.replace("was aborted (ncclCommAbort)",
                           "was revoked (ncclCommRevoke; on_failure='revoke'): shrink it to "
                           "the survivors (comm.shrink(exclude=err.suspects)), or close it")
