"""The executor's contracts that no other test pinned (found by ``python -m tools.mutation run
execute``): what a group end owes the communicators inside it, what reaches the user when NCCL
fails or an abort waited for the call, the flight recorder's view of the general path, and
checked mode's dump.  CPU only, through the stand-in (tests/nccl_standin.py): a one-rank
communicator where one is enough (send/recv to itself inside a group), two thread-ranks where
a peer matters.

What a user would lose if one of these broke:

* copies out of scratch that never happen (a list-form call inside a group), or that overwrite
  the user's buffer with what a simulated group never computed;
* a group end that another thread's call on the same communicator overtakes inside NCCL (NCCL's
  calls are not thread-safe per communicator), or that the watchdog cannot see blocked;
* a nested group that fails at its inner end, or a failed group end whose Works report success;
* an NCCL error that surfaces as an AttributeError, a watchdog verdict that a call blocked in
  NCCL never reports (or names the wrong call), a call the abort waited for that returns as
  if it ran -- or a call that returned within the abort's grace that raises instead;
* a general-path call missing from the flight recorder, recorded at the wrong call site, or
  left "issued" in a dump although its completion was seen;
* checked mode: a hang without the dump its message should name, a group whose mismatch the
  group end does not raise, a refusal that comes only at the group end.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator, lifecycle
from ncclpy.errors import CallCheckTimeout, CommAbortedError

from nccl_standin import DevArray, run_ranks, standin
from wait_util import in_thread, wait_until

UID = bytes(range(128))
REMOTE = 6                                   # ncclRemoteError


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", 0.3)
    monkeypatch.setattr(lifecycle, "ABORT_JOIN", 0.5)
    monkeypatch.setenv("NCCLPY_EXIT_ON_STUCK", "0")   # a verdict on a stuck call: no exit


def _arr(values, dev=0, dtype=np.float32) -> DevArray:
    return DevArray(np.asarray(values, dtype=dtype), device=dev)


def _one(blocking=True) -> Communicator:
    """A one-rank communicator (it sends to and receives from itself inside a group)."""
    return Communicator(1, 0, UID, 0, Config(blocking=blocking))


def _names(eng, since=0) -> list:
    return [c[0] for c in eng.calls[since:]]


def _self_exchange(c, x, y):
    with c.group():
        c.send(x, 0)
        return c.recv(y, 0)


# -- copies out of scratch in a group ----------------------------------------------------------
def _pair() -> list:
    return run_ranks(2, lambda r: Communicator(2, r, UID, r, Config(blocking=True)))


def test_a_list_form_call_in_a_group_copies_out_after_the_group_end():
    """all_gather into a list of buffers stages through scratch: the copies out of it run at
    the outermost group end, after NCCL ran the gather, into each list buffer."""
    def rank(r, c):
        out = [_arr(np.zeros(2), r), _arr(np.zeros(2), r)]
        with c.group():
            w = c.all_gather(_arr([r + 1.0, -r], r), out)
        w.wait()
        nested = [_arr(np.zeros(1), r), _arr(np.zeros(1), r)]
        with c.group():                                     # nested: at the outermost end
            with c.group():
                w2 = c.all_gather(_arr([10.0 * r], r), nested)
        w2.wait()
        return [o.a.tolist() for o in out + nested]
    with standin() as eng:
        cs = _pair()
        assert eng.calls and run_ranks(2, lambda r: rank(r, cs[r])) == \
            [[[1.0, 0.0], [2.0, -1.0], [0.0], [10.0]]] * 2
        run_ranks(2, lambda r: cs[r].close())
    assert eng.violations == []


def test_a_simulated_group_launches_nothing_and_copies_nothing():
    """group(simulate=True): NCCL estimates and launches nothing, so each Work fails with
    NotLaunchedError and no copy out of (never written) scratch lands in the user's buffer."""
    def rank(r, c):
        out = [_arr([7.0], r), _arr([7.0], r)]
        with c.group(simulate=True) as g:
            w = c.all_gather(_arr([1.0 + r], r), out)
        assert g.estimated_time_us is not None
        with pytest.raises(errors.NotLaunchedError, match="simulate=True"):
            w.wait()
        return [o.a.tolist() for o in out]
    with standin() as eng:
        cs = _pair()
        assert run_ranks(2, lambda r: rank(r, cs[r])) == [[[7.0], [7.0]]] * 2
        c = cs[0]
        y = _arr([9.0])
        with c.group(simulate=True):
            with c.group():
                w = c.recv(y, 1)                    # nested inside the simulated group
        with pytest.raises(errors.NotLaunchedError):
            w.wait()
        assert y.a.tolist() == [9.0]
        run_ranks(2, lambda r: cs[r].close())
    assert eng.violations == []


