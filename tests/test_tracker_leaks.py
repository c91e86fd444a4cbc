"""The trackers never leak a Work (issue 49, item 10), on fake CUDA (no GPU, no NCCL):

* a watchdog that stops hands its Works and its deque to the reaper exactly once, whatever
  the interleaving of stop() with the thread's end: the thread paused at the point of the
  race (events, no sleeps), stop() run against it;
* the reaper counts failed event queries per lane: another lane's successful look never
  resets a lane's count, and failures of several lanes never add up to let a Work go early.
"""
from __future__ import annotations

import threading
from typing import Any, Iterable, List

import pytest

from ncclpy._nccl import cuda as cudamod
from ncclpy.debug import reaper as reaper_mod
from ncclpy.debug.reaper import GIVE_UP, Reaper
from ncclpy.comm.work import Work, event_pool, new_work
from ncclpy.debug import watchdog as watchdog_mod
from ncclpy.debug.verdicts import Decision
from ncclpy.debug.watchdog import Watchdog

from wait_util import HANG

DEV = 7


class _Cu:
    """Fake CUDA: an event is done once below ``done``; a query of one in ``failing`` raises."""

    def __init__(self, done: int = 0, failing: Iterable[int] = ()) -> None:
        self.done, self.failing = done, set(failing)

    def event_query(self, ev: int) -> bool:
        if ev in self.failing:
            raise RuntimeError(f"cudaErrorLaunchFailure (event {ev})")
        return ev < self.done

    def thread_capture_mode_local(self) -> bool:
        return True

    def set_device(self, device: int) -> None:
        pass


class _C:
    """The communicator a Work names (a blocking one)."""
    _nonblocking = False

    def __init__(self) -> None:
        self._captured_calls, self._captured_events = 0, []


class _Comm:
    """The attributes a Watchdog reads of a communicator; ``on_abort`` runs in its abort."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.name = 0, 2, "leaks"
        self._timeout, self._device, self._watch = 60.0, DEV, None
        self.aborted_with: Any = None
        self.on_abort: Any = None

    def _watchdog_abort(self, decision: Any) -> None:
        self.aborted_with = decision
        if self.on_abort is not None:
            self.on_abort()


class _Reaper(Reaper):
    """A reaper without its thread: the test looks (``tick``) when it wants."""

    def start(self) -> "_Reaper":
        return self


def _work(c: _C, ev: int, keep: str = "buf") -> Work:
    return new_work(c, DEV, 5, None, (keep,), ev)


@pytest.fixture
def tracker(monkeypatch):
    """The process's reaper replaced by a thread-less one (what a watchdog hands over to)."""
    r = _Reaper()
    monkeypatch.setattr(reaper_mod, "reaper", lambda: r)
    yield r
    del event_pool(DEV).free[:]


def _lanes_of(r: Reaper, q: Any) -> List[Any]:
    return [ln for ln in r.lanes if ln[0] is q]


def _released_by_the_reaper(r: Reaper, cu: _Cu, works: List[Work]) -> None:
    cu.done = 1 << 20                            # every call complete now
    r.tick()
    assert all(w._done and w._keep == () for w in works)
    assert all(not pend for _, pend in r.lanes)


def test_stop_giving_up_on_a_thread_that_ends_just_then_still_hands_over(tracker, monkeypatch):
    """The race: stop()'s join times out, and the thread ends between stop's look at it and
    its request that the thread hand over.  Before the fix nobody handed over: the held Works
    and every later call's Work were never released."""
    monkeypatch.setattr(watchdog_mod, "STOP_JOIN", 0.05)
    c, comm, cu = _C(), _Comm(), _Cu(done=2)
    wd = Watchdog(comm, None, tick=0.01)
    works = [_work(c, ev) for ev in range(4)]
    paused, gate = threading.Event(), threading.Event()
    real_drain = wd.drain

    def drain(now: float) -> None:               # the thread's last drain, paused after it
        real_drain(now)
        paused.set()
        gate.wait(HANG)
    wd.drain = drain                             # type: ignore[method-assign]
    with cudamod.use(cu):
        comm._watch.extend(works)
        wd.start()
        assert paused.wait(HANG)
        t = wd._thread
        assert t is not None
        real_alive = t.is_alive
        looked: List[bool] = []

        def is_alive() -> bool:                  # stop() looks: alive; then it ends at once
            alive = real_alive()
            if wd._stop.is_set() and not looked:
                looked.append(alive)
                gate.set()
                t.join(HANG)
            return alive
        t.is_alive = is_alive                    # type: ignore[method-assign]
        wd.stop(closed=False)                    # bounded: returns after STOP_JOIN
        gate.set()
        t.join(HANG)
        assert not t.is_alive()
        late = _work(c, 9)                       # a call after the stop: its deque still
        comm._watch.append(late)
        lanes = _lanes_of(tracker, wd.queue)
        assert len(lanes) == 1, "the thread's Works went to nobody (or twice)"
        assert lanes[0][1] == works[2:] and wd.pending == []
        assert works[0]._done and works[1]._done and not works[2]._done
        wd.stop(closed=False)                    # a second stop: no second hand-over
        assert len(_lanes_of(tracker, wd.queue)) == 1
        _released_by_the_reaper(tracker, cu, works + [late])


