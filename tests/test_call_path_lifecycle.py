"""The communicator's lifecycle and captures on CPU, through the STAND-IN for libnccl and CUDA
(tests/nccl_standin.py): one abort per handle, nothing touches an aborted or destroyed handle,
abort while another thread is inside NCCL, a nonblocking wait that an abort ends, close that
never hangs (a peer gone, a CUDA graph still holding the communicator), the same error on
prepared and eager calls after a watchdog abort, captured calls (stream-ordered scratch, their
Works), dropped Works that keep their buffers, the watchdog and checked mode end to end over a
real store.  The stand-in records each NCCL call and each rule broken (none allowed).
"""
from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator, lifecycle
from ncclpy.rendezvous import free_port
from ncclpy.debug.watchdog import Decision

from nccl_standin import DevArray, inside, run_ranks, standin, wait_called, wait_inside
from wait_util import HANG, in_thread, wait_until

UID = bytes(range(128))


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", 0.3)
    monkeypatch.setattr(lifecycle, "ABORT_JOIN", 0.5)


def _arr(values, r: int, dtype=np.float32) -> DevArray:
    return DevArray(np.asarray(values, dtype=dtype), device=r)


def _names(eng) -> list:
    return [c[0] for c in eng.calls]


def _pair(route="ctypes", timeout=5.0):
    """Two communicators (ranks 0 and 1) made on two threads."""
    cfg = None if route == "cupy" else Config(blocking=(route != "nonblocking"))
    return run_ranks(2, lambda r: Communicator(2, r, UID, r, cfg, timeout=timeout))


# -- abort: once per handle, never on a handle in use ------------------------------------------
def test_abort_waits_for_a_call_inside_nccl_and_happens_once(monkeypatch):
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", HANG)     # outlasts the 0.2 s call for sure
    with standin() as eng:
        c0, c1 = _pair()
        eng.slow["ncclAllReduce"] = 0.2
        t, out = in_thread(c0.all_reduce, _arr([1.0], 0))
        wait_inside(eng, c0, "ncclAllReduce")              # rank 0 is inside ncclAllReduce
        aborts = [threading.Thread(target=c0.abort) for _ in range(3)]
        for a in aborts:
            a.start()
        for a in aborts:
            a.join(HANG)
        t.join(HANG)
        c1.abort()
    names = _names(eng)
    assert names.count("ncclCommAbort") == 2                 # one per handle, three calls
    assert not any(n.startswith("abort-while-busy") for n in names)
    assert names.index("ncclAllReduce") < names.index("ncclCommAbort")
    assert "value" in out and c0.state == "aborted"
    with pytest.raises(errors.NcclpyError, match="is aborted"):
        c0.all_reduce(_arr([1.0], 0))
    assert eng.violations == []


def test_an_abort_never_frees_a_blocking_communicator_under_a_call_inside_nccl():
    """Issue 35's defect 7: NCCL frees the communicator in ncclCommAbort and waits for no
    other thread (init.cc commReclaim); the stand-in records an abort made while a call is
    inside as the violation it is.  ncclpy defers the abort until the blocked call returns
    (abort() itself returns after the grace), refuses every call meanwhile, and the blocked
    call then raises the abort's error."""
    with standin() as eng:
        c0, c1 = _pair()
        eng.slow["ncclAllReduce"] = 3.0                     # blocked, like a dead peer's
        t, out = in_thread(c0.all_reduce, _arr([1.0], 0))
        wait_inside(eng, c0, "ncclAllReduce")
        t0 = time.monotonic()
        c0.abort()
        took = time.monotonic() - t0
        # deferred: abort() returned with the call still inside, and no ncclCommAbort made
        assert c0._life.deferred and c0.state == "aborting" and "ncclCommAbort" not in _names(eng)
        with pytest.raises(errors.NcclpyError, match="being aborted"):
            c0.barrier()
        t.join(HANG)
        wait_until(lambda: c0.state == "aborted", "the deferred abort (a thread of its own)")
        c1.abort()
    assert took >= 0.3, took                                # after the grace (0.3 s here)
    names = _names(eng)
    assert names.index("ncclAllReduce") < names.index("ncclCommAbort")
    assert not any(n.startswith("abort-while-busy") for n in names)
    assert c0.state == "aborted" and isinstance(out.get("error"), errors.NcclpyError)
    assert eng.violations == []


