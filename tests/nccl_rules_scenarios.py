"""Scenarios of ncclpy/cpu/RULES.md, each run the same way on the real libnccl and on the
STAND-IN (tests/nccl_standin.py): the differential stage of issue 35.

Each :class:`Scenario` is tied to a row of the table (its ``row``: "F4", "E3", ...), calls NCCL only
through ``lib.fn(name)`` (ncclpy's ctypes declarations) on ONE-rank communicators on device 0, and
returns an observation made of plain values (return codes, whether an out pointer came back NULL,
the distinct ncclCommGetAsyncError states in order, ...).  ``expected`` is the observation NCCL's
source gives (the row cites it).  Every scenario cleans up after itself and names the functions
it needs (``needs``: skipped where the loaded NCCL lacks one).  Nothing here depends on the
machine (no symmetric-memory or NVLS outcome).

tests/test_standin_rules.py runs them on the stand-in (CPU); tests/gpu/test_standin_differential.py
runs them on the real libnccl (``python tests/nccl_rules_scenarios.py OUT.jsonl``: one JSON line
per scenario) and on the stand-in at the same version, and compares.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Scenario", "Inconclusive", "SCENARIOS", "by_id", "normalize", "run_one", "main"]

OK, CUDA_ERR, INVALID_ARG, INVALID_USAGE, IN_PROGRESS = 0, 1, 4, 5, 7
BOUND_S = 60.0          # the longest a scenario waits for a nonblocking operation


class Inconclusive(Exception):
    """The scenario could not show its behaviour on this run (e.g. a nonblocking init already
    finished before the call meant to find it in progress): reported as a skip, never as a
    made-up observation."""


@dataclass(frozen=True)
class Scenario:
    """One behaviour of NCCL: ``run(lib) -> observation``; ``expected`` (or
    ``expected(version)``) is what NCCL's source says (row ``row`` of the table).
    ``violations``: the stand-in violations the scenario commits on purpose (patterns, each
    matching exactly one; tests/nccl_standin.py ``check_violations``)."""

    id: str
    row: str
    needs: Tuple[str, ...]
    run: Callable[[Any], Any]
    expected: Any
    violations: Tuple[str, ...] = ()

    def expect(self, version: int) -> Any:
        """The expected observation for NCCL ``version``."""
        return normalize(self.expected(version) if callable(self.expected) else self.expected)

    def missing(self, lib: Any) -> List[str]:
        """The functions it needs that ``lib`` lacks (empty: it can run)."""
        return [n for n in self.needs if not lib.has(n)]


def normalize(obs: Any) -> Any:
    """The observation as JSON gives it back (tuples become lists)."""
    return json.loads(json.dumps(obs))


# -- helpers: one-rank communicators through the declared ctypes functions ---------------------
def _device0() -> None:
    from ncclpy._nccl import cuda
    cuda.cuda().set_device(0)


def _init(lib: Any, blocking: bool = True) -> Tuple[int, int]:
    """ncclCommInitRankConfig for a 1-rank world -> (handle, return code)."""
    from ncclpy._nccl.config import Config
    from ncclpy._nccl.functions import UniqueId
    _device0()
    uid = lib.get_unique_id()
    cfg = Config(blocking=blocking).to_struct(lib.version)
    h = ctypes.c_void_p(0)
    rc = lib.fn("ncclCommInitRankConfig")(ctypes.byref(h), 1, UniqueId.from_bytes(uid), 0,
                                          ctypes.addressof(cfg))
    if rc not in (OK, IN_PROGRESS) or not h.value:
        raise RuntimeError(f"ncclCommInitRankConfig of a 1-rank world gave {rc}")
    return h.value, rc


def _state(lib: Any, h: int) -> int:
    st = ctypes.c_int(-1)
    rc = lib.fn("ncclCommGetAsyncError")(h, ctypes.byref(st))
    if rc != OK:
        raise RuntimeError(f"ncclCommGetAsyncError gave {rc}")
    return st.value


def _states(lib: Any, h: int) -> List[int]:
    """The distinct states ncclCommGetAsyncError reports, in order, until it stops saying 7."""
    seen: List[int] = []
    deadline = time.monotonic() + BOUND_S
    while True:
        s = _state(lib, h)
        if not seen or seen[-1] != s:
            seen.append(s)
        if s != IN_PROGRESS:
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(f"the communicator stayed in progress for {BOUND_S} s")
        time.sleep(0.001)


def _ready(lib: Any, blocking: bool = True) -> int:
    h, _ = _init(lib, blocking)
    if _states(lib, h)[-1] != OK:
        _abort(lib, h)
        raise RuntimeError("the 1-rank communicator did not become ready")
    return h


def _abort(lib: Any, h: Optional[int]) -> None:
    """Clean-up: wait (bounded) until the comm is not in progress, then ncclCommAbort."""
    if not h:
        return
    try:
        _states(lib, h)
    finally:
        lib.fn("ncclCommAbort")(h)


def _group_depth_left(lib: Any) -> int:
    """How many ncclGroupEnd calls succeed before "not in a group call" (a depth NCCL left
    open); each closes it."""
    n = 0
    while n < 8 and lib.fn("ncclGroupEnd")() == OK:
        n += 1
    return n


def _sync() -> None:
    from ncclpy._nccl import cuda
    cu = cuda.cuda()
    ev = cu.event_create()
    try:
        cu.event_record(ev, 0)
        deadline = time.monotonic() + BOUND_S
        while not cu.event_query(ev):
            if time.monotonic() > deadline:
                raise TimeoutError("the default stream did not drain")
            time.sleep(0.001)
    finally:
        cu.event_destroy(ev)


class _Buf:
    """``nbytes`` of device memory from ncclMemAlloc (freed on exit, after the stream)."""

    def __init__(self, lib: Any, nbytes: int = 256) -> None:
        self.lib, self.nbytes = lib, nbytes
        _device0()
        p = ctypes.c_void_p(0)
        rc = lib.fn("ncclMemAlloc")(ctypes.byref(p), nbytes)
        if rc != OK or not p.value:
            raise RuntimeError(f"ncclMemAlloc gave {rc}")
        self.ptr = p.value

    def __enter__(self) -> int:
        return self.ptr

    def __exit__(self, *exc: Any) -> None:
        _sync()
        self.lib.fn("ncclMemFree")(self.ptr)


def _allreduce(lib: Any, h: int, buf: int, count: int = 4, op: int = 0, dtype: int = 7) -> int:
    return lib.fn("ncclAllReduce")(buf, buf, count, dtype, op, h, None)   # float32, sum


# -- the scenarios ----------------------------------------------------------------------------
def s_group_end_alone(lib: Any) -> Any:
    rc = lib.fn("ncclGroupEnd")()
    text = lib.last_error() if lib.has("ncclGetLastError") else "ncclGroupEnd: not in a group call."
    return {"rc": rc, "text": text}


def s_nested_group(lib: Any) -> Any:
    f = lib.fn
    return [f("ncclGroupStart")(), f("ncclGroupStart")(), f("ncclGroupEnd")(), f("ncclGroupEnd")(),
            f("ncclGroupEnd")()]


def s_error_strings(lib: Any) -> Any:
    return [lib.error_string(code) for code in range(10)]


def _error_strings(version: int) -> List[str]:
    texts = ["no error", "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
             "unhandled system error (run with NCCL_DEBUG=INFO for details)",
             "internal error - please report this issue to the NCCL developers",
             "invalid argument (run with NCCL_DEBUG=WARN for details)",
             "invalid usage (run with NCCL_DEBUG=WARN for details)",
             "remote process exited or there was a network error", "NCCL operation in progress"]
    return texts + ["timeout" if version >= 23000 else "unknown result code",
                    "unknown result code"]


def s_init_bad_rank(lib: Any) -> Any:
    from ncclpy._nccl.functions import UniqueId
    _device0()
    h = ctypes.c_void_p(0)
    rc = lib.fn("ncclCommInitRankConfig")(ctypes.byref(h), 1, UniqueId.from_bytes(
        lib.get_unique_id()), 1, None)
    if h.value:
        lib.fn("ncclCommAbort")(h.value)
    return {"rc": rc, "null": not h.value, "depth_left": _group_depth_left(lib)}


def s_nonblocking_init(lib: Any) -> Any:
    h, rc = _init(lib, blocking=False)
    try:
        return {"rc": rc, "states": _states(lib, h)}
    finally:
        _abort(lib, h)


def s_query_in_progress(lib: Any) -> Any:
    h, rc = _init(lib, blocking=False)
    try:
        out = ctypes.c_int(-1)
        if rc != IN_PROGRESS:
            raise Inconclusive("the nonblocking init had already finished")
        during = lib.fn("ncclCommCount")(h, ctypes.byref(out))
        _states(lib, h)
        after = lib.fn("ncclCommCount")(h, ctypes.byref(out))
        return {"during": during, "after": after, "count": out.value}
    finally:
        _abort(lib, h)


def s_collective_in_progress(lib: Any) -> Any:
    with _Buf(lib) as buf:
        h, rc = _init(lib, blocking=False)
        try:
            if rc != IN_PROGRESS:
                raise Inconclusive("the nonblocking init had already finished")
            during = _allreduce(lib, h, buf)
            return {"during": during, "final": _states(lib, h)[-1]}
        finally:
            _abort(lib, h)


def s_destroy_in_progress(lib: Any) -> Any:
    h, rc = _init(lib, blocking=False)
    try:
        if rc != IN_PROGRESS:
            raise Inconclusive("the nonblocking init had already finished")
        during = lib.fn("ncclCommDestroy")(h)
        depth = _group_depth_left(lib)
        _states(lib, h)
        after = lib.fn("ncclCommDestroy")(h)
        h = 0 if after == OK else h
        return {"during": during, "depth_left": depth, "after": after}
    finally:
        _abort(lib, h)


def s_queries(lib: Any) -> Any:
    h = _ready(lib)
    try:
        out = []
        for name in ("ncclCommCount", "ncclCommUserRank", "ncclCommCuDevice"):
            v = ctypes.c_int(-1)
            out.append([lib.fn(name)(h, ctypes.byref(v)), v.value])
        return out
    finally:
        _abort(lib, h)


def s_finalize_twice(lib: Any) -> Any:
    h = _ready(lib)
    first = lib.fn("ncclCommFinalize")(h)
    second = lib.fn("ncclCommFinalize")(h)
    destroy = lib.fn("ncclCommDestroy")(h)
    if destroy != OK:
        lib.fn("ncclCommAbort")(h)
    return {"first": first, "second": second, "destroy": destroy}


def s_finalize_twice_nonblocking(lib: Any) -> Any:
    h = _ready(lib, blocking=False)
    try:
        first = lib.fn("ncclCommFinalize")(h)
        done = _states(lib, h)[-1]
        second = lib.fn("ncclCommFinalize")(h)
        return {"first_ok": first in (OK, IN_PROGRESS), "done": done, "second": second,
                "state": _state(lib, h)}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_null_handles(lib: Any) -> Any:
    out = {n: lib.fn(n)(None) for n in ("ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort")}
    if lib.has("ncclCommRevoke"):
        out["ncclCommRevoke"] = lib.fn("ncclCommRevoke")(None, 0)
    return out


def s_revoke_twice(lib: Any) -> Any:
    h = _ready(lib)
    try:
        first = lib.fn("ncclCommRevoke")(h, 0)
        state = _state(lib, h)
        return {"first": first, "state": state, "second": lib.fn("ncclCommRevoke")(h, 0)}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_revoke_bad_flags(lib: Any) -> Any:
    h = _ready(lib)
    try:
        return {"flags1": lib.fn("ncclCommRevoke")(h, 1), "then": lib.fn("ncclCommRevoke")(h, 0)}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_revoke_nonblocking(lib: Any) -> Any:
    h = _ready(lib, blocking=False)
    try:
        rc = lib.fn("ncclCommRevoke")(h, 0)
        return {"rc_ok": rc in (OK, IN_PROGRESS), "final": _states(lib, h)[-1]}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_after_revoke(lib: Any) -> Any:
    with _Buf(lib) as buf:
        h = _ready(lib)
        try:
            lib.fn("ncclCommRevoke")(h, 0)
            _states(lib, h)
            send = lib.fn("ncclSend")(buf, 4, 7, 0, h, None)
            return {"allreduce": _allreduce(lib, h, buf), "send": send,
                    "finalize": lib.fn("ncclCommFinalize")(h)}
        finally:
            lib.fn("ncclCommAbort")(h)


def s_destroy_revoked(lib: Any) -> Any:
    h = _ready(lib)
    lib.fn("ncclCommRevoke")(h, 0)
    _states(lib, h)
    rc = lib.fn("ncclCommDestroy")(h)
    if rc != OK:
        lib.fn("ncclCommAbort")(h)
    return rc


def s_shrink_refusals(lib: Any) -> Any:
    h = _ready(lib)
    try:
        shrink = lib.fn("ncclCommShrink")
        out = ctypes.c_void_p(0)
        excl = (ctypes.c_int * 1)(0)
        return {"count0": shrink(h, excl, 0, ctypes.byref(out), None, 0),
                "null_list": shrink(h, None, 1, ctypes.byref(out), None, 0),
                "self": shrink(h, excl, 1, ctypes.byref(out), None, 0), "null": not out.value,
                "usable": _state(lib, h)}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_split_nocolor(lib: Any) -> Any:
    h = _ready(lib)
    try:
        out = ctypes.c_void_p(0)
        rc = lib.fn("ncclCommSplit")(h, -1, 0, ctypes.byref(out), None)
        return {"rc": rc, "null": not out.value}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_split_child(lib: Any) -> Any:
    h = _ready(lib)
    child = ctypes.c_void_p(0)
    try:
        rc = lib.fn("ncclCommSplit")(h, 0, 0, ctypes.byref(child), None)
        n = ctypes.c_int(-1)
        count = lib.fn("ncclCommCount")(child.value, ctypes.byref(n)) if child.value else -1
        destroy = lib.fn("ncclCommDestroy")(child.value) if child.value else -1
        child.value = None if destroy == OK else child.value
        return {"rc": rc, "count": [count, n.value], "destroy": destroy}
    finally:
        _abort(lib, child.value)
        lib.fn("ncclCommAbort")(h)


def s_deregister(lib: Any) -> Any:
    h = _ready(lib)
    junk = ctypes.create_string_buffer(64)
    try:
        return {"null": lib.fn("ncclCommDeregister")(h, None),
                "unknown": lib.fn("ncclCommDeregister")(h, ctypes.addressof(junk))}
    finally:
        lib.fn("ncclCommAbort")(h)


def s_memfree(lib: Any) -> Any:
    _device0()
    junk = ctypes.create_string_buffer(64)
    return {"null": lib.fn("ncclMemFree")(None),
            "host_pointer": lib.fn("ncclMemFree")(ctypes.addressof(junk))}


def s_redop(lib: Any) -> Any:
    with _Buf(lib) as buf:
        h = _ready(lib)
        try:
            op = ctypes.c_int(-1)
            scalar = (ctypes.c_float * 2)(2.0, 0.0)
            create = lib.fn("ncclRedOpCreatePreMulSum")(ctypes.byref(op), ctypes.addressof(scalar),
                                                        7, 1, h)       # float32, host immediate
            use = _allreduce(lib, h, buf, op=op.value)
            first = lib.fn("ncclRedOpDestroy")(op.value, h)
            return {"create": create, "use": use, "destroy": first,
                    "again": lib.fn("ncclRedOpDestroy")(op.value, h),
                    "use_destroyed": _allreduce(lib, h, buf, op=op.value),
                    "builtin": lib.fn("ncclRedOpDestroy")(0, h)}
        finally:
            lib.fn("ncclCommAbort")(h)


def s_redop_owner(lib: Any) -> Any:
    """A PreMulSum op belongs to one comm and one datatype (P7)."""
    with _Buf(lib) as buf:
        a, b = _ready(lib), None
        try:
            b, op, scalar = _ready(lib), ctypes.c_int(-1), (ctypes.c_float * 2)(2.0, 0.0)
            create = lib.fn("ncclRedOpCreatePreMulSum")(ctypes.byref(op), ctypes.addressof(scalar),
                                                        7, 1, a)       # float32, host immediate
            return {"create": create,
                    "other_dtype": _allreduce(lib, a, buf, op=op.value, dtype=8),   # float64
                    "other_dtype_empty": _allreduce(lib, a, buf, count=0, op=op.value, dtype=8),
                    "other_comm": _allreduce(lib, b, buf, op=op.value),
                    "destroy_on_other_comm": lib.fn("ncclRedOpDestroy")(op.value, b),
                    "destroy": lib.fn("ncclRedOpDestroy")(op.value, a)}
        finally:
            lib.fn("ncclCommAbort")(a)
            _abort(lib, b)


def s_args_check(lib: Any) -> Any:
    with _Buf(lib) as buf:
        h = _ready(lib)
        try:
            return {"root": lib.fn("ncclBroadcast")(buf, buf, 4, 7, 1, h, None),
                    "neg_root": lib.fn("ncclReduce")(buf, buf, 4, 7, 0, -1, h, None),
                    "dtype": _allreduce(lib, h, buf, dtype=99),
                    "peer": lib.fn("ncclSend")(buf, 4, 7, 1, h, None),
                    "ok": _allreduce(lib, h, buf)}
        finally:
            lib.fn("ncclCommAbort")(h)


def s_group_error(lib: Any) -> Any:
    with _Buf(lib) as buf:
        h = _ready(lib)
        try:
            f = lib.fn
            start = f("ncclGroupStart")()
            bad = f("ncclBroadcast")(buf, buf, 4, 7, 3, h, None)
            good = _allreduce(lib, h, buf)
            end = f("ncclGroupEnd")()
            return {"start": start, "bad": bad, "good": good, "end": end,
                    "next": _allreduce(lib, h, buf)}
        finally:
            lib.fn("ncclCommAbort")(h)


def s_one_rank_nonblocking(lib: Any) -> Any:
    with _Buf(lib) as buf:
        h = _ready(lib, blocking=False)
        try:
            return {"allreduce": _allreduce(lib, h, buf), "empty": _allreduce(lib, h, buf, 0),
                    "state": _state(lib, h)}
        finally:
            _abort(lib, h)


def s_suspend_resume(lib: Any) -> Any:
    h = _ready(lib)
    try:
        f = lib.fn
        return {"resume_not_suspended": f("ncclCommResume")(h),
                "suspend": f("ncclCommSuspend")(h, 1), "again": f("ncclCommSuspend")(h, 1),
                "resume": f("ncclCommResume")(h)}
    finally:
        lib.fn("ncclCommAbort")(h)


_REVOKE = ("ncclCommRevoke",)
SCENARIOS: Tuple[Scenario, ...] = (
    Scenario("group-end-without-start", "D1", ("ncclGroupEnd",), s_group_end_alone,
             {"rc": INVALID_USAGE, "text": "ncclGroupEnd: not in a group call."}),
    Scenario("nested-group-ends", "D2", ("ncclGroupStart",), s_nested_group, [0, 0, 0, 0, 5]),
    Scenario("error-strings", "A1", ("ncclGetErrorString",), s_error_strings, _error_strings),
    Scenario("init-rank-out-of-range", "B5", ("ncclCommInitRankConfig",), s_init_bad_rank,
             {"rc": INVALID_ARG, "null": True, "depth_left": 0}),
    Scenario("nonblocking-init-in-progress-then-ready", "B3/C2", ("ncclCommInitRankConfig",),
             s_nonblocking_init, {"rc": IN_PROGRESS, "states": [IN_PROGRESS, OK]}),
    Scenario("query-while-in-progress", "C4/Q1", ("ncclCommCount",), s_query_in_progress,
             {"during": INVALID_ARG, "after": OK, "count": 1}),
    Scenario("collective-while-in-progress", "C4/E1", ("ncclMemAlloc",),
             s_collective_in_progress, {"during": INVALID_ARG, "final": INVALID_ARG}),
    Scenario("destroy-while-in-progress", "G4", ("ncclCommInitRankConfig",),
             s_destroy_in_progress, {"during": INVALID_ARG, "depth_left": 1, "after": OK}),
    Scenario("queries", "Q1", ("ncclCommCuDevice",), s_queries, [[0, 1], [0, 0], [0, 0]]),
    Scenario("finalize-twice", "F4", ("ncclCommFinalize",), s_finalize_twice,
             {"first": OK, "second": INVALID_ARG, "destroy": OK}, ("ncclCommFinalize twice",)),
    Scenario("finalize-twice-nonblocking", "F2/F4", ("ncclCommFinalize",),
             s_finalize_twice_nonblocking,
             {"first_ok": True, "done": OK, "second": INVALID_ARG, "state": INVALID_ARG},
             ("ncclCommFinalize twice",)),
    Scenario("null-handles", "F6/G1/H1/K2", ("ncclCommFinalize",), s_null_handles,
             lambda v: {"ncclCommFinalize": 0, "ncclCommDestroy": 0, "ncclCommAbort": 0,
                        **({"ncclCommRevoke": 0} if v >= 22807 else {})}),
    Scenario("revoke-twice", "K3/K4", _REVOKE, s_revoke_twice,
             {"first": OK, "state": OK, "second": INVALID_ARG}),
    Scenario("revoke-bad-flags", "K1", _REVOKE, s_revoke_bad_flags,
             {"flags1": INVALID_ARG, "then": OK}),
    Scenario("revoke-nonblocking", "K4", _REVOKE, s_revoke_nonblocking,
             {"rc_ok": True, "final": OK}),
    Scenario("calls-after-revoke", "E3/F5", _REVOKE + ("ncclMemAlloc",), s_after_revoke,
             {"allreduce": INVALID_USAGE, "send": INVALID_USAGE, "finalize": INVALID_ARG},
             ("ncclCommFinalize after ncclCommRevoke",)),
    Scenario("destroy-after-revoke", "G6", _REVOKE, s_destroy_revoked, OK,
             ("ncclCommDestroy of a revoked communicator",)),
    Scenario("shrink-refusals", "J1", ("ncclCommShrink",), s_shrink_refusals,
             {"count0": INVALID_ARG, "null_list": INVALID_ARG, "self": INVALID_ARG,
              "null": True, "usable": OK}, ("ncclCommShrink called by excluded rank 0",)),
    Scenario("split-nocolor", "I2", ("ncclCommSplit",), s_split_nocolor, {"rc": OK, "null": True}),
    Scenario("split-one-rank-child", "I1/I3", ("ncclCommSplit",), s_split_child,
             {"rc": OK, "count": [OK, 1], "destroy": OK}),
    Scenario("deregister-null-and-unknown", "P2", ("ncclCommDeregister",), s_deregister,
             {"null": OK, "unknown": INVALID_USAGE}, ("ncclCommDeregister of an unknown handle",)),
    Scenario("memfree-null-and-host-pointer", "P4", ("ncclMemFree",), s_memfree,
             {"null": OK, "host_pointer": CUDA_ERR}, ("ncclMemFree of unknown memory",)),
    Scenario("premulsum-destroy-twice", "P6/E4", ("ncclRedOpDestroy", "ncclMemAlloc"), s_redop,
             {"create": OK, "use": OK, "destroy": OK, "again": INVALID_ARG,
              "use_destroyed": INVALID_ARG, "builtin": INVALID_ARG},
             ("ncclRedOpDestroy with a destroyed PreMulSum op",
              "ncclAllReduce with a destroyed PreMulSum op")),
    Scenario("premulsum-other-comm-and-dtype", "P7", ("ncclRedOpDestroy", "ncclMemAlloc"),
             s_redop_owner, {"create": OK, "other_dtype": INVALID_ARG, "other_dtype_empty": OK,
                             "other_comm": INVALID_ARG, "destroy_on_other_comm": INVALID_ARG,
                             "destroy": OK},
             (r"ncclAllReduce with PreMulSum op \d+ made for datatype 7 on datatype 8",
              "ncclAllReduce with a PreMulSum op of another communicator",
              "ncclRedOpDestroy with a PreMulSum op of another communicator")),
    Scenario("args-check", "E4", ("ncclSend", "ncclMemAlloc"), s_args_check,
             {"root": INVALID_ARG, "neg_root": INVALID_ARG, "dtype": INVALID_ARG,
              "peer": INVALID_ARG, "ok": OK}),
    Scenario("refusal-inside-a-group-fails-its-end", "D4", ("ncclMemAlloc",), s_group_error,
             {"start": OK, "bad": INVALID_ARG, "good": OK, "end": INVALID_ARG, "next": OK}),
    Scenario("one-rank-collective-on-nonblocking-comm", "E2", ("ncclMemAlloc",),
             s_one_rank_nonblocking, {"allreduce": OK, "empty": OK, "state": OK}),
    Scenario("suspend-twice-resume-not-suspended", "M4/M5", ("ncclCommSuspend",),
             s_suspend_resume, {"resume_not_suspended": INVALID_USAGE, "suspend": OK,
                                "again": INVALID_USAGE, "resume": OK},
             ("ncclCommSuspend on a suspended communicator",)),
)


def by_id(sid: str) -> Scenario:
    for s in SCENARIOS:
        if s.id == sid:
            return s
    raise KeyError(sid)


def run_one(s: Scenario, lib: Any) -> Dict[str, Any]:
    """{"id", "skip": why} or {"id", "obs"} or {"id", "error"} (an exception in the scenario)."""
    missing = s.missing(lib)
    if missing:
        return {"id": s.id, "skip": f"NCCL {lib.version} lacks {', '.join(missing)}"}
    try:
        return {"id": s.id, "obs": normalize(s.run(lib))}
    except Inconclusive as e:
        return {"id": s.id, "skip": f"inconclusive: {e}"}
    except Exception as e:  # noqa: BLE001 - reported as the scenario's result
        return {"id": s.id, "error": f"{type(e).__name__}: {e}"}


def main(argv: List[str]) -> int:
    """``python tests/nccl_rules_scenarios.py OUT.jsonl``: every scenario on the real libnccl,
    one JSON line each (the first line: the version), flushed as it goes."""
    from ncclpy._nccl.lib import get_lib
    lib = get_lib()
    with open(argv[0], "w") as f:
        f.write(json.dumps({"version": lib.version}) + "\n")
        f.flush()
        for s in SCENARIOS:
            f.write(json.dumps(run_one(s, lib)) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
