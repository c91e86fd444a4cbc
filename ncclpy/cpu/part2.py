"""STAND-IN for NCCL 2.27-2.32's host API part 2 (a mixin of ncclpy/cpu/nccl.py's
CpuNccl): split, shrink / revoke / grow, suspend / resume / memory statistics, and
(ncclpy/cpu/windows.py) symmetric windows and one-sided RMA -- for CPU tests of
ncclpy's own logic (ordering, lifecycle, arguments, what reaches NCCL) on thread-ranks.  It
never makes a GPU test pass.

What it models (each rule and its NCCL source: ncclpy/cpu/RULES.md): a nonblocking
parent's split or shrink returns 0 and writes the child only once it is initialized, the
parent in progress meanwhile; revoke stops blocked calls (the abort flag, reset once they
returned) and is in progress for a few polls on a nonblocking communicator; shrink forms the
survivors' world; grow joins the existing and new ranks through the id the root made; suspend
and resume are collective (a barrier) and, from 2.30, group tasks (in progress on a
nonblocking communicator).  It records as violations what ncclpy must never do: a finalize or
a destroy of a revoked communicator, any call but resume / mem stats / abort on a suspended
one.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Optional, Tuple

from ncclpy._nccl.config import NcclConfigStruct

from .codes import INTERNAL, INVALID_ARG, INVALID_USAGE, IN_PROGRESS, SUCCESS, SYSTEM
from .core import _World

from .windows import Windows

__all__ = ["Part2", "PART2_HANDLE_FIRST", "PART2_HANDLE_LAST"]


def _config(cfg: int) -> NcclConfigStruct:
    """The ncclConfig_t at the address a call was given (its ``c_void_p`` argument)."""
    return NcclConfigStruct.from_address(int(cfg))


def _rma_cfg_of(cfg: int) -> Tuple[Any, Any]:
    """(numRmaSig, numRmaCtx) the config at ``cfg`` set (None where unset)."""
    s = _config(cfg)
    return tuple(None if v == -(2 ** 31) else v for v in (s.numRmaSig, s.numRmaCtx))


def _quiesce(c: Any, bound_s: float = 5.0) -> Callable[[], int]:
    """A revoke's (or NCCL_SHRINK_ABORT's) end: IN_PROGRESS while another thread is inside a
    call on ``c`` (it sees the abort flag and returns), then the abort flag is reset (0);
    bounded, as a stand-in must not hang a test."""
    import threading
    me = threading.get_ident()
    deadline = time.monotonic() + bound_s

    def step() -> int:
        now = threading.get_ident()
        others = [t for t, name in list(c.busy.items()) if t not in (me, now)
                  and name != "ncclCommGetAsyncError"]
        if others and time.monotonic() < deadline:
            return IN_PROGRESS
        c.abort_flag = False
        return SUCCESS
    return step

#: calls whose ncclComm_t is the first / the second to last argument
PART2_HANDLE_FIRST = ("ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclWinGetUserPtr",
                      "ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId",
                      "ncclCommGrow", "ncclCommSuspend", "ncclCommResume", "ncclCommMemStats")
PART2_HANDLE_LAST = ("ncclPutSignal", "ncclSignal", "ncclWaitSignal")
_OK_SUSPENDED = ("ncclCommResume", "ncclCommMemStats", "ncclCommAbort",
                 "ncclCommGetAsyncError")


class Part2(Windows):
    #: seconds a blocking split waits for the other ranks' votes (threads in one test process:
    #: bounded so a test cannot hang; None: unbounded, as NCCL's bootstrapAllGather)
    split_wait: Optional[float] = 30.0

    """The part-2 calls (``self.e``: the engine)."""

    e: Any

    # -- engine state, made on first use ---------------------------------------------------------
    def _p2(self) -> Any:
        e = self.e
        if not hasattr(e, "windows"):
            e.symmetric = getattr(e, "symmetric", True)
            e.windows: Dict[Tuple[int, int, int], Tuple[int, int, int]] = {}
            e.win_handles: Dict[int, Tuple[int, int, int, int]] = {}
            e.signals: Dict[Tuple[int, int, int, int, int], int] = defaultdict(int)
            e.grows: Dict[bytes, Any] = {}
            e.arrived: Dict[Tuple[Any, ...], set] = defaultdict(set)   # barriers: ranks in
        return e

    def _comm2(self, h: int, call: str) -> Any:
        """The live comm of a part-2 call (else a violation, from the engine).  A call on a
        suspended comm is recorded once, by CpuNccl._enter, which every call goes through
        (recording it here too counted each such call twice)."""
        return self.e.comm(h, call)

    # -- split (a nonblocking parent's job writes the child later: I5) -------------------------
    def _ncclCommSplit(self, h: int, color: int, key: int, out: Any, cfg: Any) -> int:
        e = self.e
        c = e.comm(h, "ncclCommSplit")
        if c is None:
            return INVALID_ARG
        code = self._ready(c)                # init.cc ncclCommInitChildComm: EnsureReady
        if code:
            return code
        # the child's mode: the given config's, else the parent's (copyCommConfig)
        child_nb = (NcclConfigStruct.from_address(int(cfg)).blocking == 0) if cfg else \
            c.nonblocking
        with e.lock:
            tag = (c.world.id, "split", c.coll_seq)
            c.coll_seq += 1
            sw = e.worlds.setdefault(repr(tag).encode(), _World(repr(tag).encode(), 0))
            sw.joined.setdefault(-1 - c.rank, (color, key))    # negative slots: the votes
        if c.nonblocking:    # I5: queued under the parent; *newcomm NULL until the child is
            out[0] = None    # initialized, then written; the call returns 0, the parent is 7
            addr = ctypes.cast(out, ctypes.c_void_p).value

            def make() -> Any:
                if len([k for k in sw.joined if k < 0]) < c.world.nranks:
                    return None
                votes = sorted((v[1], -1 - k) for k, v in sw.joined.items() if k < 0
                               and v[0] == color)
                if color == -1:
                    return 0
                child = self._join(len(votes), repr((tag, color)).encode(),
                                   [r for _, r in votes].index(c.rank), child_nb)
                e.comms[child].device = c.device
                e.comms[child].rma_cfg = _rma_cfg_of(cfg) if cfg else getattr(
                    c, "rma_cfg", (None, None))
                return child
            self._run_task(c, self._child_task(make, addr))
            return SUCCESS
        deadline = None if self.split_wait is None else time.monotonic() + self.split_wait
        while len([k for k in sw.joined if k < 0]) < c.world.nranks:
            if c.abort_flag:
                return INTERNAL
            if deadline is not None and time.monotonic() > deadline:
                return SYSTEM
            time.sleep(0.001)
        with e.lock:
            votes = sorted((v[1], -1 - k) for k, v in sw.joined.items() if k < 0
                           and v[0] == color)
            if color < 0:
                out[0] = None
                return self._in_progress(c)
            mine = [r for _, r in votes].index(c.rank)
            uid = repr((tag, color)).encode()
            child = self._join(len(votes), uid, mine, child_nb)
            e.comms[child].device = c.device
            e.comms[child].rma_cfg = _rma_cfg_of(cfg) if cfg else getattr(c, "rma_cfg",
                                                                        (None, None))
        out[0] = child
        if c.nonblocking:
            e.comms[child].async_state = IN_PROGRESS
            return self._in_progress(c)
        code = self._wait_world(e.comms[child])
        if code == SUCCESS:                  # a blocking parent's split ran inside the call
            e.comms[child].async_state = SUCCESS
        return code

    def _child_task(self, make: Any, addr: int) -> Any:
        """A nonblocking parent's split/shrink job: ``make()`` -> None (the other ranks have
        not called yet), 0 (no child for this rank) or the child's handle; the job completes
        once the child's world is whole, and only then writes ``*newcomm`` (init.cc
        ncclCommInitRankFunc: ``*job->newcomm = comm`` at the end of the child's init)."""
        e = self.e
        state: Dict[str, Any] = {}

        def step() -> int:
            with e.lock:
                if "child" not in state:
                    got = make()
                    if got is None:
                        return IN_PROGRESS
                    state["child"] = got
                child = state["child"]
                if child:
                    cc = e.comms[child]
                    if len(cc.world.joined) < cc.world.nranks:
                        return IN_PROGRESS
                    cc.async_state = self._init_result(cc)
                ctypes.c_void_p.from_address(addr).value = child or None
                return SUCCESS
        return step

    # -- revoke, shrink, grow ---------------------------------------------------------------------
    def _ncclCommRevoke(self, h: int, flags: int) -> int:
        """init.cc ncclCommRevoke, commRevokeAsync (2.28.9-dev): NULL -> 0; flags != 0 -> 4;
        once a finalize or destroy started, or a second revoke -> 4.  It sets the abort flags
        (what is blocked in a call returns), revokedFlag and finalizeCalled; the revoke job
        then quiesces the comm and resets the abort flags: inside the call on a blocking comm
        (0, state 0), in the background on a nonblocking one (7; state 7 until done)."""
        e = self.e
        if not h:
            return SUCCESS
        c = self._comm2(h, "ncclCommRevoke")
        if c is None or flags != 0 or c.finalized or getattr(c, "revoked", False):
            return INVALID_ARG
        with e.lock:
            c.revoked, c.finalized, c.abort_flag = True, True, True
        quiesced = _quiesce(c)
        if c.nonblocking:
            c.pending = getattr(c, "pending", []) + [quiesced]
            c.async_state, c.polls_left = IN_PROGRESS, e.polls
            return IN_PROGRESS
        while quiesced() == IN_PROGRESS:
            time.sleep(0.002)
        return SUCCESS

    def _ncclCommShrink(self, h: int, excl: Any, n: int, out: Any, cfg: Any, flags: int) -> int:
        e = self.e
        c = self._comm2(h, "ncclCommShrink")
        if c is None:
            return INVALID_ARG
        if not excl:               # init.cc ncclCommInitChildComm: PtrCheck(excludeRanksList)
            self.last_text = b"ncclCommShrink : excludeRanksList argument is NULL"
            return INVALID_ARG
        if int(n) <= 0:            # then excludeRanksCount > 0
            self.last_text = b"ncclCommShrink: excludeRanksCount must be > 0"
            return INVALID_ARG
        gone = sorted(int(excl[i]) for i in range(int(n)))
        if c.rank in gone:
            e.violations.append(f"ncclCommShrink called by excluded rank {c.rank}")
            return INVALID_ARG
        if flags & 1:              # init.cc ncclCommShrink: NCCL_SHRINK_ABORT first sets the
            c.abort_flag = True    # abort flags, syncs the device stream, resets the flags;
            c.shrink_aborted = True   # the parent is not revoked (ncclpy closes it with abort)
            quiesced = _quiesce(c)
            while quiesced() == IN_PROGRESS:
                time.sleep(0.002)
            c.abort_flag = False
        code = self._ready(c)      # then ncclCommInitChildComm: EnsureReady (an async error
        if code:                   # set, the proxy's included, refuses the shrink)
            return code
        # the child's mode: the given config's, else the parent's (copyCommConfig)
        child_nb = (_config(cfg).blocking == 0) if cfg else c.nonblocking
        with e.lock:
            k = getattr(c, "shrinks", 0)
            c.shrinks = k + 1
            alive = [r for r in range(c.world.nranks) if r not in gone]
            uid = repr((c.world.id, "shrink", k, tuple(gone))).encode()
            child = self._join(len(alive), uid, alive.index(c.rank), child_nb)
            e.comms[child].device = c.device
            e.comms[child].rma_cfg = getattr(c, "rma_cfg", (None, None)) if not cfg else \
                _rma_cfg_of(cfg)
        e.calls.append(("ncclCommShrink:" + ",".join(map(str, gone)), h, flags))
        if c.nonblocking:          # J4: as a split (I5): *newcomm written once initialized
            out[0] = None
            self._run_task(c, self._child_task(lambda: child,
                                               ctypes.cast(out, ctypes.c_void_p).value))
            return SUCCESS
        out[0] = child
        code = self._wait_world(e.comms[child])
        if code == SUCCESS:               # a blocking parent's shrink ran inside the call
            e.comms[child].async_state = SUCCESS
        return code

    def _ncclCommGetUniqueId(self, h: int, out: Any) -> int:
        e = self._p2()
        c = self._comm2(h, "ncclCommGetUniqueId")
        if c is None:
            return INVALID_ARG
        code = self._ready(c)                # init.cc ncclCommGetUniqueId: EnsureReady
        if code:
            return code
        uid = os.urandom(128)
        ctypes.memmove(ctypes.addressof(out.contents), uid, 128)
        with e.lock:
            e.grows[uid] = c.world
            c.world.grow_uid = uid
        return SUCCESS

    def _ncclCommGrow(self, h: int, n: int, uid_p: Any, rank: int, out: Any, cfg: Any) -> int:
        e = self._p2()
        if h:                                # an existing rank: keeps its number
            c = self._comm2(h, "ncclCommGrow")
            if c is None or rank != -1:
                return INVALID_ARG
            code = self._ready(c)            # init.cc ncclCommGrow: EnsureReady
            if code:
                return code
            deadline = time.monotonic() + 30
            while getattr(c.world, "grow_uid", None) is None:   # the root made the id
                if time.monotonic() > deadline:
                    return SYSTEM
                time.sleep(0.001)
            uid, me = c.world.grow_uid, c.rank
        else:                                # a new rank: the id and its number given
            if not uid_p:
                return INVALID_ARG
            uid, me = uid_p.contents.to_bytes(), int(rank)
            if uid not in e.grows or not e.grows[uid].nranks <= me < int(n):
                return INVALID_ARG
        # nonblocking as NCCL decides it: the given config, else (existing rank) the parent's
        nb = (cfg is not None and _config(cfg).blocking == 0) or (
            bool(h) and cfg is None and c.nonblocking)
        child = self._join(int(n), b"grow" + uid, me, nb)
        out[0] = child               # NCCL writes *newcomm before the async init
        with e.lock:
            if h:                            # every existing rank read the id: consumed
                c.world.grow_reads = getattr(c.world, "grow_reads", 0) + 1
                if c.world.grow_reads == c.world.nranks:
                    c.world.grow_uid, c.world.grow_reads = None, 0
            if len(e.comms[child].world.joined) == int(n):
                e.grows.pop(uid, None)       # the last rank joined: a reuse is refused
        if h and cfg is None:
            e.comms[child].rma_cfg = getattr(c, "rma_cfg", (None, None))
        if nb:                               # in progress for e.polls polls once all joined;
            e.comms[child].polls_left = e.polls   # ncclCommGrow swallows the 7 (NCCLCHECK)
            return SUCCESS
        return self._wait_world(e.comms[child])

    # -- suspend, resume, memory statistics -------------------------------------------------------
    # mem_manager.cc ncclCommSuspend / ncclCommResume: CommCheck, ncclCommEnsureReady (4 while
    # in progress); suspend without NCCL_SUSPEND_MEM does nothing (ncclSuccess).  Both are
    # COLLECTIVE: 2.29.7 synchronizes the device and meets the ranks in bootstrapBarrier inside
    # the call; from 2.30 each is a group task (the same barrier) and a nonblocking
    # communicator returns ncclInProgress (the call ends with ncclCommGetAsyncError).  A second
    # suspend, or a resume of a communicator not suspended: ncclInvalidUsage (the manager's
    # released flag).
    def _suspend_resume(self, h: int, call: str, suspend: bool) -> int:
        e = self._p2()
        c = self._comm2(h, call)
        if c is None:
            return INVALID_ARG
        code = self._ready(c) if hasattr(self, "_ready") else SUCCESS
        if code:
            return code
        if getattr(c, "suspended", False) == suspend:
            self.last_text = (b"MemManager: already suspended" if suspend else
                              b"MemManager: not suspended")
            return INVALID_USAGE
        with e.lock:
            k = getattr(c, "mem_steps", 0)
            c.mem_steps = k + 1
        tag = (c.world.id, "mem", k)

        def step() -> int:
            with e.lock:
                e.arrived[tag].add(c.rank)
                if len(e.arrived[tag]) < c.world.nranks:
                    return IN_PROGRESS
                c.suspended = suspend
                return SUCCESS
        if e.version < 23000:               # 2.29.x: the barrier inside the call
            was, c.nonblocking = c.nonblocking, False
            try:
                return self._run_task(c, step)
            finally:
                c.nonblocking = was
        return self._run_task(c, step)

    def _ncclCommSuspend(self, h: int, flags: int) -> int:
        if not int(flags) & 1:              # NCCL_SUSPEND_MEM not asked: nothing to do
            return SUCCESS if self._comm2(h, "ncclCommSuspend") is not None else INVALID_ARG
        return self._suspend_resume(h, "ncclCommSuspend", True)

    def _ncclCommResume(self, h: int) -> int:
        return self._suspend_resume(h, "ncclCommResume", False)

    def _ncclCommMemStats(self, h: int, stat: int, out: Any) -> int:
        c = self._comm2(h, "ncclCommMemStats")
        if c is None or stat not in (0, 1, 2, 3) or not out:
            return INVALID_ARG
        code = self._ready(c)                # M7: EnsureReady
        if code:
            return code
        # mem_manager.cc ncclCommMemStats: suspending changes only the "suspended" stat; the
        # suspendable and total byte counts stay what the communicator holds
        sus = getattr(c, "suspended", False)
        out[0] = (1 << 20, int(sus), 1 << 16, (1 << 16) + (1 << 20))[stat]
        return SUCCESS
