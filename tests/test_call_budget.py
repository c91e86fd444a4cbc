"""The boundary budget of a steady-state eager call (issue 37), through the STAND-IN for
libnccl and CUDA (tests/nccl_standin.py, entered through ncclpy's own ctypes declarations):
with ncclpy's defaults (``ncclpy.init``: watchdog and flight recorder on), a repeated call
makes, on the caller's thread, exactly one NCCL call and two CUDA runtime calls -- the event
record and the capture query (``cudaStreamIsCapturing``: a captured call's event must never be
queried during its capture, which a tracker could otherwise do; ncclpy/comm/work.py
``captures``; on the legacy default stream, which cannot be captured, the record only) -- and
nothing else: no ``cudaGetDevice``, no event creation once the pool holds
what is in flight, no event query (the trackers' threads make those).  Checked for
an explicit stream handle, a stream object, ``stream=None`` (CuPy's current stream, or the
stream a ``__cuda_array_interface__`` export names), each collective kind with one NCCL call,
send/recv, CuPy arrays and prepared calls.

CuPy's current-stream lookup (``current_stream``) is CuPy's thread-local state, not a CUDA
runtime call; it is counted apart.  What the budget costs in semantics is tested in
tests/test_fast_path.py.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

import ncclpy
from ncclpy.debug.reaper import reaper
from ncclpy.rendezvous import free_port

from nccl_standin import DevArray, run_ranks, standin
from wait_util import HANG

#: the stand-in CUDA object's methods that are CUDA runtime (or driver) calls
CUDA_CALLS = ("get_device", "set_device", "stream_is_capturing", "capture_status",
              "event_create", "event_record", "event_query", "event_destroy", "stream_wait_event",
              "memcpy_async", "malloc_async", "free_async", "exchange_capture_mode",
              "thread_capture_mode_local")
WARM, CALLS = 60, 50     # steady: the warm-up had more calls in flight than are measured


def _count_cuda(cu: Any) -> Dict[int, collections.Counter]:
    """Wrap the stand-in CUDA object's calls: thread ident -> Counter of call names."""
    by: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    for name in CUDA_CALLS + ("current_stream",):
        f = getattr(cu, name)

        def counted(*a: Any, _f: Callable = f, _n: str = name, **k: Any) -> Any:
            with lock:
                by[threading.get_ident()][_n] += 1
            return _f(*a, **k)
        setattr(cu, name, counted)
    return by


def _nccl_calls(eng: Any, me: int, since: int) -> List[str]:
    return [name for name, _h, t in eng.calls[since:] if t == me]


def _settle(comm: Any) -> None:
    """Let the tracker release what completed (the pool then holds what was in flight)."""
    wd = comm._watchdog
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:
        if wd is not None:
            if not wd.queue and not wd.pending:
                return
        elif reaper().tick() == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the tracker did not release the warm-up calls")


def _fill_pool(device: int, eng: Any, n: int) -> None:
    """Make the device's event pool hold ``n`` free events, the most the measured calls can
    have in flight: the warm-up's own peak depends on how soon the tracker releases its calls
    (with a fast tracker it stayed below the measured calls', and events were created inside
    the measurement: 2 of 3 runs at 6ad557c)."""
    from ncclpy.comm.work import event_pool
    pool = event_pool(device)
    while len(pool) < n:
        pool.give(pool.new(eng.cuda))


def _budget(r: int, port: int, eng: Any, counts: Dict[int, collections.Counter],
            call: Callable[[Any, int], Any], want_nccl: List[str]) -> Dict[str, Any]:
    """On rank r: warm up, settle, then CALLS calls; the caller thread's per-call counts."""
    comm = ncclpy.init(f"budget{port}", rank=r, world_size=2, master_addr="127.0.0.1",
                       master_port=port, device=r, timeout=30.0)
    try:
        assert comm._watchdog is not None and comm._recorder is not None   # the defaults
        for _ in range(WARM):
            call(comm, r)
        comm.barrier()
        _settle(comm)
        _fill_pool(r, eng, 5 * CALLS)
        me = threading.get_ident()
        before = collections.Counter(counts[me])
        since = len(eng.calls)
        works = [call(comm, r) for _ in range(CALLS)]
        after = collections.Counter(counts[me])
        nccl = _nccl_calls(eng, me, since)
        works[-1].wait()
        return {"cuda": after - before, "nccl": nccl, "want": want_nccl * CALLS}
    finally:
        comm.close()


