"""The call path holds for every caller (issue 49: items 1, 3-9, 11 and 12), on the STAND-IN for
libnccl and CUDA; item 2 (interrupts) is tests/test_interrupts.py, item 10 (tracker leaks)
tests/test_tracker_leaks.py, what the fast path's mutants showed unpinned
tests/test_fast_path_pins.py, and what only a GPU shows is tests/gpu/test_call_path_gpu.py.
"""
from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator
from ncclpy.comm import hot as _hot
from ncclpy.comm import lifecycle
from ncclpy.comm import prepared as _prepared
from ncclpy.comm import streams as _streams
from ncclpy.debug.reaper import reaper

from nccl_standin import DevArray, run_ranks, standin

UID = bytes(range(128))


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", 0.3)
    monkeypatch.setattr(lifecycle, "ABORT_JOIN", 0.5)


def _pair(route: str = "ctypes"):
    cfg = None if route == "cupy" else Config(blocking=(route != "nonblocking"))
    return run_ranks(2, lambda r: Communicator(2, r, UID, r, cfg, timeout=10.0))


def _arr(values, r: int) -> DevArray:
    return DevArray(np.asarray(values, dtype=np.float32), device=r)


def _on(eng, dev: int, fn):
    eng.cuda.set_device(dev)
    try:
        return fn()
    finally:
        eng.cuda.set_device(0)


def _made(eng, comm, name: str) -> int:
    return sum(1 for n, h, _ in list(eng.calls) if n == name and h == comm._handle)


# -- 1: a nonblocking communicator's Works stay kept after an async error --------------------
def test_an_async_error_never_lets_a_running_calls_buffers_go():
    """NCCL's kernel runs until ncclCommAbort ends it: the Work (and the memory it keeps)
    stays with the tracker until its event completes, error or not, however many looks see
    the error (the reaper lets a Work go after GIVE_UP failed looks); the Work carries the
    error for whoever waits on it."""
    from ncclpy.debug.reaper import GIVE_UP
    gc.collect()
    with standin() as eng:
        c0, c1 = _pair("nonblocking")
        x = _arr([1.0, 2.0], 0)
        alive = weakref.ref(x)
        work = weakref.ref(c0.all_reduce(x))  # the peer has not called yet: in flight
        del x
        eng.async_fail[c0._handle] = 6
        for _ in range(GIVE_UP + 5):
            reaper().tick()
        gc.collect()
        assert alive() is not None, "the buffers of a call still running were let go"
        assert isinstance(work()._error, errors.NcclRemoteError)   # a waiter gets it
        del eng.async_fail[c0._handle]
        _on(eng, 1, lambda: c1.all_reduce(_arr([1.0, 1.0], 1)).wait())
        for _ in range(3):
            reaper().tick()                   # completed: released
        gc.collect()
        assert alive() is None and work() is None
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 3: the fast path refuses what the general path refuses -----------------------------------
@pytest.mark.parametrize("call,bad", [("broadcast", 1.0), ("broadcast", True),
                                      ("all_reduce", False)])
