"""What the fast path (ncclpy/comm/hot.py) and its trackers cost in semantics, and that it
costs nothing else (issue 37), on the STAND-IN for libnccl and CUDA:

* an entry is found by object identity but checked by the values its plan depends on: a
  buffer re-pointed in place, another current stream, an export naming another stream are
  misses, never a stale call;
* groups and checked mode take the general path; an abort waits for a fast call inside NCCL
  (the in-call marker) and the watchdog times it;
* no capture query per call: a captured call is learned from its event (a host wait during
  the capture is refused without a query; after it, the query's cudaErrorCapturedEvent), the
  tracker counts it, close destroys its event; a capture in the global mode elsewhere is
  never invalidated;
* no cudaGetDevice per call: a record on a default stream with another device current is
  refused by CUDA (cudaErrorInvalidResourceHandle) and made again with the device current;
* the trackers release a completed prefix with O(log n) queries, and keep what they cannot
  query.
"""
from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from ncclpy import errors
from ncclpy._nccl.cuda import CapturedEventError
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator
from ncclpy.debug.reaper import reaper
from ncclpy.comm.work import Work, event_pool, new_work, release_done

from nccl_standin import DevArray, inside, run_ranks, standin, wait_inside
from wait_util import HANG, wait_until

UID = bytes(range(128))


def _pair(route: str = "ctypes"):
    cfg = None if route == "cupy" else Config(blocking=True)
    return run_ranks(2, lambda r: Communicator(2, r, UID, r, cfg, timeout=10.0))


def _arr(values, r: int) -> DevArray:
    return DevArray(np.asarray(values, dtype=np.float32), device=r)


def _both(eng, c0, c1, f0, f1):
    """f0 on rank 0's device, then f1 on rank 1's (one thread): the two sides of a call."""
    eng.cuda.set_device(0)
    w0 = f0(c0)
    eng.cuda.set_device(1)
    w1 = f1(c1)
    eng.cuda.set_device(0)
    return w0, w1