def test_a_nonblocking_wait_ends_at_once_when_the_watchdog_aborts():
    """Defect 1: the poll loop checks the lifecycle before every ncclCommGetAsyncError."""
    with standin() as eng:
        c0, c1 = _pair("nonblocking", timeout=10 * HANG)   # its own timeout: never reached
        eng.polls = 10 ** 9                                  # the call stays in progress
        t, out = in_thread(c0.all_reduce, _arr([1.0], 0))
        wait_called(eng, c0, "ncclCommGetAsyncError")        # the wait is polling
        c0._watchdog_abort(Decision("timeout", "all_reduce", 7, (1,), "watchdog: rank 1 gone"))
        t.join(HANG)
        assert not t.is_alive(), "the wait did not end"
        polls_after = [c for c in eng.calls[[c[0] for c in eng.calls].index("ncclCommAbort"):]
                       if c[0] == "ncclCommGetAsyncError" and c[1] == c0._handle]
        c1.abort()
    err = out.get("error")
    assert isinstance(err, errors.CommAbortedError) and err.suspects == [1] and err.seq == 7
    assert polls_after == []                                 # not a poll after the abort
    assert eng.violations == []


def test_close_and_an_abort_racing_never_finalize_or_destroy_after_the_abort():
    with standin() as eng:
        c0, c1 = _pair()
        eng.slow["ncclCommFinalize"] = 0.2
        t, out = in_thread(c0.close)
        wait_inside(eng, c0, "ncclCommFinalize")            # close is inside the finalize
        c0.abort()
        t.join(HANG)
        wait_until(lambda: c0.state == "aborted", "the abort (deferred, on a loaded machine)")
        c1.abort()
    names = [n for n, h, _ in eng.calls if h == c0._handle]
    assert names.count("ncclCommFinalize") == 1 and names.count("ncclCommAbort") == 1
    assert "ncclCommDestroy" not in names and c0.state == "aborted"
    assert eng.violations == []


def test_close_is_idempotent_and_does_nothing_after_an_abort():
    with standin() as eng:
        c0, c1 = _pair("cupy")
        c0.abort()
        c0.close()
        c0.abort()
        c1.close()
        c1.close()
        for c in (c0, c1):
            with pytest.raises(errors.NcclpyError):
                c.barrier()
    assert _names(eng).count("ncclCommDestroy") == 1 and _names(eng).count("ncclCommAbort") == 1
    assert eng.violations == []


def test_a_block_that_raises_aborts_and_one_that_ends_closes():
    with standin() as eng:
        c0, c1 = _pair()
        with pytest.raises(RuntimeError, match="boom"):
            with c0:
                raise RuntimeError("boom")
        with c1:
            pass
    assert c0.state == "aborted" and c1.state == "closed"
    assert eng.violations == []


# -- close never hangs ----------------------------------------------------------------------
@pytest.mark.parametrize("route", ["ctypes", "nonblocking"])
def test_close_with_a_live_graph_aborts_after_the_timeout_and_says_so(route):
    """Defect 4: NCCL's finalize waits for every graph holding the communicator."""
    def rank(r):
        c = Communicator(2, r, UID, r, Config(blocking=(route != "nonblocking")), timeout=0.5)
        s = eng.cuda.new_stream()
        eng.cuda.begin_capture(s)
        c.all_reduce(_arr([1.0], r), stream=s)
        graph = eng.cuda.end_capture(s)
        eng.graph_refs[c._handle] += 1                      # the graph is still alive
        t0 = time.monotonic()
        with pytest.raises(errors.CommAbortedError) as ei:
            c.close()
        return graph, time.monotonic() - t0, ei.value
    with standin() as eng:
        outs = run_ranks(2, rank)
    for graph, took, err in outs:
        assert 0.5 <= took < HANG, took                     # waited its timeout, then aborted
        assert err.reason == "finalize_timeout"
        assert "1 call(s) of this communicator were captured into CUDA graphs" in str(err)
        assert "destroy the graphs" in str(err) and "ncclCommAbort" in str(err)
    assert "ncclCommDestroy" not in _names(eng)
    assert eng.violations == []