def test_a_simulated_group_refuses_a_nonblocking_communicator_before_it_opens():
    with standin() as eng:
        c = _one(blocking=False)
        before = len(eng.calls)
        for _ in range(2):
            with pytest.raises(errors.UnsupportedError, match="simulates nothing"):
                with c.group(simulate=True):
                    c.all_reduce(_arr([1.0]))
        assert "ncclGroupStart" not in _names(eng, before)   # refused before the group
        assert ncclpy.comm.execute.group_depth() == 0
        c.close()                                           # nothing holds it: no hang
        assert c.closed
    assert eng.violations == []


# -- the group end ---------------------------------------------------------------------------
def test_a_blocking_communicators_group_makes_only_the_groups_calls():
    """A blocking communicator's group end returns once NCCL launched the group: nothing is
    polled after it (ncclCommGetAsyncError is the nonblocking communicators' wait)."""
    with standin() as eng:
        c = _one()
        x, y = _arr([1.0, 2.0]), _arr([0.0, 0.0])
        _self_exchange(c, x, y).wait()
        before = len(eng.calls)
        w = _self_exchange(c, x, y)
        assert _names(eng, before) == ["ncclGroupStart", "ncclSend", "ncclRecv",
                                       "ncclGroupEnd"]
        w.wait()
        assert y.a.tolist() == [1.0, 2.0]
        c.close()
    assert eng.violations == []


def test_the_group_end_is_a_call_inside_nccl_for_the_watchdog_and_other_threads():
    """While the outermost ncclGroupEnd is inside NCCL, the communicator shows one call inside
    (what the watchdog times, named ncclGroupEnd) and holds its API lock: another thread's
    call on it enters NCCL only after the group end returned."""
    with standin() as eng:
        c = _one()
        inside = []
        real_end = c._dispatch["GroupEnd"]

        def end():
            inside.append(True)
            try:
                return real_end()
            finally:
                inside.pop()
        c._dispatch["GroupEnd"] = end
        eng.slow["ncclGroupEnd"] = 0.8                     # the other call comes meanwhile
        x, y = _arr([1.0]), _arr([0.0])
        t, out = in_thread(_self_exchange, c, x, y)
        wait_until(lambda: inside, "the group end inside NCCL")
        life = c._life
        assert life.calls == 1 and life._what == "ncclGroupEnd"
        seen = []
        real_ar = c._dispatch["AllReduce"]

        def all_reduce(*a, **k):
            seen.append(bool(inside))
            return real_ar(*a, **k)
        c._dispatch["AllReduce"] = all_reduce
        c.all_reduce(_arr([2.0]), op=ncclpy.premul_sum(0.5)).wait()   # the general path
        t.join(10)
        assert seen == [False] and "error" not in out
        out["value"].wait()
        assert y.a.tolist() == [1.0] and life.calls == 0
        c.close()
    assert eng.violations == []


