"""GPU tests of issue 14 (thin calls): prepared calls, the resolver's cache on a real
communicator, pooled Work events.  Two ranks (on one GPU if need be) via ncclpy.spawn; each rank
records one JSON line per check (``_gpu_common.Session``), the parent reads them.  The workers
live in this file (the ranks import it by name: tests/gpu is on their PYTHONPATH).  Skipped
with the reason where CUDA, CuPy or NCCL is absent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gpu_util import cuda_reason, requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _gpu_common import C, WAIT_S, Session, Skip, done  # noqa: E402
from _gpu_spawn import ROOT, feature, spawn_records  # noqa: E402

TIMEOUT = 480   # below the device tool's 600 s per command (see _gpu_spawn)
pytestmark = pytest.mark.timeout(TIMEOUT)


# -- checks (run on every rank) -------------------------------------------------------------------
def chk_prepared_repeats(s: Session) -> None:
    """The same prepared all_reduce three times, in place: n, n^2, n^3 times the rank sum."""
    import cupy
    x = cupy.full(C, float(s.rank + 1), dtype=cupy.float64)
    ar = s.comm.prepare("all_reduce", x, op="sum")
    total = s.n * (s.n + 1) / 2
    for k in range(3):
        w = ar()
        done(w)
        assert w.plan.collective == "all_reduce"
        assert bool(cupy.all(x == total * s.n ** k)), (k, float(x[0]))
    y = cupy.zeros(C, dtype=cupy.float64)
    x.fill(float(s.rank + 1))
    done(s.comm.prepare("all_reduce", x, y, "max")())
    assert bool(cupy.all(y == s.n)) and bool(cupy.all(x == s.rank + 1))


def chk_prepared_streams(s: Session) -> None:
    """ar(stream=s) runs there; without it, the buffers' current stream at call time."""
    import cupy
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(C, dtype=cupy.float32)
    cupy.cuda.Device(s.dev).synchronize()
    ar = s.comm.prepare("all_reduce", x)
    w = ar(stream=side)
    assert w.stream == side.ptr
    done(w)
    with side:
        w = ar()
    assert w.stream == side.ptr
    done(w)
    fixed = s.comm.prepare("all_reduce", x, stream=side)
    w = fixed()
    assert w.stream == side.ptr
    done(w)
    assert bool(cupy.all(x == s.n ** 3)), float(x[0])


def chk_prepared_in_group(s: Session) -> None:
    """Prepared send/recv ring inside comm.group(); send/recv to self inside a group."""
    import cupy
    nxt, prv = (s.rank + 1) % s.n, (s.rank - 1) % s.n
    src = cupy.full(C, float(s.rank), dtype=cupy.float32)
    dst = cupy.zeros(C, dtype=cupy.float32)
    snd = s.comm.prepare("send", src, nxt)
    rcv = s.comm.prepare("recv", dst, peer=prv)
    for _ in range(2):
        dst.fill(-1)
        with s.comm.group():
            ws, wr = snd(), rcv()
        done(ws)
        done(wr)
        assert bool(cupy.all(dst == prv)), float(dst[0])
    me = cupy.zeros(C, dtype=cupy.float32)
    with s.comm.group():
        to_self = s.comm.prepare("send", src, s.rank)
        from_self = s.comm.prepare("recv", me, s.rank)
        w1, w2 = to_self(), from_self()
    done(w1)
    done(w2)
    assert bool(cupy.all(me == s.rank))
    try:
        to_self()                                 # alone it would hang: refused
        raise AssertionError("a send to self outside a group was accepted")
    except s.ncclpy.NcclpyError as e:
        assert "inside a group" in str(e)


def chk_prepared_graph(s: Session) -> None:
    """A prepared all_reduce captured in a CUDA graph replays with fresh inputs; eager Works
    after the capture still wait and complete."""
    import cupy
    st = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(1 << 12, dtype=cupy.float32)
    ar = s.comm.prepare("all_reduce", x, stream=st)
    cupy.cuda.Device(s.dev).synchronize()
    with st:
        st.begin_capture()
        wc = ar()
        graph = st.end_capture()
    assert wc.stream == st.ptr
    for k in (1, 2, 3):
        with st:
            x.fill(float(k * (s.rank + 1)))
        graph.launch(st)
        st.synchronize()
        want = k * s.n * (s.n + 1) / 2
        assert bool(cupy.all(x == want)), f"replay {k}: {float(x[0])} != {want}"
    x.fill(1.0)
    cupy.cuda.Device(s.dev).synchronize()
    done(ar())
    assert bool(cupy.all(x == s.n))


