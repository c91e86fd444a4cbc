"""STAND-IN for NCCL 2.27-2.32's host API part 2 (a mixin of tests/nccl_standin_lib.py's
StandInNccl): symmetric windows, one-sided RMA, shrink / revoke / grow, suspend / resume /
memory statistics -- for CPU tests of ncclpy's own logic (ordering, lifecycle, arguments,
what reaches NCCL) on thread-ranks.  It never makes a GPU test pass.

What it models: window registration is collective and ordered (the k-th registration of each
rank is one window; ``eng.symmetric = False`` makes NCCL register nothing, as on ranks that
share a GPU); a put copies into the peer's k-th window and raises the peer's signal counter; a
wait completes once the counters reach its counts and consumes them; calls made inside a group
run at its end.  Revoke stops blocked calls (the abort flag) and is in progress for a few
polls; shrink forms the survivors' world; grow joins the existing and new ranks through the id
the root made.  It records as violations what NCCL forbids or what could hang: a finalize or a
destroy of a revoked communicator, any call but resume / mem stats / abort on a suspended one.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Tuple

from nccl_standin import _BY_ENUM, INTERNAL, INVALID_ARG, IN_PROGRESS, SUCCESS, SYSTEM, _Item
from ncclpy._nccl.config import NcclConfigStruct

__all__ = ["StandInPart2", "PART2_HANDLE_FIRST", "PART2_HANDLE_LAST"]


def _config(cfg: Any) -> NcclConfigStruct:
    """The ncclConfig_t a call was given as ncclpy passes it (the struct, which the real
    binding's POINTER argtype turns into its address; or an address)."""
    return cfg if isinstance(cfg, NcclConfigStruct) else NcclConfigStruct.from_address(int(cfg))

#: calls whose ncclComm_t is the first / the second to last argument
PART2_HANDLE_FIRST = ("ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclWinGetUserPtr",
                      "ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId",
                      "ncclCommGrow", "ncclCommSuspend", "ncclCommResume", "ncclCommMemStats")
PART2_HANDLE_LAST = ("ncclPutSignal", "ncclSignal", "ncclWaitSignal")
_OK_SUSPENDED = ("ncclCommResume", "ncclCommMemStats", "ncclCommAbort",
                 "ncclCommGetAsyncError")


class StandInPart2:
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
        return e

    def _comm2(self, h: int, call: str) -> Any:
        c = self.e.comm(h, call)
        if c is not None and getattr(c, "suspended", False) and call not in _OK_SUSPENDED:
            self.e.violations.append(f"{call} on a suspended communicator (rank {c.rank})")
        return c

    # -- windows ----------------------------------------------------------------------------------
    def _ncclCommWindowRegister(self, h: int, ptr: int, size: int, out: Any, flags: int) -> int:
        e = self._p2()
        c = self._comm2(h, "ncclCommWindowRegister")
        if c is None or not ptr or size <= 0:
            return INVALID_ARG
        if int(ptr) % 4096:
            return INVALID_ARG
        out._obj.value = None
        if not e.symmetric:
            return SUCCESS                   # no symmetric support: NULL window, success
        with e.lock:
            k = getattr(c, "win_count", 0)
            c.win_count = k + 1
            e.windows[(c.world.id, k, c.rank)] = (int(ptr), int(size), int(flags))
            w = e.new_id()
            e.win_handles[w] = (c.world.id, k, c.rank, h)
        out._obj.value = w
        return SUCCESS

    def _ncclCommWindowDeregister(self, h: int, win: int) -> int:
        e = self._p2()
        if self._comm2(h, "ncclCommWindowDeregister") is None:
            return INVALID_ARG
        if not win:
            return SUCCESS
        with e.lock:
            got = e.win_handles.pop(int(win), None)
            if got is None:
                e.violations.append(f"ncclCommWindowDeregister of an unknown window {win!r}")
                return INVALID_ARG
            e.windows.pop(got[:3], None)
        return SUCCESS

    def _ncclWinGetUserPtr(self, h: int, win: int, out: Any) -> int:
        e = self._p2()
        if self._comm2(h, "ncclWinGetUserPtr") is None or int(win or 0) not in e.win_handles:
            return INVALID_ARG
        out._obj.value = e.windows[e.win_handles[int(win)][:3]][0]
        return SUCCESS

    # -- one-sided RMA ----------------------------------------------------------------------------
    def _rma(self, h: int, stream: int, call: str, item: Callable[[Any], _Item]) -> int:
        e = self._p2()
        c = self._comm2(h, call)
        if c is None:
            return INVALID_ARG
        e.calls.append((call + ":issued", h, 0))
        t = e.tls()
        thunk = (lambda: e.enqueue(stream, lambda: item(c), device=c.device))
        if t.group_depth:
            t.rma.append(thunk)
        else:
            thunk()
        return SUCCESS

    def _ncclPutSignal(self, buf, count, dt, peer, win, off, sig, ctx, flags, h, stream):
        e = self._p2()
        nbytes = int(count) * _BY_ENUM[dt].itemsize
        got = e.win_handles.get(int(win or 0))
        if got is None:
            return INVALID_ARG

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
        return self._rma(h, stream, "ncclPutSignal", item)

    def _ncclSignal(self, peer, sig, ctx, flags, h, stream):
        e = self._p2()

        def item(c: Any) -> _Item:
            def run() -> None:
                e.signals[(c.world.id, int(peer), c.rank, int(sig), int(ctx))] += 1
            return _Item("copy", run=run)
        return self._rma(h, stream, "ncclSignal", item)

    def _ncclWaitSignal(self, n, descs, h, stream):
        e = self._p2()
        from ncclpy._nccl.functions import WaitSignalDescStruct
        arr = (WaitSignalDescStruct * int(n)).from_address(int(descs))
        rows = [(d.opCnt, d.peer, d.sigIdx, d.ctx) for d in arr]    # copied now

        def item(c: Any) -> _Item:
            keys = [((c.world.id, c.rank, p, s, x), cnt) for cnt, p, s, x in rows]

            def ready() -> bool:
                if all(e.signals[k] >= cnt for k, cnt in keys):
                    for k, cnt in keys:
                        e.signals[k] -= cnt
                    return True
                return False
            return _Item("wait", ready=ready)
        return self._rma(h, stream, "ncclWaitSignal", item)

    # -- revoke, shrink, grow ---------------------------------------------------------------------
    def _ncclCommRevoke(self, h: int, flags: int) -> int:
        e = self.e
        c = self._comm2(h, "ncclCommRevoke")
        if c is None or flags != 0:
            return INVALID_ARG
        with e.lock:
            c.revoked = True
            c.abort_flag = True              # what is blocked in a call returns
            c.async_state, c.polls_left = IN_PROGRESS, e.polls
        return SUCCESS

    def _ncclCommShrink(self, h: int, excl: Any, n: int, out: Any, cfg: Any, flags: int) -> int:
        e = self.e
        c = self._comm2(h, "ncclCommShrink")
        if c is None:
            return INVALID_ARG
        gone = sorted(int(excl[i]) for i in range(int(n)))
        if c.rank in gone:
            e.violations.append(f"ncclCommShrink called by excluded rank {c.rank}")
            return INVALID_ARG
        with e.lock:
            if flags & 1:
                c.revoked, c.abort_flag = True, True
            k = getattr(c, "shrinks", 0)
            c.shrinks = k + 1
            alive = [r for r in range(c.world.nranks) if r not in gone]
            uid = repr((c.world.id, "shrink", k, tuple(gone))).encode()
            child = self._join(len(alive), uid, alive.index(c.rank), c.nonblocking)
            e.comms[child].device = c.device
        out._obj.value = child
        e.calls.append(("ncclCommShrink:" + ",".join(map(str, gone)), h, flags))
        if c.nonblocking:
            return IN_PROGRESS
        return self._wait_world(e.comms[child])

    def _ncclCommGetUniqueId(self, h: int, out: Any) -> int:
        e = self._p2()
        c = self._comm2(h, "ncclCommGetUniqueId")
        if c is None:
            return INVALID_ARG
        uid = os.urandom(128)
        ctypes.memmove(ctypes.addressof(out._obj), uid, 128)
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
            deadline = time.monotonic() + 30
            while getattr(c.world, "grow_uid", None) is None:   # the root made the id
                if time.monotonic() > deadline:
                    return SYSTEM
                time.sleep(0.001)
            uid, me = c.world.grow_uid, c.rank
        else:                                # a new rank: the id and its number given
            if not uid_p:
                return INVALID_ARG
            uid, me = ctypes.string_at(ctypes.addressof(uid_p._obj), 128), int(rank)
            if uid not in e.grows or not e.grows[uid].nranks <= me < int(n):
                return INVALID_ARG
        # nonblocking as NCCL decides it: the given config, else (existing rank) the parent's
        nb = (cfg is not None and _config(cfg).blocking == 0) or (
            bool(h) and cfg is None and c.nonblocking)
        child = self._join(int(n), b"grow" + uid, me, nb)
        out._obj.value = child               # NCCL writes *newcomm before the async init
        with e.lock:
            if h:                            # every existing rank read the id: consumed
                c.world.grow_reads = getattr(c.world, "grow_reads", 0) + 1
                if c.world.grow_reads == c.world.nranks:
                    c.world.grow_uid, c.world.grow_reads = None, 0
            if len(e.comms[child].world.joined) == int(n):
                e.grows.pop(uid, None)       # the last rank joined: a reuse is refused
        if nb:                               # in progress for e.polls polls once all joined
            e.comms[child].polls_left = e.polls
            return IN_PROGRESS
        return self._wait_world(e.comms[child])

    # -- suspend, resume, memory statistics -------------------------------------------------------
    def _ncclCommSuspend(self, h: int, flags: int) -> int:
        c = self._comm2(h, "ncclCommSuspend")
        if c is None or getattr(c, "suspended", False):
            return INVALID_ARG if c is None else INTERNAL
        c.suspended = True
        return SUCCESS

    def _ncclCommResume(self, h: int) -> int:
        c = self._comm2(h, "ncclCommResume")
        if c is None or not getattr(c, "suspended", False):
            self.e.violations.append("ncclCommResume of a communicator not suspended")
            return INVALID_ARG
        c.suspended = False
        return SUCCESS

    def _ncclCommMemStats(self, h: int, stat: int, out: Any) -> int:
        c = self._comm2(h, "ncclCommMemStats")
        if c is None or stat not in (0, 1, 2, 3):
            return INVALID_ARG
        sus = getattr(c, "suspended", False)
        movable = 0 if sus else 1 << 20
        out._obj.value = (movable, int(sus), 1 << 16, (1 << 16) + movable)[stat]
        return SUCCESS