def test_close_returns_even_when_the_abort_blocks_too():
    """The finalize is stuck (6 s), and so is the abort close makes of it (deferred behind the
    finalize, then 1 s of its own): close returns, refusing, while they are still inside."""
    with standin() as eng:
        c0, c1 = run_ranks(2, lambda r: Communicator(2, r, UID, r, Config(), timeout=0.3))
        eng.slow["ncclCommFinalize"], eng.slow["ncclCommAbort"] = 6.0, 1.0   # both stuck
        t0 = time.monotonic()
        with pytest.raises(errors.CommAbortedError, match="did not finish within 0.3 s"):
            c0.close()
        took = time.monotonic() - t0
        assert inside(eng, c0, "ncclCommFinalize"), took    # returned without waiting for it
        assert c0.state in ("aborting", "aborted")
        with pytest.raises(errors.CommAbortedError):
            c0.all_reduce(_arr([1.0], 0))
        wait_until(lambda: c0.state == "aborted", "the stuck calls' end")
        c1.abort()
    assert eng.violations == []


def test_finalize_then_close_destroys_once():
    with standin() as eng:
        c0, c1 = _pair("nonblocking")
        run_ranks(2, lambda r: (c0, c1)[r].finalize())
        assert c0.state == "finalized"
        with pytest.raises(errors.NcclpyError, match="finalized; only close"):
            c0.all_reduce(_arr([1.0], 0))
        run_ranks(2, lambda r: (c0, c1)[r].close())
    assert _names(eng).count("ncclCommFinalize") == 2 and _names(eng).count("ncclCommDestroy") == 2
    assert eng.violations == []


# -- the same error on every path after a watchdog abort ---------------------------------------
def test_prepared_and_eager_calls_raise_the_watchdogs_error():
    """Defect 5."""
    with standin() as eng:
        c0, c1 = _pair()
        x = _arr([1.0], 0)
        p = c0.prepare("all_reduce", x)
        c0._watchdog_abort(Decision("peer_dead", "all_reduce", 3, (1,), "rank 1 died"))
        for call in (p, lambda: c0.all_reduce(x), lambda: c0.split(0, 0),
                     lambda: c0.register(x), c0.barrier, c0.finalize):
            with pytest.raises(errors.CommAbortedError) as ei:
                call()
            assert ei.value.reason == "peer_dead" and ei.value.suspects == [1]
        c1.abort()
    assert eng.violations == []


# -- Works ----------------------------------------------------------------------------------
def test_work_completes_when_the_peer_arrives_and_times_out_naming_the_call():
    with standin() as eng:
        c0, c1 = _pair(timeout=0.3)
        x0, x1 = _arr([1.0], 0), _arr([2.0], 1)
        w = c0.all_reduce(x0)
        assert not w.is_completed()
        with pytest.raises(errors.NcclTimeoutError, match="all_reduce not complete after 0.3"):
            w.wait()
        s = eng.cuda.new_stream()
        w.wait(s)                                           # a stream waits, the host does not
        eng.cuda.set_device(1)
        c1.all_reduce(x1).wait()
        eng.cuda.set_device(0)
        assert w.is_completed() and x0.a[0] == 3.0
        w.wait()
        assert w.event is None
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_a_dropped_work_keeps_its_buffers_until_the_call_completed():
    """The caller drops the Work at once: its tracker (the reaper, no watchdog here) holds it,
    and with it the buffers, until a look sees the call complete; no later call of the
    caller's is needed (docs/reference/concepts/streams.rst)."""
    from ncclpy.debug.reaper import reaper
    gc.collect()                        # an earlier test's garbage Works are not this one's
    with standin() as eng:
        c0, c1 = _pair()
        x = _arr([1.0, 2.0], 0)
        alive = weakref.ref(x)
        c0.all_reduce(x)                                    # the Work is dropped at once
        del x
        gc.collect()
        reaper().tick()
        assert alive() is not None                          # NCCL has not run it yet
        eng.cuda.set_device(1)
        c1.all_reduce(_arr([1.0, 1.0], 1)).wait()
        eng.cuda.set_device(0)
        reaper().tick()                                     # a look, not a later call
        gc.collect()
        assert alive() is None
        c0.abort(), c1.abort()
    assert eng.violations == []


