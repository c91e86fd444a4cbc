"""Rate-limited warnings for the store server: a flood of bad connections costs a few log lines.

Why: every bad connection (a malformed frame, a wrong token, an oversized request...) used to
log one warning, so a peer sending bad frames in a loop wrote about 1,700 lines a minute. Now
the first :data:`BURST` warnings of each kind from each client *host* (the port varies from one
connection to the next) in an interval of :data:`INTERVAL` seconds are logged in full; the rest
are counted, and once the interval is over one summary line gives the counts per kind (and how
many hosts sent them). Nothing is lost: logged + summarised is the true number of events.

The server owns one :class:`LogLimiter`; it runs on the server's thread only (no locking) and
asks the server's timer heap (``schedule``) to call :meth:`LogLimiter.flush_due` when an
interval with suppressed warnings ends, so the summary comes even when the flood has stopped.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional, Set, Tuple

__all__ = ["LogLimiter", "BURST", "INTERVAL", "MAX_TRACKED"]

#: warnings of one kind from one client host logged in full per interval
BURST = 5
#: seconds an interval lasts; one summary line per interval at most
INTERVAL = 10.0
#: (kind, host) pairs tracked per interval; past this, new hosts' warnings are only counted
MAX_TRACKED = 1024
_SHOWN_HOSTS = 4


def _host(peer: str) -> str:
    """The host part of ``"addr:port"`` (IPv6 addresses keep their colons)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class LogLimiter:
    """Logs the first ``burst`` warnings per (kind, client host) per ``interval`` seconds and
    counts the rest; :meth:`flush` writes one summary line for what it counted."""

    def __init__(self, logger: logging.Logger, burst: int = BURST, interval: float = INTERVAL,
                 schedule: Optional[Callable[[float], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.burst = max(int(burst), 0)
        self.interval = float(interval)
        self._schedule = schedule
        self._clock = clock
        self._start = 0.0
        self._end: Optional[float] = None          # the current interval's end; None: idle
        self._seen: Dict[Tuple[str, str], int] = {}
        self._suppressed: Dict[str, int] = {}      # kind -> warnings counted, not logged
        self._hosts: Dict[str, Set[str]] = {}      # kind -> hosts they came from (capped)
        self.total = 0                             # every warning, logged or not

    def warn(self, logger: Optional[logging.Logger], kind: str, peer: str, msg: str,
             *args: object, exc_info: bool = False, level: int = logging.WARNING) -> bool:
        """Log ``msg % args`` at ``level`` through ``logger`` (default: this limiter's) unless
        this (kind, host) has used up its burst for the interval; True when logged."""
        now = self._clock()
        self.total += 1
        if self._end is not None and now >= self._end:
            self.flush()
        if self._end is None:
            self._start, self._end = now, now + self.interval
        host = _host(peer)
        key = (kind, host)
        n = self._seen.get(key, 0)
        if n < self.burst and (n or len(self._seen) < MAX_TRACKED):
            self._seen[key] = n + 1
            if n + 1 == self.burst:
                msg += (" (more %s warnings from %s in the next %.0f s are counted and "
                        "summarised)")
                args = (*args, kind, host, self._end - now)
            (logger or self.log).log(level, msg, *args, exc_info=exc_info,
                                         stacklevel=2)
            return True
        if not self._suppressed and self._schedule is not None:
            self._schedule(self._end)
        self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
        hosts = self._hosts.setdefault(kind, set())
        if len(hosts) < MAX_TRACKED:
            hosts.add(host)
        return False

    @property
    def suppressed(self) -> int:
        """Warnings counted but not yet summarised."""
        return sum(self._suppressed.values())

    def flush_due(self) -> None:
        """Flush if the current interval is over (the server's timer calls this)."""
        if self._end is not None and self._clock() >= self._end:
            self.flush()

    def flush(self) -> None:
        """End the interval: one summary line for the warnings counted in it, if any."""
        counted, hosts = self._suppressed, self._hosts
        start = self._start
        self._end = None
        self._seen, self._suppressed, self._hosts = {}, {}, {}
        if not counted:
            return
        parts = []
        for kind, n in sorted(counted.items(), key=lambda kv: -kv[1]):
            names = sorted(hosts.get(kind, ()))
            shown = ", ".join(names[:_SHOWN_HOSTS])
            more = f" and {len(names) - _SHOWN_HOSTS} more" if len(names) > _SHOWN_HOSTS else ""
            parts.append(f"{kind}: {n} from {shown}{more}")
        self.log.warning("store server: %d more warnings in the last %.1f s were not logged one "
                         "by one (%s); the first %d per kind and client host in each %g s are",
                         sum(counted.values()), self._clock() - start, "; ".join(parts),
                         self.burst, self.interval)
