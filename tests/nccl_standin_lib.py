"""STAND-IN for libnccl (the C functions under ``ncclpy._nccl.lib.NcclLib``): the libnccl half
of tests/nccl_standin.py's stand-in (see there).  CPU tests of ncclpy's own logic only; it
never makes a GPU test pass.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Tuple

from ncclpy._nccl import lib as _lib
from ncclpy._nccl.config import NcclConfigStruct

from nccl_standin import (_BY_ENUM, INTERNAL, INVALID_ARG, INVALID_USAGE, IN_PROGRESS, SUCCESS,
                          SYSTEM, StandIn, _Comm, _Item, _Mem, _Op, _World)

from nccl_standin_part2 import StandInPart2, PART2_HANDLE_FIRST, PART2_HANDLE_LAST  # noqa: E402

__all__ = ["StandInNccl"]


class _NcclError(Exception):
    """CuPy's NcclError stand-in (``.status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class StandInNccl(StandInPart2, _lib.NcclLib):
    """:class:`ncclpy._nccl.lib.NcclLib` with its C functions replaced by the engine's.
    Everything NcclLib builds on top of them (errors, checks, async_error, init through
    ``ncclCommInitRankConfig``, repair of the group depth) is NcclLib's own code."""

    def __init__(self, eng: StandIn) -> None:
        self.e = eng
        self.path = "stand-in libnccl"
        self.version = eng.version
        self.cupy_version = eng.version
        self._fns = {}
        self._seen_error = ""
        self.last_text = b""
        self.cupy_nccl = SimpleNamespace(NcclError=_NcclError, NcclCommunicator=self._cupy_comm,
                                         get_version=lambda: eng.version,
                                         check_status=self._cupy_check)

    def fn(self, name: str, check_version: bool = True) -> Callable:
        if check_version:
            _lib.require_version(name, self.version, self.path)
        impl = getattr(self, "_" + name, None)
        if impl is None:
            raise AttributeError(f"stand-in has no {name}")

        def call(*args: Any) -> Any:
            return self._enter(name, impl, args)
        return call

    # -- bookkeeping common to every call ----------------------------------------------------
    def _enter(self, name: str, impl: Callable, args: Tuple[Any, ...]) -> Any:
        e = self.e
        h = _handle_of(name, args)
        me = threading.get_ident()
        with e.lock:
            e.calls.append((name, h, me))
            code = e.fail.pop(name, None)
            if code is not None:
                self.last_text = f"stand-in: {name} made to fail".encode()
                return code
            c = e.comms.get(h) if h else None
            if c is not None:
                c.busy[me] = name
                if getattr(c, "suspended", False) and name not in (
                        "ncclCommResume", "ncclCommMemStats", "ncclCommAbort",
                        "ncclCommGetAsyncError"):
                    e.violations.append(f"{name} on a suspended communicator (rank {c.rank})")
        try:
            slow = e.slow.get(name)
            if slow:
                end = time.monotonic() + slow
                while time.monotonic() < end and not (c is not None and c.abort_flag):
                    time.sleep(0.005)
                if c is not None and c.abort_flag and name != "ncclCommAbort":
                    return INTERNAL
            return impl(*args)
        finally:
            if c is not None:
                with e.lock:
                    c.busy.pop(me, None)

    # -- errors and versions --------------------------------------------------------------------
    def _ncclGetVersion(self, out: Any) -> int:
        out._obj.value = self.version
        return SUCCESS

    def _ncclGetErrorString(self, code: int) -> bytes:
        return {0: b"no error", 4: b"invalid argument", 5: b"invalid usage",
                6: b"remote process exited or there was a network error",
                7: b"NCCL operation in progress"}.get(code, b"unhandled error")

    def _ncclGetLastError(self, comm: Any) -> bytes:
        return self.last_text

    def _ncclGetUniqueId(self, out: Any) -> int:
        ctypes.memmove(ctypes.addressof(out._obj), os.urandom(128), 128)
        return SUCCESS

    # -- communicators --------------------------------------------------------------------------
    def _join(self, nranks: int, uid: bytes, rank: int, nonblocking: bool) -> int:
        e = self.e
        with e.lock:
            w = e.worlds.setdefault(uid, _World(uid, nranks))
            h = e.new_id()
            dev = e.tls().device
            c = _Comm(h, w, rank, dev, nonblocking)
            e.comms[h] = c
            if rank in w.joined:
                e.violations.append(f"rank {rank} joined twice")
            w.joined[rank] = h
            if nonblocking:
                c.async_state = IN_PROGRESS
        return h

    def _wait_world(self, c: _Comm, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while len(c.world.joined) < c.world.nranks:
            if c.abort_flag:
                return INTERNAL
            if time.monotonic() > deadline:
                return SYSTEM
            time.sleep(0.001)
        return SUCCESS

    def _ncclCommInitRankConfig(self, out: Any, nranks: int, uid: Any, rank: int,
                                cfg: Any) -> int:
        nb = bool(cfg) and NcclConfigStruct.from_address(int(cfg)).blocking == 0
        h = self._join(int(nranks), uid.to_bytes(), int(rank), nb)
        out._obj.value = h
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
        out._obj.value = h
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
            if h in e.async_fail:
                out._obj.value = e.async_fail[h]
                return SUCCESS
            if c.async_state == IN_PROGRESS:
                if len(c.world.joined) < c.world.nranks:
                    out._obj.value = IN_PROGRESS
                    return SUCCESS
                if c.polls_left > 0:
                    c.polls_left -= 1
                else:
                    c.async_state = SUCCESS
            out._obj.value = c.async_state
        return SUCCESS

    def _in_progress(self, c: _Comm) -> int:
        if c.nonblocking:
            c.async_state, c.polls_left = IN_PROGRESS, self.e.polls
            return IN_PROGRESS
        return SUCCESS

    def _ncclCommFinalize(self, h: int) -> int:
        e = self.e
        c = e.comm(h, "ncclCommFinalize")
        if c is None:
            return INVALID_ARG
        if c.finalized:
            e.violations.append(f"ncclCommFinalize twice (rank {c.rank})")
        if getattr(c, "revoked", False):      # nccl.h: finalize after revoke is invalid
            e.violations.append(f"ncclCommFinalize after ncclCommRevoke (rank {c.rank})")
        c.finalized = True
        if e.graph_refs.get(h, 0) > 0:   # NCCL >= 2.26 polls until every graph died
            if c.nonblocking:
                c.async_state, c.polls_left = IN_PROGRESS, 10 ** 9
                return IN_PROGRESS
            while e.graph_refs.get(h, 0) > 0 and not c.abort_flag:
                time.sleep(0.005)
            return INTERNAL if c.abort_flag else SUCCESS
        return self._in_progress(c)

    def _ncclCommDestroy(self, h: int) -> int:
        e = self.e
        c = e.comm(h, "ncclCommDestroy")
        if c is None:
            return INVALID_ARG
        if getattr(c, "revoked", False):      # its barrier may wait for dead ranks
            e.violations.append(f"ncclCommDestroy of a revoked communicator (rank {c.rank})")
        c.freed = "destroyed"
        return SUCCESS

    def _ncclCommAbort(self, h: int) -> int:
        e = self.e
        with e.lock:
            c = e.comms.get(int(h or 0))
            if c is None or c.freed:
                e.violations.append(f"ncclCommAbort on a {c.freed if c else 'unknown'} handle")
                return INVALID_ARG
            c.abort_flag = True
            others = {t: n for t, n in c.busy.items() if t != threading.get_ident()}
            if others:
                e.calls.append(("abort-while-busy:" + ",".join(others.values()), h, 0))
        deadline = time.monotonic() + 5.0      # NCCL's abort waits for the blocked call to see
        while any(t != threading.get_ident() for t in c.busy) and time.monotonic() < deadline:
            time.sleep(0.002)                  # its abort flag
        c.freed = "aborted"
        return SUCCESS

    def _query(self, h: int, out: Any, what: str) -> int:
        c = self.e.comm(h, what)
        if c is None:
            return INVALID_ARG
        out._obj.value = {"ncclCommCount": c.world.nranks, "ncclCommUserRank": c.rank,
                          "ncclCommCuDevice": c.device}[what]
        return SUCCESS

    def _ncclCommCount(self, h: int, out: Any) -> int:
        return self._query(h, out, "ncclCommCount")

    def _ncclCommUserRank(self, h: int, out: Any) -> int:
        return self._query(h, out, "ncclCommUserRank")

    def _ncclCommCuDevice(self, h: int, out: Any) -> int:
        return self._query(h, out, "ncclCommCuDevice")

    def _ncclCommSplit(self, h: int, color: int, key: int, out: Any, cfg: Any) -> int:
        e = self.e
        c = e.comm(h, "ncclCommSplit")
        if c is None:
            return INVALID_ARG
        with e.lock:
            tag = (c.world.id, "split", c.coll_seq)
            c.coll_seq += 1
            sw = e.worlds.setdefault(repr(tag).encode(), _World(repr(tag).encode(), 0))
            sw.joined.setdefault(-1 - c.rank, (color, key))    # negative slots: the votes
        deadline = time.monotonic() + 30
        while len([k for k in sw.joined if k < 0]) < c.world.nranks:
            if time.monotonic() > deadline:
                return SYSTEM
            time.sleep(0.001)
        with e.lock:
            votes = sorted((v[1], -1 - k) for k, v in sw.joined.items() if k < 0
                           and v[0] == color)
            if color < 0:
                out._obj.value = None
                return self._in_progress(c)
            mine = [r for _, r in votes].index(c.rank)
            uid = repr((tag, color)).encode()
            child = self._join(len(votes), uid, mine, c.nonblocking)
            e.comms[child].device = c.device
        out._obj.value = child
        if c.nonblocking:
            e.comms[child].async_state = IN_PROGRESS
            return self._in_progress(c)
        return self._wait_world(e.comms[child])

    # -- registration, memory, premul ------------------------------------------------------------
    def _ncclCommRegister(self, h: int, ptr: int, nbytes: int, out: Any) -> int:
        if self.e.comm(h, "ncclCommRegister") is None:
            return INVALID_ARG
        r = self.e.new_id()
        self.e.registrations[r] = int(ptr)
        out._obj.value = r
        return SUCCESS

    def _ncclCommDeregister(self, h: int, reg: int) -> int:
        if self.e.comm(h, "ncclCommDeregister") is None:
            return INVALID_ARG
        if self.e.registrations.pop(int(reg), None) is None:
            return INVALID_ARG
        return SUCCESS

    def _ncclMemAlloc(self, out: Any, nbytes: int) -> int:
        m = _Mem(nbytes)
        self.e.mem[m.ptr] = m
        out._obj.value = m.ptr
        return SUCCESS

    def _ncclMemFree(self, ptr: int) -> int:
        return SUCCESS if self.e.mem.pop(int(ptr), None) is not None else INVALID_ARG

    def _ncclRedOpCreatePreMulSum(self, out: Any, scalar: Any, dtype: int, residence: int,
                                  h: int) -> int:
        c = self.e.comm(h, "ncclRedOpCreatePreMulSum")
        if c is None:
            return INVALID_ARG
        op = 5 + len(self.e.premul)
        self.e.premul[op] = (bytes(scalar.raw if hasattr(scalar, "raw") else scalar), dtype)
        out._obj.value = op
        return SUCCESS

    def _ncclRedOpDestroy(self, op: int, h: int) -> int:
        if self.e.comm(h, "ncclRedOpDestroy") is None:
            return INVALID_ARG
        return SUCCESS if op in self.e.premul else INVALID_ARG

    # -- groups and the calls themselves -----------------------------------------------------------
    def _ncclGroupStart(self) -> int:
        self.e.tls().group_depth += 1
        return SUCCESS

    def _ncclGroupEnd(self) -> int:
        t = self.e.tls()
        if t.group_depth == 0:
            self.last_text = b"ncclGroupEnd: not in a group call"
            return INVALID_USAGE
        t.group_depth -= 1
        if t.group_depth:
            return SUCCESS
        ops, t.group = t.group, []
        code = self._submit(ops)
        rma, t.rma = t.rma, []
        for thunk in rma:             # one-sided calls of the group (nccl_standin_part2)
            thunk()
        return code

    def _ncclGroupSimulateEnd(self, info: Any) -> int:
        """Like ncclGroupEnd, but the outermost end launches nothing and writes a stand-in
        estimate: 1 us per call of the group (ncclpy's own logic is what is under test)."""
        t = self.e.tls()
        if t.group_depth == 0:
            self.last_text = b"ncclGroupSimulateEnd: not in a group call"
            return INVALID_USAGE
        t.group_depth -= 1
        if t.group_depth:
            return SUCCESS
        ops, t.group = t.group, []
        info._obj.estimatedTime = float(len(ops))
        return SUCCESS

    def _submit(self, ops: List[Tuple[_Comm, int, _Op]]) -> int:
        """One stream item per (comm, stream) of the batch; nonblocking comms report
        in progress."""
        e = self.e
        groups: Dict[Tuple[int, int], List[_Op]] = defaultdict(list)
        for c, stream, op in ops:
            groups[(c.handle, stream)].append(op)
        code = SUCCESS
        for (h, stream), batch in groups.items():
            c = e.comms[h]
            e.enqueue(stream, _maker(batch), device=c.device)
            code = max(code, self._in_progress(c))
        return code

    def _call(self, fn: str, h: int, stream: int, **args: Any) -> int:
        e = self.e
        c = e.comm(h, "nccl" + fn)
        if c is None:
            return INVALID_ARG
        if fn in ("Send", "Recv"):
            peer = args["peer"]
            src, dst = (c.rank, peer) if fn == "Send" else (peer, c.rank)
            with e.lock:
                seq = c.p2p_seq[(src, dst)]
                c.p2p_seq[(src, dst)] += 1
            op = _Op((c.world.id, "p2p", src, dst, seq, 2), c.rank, "p2p",
                     {"dir": fn.lower(), "buf": args["buf"], "nbytes": args["nbytes"]})
        else:
            with e.lock:
                seq = c.coll_seq
                c.coll_seq += 1
            op = _Op((c.world.id, "coll", seq, c.world.nranks), c.rank, "coll",
                     {"fn": fn, **args})
        t = e.tls()
        if t.group_depth:
            t.group.append((c, stream, op))
            return SUCCESS
        return self._submit([(c, stream, op)])

    def _ncclAllReduce(self, s, r, n, dt, op, h, stream):
        return self._call("AllReduce", h, stream, send=s, recv=r, count=n, dtype=dt, op=op)

    def _ncclReduce(self, s, r, n, dt, op, root, h, stream):
        return self._call("Reduce", h, stream, send=s, recv=r, count=n, dtype=dt, op=op,
                          root=root)

    def _ncclBroadcast(self, s, r, n, dt, root, h, stream):
        return self._call("Broadcast", h, stream, send=s, recv=r, count=n, dtype=dt, root=root)

    def _ncclReduceScatter(self, s, r, n, dt, op, h, stream):
        return self._call("ReduceScatter", h, stream, send=s, recv=r, count=n, dtype=dt, op=op)

    def _ncclAllGather(self, s, r, n, dt, h, stream):
        return self._call("AllGather", h, stream, send=s, recv=r, count=n, dtype=dt)

    def _ncclAlltoAll(self, s, r, n, dt, h, stream):
        return self._call("AlltoAll", h, stream, send=s, recv=r, count=n, dtype=dt)

    def _ncclGather(self, s, r, n, dt, root, h, stream):
        return self._call("Gather", h, stream, send=s, recv=r, count=n, dtype=dt, root=root)

    def _ncclScatter(self, s, r, n, dt, root, h, stream):
        return self._call("Scatter", h, stream, send=s, recv=r, count=n, dtype=dt, root=root)

    # per-collective config (NCCL 2.31): the plain call, the config's address noted
    def _configured(self, fn: str, *args: Any) -> int:
        self.e.configs.append((fn, args[-1]))
        return getattr(self, "_nccl" + fn)(*args[:-1])

    def _ncclAllReduceConfig(self, *a):
        return self._configured("AllReduce", *a)

    def _ncclReduceConfig(self, *a):
        return self._configured("Reduce", *a)

    def _ncclBroadcastConfig(self, *a):
        return self._configured("Broadcast", *a)

    def _ncclAllGatherConfig(self, *a):
        return self._configured("AllGather", *a)

    def _ncclReduceScatterConfig(self, *a):
        return self._configured("ReduceScatter", *a)

    def _ncclAlltoAllConfig(self, *a):
        return self._configured("AlltoAll", *a)

    def _ncclGatherConfig(self, *a):
        return self._configured("Gather", *a)

    def _ncclScatterConfig(self, *a):
        return self._configured("Scatter", *a)

    def _ncclSend(self, buf, n, dt, peer, h, stream):
        return self._call("Send", h, stream, buf=buf, nbytes=n * _BY_ENUM[dt].itemsize,
                          peer=peer)

    def _ncclRecv(self, buf, n, dt, peer, h, stream):
        return self._call("Recv", h, stream, buf=buf, nbytes=n * _BY_ENUM[dt].itemsize,
                          peer=peer)

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


def _maker(batch: List[_Op]) -> Callable[[], _Item]:
    """The stream item of a submission; made again per replay of a captured graph, with keys
    that tell the k-th replay apart (every rank replays its graph in the same order)."""
    launches = [0]

    def make() -> _Item:
        k = launches[0]
        launches[0] += 1
        if k == 0:
            return _Item("nccl", ops=batch)
        return _Item("nccl", ops=[dataclasses.replace(o, key=o.key[:-1] + (("replay", k),)
                                                      + o.key[-1:], done=False)
                                  for o in batch])
    return make


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


