"""A process hosting ranks ``first .. last-1`` of a ``world``-rank job: each rank the real
:class:`ncclpy.watchdog.Watchdog` thread with every default (1 s beat, 0.1 s tick, 3 s silence
limit, 300 s timeout) over its own real ``TCPStore`` client, with a stand-in communicator (no
NCCL: the decisions and the heartbeat table are what is under test).

Run as ``python tests/watchdog_crowd.py PORT WORLD FIRST LAST``.  It prints ``up`` once every
rank's watchdog runs, then one JSON line per verdict (``rank``, ``reason``, ``suspects``,
``message``, ``t``: wall clock).  Commands on stdin, one per line: ``wait`` -- every rank issues
a call that waits (its Work never completes until ``done``); ``done`` -- those calls complete;
``quit``.  Used by tests/test_watchdog_pauses.py and ``python -m bench.scale --pauses``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ncclpy.store import TCPStore  # noqa: E402
from ncclpy.debug.watchdog import Watchdog  # noqa: E402

_OUT = threading.Lock()


class Work:
    """A call in flight: completes when the crowd is told ``done``."""

    _owned, _error = False, None
    _event = object()                 # recorded: the watchdog times it
    plan = type("Plan", (), {"collective": "all_reduce", "calls": ()})()

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def _reap(self, raising: bool = False) -> bool:
        """The watchdog's look (as for a real Work: True once complete)."""
        return self.done


class Comm:
    """What the Watchdog needs of a communicator; a verdict is printed, as the real one
    aborts (the watchdog published it in the table first)."""

    name, _device, _watch, _timeout = "crowd", 0, None, 300.0

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def _watchdog_abort(self, d: Any) -> None:
        line = json.dumps({"rank": self.rank, "reason": d.reason, "suspects": list(d.suspects),
                           "message": d.message, "t": time.time()})
        with _OUT:
            print(line, flush=True)


def main(port: int, world: int, first: int, last: int) -> None:
    dogs: List[Watchdog] = []
    for r in range(first, last):
        store = TCPStore("127.0.0.1", port, timeout=60)
        dogs.append(Watchdog(Comm(r, world), store).start())
    with _OUT:
        print("up", flush=True)
    works: List[Work] = []
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "wait":
            works = [Work() for _ in dogs]
            for wd, w in zip(dogs, works):
                q = wd.queue
                if q is not None:
                    q.append(w)
        elif cmd == "done":
            for w in works:
                w.done = True
        else:
            break
    for wd in dogs:
        wd._stop.set()               # every thread ends at once, then each leaves the table
    for wd in dogs:
        wd.stop(closed=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]))