def test_a_nested_group_ends_at_its_outermost_end():
    with standin() as eng:
        c = _one()
        x, y = _arr([3.0]), _arr([0.0])
        before = len(eng.calls)
        with c.group():
            with c.group():
                w = _self_exchange(c, x, y)
            with pytest.raises(errors.NcclpyError, match="outermost group ends"):
                w.wait()
        w.wait()
        assert y.a.tolist() == [3.0]
        assert _names(eng, before).count("ncclGroupEnd") == 3    # one per level
        c.close()
    assert eng.violations == []


def test_a_failed_group_end_fails_its_works_with_nccls_error():
    with standin() as eng:
        c = _one()
        x, y = _arr([3.0]), _arr([0.0])
        eng.fail["ncclGroupEnd"] = REMOTE
        with pytest.raises(errors.NcclRemoteError):
            _self_exchange(c, x, y)
        eng.fail["ncclGroupEnd"] = REMOTE
        works = []
        with pytest.raises(errors.NcclRemoteError) as ei:
            with c.group():
                works.append(c.send(x, 0))
                works.append(c.recv(y, 0))
        assert type(ei.value) is errors.NcclRemoteError and ei.value.__cause__ is None
        for w in works:
            with pytest.raises(errors.NcclRemoteError):
                w.wait()
        assert y.a.tolist() == [0.0]
        c.abort()
    assert eng.violations == []


# -- NCCL errors and aborts on the general path ------------------------------------------------
def test_an_nccl_error_of_a_call_is_nccls_error():
    with standin() as eng:
        c = _one()
        eng.fail["ncclAllReduce"] = REMOTE
        with pytest.raises(errors.NcclRemoteError) as ei:
            c.all_reduce(_arr([1.0]), op=ncclpy.premul_sum(2.0))   # the general path
        assert type(ei.value) is errors.NcclRemoteError and ei.value.__cause__ is None
        c.abort()
    assert eng.violations == []


def test_an_nccl_error_after_the_watchdogs_verdict_raises_the_verdict():
    """NCCL's call fails after the watchdog decided (its verdict is the communicator's abort
    error): the caller gets the verdict, CommAbortedError naming the suspects, with NCCL's
    error as its cause -- on the general path and at a group end."""
    verdict = CommAbortedError("rank(s) 1 died", collective="send", seq=4, suspects=(1,),
                               reason="peer_dead")
    with standin() as eng:
        c = _one()
        real_send = c._dispatch["Send"]

        def send(*a, **k):               # the verdict lands while the call is inside NCCL
            c._life.abort_error = verdict
            return real_send(*a, **k)
        c._dispatch["Send"] = send
        eng.fail["ncclSend"] = REMOTE
        with pytest.raises(CommAbortedError) as ei:
            with c.group():
                c.send(_arr([1.0]), 0)
        assert ei.value is verdict and ei.value.suspects == [1]
        assert isinstance(ei.value.__cause__, errors.NcclRemoteError)
        c._life.abort_error = None
        c._dispatch["Send"] = real_send
        real_end = c._dispatch["GroupEnd"]

        def end():
            c._life.abort_error = verdict
            return real_end()
        c._dispatch["GroupEnd"] = end
        eng.fail["ncclGroupEnd"] = REMOTE
        verdict.__cause__ = None
        with pytest.raises(CommAbortedError) as ei:
            _self_exchange(c, _arr([1.0]), _arr([0.0]))
        assert ei.value is verdict and isinstance(ei.value.__cause__, errors.NcclRemoteError)
        c._life.abort_error = None
        c.abort()
    assert eng.violations == []