def test_an_async_error_without_a_watchdog_raises_nccls_error():
    with standin() as eng:
        c0, c1 = _pair("nonblocking")
        w = c0.all_reduce(_arr([1.0], 0))
        eng.async_fail[c0._handle] = 6
        with pytest.raises(errors.NcclRemoteError):
            w.wait()
        c0.abort(), c1.abort()
    assert eng.violations == []


# -- captures ---------------------------------------------------------------------------------
def test_captured_calls_replay_and_take_stream_ordered_scratch():
    from ncclpy.debug.reaper import reaper

    def rank(r):
        c = Communicator(2, r, UID, r, Config())
        s = eng.cuda.new_stream()
        x = _arr([0.0, 0.0], r)
        outs = [_arr([0.0], r) for _ in range(2)]            # list form: scratch + copies
        src = _arr([0.0], r)
        eng.cuda.begin_capture(s)
        w = c.all_reduce(x, stream=s)
        c.all_gather(src, outs, stream=s)
        graph = eng.cuda.end_capture(s)
        with pytest.raises(errors.NcclpyError, match="captured into a CUDA graph"):
            w.wait()
        with pytest.raises(errors.NcclpyError, match="graph.launch"):
            w.is_completed()
        got = []
        for k in (1, 2):
            x.a[:] = k * (r + 1)
            src.a[:] = 10 * k + r
            eng.cuda.launch(graph, s)
            eng.cuda.synchronize(s)
            got.append(x.a.tolist() + [o.a[0] for o in outs])
        reaper().tick()           # a tracker's look learns what was captured (from its event)
        captured = c._captured_calls
        del graph
        c.close()
        return got, captured
    with standin() as eng:
        outs = run_ranks(2, rank)
        assert eng.async_allocs == {}                        # freed inside the graph
    for got, captured in outs:
        assert got == [[3.0, 3.0, 10.0, 11.0], [6.0, 6.0, 20.0, 21.0]]
        assert captured == 2
    assert eng.violations == []


# -- the watchdog and checked mode, end to end over a real store --------------------------------
def _init(r, n, port, **kw):
    return ncclpy.init(f"sp{port}", rank=r, world_size=n, master_addr="127.0.0.1",
                       master_port=port, device=r, **kw)


def test_the_watchdog_names_the_rank_that_skipped_a_call():
    port = free_port()
    verdict = threading.Event()

    def rank(r):
        c = _init(r, 2, port, timeout=1.0)
        wd_thread = c._watchdog._thread.ident
        x = _arr([1.0], r)
        c.all_reduce(x).wait()
        if r == 1:
            assert verdict.wait(HANG)                        # skips the next call
            c.abort()
            return None, wd_thread
        try:
            with pytest.raises(errors.CommAbortedError) as ei:
                c.all_reduce(x).wait()
        finally:
            verdict.set()
        return ei.value, wd_thread
    with standin() as eng:
        (err, wd0), (_, wd1) = run_ranks(2, rank)
    assert err.reason == "timeout" and err.suspects == [1] and err.collective == "all_reduce"
    assert "rank(s) 1, which never issued it" in str(err)
    assert {wd0, wd1} <= set(eng.cuda.local_capture_threads)   # defect 3: capture-safe thread
    assert eng.violations == []


def test_an_nccl_error_becomes_the_watchdogs_verdict_naming_the_silent_peer():
    """What a GPU showed (docs/gpu-runs.md): NCCL reports a dead peer's closed socket before
    any heartbeat is stale; the wait hands the error to the watchdog, which names the rank."""
    port = free_port()
    verdict = threading.Event()

    def rank(r):
        c = _init(r, 2, port, timeout=20.0)
        c.all_reduce(_arr([1.0], r)).wait()
        if r == 1:
            c._watchdog.stop(closed=False)                    # its heartbeats stop: "dead"
            assert verdict.wait(HANG)                         # (its abort would be a verdict)
            c.abort()
            return None
        w = c.all_reduce(_arr([1.0], r))
        eng.async_fail[c._handle] = 6                         # the peer's socket closed
        try:
            with pytest.raises(errors.CommAbortedError) as ei:
                w.wait()
        finally:
            verdict.set()
        return ei.value
    with standin() as eng:
        err, _ = run_ranks(2, rank)
    # named silent (not the 20 s timeout's verdict), with NCCL's error as the cause
    assert err.reason == "peer_silent" and err.suspects == [1]
    assert "after NCCL reported" in str(err) and "ncclRemoteError" in str(err)
    assert isinstance(err.__cause__, errors.NcclRemoteError)
    assert eng.violations == []