def _run(call: Callable[[Any, int], Any], want_nccl: List[str], legacy: bool = False) -> None:
    """``legacy``: the calls run on the legacy default stream (0), which cannot be captured:
    no capture query."""
    port = free_port()
    with standin() as eng:
        counts = _count_cuda(eng.cuda)
        outs = run_ranks(2, lambda r: _budget(r, port, eng, counts, call, want_nccl),
                         timeout=120)
    assert eng.violations == []
    for o in outs:
        assert o["nccl"] == o["want"], o["nccl"][:6]
        cuda = dict(o["cuda"])
        cuda.pop("current_stream", None)          # CuPy's thread-local, not a CUDA call
        want = {"event_record": CALLS} if legacy else \
            {"event_record": CALLS, "capture_status": CALLS}
        assert cuda == want, cuda


def _dev(r: int, n: int = 4) -> DevArray:
    return DevArray(np.arange(n, dtype=np.float32) + r, device=r)


_X: Dict[Any, Any] = {}


def _buf(r: int, key: str, n: int = 4) -> DevArray:
    """One buffer per rank and key, reused by every call (the steady state)."""
    k = (r, key)
    if k not in _X:
        _X[k] = _dev(r, n)
    return _X[k]


@pytest.mark.parametrize("form", ["int", "object", "none"])
def test_a_steady_all_reduce_makes_one_nccl_call_and_two_cuda_calls(form):
    _X.clear()

    class S:                                      # a stream object (the CUDA stream protocol)
        def __init__(self, h):
            self.h = h

        def __cuda_stream__(self):
            return (0, self.h)
    streams = {0: 1000, 1: 1001}                  # a stream of each rank's own

    def call(comm, r):
        x = _buf(r, "x")
        if form == "int":
            return comm.all_reduce(x, stream=streams[r])
        if form == "object":
            return comm.all_reduce(x, stream=S(streams[r]))
        return comm.all_reduce(x)                 # (the stand-in's current stream: 0)
    _run(call, ["ncclAllReduce"], legacy=form == "none")


def test_every_one_call_collective_and_send_recv_keep_the_budget():
    _X.clear()

    def call(comm, r):
        x, y = _buf(r, "x", 4), _buf(r, "y", 8)
        w = comm.reduce(x, _buf(r, "xr", 4), root=1, op="max")
        w = comm.broadcast(x, root=0)
        w = comm.all_gather(x, y)
        w = comm.reduce_scatter(y, x, op="sum")
        w = comm.send(x, 1 - r) if r == 0 else comm.recv(x, 1 - r)
        return w
    want = ["ncclReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter"]
    port = free_port()
    with standin() as eng:
        counts = _count_cuda(eng.cuda)
        outs = run_ranks(2, lambda r: _budget(r, port, eng, counts, call, []), timeout=120)
    assert eng.violations == []
    for r, o in enumerate(outs):
        p2p = "ncclSend" if r == 0 else "ncclRecv"
        assert o["nccl"] == (want + [p2p]) * CALLS, o["nccl"][:6]
        cuda = dict(o["cuda"])
        cuda.pop("current_stream", None)
        assert cuda == {"event_record": 5 * CALLS}, cuda      # the legacy stream: no query


def test_cupy_arrays_on_cupys_current_stream_keep_the_budget():
    cupy = pytest.importorskip("cupy")
    hosts = {r: np.arange(4, dtype=np.float32) for r in range(2)}

    def arr(r):
        h = hosts[r]
        mem = cupy.cuda.UnownedMemory(h.ctypes.data, h.nbytes, h, r)
        return cupy.ndarray((4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    xs: Dict[int, Any] = {}

    def call(comm, r):
        if r not in xs:
            xs[r] = arr(r)
        return comm.all_reduce(xs[r])             # stream=None: CuPy's current stream
    _run(call, ["ncclAllReduce"], legacy=True)    # (CuPy's null stream: the legacy one)


def test_a_prepared_call_keeps_the_budget():
    _X.clear()
    prepared: Dict[int, Any] = {}

    def call(comm, r):
        if r not in prepared:
            prepared[r] = comm.prepare("all_reduce", _buf(r, "p"), stream=2000 + r)
        return prepared[r]()
    _run(call, ["ncclAllReduce"])
