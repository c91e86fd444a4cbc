"""NCCL's rules of concurrency and collectiveness that ncclpy's lifecycle keeps, on CPU through
the faithful STAND-IN (tests/nccl_standin*.py; its rules and their NCCL sources:
ncclpy/cpu/RULES.md): suspend and resume are collective and asynchronous (issue 35's
defect 6), a nonblocking call blocked on a peer is timed by the watchdog (defect 8), no two
threads inside NCCL on one communicator (defect 9), no event query that invalidates another
thread's global-mode CUDA-graph capture (defect 10).  The abort that never frees a handle a
call is inside (defect 7) is in tests/test_call_path_lifecycle.py.
"""
from __future__ import annotations

import gc
import threading
import weakref
import time

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator, lifecycle
from ncclpy.rendezvous import free_port

from nccl_standin import DevArray, StandInCudaError, run_ranks, standin, wait_inside
from wait_util import HANG, wait_until

UID = bytes(range(7, 135))
NEW = 23203


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", 0.3)
    monkeypatch.setattr(lifecycle, "ABORT_JOIN", 0.5)


def _arr(values, r: int) -> DevArray:
    return DevArray(np.asarray(values, dtype=np.float32), device=r)


def _comm(r: int, n: int = 2, blocking: bool = True, timeout: float = 5.0) -> Communicator:
    return Communicator(n, r, UID, r, Config(blocking=blocking), timeout=timeout)


# -- defect 6: suspend / resume are collective, asynchronous, bounded --------------------------
@pytest.mark.parametrize("blocking", [True, False])
def test_suspend_and_resume_wait_for_every_rank(blocking):
    """mem_manager.cc: each is a group task ending in a bootstrap barrier; a nonblocking
    communicator returns ncclInProgress (ncclpy used to raise it as an error)."""
    def rank(r: int):
        c = _comm(r, blocking=blocking)
        try:
            if r == 1:
                time.sleep(0.3)                      # late: the barrier waits for this rank
            entered = time.monotonic()
            c.suspend()
            left = time.monotonic()
            assert c.suspended and c.mem_stats()["suspended"] == 1
            with pytest.raises(errors.NcclpyError, match="suspended"):
                c.all_reduce(_arr([1.0], r))
            c.resume()
            c.all_reduce(_arr([1.0], r)).wait()
            return entered, left
        finally:
            c.close()
    with standin(version=NEW) as eng:
        (_, left0), (entered1, _) = run_ranks(2, rank)
    assert left0 >= entered1, (left0, entered1)      # rank 0 left only once rank 1 came
    assert eng.violations == []
    assert [n for n, *_ in eng.calls].count("ncclCommSuspend") == 2


@pytest.mark.parametrize("blocking", [True, False])
def test_close_of_a_suspended_communicator_is_bounded_when_a_peer_never_resumes(blocking):
    """close() resumes first, and resume is collective: with a peer that neither resumes nor
    closes, close() ends after the timeout (+1 s, the abort's grace) with CommAbortedError,
    instead of waiting in NCCL's barrier for good."""
    closed = threading.Event()

    def rank(r: int):
        c = _comm(r, blocking=blocking, timeout=0.5)
        c.suspend()
        if r == 1:                                   # never resumes: gone quiet ...
            assert closed.wait(HANG)                 # ... until rank 0's close gave up
            c.resume() if blocking else None         # lets rank 0's stuck resume return
            c.abort()
            return None
        t0 = time.monotonic()
        try:
            with pytest.raises(errors.CommAbortedError) as ei:
                c.close()
        finally:
            closed.set()
        return ei.value, time.monotonic() - t0, c
    with standin(version=NEW) as eng:
        (err, took, c0), _ = run_ranks(2, rank)
        wait_until(lambda: c0.state == "aborted", "the deferred abort, once the resume returned")
    assert 0.5 <= took < HANG, took                  # its timeout, then the abort: no hang
    assert err.reason == "resume_timeout" and "collective" in str(err) and "Resume" in str(err)
    assert "ncclCommDestroy" not in [n for n, *_ in eng.calls]
    assert eng.violations == []


