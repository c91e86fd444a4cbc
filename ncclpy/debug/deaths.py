"""Death notices: how a launcher tells every rank's watchdog that ranks died, in O(1) per beat.

The notice is three things in the job's store: ``ncclpy/dead/<rank>`` (the reason, for a human
or a tool reading the store), the list ``ncclpy/dead/ranks`` ("3,7", appended with
compare-and-set so launchers of several nodes never lose each other's entries) and the counter
``ncclpy/dead/epoch``, bumped after the list is written.  A watchdog reads the epoch with every
heartbeat (it rides in the BEAT reply: no extra request) and reads the list only when the epoch
moved: one request per death event per rank, instead of N-1 key checks per rank per beat.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Set

__all__ = ["EPOCH_KEY", "RANKS_KEY", "dead_key", "publish_deaths", "read_deaths", "read_epoch"]

log = logging.getLogger(__name__)

EPOCH_KEY = "ncclpy/dead/epoch"
RANKS_KEY = "ncclpy/dead/ranks"
_CAS_TRIES = 64


def dead_key(rank: int) -> str:
    """The key holding why ``rank`` died."""
    return f"ncclpy/dead/{rank}"


def _parse(raw: bytes) -> Set[int]:
    out = set()
    for part in raw.decode("ascii", "replace").split(","):
        part = part.strip()
        if part.isdigit():
            out.add(int(part))
    return out


def publish_deaths(store: Any, ranks: Iterable[int], why: str) -> None:
    """Publish that ``ranks`` died (``why``: one line); raises the store's error when it cannot."""
    ranks = sorted(set(int(r) for r in ranks))
    for r in ranks:
        store.set(dead_key(r), why)
    cur = b""
    for _ in range(_CAS_TRIES):
        new = ",".join(map(str, sorted(_parse(cur) | set(ranks)))).encode()
        got = store.compare_set(RANKS_KEY, cur, new)
        if got == new or set(ranks) <= _parse(got):
            break
        if got == cur:          # a torch-style reply for a missing key: start from empty
            cur = b""
            continue
        cur = got
    else:
        log.warning("deaths: could not append ranks %s to %s after %d tries", ranks, RANKS_KEY,
                    _CAS_TRIES)
    store.add(EPOCH_KEY, 1)


def read_deaths(store: Any) -> Set[int]:
    """The ranks published as dead (empty when none): one request on ncclpy's store."""
    if getattr(store, "supports_tables", False):    # ncclpy's: a get that never parks
        from ..errors import StoreTimeout
        try:
            return _parse(store.get(RANKS_KEY, timeout=0))
        except StoreTimeout:
            return set()
    if not store.check([RANKS_KEY]):
        return set()
    return _parse(store.get(RANKS_KEY, timeout=1.0))


def read_epoch(store: Any) -> int:
    """The death counter (0 when none died); for stores without the heartbeat table."""
    return int(store.add(EPOCH_KEY, 0))
