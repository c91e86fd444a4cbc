"""STAND-IN for libnccl and the CUDA runtime: CPU tests of ncclpy's own logic only.

It replaces, for a ``with standin(...)`` block, the two objects at ncclpy's native boundary:
the libnccl binding (:func:`ncclpy._nccl.lib.use_lib`) and the CUDA runtime
(:func:`ncclpy._nccl.cuda.use`).  Ranks are threads of this process; "device memory" is host
memory (real addresses, so ncclpy's pointers, copies and scratch are exercised as they are);
streams are ordered queues; events complete when what was queued before them has run.  A
collective runs when every rank's call has reached the head of its stream, and computes its
result with :mod:`ncclpy.reference` (send/recv pairs move bytes).  It can be made slow
(``slow``), fail (``fail``), keep a nonblocking communicator in progress (``polls``), and model
a CUDA graph that still holds a communicator (``graph_refs``).

It records what a real library could not tell a test: every call (``calls``), and every
violation of NCCL's rules that ncclpy must never commit (``violations``): a call on a freed or
aborted handle, a second ``ncclCommAbort``, a finalize or destroy after an abort, two threads
inside NCCL on one communicator, an ``ncclCommAbort`` while another thread is inside a call.
Its libnccl is entered through C function pointers bound with ncclpy's own ctypes declarations
(tests/nccl_standin_abi.py), and each behaviour it models cites the NCCL source it follows in
tests/nccl_standin_rules.md; its CUDA side models the stream-capture interaction modes.

It never makes a GPU test pass: GPU tests stay in tests/gpu and run against the real library.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ncclpy import numerics as nm
from ncclpy import reference as R
from ncclpy._nccl import cuda as _cuda
from ncclpy._nccl import lib as _lib
from ncclpy._nccl.cuda import CapturedEventError
from ncclpy.dtypes import DTYPES
from ncclpy.ops import RedOp

__all__ = ["StandIn", "standin", "DevArray", "run_ranks", "Graph"]

SUCCESS, UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARG, INVALID_USAGE, REMOTE, IN_PROGRESS = \
    range(8)
_BY_ENUM = {d.nccl: d for d in DTYPES.values()}
_OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


class StandInCudaError(RuntimeError):
    """What the stand-in CUDA runtime raises (CuPy's CUDARuntimeError's stand-in, with its
    ``status``: the cudaError_t)."""

    def __init__(self, msg: str, status: Optional[int] = None) -> None:
        super().__init__(msg)
        self.status = status


# -- "device" memory --------------------------------------------------------------------------
class DevArray:
    """A numpy array posing as device memory: ``__cuda_array_interface__`` v3 with a real host
    address, and ``.device``."""

    def __init__(self, arr: np.ndarray, device: int = 0, stream: Optional[int] = None) -> None:
        self.a = np.ascontiguousarray(arr)
        self.device = device
        self._stream = stream

    @property
    def __cuda_array_interface__(self) -> dict:
        d = {"shape": self.a.shape, "typestr": self.a.dtype.str,
             "data": (self.a.ctypes.data if self.a.size else 0, False), "version": 3,
             "strides": None}
        if self._stream is not None:
            d["stream"] = self._stream
        return d

    @property
    def ptr(self) -> int:
        return self.a.ctypes.data


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
    p2p_seq: Dict[Tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))


@dataclass
class _World:
    uid: bytes
    nranks: int
    joined: Dict[int, int] = field(default_factory=dict)   # rank -> handle
    id: int = field(default_factory=itertools.count(1).__next__)


class StandIn:
    """The engine: the stand-in libnccl (``.nccl``) and CUDA runtime (``.cuda``) share it."""

    def __init__(self, ndev: int = 8, version: int = 22809, polls: int = 2) -> None:
        self.lock = threading.RLock()
        self.ndev = ndev
        self.version = version
        self.polls = polls                       # in-progress polls of a nonblocking call
        self.calls: List[Tuple[str, int, int]] = []   # (name, handle, thread ident)
        self.configs: List[Tuple[str, int]] = []       # (collective, ncclCollConfig_t address)
        self.scalable_ids: List[Tuple[int, bytes]] = []  # (rank, ids) of InitRankScalable
        self.violations: List[str] = []
        self.slow: Dict[str, float] = {}         # NCCL call -> seconds it blocks
        self.fail: Dict[str, int] = {}           # NCCL call -> code it returns (once)
        self.async_fail: Dict[int, int] = {}     # handle -> async error to report
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
        from nccl_standin_lib import StandInNccl
        self.nccl = StandInNccl(self)
        self.cuda = StandInCuda(self)

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
                    elif it.kind == "wait" and it.ready():
                        it.done, changed = True, True
                at_head = [op for it in heads.values() if it.kind == "nccl" for op in it.ops
                           if not op.done]
                by_key: Dict[Tuple[Any, ...], List[_Op]] = defaultdict(list)
                for op in at_head:
                    by_key[op.key].append(op)
                for key, ops in by_key.items():
                    if self.ready(key, ops):           # every participant is at its head
                        self._execute(ops)
                        for op in ops:
                            op.done = True
                        changed = True
                for it in heads.values():
                    if it.kind == "nccl" and all(op.done for op in it.ops):
                        it.done, changed = True, True

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
        for o in ops[1:]:
            if (o.args["fn"], o.args["dtype"], o.args["count"]) != (name, a["dtype"], count):
                self.violations.append(f"mismatched collective: {a} vs {o.args}")
                return
        n = len(ops)
        wire, isz = dt.name, dt.itemsize

        def read(ptr: int, k: int) -> np.ndarray:
            bits = np.frombuffer(ctypes.string_at(ptr, k * isz), dtype=dt.view).copy()
            return nm.from_bits(bits, wire)

        def write(ptr: int, arr: np.ndarray) -> None:
            b = nm.as_bits(np.asarray(arr), wire).tobytes()
            if b:
                ctypes.memmove(ptr, b, len(b))
        if name in ("AllReduce", "Reduce", "ReduceScatter"):
            total = count * n if name == "ReduceScatter" else count
            ins = [read(o.args["send"], total) for o in ops]
            op, sb = self._op(a["op"])
            res = R.reduce_arrays(ins, op, wire, n, scalar_bits=sb)
            for o in ops:
                if name == "AllReduce":
                    write(o.args["recv"], res)
                elif name == "Reduce" and o.rank == a["root"]:
                    write(o.args["recv"], res)
                elif name == "ReduceScatter":
                    write(o.args["recv"], res[o.rank * count:(o.rank + 1) * count])
        elif name == "Broadcast":
            data = read(ops[a["root"]].args["send"], count)
            for o in ops:
                write(o.args["recv"], data)
        elif name == "AllGather":
            data = np.concatenate([read(o.args["send"], count) for o in ops])
            for o in ops:
                write(o.args["recv"], data)
        elif name == "AlltoAll":
            ins = [read(o.args["send"], count * n) for o in ops]
            for o in ops:
                write(o.args["recv"], np.concatenate(
                    [ins[s][o.rank * count:(o.rank + 1) * count] for s in range(n)]))
        elif name == "Gather":
            data = np.concatenate([read(o.args["send"], count) for o in ops])
            write(ops[a["root"]].args["recv"], data)
        elif name == "Scatter":
            data = read(ops[a["root"]].args["send"], count * n)
            for o in ops:
                write(o.args["recv"], data[o.rank * count:(o.rank + 1) * count])
        else:  # pragma: no cover
            self.violations.append(f"stand-in has no {name}")

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


# -- the CUDA runtime ---------------------------------------------------------------------------
def _captured(deps: Any) -> bool:
    """An event's state says it was last recorded in a capture: ("captured", its capture)."""
    return type(deps) is tuple and len(deps) == 2 and deps[0] == "captured"


