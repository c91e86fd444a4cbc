"""STAND-IN for NCCL's symmetric windows and one-sided RMA (2.27-2.32): a mixin of
ncclpy/cpu/part2.py's Part2 (see there and ncclpy/cpu/engine.py).  Window
registration is collective, ordered and a group task (dev_runtime.cc); RMA calls go through
ncclEnqueueCheck's and rmaTaskAppend's refusals (enqueue.cc) and join the thread's group as
collective work.  Each rule and its NCCL source: ncclpy/cpu/RULES.md (rows N, O).  CPU
tests of ncclpy's own logic only; it never makes a GPU test pass.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Dict

from .codes import (_BY_ENUM, INTERNAL, INVALID_ARG, INVALID_USAGE, IN_PROGRESS, SUCCESS,
                    SYSTEM)
from .core import _Item

__all__ = ["Windows"]


class Windows:
    """Windows and RMA calls (``self.e``: the engine; ``_p2``, ``_comm2``, ``_ready``,
    ``_group_err``, ``_in_progress``: the other mixins')."""

    e: Any
    last_text: bytes

    # -- windows ----------------------------------------------------------------------------------
    # dev_runtime.cc ncclCommWindowRegister (2.28.9-2.30.7): a NULL pointer, size 0 or no
    # symmetric support -> ncclSuccess and *win NOT written; else a registration task queued
    # between ncclGroupStartInternal / ncclGroupEndInternal: inside a user group it runs at the
    # group's end; on a nonblocking communicator ncclGroupEndInternal runs it asynchronously
    # and its ncclInProgress is swallowed by NCCLCHECK (the call says ncclSuccess while *win is
    # written later, when ncclCommGetAsyncError stops saying in progress).  The task
    # (ncclDevrWindowRegister) refuses an address not 4096-aligned in its allocation and ends
    # in a bootstrap barrier (symWindowCreate): collective, every rank in the same order.
    def _ncclCommWindowRegister(self, h: int, ptr: int, size: int, out: Any, flags: int) -> int:
        e = self._p2()
        c = self._comm2(h, "ncclCommWindowRegister")
        if c is None:
            return INVALID_ARG
        if e.version >= 22902:               # N2, 2.29.2+: NULL/0 refused; no symmetric
            if not ptr or not size:          # support: *win = NULL, ncclSuccess
                self.last_text = b"ncclCommWindowRegister: invalid buffer or size"
                return INVALID_ARG
            if not e.symmetric:
                out[0] = None
                return SUCCESS
        elif not ptr or not size:            # 2.28.9: NCCL's "goto exit", nothing written
            return SUCCESS
        elif not e.symmetric:                # 2.28.9 without symmetric support: a local
            r = e.new_id()                   # registration's handle (NCCL_LOCAL_REGISTER=1,
            e.registrations[r] = int(ptr)    # the default); deregistered as one (N5)
            out[0] = r
            return SUCCESS
        code = self._ready(c)
        if code:
            return code
        addr = ctypes.cast(out, ctypes.c_void_p).value
        with e.lock:
            k = getattr(c, "win_count", 0)
            c.win_count = k + 1
        task = self._win_task(c, h, k, int(ptr), int(size), int(flags), addr)
        t = e.tls()
        if t.group_depth:                    # at the user's group end
            t.rma.append(lambda: self._run_task(c, task))
            return SUCCESS
        code = self._run_task(c, task)
        return SUCCESS if code == IN_PROGRESS else code

    def _win_task(self, c: Any, h: int, k: int, ptr: int, size: int, flags: int,
                  addr: int) -> Callable[[], int]:
        """The registration task: -> IN_PROGRESS until every rank registered its k-th window
        (the barrier), then writes ``*win`` at ``addr`` and says SUCCESS (or the refusal)."""
        e = self.e
        state: Dict[str, Any] = {}

        def step() -> int:
            with e.lock:
                if "code" in state:
                    return state["code"]
                if "w" not in state:
                    if ptr % 4096:           # "Window address must be suitably aligned."
                        self.last_text = b"Window address must be suitably aligned."
                        state["code"] = INVALID_ARG
                        return INVALID_ARG
                    e.windows[(c.world.id, k, c.rank)] = (ptr, size, flags)
                    state["w"] = w = e.new_id()
                    e.win_handles[w] = (c.world.id, k, c.rank, h)
                    e.arrived[(c.world.id, k)].add(c.rank)
                if len(e.arrived[(c.world.id, k)]) < c.world.nranks:
                    return IN_PROGRESS
                ctypes.c_void_p.from_address(addr).value = state["w"]
                state["code"] = SUCCESS
                return SUCCESS
        return step

    def _run_task(self, c: Any, task: Callable[[], int]) -> int:
        """A group task of ``c``: to completion now (blocking), or left to
        ncclCommGetAsyncError's polls (nonblocking: IN_PROGRESS)."""
        if c.nonblocking:
            c.pending = getattr(c, "pending", []) + [task]
            c.async_state = IN_PROGRESS
            return IN_PROGRESS
        deadline = time.monotonic() + 30
        while True:
            code = task()
            if code != IN_PROGRESS:
                return code
            if c.abort_flag:
                return INTERNAL
            if time.monotonic() > deadline:
                return SYSTEM
            time.sleep(0.001)

    def _ncclCommWindowDeregister(self, h: int, win: int) -> int:
        e = self._p2()
        if self._comm2(h, "ncclCommWindowDeregister") is None:
            return INVALID_ARG
        if not win:
            return SUCCESS
        if not e.symmetric:                  # dev_runtime.cc: -> ncclCommDeregister (N5)
            if e.registrations.pop(int(win), None) is None:
                self.last_text = b"Deregister: Could not find handle"
                return INVALID_USAGE
            return SUCCESS
        with e.lock:
            got = e.win_handles.pop(int(win), None)
            if got is None:           # dev_runtime.cc symWindowDestroy -> ncclShadowPoolToHost
                e.violations.append(f"ncclCommWindowDeregister of an unknown window {win!r}")
                self.last_text = b"Device object does not exist in shadow pool."
                return INTERNAL
            e.windows.pop(got[:3], None)
        return SUCCESS

    def _ncclWinGetUserPtr(self, h: int, win: int, out: Any) -> int:
        """dev_runtime.cc ncclWinGetUserPtr (2.29.2-dev): out NULL -> 4; no symmetric support
        -> *out = NULL, 0; win NULL -> 4; an unknown window -> 3 (shadow pool)."""
        e = self._p2()
        if self._comm2(h, "ncclWinGetUserPtr") is None or not out:
            return INVALID_ARG
        if not e.symmetric:
            out[0] = None
            return SUCCESS
        if not win:
            return INVALID_ARG
        if int(win) not in e.win_handles:
            self.last_text = b"Device object does not exist in shadow pool."
            return INTERNAL
        out[0] = e.windows[e.win_handles[int(win)][:3]][0]
        return SUCCESS

    # -- one-sided RMA ----------------------------------------------------------------------------
    # enqueue.cc rmaTaskAppend (2.29.2-2.30.7): host RMA support (symmetric support and
    # numRmaCtx > 0), then ctx == 0, sigIdx == 0, flags == 0 (ncclInvalidArgument each); a put's
    # peerWin and source non-NULL and the source inside a window registered
    # NCCL_WIN_COLL_SYMMETRIC (ncclDevrFindWindow finds the window holding its first byte);
    # ncclWaitSignal: nDesc > 0, each opCnt > 0, sigIdx == 0, ctx == 0.  From NCCL 2.32
    # (numRmaSig in nccl.h) ON PURPOSE: sigIdx < numRmaSig and ctx < numRmaCtx, each 1 unless the
    # config set it (2.32's source is not public; 2.30.7 defaults numRmaCtx to 1).
    def _rma_refusal(self, c: Any, sig: int, ctx: int, flags: int = 0) -> int:
        e = self._p2()
        n_sig, n_ctx = getattr(c, "rma_cfg", (None, None))
        if not e.symmetric or n_ctx == 0:
            self.last_text = b"One sided RMA: host RMA is not supported in this communicator."
            return INVALID_ARG
        if e.version < 23200:
            n_sig = n_ctx = 1
        if not 0 <= int(ctx) < (n_ctx or 1):
            self.last_text = f"Context {ctx} is invalid (must be 0)".encode()
            return INVALID_ARG
        if not 0 <= int(sig) < (n_sig or 1):
            self.last_text = f"Signal index {sig} is invalid (must be 0)".encode()
            return INVALID_ARG
        if flags:
            self.last_text = f"Flags {flags} is invalid (must be 0)".encode()
            return INVALID_ARG
        return SUCCESS

    def _rma(self, h: int, stream: int, call: str, item: Callable[[Any], _Item],
             check: Callable[[Any], int], peer: Any = None) -> int:
        """enqueue.cc ncclEnqueueCheck, as for a collective (O1): revoked -> 5, EnsureReady
        (4 while in progress), ArgsCheck (a put's or signal's peer in range, else 4), then
        rmaTaskAppend's refusals (``check``); the task joins the thread's group as collective
        work (O6): at the group's end, or at once -- on a nonblocking communicator as
        ncclInProgress."""
        e = self._p2()
        c = self._comm2(h, call)
        if c is None:
            return self._group_err(INVALID_ARG)
        if getattr(c, "revoked", False):
            self.last_text = f"{call[4:]}: communicator was revoked".encode()
            return self._group_err(INVALID_USAGE)
        code = self._ready(c) or (check(c) if peer is None or 0 <= int(peer) < c.world.nranks
                                  else INVALID_ARG)
        if code:
            if code == INVALID_ARG and peer is not None and not 0 <= int(peer) < c.world.nranks:
                self.last_text = f"{call[4:]} : invalid root {peer}".encode()
            return self._group_err(code)
        e.calls.append((call + ":issued", h, 0))
        t = e.tls()
        thunk = (lambda: e.enqueue(stream, lambda: item(c), device=c.device))
        if t.group_depth:
            t.rma.append(thunk)
            t.rma_comms = getattr(t, "rma_comms", []) + [c]
            return SUCCESS
        thunk()
        return self._in_progress(c)

    def _ncclPutSignal(self, buf, count, dt, peer, win, off, sig, ctx, flags, h, stream):
        e = self._p2()
        nbytes = int(count) * _BY_ENUM[dt].itemsize
        got = e.win_handles.get(int(win or 0))

        def check(c: Any) -> int:
            code = self._rma_refusal(c, sig, ctx, flags)
            if code:
                return code
            if got is None or not buf:
                self.last_text = b"ncclPutSignal: peerWin is NULL" if got is None else \
                    b"ncclPutSignal: srcBuff is NULL"
                return INVALID_ARG
            src = int(buf)
            mine = [v for k, v in e.windows.items() if k[0] == c.world.id and k[2] == c.rank]
            if not any(p <= src < p + n and f & 1 for p, n, f in mine):
                self.last_text = b"ncclPutSignal: srcWinHost is not in a valid symmetric window"
                return INVALID_ARG
            return SUCCESS

        def item(c: Any) -> _Item:
            def run() -> None:
                dst = e.windows.get((got[0], got[1], int(peer)))
                if dst is None or int(off) + nbytes > dst[1]:
                    e.violations.append(f"put of {nbytes} bytes at {off} outside rank {peer}'s "
                                        f"window")
                    return
                ctypes.memmove(dst[0] + int(off), int(buf), nbytes)
                e.signals[(c.world.id, int(peer), c.rank, int(sig), int(ctx))] += 1
            return _Item("copy", run=run)
        return self._rma(h, stream, "ncclPutSignal", item, check, peer)

    def _ncclSignal(self, peer, sig, ctx, flags, h, stream):
        e = self._p2()

        def item(c: Any) -> _Item:
            def run() -> None:
                e.signals[(c.world.id, int(peer), c.rank, int(sig), int(ctx))] += 1
            return _Item("copy", run=run)
        return self._rma(h, stream, "ncclSignal", item,
                         lambda c: self._rma_refusal(c, sig, ctx, flags), peer)

    def _ncclWaitSignal(self, n, descs, h, stream):
        e = self._p2()
        if int(n) < 1 or not descs:
            self.last_text = b"ncclWaitSignal: invalid arguments"
            return INVALID_ARG
        from ncclpy._nccl.functions import WaitSignalDescStruct
        arr = (WaitSignalDescStruct * int(n)).from_address(int(descs))
        rows = [(d.opCnt, d.peer, d.sigIdx, d.ctx) for d in arr]    # copied now

        def check(c: Any) -> int:
            for cnt, _p, sig, ctx in rows:
                code = self._rma_refusal(c, sig, ctx) or (INVALID_ARG if cnt <= 0 else SUCCESS)
                if code:
                    return code
            return SUCCESS

        def item(c: Any) -> _Item:
            keys = [((c.world.id, c.rank, p, s, x), cnt) for cnt, p, s, x in rows]

            def ready() -> bool:
                if all(e.signals[k] >= cnt for k, cnt in keys):
                    for k, cnt in keys:
                        e.signals[k] -= cnt
                    return True
                return False
            return _Item("wait", ready=ready)
        return self._rma(h, stream, "ncclWaitSignal", item, check)