def test_a_call_an_abort_waited_for_raises_the_abort(monkeypatch, tmp_path):
    """The watchdog's verdict while a general-path call (a PreMulSum op to create) is blocked
    inside NCCL: the abort waits for it (NCCL frees the communicator in ncclCommAbort) and
    says which call it waits for (the all_reduce, not the op's creation that came first);
    when the call returns it raises the verdict, never a Work as if nothing happened, and
    the abort then runs."""
    from ncclpy.debug.watchdog import Decision
    monkeypatch.setenv("NCCLPY_TRACE_DIR", str(tmp_path))    # the verdict's dump
    with standin() as eng:
        c0, c1 = _pair()
        eng.slow["ncclAllReduce"] = 1.0                     # blocked, like a dead peer's
        t, out = in_thread(c0.all_reduce, _arr([1.0]), None, ncclpy.premul_sum(2.0))
        wait_until(lambda: "ncclAllReduce" in _names(eng), "the all_reduce inside NCCL")
        c0._watchdog_abort(Decision("peer_dead", "all_reduce", 3, (1,), "rank 1 died"))
        assert c0.state == "aborting" and "ncclCommAbort" not in _names(eng)
        assert c0._life._what == "all_reduce"               # not the op's creation, done
        t.join(10)
        err = out.get("error")
        assert isinstance(err, CommAbortedError) and err.reason == "peer_dead", out
        assert err.suspects == [1] and "waits until all_reduce returns" in str(err)
        wait_until(lambda: c0.state == "aborted", "the deferred abort")
        names = _names(eng)
        assert names.index("ncclAllReduce") < names.index("ncclCommAbort")
        c1.abort()
    assert eng.violations == []


# -- the flight recorder and checked mode on the general path ----------------------------------
def _send_here(c, x):
    return c.send(x, 0), sys._getframe().f_lineno


def test_a_general_path_call_is_recorded_at_its_call_site(monkeypatch):
    monkeypatch.delenv("NCCLPY_TRACE_BUFFER", raising=False)    # the default ring
    with standin() as eng:
        c = _one()
        assert c._recorder is not None
        with c.group():
            (w, line) = _send_here(c, _arr([1.0]))
            c.recv(_arr([0.0]), 0)
        w.wait()
        e = [d for d in c._recorder.entries() if d["coll"] == "send"]
        assert len(e) == 1 and e[0]["state"] == "completed" and e[0]["group"]
        assert e[0]["site"] == f"{__file__}:{line}:_send_here"
        c.close()
    assert eng.violations == []
    monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "0")           # off: no recorder, calls work
    with standin() as eng:
        c = _one()
        assert c._recorder is None
        y = _arr([0.0])
        _self_exchange(c, _arr([2.0]), y).wait()
        assert y.a.tolist() == [2.0]
        c.close()
    assert eng.violations == []


