"""The reaper: releases the Works of communicators that have no watchdog.

Every Work goes to a tracker (``comm._watch``, a deque): the communicator's watchdog when it
has one, else this process's reaper.  The caller's thread only appends (one ``deque.append``
per call); the reaper's daemon thread, every :data:`TICK` seconds, queries the events of the
Works it holds -- in the thread-local stream-capture mode, so another thread's capture in the
global mode (torch.cuda.graph's default) is neither prohibited nor invalidated by it -- and
releases what completed (the buffers and scratch a call kept alive, its pooled event).  A Work
whose event was recorded in a capture is marked captured (:meth:`ncclpy.comm.work.Work._captured`).

Why a thread and not the next call: a sweep of dropped Works on the call path cost the caller
1-9 ``cudaEventQuery`` per call; the thread costs the caller nothing and releases within a
tick.  A query that fails proves nothing about the call: the Work stays held and is tried
again, and given up after :data:`GIVE_UP` consecutive failed looks at its lane (a broken CUDA
context), logged.  Each lane counts its own failures: another lane's successful look never
resets them, and failures of several lanes never add up to let a Work go early.  A lane
whose communicator is gone (nothing else refers to its deque) and which holds nothing is
dropped.
"""
from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from typing import Any, Deque, List, Optional

from .._nccl.cuda import cuda
from ..comm.work import release_done, take

__all__ = ["Reaper", "reaper", "TICK", "GIVE_UP", "BUSY"]

log = logging.getLogger(__name__)

#: seconds between two looks at the held Works
TICK = 0.1
#: consecutive failed looks at a lane after which its oldest Work (whose event cannot be
#: queried) is let go
GIVE_UP = 50
#: Works held at which the next look comes ten times sooner: a busy caller's Works are let go
#: young (before the garbage collector's oldest generation holds them and every full
#: collection walks them)
BUSY = 256


class _Lane(List[Any]):
    """One lane: ``[deque the call path appends to, list of the Works taken from it]`` (a
    list: ``q, pend = lane`` unpacks it), and ``failed``: the consecutive failed looks at its
    oldest Work (this lane's own count)."""

    __slots__ = ("failed",)

    def __init__(self, q: Deque[Any], pending: List[Any]) -> None:
        super().__init__((q, pending))
        self.failed = 0


class Reaper:
    """The process's tracker of Works without a watchdog (see the module docstring): one
    lane (an append-only deque, and the Works taken from it) per communicator, so that one
    communicator's long call never holds back the release of another's."""

    def __init__(self, tick: float = TICK) -> None:
        self.tick_s = float(tick)
        self.lanes: List[_Lane] = []      # [deque the call path appends to, list taken]
        self.ticks = 0
        self.taken = 0                    # Works the last look took (many: look sooner)
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._runtime: Any = None
        self._device: Any = None          # the device current on this thread (set by it)

    def lane(self) -> Deque[Any]:
        """A new lane's deque (a communicator's ``_watch``)."""
        q: Deque[Any] = collections.deque()
        self.adopt(q, [])
        return q

    def start(self) -> "Reaper":
        """Start the daemon thread (once)."""
        with self._lock:
            t = self._thread
            if t is None or not t.is_alive():
                t = self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="ncclpy-reaper")
                t.start()
        return self

    @property
    def alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def held(self) -> int:
        """Works issued and not yet released (taken or still in the lanes)."""
        return sum(len(q) + len(p) for q, p in list(self.lanes))

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s if self.taken < BUSY else self.tick_s / 10)
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the thread must outlive one bad tick
                log.warning("the ncclpy reaper's tick failed: %s", e)

    def tick(self) -> int:
        """One look: take the newly issued Works, release what completed; how many are held
        (one look at a time: the thread's, or a caller's)."""
        with self._tick_lock:
            return self._tick()

    def _tick(self) -> int:
        self.ticks += 1
        if not any(q or p for q, p in self.lanes):
            if self.ticks % 50 == 0:
                self._drop_gone()
            return 0
        cu = cuda()
        if cu is not self._runtime:        # this thread's capture mode, once per runtime
            self._runtime = cu
            self._device = None
            try:
                cu.thread_capture_mode_local()
            except Exception as e:  # noqa: BLE001 - queries may then be prohibited
                log.debug("reaper: no thread-local capture mode: %s", e)
        held = taken = 0
        gone = []
        for lane in list(self.lanes):
            q, pend = lane
            taken += take(q, pend)
            if pend:
                dev = getattr(pend[0], "_device", None)
                if dev is not None and dev != self._device and \
                        threading.current_thread() is self._thread:   # its own thread: never
                    cu.set_device(dev)          # a context on GPU 0 for another device's events
                    self._device = dev
                self._look(lane)
            held += len(pend)
            if not pend and not q and sys.getrefcount(q) <= 3:   # its communicator is gone
                gone.append(lane)
        self.taken = taken
        if gone:
            with self._lock:
                self.lanes = [ln for ln in self.lanes if all(ln is not g for g in gone)]
        return held

    def _drop_gone(self) -> None:
        """Forget the empty lanes of communicators that are gone (nothing else refers to
        their deque)."""
        with self._lock:
            self.lanes = [ln for ln in self.lanes
                          if ln[0] or ln[1] or sys.getrefcount(ln[0]) > 2]

    def _look(self, lane: _Lane) -> None:
        """Release what completed in ``lane``; a failed query is counted on the lane (its
        oldest Work is let go after :data:`GIVE_UP` consecutive failed looks)."""
        pend = lane[1]
        n = len(pend)
        try:
            release_done(pend, raising=True)
            lane.failed = 0
        except Exception as e:  # noqa: BLE001 - a query failed: held, tried again
            # a look that released some Works before it failed: a new oldest, counted afresh
            lane.failed = 1 if len(pend) < n else lane.failed + 1
            if lane.failed >= GIVE_UP:
                lane.failed = 0
                w = pend.pop(0)
                log.warning("reaper: the event of a %s could not be queried in %d looks in a row "
                            "(%s); its buffers are let go",
                            getattr(getattr(w, "plan", None), "collective", "call"), GIVE_UP, e)

    def adopt(self, q: Deque[Any], pending: List[Any]) -> None:
        """Track deque ``q`` (the call path appends to it) and the Works ``pending`` already
        taken from it, oldest first (a watchdog that stopped hands over its own)."""
        with self._lock:
            self.lanes.append(_Lane(q, pending))
        self.start()


_reaper: Optional[Reaper] = None
_reaper_lock = threading.Lock()


def reaper() -> Reaper:
    """This process's reaper, started on first use."""
    r = _reaper
    if r is None or not r.alive:
        with _reaper_lock:
            r = _reaper
            if r is None:
                r = _set(Reaper())
            r.start()
    return r


def _set(r: Reaper) -> Reaper:
    global _reaper
    _reaper = r
    return r
