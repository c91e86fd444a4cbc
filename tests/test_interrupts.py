"""Ctrl-C at every point of a call (issue 49, item 2), on the STAND-IN for libnccl and CUDA.

A KeyboardInterrupt can arrive wherever CPython checks for signals (tests/interrupt_util.py
says where).  For each such point of an eager call (the fast path, both NCCL routes), a
prepared call and the general path, one call is interrupted there, and then:

* the communicator's API lock is free (another thread takes it at once), the in-call marker
  and the counts of calls inside NCCL are clear: a later call, an abort and a close all work;
* if the NCCL call was made, a Work that keeps the buffers and has its event recorded is with
  the tracker (the op runs when the peer arrives, on memory nobody freed); if it was not, the
  tracker got nothing that stays;
* the flight recorder has no entry left "issued" once every call was completed: an entry is
  failed (the call never reached NCCL) or completes with the call;
* no event leaked out of the pool.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional

import numpy as np
import pytest

import ncclpy

from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator
from ncclpy.debug.reaper import reaper
from ncclpy.comm.work import event_pool
from ncclpy.debug import recorder as _recorder

from interrupt_util import Injector, inject_each
from nccl_standin import DevArray, run_ranks, standin

UID = bytes(range(128))


def _pair(route: str):
    cfg = None if route == "cupy" else Config(blocking=True)
    return run_ranks(2, lambda r: Communicator(2, r, UID, r, cfg, timeout=10.0))


def _made(eng, comm, name: str) -> int:
    return sum(1 for n, h, _ in list(eng.calls) if n == name and h == comm._handle)


def _lock_is_free(api) -> bool:
    got: List[bool] = []

    def take() -> None:
        ok = api.acquire(timeout=2.0)
        got.append(ok)
        if ok:
            api.release()
    t = threading.Thread(target=take)
    t.start()
    t.join(5.0)
    return bool(got and got[0])


def _keeps(keep: Any, x: Any) -> bool:
    """Whether ``keep`` (a Work's, nested tuples) holds ``x``."""
    if keep is x:
        return True
    return type(keep) is tuple and any(_keeps(k, x) for k in keep)


def _held(comm) -> List[Any]:
    """The Works comm's tracker (the reaper here) holds, oldest first."""
    for q, pend in reaper().lanes:
        if q is comm._watch:
            return list(pend) + list(q)
    return []


class _Case:
    """One communicator pair and a call of rank 0's to interrupt; rank 1 makes the matching
    call after each interrupted one that reached NCCL."""

    def __init__(self, eng, route: str, how: str) -> None:
        self.eng = eng
        self.c0, self.c1 = _pair(route)
        self.x0 = DevArray(np.ones(4, np.float32), 0)
        self.x1 = DevArray(np.ones(4, np.float32), 1)
        self.how = how
        self.p0 = self.c0.prepare("all_reduce", self.x0) if how == "prepared" else None
        self.s = None
        if how == "general":                  # (and on a stream of its own: asked whether it
            self.c0._hot = None               # captures)
            self.s = eng.cuda.new_stream()
        eng.cuda.set_device(0)
        self.call()                                  # the first call: an entry is made
        self.peer()
        self.call()                                  # and found: the calls below are hits
        self.peer()
        self.settle()
        self.events = self._events()
        self.entries = self.c0._recorder.count if self.c0._recorder is not None else 0

    def call(self) -> Any:
        if self.p0 is not None:
            return self.p0()
        if self.how == "premul":              # the plan's executor (an op made and destroyed)
            return self.c0.all_reduce(self.x0, op=ncclpy.premul_sum(0.5))
        return self.c0.all_reduce(self.x0, stream=self.s)

    def peer(self) -> None:
        self.eng.cuda.set_device(1)
        try:
            op = ncclpy.premul_sum(0.5) if self.how == "premul" else "sum"
            self.c1.all_reduce(self.x1, op=op).wait()
        finally:
            self.eng.cuda.set_device(0)

    def settle(self) -> None:
        """Wait until rank 0's tracker released every Work (all completed)."""
        for _ in range(200):
            reaper().tick()
            if not _held(self.c0):
                return
            threading.Event().wait(0.01)
        raise AssertionError(f"the tracker still holds {_held(self.c0)}")

    def _events(self) -> int:
        pool = event_pool(0)
        return pool.created - len(pool.free)      # events out of the pool (in flight)

    def check(self, err: Optional[BaseException], inj: Injector, made_before: int) -> None:
        c0, life = self.c0, self.c0._life
        where = inj.where
        assert _lock_is_free(life.api), f"the API lock is held after an interrupt at {where}"
        assert not life.api._is_owned(), f"this thread still owns the API lock ({where})"
        assert life.hot is None, f"the in-call marker is left set ({where})"
        assert (life.inflight, life.calls) == (0, 0), \
            f"counted inside NCCL after an interrupt at {where}: {life.inflight}, {life.calls}"
        made = _made(self.eng, c0, "ncclAllReduce") - made_before
        held = [w for w in _held(c0) if not w._done]
        if made:
            assert held, f"the call reached NCCL but no Work keeps its buffers ({where})"
            w = held[-1]
            assert _keeps(w._keep, self.x0), \
                f"the Work does not keep the buffer ({where}): {w._keep}"
            assert w._event is not None, f"the Work has no event ({where})"
            self.peer()
        self.settle()
        assert self._events() == self.events, f"an event left the pool for good ({where})"
        rec = c0._recorder
        if rec is not None:
            left = [e for e in rec.ring if e[_recorder.STATE] == _recorder.ISSUED]
            assert not left, f"recorder entries left issued after an interrupt at {where}"
            ents = [e for e in rec.ring if e[0] >= self.entries]
            states = [e[_recorder.STATE] for e in ents]
            if made:                  # completed with the call; said interrupted or not
                assert states == [_recorder.COMPLETED], (states, where)
            elif states != [] and states != [_recorder.FAILED]:   # tracked to be safe: then
                assert states == [_recorder.COMPLETED] and \
                    "may not have reached NCCL" in (ents[0][_recorder.ERR] or ""), \
                    f"the recorder claims a call NCCL never had ran: {ents} ({where})"
            self.entries = rec.count


@pytest.mark.parametrize("route,how", [("cupy", "eager"), ("ctypes", "eager"),
                                       ("cupy", "prepared"), ("ctypes", "general"),
                                       ("ctypes", "premul")])
def test_an_interrupt_anywhere_in_a_call_leaves_nothing_held_or_untracked(route, how):
    with standin() as eng:
        case = _Case(eng, route, how)
        state = {"made": 0}

        def fn() -> None:
            state["made"] = _made(eng, case.c0, "ncclAllReduce")
            case.call()

        def after(err: Optional[BaseException], inj: Injector) -> None:
            if err is None:           # the last run: nothing interrupted, the call was made
                case.peer()
                case.settle()
                if case.c0._recorder is not None:
                    case.entries = case.c0._recorder.count
                return
            case.check(err, inj, state["made"])
        points = inject_each(fn, after)
        assert len(points) > 10, points            # the call's points were all visited
        case.eng.cuda.set_device(0)
        case.call()                                # the communicator still works
        case.peer()
        case.settle()
        case.c0.abort(), case.c1.abort()
        assert case.c0.state == "aborted"
    assert eng.violations == []