def test_a_checked_mode_timeout_writes_the_dump_its_error_names(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCLPY_TRACE_DIR", str(tmp_path))

    class Hangs:
        """checked mode's checker, whose peer never arrives at the check"""

        def check(self, plans, names):
            raise CallCheckTimeout(f"checked mode: rank 1 never reached {names[0]}",
                                   missing=[1])
    with standin() as eng:
        c = _one()
        assert c._recorder is not None
        c._checker = Hangs()
        with pytest.raises(CallCheckTimeout) as ei:
            c.all_reduce(_arr([1.0]))
        msg = str(ei.value)
        assert "flight-recorder dump: " in msg and ei.value.missing == [1]
        path = msg.split("flight-recorder dump: ", 1)[1].strip()
        assert os.path.dirname(path) == str(tmp_path) and os.path.exists(path)
        entries = [d for d in c._recorder.entries() if d["coll"] == "all_reduce"]
        assert entries[-1]["state"] == "failed" and "CallCheckTimeout" in entries[-1]["error"]
        assert "ncclAllReduce" not in _names(eng)
        c._checker = None
        c.close()
    assert eng.violations == []


def test_a_call_completed_before_its_entry_is_attached_is_stamped_completed():
    """A tracker may see a general-path call complete before the recorder's entry is attached
    to its Work (another thread's look, here one made at once): the entry is stamped
    completed all the same, so a dump never shows a finished call as still issued."""
    class AtOnce(list):
        """a tracker that looks at each Work as it arrives"""

        def append(self, w):
            super().append(w)
            w.is_completed()

        def __iadd__(self, ws):           # the call path hands Works over with +=
            for w in ws:
                self.append(w)
            return self
    with standin() as eng:
        c = _one()
        c._watch = AtOnce()
        w = c.all_reduce(_arr([1.0, 2.0]), op=ncclpy.premul_sum(2.0))   # the general path
        assert w._done                                      # seen complete inside the call
        e = [d for d in c._recorder.entries() if d["coll"] == "all_reduce"]
        assert [d["state"] for d in e] == ["completed"] and e[0]["t_done"] is not None
        w.wait()
        assert [d["state"] for d in c._recorder.entries()] == ["completed"]
        c.close()
    assert eng.violations == []


class _Agrees:
    """checked mode's checker: every rank made the same calls"""

    def __init__(self):
        self.checked = []

    def check(self, plans, names):
        self.checked.append(tuple(names))


def test_a_checked_mismatch_in_a_group_is_raised_by_the_group_end():
    """Checked mode defers a group's calls to its outermost end and compares them there: a
    mismatch is raised by the group end (and fails each Work); NCCL sees none of the calls."""
    class Differs(_Agrees):
        def check(self, plans, names):
            super().check(plans, names)
            raise errors.CallMismatchError(f"checked mode: rank 1 called something else than "
                                           f"{', '.join(names)}")
    with standin() as eng:
        c = _one()
        c._checker = Differs()
        before = len(eng.calls)
        with pytest.raises(errors.CallMismatchError, match="all_reduce, all_reduce") as ei:
            with c.group():
                ws = [c.all_reduce(_arr([1.0])), c.all_reduce(_arr([2.0]))]
        assert c._checker.checked == [("all_reduce", "all_reduce")]    # once, the group
        for w in ws:
            with pytest.raises(errors.CallMismatchError) as wi:
                w.wait()
            assert wi.value is ei.value
        assert "ncclAllReduce" not in _names(eng, before)
        c._checker = None
        c.close()
    assert eng.violations == []


def test_a_checked_call_in_a_simulated_group_is_refused_at_the_call():
    """A checked call inside a group makes no NCCL call until the group end, but its
    communicator takes part in the group from the call on: a nonblocking one in a simulated
    group (NCCL would launch its calls) is refused at the call, before anything is deferred
    or compared, and the block goes on."""
    with standin() as eng:
        nb = _one(blocking=False)
        nb._checker = _Agrees()
        before = len(eng.calls)
        with ncclpy.group(simulate=True):
            with pytest.raises(errors.UnsupportedError, match="simulates nothing"):
                nb.all_reduce(_arr([1.0]))
            assert ncclpy.comm.execute.group_state().checks == []
        assert nb._checker.checked == [] and "ncclAllReduce" not in _names(eng, before)
        nb._checker = None
        nb.close()
    assert eng.violations == []


def test_a_call_that_returned_within_the_aborts_grace_returns_its_work(monkeypatch):
    """An abort that waited for a call inside NCCL and saw it return within its grace did
    not have to defer: the call returns its Work (the abort then stops NCCL's work, which the
    Work reports), not the refusal a deferred abort gives."""
    monkeypatch.setattr(lifecycle, "ABORT_GRACE", 10.0)     # the call returns well within it
    with standin() as eng:
        c = _one()
        eng.slow["ncclAllReduce"] = 0.3
        t, out = in_thread(c.all_reduce, _arr([1.0]), None, ncclpy.premul_sum(2.0))
        wait_until(lambda: "ncclAllReduce" in _names(eng), "the all_reduce inside NCCL")
        c.abort()                                           # waits for it, then aborts
        t.join(10)
        assert "error" not in out and c.state == "aborted" and not c._life.deferred
        names = _names(eng)
        assert names.index("ncclAllReduce") < names.index("ncclCommAbort")
        with pytest.raises(errors.NcclpyError, match="abort"):
            out["value"].wait()
    assert eng.violations == []
