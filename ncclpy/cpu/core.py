"""The CPU engine's core: streams as ordered queues, the stand-in's communicators and what runs
at the heads of the streams (:class:`EngineCore`).  :mod:`ncclpy.cpu.engine` puts the libnccl
and CUDA runtime halves on top (:class:`ncclpy.cpu.engine.Engine`); everything of the engine
imports this module, and it imports none of them (see :mod:`ncclpy.cpu.engine` for what the
engine models and records).

A collective runs when every rank's call has reached the head of its stream; a reduction folds
in NCCL's order for the configuration its communicator runs (:mod:`ncclpy.cpu.folds`), the
other collectives move bytes, send/recv pairs copy.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..semantics import numerics as nm
from ..semantics.ops import RedOp
from .codes import BY_ENUM as _BY_ENUM, OPS as _OPS, SUCCESS
from .folds import reduce_outputs

__all__ = ["EngineCore", "Graph"]

log = logging.getLogger(__name__)


class _Mem:
    """A pool allocation: keeps its bytes alive while referenced."""

    def __init__(self, nbytes: int) -> None:   # page-aligned, as cuMem memory is
        self.buf = ctypes.create_string_buffer(max(int(nbytes), 1) + 4096)
        self.ptr = (ctypes.addressof(self.buf) + 4095) & ~4095


# -- streams and work items -------------------------------------------------------------------
@dataclass
class _Op:
    """One NCCL operation of a submission: its matching key, and what it moves."""
    key: Tuple[Any, ...]
    rank: int
    kind: str
    args: Dict[str, Any]
    done: bool = False


@dataclass
class _Item:
    """One entry of a stream: a copy, a free, a wait on an event, or an NCCL submission."""
    kind: str                                   # copy | free | wait | nccl | mark
    run: Optional[Callable[[], None]] = None
    ops: List[_Op] = field(default_factory=list)
    ready: Optional[Callable[[], bool]] = None
    done: bool = False
    id: int = field(default_factory=itertools.count(1).__next__)
    reached: bool = False                       # a wait item has been at its stream's head
    pre: List["_Item"] = field(default_factory=list)   # waits that must be reached first


class Graph:
    """A captured sequence (the stand-in's CUDA graph): ``launch(stream)`` re-enqueues it."""

    def __init__(self, items: List[Callable[[], _Item]]) -> None:
        self.makers = items


@dataclass
class _Comm:
    handle: int
    world: "_World"
    rank: int
    device: int
    nonblocking: bool
    async_state: int = SUCCESS
    async_shown: int = 0            # set during an operation in progress (ncclCommSetAsyncError)
    polls_left: int = 0
    freed: str = ""                 # "", "aborted", "destroyed"
    finalized: bool = False
    abort_flag: bool = False
    busy: Dict[int, str] = field(default_factory=dict)   # thread ident -> call inside
    coll_seq: int = 0
    p2p_seq: Dict[Tuple[int, int, str], int] = field(default_factory=lambda: defaultdict(int))
    # what NCCL reads at init and its calls' algorithm choice (ncclpy.cpu.algo): the pins of
    # NCCL_ALGO/NCCL_PROTO/NCCL_*NCHANNELS/NCCL_*BUFFSIZE (None: init refused them), the code
    # the init then returns once every rank joined (ncclTopoTuneModel's), each (collective,
    # datatype)'s Choice or refusal text
    pins: Any = None
    init_refusal: int = SUCCESS
    init_text: bytes = b""
    choices: Dict[Tuple[str, int], Any] = field(default_factory=dict)


@dataclass
class _World:
    uid: bytes
    nranks: int
    joined: Dict[int, int] = field(default_factory=dict)   # rank -> handle
    id: int = field(default_factory=itertools.count(1).__next__)


class EngineCore:
    """The engine's state and its streams: the stand-in libnccl (``.nccl``) and CUDA runtime
    (``.cuda``) share it.

    ``nccl_type`` / ``runtime_type``: the classes of ``.nccl`` and ``.cuda``, each made once with
    the engine; :class:`ncclpy.cpu.engine.Engine` names ncclpy's (this module cannot: they
    import it), a subclass names its own."""

    nccl_type: Optional[type] = None
    runtime_type: Optional[type] = None

    def __init__(self, ndev: int = 8, version: int = 22809, polls: int = 2) -> None:
        self.lock = threading.RLock()
        self.ndev = ndev
        self.version = version
        self.polls = polls                       # in-progress polls of a nonblocking call
        self.calls: List[Tuple[str, int, int]] = []   # (name, handle, thread ident)
        self.configs: List[Tuple[str, int]] = []       # (collective, ncclCollConfig_t address)
        self.scalable_ids: List[Tuple[int, bytes]] = []  # (rank, ids) of InitRankScalable
        self.violations: List[str] = []
        self.graph_refs: Dict[int, int] = defaultdict(int)   # handle -> live graphs holding it
        self.comms: Dict[int, _Comm] = {}
        self.worlds: Dict[bytes, _World] = {}
        self.streams: Dict[Tuple[int, int], deque] = defaultdict(deque)
        self.events: Dict[int, Any] = {}
        self.premul: Dict[int, Tuple[bytes, int]] = {}
        self.capturing: Dict[Tuple[int, int], List[Callable[[], _Item]]] = {}
        self.async_allocs: Dict[int, _Mem] = {}
        self.registrations: Dict[int, int] = {}
        self.mem: Dict[int, _Mem] = {}
        self._tls = threading.local()
        self._ids = itertools.count(0x1000, 0x10)
        if self.nccl_type is None or self.runtime_type is None:
            raise TypeError("EngineCore has no libnccl or CUDA runtime of its own: make a "
                            "ncclpy.cpu.engine.Engine (or a subclass naming nccl_type and "
                            "runtime_type)")
        self.nccl = self.nccl_type(self)
        self.cuda = self.runtime_type(self)

    # -- thread state ---------------------------------------------------------------------------
    def tls(self) -> Any:
        t = self._tls
        if not hasattr(t, "device"):
            t.device, t.group_depth, t.group, t.rma = 0, 0, [], []
            t.stream = 0
        return t

    def new_id(self) -> int:
        return next(self._ids)

    # -- streams --------------------------------------------------------------------------------
    def skey(self, stream: int, device: Optional[int] = None) -> Tuple[int, int]:
        """Legacy/per-thread default streams are per device; others are global handles
        (``stream``: as C passed it, None for a NULL ``cudaStream_t``)."""
        stream = int(stream or 0)
        if stream in (0, 1, 2):
            return (self.tls().device if device is None else device, stream)
        return (-1, stream)

    def enqueue(self, stream: int, make: Callable[[], _Item], device: Optional[int] = None
                ) -> Optional[_Item]:
        key = self.skey(stream, device)
        with self.lock:
            cap = self.capturing.get(key)
            if cap is not None:
                cap.append(make)
                return None
            item = make()
            self.streams[key].append(item)
            self.progress()
            return item

    def progress(self) -> None:
        """Run what can run: stream heads that are copies/frees/satisfied waits, and every
        NCCL op whose partners are all at the heads of their streams."""
        with self.lock:
            changed = True
            while changed:
                changed = False
                heads = {}
                for key, q in self.streams.items():
                    while q and q[0].done:
                        q.popleft()
                    if q:
                        heads[key] = q[0]
                for key, it in heads.items():
                    if it.kind in ("copy", "free", "mark"):
                        if it.run is not None:
                            it.run()
                        it.done, changed = True, True
                    elif it.kind == "wait" and (setattr(it, "reached", True) or it.ready()):
                        it.done, changed = True, True
                changed = self._advance([it for it in heads.values() if it.kind == "nccl"]) \
                    or changed

    def _advance(self, items: List[_Item]) -> bool:
        """Run the NCCL ops of the stream heads ``items`` whose partners are all at the heads of
        their streams (ranks of this process); True when something ran.  The cross-process
        engine (:mod:`ncclpy.cpu.transport`) overrides it."""
        changed = False
        by_key: Dict[Tuple[Any, ...], List[_Op]] = defaultdict(list)
        for it in items:
            for op in it.ops:
                if not op.done:
                    by_key[op.key].append(op)
        for key, ops in by_key.items():
            if self.ready(key, ops):           # every participant is at its head
                self._execute(ops)
                for op in ops:
                    op.done = True
                changed = True
        for it in items:
            if all(op.done for op in it.ops):
                it.done, changed = True, True
        return changed

    def ready(self, key: Tuple[Any, ...], ops: List[_Op]) -> bool:
        """Whether the NCCL op ``key`` can run: all ``key[-1]`` participants are at the heads of
        their streams (``ops``)."""
        return len(ops) == key[-1]

    def _execute(self, ops: List[_Op]) -> None:
        kind = ops[0].kind
        if kind == "p2p":
            send = next(o for o in ops if o.args["dir"] == "send")
            recv = next(o for o in ops if o.args["dir"] == "recv")
            n = send.args["nbytes"]
            if n != recv.args["nbytes"]:
                self.violations.append(f"send of {n} bytes matched a recv of "
                                       f"{recv.args['nbytes']}")
            ctypes.memmove(recv.args["buf"], send.args["buf"], min(n, recv.args["nbytes"]))
            return
        ops = sorted(ops, key=lambda o: o.rank)
        a = ops[0].args
        name, dt, count = a["fn"], _BY_ENUM[a["dtype"]], a["count"]
        bad = self._mismatch(ops)
        if bad:                        # NCCL: undefined (hang or garbage); never rank 0's call
            self.violations.append(f"mismatched collective: {bad}")
            return
        n = len(ops)
        wire, isz = dt.name, dt.itemsize

        def read(ptr: int, k: int) -> np.ndarray:
            # a view, not a copy: every result below is a new array, made before any write
            if not k:
                return nm.from_bits(np.zeros(0, dt.view), wire)
            raw = (ctypes.c_char * (k * isz)).from_address(ptr)
            return nm.from_bits(np.frombuffer(raw, dtype=dt.view), wire)

        def write(ptr: Optional[int], arr: np.ndarray) -> None:
            if not ptr:                        # another process's rank: it writes its own
                return
            b = np.ascontiguousarray(nm.as_bits(np.asarray(arr), wire))
            if b.nbytes:
                ctypes.memmove(ptr, b.ctypes.data, b.nbytes)
        if name in ("AllReduce", "Reduce", "ReduceScatter"):
            total = count * n if name == "ReduceScatter" else count
            ins = [read(o.args["send"], total) for o in ops]
            op, sb = self._op(a["op"])
            sbs = [o.args.get("_sb", self._op(o.args["op"])[1]) if sb is not None else None
                   for o in ops]
            writers = [o for o in ops if o.args.get("recv") and
                       (name != "Reduce" or o.rank == a["root"])]
            outs = reduce_outputs(name, ins, op, sbs, wire, count, a.get("root", 0),
                                  a.get("_choice"), self.version, [o.rank for o in writers])
            for o in writers:
                write(o.args["recv"], outs[o.rank])
        elif name == "Broadcast":
            data = read(ops[a["root"]].args["send"], count)
            for o in ops:
                write(o.args.get("recv"), data)
        elif name == "AllGather":
            data = np.concatenate([read(o.args["send"], count) for o in ops])
            for o in ops:
                write(o.args.get("recv"), data)
        elif name == "AlltoAll":
            ins = [read(o.args["send"], count * n) for o in ops]
            for o in ops:
                write(o.args.get("recv"), np.concatenate(
                    [ins[s][o.rank * count:(o.rank + 1) * count] for s in range(n)]))
        elif name == "Gather":
            data = np.concatenate([read(o.args["send"], count) for o in ops])
            write(ops[a["root"]].args.get("recv"), data)
        elif name == "Scatter":
            data = read(ops[a["root"]].args["send"], count * n)
            for o in ops:
                write(o.args.get("recv"), data[o.rank * count:(o.rank + 1) * count])
        else:  # pragma: no cover
            self.violations.append(f"stand-in has no {name}")

    def _signature(self, args: Dict[str, Any]) -> Dict[str, Any]:
        """What every rank of one collective must pass alike (RULES.md E8): the function,
        datatype, count, root and reduction op (a PreMulSum's handle and scalar are each
        rank's own, nccl.h: only its being a PreMulSum of that datatype)."""
        op = args.get("op")
        if op is not None and op not in _OPS:
            op = ("premul_sum", self.premul[op][1]) if op in self.premul else ("unknown", op)
        return {"fn": args["fn"], "dtype": args["dtype"], "count": args["count"],
                "root": args.get("root"), "op": op}

    def _mismatch(self, ops: List[_Op]) -> str:
        """"" when the ranks of one collective (``ops``, rank order) agree, else what differs
        (each field with every rank's value)."""
        sigs = [self._signature(o.args) for o in ops]
        diff = [k for k in sigs[0] if any(s[k] != sigs[0][k] for s in sigs[1:])]
        return "; ".join(f"{k} differs across ranks: " + ", ".join(
            f"rank {o.rank} {s[k]!r}" for o, s in zip(ops, sigs)) for k in diff)

    def _op(self, op: int) -> Tuple[Any, Optional[int]]:
        if op in _OPS:
            return _OPS[op], None
        scalar, dtype = self.premul[op]
        isz = _BY_ENUM[dtype].itemsize
        return RedOp("premul_sum", 1.0), int.from_bytes(scalar[:isz], "little")

    # -- the libnccl and CUDA sides share these --------------------------------------------------
    def comm(self, handle: int, call: str) -> Optional[_Comm]:
        c = self.comms.get(int(handle or 0))
        if c is None:
            self.violations.append(f"{call} on an unknown handle {handle!r}")
            return None
        if c.freed:
            self.violations.append(f"{call} on a {c.freed} handle (rank {c.rank})")
            return None
        return c