def test_a_thread_ending_between_stops_join_and_its_look_is_handed_over_by_stop(tracker,
                                                                               monkeypatch):
    """The window of the fix itself: stop()'s join gives up, then the thread ends -- its
    hand-over flag read, unset -- before stop looks: stop hands over (it finds the loop
    ended), exactly once."""
    monkeypatch.setattr(watchdog_mod, "STOP_JOIN", 0.05)
    c, comm, cu = _C(), _Comm(), _Cu(done=1)
    wd = Watchdog(comm, None, tick=0.01)
    works = [_work(c, ev) for ev in range(3)]
    paused, gate = threading.Event(), threading.Event()
    real_drain = wd.drain

    def drain(now: float) -> None:
        real_drain(now)
        paused.set()
        gate.wait(HANG)
    wd.drain = drain                             # type: ignore[method-assign]
    with cudamod.use(cu):
        comm._watch.extend(works)
        wd.start()
        assert paused.wait(HANG)
        t = wd._thread
        real_join = t.join

        def join(timeout=None) -> None:          # stop's join: it gives up, then the
            real_join(timeout)                   # thread ends before stop looks
            assert t.is_alive()
            gate.set()
            real_join(HANG)
        t.join = join                            # type: ignore[method-assign]
        wd.stop(closed=False)
        assert not t.is_alive() and not wd._hand_over_at_exit
        lanes = _lanes_of(tracker, wd.queue)
        assert len(lanes) == 1 and lanes[0][1] == works[1:], "nobody (or both) handed over"
        _released_by_the_reaper(tracker, cu, works)


def test_stop_while_the_thread_is_still_draining_lets_the_thread_hand_over(tracker,
                                                                          monkeypatch):
    """stop() gives up joining while the thread is still in a drain: it returns (bounded),
    hands nothing over itself (the thread may still drain: never two trackers on one list),
    and the thread hands over after its last drain."""
    monkeypatch.setattr(watchdog_mod, "STOP_JOIN", 0.05)
    c, comm, cu = _C(), _Comm(), _Cu(done=1)
    wd = Watchdog(comm, None, tick=0.01)
    works = [_work(c, ev) for ev in range(3)]
    paused, gate = threading.Event(), threading.Event()
    real_drain = wd.drain

    def drain(now: float) -> None:
        paused.set()
        gate.wait(HANG)
        real_drain(now)
    wd.drain = drain                             # type: ignore[method-assign]
    with cudamod.use(cu):
        comm._watch.extend(works)
        wd.start()
        assert paused.wait(HANG)
        wd.stop(closed=False)
        t = wd._thread
        assert t is not None and t.is_alive() and not gate.is_set()
        assert _lanes_of(tracker, wd.queue) == []    # not while the thread may drain
        gate.set()
        t.join(HANG)
        lanes = _lanes_of(tracker, wd.queue)
        assert len(lanes) == 1 and lanes[0][1] == works[1:] and works[0]._done
        _released_by_the_reaper(tracker, cu, works)


def test_stop_after_the_loop_ended_hands_over_itself_even_if_the_thread_lingers(tracker,
                                                                               monkeypatch):
    """The thread's loop ended (a verdict) and it lingers in its last steps when stop() gives
    up joining: stop hands over itself, and the thread does not again."""
    monkeypatch.setattr(watchdog_mod, "STOP_JOIN", 0.05)
    c, comm, cu = _C(), _Comm(), _Cu(done=0)
    wd = Watchdog(comm, None, tick=0.01)
    paused, gate = threading.Event(), threading.Event()

    class Decided(threading.Event):
        def set(self) -> None:                   # the thread's end, after its loop
            if threading.current_thread() is wd._thread:
                paused.set()
                gate.wait(HANG)
            super().set()
    wd._decided = Decided()
    verdict = Decision("nccl_error", "all_reduce", 0, (), "a test verdict")
    wd.decide = lambda now, dead=(): verdict     # type: ignore[method-assign]
    works = [_work(c, ev) for ev in range(2)]
    with cudamod.use(cu):
        comm._watch.extend(works)
        wd.start()
        assert paused.wait(HANG) and comm.aborted_with is verdict
        wd.stop(closed=False)
        t = wd._thread
        assert t is not None and t.is_alive()
        gate.set()
        t.join(HANG)
        lanes = _lanes_of(tracker, wd.queue)
        assert len(lanes) == 1 and lanes[0][1] == works
        _released_by_the_reaper(tracker, cu, works)


