"""GPU checks of issue 21 (abort- and capture-safety): a torch.cuda.graph capture (CUDA's
default global mode) right after ~200 eager calls with the watchdog on, for an in-place
all_reduce and a list-form all_gather; the buffers of a dropped Work stay untouched by the
allocator until NCCL is done (watchdog off); close() with a live CUDA graph returns with a
CommAbortedError that says why, instead of hanging in ncclCommFinalize."""
from __future__ import annotations

import time
from typing import Any

from _gpu_common import WAIT_S, Session, Skip, done


def _torch(s: Session) -> Any:
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed") from None
    if not torch.cuda.is_available():
        raise Skip("this torch build has no CUDA")
    return torch


def chk_torch_graph_after_eager(s: Session) -> None:
    """Defect 3: the watchdog (on) queries events of the eager Works while torch captures in
    global mode; its thread is ThreadLocal, and the list form's scratch is stream-ordered."""
    torch = _torch(s)
    dev = torch.device("cuda", s.dev)
    x = torch.ones(4096, device=dev)
    for _ in range(200):                       # Works dropped: the watchdog follows them
        s.comm.all_reduce(x, op="max")
    y = torch.zeros(1024, device=dev)
    src = torch.zeros(16, device=dev)
    parts = [torch.zeros(16, device=dev) for _ in range(s.n)]
    side = torch.cuda.Stream(dev)              # torch's warm-up pattern, on a side stream
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        s.comm.all_reduce(y)
        s.comm.all_gather(src, parts)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):                  # capture_error_mode="global", the default
        s.comm.all_reduce(y)
        s.comm.all_gather(src, parts)
    for k in (1, 2, 3):
        y.fill_(float(k * (s.rank + 1)))
        src.fill_(float(10 * k + s.rank))
        g.replay()
        torch.cuda.synchronize(dev)
        want = k * s.n * (s.n + 1) / 2
        assert bool((y == want).all()), f"replay {k}: y[0]={y[0].item()} != {want}"
        for r, p in enumerate(parts):
            assert bool((p == 10 * k + r).all()), f"replay {k}: part {r} = {p[0].item()}"
    del g
    torch.cuda.synchronize(dev)


def chk_dropped_work_keeps_buffers(s: Session) -> None:
    """A Work dropped before completion, with its tensor, on a stream other than the tensor's:
    the memory is not handed out again while NCCL still writes it (watchdog off)."""
    torch = _torch(s)
    dev = torch.device("cuda", s.dev)
    comm = s.ncclpy.init(name=f"lifetime{s.gen}", watchdog=False, timeout=WAIT_S)
    try:
        n = 1 << 20
        side = torch.cuda.Stream(dev)
        done(comm.all_reduce(torch.ones(n, device=dev), stream=side))   # connect first
        for trial in range(3):
            t = torch.full((n,), float(s.rank + 1), device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            if s.rank == 1:
                time.sleep(0.5)                # rank 0's call is in flight meanwhile
            comm.all_reduce(t, stream=side)    # the Work is dropped at once
            del t
            u = torch.empty((n,), device=dev)  # the size t had: the allocator's first choice
            u.fill_(-7.0)
            torch.cuda.synchronize(dev)
            assert bool((u == -7.0).all()), f"trial {trial}: NCCL wrote into reused memory"
    finally:
        comm.close()


def chk_close_with_live_graph(s: Session) -> None:
    """Defect 4: ncclCommFinalize waits for every graph that captured the communicator's
    calls (NCCL >= 2.26); close() must return within its timeout and say which."""
    import cupy
    from ncclpy.comm import lifecycle
    t = 8.0
    comm = s.ncclpy.init(name=f"graphclose{s.gen}", watchdog=False, timeout=t)
    st = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(1024, dtype=cupy.float32)
    done(comm.all_reduce(x))
    with st:
        st.begin_capture()
        comm.all_reduce(x)
        graph = st.end_capture()
    graph.launch(st)
    st.synchronize()
    t0 = time.monotonic()
    try:
        comm.close()
    except s.ncclpy.CommAbortedError as e:
        msg = str(e)
    else:
        raise AssertionError("close() returned normally while a CUDA graph held the "
                             "communicator (NCCL's finalize did not wait for it)")
    took = time.monotonic() - t0
    assert took < t + 1.0 + lifecycle.ABORT_GRACE + lifecycle.ABORT_JOIN + 2.0, took
    assert "captured into CUDA graphs" in msg and "destroy the graphs" in msg, msg
    assert comm.state in ("aborting", "aborted")
    del graph


def lifecycle_worker(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "life")
    for name, fn in (("torch_graph_after_eager", chk_torch_graph_after_eager),
                     ("dropped_work_keeps_buffers", chk_dropped_work_keeps_buffers),
                     ("close_with_live_graph", chk_close_with_live_graph)):
        s.check(name, fn)
    s.finish()
