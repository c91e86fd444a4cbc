"""The fast path's and the general path's own checks, pinned where their mutants showed
nothing did (issue 49; docs/testing.md, "What the runs found"), on the STAND-IN for libnccl
and CUDA.  The defects themselves are tests/test_call_path_defects.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ncclpy
from ncclpy import errors

from nccl_standin import standin
from test_call_path_defects import _arr, _made, _on, _pair, _short_grace

pytestmark = pytest.mark.usefixtures(_short_grace.__name__)   # its short abort grace


# -- the fast path's own checks, pinned (what its mutants showed unpinned) ---------------------
def test_a_receive_buffer_re_pointed_in_place_is_a_miss():
    with standin() as eng:
        c0, c1 = _pair()
        x0, y0, x1 = _arr([1.0], 0), _arr([0.0], 0), _arr([2.0], 1)
        for _ in range(2):                    # out of place: an entry, then a hit
            w0 = c0.all_reduce(x0, y0)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
        old = y0.a
        y0.a = np.zeros(1, np.float32)        # the same object, new memory
        w0 = c0.all_reduce(x0, y0)
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        assert y0.a.tolist() == [5.0] and old.tolist() == [4.0]   # 1 + (1 + (1 + 2))
        c0.abort(), c1.abort()
    assert eng.violations == []


@pytest.mark.parametrize("route", ["cupy", "ctypes"])
def test_an_nccl_failure_on_a_hit_is_said_recorded_and_leaves_nothing_held(route):
    with standin() as eng:
        c0, c1 = _pair(route)
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        for _ in range(2):
            w0 = c0.all_reduce(x0)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
        eng.fail["ncclAllReduce"] = 5         # ncclInvalidUsage, once
        with pytest.raises(errors.NcclError, match="ncclAllReduce") as e:
            c0.all_reduce(x0)
        if route == "cupy":                   # CuPy's error, said as ncclpy's, kept as cause
            assert type(e.value.__cause__).__name__ == "_NcclError", e.value.__cause__
        last = c0._recorder.entries()[-1]
        assert last["state"] == "failed" and "ncclAllReduce" in last["error"]
        assert c0._life.hot is None and (c0._life.inflight, c0._life.calls) == (0, 0)
        w0 = c0.all_reduce(x0)                # and the next call is as usual
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_calls_the_fast_path_cannot_make_take_the_general_path():
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        p = c0.prepare("all_reduce", x0, op=ncclpy.premul_sum(2.0))
        for call in (lambda: c0.all_reduce(x0, op=ncclpy.premul_sum(2.0)), p):
            for _ in range(2):
                w0 = call()
                _on(eng, 1, lambda: c1.all_reduce(x1, op=ncclpy.premul_sum(2.0)).wait())
                w0.wait()
        assert x0.a.tolist() == x1.a.tolist() == [384.0]   # each round: 2 x0 + 2 x1
        assert c0._resolver.hot == {}
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_the_general_path_counts_each_call_once_and_gives_every_count_back():
    """What the watchdog and an abort read (calls inside NCCL, calls let in so far, a group's
    hold) is taken once per call and given back, on every route of the general path; a
    PreMulSum op is destroyed once its call is issued."""
    from ncclpy.cpu.nccl import live_ops
    with standin() as eng:
        c0, c1 = _pair()
        c0._hot = None                        # the general path
        life = c0._life
        x0, x1 = _arr([1.0, 2.0], 0), _arr([2.0, 3.0], 1)
        y0, y1 = _arr([0.0, 0.0], 0), _arr([0.0, 0.0], 1)
        before = life.entered
        for _ in range(2):
            w0 = c0.all_reduce(x0)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
        assert life.entered == before + 2
        w0 = c0.send_recv(x0, y0, 1, 1)       # its own group
        _on(eng, 1, lambda: c1.send_recv(x1, y1, 0, 0).wait())
        w0.wait()
        assert y0.a.tolist() == x1.a.tolist()
        w0 = c0.all_reduce(x0, op=ncclpy.premul_sum(2.0))   # the plan's executor
        _on(eng, 1, lambda: c1.all_reduce(x1, op=ncclpy.premul_sum(2.0)).wait())
        w0.wait()
        assert not [op for op, h in live_ops(eng).items() if h == c0._handle]
        assert (life.inflight, life.calls, life.nhold, life.holder) == (0, 0, 0, None)
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_record_takes_the_newest_free_event_and_leaves_the_others_free():
    from ncclpy.comm.work import event_pool, record_event
    with standin() as eng:
        pool = event_pool(0)
        evs = [pool.new(eng.cuda) for _ in range(3)]
        pool.free[:] = evs
        ev = record_event(eng.cuda, pool, 0)
        assert ev == evs[-1] and pool.free == evs[:-1]
        pool.free.clear()
        assert record_event(eng.cuda, pool, 0) not in evs     # none free: a new one


def test_a_fast_call_waits_for_the_api_lock_another_thread_holds():
    """One thread inside NCCL per handle (NCCL's rule): a hit waits for the API lock."""
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        for _ in range(2):
            w0 = c0.all_reduce(x0)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
        made = _made(eng, c0, "ncclAllReduce")
        taken, free_it, out = threading.Event(), threading.Event(), {}

        def holder() -> None:
            with c0._life.api:
                taken.set()
                free_it.wait(10)

        def caller() -> None:
            eng.cuda.set_device(0)
            out["w"] = c0.all_reduce(x0)
        h = threading.Thread(target=holder)
        h.start()
        assert taken.wait(10)
        t = threading.Thread(target=caller)
        t.start()
        t.join(0.3)
        assert t.is_alive() and _made(eng, c0, "ncclAllReduce") == made, \
            "a fast call went into NCCL while another thread held the handle"
        free_it.set()
        h.join(10), t.join(10)
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        out["w"].wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_captured_hit_on_any_stream_handle_is_marked_by_the_call():
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        s = 3                                 # handles from 3 on: asked whether they capture
        for _ in range(2):
            w0 = c0.all_reduce(x0, stream=s)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
        eng.cuda.begin_capture(s)
        w = c0.all_reduce(x0, stream=s)       # a hit, captured
        eng.cuda.end_capture(s)
        assert w._owned, f"a captured call on stream {s} was not marked"
        c0.abort(), c1.abort()
    assert eng.violations == []



def test_a_plan_that_fails_after_its_copies_keeps_its_buffers_with_a_work():
    """A list form copies its blocks into scratch, then calls NCCL: when that call fails, the
    copies are already on the stream, reading the user's buffers -- a Work keeps them until
    the stream passed them."""
    from ncclpy.debug.reaper import reaper
    with standin() as eng:
        c0, c1 = _pair()
        blocks = [_arr([1.0], 0), _arr([2.0], 0)]
        out = _arr([0.0], 0)
        eng.fail["ncclReduceScatter"] = 5
        with pytest.raises(errors.NcclError, match="ncclReduceScatter"):
            c0.reduce_scatter(blocks, out)
        held = [w for q, pend in reaper().lanes if q is c0._watch for w in list(pend) + list(q)]
        assert any(blocks is k for w in held for k in _flat(w._keep)), \
            f"no Work keeps the buffers the copies read: {[w._keep for w in held]}"
        c0.abort(), c1.abort()
    assert eng.violations == []


def _flat(keep):
    if type(keep) is tuple:
        for k in keep:
            yield from _flat(k)
    else:
        yield keep


@pytest.mark.parametrize("how", ["eager", "prepared"])
def test_the_fast_record_and_capture_query_keep_the_pool_and_mark_what_they_must(how):
    """hot() and fire() (a prepared call's) hold the same lines: the newest free event is
    taken and the others stay free; a record refused on a default stream (another device
    current) gives its event back before the careful one; a capture query that raises (an
    invalidated capture) counts as captured."""
    from ncclpy.comm.work import event_pool
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        s = eng.cuda.new_stream()
        p = c0.prepare("all_reduce", x0, stream=s) if how == "prepared" else None
        p0 = c0.prepare("all_reduce", x0, stream=0) if how == "prepared" else None
        call = (lambda st: (p if st == s else p0)()) if p else \
            (lambda st: c0.all_reduce(x0, stream=st))
        for st in (s, s, 0, 0):
            w0 = call(st)
            _on(eng, 1, lambda: c1.all_reduce(x1).wait())
            w0.wait()
        pool = event_pool(0)
        pool.free.extend(pool.new(eng.cuda) for _ in range(3))
        free = list(pool.free)
        w0 = call(s)                          # a hit: the newest free event
        assert w0._event == free[-1] and pool.free == free[:-1]
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        out = pool.created - len(pool.free)
        eng.cuda.set_device(1)                # stream 0 is device 1's now: refused, redone
        w0 = call(0)
        eng.cuda.set_device(0)
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        assert pool.created - len(pool.free) == out, "an event left the pool"
        real = eng.cuda.capture_status
        eng.cuda.capture_status = lambda st: (_ for _ in ()).throw(
            RuntimeError("cudaErrorStreamCaptureInvalidated"))
        try:
            w0 = call(s)
        finally:
            eng.cuda.capture_status = real
        assert w0._owned, "a failing capture query must count as captured"
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_prepared_call_waits_for_the_communicators_lock_that_another_thread_holds():
    """A prepared call takes the communicator's one lock around its NCCL call, as every other
    call does: made while another thread holds it (an abort, a close, another call), it waits
    until that thread lets go."""
    import time
    with standin() as eng:
        c0, c1 = _pair()
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        p = c0.prepare("all_reduce", x0, stream=0)
        held, order = threading.Event(), []

        def holder() -> None:
            with c0._life.api:
                held.set()
                time.sleep(0.5)
                order.append("let go")
        t = threading.Thread(target=holder)
        t.start()
        assert held.wait(30)
        w0 = p()                              # issued after the holder let go
        order.append("called")
        t.join(30)
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        assert order == ["let go", "called"] and x0.a.tolist() == [3.0]
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_streams_handle_is_read_directly_only_from_cupys_and_torchs_own_types():
    """CuPy's ``.ptr`` and torch's ``.cuda_stream`` are read directly by the module the type
    comes from (its top-level package); any other type, one from a module of one name
    included, through ncclpy.comm.streams.stream_handle."""
    from ncclpy.comm import hot
    from ncclpy.comm.streams import stream_handle

    def kind(module: str, attr: str) -> type:
        return type("S", (), {"__module__": module, attr: 7})
    cupy_like = kind("cupy.cuda.stream", "ptr")
    f = hot._handle_of(cupy_like)
    assert f is not stream_handle and f(cupy_like()) == 7
    torch_like = kind("torch.cuda.streams", "cuda_stream")
    f = hot._handle_of(torch_like)
    assert f is not stream_handle and f(torch_like()) == 7
    for other in (kind("mystreams", "ptr"), kind("cuda.cupy", "ptr"), kind("cupy", "handle")):
        assert hot._handle_of(other) is stream_handle


def test_a_premul_sum_that_fails_inside_a_group_keeps_its_op_until_the_group_ends():
    """NCCL may still launch what a group enqueued before a call of it failed: the failed
    call's PreMulSum op is kept until the group ends, then destroyed, never left behind."""
    from ncclpy.cpu.nccl import live_ops

    def ops() -> list:
        return [op for op, h in live_ops(eng).items() if h == c0._handle]
    with standin() as eng:
        c0, c1 = _pair()
        x0 = _arr([1.0], 0)
        eng.fail["ncclAllReduce"] = 5         # ncclInvalidUsage, once
        with pytest.raises(errors.NcclError, match="ncclAllReduce"):
            with c0.group():
                try:
                    c0.all_reduce(x0, op=ncclpy.premul_sum(2.0))
                finally:
                    held = ops()              # inside the group: still there
        assert len(held) == 1 and ops() == []
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_call_on_a_torch_tensor_on_the_general_path_is_in_the_flight_recorder(monkeypatch):
    """A general-path call whose buffer is a torch tensor (here a BufferSpec of one) keeps
    the tensor's storage and is recorded in the flight recorder like any other call."""
    torch = pytest.importorskip("torch")
    from ncclpy.comm import streams as _streams
    monkeypatch.setattr(_streams, "torch_stream", lambda device: 0)   # torch's current: 0
    with standin() as eng:
        c0, c1 = _pair()
        c0._hot = None                        # the general path
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        spec = ncclpy.buffers.buffer.as_buffer(x0)
        t = torch.zeros(1)
        spec = ncclpy.buffers.buffer.BufferSpec(spec.ptr, spec.count, spec.dtype, spec.device,
                                                spec.shape, framework="torch", obj=t)
        before = len(c0._recorder.entries())
        w0 = c0.all_reduce(spec)
        _on(eng, 1, lambda: c1.all_reduce(x1).wait())
        w0.wait()
        entries = c0._recorder.entries()
        assert len(entries) == before + 1 and entries[-1]["coll"] == "all_reduce"
        assert x0.a.tolist() == [3.0]
        c0.abort(), c1.abort()
    assert eng.violations == []