@pytest.mark.parametrize("route", ["cupy", "ctypes"])
def test_a_buffer_re_pointed_in_place_is_a_miss_and_the_call_uses_its_new_memory(route):
    with standin() as eng:
        c0, c1 = _pair(route)
        x0, x1 = _arr([1.0, 2.0], 0), _arr([10.0, 20.0], 1)
        for _ in range(2):                           # the second call is a hit
            w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(x0), lambda c: c.all_reduce(x1))
            w0.wait(), w1.wait()
        assert len(c0._resolver.hot) == 1 and x0.a.tolist() == [1.0 + 10 + 11, 2.0 + 20 + 22]
        old = x0.a
        x0.a = np.array([5.0, 6.0], np.float32)      # same object (same id), new memory
        x1.a = np.array([1.0, 1.0], np.float32)
        w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(x0), lambda c: c.all_reduce(x1))
        w0.wait(), w1.wait()
        assert x0.a.tolist() == [6.0, 7.0] and old.tolist() == [22.0, 44.0]
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_another_current_stream_or_a_named_one_is_a_miss():
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        a = (eng.cuda.new_stream(), eng.cuda.new_stream())      # a stream of each rank's
        b = (eng.cuda.new_stream(), eng.cuda.new_stream())

        def on(r, s, f):
            def call(c):
                eng.tls().stream = s[r]               # stream=None: the current stream
                return f(c)
            return call
        for s in (a, a, b):
            w0, w1 = _both(eng, c0, c1, on(0, s, lambda c: c.all_reduce(x0)),
                           on(1, s, lambda c: c.all_reduce(x1)))
            assert (w0.stream, w1.stream) == s
            w0.wait(), w1.wait()
        eng.tls().stream = 0
        n0, n1 = DevArray(x0.a, 0), DevArray(x1.a, 1)
        for s in (a, b):                              # an export that names its stream
            n0._stream, n1._stream = s
            w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(n0), lambda c: c.all_reduce(n1))
            assert w0.stream == s[0] and w1.stream == s[1]
            w0.wait(), w1.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_calls_in_a_group_take_the_general_path_and_are_recorded_at_its_end():
    import ncclpy
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        for _ in range(2):
            w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(x0), lambda c: c.all_reduce(x1))
            w0.wait(), w1.wait()
        hot = dict(c0._resolver.hot)
        eng.cuda.set_device(0)
        with ncclpy.group():
            w0 = c0.all_reduce(x0)
            assert w0.event is None                  # recorded at the group end
            eng.cuda.set_device(1)
            w1 = c1.all_reduce(x1)
            eng.cuda.set_device(0)
        assert c0._resolver.hot == hot               # no entry made inside the group
        w0.wait(), w1.wait()
        assert x0.a[0] == x1.a[0]
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_an_abort_waits_for_a_fast_call_inside_nccl_and_the_watchdog_times_it(monkeypatch):
    import threading
    from ncclpy.comm import lifecycle
    from ncclpy.debug.watchdog import Watchdog
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", HANG)   # outlasts the call whatever the load
    with standin() as eng:
        c0, c1 = _pair()
        x0 = _arr([1.0], 0)
        for _ in range(2):                           # an entry: the next call is a hit
            w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(x0),
                           lambda c: c.all_reduce(_arr([1.0], 1)))
            w0.wait(), w1.wait()
        eng.slow["ncclAllReduce"] = 0.6
        out = {}

        def call():
            eng.cuda.set_device(0)
            try:
                out["w"] = c0.all_reduce(x0)
            except errors.NcclpyError as e:
                out["e"] = e
        t = threading.Thread(target=call, daemon=True)
        t.start()
        wait_until(lambda: c0._life.hot is not None, "the marker: inside NCCL")
        wd = Watchdog(c0, None)
        blk = wd.blocked(100.0)
        assert blk is not None and blk[1] == "all_reduce" and blk[2] == 100.0
        assert wd.blocked(101.0)[2] == 100.0         # the same call, still inside
        # the marker is set ahead of the call: it enters NCCL (0.6 s there) once its thread runs
        wait_inside(eng, c0, "ncclAllReduce")
        c0.abort()                   # waits for the call to leave NCCL (within its grace)
        # it waited (neither deferred, nor an abort while the call was inside: a violation)
        assert c0.state == "aborted" and not inside(eng, c0, "ncclAllReduce")
        t.join(HANG)
        assert c0._life.hot is None and "w" in out      # the call itself returned
        with pytest.raises(errors.NcclpyError):
            c0.all_reduce(x0)                        # and every later one is refused
        c1.abort()
    assert eng.violations == []


def _tick_elsewhere(eng) -> None:
    """One reaper look from another thread in the thread-local capture mode (the reaper's own
    thread's state): its calls are not prohibited by this thread's capture."""
    def look() -> None:
        eng.cuda.exchange_capture_mode(1)
        reaper().tick()
    t = threading.Thread(target=look)
    t.start()
    t.join(10)


def test_a_captured_call_is_marked_by_the_call_itself_and_counted():
    with standin() as eng:
        c0, c1 = _pair()
        x0 = _arr([1.0], 0)
        s = eng.cuda.new_stream()
        events_before = len(eng.events)
        eng.cuda.set_device(0)
        eng.cuda.begin_capture(s)                    # the global mode, this thread
        w = c0.all_reduce(x0, stream=s)
        with pytest.raises(errors.NcclpyError, match="captured into a CUDA graph"):
            w.wait()                                 # refused without a query
        assert w._owned and c0._captured_calls == 1  # the call asked its stream
        _tick_elsewhere(eng)                         # a tracker look: no query of its event
        graph = eng.cuda.end_capture(s)              # not invalidated
        with pytest.raises(errors.NcclpyError, match="captured into a CUDA graph"):
            w.is_completed()
        eng.cuda.begin_capture(s)
        w2 = c0.all_reduce(x0, stream=s)
        _tick_elsewhere(eng)
        eng.cuda.end_capture(s)
        assert c0._captured_calls == 2 and w2._owned
        assert len(c0._captured_events) == 2
        del graph
        c0.abort(), c1.abort()
        assert c0._captured_events == [] and len(eng.events) <= events_before + 4
    assert eng.violations == []


