"""One member's side of a heartbeat table held by ncclpy's store (the watchdog's, nodewatch's).

Every period a member sends one BEAT (:mod:`ncclpy.store.tablewire`): its own beat, value and
progress counter in, the members whose last beat is older than ``stale_after`` (server clock),
the members that never beat, the first member that aborted and the death epoch out: one request
per member per period, whatever the world size.

The rule that keeps a slow store from being taken for dead peers: a reply that took longer than
``on_time`` seconds is *late*; :meth:`Heart.beat` then returns None (no member is judged from
it) and the slowness is logged with its figures, at most once a minute (plus a count).  Ages in a
reply that came on time are the server's, and the server's clock does not run while its loop
is stalled, so they are the members' own silence; they are taken as of :attr:`Heart.replied_at`
(the local clock once the reply arrived), so a round trip never adds to anyone's silence.

A request the store *refuses* (a table of another size, a malformed reply) is not slowness: it
is counted in :attr:`Heart.errors` and logged as an error with the store's words (again at most
once a minute), and judges nobody.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from ..store import tablewire as W

__all__ = ["Heart", "Throttle", "SLOW_LOG_EVERY", "on_time_limit", "is_late", "is_refusal"]

log = logging.getLogger(__name__)

#: seconds between two "store slow" warnings of one member (the ones between are counted)
SLOW_LOG_EVERY = 60.0


def on_time_limit(interval: float) -> float:
    """How long a heartbeat's reply may take and still be judged: one interval (at least
    0.25 s)."""
    return max(float(interval), 0.25)


def is_late(rtt: float, on_time: float) -> bool:
    """A reply that took longer than ``on_time`` judges nobody."""
    return rtt > on_time


def is_refusal(e: BaseException) -> bool:
    """An error of the request itself (the store answered: refused, or answered nonsense), as
    opposed to a slow or lost store (timeout, connection)."""
    from ..errors import StoreAuthError, StoreProtocolError, StoreRequestError
    return isinstance(e, (StoreRequestError, StoreProtocolError, StoreAuthError, ValueError))


class Throttle:
    """A repeated condition said at most once per ``every`` seconds: :meth:`due` counts one
    occurrence and returns how many were kept quiet since the last line said (None: keep this
    one quiet too)."""

    def __init__(self, every: float, clock: Callable[[], float]) -> None:
        self.every, self.clock = every, clock
        self._said: Optional[float] = None
        self._quiet = 0

    def due(self) -> Optional[int]:
        now = self.clock()
        if self._said is not None and now - self._said < self.every:
            self._quiet += 1
            return None
        quiet, self._said, self._quiet = self._quiet, now, 0
        return quiet


class Heart:
    """``store``: ncclpy's TCPStore (serving the tables); ``group`` names the table of ``world``
    members; ``what`` names this member in log lines ("watchdog of 'job' rank 3")."""

    def __init__(self, store: Any, group: str, rank: int, world: int, *, stale_after: float,
                 on_time: float, call_timeout: float, watch: str = "", what: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.group, self.rank, self.world = store, group, rank, world
        self.stale_after, self.on_time = float(stale_after), float(on_time)
        self.call_timeout, self.watch, self.what, self.clock = call_timeout, watch, what, clock
        self.late = 0                 # late replies (and lost calls) since the start
        self.errors = 0               # requests the store refused since the start
        self.last_error = ""
        self.last_rtt = 0.0
        self.worst_rtt = 0.0
        self.replied_at = 0.0         # local clock when the last on-time reply arrived
        self._slow_said = Throttle(SLOW_LOG_EVERY, clock)
        self._refused_said = Throttle(SLOW_LOG_EVERY, clock)

    def beat(self, value: bytes, flags: int = 0, count: int = 0) -> Optional[W.BeatReply]:
        """One BEAT; its reply when it came on time, else None (store slow, or the request
        refused: logged and counted)."""
        t0 = self.clock()
        try:
            rep = self.store.beat(self.group, self.rank, self.world, self.stale_after, value,
                                  watch=self.watch, flags=flags, timeout=self.call_timeout,
                                  count=count)
        except Exception as e:   # a slow or lost store: no news, never a verdict
            if is_refusal(e):
                self._refused(e)
            else:
                self._slow(self.clock() - t0, f"{type(e).__name__}: {e}")
            return None
        t1 = self.clock()
        rtt = self.last_rtt = t1 - t0
        self.worst_rtt = max(self.worst_rtt, rtt)
        if is_late(rtt, self.on_time):
            self._slow(rtt, "")
            return None
        self.replied_at = t1
        return rep

    def peek(self) -> Optional[W.BeatReply]:
        """The table as it is now (a read, not a beat): a confirmation before a verdict."""
        return self.beat(b"", W.BEAT_PEEK)

    def behind(self, count: int) -> Optional[W.BeatReply]:
        """The members whose progress counter is at most ``count`` (a peek)."""
        return self.beat(b"", W.BEAT_PEEK | W.BEAT_BEHIND, count)

    def full(self) -> Optional[W.BeatReply]:
        """The whole table (a peek: not a beat; O(world): ``ncclpy status``'s read)."""
        return self.beat(b"", W.BEAT_PEEK | W.BEAT_FULL)

    def close(self, value: bytes = b"closed", aborted: bool = False,
              count: int = 0) -> Optional[W.BeatReply]:
        """Leave the table: this member is never stale again (best effort); ``aborted``: it
        aborted, ``value`` saying why (peers follow that verdict); ``count``: its progress
        counter.  The reply (which names the first member that aborted), None when it failed."""
        flags = W.BEAT_CLOSE | (W.BEAT_ABORT if aborted else 0)
        try:
            return self.store.beat(self.group, self.rank, self.world, self.stale_after, value,
                                   flags=flags, timeout=self.call_timeout, count=count)
        except Exception:
            log.debug("%s: could not publish the %s", self.what,
                      "abort" if aborted else "close", exc_info=True)
            return None

    def _refused(self, e: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}"
        quiet = self._refused_said.due()
        if quiet is None:
            return
        more = f" ({quiet} more since the last such line)" if quiet else ""
        log.error("%s: the store refused a heartbeat: %s%s; no peer is judged from it, and "
                  "until this is fixed this rank's heartbeats do not reach its peers",
                  self.what, self.last_error, more)

    def _slow(self, rtt: float, err: str) -> None:
        self.late += 1
        quiet = self._slow_said.due()
        if quiet is None:
            return
        more = f" ({quiet} more late since the last such line)" if quiet else ""
        log.warning("%s: store slow: a heartbeat to the store took %.2f s (on time: %.2f s)%s; "
                    "no peer is judged from a late reply%s", self.what, rtt, self.on_time,
                    f" and failed ({err})" if err else "", more)