def test_a_hit_with_an_argument_equal_to_but_not_an_int_is_refused(call, bad):
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        good = 1 if call == "broadcast" else 0
        kw = "root" if call == "broadcast" else "op"
        for _ in range(2):                    # an entry: the next call is a hit
            w0 = getattr(c0, call)(x0, **{kw: good})
            _on(eng, 1, lambda: getattr(c1, call)(x1, **{kw: good}).wait())
            w0.wait()
        assert len(c0._resolver.hot) == 1
        made = _made(eng, c0, "ncclBroadcast" if call == "broadcast" else "ncclAllReduce")
        with pytest.raises(errors.NcclpyError, match=kw):
            getattr(c0, call)(x0, **{kw: bad})
        assert _made(eng, c0, "ncclBroadcast" if call == "broadcast" else
                     "ncclAllReduce") == made, "issued what the general path refuses"
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 4: a BufferSpec of a torch tensor follows torch's current stream --------------------------
def test_a_buffer_spec_of_a_torch_tensor_runs_on_torchs_current_stream(monkeypatch):
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        side = eng.cuda.new_stream()
        torch_now = {0: 0, 1: 0}              # torch's current stream (CuPy's stays 0)
        fake = lambda device: torch_now[device]    # noqa: E731
        monkeypatch.setattr(_streams, "torch_stream", fake)
        monkeypatch.setattr(_hot, "torch_stream", fake)
        spec = ncclpy.buffers.buffer.as_buffer(x0)
        spec = ncclpy.buffers.buffer.BufferSpec(spec.ptr, spec.count, spec.dtype, spec.device,
                                                spec.shape, framework="torch", obj=None)
        for _ in range(2):
            w0 = c0.all_reduce(spec)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
            assert w0.stream == 0
        assert len(c0._resolver.hot) == 1     # on the fast path
        torch_now[0] = side                   # with torch.cuda.stream(side): ...
        w0 = c0.all_reduce(spec)
        assert w0.stream == side, "issued on the stream torch left, not its current one"
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        c0._resolver.clear()
        res = c0._resolver
        raws = [ncclpy.buffers.buffer.BufferSpec(spec.ptr, spec.count, spec.dtype, spec.device,
                                          spec.shape, framework=fw) for fw in ("raw", "cupy")]
        raws.append(ncclpy.Buffer(spec.ptr, spec.count, "float32", 0))
        resolved = []
        orig = type(res).resolve
        monkeypatch.setattr(type(res), "resolve",
                            lambda self, *a, **k: resolved.append(a) or orig(self, *a, **k))
        for raw in raws:                      # CuPy's current stream, on the fast path too
            for i in range(3):
                if i == 1:
                    resolved.clear()
                w0 = c0.all_reduce(raw)
                _on(eng, 1, lambda: c1.all_reduce(x1).wait())
                w0.wait()
                assert w0.stream == 0
            assert not [a for a in resolved if a[2] is raw], f"{raw!r}: resolved again"
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 5: an entry planned before the cache was cleared is not kept ------------------------------
def test_an_entry_planned_before_a_clear_is_not_kept(monkeypatch):
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        res = c0._resolver
        orig = type(res).resolve

        def racing(self, *a, **k):            # force_fallback on another thread, meanwhile
            r = orig(self, *a, **k)
            if self is res:
                self.clear()
            return r
        monkeypatch.setattr(type(res), "resolve", racing)
        w0 = c0.all_reduce(x0)
        assert res.hot == {}, "an entry of the old plan survived the clear"
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 6: a host wait never asks CUDA about the call's stream ------------------------------------
def test_wait_and_is_completed_never_ask_about_the_stream_and_never_break_a_capture():
    """The stream may be destroyed once its calls are issued (tests/gpu/test_call_path_gpu.py
    does it on a GPU): wait() and is_completed() query the event only, in the relaxed capture
    mode, so a Work recorded before a capture may be waited on during it."""
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        s = eng.cuda.new_stream()
        asked = []
        for name in ("stream_is_capturing", "capture_status"):
            orig = getattr(eng.cuda, name)
            setattr(eng.cuda, name, lambda st, o=orig, n=name: asked.append(n) or o(st))
        w0 = c0.all_reduce(x0, stream=s)
        asked.clear()
        assert w0.is_completed() is False
        eng.cuda.begin_capture(s)             # this thread captures the Work's stream
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()                             # recorded before the capture: waited on
        eng.cuda.end_capture(s)               # and the capture is intact
        assert asked == [], f"the Work asked CUDA about its stream: {asked}"
        assert w0.is_completed()
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 7: another thread's call on a communicator in this thread's open group --------------------
def test_a_call_from_another_thread_on_a_communicator_in_an_open_group_is_refused():
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1, y0 = _arr([1.0], 0), _arr([2.0], 1), _arr([3.0], 0)
        p = c0.prepare("all_reduce", y0)
        opened, done = threading.Event(), threading.Event()
        out = {}

        def group_thread() -> None:
            eng.cuda.set_device(0)
            with ncclpy.group():
                out["w"] = c0.all_reduce(x0)
                opened.set()
                done.wait(10)
        t = threading.Thread(target=group_thread)
        t.start()
        assert opened.wait(10)
        made = _made(eng, c0, "ncclAllReduce")
        for call in (lambda: c0.all_reduce(y0), p, lambda: c0.broadcast(y0, root=0)):
            with pytest.raises(errors.NcclpyError, match="open group.* of another thread"):
                call()
        assert _made(eng, c0, "ncclAllReduce") == made
        assert (c0._life.inflight, c0._life.calls) == (1, 0)   # the group's hold, no more
        done.set()
        t.join(10)
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        out["w"].wait()
        w = c0.all_reduce(y0)                 # after the group: as usual
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_hit_made_as_another_threads_group_takes_the_communicator_is_refused():
    """The race the fast path's lock-free group check leaves: this thread found no group
    open, then another thread's group took the communicator before the API lock: the call
    is refused under the lock, never issued into that group."""
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        p = c0.prepare("all_reduce", x0, stream=0)
        for _ in range(2):                    # entries: the calls below are hits
            w0, wp = c0.all_reduce(x0), p()
            _on(eng, 1, lambda: (c1.all_reduce(x1).wait(), c1.all_reduce(x1).wait()))
            w0.wait(), wp.wait()
        made = _made(eng, c0, "ncclAllReduce")
        life = c0._life
        life.holder, life.nhold = threading.get_ident() + 1, 1    # (another thread's hold)
        try:
            for call in (lambda: c0.all_reduce(x0), p):
                with pytest.raises(errors.NcclpyError, match="of another thread") as e:
                    call()
                assert e.value.__cause__ is None    # a refusal: nothing behind it
        finally:
            life.holder, life.nhold = None, 0
        assert _made(eng, c0, "ncclAllReduce") == made and life.hot is None
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 8: an eager call keeps a torch tensor's memory, not only the tensor -----------------------
def test_an_eager_call_keeps_the_memory_of_a_tensor_re_pointed_while_in_flight():
    torch = pytest.importorskip("torch")
    from ncclpy.buffers.buffer import set_host_memory
    gc.collect()
    set_host_memory(True)                     # torch CPU tensors: the CPU backend's buffers
    try:
        with standin() as eng:
            c0, c1 = _pair()
            for path in ("miss", "hit"):
                arr = np.ones(4, np.float32)
                t = torch.from_numpy(arr)     # its storage keeps arr (weakly visible)
                alive = weakref.ref(arr)
                del arr
                if path == "hit":             # the same tensor object: an entry, then a hit
                    w = c0.all_reduce(t)
                    _on(eng, 1, lambda: c1.all_reduce(torch.ones(4)).wait())
                    w.wait()
                w = c0.all_reduce(t)          # in flight: the peer has not called
                t.set_(torch.zeros(4))        # re-pointed: its old memory is the call's only
                gc.collect()
                reaper().tick()
                assert alive() is not None, f"{path}: the memory NCCL writes was freed"
                _on(eng, 1, lambda: c1.all_reduce(torch.ones(4)).wait())
                w.wait()
                del w
                reaper().tick()
                gc.collect()
                assert alive() is None        # released once the call completed
            c0.abort(), c1.abort()
        assert eng.violations == []
    finally:
        set_host_memory(False)