def test_a_record_on_a_default_stream_with_another_device_current_is_made_again():
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        for _ in range(2):
            eng.cuda.set_device(1)                   # rank 0's call, device 1 current
            w0 = c0.all_reduce(x0, stream=0)
            assert eng.cuda.get_device() == 1       # restored
            w1 = c1.all_reduce(x1, stream=0)
            eng.cuda.set_device(0)
            w0.wait()
            eng.cuda.set_device(1)
            w1.wait()
        assert x0.a[0] == x1.a[0] == 6.0                # (1 + 2) + (3 + 3)
        c0.abort(), c1.abort()
    assert eng.violations == []


class _Cu:
    """A CUDA runtime whose events are done below ``done`` (by event number); counts queries."""

    def __init__(self, done: int, captured=(), capturing=()) -> None:
        self.done, self.captured, self.queries = done, set(captured), 0
        self.capturing, self.asked, self.queried = set(capturing), [], []

    def stream_is_capturing(self, stream: int) -> bool:
        self.asked.append(stream)
        if stream == 0 and self.capturing:
            raise RuntimeError("cudaErrorStreamCaptureImplicit")
        return stream in self.capturing

    def event_query(self, ev: int) -> bool:
        self.queries += 1
        self.queried.append(ev)
        if ev in self.captured:
            raise CapturedEventError("captured")
        return ev < self.done


class _C:
    _nonblocking = False

    def __init__(self) -> None:
        self._captured_calls, self._captured_events = 0, []


def test_the_trackers_release_a_completed_prefix_with_log_n_queries():
    from ncclpy._nccl import cuda as cudamod
    c = _C()
    works = [new_work(c, 7, 5, None, ("buf",), ev) for ev in range(1000)]
    cu = _Cu(done=700)
    with cudamod.use(cu):
        assert release_done(works) == 700
    assert cu.queries <= 12 and len(works) == 300 and works[0]._event == 700
    assert event_pool(7).free[-700:] == list(range(700))
    del event_pool(7).free[:]
    # two streams: each run is searched on its own, in order
    mixed = [new_work(c, 7, 5, None, (), 1), new_work(c, 7, 6, None, (), 2),
             new_work(c, 7, 5, None, (), 9)]
    with cudamod.use(_Cu(done=5)):
        assert release_done(mixed) == 2 and mixed[0]._event == 9
    # the newest call was captured: learned from its event, let go; the rest released
    cap = [new_work(c, 7, 5, None, (), ev) for ev in range(4)]
    with cudamod.use(_Cu(done=10, captured={3})):
        assert release_done(cap) == 4
    assert c._captured_calls == 1 and [w._event for w in c._captured_events] == [3]
    del event_pool(7).free[:]


def test_a_tracker_never_asks_about_a_stream():
    """A tracker queries events only: never a stream (a stream may be destroyed once its last
    call is issued -- asking about it then crashed a rank on an H200, 2026-11-26).  Whether a
    call was captured is asked by the call itself (``captures``)."""
    from ncclpy._nccl import cuda as cudamod
    c = _C()
    works = [new_work(c, 7, 5, None, (), ev) for ev in range(3)]
    cu = _Cu(done=10, capturing={5})
    with cudamod.use(cu):
        assert release_done(works) == 3 and cu.asked == []
    del event_pool(7).free[:]