def test_a_ranks_abort_is_published_and_followed_and_a_close_is_not_an_abort():
    """Rank 1 aborts its communicator while rank 0 is idle: rank 0's communicator is left
    alone while idle (NCCL may share its resources with a child in use), and its next call
    follows the published abort at the watchdog's next tick (one cause, suspects [1]) instead
    of waiting out the silence limit or the timeout; on a second communicator rank 1 closes
    and rank 0's stays usable."""
    port = free_port()

    def two_beats_after(c, what: str) -> None:           # (or an abort: asserted after)
        wd, b = c._watchdog, c._watchdog._beat
        wait_until(lambda: wd._beat >= b + 2 or c._life.abort_error is not None, what)

    def rank(r):
        c = _init(r, 2, port, timeout=10 * HANG)            # its own timeout: never reached
        c.all_reduce(_arr([1.0], r)).wait()
        if r == 1:
            c.abort()
            return None
        wait_until(lambda: c._watchdog.published is not None, "rank 1's abort heard")
        two_beats_after(c, "two more beats")               # idle: left alone meanwhile
        assert c._life.abort_error is None
        w = c.all_reduce(_arr([1.0], r))                   # followed once a call waits
        with pytest.raises(errors.CommAbortedError) as ei:
            w.wait()
        return ei.value
    with standin() as eng:
        err, _ = run_ranks(2, rank)
    # the published abort's verdict (not the silence limit's or the timeout's)
    assert err.reason == "peer_aborted" and err.suspects == [1], err
    assert "rank 1 aborted the communicator (abort: the communicator was aborted on rank 1" \
        in str(err), err
    assert eng.violations == []
    port = free_port()
    closed = threading.Event()

    def closing(r):
        c = _init(r, 2, port, timeout=30.0)
        c.all_reduce(_arr([1.0], r)).wait()
        if r == 1:
            c.close()
            closed.set()
            return None
        assert closed.wait(HANG)
        two_beats_after(c, "two heartbeats after the close")
        assert c._life.abort_error is None and c._watchdog.published is None
        c.abort()
        return True
    with standin() as eng:
        assert run_ranks(2, closing)[0] is True


def test_checked_mode_stops_a_mismatch_before_nccl_sees_it():
    port = free_port()

    def rank(r):
        c = _init(r, 2, port, timeout=10.0, checked=True, watchdog=False)
        c.all_reduce(_arr([1.0, 2.0], r)).wait()
        x = _arr([1.0], r)
        with c.group():                                       # deferred to the group end
            w = c.all_reduce(x)
        w.wait()                    # the Work returned in the group follows the call made
        assert w.is_completed() and x.a.tolist() == [2.0]    # at its end
        with pytest.raises(errors.CallMismatchError):
            c.all_reduce(_arr(np.ones(3 + r), r))
        c.abort()
    with standin() as eng:
        run_ranks(2, rank)
    assert _names(eng).count("ncclAllReduce") == 2 * 2       # the mismatch never reached NCCL
    assert eng.violations == []


def test_object_collectives_of_a_communicator_go_through_its_store_not_nccl():
    port = free_port()
    out = {}

    def rank(r):
        c = _init(r, 3, port, timeout=10.0, watchdog=False)
        got = c.broadcast_object({"cfg": [1, 2], "from": r} if r == 2 else None, root=2)
        every = c.all_gather_object(("rank", r))
        with pytest.raises(errors.ArgumentError, match="max_bytes=8"):
            c.all_gather_object("x" * 64, max_bytes=8)
        with pytest.raises(errors.ArgumentError, match="root 3 is not a rank"):
            c.broadcast_object(1, root=3)
        out[r] = (got, every)
        c.close()
        with pytest.raises(errors.NcclpyError, match="all_gather_object"):
            c.all_gather_object(1)                      # closed: refused like any call
    with standin() as eng:
        run_ranks(3, rank)
    for r in range(3):
        assert out[r] == ({"cfg": [1, 2], "from": 2}, [("rank", 0), ("rank", 1), ("rank", 2)])
    assert not [c for c in _names(eng) if c.startswith("ncclAll") or c.startswith("ncclBroad")]
    assert eng.violations == []
