"""Work and streams, raw pointers, bf16 premul_sum, 256 MiB, CUDA graphs, registration and
ncclMemAlloc, ctypes and nonblocking communicators, lifecycle, split, torch tensors."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from _gpu_common import B, C, DT, WAIT_S, Session, dev_buf, done, host


def chk_work_side_stream(s: Session) -> None:
    import cupy
    n = 8 << 20
    side = cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.Stream(non_blocking=True)
    x = cupy.full(n, float(s.rank + 1), dtype=cupy.float32)
    # NCCL's first call of a kind on a communicator connects its peers, and host-waits for the
    # stream while doing so (2.28.9, seen 2026-11-25); a warm-up call keeps that out of the test
    warm = cupy.zeros(n, dtype=cupy.float32)
    done(s.comm.all_reduce(warm, stream=side))
    cupy.cuda.Device(s.dev).synchronize()
    gate = threading.Event()
    side.launch_host_func(lambda _: gate.wait(WAIT_S), None)   # hold the side stream
    t0 = time.monotonic()
    w = s.comm.all_reduce(x, stream=side)
    took = time.monotonic() - t0
    assert took < 5.0, f"all_reduce host-waited {took:.1f} s for its held stream"
    assert w.stream == side.ptr
    time.sleep(0.2)
    assert not w.is_completed(), "completed while its stream was held"
    w.wait(main)                           # main waits on the event, no host block
    with main:
        y = x * 2
    gate.set()
    main.synchronize()
    total = s.n * (s.n + 1) / 2
    assert bool(cupy.all(y == 2 * total)), "main stream ran before the all_reduce finished"
    w.wait()
    assert w.is_completed()


def chk_stream_kinds(s: Session) -> None:
    import cupy

    class Proto:
        def __init__(self, st):
            self.st = st

        def __cuda_stream__(self):
            return (0, self.st.ptr)

    st = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(C, dtype=cupy.float32)           # filled on the current (legacy) stream
    st.wait_event(cupy.cuda.get_current_stream().record())   # ... which st does not wait for
    for arg in (st, st.ptr, Proto(st)):
        w = s.comm.all_reduce(x, stream=arg)
        assert w.stream == st.ptr, (arg, w.stream, st.ptr)
        done(w)
    with st:                               # default: CuPy's current stream
        w = s.comm.all_reduce(x)
    assert w.stream == st.ptr
    done(w)
    assert bool(cupy.all(x == s.n ** 4)), x


def chk_raw_pointers(s: Session) -> None:
    import cupy
    a = cupy.full(C, float(s.rank + 1), dtype=cupy.float64)
    b = cupy.zeros(s.n * C, dtype=cupy.float64)
    buf = s.ncclpy.Buffer(int(a.data.ptr), C, "float64", s.dev)
    out = s.ncclpy.Buffer(int(b.data.ptr), s.n * C, "float64", s.dev)
    done(s.comm.all_gather(buf, out))
    want = np.repeat(np.arange(1, s.n + 1, dtype=np.float64), C)
    assert np.array_equal(cupy.asnumpy(b), want)
    done(s.comm.all_reduce(buf, op="max"))
    assert bool(cupy.all(a == s.n))


def chk_premul_bf16_raw(s: Session) -> None:
    dt = DT("bfloat16")
    a, buf = dev_buf(s, dt, np.full(C, 2.0))
    done(s.comm.all_reduce(buf, op=s.ncclpy.premul_sum(0.5)))
    got = host(dt, a)
    assert np.array_equal(got, np.full(C, float(s.n))), got   # sum of 0.5*2 = n, not 0


#: chk_large's values: (i + LARGE_SHIFT * rank) % LARGE_PERIOD, a prime below 2**21, so a sum
#: over up to 8 ranks stays below 2**24 (exact in float32) and every element within a window of
#: 2 Mi differs from every other: a chunk delivered to the wrong offset (chunk offsets are sums
#: of powers of two, never a multiple of this prime) or from the wrong rank shows
LARGE_PERIOD = 2097143
LARGE_SHIFT = 7919


def chk_large(s: Session) -> None:
    import cupy
    n = 64 << 20                                # 64 Mi float32 = 256 MiB per buffer
    i = cupy.arange(n, dtype=cupy.int64)
    x = ((i + LARGE_SHIFT * s.rank) % LARGE_PERIOD).astype(cupy.float32)
    y = cupy.full(n, -1.0, dtype=cupy.float32)
    done(s.comm.all_reduce(x, y))
    want = sum((i + LARGE_SHIFT * r) % LARGE_PERIOD for r in range(s.n)).astype(cupy.float32)
    bad = cupy.flatnonzero(y != want)
    if bad.size:
        k = int(bad[0])
        raise AssertionError(f"256 MiB all_reduce wrong at {int(bad.size)} of {n} elements; "
                             f"first at {k}: {float(y[k])}, expected {float(want[k])}")
    del i, x, y, want, bad
    cupy.get_default_memory_pool().free_all_blocks()


def chk_graph(s: Session) -> None:
    import cupy
    st = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(1 << 16, dtype=cupy.float32)
    cupy.cuda.Device(s.dev).synchronize()
    with st:
        st.begin_capture()
        s.comm.all_reduce(x)
        graph = st.end_capture()
    for k in (1, 2, 3):
        with st:
            x.fill(float(k * (s.rank + 1)))
        graph.launch(st)
        st.synchronize()
        want = k * s.n * (s.n + 1) / 2
        assert bool(cupy.all(x == want)), f"replay {k}: {float(x[0])} != {want}"


def chk_register_mem_alloc(s: Session) -> None:
    import cupy
    buf = s.comm.mem_alloc(1024, "float32")
    assert buf.count == 1024 and buf.device == s.dev
    mem = cupy.cuda.UnownedMemory(buf.ptr, 4096, None, s.dev)
    arr = cupy.ndarray((1024,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    arr.fill(float(s.rank + 1))
    reg = s.comm.register(buf)
    done(s.comm.all_reduce(buf))
    assert bool(cupy.all(arr == s.n * (s.n + 1) / 2))
    s.comm.deregister(reg)
    s.comm.mem_free(buf)
    other = s.comm.mem_alloc(16, "int32")       # left for close() to free
    assert other.ptr


class _DeregisterSpy:
    """Counts the ncclCommDeregister calls (by handle) made while it is installed; each call
    still reaches NCCL.  Installed on the process's NcclLib, both where ``lib.fn`` caches the
    binding and as the attribute, so either way of calling it is seen."""

    NAME = "ncclCommDeregister"

    def __init__(self) -> None:
        from ncclpy._nccl.lib import get_lib
        self.lib = get_lib()
        self.real = self.lib.fn(self.NAME)
        self.handles: list = []

    def __call__(self, comm: Any, handle: Any) -> int:
        self.handles.append(int(getattr(handle, "value", handle) or 0))
        return self.real(comm, handle)

    def __enter__(self) -> "_DeregisterSpy":
        self.lib._fns[self.NAME] = self
        setattr(self.lib, self.NAME, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lib._fns[self.NAME] = self.real
        try:
            delattr(self.lib, self.NAME)
        except AttributeError:
            pass


def chk_register_twice(s: Session) -> None:
    import collections
    import logging

    import cupy
    x = cupy.full(1 << 18, float(s.rank + 1), dtype=cupy.float32)     # 1 MiB
    r1 = s.comm.register(x)
    r2 = s.comm.register(x)
    assert r1 is not r2 and r1 != r2, f"one buffer registered twice gave equal registrations " \
                                      f"{r1!r} and {r2!r}"
    done(s.comm.all_reduce(x))
    assert bool(cupy.all(x == s.n * (s.n + 1) / 2))
    s.comm.deregister(r1)
    s.comm.deregister(r2)                  # the second one is still known
    try:
        s.comm.deregister(r1)
    except s.ncclpy.ArgumentError:
        pass
    else:
        raise AssertionError("a third deregister of the same registration was accepted")
    # close() with registrations held: every one is deregistered, none fails
    comm = s.ncclpy.init(name="register-twice-close")
    y = cupy.zeros(1 << 16, dtype=cupy.float32)
    z = cupy.zeros(1 << 16, dtype=cupy.float32)
    regs = [comm.register(y), comm.register(y), comm.register(z)]
    done(comm.all_reduce(y))
    warned: list = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    catch = _Catch(logging.WARNING)
    logging.getLogger("ncclpy").addHandler(catch)
    try:
        with _DeregisterSpy() as spy:
            comm.close()
    finally:
        logging.getLogger("ncclpy").removeHandler(catch)
    assert not warned, f"close() warned: {warned}"
    held = collections.Counter(getattr(r, "handle", 0) for r in regs if getattr(r, "handle", 0))
    seen = collections.Counter(h for h in spy.handles if h in held)
    assert seen == held, f"close() deregistered {dict(seen)}; registrations held: {dict(held)}"


def _mini(s: Session, comm: Any) -> None:
    """A few collectives on ``comm`` (a communicator not made by CuPy)."""
    import cupy
    n, r = comm.world_size, comm.rank
    total = n * (n + 1) / 2
    x = cupy.full(C, float(r + 1), dtype=cupy.float32)
    done(comm.all_reduce(x))
    assert bool(cupy.all(x == total)), "all_reduce"
    y = cupy.full(C, float(r + 1), dtype=cupy.float32)
    done(comm.all_reduce(y, op=s.ncclpy.premul_sum(2.0)))
    assert bool(cupy.all(y == 2 * total)), "premul_sum"
    z = cupy.full(B, float(r), dtype=cupy.float32)
    g = cupy.zeros(n * B, dtype=cupy.float32)
    done(comm.all_gather(z, g))
    assert np.array_equal(cupy.asnumpy(g), np.repeat(np.arange(n, dtype=np.float32), B))
    a = cupy.asarray(np.repeat(np.arange(n, dtype=np.float32) + 10 * r, B))
    o = cupy.zeros(n * B, dtype=cupy.float32)
    done(comm.all_to_all(a, o))
    assert np.array_equal(cupy.asnumpy(o), np.repeat(10 * np.arange(n, dtype=np.float32) + r, B))
    rs = cupy.zeros(B, dtype=cupy.float32)
    done(comm.reduce_scatter(cupy.ones(n * B, dtype=cupy.float32), rs))
    assert bool(cupy.all(rs == n))
    bc = cupy.full(B, float(r), dtype=cupy.float32)
    done(comm.broadcast(bc, root=n - 1))
    assert bool(cupy.all(bc == n - 1))
    if n > 1:
        rb = cupy.zeros(B, dtype=cupy.float32)
        done(comm.send_recv(cupy.full(B, float(r), dtype=cupy.float32), rb, (r + 1) % n,
                            (r - 1) % n))
        assert bool(cupy.all(rb == (r - 1) % n))
    comm.barrier()


def chk_ctypes_comm(s: Session) -> None:
    comm = s.ncclpy.init(name="ctypes-blocking", config=s.ncclpy.Config())
    try:
        assert comm.nccl_comm is None and not comm.nonblocking
        assert (comm.rank, comm.world_size) == (s.rank, s.n)
        _mini(s, comm)
        half = comm.split(s.rank % 2, s.rank)
        assert half is not None and half.world_size == (s.n + 1 - s.rank % 2) // 2
        _mini(s, half)
        half.close()
    finally:
        comm.close()


def chk_nonblocking_comm(s: Session) -> None:
    cfg = s.ncclpy.Config(blocking=False, comm_name="ncclpy-nonblocking", max_ctas=8,
                          min_ctas=1)
    comm = s.ncclpy.init(name="nonblocking", config=cfg)
    try:
        assert comm.nonblocking and comm.config is cfg
        _mini(s, comm)
        import cupy
        # two buffers: NCCL may run the calls of one group concurrently (one launch), so two
        # in-place calls on one buffer race (seen on an H200, docs/gpu-runs.md)
        x = cupy.ones(C, dtype=cupy.float32)
        y = cupy.full(C, float(s.rank), dtype=cupy.float32)
        with comm.group():
            comm.all_reduce(x)
            w = comm.all_reduce(y, op="max")
        done(w)
        assert bool(cupy.all(x == s.n)) and bool(cupy.all(y == s.n - 1))
        comm.finalize()
    finally:
        comm.close()
    comm.close()      # idempotent


def chk_lifecycle(s: Session) -> None:
    import cupy
    x = cupy.ones(4, dtype=cupy.float32)
    with s.ncclpy.init(name="ctx") as comm:
        done(comm.all_reduce(x))
    assert comm.closed and bool(cupy.all(x == s.n))
    comm.close()
    try:
        comm.all_reduce(x)
        raise AssertionError("a closed communicator accepted a call")
    except s.ncclpy.NcclpyError as e:
        assert "closed" in str(e)
    doomed = s.ncclpy.init(name="abort")
    done(doomed.all_reduce(x))
    doomed.abort()
    doomed.abort()
    doomed.close()


def misc(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "misc")
    for name, fn in (("work_side_stream", chk_work_side_stream),
                     ("stream_kinds", chk_stream_kinds), ("raw_pointers", chk_raw_pointers),
                     ("premul_bf16_raw", chk_premul_bf16_raw), ("large_256MiB", chk_large),
                     ("cuda_graph", chk_graph), ("register_mem_alloc", chk_register_mem_alloc),
                     ("register_twice", chk_register_twice),
                     ("ctypes_comm", chk_ctypes_comm), ("nonblocking_comm", chk_nonblocking_comm),
                     ("lifecycle", chk_lifecycle)):
        s.check(name, fn)
    s.finish()


def chk_split_halves(s: Session) -> None:
    import cupy
    half = s.comm.split(s.rank // 2, s.rank)
    assert half is not None
    assert (half.world_size, half.rank) == (2, s.rank % 2), (half.world_size, half.rank)
    x = cupy.full(C, float(s.rank + 1), dtype=cupy.float32)
    done(half.all_reduce(x))
    lo = 2 * (s.rank // 2)
    assert bool(cupy.all(x == (lo + 1) + (lo + 2))), float(x[0])
    y = cupy.full(C, float(s.rank + 1), dtype=cupy.float32)
    done(half.all_reduce(y, op="max"))
    assert bool(cupy.all(y == lo + 2))
    half.close()


def chk_split_nocolor(s: Session) -> None:
    import cupy
    sub_comm = s.comm.split(-1 if s.rank == s.n - 1 else 0, -s.rank)
    if s.rank == s.n - 1:
        assert sub_comm is None
        return
    assert sub_comm.world_size == s.n - 1
    assert sub_comm.rank == s.n - 2 - s.rank        # key = -rank reverses the order
    x = cupy.ones(C, dtype=cupy.float32)
    done(sub_comm.all_reduce(x))
    assert bool(cupy.all(x == s.n - 1))
    sub_comm.close()


def split(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "split")
    s.check("split_halves", chk_split_halves)
    s.check("split_nocolor", chk_split_nocolor)
    s.finish()


# -- torch tensors ------------------------------------------------------------------------

def chk_torch(s: Session) -> None:
    import torch
    dev = torch.device("cuda", s.dev)
    total = s.n * (s.n + 1) / 2
    t = torch.full((C,), float(s.rank + 1), device=dev)
    done(s.comm.all_reduce(t))
    assert torch.all(t == total).item()
    o = torch.empty(s.n * B, device=dev, dtype=torch.int64)
    done(s.comm.all_gather(torch.full((B,), s.rank, device=dev, dtype=torch.int64), o))
    assert o.cpu().tolist() == [r for r in range(s.n) for _ in range(B)]
    c = torch.full((B,), complex(s.rank + 1, -1), device=dev, dtype=torch.complex64)
    done(s.comm.all_reduce(c))
    assert torch.all(c == complex(total, -s.n)).item()
    bl = torch.tensor([s.rank == 0, False, True], device=dev)
    done(s.comm.all_reduce(bl))
    assert bl.cpu().tolist() == [True, False, True]
    f8 = torch.full((B,), 1.5, device=dev).to(torch.float8_e4m3fn) if s.rank == 0 else \
        torch.zeros((B,), device=dev).to(torch.float8_e4m3fn)
    done(s.comm.broadcast(f8, root=0))
    assert torch.all(f8.float() == 1.5).item()


def chk_torch_premul_bf16(s: Session) -> None:
    import torch
    t = torch.full((C,), 2.0, device=torch.device("cuda", s.dev), dtype=torch.bfloat16)
    done(s.comm.all_reduce(t, op=s.ncclpy.premul_sum(0.5)))
    assert torch.all(t == float(s.n)).item(), t    # 0.5*2 summed: n, never 0


def chk_torch_streams(s: Session) -> None:
    import torch
    dev = torch.device("cuda", s.dev)
    ts = torch.cuda.Stream(device=dev)
    t = torch.ones(C, device=dev)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(ts):                    # default: torch's current stream
        w = s.comm.all_reduce(t)
    assert w.stream == ts.cuda_stream
    w.wait(torch.cuda.current_stream(dev))         # the current stream waits, host does not
    u = t * 2
    assert torch.all(u == 2 * s.n).item()
    w2 = s.comm.all_reduce(t, stream=ts)
    assert w2.stream == ts.cuda_stream
    done(w2)
    assert torch.all(t == s.n * s.n).item()


def torch_worker(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "torch")
    s.check("torch_tensors", chk_torch)
    s.check("premul_bf16_torch", chk_torch_premul_bf16)
    s.check("torch_streams", chk_torch_streams)
    s.finish()
