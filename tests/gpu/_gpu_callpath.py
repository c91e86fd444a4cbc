"""GPU checks of issue 49 (the call path holds for every caller): what only CUDA, torch's
caching allocator and CuPy show, each modelled on the CPU stand-in by
tests/test_call_path_defects.py.

* a Work whose stream was destroyed once the call was issued (a stream made for one step and
  dropped) is waited on and queried without CUDA being asked about that stream;
* a Work recorded before a capture of its stream is waited on during the capture (the query
  is made in the relaxed capture mode), and the capture stays valid;
* a prepared call keeps the stream object it was given: dropped by the caller, it is not
  destroyed under the prepared call;
* an eager call on a side stream records the tensor with torch's caching allocator: a
  storage freed in place while the call is in flight (``untyped_storage().resize_(0)``,
  FSDP's idiom) is not handed out again before the call is done; a tensor re-pointed with
  ``set_()`` keeps its old memory for the call.
"""
from __future__ import annotations

import gc
import time

from _gpu_common import Session
from _gpu_lifecycle import _torch   # torch, or Skip with the reason


def chk_destroyed_stream(s: Session) -> None:
    import cupy
    x = cupy.full(1024, s.rank + 1, dtype=cupy.float32)

    def step():
        st = cupy.cuda.Stream(non_blocking=True)     # destroyed when dropped
        return s.comm.all_reduce(x, stream=st)
    for _ in range(3):
        w = step()
        gc.collect()
        w.is_completed()
        w.wait()
        assert w.is_completed()
    assert float(x[0]) == float(s.n * (s.n + 1) / 2 * s.n ** 2), float(x[0])


def chk_wait_during_capture(s: Session) -> None:
    import cupy
    st = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(256, dtype=cupy.float32)
    y = cupy.zeros(256, dtype=cupy.float32)
    w = s.comm.all_reduce(x, stream=st)              # recorded outside the capture
    with st:                                         # global mode (torch.cuda.graph's):
        st.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)   # the strictest
        y += 1                                       # something captured
        w.wait()                                     # relaxed mode: allowed, no invalidation
        graph = st.end_capture()                     # raises if it was invalidated
    graph.launch(st)
    st.synchronize()
    assert float(x[0]) == float(s.n) and float(y[0]) == 1.0


def chk_prepared_keeps_its_stream(s: Session) -> None:
    import cupy
    import weakref
    x = cupy.full(64, s.rank + 1, dtype=cupy.float32)
    st = cupy.cuda.Stream(non_blocking=True)
    ref = weakref.ref(st)
    p = s.comm.prepare("all_reduce", x, stream=st)
    del st
    gc.collect()
    assert ref() is not None, "the prepared call's stream was destroyed"
    for _ in range(3):
        p().wait()
    assert float(x[0]) == float(s.n * (s.n + 1) / 2 * s.n ** 2), float(x[0])


def chk_storage_freed_in_flight(s: Session) -> None:
    """For each way a call can run on a stream other than the tensor's allocation stream:
    a torch side stream passed, a torch side stream made current, a CuPy stream."""
    torch = _torch(s)
    import cupy
    dev = torch.device("cuda", s.dev)
    n = 1 << 20
    for how in ("torch stream=", "torch current", "cupy stream="):
        side = torch.cuda.Stream(device=dev)
        cs = cupy.cuda.Stream(non_blocking=True)
        t = torch.full((n,), float(s.rank + 1), device=dev)   # made on the default stream
        torch.cuda.current_stream(dev).synchronize()

        def call():
            if how == "torch stream=":
                return s.comm.all_reduce(t, stream=side)
            if how == "cupy stream=":
                return s.comm.all_reduce(t, stream=cs)
            with torch.cuda.stream(side):
                return s.comm.all_reduce(t)
        if s.rank == 1:
            time.sleep(1.0)                          # rank 0's call waits inside NCCL
            call().wait()
            continue
        old = t.data_ptr()
        w = call()                                   # on another stream, the peer late
        t.untyped_storage().resize_(0)               # freed in place while in flight
        u = torch.empty((n,), device=dev)            # the same size, the default stream
        assert u.data_ptr() != old, f"{how}: the allocator handed out memory NCCL still uses"
        w.wait()
        del u


def chk_set_in_flight(s: Session) -> None:
    torch = _torch(s)
    dev = torch.device("cuda", s.dev)
    t = torch.full((1024,), float(s.rank + 1), device=dev)
    if s.rank == 1:
        time.sleep(0.5)
        s.comm.all_reduce(t).wait()
        return
    old = t.untyped_storage()
    w = s.comm.all_reduce(t)
    t.set_(torch.zeros(1024, device=dev))            # re-pointed: the call keeps the old
    assert any(k is not None and getattr(k, "data_ptr", None) and
               k.data_ptr() == old.data_ptr() for k in w._keep), w._keep
    w.wait()
    view = torch.empty(0, dtype=torch.float32, device=dev).set_(old, 0, (1024,))
    assert float(view[0]) == float(s.n * (s.n + 1) / 2), float(view[0])   # the call's result


def callpath_worker(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "callpath")
    for name, fn in (("destroyed_stream", chk_destroyed_stream),
                     ("wait_during_capture", chk_wait_during_capture),
                     ("prepared_keeps_its_stream", chk_prepared_keeps_its_stream),
                     ("storage_freed_in_flight", chk_storage_freed_in_flight),
                     ("set_in_flight", chk_set_in_flight)):
        s.check(name, fn)
    s.finish()