def _refused(s: Session, fn, word: str) -> None:
    try:
        fn()
    except s.ncclpy.NcclpyError as e:
        assert word in str(e) and "prepared all_reduce" in str(e), str(e)
        return
    raise AssertionError(f"a prepared call on a {word} communicator was accepted")


def chk_prepared_refused_when_closed(s: Session) -> None:
    import cupy
    x = cupy.ones(4, dtype=cupy.float32)
    comm = s.ncclpy.init(name="prep-close")
    ar = comm.prepare("all_reduce", x)
    done(ar())
    comm.close()
    _refused(s, ar, "closed")
    comm = s.ncclpy.init(name="prep-finalize")
    ar = comm.prepare("all_reduce", x)
    comm.finalize()
    _refused(s, ar, "finalized")
    comm.close()
    comm = s.ncclpy.init(name="prep-abort")
    ar = comm.prepare("all_reduce", x)
    comm.abort()
    _refused(s, ar, "aborted")
    assert len(comm._resolver) == 0


def chk_cache_follows_context_and_buffers(s: Session) -> None:
    """On a real communicator: force_fallback re-plans (native Gather -> grouped send/recv) and
    both give the right result; a repeated call is not planned again; new arrays are seen."""
    import cupy
    res = s.comm._resolver
    src = cupy.full(C, float(s.rank), dtype=cupy.float32)
    out = cupy.zeros(s.n * C, dtype=cupy.float32) if s.rank == 0 else None
    want = np.repeat(np.arange(s.n, dtype=np.float32), C)
    paths = []
    for ff in (False, True, False):
        s.comm.force_fallback = ff
        for _ in range(2):
            w = s.comm.gather(src, out, root=0)
            done(w)
            paths.append(w.plan.path)
            if s.rank == 0:
                assert np.array_equal(cupy.asnumpy(out), want)
                out.fill(0)
    assert paths[0] == paths[1] and paths[2] == paths[3] == "p2p" and paths[0] != "p2p"
    x = cupy.ones(C, dtype=cupy.float32)
    done(s.comm.all_reduce(x))
    misses = res.misses
    done(s.comm.all_reduce(x))
    assert res.misses == misses, "a repeated call was planned again"
    for k in range(3):                             # new arrays: new pointers, right results
        y = cupy.full(C + k, float(s.rank + k), dtype=cupy.float32)
        done(s.comm.all_reduce(y))
        assert bool(cupy.all(y == sum(r + k for r in range(s.n))))


def chk_torch_repointed_tensor(s: Session) -> None:
    """A torch tensor re-pointed in place (set_) is reduced where it points now."""
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed") from None
    if not torch.cuda.is_available():
        raise Skip("this torch has no CUDA")
    dev = torch.device("cuda", s.dev)
    t = torch.full((C,), float(s.rank + 1), device=dev)
    done(s.comm.all_reduce(t))
    other = torch.full((C,), 2.0 * (s.rank + 1), device=dev)
    old_ptr = t.data_ptr()
    t.set_(other.untyped_storage())
    assert t.data_ptr() != old_ptr
    done(s.comm.all_reduce(t))
    torch.cuda.synchronize(dev)
    assert bool((other == 2 * s.n * (s.n + 1) / 2).all()), other[0].item()


def chk_work_pool(s: Session) -> None:
    """Events are pooled: hundreds of calls create only a few; waiting, is_completed and
    wait(stream) keep their meaning on reused events."""
    import cupy
    from ncclpy.comm.work import event_pool
    x = cupy.ones(64, dtype=cupy.float32)
    pool = event_pool(s.dev)

    def burst() -> int:
        before = pool.created
        for i in range(300):
            w = s.comm.all_reduce(x, op="max")
            if i % 3 == 0:
                w.wait()
                assert w.is_completed() and w.event is None
                w.wait()                           # again: nothing left to wait for
            elif i % 3 == 1:
                done(w)
            # else: dropped unwaited; its event returns once its completion is seen (by the
            # watchdog's next tick, or the sweep of dropped Works): never while in flight
        cupy.cuda.Device(s.dev).synchronize()
        wd, deadline = s.comm._watchdog, time.monotonic() + 5.0
        while wd is not None and wd.pending and time.monotonic() < deadline:
            time.sleep(0.05)                       # the watchdog sees them complete
        return pool.created - before
    first = burst()
    assert first <= 300, first                     # at most one per call in flight
    again = burst()                                # the first burst's events are reused
    assert again <= 4, (first, again)
    side = cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.Stream(non_blocking=True)
    gate = threading.Event()
    y = cupy.full(8 << 20, float(s.rank + 1), dtype=cupy.float32)
    cupy.cuda.Device(s.dev).synchronize()
    side.launch_host_func(lambda _: gate.wait(WAIT_S), None)   # hold the side stream
    w = s.comm.all_reduce(y, stream=side)
    time.sleep(0.2)
    assert not w.is_completed(), "completed while its stream was held"
    w.wait(main)
    with main:
        z = y * 2
    gate.set()
    main.synchronize()
    assert bool(cupy.all(z == s.n * (s.n + 1))), "main ran before the all_reduce finished"
    w.wait()
    w.wait(main)                                   # completed: a no-op
    assert w.is_completed()


