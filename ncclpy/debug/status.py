"""Where is everyone, now: each rank's progress, read from the watchdog's heartbeat table.

Every heartbeat (:mod:`ncclpy.watchdog`, one BEAT per rank per interval) carries the rank's
progress in its value -- no extra request::

    <beat>:<issued>:<done>:<wait_ms>:<signal>:<call>:<site>

``issued``: calls handed to NCCL; ``done``: of those, how many completed (as the watchdog saw);
``wait_ms``: how long the oldest unfinished one has been in flight; ``signal``: the signal that
makes the rank dump its flight recorder (0: none); ``call`` and ``site``: its last call and the
user's line that made it; a ``call`` starting with ``!`` is still blocked inside its NCCL call on
the host (a send whose peer never connects: the launch itself waits), ``wait_ms`` then how
long.  Rank 0 of each communicator registers its table once (``ncclpy/status/n``,
``ncclpy/status/<i>``: one add and one set per communicator), so ``ncclpy status`` and
``ncclpy run`` find every table with 1 + C reads and one FULL peek per table (C communicators):
O(C + N) bytes, never per-pair traffic.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["Progress", "RankRow", "encode", "decode", "register", "read_comms", "read_rows",
           "format_rows", "snapshot", "format_snapshot", "COUNT_KEY"]

log = logging.getLogger(__name__)

COUNT_KEY = "ncclpy/status/n"
_SITE_MAX = 160


@dataclass
class Progress:
    """One rank's progress as its heartbeat carries it."""

    beat: int = 0
    issued: int = 0
    done: int = 0
    wait: float = 0.0
    signal: int = 0
    call: str = ""
    site: str = ""
    blocked: bool = False


def encode(p: Progress) -> bytes:
    """The heartbeat value of ``p`` (the site shortened from the left to its last 160 chars)."""
    site = p.site if len(p.site) <= _SITE_MAX else "..." + p.site[-_SITE_MAX + 3:]
    return (f"{p.beat}:{p.issued}:{p.done}:{int(p.wait * 1000)}:{p.signal}:"
            f"{'!' if p.blocked else ''}{p.call.replace(':', '_')}:{site}").encode()


def decode(raw: bytes) -> Progress:
    """A heartbeat value back (an older ``<beat>:<issued>`` value gives what it has)."""
    parts = raw.decode("utf-8", "replace").split(":", 6)
    p = Progress()
    try:
        p.beat, p.issued = int(parts[0]), int(parts[1])
        if len(parts) >= 7:
            p.done, p.wait, p.signal = int(parts[2]), int(parts[3]) / 1000.0, int(parts[4])
            p.call, p.site = parts[5], parts[6]
            if p.call.startswith("!"):
                p.call, p.blocked = p.call[1:], True
    except (IndexError, ValueError):
        pass
    return p


def register(store: Any, name: str, group: str, world: int) -> None:
    """Rank 0 of a communicator: list its heartbeat table for ``ncclpy status``."""
    i = int(store.add(COUNT_KEY, 1))
    store.set(f"ncclpy/status/{i}", json.dumps({"comm": name, "group": group, "world": world}))


def read_comms(store: Any, timeout: float = 5.0) -> List[Dict[str, Any]]:
    """The communicators registered in ``store``, oldest first."""
    n = int(store.add(COUNT_KEY, 0))
    out = []
    for i in range(1, n + 1):
        try:
            out.append(json.loads(store.get(f"ncclpy/status/{i}", timeout=timeout)))
        except Exception as e:  # noqa: BLE001 - one lost entry, not the table
            log.debug("status: entry %d unreadable: %s", i, e)
    return out


@dataclass
class RankRow:
    """One rank in the table: heartbeat age (None: never beat), closed, and its progress."""

    rank: int
    age: Optional[float]
    closed: bool
    progress: Progress

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("progress"))
        return d


def read_rows(store: Any, comm: Dict[str, Any], timeout: float = 5.0) -> List[RankRow]:
    """Every rank of ``comm``'s table (one FULL peek)."""
    from ..store import tablewire as W
    rep = store.beat(comm["group"], 0, int(comm["world"]), 3600.0, b"",
                     flags=W.BEAT_PEEK | W.BEAT_FULL, timeout=timeout)
    rows = []
    for r, (age, closed, value) in enumerate(rep.full or ()):
        rows.append(RankRow(r, age, bool(closed), decode(value) if value else Progress()))
    return rows


def _laggard_key(row: RankRow) -> tuple:
    p = row.progress
    return (row.closed, row.age is not None, p.issued, p.done, -p.wait, row.rank)


def format_rows(comm: Dict[str, Any], rows: Sequence[RankRow], most: int = 64) -> List[str]:
    """One line per rank, laggards first (never seen, fewest calls issued, then completed)."""
    rows = sorted(rows, key=_laggard_key)
    top = max((r.progress.issued for r in rows), default=0)
    lines = [f"communicator {comm['comm']!r} ({comm['world']} ranks; laggards first; "
             f"most calls issued: {top})",
             f"  {'rank':>5}  {'issued':>7}  {'done':>7}  {'waiting':>8}  {'beat':>6}  "
             f"last call"]
    for row in rows[:most]:
        p = row.progress
        beat = ("never" if row.age is None else "closed" if row.closed
                else f"{row.age:.1f}s")
        wait = f"{p.wait:.1f}s" if p.issued > p.done or p.blocked else "-"
        if p.blocked:               # not issued yet: its launch has not returned
            last = f"#{p.issued} {p.call} BLOCKED inside NCCL on the host"
        else:
            last = f"#{p.issued - 1} {p.call}" if p.issued else "(no call yet)"
        last += f" at {p.site}" if p.site else ""
        lines.append(f"  {row.rank:>5}  {p.issued:>7}  {p.done:>7}  {wait:>8}  {beat:>6}  "
                     f"{last}")
    if len(rows) > most:
        lines.append(f"  ... {len(rows) - most} more ranks, ahead of those shown")
    return lines


def snapshot(store: Any, comm_name: Optional[str] = None,
             timeout: float = 5.0) -> List[Dict[str, Any]]:
    """``[{"comm": ..., "group": ..., "world": ..., "rows": [RankRow]}]`` of every registered
    communicator (or only those named ``comm_name``)."""
    out = []
    for c in read_comms(store, timeout):
        if comm_name is not None and c.get("comm") != comm_name:
            continue
        try:
            c["rows"] = read_rows(store, c, timeout)
        except Exception as e:  # noqa: BLE001 - said in the table
            c["rows"], c["error"] = [], f"{type(e).__name__}: {e}"
        out.append(c)
    return out


def format_snapshot(snap: Sequence[Dict[str, Any]]) -> str:
    """The status text of :func:`snapshot`'s result."""
    if not snap:
        return ("no communicator has registered its progress yet (none created, or every one "
                "runs without its watchdog: NCCLPY_WATCHDOG=0)")
    lines: List[str] = []
    for c in snap:
        if c.get("error"):
            lines.append(f"communicator {c['comm']!r}: its table could not be read: "
                         f"{c['error']}")
            continue
        lines.extend(format_rows(c, c["rows"]))
    return "\n".join(lines)
