"""NCCL 2.27-2.32's host API, part 2, on CPU: symmetric windows, revoke /
shrink / grow, suspend / resume / memory statistics -- ncclpy's own logic (arguments, version
gates, ordering, lifecycle: window before communicator, revoke then shrink, double close, no
finalize or destroy of a revoked communicator) through the call path over the STAND-IN for
libnccl and CUDA (tests/nccl_standin.py, ncclpy/cpu/part2.py) on thread-ranks.  What needs a
GPU is in tests/gpu/test_part2_gpu.py; one-sided RMA is tests/test_nccl_rma.py; the bench's
flags for this API are tests/test_bench_nccl_part2.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator
from ncclpy.comm.membership import exclude_list

from nccl_standin import DevArray, run_ranks, standin

from part2_util import NEW, UID, calls as _calls, comm as _comm
from part2_util import fill as _fill, read as _read
from wait_util import HANG


# -- windows -----------------------------------------------------------------------------------

def test_a_window_is_registered_used_and_closed_once_before_its_communicator():
    def one(r: int, n: int):
        c = _comm(n, r)
        buf = c.mem_alloc(16, "float32")
        _fill(buf, np.full(16, r + 1, np.float32))
        with c.register_window(buf) as win:
            assert win.registered and win.symmetric and win.state == "open"
            assert win.user_ptr() == buf.ptr and win.nbytes == 64
            c.all_reduce(buf).wait()                   # a collective on window memory
            got = _read(buf, 16)
        assert win.state == "closed" and win.closed
        win.close()                                    # idempotent: no second deregister
        keep = c.register_window(buf, symmetric=False)  # left open: close() deregisters it
        assert keep.flags == 0 and c.windows() == [keep]
        c.close()
        assert keep.state == "closed"
        with pytest.raises(errors.NcclpyError, match="the window is closed"):
            keep.user_ptr()
        return got
    with standin(version=NEW) as eng:
        got = run_ranks(2, one, 2)
    assert all(np.array_equal(g, np.full(16, 3, np.float32)) for g in got)
    assert eng.violations == []
    assert len(_calls(eng, "ncclCommWindowDeregister")) == 4
    for r_handle in {h for (nm, h, _) in _calls(eng, "ncclCommDestroy")}:
        names = [nm for nm, h, _ in eng.calls if h == r_handle]
        last_dereg = max(i for i, nm in enumerate(names) if nm == "ncclCommWindowDeregister")
        assert last_dereg < names.index("ncclCommFinalize") < names.index("ncclCommDestroy")


def test_an_abort_loses_the_windows_and_nothing_touches_them_again():
    def one(r: int, n: int):
        c = _comm(n, r)
        win = c.register_window(c.mem_alloc(1024, "uint8"))
        c.abort()
        assert win.state == "lost" and c.windows() == []
        win.close()                                     # no NCCL call on a freed handle
        with pytest.raises(errors.NcclpyError, match="aborted"):
            win.user_ptr()
    with standin(version=NEW) as eng:
        run_ranks(2, one, 2)
    assert eng.violations == [] and _calls(eng, "ncclCommWindowDeregister") == []


def test_window_arguments_and_versions_are_refused_precisely():
    def one(r: int, n: int):
        c = _comm(n, r)
        try:
            with pytest.raises(errors.ArgumentError, match="aligned to 4096 bytes"):
                c.register_window(ncclpy.Buffer(c.mem_alloc(64).ptr + 8, 8, "uint8", r))
            with pytest.raises(errors.ArgumentTypeError, match="symmetric: expected True or"):
                c.register_window(c.mem_alloc(64), symmetric=1)
            with pytest.raises(errors.VersionError, match=r"gin_only=True needs NCCL >= 2\.32"):
                c.register_window(c.mem_alloc(64), gin_only=True)
            with pytest.raises(errors.ArgumentError, match="non-empty"):
                c.register_window(ncclpy.Buffer(c.mem_alloc(64).ptr, 0, "uint8", r))
        finally:
            c.close()
    with standin(version=23100) as eng:
        run_ranks(2, one, 2)
    assert _calls(eng, "ncclCommWindowRegister") == []

    def old(r: int, n: int):
        c = _comm(n, r)
        try:
            with pytest.raises(errors.VersionError, match=r"ncclCommWindowRegister needs NCCL "
                                                         r">= 2\.27\.3"):
                c.register_window(c.mem_alloc(64))
        finally:
            c.close()
    with standin(version=22608):
        run_ranks(2, old, 2)


def test_a_nonblocking_communicators_window_is_read_only_once_nccl_wrote_it():
    """dev_runtime.cc: on a nonblocking communicator ncclCommWindowRegister says ncclSuccess
    while its task still runs, and writes *win later (issue 35's defect 3: ncclpy read 0 at
    once and called the window unregistered)."""
    def one(r: int, n: int):
        c = _comm(n, r, config=Config(blocking=False))
        try:
            if r == 1:
                time.sleep(0.2)                  # the registration's barrier waits for it
            with c.register_window(c.mem_alloc(64)) as win:
                assert win.registered and win.user_ptr() == win.ptr
            return win.handle
        finally:
            c.close()
    with standin(version=NEW) as eng:
        handles = run_ranks(2, one, 2)
    assert all(handles) and eng.violations == []


def test_register_window_inside_a_group_is_refused_before_nccl():
    """NCCL runs a registration made inside a group at the group's end and writes *win only
    then (defect 3): ncclpy refuses it there, precisely, and registers nothing."""
    def one(r: int, n: int):
        c = _comm(n, r)
        try:
            buf = c.mem_alloc(64)
            with c.group():
                with pytest.raises(errors.UnsupportedError, match="inside a group"):
                    c.register_window(buf)
            with c.register_window(buf) as win:       # after the group: registered
                assert win.registered
        finally:
            c.close()
    with standin(version=NEW) as eng:
        run_ranks(2, one, 2)
    assert len(_calls(eng, "ncclCommWindowRegister")) == 2 and eng.violations == []


def test_no_symmetric_support_is_said_not_hidden():
    def one(r: int, n: int):
        c = _comm(n, r)
        try:
            win = c.register_window(c.mem_alloc(64))
            assert not win.registered and win.handle == 0 and "not registered" in repr(win)
            with pytest.raises(errors.ArgumentError, match="NCCL registered no window"):
                c.put_signal(c.mem_alloc(4), 1 - r, win)
            win.close()
        finally:
            c.close()
    with standin(version=NEW) as eng:
        eng.nccl._p2()
        eng.symmetric = False
        run_ranks(2, one, 2)
    assert eng.violations == [] and _calls(eng, "ncclCommWindowDeregister") == []


# -- revoke, shrink, grow ----------------------------------------------------------------------

def test_revoke_then_shrink_to_the_survivors_and_carry_on():
    """Rank 2 is gone; the survivors revoke, shrink it out, reduce on the child, and close the
    parent by aborting it (no finalize, no destroy of a revoked communicator)."""
    def one(r: int, n: int):
        c = _comm(n, r)
        if r == 2:
            c.abort()
            return None
        c.revoke()
        c.revoke()                                      # idempotent
        assert c.state == "revoked"
        with pytest.raises(errors.CommAbortedError, match="revoked by comm.revoke"):
            c.all_reduce(DevArray(np.ones(2, np.float32), device=r))
        child = c.shrink([2])
        assert (child.rank, child.world_size) == (r, 2)
        x = DevArray(np.full(3, r + 1, np.float32), device=r)
        child.all_reduce(x).wait()
        child.close()
        c.close()
        c.close()
        assert c.state == "aborted"
        return x.a.tolist()
    with standin(version=NEW) as eng:
        got = run_ranks(3, one, 3)
    assert got[:2] == [[3.0] * 3, [3.0] * 3] and eng.violations == []
    assert len(_calls(eng, "ncclCommRevoke")) == 2
    assert [c[0] for c in eng.calls if c[0].startswith("ncclCommShrink:")] == \
        ["ncclCommShrink:2"] * 2


def _voting(c, store, timeout: float = 10.0, gen: int = 0):
    """Give a bare stand-in Communicator the rendezvous store ncclpy.init gives its own."""
    from ncclpy.comm.objects import ObjectExchange
    c._objects = ObjectExchange(store, c.rank, c.world_size, f"ncclpy/vote/{gen}/obj", timeout)
    c._timeout = timeout
    return c


def test_a_survivor_nccl_refuses_to_shrink_fails_every_survivor_at_once():
    """Rank 2 died; rank 0's parent keeps its proxy's network error through the revoke (NCCL
    2.28.9's ncclCommEnsureReady then refuses its ncclCommShrink, and rank 1 waited in its own
    shrink for ever: a GPU run, 2026-11-26).  The survivors vote first: both raise the same
    NcclRemoteError naming rank 0, and neither enters ncclCommShrink."""
    from ncclpy.store import TCPStore
    store = TCPStore("127.0.0.1", 0, timeout=20, is_server=True)

    def one(r: int, n: int):
        c = _comm(n, r)
        if r == 2:
            c.abort()
            return None
        _voting(c, store)
        c.revoke()
        if r == 0:
            eng.async_fail[c._handle] = 6                 # the proxy's ncclRemoteError
        with pytest.raises(errors.NcclRemoteError) as ei:
            c.shrink([2])
        c.close()
        return str(ei.value)
    try:
        with standin(version=NEW) as eng:
            got = run_ranks(3, one, 3)
    finally:
        store.close()
    for msg in got[:2]:
        assert "ncclCommShrink failed: ncclRemoteError (6): not called" in msg, msg
        assert "on rank(s) [0] (rank 0: ncclRemoteError (6))" in msg, msg
    assert [c for c in eng.calls if c[0].startswith("ncclCommShrink")] == []
    assert eng.violations == []


def test_survivors_that_can_shrink_vote_and_shrink_and_one_that_never_comes_is_named():
    from ncclpy.store import TCPStore
    store = TCPStore("127.0.0.1", 0, timeout=20, is_server=True)

    def one(r: int, n: int):
        c = _voting(_comm(n, r), store)
        if r == 2:
            c.abort()
            return None
        child = c.shrink([2])
        x = DevArray(np.full(2, r + 1, np.float32), device=r)
        child.all_reduce(x).wait()
        assert child.all_gather_object(r * 10) == [0, 10]    # the child has the store too
        child.close()
        c.close()
        return x.a.tolist()

    def differ(r: int, n: int):
        c = _voting(_comm(n, r), store, gen=2)
        if r == 2:
            c.abort()
            return None
        if r == 1:                  # excludes rank 0 too: it reads no vote, shrinks alone
            c.shrink([0, 2]).close()
            c.close()
            return True
        with pytest.raises(errors.ArgumentError, match=r"different exclude lists: rank 0: "
                                                       r"\[2\], rank 1: \[0, 2\]"):
            c.shrink([2])           # reads rank 1's vote: raises, never waits in NCCL
        c.abort()
        return True

    def alone(r: int, n: int):
        c = _voting(_comm(n, r), store, timeout=1.0, gen=1)
        if r != 0:
            c.abort()                                   # rank 1 never calls shrink
            return None
        with pytest.raises(errors.NcclTimeoutError, match=r"rank 1 did not reach shrink\("
                                                          r"exclude=\[2\]\) within 1 s"):
            c.shrink([2])
        c.abort()
        return True
    try:
        with standin(version=NEW) as eng:
            assert run_ranks(3, one, 3)[:2] == [[3.0, 3.0], [3.0, 3.0]]
        assert eng.violations == []
        with standin(version=NEW) as eng:
            assert run_ranks(3, alone, 3)[0] is True
        with standin(version=NEW) as eng:
            assert run_ranks(3, differ, 3)[:2] == [True, True]
    finally:
        store.close()


def test_shrink_with_abort_revokes_the_parent():
    """Rank 2 leaves; the survivors shrink it out with abort=True (a config given: its
    address reaches NCCL -- issue 35's defect 2 failed in ctypes here)."""
    def one(r: int, n: int):
        c = _comm(n, r)
        if r == 2:
            c.abort()
            return c.state
        child = c.shrink([2], abort=True, config=ncclpy.Config(blocking=True))
        assert c.state == "revoked" and (child.rank, child.world_size) == (r, 2)
        half = child.split(0, -r)
        assert (half.rank, half.world_size) == (1 - r, 2)
        half.close()
        child.close()
        c.close()
        return c.state
    with standin(version=NEW) as eng:
        assert run_ranks(3, one, 3) == ["aborted"] * 3
    assert eng.violations == [] and {c[2] for c in eng.calls
                                     if c[0].startswith("ncclCommShrink:")} == {1}


def test_shrink_refuses_an_empty_exclude_list_before_nccl_and_leaves_the_parent_usable():
    """NCCL refuses excludeRanksCount == 0 (issue 35's defect 5): ncclpy says so first, and
    with abort=True the parent is not revoked for a shrink that never happened."""
    def one(r: int, n: int):
        c = _comm(n, r)
        for abort in (False, True):
            with pytest.raises(errors.ArgumentError, match="exclude: expected at least one"):
                c.shrink([], abort=abort)
        assert c.state == "usable"
        c.close()
    with standin(version=NEW) as eng:
        run_ranks(2, one, 2)
    assert _calls(eng, "ncclCommShrink") == [] and eng.violations == []


def test_shrink_arguments_are_refused_precisely():
    assert exclude_list([3, 1], 0, 4) == [1, 3]
    for bad, exc, text in [([0], errors.ArgumentError, "lists this rank"),
                           ([], errors.ArgumentError, "expected at least one rank"),
                           ([1, 1], errors.ArgumentError, "listed twice"),
                           ([4], errors.ArgumentError, "expected an int <= 3"),
                           ("1", errors.ArgumentTypeError, "expected a list of ranks"),
                           ([True], errors.ArgumentTypeError, "must be an int")]:
        with pytest.raises(exc, match=text):
            exclude_list(bad, 0, 4)

    def old(r: int, n: int):
        c = _comm(n, r)
        try:
            with pytest.raises(errors.VersionError, match=r"ncclCommRevoke needs NCCL >= 2\.28\.7"):
                c.revoke()
            with pytest.raises(errors.VersionError, match="ncclCommRevoke"):
                c.on_failure = "revoke"
            with pytest.raises(errors.ArgumentError, match="expected 'abort' or 'revoke'"):
                c.on_failure = "retry"
        finally:
            c.close()
    with standin(version=22803):
        run_ranks(2, old, 2)


def test_a_revoking_watchdog_names_the_suspects_and_leaves_the_handle_for_shrink(caplog):
    """... and its log line says what it did: revoked, not aborted (a GPU run's log said
    "aborted (ncclCommAbort)" for a revoke, 2026-11-26)."""
    import logging
    from ncclpy.debug.watchdog import Watchdog
    caplog.set_level(logging.ERROR, logger="ncclpy.debug.watchdog")
    verdict = threading.Event()

    def one(r: int, n: int):
        c = _comm(n, r, timeout=1.0)
        if r == 1:
            assert verdict.wait(HANG)                   # never makes the all_reduce
            c.abort()
            return None
        c.on_failure = "revoke"
        c._watchdog = Watchdog(c, None, interval=0.2, tick=0.05).start()
        w = c.all_reduce(DevArray(np.ones(2, np.float32), device=r))
        try:
            with pytest.raises(errors.CommAbortedError) as ei:
                w.wait(timeout=30)
        finally:
            verdict.set()
        c.close()
        return ei.value
    with standin(version=NEW) as eng:
        err = run_ranks(2, one, 2)[0]
    assert err.reason == "timeout" and list(err.suspects) == [1]
    assert "was revoked (ncclCommRevoke; on_failure='revoke')" in str(err)
    said = [r.getMessage() for r in caplog.records if r.name == "ncclpy.debug.watchdog"]
    assert said and all("was revoked (ncclCommRevoke" in m and "was aborted" not in m
                        for m in said), said
    assert len(_calls(eng, "ncclCommRevoke")) == 1 and eng.violations == []


def test_grow_two_ranks_to_three():
    box: dict = {}
    ready = threading.Event()

    def one(r: int, n: int):
        if r == 2:                                      # the new rank
            ready.wait(30)
            g = ncclpy.grow_join(3, 2, box["uid"], device=2)
        else:
            c = _comm(2, r)
            if r == 0:
                box["uid"] = c.grow_unique_id()
                ready.set()
                g = c.grow(3, box["uid"])
            else:
                with pytest.raises(errors.ArgumentError, match="grow: world_size"):
                    c.grow(2)
                g = c.grow(3)
        x = DevArray(np.full(2, r + 1, np.float32), device=r)
        g.all_reduce(x).wait()
        g.close()
        if r != 2:
            c.close()
        return (g.rank, g.world_size, x.a.tolist())
    with standin(version=NEW) as eng:
        got = run_ranks(3, one, 3)
    assert got == [(r, 3, [6.0, 6.0]) for r in range(3)] and eng.violations == []


def test_a_nonblocking_grow_waits_for_the_grown_communicator_on_every_rank():
    """Nonblocking parents (their config copied by NCCL) and a nonblocking new rank: ncclCommGrow
    returns ncclInProgress and the child is polled ready before it is used; NCCL writes the new
    rank's handle before its async init, and grow_join reads it then."""
    box: dict = {}
    ready = threading.Event()
    nb = Config(blocking=False)

    def one(r: int, n: int):
        if r == 2:
            ready.wait(30)
            g = ncclpy.grow_join(3, 2, box["uid"], device=2, config=nb)
        else:
            c = Communicator(2, r, UID, r, nb)
            if r == 0:
                box["uid"] = c.grow_unique_id()
                ready.set()
            g = c.grow(3, box.get("uid") if r == 0 else None)
        x = DevArray(np.full(2, r + 1, np.float32), device=r)
        g.all_reduce(x).wait()
        out = (g.rank, g.world_size, g.nonblocking, x.a.tolist())
        box[r] = g._handle
        g.close()
        if r != 2:
            c.close()
        return out
    with standin(version=NEW, polls=3) as eng:
        got = run_ranks(3, one, 3)
        calls = [(c[0], c[1]) for c in eng.calls]
    assert got == [(r, 3, True, [6.0, 6.0]) for r in range(3)] and eng.violations == []
    assert len([c for c in calls if c[0] == "ncclCommGrow"]) == 3
    for r in range(3):                  # polled in progress, then ready, before its first query
        first_query = calls.index(("ncclCommUserRank", box[r]))
        assert calls[:first_query].count(("ncclCommGetAsyncError", box[r])) >= 4, (r, calls)


# -- suspend, resume, memory statistics ---------------------------------------------------------

def test_suspend_resume_and_the_memory_statistics():
    def one(r: int, n: int):
        c = _comm(n, r)
        x = DevArray(np.ones(2, np.float32), device=r)
        before = c.mem_stats()
        c.suspend()
        during = c.mem_stats()
        with pytest.raises(errors.NcclpyError, match=r"suspended \(ncclCommSuspend\); call "
                                                     r"resume\(\) first"):
            c.all_reduce(x)
        with pytest.raises(errors.NcclpyError, match="suspended"):
            c.suspend()
        c.resume()
        c.resume()                                      # not suspended: a no-op
        c.all_reduce(x).wait()
        c.suspend()
        c.close()                                       # resumes first, then closes
        return before, during, x.a.tolist()
    with standin(version=NEW) as eng:
        got = run_ranks(2, one, 2)
    for before, during, x in got:
        assert before == {"suspendable_bytes": 1 << 20, "suspended": 0,
                          "persistent_bytes": 1 << 16, "total_bytes": (1 << 16) + (1 << 20)}
        # mem_manager.cc ncclCommMemStats: the suspendable bytes are what the communicator
        # holds (totalScratch + ...), suspended or not; only "suspended" says it
        assert during == dict(before, suspended=1) and x == [2.0, 2.0]
    assert eng.violations == []


def test_memory_calls_need_nccl_2_29_7():
    def old(r: int, n: int):
        c = _comm(n, r)
        try:
            for call in (c.suspend, c.mem_stats):
                with pytest.raises(errors.VersionError, match=r"needs NCCL >= 2\.29\.7"):
                    call()
        finally:
            c.close()
    with standin(version=22903):
        run_ranks(2, old, 2)


def test_nccl_empty_refuses_a_bad_framework_before_any_allocation():
    with pytest.raises(errors.ArgumentError, match="framework: expected 'cupy' or 'torch'"):
        ncclpy.nccl_empty(4, framework="jax")
    with pytest.raises(errors.ArgumentError, match=r"shape\[0\]"):
        ncclpy.nccl_empty([-1])


def test_check_window_runs_the_symmetric_collectives_only():
    from ncclpy.check import cases as C
    from ncclpy.check.runner import WINDOW_COLLECTIVES, windowed
    mk = lambda coll, count=8, variant="": C.Case(coll, "float32", None, None, count, "8", 0,
                                                  False, variant)
    assert windowed(mk("all_reduce")) and windowed(mk("all_to_all"))
    assert not windowed(mk("gather")) and not windowed(mk("send_recv"))
    assert not windowed(mk("all_to_all", variant="uneven")) and not windowed(mk("all_reduce", 0))
    assert "scatter" not in WINDOW_COLLECTIVES


def test_a_window_block_on_a_revoked_communicator_keeps_the_revoke_error():
    def one(r: int, n: int):
        c = _comm(n, r)
        with pytest.raises(errors.CommAbortedError, match="revoked by comm.revoke"):
            with c.register_window(c.mem_alloc(64)) as win:
                c.revoke()
                c.all_reduce(DevArray(np.ones(2, np.float32), device=r))
        assert win.state == "closed"
        c.close()
    with standin(version=NEW) as eng:
        run_ranks(2, one, 2)
    assert eng.violations == [] and len(_calls(eng, "ncclCommWindowDeregister")) == 2


def test_the_on_failure_variable_is_checked_before_nccl_makes_a_communicator(monkeypatch):
    monkeypatch.setenv("NCCLPY_ON_FAILURE", "revoke")
    with standin(version=22803) as eng:
        with pytest.raises(errors.VersionError, match=r"ncclCommRevoke needs NCCL >= 2\.28\.7"):
            Communicator(1, 0, UID, 0, Config(blocking=True))
    assert not [c for c in eng.calls if c[0].startswith("ncclCommInitRank")]
    monkeypatch.setenv("NCCLPY_ON_FAILURE", "retry")
    with standin(version=NEW) as eng:
        with pytest.raises(errors.ArgumentError, match="NCCLPY_ON_FAILURE: expected 'abort' or "
                                                       "'revoke', got 'retry'"):
            Communicator(1, 0, UID, 0, Config(blocking=True))
    monkeypatch.setenv("NCCLPY_ON_FAILURE", "revoke")
    with standin(version=NEW):
        c = Communicator(1, 0, UID, 0, Config(blocking=True))
        assert c.on_failure == "revoke"
        c.close()
