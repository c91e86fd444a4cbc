"""STAND-IN for libnccl's collectives and send/recv (a mixin of ncclpy/cpu/nccl.py's
CpuNccl; see ncclpy/cpu/engine.py): ncclEnqueueCheck's refusals (revoked, EnsureReady,
ArgsCheck), what joins the thread's group, and the stream items the engine runs.  CPU tests of
ncclpy's own logic only; it never makes a GPU test pass.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, Dict, List, Tuple

from .algo import call_choice, refusal_now
from .codes import _BY_ENUM, IN_PROGRESS, INVALID_ARG, INVALID_USAGE, SUCCESS
from .core import _Comm, _Item, _Op

__all__ = ["Colls", "live_ops", "op_owners", "overlap", "maker"]


class Colls:
    """The collective and p2p calls (``self.e``: the engine; ``_ready``, ``_group_err`` and
    ``_in_progress`` come from CpuNccl)."""

    e: Any

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
            e.enqueue(stream, maker(batch), device=c.device)
            code = max(code, self._in_progress(c))
        return code

    def _call(self, fn: str, h: int, stream: int, **args: Any) -> int:
        """enqueue.cc ncclEnqueueCheck (2.28.9-dev): CommCheck; revoked -> 5 ("%s:
        communicator was revoked"); EnsureReady; ArgsCheck; then taskAppend: an empty
        collective is dropped and a 1-rank one launched at once (nothing joins the group, so
        0 even on a nonblocking comm).  A failure inside a group fails its end (D4); on a
        nonblocking comm it becomes the async error (``fail:``)."""
        e = self.e
        c = e.comm(h, "nccl" + fn)
        if c is None:
            return self._group_err(INVALID_ARG)
        if getattr(c, "revoked", False):
            self.last_text = f"{fn}: communicator was revoked".encode()
            return self._group_err(INVALID_USAGE)
        code = self._ready(c)
        if code == SUCCESS:
            code = self._args_check(c, fn, args)
            if code == SUCCESS and fn not in ("Send", "Recv") and args["count"]:
                code = self._redop_type(c, fn, args)     # taskAppend: hostToDevRedOp
            if code and c.nonblocking:
                c.async_state = code
        elif c.nonblocking:                  # fail: ncclCommSetAsyncError(comm, ret), even
            self._set_async(c, code)         # while an init is in progress (C4)
        if code:
            return self._group_err(code)
        if fn in ("Send", "Recv"):
            args["nbytes"] = args.pop("count") * _BY_ENUM[args.pop("dtype")].itemsize
        elif args["count"] == 0:
            return SUCCESS                   # "Empty collectives can be discarded."
        if fn in ("Send", "Recv"):
            peer = args["peer"]
            src, dst = (c.rank, peer) if fn == "Send" else (peer, c.rank)
            with e.lock:
                # the k-th send of src to dst meets dst's k-th recv from src: one count per
                # side (a rank sending to itself counts its sends and its recvs apart)
                seq = c.p2p_seq[(src, dst, fn)]
                c.p2p_seq[(src, dst, fn)] += 1
            op = _Op((c.world.id, "p2p", src, dst, seq, 2), c.rank, "p2p",
                     {"dir": fn.lower(), "buf": args["buf"], "nbytes": args["nbytes"]})
        else:
            bad = overlap(fn, c.rank, c.world.nranks, args)
            if bad:
                e.violations.append(f"nccl{fn} (rank {c.rank}): {bad}")
            if c.world.nranks > 1:           # (one rank: ncclLaunchOneRank, no algorithm)
                choice = call_choice(c, fn, args["dtype"], args.get("op", 0))
                if isinstance(choice, str):  # nothing enabled for it (RULES.md T2)
                    return self._no_algorithm(c, *refusal_now(c, fn, args["dtype"]))
                args["_choice"] = choice
            with e.lock:
                seq = c.coll_seq
                c.coll_seq += 1
            op = _Op((c.world.id, "coll", seq, c.world.nranks), c.rank, "coll",
                     {"fn": fn, **args})
            if c.world.nranks == 1:          # ncclLaunchOneRank: on the stream, no group work
                e.enqueue(stream, maker([op]), device=c.device)
                return SUCCESS
        t = e.tls()
        if t.group_depth:
            t.group.append((c, stream, op))
            return SUCCESS
        return self._submit([(c, stream, op)])

    def _no_algorithm(self, c: _Comm, code: int, text: bytes) -> int:
        """enqueue.cc:1848-1860 topoGetAlgoInfo: no algorithm/protocol enabled for the call ->
        ``code`` (ncclInvalidUsage where NCCL_ALGO or NCCL_PROTO is set when NCCL plans it,
        else ncclInternalError) and the WARN ``text`` (:func:`refusal_now`), when NCCL
        plans it (group.cc groupLaunch -> ncclPrepareTasks): inside a group the call says 0
        and the outermost ncclGroupEnd fails (``_ncclGroupEnd``), dropping the group's work;
        outside one the call's own group end fails.  A nonblocking communicator launches in a
        thread: the call (or group end) says ncclInProgress and the async error becomes 5."""
        t = self.e.tls()
        if t.group_depth:
            if not getattr(t, "launch_error", None):
                t.launch_error = (code, text)
            t.launch_comms = getattr(t, "launch_comms", []) + [c]
            return SUCCESS
        self.last_text = text
        if c.nonblocking:
            c.async_state = code
            return IN_PROGRESS
        return code

    def _args_check(self, c: _Comm, fn: str, args: Dict[str, Any]) -> int:
        """argcheck.cc ArgsCheck (all): root (a p2p's peer) in [0, nranks), datatype known,
        op in range and, for a PreMulSum op, alive on this comm (pointer checks are off by
        default and not modelled)."""
        root = args.get("peer", args.get("root", 0))
        if not 0 <= root < c.world.nranks:
            self.last_text = (f"{fn} : invalid root {root} (root should be in the "
                              f"0..{c.world.nranks} range)").encode()
            return INVALID_ARG
        v = self.e.version
        # ncclNumTypes: 9 before 2.10 (no bfloat16), 10 to 2.23, 12 from 2.24.3 (float8);
        # ncclNumOps: 4 before 2.10 (no ncclAvg) (src/nccl.h.in at v2.9.9-1, v2.23.4-1,
        # v2.24.3-1; src/misc/argcheck.cc "invalid type" / "invalid reduction operation")
        ntypes = 12 if v >= 22403 else 10 if v >= 21003 else 9
        nops = 5 if v >= 21003 else 4
        if args["dtype"] not in _BY_ENUM or args["dtype"] >= ntypes:
            self.last_text = f"{fn} : invalid type {args['dtype']}".encode()
            return INVALID_ARG
        op = args.get("op", 0)
        if op < 0 or (nops <= op < 5) or (op >= 5 and live_ops(self.e).get(op) != c.handle):
            self.last_text = (f"{fn} : reduction operation {op} unknown to this communicator"
                              if op >= 5 else f"{fn} : invalid reduction operation {op}"
                              ).encode()
            self._stale_op(c, "nccl" + fn, op)
            return INVALID_ARG
        return SUCCESS

    def _stale_op(self, c: _Comm, call: str, op: int) -> None:
        """A PreMulSum op ncclpy must never pass again: destroyed (NCCL reuses its slot for
        the next op created: enqueue.cc ncclRedOpDestroy pushes it to the free list), or made
        on another communicator (ops are per comm: ncclUserRedOpMangle).  An op never
        created is NCCL's 4 alone."""
        owner = op_owners(self.e).get(op)
        if owner is None:
            return
        what = ("a destroyed PreMulSum op" if op not in live_ops(self.e)
                else "a PreMulSum op of another communicator")
        self.e.violations.append(f"{call} with {what} {op} (rank {c.rank})")

    def _redop_type(self, c: _Comm, fn: str, args: Dict[str, Any]) -> int:
        """enqueue.cc taskAppend -> hostToDevRedOp (2.28.9-dev; after the empty-collective
        discard): a PreMulSum op used with another datatype than it was created for -> 4
        ("Data type supplied to user-created ncclRedOp_t does not match type given to
        reduction operation"), also a violation."""
        op = args.get("op", 0)
        made = self.e.premul.get(op)
        if op >= 5 and made is not None and made[1] != args["dtype"]:
            self.last_text = (b"Data type supplied to user-created ncclRedOp_t does not match "
                              b"type given to reduction operation")
            self.e.violations.append(f"nccl{fn} with PreMulSum op {op} made for datatype "
                                     f"{made[1]} on datatype {args['dtype']} (rank {c.rank})")
            return INVALID_ARG
        if c.world.nranks == 1 and args["dtype"] in (10, 11) and (op == 4 or op >= 5):
            # taskAppend -> ncclLaunchOneRank (src/device/onerank.cu, 2.24.3-dev): a float8
            # PreMulSum (avg on a float, or a user op) falls to "default: return
            # ncclInvalidArgument" (its fp8 cases are compiled for device code only); no WARN.
            # ncclpy refuses it before (ops.effective_op): passing it is a violation.
            self.e.violations.append(f"nccl{fn} of a float8 PreMulSum (op {op}) on a one-rank "
                                     f"communicator (rank {c.rank})")
            return INVALID_ARG
        return SUCCESS

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
        return self._call("Send", h, stream, buf=buf, count=n, dtype=dt, peer=peer)

    def _ncclRecv(self, buf, n, dt, peer, h, stream):
        return self._call("Recv", h, stream, buf=buf, count=n, dtype=dt, peer=peer)


def live_ops(e: Any) -> Dict[int, int]:
    """PreMulSum ops not destroyed: op -> the comm that made it (NCCL's per-comm table)."""
    if not hasattr(e, "premul_live"):
        e.premul_live = {}
    return e.premul_live


def op_owners(e: Any) -> Dict[int, int]:
    """Every PreMulSum op ever made, destroyed or not: op -> the comm that made it."""
    if not hasattr(e, "premul_owner"):
        e.premul_owner = {}
    return e.premul_owner


def _extent(fn: str, c: int, n: int, me: int, root: int) -> Any:
    """(send elements, recv elements, sendbuff - recvbuff in elements when in place (None: no
    in-place form), whether only the root's pair is used) of collective ``fn``, or None.
    nccl.h (src/nccl.h.in, 2.28.9-dev) "In-place operation(s) will happen if ...": AllReduce,
    Broadcast, Reduce sendbuff == recvbuff; ReduceScatter recvbuff == sendbuff + rank*recvcount;
    AllGather sendbuff == recvbuff + rank*sendcount; Gather sendbuff == recvbuff + root*count;
    Scatter recvbuff == sendbuff + root*count; AlltoAll has none (also
    docs/userguide/source/usage/inplace.rst, 2.30.7)."""
    return {"AllReduce": (c, c, 0, False), "Broadcast": (c, c, 0, True),
            "Reduce": (c, c, 0, True), "ReduceScatter": (c * n, c, -me * c, False),
            "AllGather": (c, c * n, me * c, False), "Gather": (c, c * n, root * c, True),
            "Scatter": (c * n, c, -root * c, True), "AlltoAll": (c * n, c * n, None, False),
            }.get(fn)


def overlap(fn: str, rank: int, nranks: int, args: Dict[str, Any]) -> str:
    """"" unless this rank's send and recv buffers overlap other than in NCCL's in-place
    form (undefined behaviour: NCCL checks nothing and its kernels read what they already
    wrote), else what is wrong.  Broadcast, Reduce, Gather and Scatter use the pair on the
    root only (nccl.h: "On non-root ranks, recvbuff is not used"; ArgsCheck checks a
    Broadcast's sendbuff on the root only)."""
    root = args.get("root", 0)
    ext = _extent(fn, args["count"], nranks, rank, root)
    if ext is None or not args.get("send") or not args.get("recv"):
        return ""
    sn, rn, want, root_only = ext
    if root_only and rank != root:
        return ""
    isz = _BY_ENUM[args["dtype"]].itemsize
    s, r = int(args["send"]), int(args["recv"])
    if not (s < r + rn * isz and r < s + sn * isz):
        return ""                          # disjoint
    if want is not None and s - r == want * isz:
        return ""                          # in place
    form = "none exists" if want is None else f"sendbuff == recvbuff {want * isz:+d} bytes"
    return (f"sendbuff {s:#x} ({sn * isz} bytes) and recvbuff {r:#x} ({rn * isz} bytes) "
            f"overlap, not in place (NCCL's in-place form: {form})")


def maker(batch: List[_Op]) -> Callable[[], _Item]:
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