# -- defect 8: a nonblocking call blocked on a peer is a call for the watchdog ----------------
def test_a_nonblocking_call_in_progress_for_good_gets_the_watchdogs_verdict():
    """_wait_ready's polls used to count as new calls, so the watchdog's blocked timer restarted
    at every tick and no verdict came: the wait ran into its own timeout."""
    port = free_port()
    verdict = threading.Event()

    def rank(r: int):
        c = ncclpy.init(f"nb{port}", rank=r, world_size=2, master_addr="127.0.0.1",
                        master_port=port, device=r, timeout=1.0,
                        config=Config(blocking=False))
        c.all_reduce(_arr([1.0], r)).wait()
        if r == 1:
            assert verdict.wait(HANG)                # never posts its recv
            c.abort()
            return None
        eng.polls = 10 ** 9                          # NCCL's job stays in progress
        try:
            with pytest.raises(errors.CommAbortedError) as ei:
                c.send(_arr([1.0], 0), 1)
        finally:
            verdict.set()
        return ei.value
    with standin() as eng:
        err, _ = run_ranks(2, rank)
    # the watchdog's verdict on a blocked call (the wait's own timeout: NcclTimeoutError)
    assert err.reason == "timeout" and err.collective == "send", err
    assert "blocked inside its NCCL call" in str(err)
    assert eng.violations == []


# -- defect 9: one thread at a time inside NCCL with a handle ---------------------------------
def test_the_watchdogs_drain_and_a_wait_never_poll_one_handle_at_once():
    """Work.is_completed (the watchdog's drain) and a thread's wait both call
    ncclCommGetAsyncError on a nonblocking communicator; NCCL completes and frees the job in
    it (init.cc), so two threads there at once is a double free.  The stand-in records any
    two threads inside NCCL on one communicator."""
    def rank(r: int):
        c = _comm(r, blocking=False)
        try:
            w = c.all_reduce(_arr([1.0], r))
            eng.slow["ncclCommGetAsyncError"] = 0.01  # each poll takes a while
            stop = threading.Event()

            def drain() -> None:
                while not stop.is_set():
                    try:
                        w.is_completed()
                    except errors.NcclpyError:
                        return
            t = threading.Thread(target=drain, daemon=True)
            t.start()
            for _ in range(5):
                c.all_reduce(_arr([1.0], r)).wait()
            stop.set()
            t.join(5)
            eng.slow.pop("ncclCommGetAsyncError", None)
        finally:
            c.close()
    with standin(polls=3) as eng:
        run_ranks(2, rank)
    assert eng.violations == []
    assert [n for n, *_ in eng.calls].count("ncclCommGetAsyncError") > 20


# -- defect 10: a sweep of dropped Works never breaks a global-mode capture -----------------
def test_a_call_on_another_stream_during_a_global_capture_keeps_the_capture_and_the_buffers():
    """torch.cuda.graph captures in the global mode: a cudaEventQuery from a thread in the
    global mode is prohibited then and invalidates the capture.  A call on another stream
    makes no query (its CUDA calls, the record and the capture query, are allowed) and the
    trackers query in the thread-local mode: the capture stays valid, and a Work that may
    still run keeps its buffers."""
    captured = threading.Event()

    def rank(r: int):
        c = _comm(r)
        try:
            x = _arr([1.0, 2.0], r)
            c.all_reduce(x)                          # dropped at once: kept until done
            if r == 0:                               # rank 1's side waits: still running
                assert captured.wait(HANG)           # through rank 1's whole capture
            s = eng.cuda.new_stream()
            eng.cuda.begin_capture(s)                # global mode, this thread
            w = c.all_reduce(_arr([3.0], r), stream=eng.cuda.new_stream())
            try:
                eng.cuda.end_capture(s)              # raises if it was invalidated
            finally:
                captured.set()
            w.wait()                                 # (after the capture: allowed)
            return True
        finally:
            c.close()
    with standin() as eng:
        assert run_ranks(2, rank) == [True, True]
    assert eng.violations == []