class StandInCuda:
    """``ncclpy._nccl.cuda``'s object, on host memory and queues (see the module docstring)."""

    name = "standin"

    def __init__(self, eng: StandIn) -> None:
        self.e = eng
        self.local_capture_threads: List[int] = []
        self.modes: Dict[int, int] = {}            # thread -> CUstreamCaptureMode (0 global)
        self.captures: Dict[Tuple[int, int], Dict[str, Any]] = {}   # stream key -> capture
        self.event_device: Dict[int, int] = {}     # event -> the device it was made on

    def device_count(self) -> int:
        return self.e.ndev

    def get_device(self) -> int:
        return self.e.tls().device

    def set_device(self, device: int) -> None:
        if not 0 <= device < self.e.ndev:
            raise StandInCudaError(f"invalid device {device}")
        self.e.tls().device = device

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        t = self.e.tls()
        prev, t.device = t.device, device
        try:
            yield
        finally:
            t.device = prev

    def use_device(self, device: int) -> None:
        self.set_device(device)

    def new_stream(self) -> int:
        return self.e.new_id()

    def current_stream(self, device: int) -> int:
        return self.e.tls().stream

    def stream_is_capturing(self, stream: int) -> bool:
        return self._capturing(stream)

    def _capturing(self, stream: int) -> bool:
        return self.e.skey(stream) in self.e.capturing

    def capture_status(self, stream: int) -> int:
        """cudaStreamIsCapturing's status (0 none, 1 active, 2 invalidated)."""
        if not self._capturing(stream):
            return 0
        info = self.captures.get(self.e.skey(stream))
        return 2 if info is not None and info["invalid"] else 1

    def begin_capture(self, stream: int, mode: int = 0) -> None:
        """cudaStreamBeginCapture in ``mode`` (0 global: torch.cuda.graph's default)."""
        key = self.e.skey(stream)
        self.e.capturing[key] = []
        self.captures[key] = {"thread": threading.get_ident(), "mode": mode, "invalid": ""}

    def end_capture(self, stream: int) -> Graph:
        key = self.e.skey(stream)
        info = self.captures.pop(key, None)
        makers = self.e.capturing.pop(key)
        if info is not None and info["invalid"]:
            raise StandInCudaError(f"cudaErrorStreamCaptureInvalidated: {info['invalid']}")
        return Graph(makers)

    # CUDA's stream-capture interaction modes (cudaThreadExchangeStreamCaptureMode): a thread
    # in the global mode is prohibited from potentially unsafe calls (cudaEventQuery among
    # them) while any thread captures in the global mode, or while it captures itself; the
    # thread-local mode only while it captures itself; the relaxed mode never.  A prohibited
    # call fails with cudaErrorStreamCaptureUnsupported and invalidates the capture.
    def exchange_capture_mode(self, mode: int) -> int:
        t = threading.get_ident()
        prev = self.modes.get(t, 0)
        self.modes[t] = int(mode)
        return prev

    def _prohibited(self, call: str) -> None:
        me = threading.get_ident()
        mode = self.modes.get(me, 0)
        if mode == 2:
            return
        hit = [info for info in self.captures.values() if info["mode"] != 2 and (
            info["thread"] == me or (mode == 0 and info["mode"] == 0))]
        for info in hit:
            info["invalid"] = info["invalid"] or f"{call} from a thread in the global mode"
        if hit:
            raise StandInCudaError(f"cudaErrorStreamCaptureUnsupported: {call} during a "
                                   f"stream capture")

    def launch(self, graph: Graph, stream: int) -> None:
        for make in graph.makers:
            self.e.enqueue(stream, make)

    def event_create(self) -> int:
        ev = self.e.new_id()
        self.e.events[ev] = ()
        self.event_device[ev] = self.e.tls().device   # the current device's context
        return ev

    def event_record(self, event: int, stream: int) -> None:
        e = self.e
        # cuEventRecord: "hEvent and hStream must be from the same context otherwise
        # CUDA_ERROR_INVALID_HANDLE is returned"; the legacy (0, 1) and per-thread (2) default
        # streams are the current device's
        if stream in (0, 1, 2) and self.event_device.get(event, e.tls().device) != \
                e.tls().device:
            raise StandInCudaError(f"cudaErrorInvalidResourceHandle: event {event} of device "
                                   f"{self.event_device[event]} on the default stream of "
                                   f"device {e.tls().device}", 400)
        with e.lock:
            key = e.skey(stream)
            if key in e.capturing:
                e.events[event] = ("captured", self.captures.get(key))
                return
            q = e.streams[e.skey(stream)]
            e.events[event] = tuple(it for it in q if not it.done)

    def event_query(self, event: int) -> bool:
        e = self.e
        self._prohibited("cudaEventQuery")
        with e.lock:
            deps = e.events.get(event)
            if deps is None:
                raise StandInCudaError(f"cudaErrorInvalidResourceHandle: event {event}")
            if _captured(deps):
                # last recorded in a capturing stream.  While that capture is under way: 907,
                # and the capture is invalidated, whatever the thread's mode (an H200, CUDA
                # 13.0: a watchdog's query in the thread-local mode broke torch.cuda.graph's
                # capture, docs/gpu-runs.md 2026-11-26); once it ended: cudaErrorInvalidValue
                info = deps[1]
                if info is not None and any(i is info for i in self.captures.values()):
                    info["invalid"] = info["invalid"] or "cudaEventQuery of an event " \
                        "recorded in this capture"
                    raise CapturedEventError("cudaErrorCapturedEvent: the event was last "
                                             "recorded in a capturing stream")
                raise CapturedEventError("cudaErrorInvalidValue: the event was last recorded "
                                         "in a stream capture that has ended", 1)
            e.progress()
            return all(it.done for it in deps)

    def event_destroy(self, event: int) -> None:
        self.e.events.pop(event, None)

    def stream_wait_event(self, stream: int, event: int) -> None:
        deps = self.e.events.get(event, ())
        if _captured(deps):
            deps = ()
        self.e.enqueue(stream, lambda: _Item("wait", ready=lambda: all(i.done for i in deps)))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.e.enqueue(stream, lambda: _Item("copy", run=lambda: ctypes.memmove(dst, src, nbytes)))

    def alloc(self, nbytes: int, stream: int, device: int) -> Any:
        return _Mem(nbytes)

    def malloc_async(self, nbytes: int, stream: int) -> int:
        m = _Mem(nbytes)
        self.e.async_allocs[m.ptr] = m
        return m.ptr

    def free_async(self, ptr: int, stream: int) -> None:
        self.e.enqueue(stream, lambda: _Item("free", run=lambda: self.e.async_allocs.pop(ptr,
                                                                                     None)))

    def zeros_float32(self, count: int, device: int) -> Any:
        return DevArray(np.zeros(count, np.float32), device)

    def thread_capture_mode_local(self) -> bool:
        self.local_capture_threads.append(threading.get_ident())
        self.exchange_capture_mode(1)
        return True

    def synchronize(self, stream: int, timeout: float = 10.0) -> None:
        """Test helper: wait until everything queued on ``stream`` ran."""
        deadline = time.monotonic() + timeout
        key = self.e.skey(stream)
        while True:
            with self.e.lock:
                self.e.progress()
                if not any(not it.done for it in self.e.streams[key]):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {stream} did not drain")
            time.sleep(0.001)


