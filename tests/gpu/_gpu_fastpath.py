"""GPU checks of issue 37 (the thin call): what the fast path assumes of CUDA, torch and CuPy,
which the CPU stand-in can only model.

* a torch tensor re-pointed in place (``set_``: the same Python object, new memory) is a miss:
  the call reduces the new memory and leaves the old alone;
* a call captured on a CuPy stream: a host wait during the capture is refused without
  invalidating it (the call marked its Work captured: no tracker queries its event), the graph
  replays correctly, and the Work is counted as captured;
* a steady loop with ncclpy's defaults creates no event once the pool holds what is in
  flight, and its Works' buffers are released by the tracker within ticks, not by later calls;
* a record on the legacy default stream with another device current is made again with the
  communicator's device (needs two GPUs in the process: skipped with one).
"""
from __future__ import annotations

import time
from typing import Any

from _gpu_common import Session, Skip
from _gpu_lifecycle import _torch   # torch, or Skip with the reason


def chk_repointed_tensor(s: Session) -> None:
    """The fast path finds the entry by the tensor's identity and reads its data_ptr again."""
    torch = _torch(s)
    dev = torch.device("cuda", s.dev)
    t = torch.full((64,), float(s.rank + 1), device=dev)
    for _ in range(3):                           # the second and third calls are hits
        s.comm.all_reduce(t).wait()
    want = float(sum(range(1, s.n + 1)) * s.n * s.n)
    assert bool((t == want).all()), t[0].item()
    old = t.clone()
    fresh = torch.full((64,), float(s.rank + 1), device=dev)
    storage_before = t.data_ptr()
    t.set_(fresh.untyped_storage(), 0, (64,))   # the same object, another memory
    assert t.data_ptr() != storage_before
    s.comm.all_reduce(t).wait()
    assert bool((fresh == float(sum(range(1, s.n + 1)))).all()), fresh[0].item()
    assert bool((old == want).all())


def _refused_as_captured(s: Session, call: Any, what: str) -> None:
    """``call()`` raises NcclpyError saying its Work was captured into a CUDA graph."""
    try:
        call()
    except s.ncclpy.NcclpyError as e:
        assert "captured into a CUDA graph" in str(e), e
    else:
        raise AssertionError(f"{what} was not refused")


def chk_captured_learned(s: Session) -> None:
    """The call asks whether its stream captures: the Work is marked captured at once, and a
    host wait or query is refused (during the capture and after it) without touching the
    event, so the capture stays valid; the graph replays correctly."""
    import cupy
    st = cupy.cuda.Stream(non_blocking=True)
    x = cupy.full(256, s.rank + 1, dtype=cupy.float32)
    s.comm.all_reduce(x, stream=st).wait()       # connected, eager, not captured
    before = s.comm._captured_calls
    with st:
        st.begin_capture()
        w = s.comm.all_reduce(x, stream=st)
        _refused_as_captured(s, w.wait, "a host wait during the capture")
        graph = st.end_capture()                 # raises if the capture was invalidated
    _refused_as_captured(s, w.is_completed, "is_completed() of a captured call")
    assert s.comm._captured_calls == before + 1 and w._owned
    for k in (1, 2):
        x.fill(k * (s.rank + 1))
        graph.launch(st)
        st.synchronize()
        want = k * s.n * (s.n + 1) / 2
        assert float(x[0]) == want, (k, float(x[0]), want)
    del graph


def chk_pool_holds_what_is_in_flight(s: Session) -> None:
    """With the defaults (watchdog on), a steady loop creates no event, and a dropped Work's
    buffer is released by the watchdog's thread, not by a later call."""
    import cupy
    import weakref
    from ncclpy.comm.work import event_pool
    x = cupy.ones(2, dtype=cupy.float32)
    st = cupy.cuda.Stream(non_blocking=True)
    for _ in range(300):
        s.comm.all_reduce(x, stream=st)
    st.synchronize()
    time.sleep(0.5)                              # the watchdog releases what completed
    pool = event_pool(s.dev)
    made = pool.created
    for _ in range(200):
        s.comm.all_reduce(x, stream=st)
    st.synchronize()
    assert pool.created == made, f"{pool.created - made} events created in a steady loop"
    y = cupy.ones(1 << 16, dtype=cupy.float32)
    alive = weakref.ref(y)
    s.comm.all_reduce(y, stream=st)              # dropped at once
    del y
    st.synchronize()
    deadline = time.monotonic() + 3.0
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.05)                         # no further call: the tracker releases it
    assert alive() is None, "the dropped Work's buffer was not released by its tracker"


def chk_legacy_stream_other_device(s: Session) -> None:
    """The record on stream 0 while another device is current is refused by CUDA and made
    again with the communicator's device current."""
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        raise Skip("one GPU visible: another device cannot be current")
    other = (s.dev + 1) % cupy.cuda.runtime.getDeviceCount()
    x = cupy.full(8, s.rank + 1, dtype=cupy.float32)
    for _ in range(2):
        cupy.cuda.runtime.setDevice(other)
        w = s.comm.all_reduce(x, stream=0)
        assert cupy.cuda.runtime.getDevice() == other
        cupy.cuda.runtime.setDevice(s.dev)
        w.wait()
    want = s.n * (s.n + 1) / 2
    assert float(x[0]) == want * s.n, float(x[0])


def fastpath_worker(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "fast")
    for name, fn in (("repointed_tensor", chk_repointed_tensor),
                     ("captured_learned", chk_captured_learned),
                     ("pool_holds_what_is_in_flight", chk_pool_holds_what_is_in_flight),
                     ("legacy_stream_other_device", chk_legacy_stream_other_device)):
        s.check(name, fn)
    s.finish()
