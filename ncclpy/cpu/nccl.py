"""The CPU engine's libnccl (the C functions under ``ncclpy._nccl.lib.NcclLib``): the libnccl
half of ncclpy/cpu/engine.py (see there), for the CPU backend and the CPU tests of ncclpy's own
logic alike.  It never makes a GPU test pass.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, List, Optional, Tuple

from ncclpy._nccl import lib as _lib
from ncclpy._nccl.config import NcclConfigStruct
from ncclpy._nccl.group import SimInfoStruct

from .abi import CpuCDLL
from .algo import init_pins

from .codes import (INTERNAL, INVALID_ARG, INVALID_USAGE, IN_PROGRESS, SUCCESS, SYSTEM,
                    UNHANDLED_CUDA)
from .core import EngineCore, _Comm, _Mem, _World
from .part2 import Part2, PART2_HANDLE_FIRST, PART2_HANDLE_LAST, _OK_SUSPENDED, _rma_cfg_of
from .colls import Colls, live_ops, op_owners

__all__ = ["CpuNccl"]


class _NcclError(Exception):
    """CuPy's NcclError stand-in (``.status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class CpuNccl(Colls, Part2, _lib.NcclLib):
    """:class:`ncclpy._nccl.lib.NcclLib` with its C library replaced by the engine's
    (:class:`ncclpy.cpu.abi.CpuCDLL`: C function pointers bound with ncclpy's own
    declarations, so every argument goes through ctypes as for the real call).  Everything
    NcclLib builds on top (``fn``, errors, checks, async_error, init through
    ``ncclCommInitRankConfig``, repair of the group depth) is NcclLib's own code."""

    def __init__(self, eng: EngineCore) -> None:
        self.e = eng
        self.path = "stand-in libnccl"
        self.version = eng.version
        self.cupy_version = eng.version
        self._fns = {}
        self._seen_error = ""
        self.last_text = b""
        # NcclLib.fn binds these exactly as the real libnccl's exports (see ncclpy.cpu.abi)
        self.cdll = CpuCDLL(self, self._enter)
        self.cupy_nccl = SimpleNamespace(NcclError=_NcclError, NcclCommunicator=self._cupy_comm,
                                         get_version=lambda: eng.version,
                                         check_status=self._cupy_check)

    # -- bookkeeping common to every call ----------------------------------------------------
    def _enter(self, name: str, impl: Callable, args: Tuple[Any, ...]) -> Any:
        e = self.e
        h = _handle_of(name, args)
        me = threading.get_ident()
        with e.lock:
            e.calls.append((name, h, me))
            code = self._injected_failure(name)
            if code is not None:
                return code
            c = e.comms.get(h) if h else None
            if c is not None:
                others = [n for t, n in c.busy.items() if t != me]
                if others and name != "ncclCommAbort":   # (abort: its own rule, below)
                    # NCCL's calls are not thread-safe on one communicator (docs: Thread
                    # Safety); ncclCommGetAsyncError of a nonblocking one completes and frees
                    # its group job (init.cc ncclCommGetAsyncError -> ncclGroupJobComplete)
                    e.violations.append(f"two threads inside NCCL on one communicator (rank "
                                        f"{c.rank}): {name} while {','.join(others)}")
                c.busy[me] = name
                if getattr(c, "suspended", False) and name not in _OK_SUSPENDED:
                    e.violations.append(f"{name} on a suspended communicator (rank {c.rank})")
        try:
            code = self._injected_delay(name, c)
            if code is not None:
                return code
            return impl(*args)
        finally:
            if c is not None:
                with e.lock:
                    c.busy.pop(me, None)

    # -- hooks: no-ops here, so this engine never fails or slows a call on purpose; the tests'
    #    fault injection (tests/nccl_standin.py) is a subclass that fills them -------------
    def _injected_failure(self, name: str) -> Optional[int]:
        """A code for the call ``name`` to return at once, without running (None: it runs).
        Called under the engine's lock once the call is recorded in ``calls``, before it is
        marked as inside its communicator."""
        return None

    def _injected_delay(self, name: str, c: Optional[_Comm]) -> Optional[int]:
        """Called inside the call ``name`` (on ``c``, None for no communicator) just before it
        runs, outside the engine's lock: it may block; a code to return instead of running
        (None: it runs)."""
        return None

    def _injected_async_error(self, h: int) -> Optional[int]:
        """An asynchronous error for ``ncclCommGetAsyncError`` on handle ``h`` to report instead
        of the communicator's state (None: its state)."""
        return None

    # -- errors and versions --------------------------------------------------------------------
    def _ncclGetVersion(self, out: Any) -> int:
        out[0] = self.version
        return SUCCESS

    def _ncclGetErrorString(self, code: int) -> bytes:
        """init.cc ncclGetErrorString (2.28.9-dev): NCCL's texts; 8 ("timeout") from 2.30."""
        if code == 8 and self.version >= 23000:
            return b"timeout"
        return _ERROR_STRINGS.get(code, b"unknown result code")

    def _ncclGetLastError(self, comm: Any) -> bytes:
        return self.last_text

    def _ncclGetUniqueId(self, out: Any) -> int:
        ctypes.memmove(ctypes.addressof(out.contents), os.urandom(128), 128)
        return SUCCESS

    # -- communicators --------------------------------------------------------------------------
    def _join(self, nranks: int, uid: bytes, rank: int, nonblocking: bool) -> int:
        e = self.e
        with e.lock:
            w = e.worlds.setdefault(uid, _World(uid, nranks))
            h = e.new_id()
            dev = e.tls().device
            c = _Comm(h, w, rank, dev, nonblocking)
            # tuning.cc ncclTopoTuneModel: the environment is read at init (RULES.md T1)
            c.pins, c.init_refusal, c.init_text = init_pins(nranks, e.version)
            e.comms[h] = c
            if rank in w.joined:
                e.violations.append(f"rank {rank} joined twice")
            w.joined[rank] = h
            if nonblocking:           # the init job takes a few polls, as NCCL's thread does
                c.async_state, c.polls_left = IN_PROGRESS, e.polls
        return h

    def _wait_world(self, c: _Comm, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while len(c.world.joined) < c.world.nranks:
            if c.abort_flag:
                return INTERNAL
            if time.monotonic() > deadline:
                return SYSTEM
            time.sleep(0.001)
        return self._init_result(c)

    def _init_result(self, c: _Comm) -> int:
        """How an init whose ranks met ends (RULES.md T1): ncclTopoTuneModel (init.cc:1356,
        after the bootstrap) refuses an NCCL_PROTO/NCCL_ALGO its parseList cannot read with
        ncclInvalidUsage and the WARN (``ncclGetLastError``), which becomes the communicator's
        state; else 0."""
        if c.init_refusal:
            c.async_state = c.init_refusal
            self.last_text = c.init_text
        return c.init_refusal

    def _ncclCommInitRankConfig(self, out: Any, nranks: int, uid: Any, rank: int,
                                cfg: Any) -> int:
        """init.cc ncclCommInitRankDev: a rank outside [0, nranks) -> 4, nothing written."""
        if nranks < 1 or not 0 <= rank < nranks:
            self.last_text = f"Invalid rank requested : {rank}/{nranks}".encode()
            return INVALID_ARG
        nb = bool(cfg) and NcclConfigStruct.from_address(int(cfg)).blocking == 0
        h = self._join(int(nranks), uid.to_bytes(), int(rank), nb)
        self.e.comms[h].rma_cfg = _rma_cfg_of(cfg) if cfg else (None, None)
        out[0] = h
        if nb:
            return IN_PROGRESS
        return self._wait_world(self.e.comms[h])

    def _ncclCommInitRankScalable(self, out: Any, nranks: int, rank: int, nid: int,
                                  ids: int, cfg: Any) -> int:
        """Joins the world of the first id (all ids noted: every rank must pass the same)."""
        raw = ctypes.string_at(int(ids), 128 * int(nid))
        self.e.scalable_ids.append((int(rank), raw))
        nb = bool(cfg) and NcclConfigStruct.from_address(int(cfg)).blocking == 0
        h = self._join(int(nranks), raw[:128], int(rank), nb)
        out[0] = h
        if nb:
            return IN_PROGRESS
        return self._wait_world(self.e.comms[h])

    def _ncclCommGetAsyncError(self, h: int, out: Any) -> int:
        e = self.e
        c = e.comm(h, "ncclCommGetAsyncError")
        if c is None:
            return INVALID_ARG
        with e.lock:
            e.progress()
            code = self._injected_async_error(h)
            if code is not None:
                out[0] = code
                return SUCCESS
            pending = getattr(c, "pending", None)
            if pending:                      # group tasks run asynchronously (windows)
                codes = [task() for task in pending]
                c.pending = [t for t, code in zip(pending, codes) if code == IN_PROGRESS]
                bad = [code for code in codes if code not in (SUCCESS, IN_PROGRESS)]
                if bad:
                    c.async_state, c.pending = bad[0], []
                elif c.pending:
                    out[0] = IN_PROGRESS
                    return SUCCESS
            if c.async_state == IN_PROGRESS:
                shown = c.async_shown
                if len(c.world.joined) < c.world.nranks:
                    out[0] = shown or IN_PROGRESS
                    return SUCCESS
                if c.polls_left > 0:
                    c.polls_left -= 1
                    out[0] = shown or IN_PROGRESS
                    return SUCCESS
                c.async_state, c.async_shown = self._init_result(c), 0
            out[0] = c.async_state
        return SUCCESS

    def _set_async(self, c: _Comm, code: int) -> None:
        """init.cc ncclCommSetAsyncError (2.28.9): the state becomes ``code`` at once.  While
        an operation is in progress its thread still runs, and writes its own result when it
        ends (group.cc groupLaunch: ``ncclCommSetAsyncError(job->comm, ret)``): a poll meanwhile
        reads ``code`` (real NCCL 2.28.9 on an H200: a collective refused during a nonblocking
        init, then a poll reads 4; docs/gpu-runs.md 2026-11-26)."""
        with self.e.lock:
            if c.async_state == IN_PROGRESS:
                c.async_shown = code
            else:
                c.async_state = code

    def _in_progress(self, c: _Comm) -> int:
        if c.nonblocking:
            c.async_state, c.polls_left = IN_PROGRESS, self.e.polls
            return IN_PROGRESS
        return SUCCESS

    def _ready(self, c: _Comm) -> int:
        """init.cc ncclCommEnsureReady (2.28.9-dev): with the abort flag set -> 0 (the group
        job is aborted); else the comm's async state, read by a poll: 7 -> **4** ("Attempt to
        use communicator before the previous operation returned ncclSuccess"), any other
        error as it is.  Collectives, p2p, queries, PreMulSum, finalize, destroy, split,
        shrink, grow and ncclCommGetUniqueId call it."""
        if c.abort_flag:
            return SUCCESS
        st = (ctypes.c_int * 1)()
        self._ncclCommGetAsyncError(c.handle, st)
        if st[0] == IN_PROGRESS:
            self.last_text = (b"Attempt to use communicator before the previous operation "
                              b"returned ncclSuccess")
            return INVALID_ARG
        return st[0]

    def _group_err(self, code: int) -> int:
        """group.h ncclGroupErrCheck: inside a group, a failure (not 0, not 7) is remembered
        and returned by the outermost ncclGroupEnd, which then drops the group's work."""
        t = self.e.tls()
        if t.group_depth and code not in (SUCCESS, IN_PROGRESS):
            t.group_error = code
        return code

    def _ncclCommFinalize(self, h: int) -> int:
        """init.cc ncclCommFinalize (2.28.9-dev): NULL -> 0; EnsureReady; a second finalize,
        or one after ncclCommRevoke (which sets finalizeCalled) -> 4, and on a nonblocking
        comm the async error becomes 4.  Both are also violations (ncclpy must never)."""
        e = self.e
        if not h:
            return SUCCESS
        c = e.comm(h, "ncclCommFinalize")
        if c is None:
            return INVALID_ARG
        code = self._ready(c)
        if code == SUCCESS and c.finalized:
            if getattr(c, "revoked", False):    # nccl.h: finalize after revoke is invalid
                e.violations.append(f"ncclCommFinalize after ncclCommRevoke (rank {c.rank})")
            else:
                e.violations.append(f"ncclCommFinalize twice (rank {c.rank})")
            code = INVALID_ARG
            if c.nonblocking:
                c.async_state = INVALID_ARG
        if code:
            return self._group_err(code)
        c.finalized = True
        if e.graph_refs.get(h, 0) > 0:   # commDestroySync polls until every graph died (2.24+)
            if c.nonblocking:
                def graphs_gone() -> int:
                    return IN_PROGRESS if e.graph_refs.get(h, 0) > 0 else SUCCESS
                c.pending = getattr(c, "pending", []) + [graphs_gone]
                c.async_state, c.polls_left = IN_PROGRESS, 0
                return IN_PROGRESS
            while e.graph_refs.get(h, 0) > 0 and not c.abort_flag:
                time.sleep(0.005)
            return INTERNAL if c.abort_flag else SUCCESS
        return self._in_progress(c)

    def _ncclCommDestroy(self, h: int) -> int:
        """init.cc ncclCommDestroy (2.28.9-dev): NULL -> 0; always blocking; EnsureReady's
        failure (4 while in progress, or the comm's async error) returns through NCCLCHECK
        after ncclGroupStartInternal, so this thread's group depth stays one too high."""
        e = self.e
        if not h:
            return SUCCESS
        c = e.comm(h, "ncclCommDestroy")
        if c is None:
            return INVALID_ARG
        code = self._ready(c)
        if code:
            e.tls().group_depth += 1             # NCCL's leak, modelled
            return code
        # NCCL allows destroying a revoked comm (nccl.h ncclCommRevoke); ncclpy's own rule
        # (ncclpy/comm/membership.py) closes a revoked or shrink-aborted parent with abort
        if getattr(c, "revoked", False) or getattr(c, "shrink_aborted", False):
            e.violations.append(f"ncclCommDestroy of a revoked communicator (rank {c.rank})")
        c.freed = "destroyed"
        return SUCCESS

    def _ncclCommAbort(self, h: int) -> int:
        """init.cc ncclCommAbort (2.28.9): NULL -> ncclSuccess; sets the abort flags (what is
        blocked on the device or in a host poll loop returns), joins the comm's own async
        init job (ncclCommEnsureReady), then commReclaim -> commFree: the communicator is
        freed at once.  It waits for no other thread: a thread still inside a call on the
        handle runs on freed memory -- NCCL's docs require that "no thread is calling any
        NCCL operations while calling ncclCommAbort" (usage/communicators.rst, Fault
        Tolerance), so that is recorded as a violation ncclpy must never commit."""
        e = self.e
        if not h:
            return SUCCESS
        with e.lock:
            c = e.comms.get(int(h))
            if c is None or c.freed:
                e.violations.append(f"ncclCommAbort on a {c.freed if c else 'unknown'} handle")
                return INVALID_ARG
            c.abort_flag = True
            others = {t: n for t, n in c.busy.items() if t != threading.get_ident()}
            if others:
                e.calls.append(("abort-while-busy:" + ",".join(others.values()), h, 0))
                e.violations.append(f"ncclCommAbort while another thread is inside "
                                    f"{','.join(others.values())} on the handle (rank "
                                    f"{c.rank}): NCCL frees the communicator under it")
            c.freed = "aborted"
        return SUCCESS

    def _query(self, h: int, out: Any, what: str) -> int:
        """init.cc ncclCommCount/UserRank/CuDevice: CommCheck, PtrCheck, EnsureReady."""
        c = self.e.comm(h, what)
        if c is None:
            return INVALID_ARG
        code = self._ready(c)
        if code:
            return code
        out[0] = {"ncclCommCount": c.world.nranks, "ncclCommUserRank": c.rank,
                          "ncclCommCuDevice": c.device}[what]
        return SUCCESS

    def _ncclCommCount(self, h: int, out: Any) -> int:
        return self._query(h, out, "ncclCommCount")

    def _ncclCommUserRank(self, h: int, out: Any) -> int:
        return self._query(h, out, "ncclCommUserRank")

    def _ncclCommCuDevice(self, h: int, out: Any) -> int:
        return self._query(h, out, "ncclCommCuDevice")

    # -- registration, memory, premul ------------------------------------------------------------
    def _ncclCommRegister(self, h: int, ptr: int, nbytes: int, out: Any) -> int:
        if self.e.comm(h, "ncclCommRegister") is None:
            return INVALID_ARG
        r = self.e.new_id()
        self.e.registrations[r] = int(ptr)
        out[0] = r
        return SUCCESS

    def _ncclCommDeregister(self, h: int, reg: int) -> int:
        """register.cc commDeregister (all): CommCheck; NULL -> 0; unknown -> 5 ("Deregister:
        Could not find handle"), also a violation (ncclpy must never)."""
        if self.e.comm(h, "ncclCommDeregister") is None:
            return INVALID_ARG
        if not reg:
            return SUCCESS
        if self.e.registrations.pop(int(reg), None) is None:
            self.e.violations.append(f"ncclCommDeregister of an unknown handle {reg!r}")
            self.last_text = b"Deregister: Could not find handle"
            return INVALID_USAGE
        return SUCCESS

    def _ncclMemAlloc(self, out: Any, nbytes: int) -> int:
        m = _Mem(nbytes)
        self.e.mem[m.ptr] = m
        out[0] = m.ptr
        return SUCCESS

    def _ncclMemFree(self, ptr: int) -> int:
        """allocator.cc ncclMemFree: NULL -> 0 (cudaFree(NULL)); a pointer not from CUDA fails
        cuPointerGetAttribute -> 1 (also a violation)."""
        if not ptr:
            return SUCCESS
        if self.e.mem.pop(int(ptr), None) is None:
            self.e.violations.append(f"ncclMemFree of unknown memory {ptr!r}")
            return UNHANDLED_CUDA
        return SUCCESS

    def _ncclRedOpCreatePreMulSum(self, out: Any, scalar: Any, dtype: int, residence: int,
                                  h: int) -> int:
        c = self.e.comm(h, "ncclRedOpCreatePreMulSum")
        if c is None:
            return INVALID_ARG
        code = self._ready(c)                # enqueue.cc: EnsureReady
        if code:
            return code
        op = 5 + len(self.e.premul)          # the scalar is kept for ops already enqueued
        self.e.premul[op] = (ctypes.string_at(int(scalar), 8), dtype)
        live_ops(self.e)[op] = int(h)
        op_owners(self.e)[op] = int(h)
        out[0] = op
        return SUCCESS

    def _ncclRedOpDestroy(self, op: int, h: int) -> int:
        """enqueue.cc ncclRedOpDestroy (all): builtin (0-4) or garbage -> 4; comm NULL -> 4;
        an op unknown to this comm or already destroyed -> 4 (the last two also violations:
        RULES.md P6, P7); else the op is freed."""
        if 0 <= op < 5:
            self.last_text = b"ncclRedOpDestroy : operator is a NCCL builtin."
            return INVALID_ARG
        if op < 0:
            self.last_text = b"ncclRedOpDestroy :  operator is garbage."
            return INVALID_ARG
        c = self.e.comm(h, "ncclRedOpDestroy")
        if c is None:
            return INVALID_ARG
        live = live_ops(self.e)
        if live.get(op) != int(h):
            self.last_text = b"ncclRedOpDestroy : operator unknown to this communicator."
            self._stale_op(c, "ncclRedOpDestroy", op)   # destroyed, or another comm's
            return INVALID_ARG
        del live[op]
        return SUCCESS

    # -- groups and the calls themselves -----------------------------------------------------------
    def _ncclGroupStart(self) -> int:
        self.e.tls().group_depth += 1
        return SUCCESS

    def _ncclGroupEnd(self) -> int:
        t = self.e.tls()
        if t.group_depth == 0:
            self.last_text = b"ncclGroupEnd: not in a group call."   # group.cc, all
            return INVALID_USAGE
        t.group_depth -= 1
        if t.group_depth:
            return SUCCESS
        err, t.group_error = getattr(t, "group_error", SUCCESS), SUCCESS
        launch, t.launch_error = getattr(t, "launch_error", None), None
        refused, t.launch_comms = getattr(t, "launch_comms", []), []
        if err:                       # group.cc: ncclGroupError -> groupCleanup drops the work
            for c in {id(c): c for c, _s, _o in t.group}.values():
                if c.nonblocking:     # and sets the nonblocking comms' async error
                    c.async_state = err
            t.group, t.rma, t.rma_comms = [], [], []
            return err
        if launch:                    # groupLaunch -> ncclPrepareTasks -> topoGetAlgoInfo
            return self._launch_failed(launch, refused)
        ops, t.group = t.group, []
        code = self._submit(ops)
        rma, t.rma = t.rma, []
        for thunk in rma:             # one-sided calls, window tasks (ncclpy.cpu.part2)
            got = thunk()
            if isinstance(got, int) and got != SUCCESS and code in (SUCCESS, IN_PROGRESS):
                code = got            # a failed task fails the group end; else in progress
        rma_comms, t.rma_comms = getattr(t, "rma_comms", []), []
        for c in {id(c): c for c in rma_comms}.values():   # RMA work: as a collective's (O6)
            if code in (SUCCESS, IN_PROGRESS):
                code = max(code, self._in_progress(c))
        return code

    def _launch_failed(self, launch: Tuple[int, bytes], refused: List[_Comm]) -> int:
        """A group whose launch fails (RULES.md T2: a call with no algorithm/protocol): the
        WARN is said, the group's work dropped (groupCleanup); a blocking group end returns the
        code, a nonblocking one ncclInProgress, its communicators' async error the code."""
        t = self.e.tls()
        code, self.last_text = launch
        comms = {id(c): c for c in refused + [c for c, _s, _o in t.group]}.values()
        t.group, t.rma, t.rma_comms = [], [], []
        nonblocking = False
        for c in comms:
            if c.nonblocking:
                c.async_state, nonblocking = code, True
        return IN_PROGRESS if nonblocking else code

    def _ncclGroupSimulateEnd(self, info: Any) -> int:
        """Like ncclGroupEnd, but the outermost end launches nothing and writes a stand-in
        estimate: 1 us per call of the group (ncclpy's own logic is what is under test)."""
        t = self.e.tls()
        if t.group_depth == 0:
            self.last_text = b"ncclGroupEnd: not in a group call."   # the same function
            return INVALID_USAGE
        t.group_depth -= 1
        if t.group_depth:
            return SUCCESS
        launch, t.launch_error = getattr(t, "launch_error", None), None
        refused, t.launch_comms = getattr(t, "launch_comms", []), []
        if launch:                    # the simulated launch plans too (ncclPrepareTasks)
            return self._launch_failed(launch, refused)
        ops, t.group = t.group, []
        SimInfoStruct.from_address(int(info)).estimatedTime = float(len(ops))
        return SUCCESS

    # -- the CuPy route (cupy.cuda.nccl.NcclCommunicator's stand-in) -------------------------
    def _cupy_check(self, code: int) -> None:
        if code in (7, 8):
            raise KeyError(code)            # CuPy 14 cannot build its NcclError for 7/8
        if code:
            raise _NcclError(code)

    def _cupy_comm(self, nranks: int, uid: bytes, rank: int) -> Any:
        h = self._enter("ncclCommInitRank",
                        lambda: self._join(int(nranks), bytes(uid), int(rank), False), ())
        self._cupy_check(self._wait_world(self.e.comms[h]))
        return self._cupy_wrap(h)

    def _cupy_wrap(self, h: int) -> Any:
        lib = self

        def method(name: str) -> Callable:
            def m(*args: Any) -> None:
                *rest, stream = args
                lib._cupy_check(lib.fn(name)(*rest, h, stream))
            return m

        ns = SimpleNamespace(comm=h)
        for cname, nname in (("allReduce", "ncclAllReduce"), ("reduce", "ncclReduce"),
                             ("broadcast", "ncclBroadcast"), ("reduceScatter",
                                                              "ncclReduceScatter"),
                             ("allGather", "ncclAllGather"), ("send", "ncclSend"),
                             ("recv", "ncclRecv")):
            setattr(ns, cname, method(nname))
        ns.abort = lambda: lib._cupy_check(lib.fn("ncclCommAbort")(h))
        ns.destroy = lambda: lib._cupy_check(lib.fn("ncclCommDestroy")(h))

        def commSplit(color: int, key: int) -> Any:
            slot = ctypes.c_void_p(0)
            lib._cupy_check(lib.fn("ncclCommSplit")(h, color, key, ctypes.byref(slot), None))
            return None if not slot.value else lib._cupy_wrap(slot.value)
        ns.commSplit = commSplit
        return ns


#: init.cc ncclGetErrorString (2.28.9-dev), codes 0-7
_ERROR_STRINGS = {
    0: b"no error",
    1: b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    2: b"unhandled system error (run with NCCL_DEBUG=INFO for details)",
    3: b"internal error - please report this issue to the NCCL developers",
    4: b"invalid argument (run with NCCL_DEBUG=WARN for details)",
    5: b"invalid usage (run with NCCL_DEBUG=WARN for details)",
    6: b"remote process exited or there was a network error",
    7: b"NCCL operation in progress"}


def _handle_of(name: str, args: Tuple[Any, ...]) -> int:
    """The ncclComm_t argument of an NCCL call (0 where it takes none)."""
    if name in ("ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError",
                "ncclCommCount", "ncclCommUserRank", "ncclCommCuDevice", "ncclCommSplit",
                "ncclCommRegister", "ncclCommDeregister"):
        return int(args[0] or 0)
    if name in ("ncclRedOpCreatePreMulSum", "ncclRedOpDestroy"):
        return int(args[-1] or 0)
    if name in PART2_HANDLE_FIRST:
        return int(args[0] or 0)
    if name in PART2_HANDLE_LAST:
        return int(args[-2] or 0)
    if name.startswith("nccl") and name[4:] in ("AllReduce", "Reduce", "Broadcast",
                                                "ReduceScatter", "AllGather", "AlltoAll",
                                                "Gather", "Scatter", "Send", "Recv"):
        return int(args[-2] or 0)
    if name.endswith("Config") and name[4:-6] in ("AllReduce", "Reduce", "Broadcast",
                                                  "ReduceScatter", "AllGather", "AlltoAll",
                                                  "Gather", "Scatter"):
        return int(args[-3] or 0)      # ..., comm, stream, config
    return 0