# -- 9: a prepared call keeps the stream object it was given -----------------------------------
def test_a_prepared_call_keeps_its_fixed_stream_alive():
    class Stream:
        def __init__(self, h: int) -> None:
            self.ptr = h
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        s = Stream(eng.cuda.new_stream())
        ref = weakref.ref(s)
        p = c0.prepare("all_reduce", x0, stream=s)
        del s
        gc.collect()
        assert ref() is not None, "the stream may be destroyed while the prepared call lives"
        w = p()
        assert w.stream == ref().ptr
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w.wait()
        del p
        gc.collect()
        assert ref() is None
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 11: per-call costs the docs deny ----------------------------------------------------------
def test_a_hit_on_the_per_thread_default_stream_asks_no_current_device():
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        orig = eng.cuda.get_device
        asked = []
        eng.cuda.get_device = lambda: asked.append(1) or orig()
        for _ in range(3):
            asked.clear()
            w0 = c0.all_reduce(x0, stream=2)
            _on(eng, 1, lambda: c1.all_reduce(x1, stream=2).wait())
            w0.wait()
        asked.clear()
        w0 = c0.all_reduce(x0, stream=2)      # a hit, device 0 current
        assert asked == [], "cudaGetDevice on a hit"
        _on(eng, 1, lambda: c1.all_reduce(x1, stream=2).wait())
        w0.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_prepared_call_without_a_fixed_stream_makes_its_entry_once(monkeypatch):
    made = []
    orig = _prepared.entry_of
    monkeypatch.setattr(_prepared, "entry_of", lambda c, r: made.append(r) or orig(c, r))
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        p = c0.prepare("all_reduce", x0)
        for _ in range(4):
            w = p()
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w.wait()
        assert len(made) == 1, f"an entry made per call ({len(made)} for 4)"
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- 12: a captured call's Work after close ---------------------------------------------------
def test_waiting_on_a_captured_call_after_close_says_so_instead_of_using_a_dead_event():
    with standin() as eng:
        c0, c1 = _pair()
        x0 = _arr([1.0], 0)
        s, other = eng.cuda.new_stream(), eng.cuda.new_stream()
        eng.cuda.begin_capture(s)
        w = c0.all_reduce(x0, stream=s)
        eng.cuda.end_capture(s)
        assert w._owned
        ev = w._event
        c0.abort(), c1.abort()
        assert ev not in eng.events           # destroyed at the abort
        with pytest.raises(errors.NcclpyError, match="captured into a CUDA graph and its "
                                                     "communicator is aborted"):
            w.wait(other)
        assert w.event is None
    assert eng.violations == []