def test_stop_twice_and_stop_from_the_thread_hand_over_once(tracker):
    """A double hand-over would make two lanes of one deque: never."""
    c, cu = _C(), _Cu(done=0)
    with cudamod.use(cu):
        comm = _Comm()
        wd = Watchdog(comm, None, tick=0.01)     # never started
        comm._watch.append(_work(c, 0))
        wd.stop(closed=False)
        wd.stop(closed=False)
        assert len(_lanes_of(tracker, wd.queue)) == 1
        comm2 = _Comm()
        wd2 = Watchdog(comm2, None, tick=0.01)
        comm2.on_abort = lambda: wd2.stop(closed=False)    # the abort closes: from the thread
        wd2.decide = lambda now, dead=(): Decision(           # type: ignore[method-assign]
            "nccl_error", "all_reduce", 0, (), "a test verdict")
        comm2._watch.append(_work(c, 1))
        wd2.start()
        t = wd2._thread
        assert t is not None
        t.join(HANG)
        assert not t.is_alive() and comm2.aborted_with is not None
        wd2.stop(closed=False)                   # and the close's stop, later
        assert len(_lanes_of(tracker, wd2.queue)) == 1
        assert [w._event for w in _lanes_of(tracker, wd2.queue)[0][1]] == [1]


# -- the reaper: one failure count per lane ---------------------------------------------------
def _reaper_with(n: int) -> tuple:
    r = _Reaper()
    return r, [r.lane() for _ in range(n)]


def _lane(r: Reaper, q: Any) -> Any:
    (ln,) = _lanes_of(r, q)
    return ln


@pytest.fixture
def pool():
    yield
    del event_pool(DEV).free[:]


def test_a_lane_that_keeps_failing_is_given_up_although_another_lane_succeeds(pool):
    """Lane A's query fails at every look, lane B's succeeds (its call is still running):
    before the fix B's look reset the one counter, and A was never given up."""
    c, cu = _C(), _Cu(done=0, failing={100})
    r, (qa, qb) = _reaper_with(2)
    wa, wb = _work(c, 100, "a"), _work(c, 200, "b")
    qa.append(wa)
    qb.append(wb)
    with cudamod.use(cu):
        for _ in range(GIVE_UP - 1):
            r.tick()
        assert _lane(r, qa)[1] == [wa] and wa._keep == ("a",)   # kept until its GIVE_UP-th
        r.tick()                                 # A's own GIVE_UP-th failed look
    assert _lane(r, qa)[1] == [] and not wa._done     # let go (not seen complete)
    assert _lane(r, qb)[1] == [wb] and wb._keep == ("b",)


def test_failures_of_two_lanes_never_add_up_to_let_a_work_go(pool):
    """Lane A fails at every look; lane B (looked at first) holds nothing for GIVE_UP - 1
    looks, then a call whose query fails once.  Before the fix the shared count reached
    GIVE_UP at B's first failure: B's buffers were let go while its call may still run."""
    c, cu = _C(), _Cu(done=0, failing={100, 300})
    r, (qb, qa) = _reaper_with(2)
    wa = _work(c, 100, "a")
    qa.append(wa)
    with cudamod.use(cu):
        for _ in range(GIVE_UP - 1):
            r.tick()
        wb = _work(c, 300, "b")
        qb.append(wb)
        r.tick()
        assert _lane(r, qb)[1] == [wb] and wb._keep == ("b",)     # B failed once: kept
        assert _lane(r, qa)[1] == [] and not wa._done             # A: its GIVE_UP-th
        for _ in range(GIVE_UP - 2):
            r.tick()
        assert _lane(r, qb)[1] == [wb]           # B: GIVE_UP - 1 failed looks, still kept
        cu.failing.clear()
        cu.done = 1000                           # B's query works again: released
        r.tick()
    assert _lane(r, qb)[1] == [] and wb._done and wb._keep == ()