def test_the_reaper_keeps_what_it_cannot_query():
    """An event query that fails (a capture, anything) proves nothing: the reaper keeps the
    Work and its buffers, and releases them at a later look once the query says done."""
    from ncclpy.debug.reaper import reaper
    gc.collect()
    with standin() as eng:
        c0, c1 = run_ranks(2, lambda r: _comm(r))
        x = _arr([1.0], 0)
        alive = weakref.ref(x)
        c0.all_reduce(x)                             # dropped, rank 1 has not called yet
        del x
        query = eng.cuda.event_query
        eng.cuda.event_query = lambda ev: (_ for _ in ()).throw(StandInCudaError("boom"))
        reaper().tick()
        gc.collect()
        assert alive() is not None and reaper().held() >= 1      # kept
        eng.cuda.event_query = query
        c1.all_reduce(_arr([1.0], 1)).wait()
        reaper().tick()                              # done now: released
        gc.collect()
        assert alive() is None
        c0.close()
        c1.close()
    assert eng.violations == []


# -- a simulated group launches nothing only on blocking communicators ------------------------
def test_a_simulated_group_refuses_a_nonblocking_communicator():
    """group.cc ncclGroupEndInternal: a nonblocking group launches its calls and ignores the
    simulation (the table's row D6); ncclpy refuses it before any call is enqueued."""
    def rank(r: int):
        c = _comm(r, blocking=False)
        try:
            with pytest.raises(errors.UnsupportedError, match="nonblocking communicator"):
                with c.group(simulate=True):
                    pass
            with pytest.raises(errors.UnsupportedError, match="simulates nothing"):
                with ncclpy.group(simulate=True):
                    c.all_reduce(_arr([1.0], r))
            c.all_reduce(_arr([1.0], r)).wait()       # the communicator is still usable
        finally:
            c.close()
    with standin() as eng:
        run_ranks(2, rank)
    assert eng.violations == [] and "ncclGroupSimulateEnd" in [n for n, *_ in eng.calls]


# -- the deferred abort and revoke (issue 35's review) --------------------------------------------
def test_a_deferred_abort_runs_on_its_own_thread_even_when_the_last_caller_holds_a_window():
    """The abort waits for a blocked call; the thread that leaves NCCL last may hold its
    window's lock (user_ptr waiting for the API lock): the abort, which loses the windows,
    must not run on it (it would wait for its own lock)."""
    with standin(version=NEW) as eng:
        c0, c1 = run_ranks(2, lambda r: _comm(r))
        wins = run_ranks(2, lambda r: (c0, c1)[r].register_window((c0, c1)[r].mem_alloc(64)))
        eng.slow["ncclAllReduce"] = 2.0              # outlasts the steps below and the grace
        t1 = threading.Thread(target=lambda: _swallow(c0.all_reduce, _arr([1.0], 0)),
                              daemon=True)
        t1.start()
        wait_inside(eng, c0, "ncclAllReduce")
        t2 = threading.Thread(target=lambda: _swallow(wins[0].user_ptr), daemon=True)
        t2.start()                                   # waits for the API lock, window locked
        wait_until(wins[0]._lock.locked, "user_ptr holding its window's lock")
        c0.abort()                                   # deferred: all_reduce is inside
        assert c0._life.deferred
        for t in (t1, t2):
            t.join(HANG)
        wait_until(lambda: c0.state == "aborted", "the deferred abort")
        assert wins[0].state == "lost"
        c1.abort()
    assert not t1.is_alive() and not t2.is_alive()
    assert eng.violations == []


def test_a_shrink_waits_for_a_revoke_deferred_behind_a_blocked_call():
    """A revoke made while a call is inside NCCL waits for it (no two threads inside NCCL);
    a shrink asked meanwhile must not reach NCCL before ncclCommRevoke did."""
    def rank(r: int):
        c = _comm(r, n=3)
        if r == 2:                                   # the rank that is gone
            c.abort()
            return None
        if r == 0:
            eng.slow["ncclAllReduce"] = 1.5          # a call inside NCCL on another thread
            t = threading.Thread(target=_swallow, args=(c.all_reduce, _arr([1.0], 0)),
                                 daemon=True)
            t.start()
            wait_inside(eng, c, "ncclAllReduce")
        c.revoke()                                   # rank 0: deferred behind that call
        child = c.shrink([2])
        assert child.world_size == 2
        child.close()
        c.close()
        return c._handle
    with standin(version=NEW) as eng:
        h0 = run_ranks(3, rank)[0]
    mine = [n for n, h, _ in eng.calls if h == h0]
    assert mine.index("ncclCommRevoke") < mine.index("ncclCommShrink")
    assert eng.violations == []


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except errors.NcclpyError:
        pass