def chk_split_child(s: Session) -> None:
    """A split child resolves on its own context; the parent keeps working after the split."""
    import cupy
    x = cupy.ones(C, dtype=cupy.float32)
    done(s.comm.all_reduce(x))
    child = s.comm.split(0, s.rank)
    assert child is not None and child._resolver is not s.comm._resolver
    assert child._resolver.ctx.world_size == child.world_size
    y = cupy.ones(C, dtype=cupy.float32)
    done(child.all_reduce(y))
    assert bool(cupy.all(y == child.world_size))
    done(s.comm.all_reduce(x))
    assert bool(cupy.all(x == s.n ** 2))
    child.close()


CHECKS = (("prepared_repeats", chk_prepared_repeats),
          ("prepared_streams", chk_prepared_streams),
          ("prepared_in_group", chk_prepared_in_group),
          ("prepared_graph", chk_prepared_graph),
          ("prepared_refused_when_closed", chk_prepared_refused_when_closed),
          ("cache_context_buffers", chk_cache_follows_context_and_buffers),
          ("torch_repointed", chk_torch_repointed_tensor),
          ("work_pool", chk_work_pool),
          ("split_child", chk_split_child))


def prepared_worker(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "prepared")
    for name, fn in CHECKS:
        s.check(name, fn)
    s.finish()


# -- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory):
    if cuda_reason():
        pytest.skip(cuda_reason())
    mp = pytest.MonkeyPatch()
    try:
        return spawn_records(prepared_worker, 2, str(tmp_path_factory.mktemp("prep")), mp)
    finally:
        mp.undo()


@requires_gpu
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.gpu_world(2)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_prepared_and_cached_calls(prepared_run, name):
    """Each check of :data:`CHECKS` ran and passed on both ranks."""
    feature(prepared_run, name, 2)


@requires_gpu
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.gpu_world(2)
def test_overhead_benchmark_prepared_mode(tmp_path):
    """``bench.overhead --modes eager,prepared`` times both ncclpy flavours' prepared calls
    beside raw CuPy."""
    js = tmp_path / "o.json"
    flavours = ("ncclpy", "ncclpy-bare")
    cp = subprocess.run([sys.executable, "-m", "bench.overhead", "--backends",
                         "ncclpy,ncclpy-bare,cupy", "--modes", "eager,prepared", "--calls",
                         "200", "--sizes", "8", "-J", str(js)], cwd=ROOT, capture_output=True,
                        text=True, timeout=TIMEOUT - 60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = json.loads(js.read_text())
    res = {(r["backend"], r["mode"]): r for r in doc["results"]}
    assert set(res) == {(b, m) for b in (*flavours, "cupy") for m in ("eager", "prepared")}
    for r in res.values():             # every call of every mode timed, and the figures hold
        assert r["calls"] == 200 and r["size"] == 8 and r["rounds"] == 5, r
        assert 0 < r["min_us"] <= r["p10_us"] <= r["median_us"] <= r["p90_us"], r
    # what the benchmark is for: each flavour's cost over the raw CuPy call, per mode
    derived = {(d["backend"], d["mode"]): d for d in doc["derived"]}
    assert set(derived) == {(f, m) for f in flavours for m in ("eager", "prepared")}
    for (fl, mode), d in derived.items():
        want = res[(fl, mode)]["median_us"] - res[("cupy", mode)]["median_us"]
        assert d["minus_cupy_us"] == pytest.approx(want), (fl, mode, d)
    assert doc["calls"] == 200 and doc["world_size"] == 2