@contextlib.contextmanager
def standin(**kw: Any) -> Iterator[StandIn]:
    """The stand-in in place of libnccl and CUDA for the block (see the module docstring)."""
    eng = StandIn(**kw)
    from ncclpy.comm import work
    from ncclpy.comm.reaper import reaper
    pools = dict(work._pools)
    work._pools.clear()
    try:
        with _lib.use_lib(eng.nccl), _cuda.use(eng.cuda):
            yield eng
        eng.nccl.cdll.raise_pending()      # a stand-in function raised inside a C call
    finally:
        work._pools.clear()
        work._pools.update(pools)
        for q, pend in list(reaper().lanes):   # the block's Works: their events are gone
            q.clear()
            pend.clear()


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
              devices: Optional[List[int]] = None) -> List[Any]:
    """Run ``fn(rank, *args)`` on ``n`` threads (each on its own stand-in device unless
    ``devices`` says otherwise); their return values, re-raising the first exception."""
    eng_cuda = _cuda.cuda()
    out: List[Any] = [None] * n
    errs: List[Optional[BaseException]] = [None] * n

    def body(r: int) -> None:
        try:
            eng_cuda.set_device(devices[r] if devices else r)
            out[r] = fn(r, *args)
        except BaseException as e:  # noqa: B902 - re-raised in the caller
            errs[r] = e
    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank thread did not finish within {timeout} s")
    for e in errs:
        if e is not None:
            raise e
    return out
