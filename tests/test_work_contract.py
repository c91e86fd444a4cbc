"""The Work's own contract (ncclpy/comm/work.py), piece by piece: what a tracker's look and a
caller's wait do in each state, including the races the release lock guards (a caller's
completion, or a tracker's, landing between a check and the lock), made deterministic here by a
lock that lets the other side in as it is taken.  The end-to-end behaviour is in
tests/test_call_path_defects.py and tests/test_fast_path.py (stand-in)."""
from __future__ import annotations

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl import cuda as cudamod
from ncclpy._nccl.config import Config
from ncclpy._nccl.cuda import CapturedEventError
from ncclpy.comm import Communicator
from ncclpy.comm import work as _work
from ncclpy.comm.work import EventPool, new_work, record_event

from nccl_standin import DevArray, run_ranks, standin

UID = bytes(range(128))


class _Cu:
    """A CUDA runtime: events below ``done`` are complete; ``fail``: queries raise it."""

    def __init__(self, done: int = 0, fail=None, record_fails=False) -> None:
        self.done, self.fail, self.record_fails = done, fail, record_fails
        self.queries, self.set_devices = 0, 0

    def event_query(self, ev: int) -> bool:
        self.queries += 1
        if self.fail is not None:
            raise self.fail
        return ev < self.done

    def event_record(self, ev: int, stream: int) -> None:
        if self.record_fails:
            raise RuntimeError("cudaErrorLaunchFailure")

    def get_device(self) -> int:
        return 0

    def set_device(self, d: int) -> None:
        self.set_devices += 1

    def exchange_capture_mode(self, mode: int) -> int:
        return 0


class _C:
    _nonblocking = False

    def __init__(self) -> None:
        self._captured_calls, self._captured_events = 0, []


class _LetsIn:
    """A release lock that runs ``then()`` as it is taken: the other thread's step, landed
    between the caller's first check and its lock."""

    def __init__(self, then) -> None:
        self.then = then

    def __enter__(self):
        self.then()
        return self

    def __exit__(self, *a) -> None:
        return None


def test_a_work_is_counted_captured_once_and_never_once_done():
    c = _C()
    w = new_work(c, 0, 5, None, ("buf",), 9)
    w._captured()
    w._captured()
    assert c._captured_calls == 1 and c._captured_events == [w] and w._keep == ()
    done = new_work(c, 0, 5, None, ("buf",), 10)
    done._done = True
    done._captured()
    assert c._captured_calls == 1 and not done._owned


def test_a_look_at_a_captured_or_released_work_never_queries_it(monkeypatch):
    cu = _Cu(done=100)
    with cudamod.use(cu):
        for state in ("_owned", "_done"):
            w = new_work(_C(), 0, 5, None, (), 3)
            setattr(w, state, True)
            assert w._reap() is True and cu.queries == 0
        w = new_work(_C(), 0, 5, None, (), 3)            # released by a caller meanwhile
        monkeypatch.setattr(_work, "_release_lock", _LetsIn(lambda: setattr(w, "_done", True)))
        assert w._reap() is True and cu.queries == 0
        w = new_work(_C(), 0, 5, None, (), 3)            # and a caller's wait: the same
        monkeypatch.setattr(_work, "_release_lock", _LetsIn(lambda: setattr(w, "_done", True)))
        assert w._query(3) is True and cu.queries == 0


def test_a_look_at_a_done_or_captured_work_never_gives_it_a_later_communicator_error():
    """A nonblocking communicator's async error reaches the Works still in flight; a Work
    already completed or captured into a graph is left as it is (its tracker lets go of it
    without asking the communicator)."""
    class Failed(_C):
        _nonblocking = True
        asked = 0

        def _raise_async_error(self) -> None:
            Failed.asked += 1
            raise RuntimeError("ncclRemoteError")
    cu = _Cu(done=100)
    with cudamod.use(cu):
        for state in ("_owned", "_done"):
            w = new_work(Failed(), 0, 5, None, (), 3)
            setattr(w, state, True)
            assert w._reap() is True and w._error is None and cu.queries == 0
        assert Failed.asked == 0
        w = new_work(Failed(), 0, 5, None, (), 3)        # in flight: it takes the error
        assert w._reap() is True and isinstance(w._error, RuntimeError) and Failed.asked == 1


