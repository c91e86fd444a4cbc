"""Where is everyone, now: each rank's progress, read from the watchdog's heartbeat table.

Every heartbeat (:mod:`ncclpy.watchdog`, one BEAT per rank per interval) carries the rank's
progress in its value -- no extra request::

    <beat>:<issued>:<done>:<wait_ms>:<signal>:<late>.<refused>.<blind>:<call>:<site>

``issued``: calls handed to NCCL; ``done``: of those, how many completed (as the watchdog saw);
``wait_ms``: how long the oldest unfinished one has been in flight; ``signal``: the signal that
makes the rank dump its flight recorder (0: none); ``late``, ``refused``, ``blind``: the
watchdog's own health (heartbeats whose reply came late, heartbeats the store refused, ticks
that failed: a watchdog that saw nothing); ``call`` and ``site``: its last call and the
user's line that made it; a ``call`` starting with ``!`` is still blocked inside its NCCL call on
the host (a send whose peer never connects: the launch itself waits), ``wait_ms`` then how
long.  A rank that aborted appends a line with its verdict (:class:`~ncclpy.debug.verdicts.
Published`).  Rank 0 of each communicator registers its table once (``ncclpy/status/n``,
``ncclpy/status/<i>``: one add and one set per communicator), so ``ncclpy status`` and
``ncclpy run`` find every table with 1 + C reads and one FULL peek per table (C communicators):
O(C + N) bytes, never per-pair traffic.  Ranks silent longer than the communicator's silence
limit are listed under the table: only a rank with a call waiting on them acts on it.
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
    late: int = 0
    refused: int = 0
    blind: int = 0


def encode(p: Progress) -> bytes:
    """The heartbeat value of ``p`` (the site shortened from the left to its last 160 chars)."""
    site = p.site if len(p.site) <= _SITE_MAX else "..." + p.site[-_SITE_MAX + 3:]
    return (f"{p.beat}:{p.issued}:{p.done}:{int(p.wait * 1000)}:{p.signal}:"
            f"{p.late}.{p.refused}.{p.blind}:"
            f"{'!' if p.blocked else ''}{p.call.replace(':', '_')}:{site}").encode()


def decode(raw: bytes) -> Progress:
    """A heartbeat value back (a bare ``<beat>:<issued>`` value gives what it has; a verdict
    line after it is not progress: :meth:`~ncclpy.debug.verdicts.Published.decode`)."""
    parts = raw.split(b"\n", 1)[0].decode("utf-8", "replace").split(":", 7)
    p = Progress()
    try:
        p.beat, p.issued = int(parts[0]), int(parts[1])
        if len(parts) >= 8:
            p.done, p.wait, p.signal = int(parts[2]), int(parts[3]) / 1000.0, int(parts[4])
            p.late, p.refused, p.blind = (int(x) for x in parts[5].split("."))
            p.call, p.site = parts[6], parts[7]
            if p.call.startswith("!"):
                p.call, p.blocked = p.call[1:], True
    except (IndexError, ValueError):
        pass
    return p


def register(store: Any, name: str, group: str, world: int, silence: float = 3.0) -> None:
    """Rank 0 of a communicator: list its heartbeat table (and its silence limit, seconds)
    for ``ncclpy status``."""
    i = int(store.add(COUNT_KEY, 1))
    store.set(f"ncclpy/status/{i}", json.dumps({"comm": name, "group": group, "world": world,
                                                 "silence": silence}))


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
    """One rank in the table: heartbeat age (None: never beat), closed, its progress, and
    the verdict it published when it aborted (``aborted``: its reason and cause, else "")."""

    rank: int
    age: Optional[float]
    closed: bool
    progress: Progress
    aborted: str = ""

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("progress"))
        return d


def read_rows(store: Any, comm: Dict[str, Any], timeout: float = 5.0) -> List[RankRow]:
    """Every rank of ``comm``'s table (one FULL peek)."""
    from ..store import tablewire as W
    from .verdicts import Published
    rep = store.beat(comm["group"], 0, int(comm["world"]), 3600.0, b"",
                     flags=W.BEAT_PEEK | W.BEAT_FULL, timeout=timeout)
    rows = []
    for r, (age, state, value) in enumerate(rep.full or ()):
        pub = Published.decode(value) if state & W.STATE_ABORTED else None
        why = "" if pub is None else f"{pub.reason}: {pub.cause}" + (
            f" (suspected: rank(s) {', '.join(map(str, pub.suspects))})" if pub.suspects else "")
        rows.append(RankRow(r, age, bool(state & W.STATE_CLOSED),
                            decode(value) if value else Progress(),
                            why or ("aborted" if state & W.STATE_ABORTED else "")))
    return rows


def _laggard_key(row: RankRow) -> tuple:
    p = row.progress
    return (row.closed, row.age is not None, p.issued, p.done, -p.wait, row.rank)


def format_rows(comm: Dict[str, Any], rows: Sequence[RankRow], most: int = 64) -> List[str]:
    """One line per rank, laggards first (never seen, fewest calls issued, then completed);
    then the ranks silent past the silence limit, those that aborted (with their verdict),
    and the watchdogs that are blind or whose store is slow."""
    rows = sorted(rows, key=_laggard_key)
    top = max((r.progress.issued for r in rows), default=0)
    lines = [f"communicator {comm['comm']!r} ({comm['world']} ranks; laggards first; "
             f"most calls issued: {top})",
             f"  {'rank':>5}  {'issued':>7}  {'done':>7}  {'waiting':>8}  {'beat':>6}  "
             f"last call"]
    for row in rows[:most]:
        p = row.progress
        beat = ("never" if row.age is None else "aborted" if row.aborted
                else "closed" if row.closed else f"{row.age:.1f}s")
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
    limit = float(comm.get("silence", 3.0))
    silent = [r for r in rows if not r.closed and r.age is not None and r.age > limit]
    if silent:
        lines.append(f"  silent for more than {limit:g} s: " + ", ".join(
            f"rank {r.rank} ({r.age:.1f} s)" for r in sorted(silent, key=lambda r: r.rank)[:16])
            + ("" if len(silent) <= 16 else f", and {len(silent) - 16} more")
            + " (a watchdog names a silent rank only while a call of its own waits on it)")
    for r in [r for r in rows if r.aborted][:8]:
        lines.append(f"  rank {r.rank} aborted: {r.aborted}")
    sick = [r for r in rows if r.progress.blind or r.progress.refused or r.progress.late]
    for r in sorted(sick, key=lambda r: r.rank)[:8]:
        p = r.progress
        lines.append(f"  rank {r.rank}'s watchdog: " + ", ".join(
            t for t in (f"{p.blind} tick(s) failed (blind meanwhile)" if p.blind else "",
                        f"{p.refused} heartbeat(s) refused by the store" if p.refused else "",
                        f"{p.late} heartbeat(s) late (store slow)" if p.late else "") if t))
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