def test_the_call_asks_whether_its_stream_captures_and_counts_an_error_as_captured():
    from ncclpy.comm.work import captures

    class Status:
        def __init__(self, answer, device=0):
            self.answer, self.device, self.asked = answer, device, []

        def get_device(self):
            return self.device

        def set_device(self, d):
            self.device = d

        def capture_status(self, stream):
            self.asked.append((stream, self.device))
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer
    assert captures(Status(0), 5, 0) is False
    assert captures(Status(1), 5, 0) is True and captures(Status(2), 5, 0) is True  # invalid
    assert captures(Status(RuntimeError("cudaErrorStreamCaptureInvalidated")), 5, 0) is True
    legacy = Status(1)
    assert captures(legacy, 0, 0) is False and captures(legacy, 1, 0) is False
    assert legacy.asked == []                 # the legacy stream cannot be captured: not asked
    per_thread = Status(1, device=3)          # another device current: asked on the Work's
    assert captures(per_thread, 2, 1) is True
    assert per_thread.asked == [(2, 1)] and per_thread.device == 3      # and restored


def test_a_tracker_never_queries_a_captured_work_in_a_run_of_its_stream():
    """An eager call, then a call captured on the same stream, both seen in one tick: the
    binary search stops at the captured Work (its query would invalidate the capture)."""
    from ncclpy._nccl import cuda as cudamod
    c = _C()
    eager = new_work(c, 7, 5, None, (), 1)
    cap = new_work(c, 7, 5, None, (), 2)
    cap._captured()
    later = new_work(c, 7, 5, None, (), 3)
    cu = _Cu(done=0)
    with cudamod.use(cu):
        assert release_done([eager, cap, later]) == 0
    assert 2 not in cu.queried and cu.queried == [1]
    cu = _Cu(done=10)
    pending = [eager, cap, later]
    with cudamod.use(cu):
        assert release_done(pending) == 3 and pending == []
    assert 2 not in cu.queried and c._captured_calls == 1
    del event_pool(7).free[:]


def test_a_released_work_is_complete_and_its_event_is_reused():
    from ncclpy._nccl import cuda as cudamod
    c = _C()
    w = new_work(c, 8, 5, None, ("kept",), 42)
    with cudamod.use(_Cu(done=100)):
        release_done([w])
    assert w._done and w._keep == () and w.event is None and w.is_completed()
    assert event_pool(8).free == [42]
    del event_pool(8).free[:]
    assert isinstance(w, Work)


def test_a_cupy_array_found_again_is_the_whole_check_and_another_one_is_read():
    """A C-contiguous cupy.ndarray cannot be re-pointed (data, size, dtype, strides are
    read-only): the entry keeps a weak reference and finding the same object is the check;
    any other array (a new object, perhaps at the same address) has its key read again."""
    cupy = pytest.importorskip("cupy")
    import weakref

    def arr(host, r):
        mem = cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, r)
        return cupy.ndarray(host.shape, cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    with standin() as eng:
        c0, c1 = _pair("cupy")
        h0, h1 = np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.ones(4, np.float32)
        x0, x1 = arr(h0, 0), arr(h1, 1)
        for _ in range(2):
            w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(x0, stream=0),
                           lambda c: c.all_reduce(x1, stream=0))
            w0.wait(), w1.wait()
        e = next(iter(c0._resolver.hot.values()))
        assert isinstance(e.wa, weakref.ref) and e.wa() is x0
        x0.shape = (2, 2)                            # in place: still contiguous, same plan
        x1.shape = (2, 2)
        w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(x0, stream=0),
                       lambda c: c.all_reduce(x1, stream=0))
        w0.wait(), w1.wait()
        assert h0.tolist() == [8.0, 12.0, 16.0, 20.0] and len(c0._resolver.hot) == 1
        g0, g1 = np.full(4, 5.0, np.float32), np.full(4, 1.0, np.float32)
        y0, y1 = arr(g0, 0), arr(g1, 1)              # other objects, other memory: read
        w0, w1 = _both(eng, c0, c1, lambda c: c.all_reduce(y0, stream=0),
                       lambda c: c.all_reduce(y1, stream=0))
        w0.wait(), w1.wait()
        assert g0.tolist() == [6.0] * 4 and h0.tolist() == [8.0, 12.0, 16.0, 20.0]
        c0.abort(), c1.abort()
    assert eng.violations == []