def test_a_look_whose_query_fails_lets_go_or_raises_as_asked():
    with cudamod.use(_Cu(fail=RuntimeError("cudaErrorLaunchFailure"))):
        w = new_work(_C(), 0, 5, None, ("buf",), 3)
        assert w._reap(raising=False) is True            # the watchdog's look: let go
        with pytest.raises(RuntimeError):
            w._reap(raising=True)                        # the reaper's: held, tried again
    with cudamod.use(_Cu(fail=CapturedEventError("captured"))):
        c = _C()
        w = new_work(c, 0, 5, None, ("buf",), 3)
        assert w._reap(raising=True) is True and w._owned and c._captured_calls == 1


def test_a_failed_record_on_a_stream_of_its_own_is_not_made_again():
    """Only a default stream's record is made again with the event's device current (the one
    failure another current device causes); any other gives the event back and raises."""
    cu = _Cu(record_fails=True)
    pool = EventPool(0)
    pool.free[:] = [7]
    with pytest.raises(RuntimeError):
        record_event(cu, pool, 5)
    assert pool.free == [7] and cu.set_devices == 0
    with pytest.raises(RuntimeError):
        record_event(cu, pool, 0)                        # made again, on its device
    assert pool.free == [7] and cu.set_devices == 2      # set, then restored


def _pair(route: str = "ctypes"):
    cfg = None if route == "cupy" else Config(blocking=(route != "nonblocking"))
    return run_ranks(2, lambda r: Communicator(2, r, UID, r, cfg, timeout=10.0))


def _arr(v, r):
    return DevArray(np.asarray(v, np.float32), r)


def _on(eng, dev, fn):
    eng.cuda.set_device(dev)
    try:
        return fn()
    finally:
        eng.cuda.set_device(0)


def test_wait_on_a_stream_orders_that_stream_after_the_call():
    with standin() as eng:
        c0, c1 = _pair()
        s, other = eng.cuda.new_stream(), eng.cuda.new_stream()
        w = c0.all_reduce(_arr([1.0], 0), stream=s)     # the peer has not called yet
        w.wait(other)
        with pytest.raises(TimeoutError):
            eng.cuda.synchronize(other, timeout=0.2)     # other waits for the call
        _on(eng, 1, lambda: c1.all_reduce(_arr([2.0], 1)).wait())
        eng.cuda.synchronize(other, timeout=5.0)
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_nonblocking_communicators_error_reaches_wait_and_is_completed():
    with standin() as eng:
        c0, c1 = _pair("nonblocking")
        w = c0.all_reduce(_arr([1.0], 0))
        _on(eng, 1, lambda: c1.all_reduce(_arr([2.0], 1)).wait())
        eng.async_fail[c0._handle] = 6                  # after the call completed
        with pytest.raises(errors.NcclRemoteError):
            w.is_completed()
        with pytest.raises(errors.NcclRemoteError):
            w.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_work_of_a_group_not_ended_is_not_complete():
    with standin() as eng:
        c0, c1 = _pair()
        with ncclpy.group():
            w = c0.all_reduce(_arr([1.0], 0))
            assert w.is_completed() is False and w.event is None
            _on(eng, 1, lambda: c1.all_reduce(_arr([2.0], 1)))
        w.wait()
        assert w.is_completed() is True
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_look_that_sees_completion_releases_and_gives_the_event_back():
    pool = _work.event_pool(5)
    pool.free.clear()
    with cudamod.use(_Cu(done=100)):
        w = new_work(_C(), 5, 3, None, ("buf",), 7)
        assert w._reap() is True
    assert w._done and w._keep == () and pool.free == [7]
    pool.free.clear()


def test_a_captured_works_event_never_goes_back_to_the_pool():
    pool = _work.event_pool(5)
    pool.free.clear()
    c = _C()
    w = new_work(c, 5, 3, None, ("buf",), 8)
    w._captured()
    w._completed()                           # (a graph may still name the event)
    assert pool.free == [] and c._captured_events == [w]
