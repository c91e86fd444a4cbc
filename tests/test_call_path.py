"""The communicator's own logic on CPU, through the STAND-IN for libnccl and CUDA
(tests/nccl_standin.py): every collective and plan step (copies, scratch, premul ops), groups,
prepared calls, Works, split, registration, nonblocking communicators, on thread-ranks, with
results checked against numpy and the stand-in's record of NCCL-rule violations (none allowed).

The lifecycle (abort, close, finalize, the watchdog) and captures are in
tests/test_call_path_lifecycle.py.  None of this runs NCCL or a GPU: tests/gpu does.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator

from nccl_standin import DevArray, run_ranks, standin

UID = bytes(range(128))


def _comm(r: int, n: int, route: str, uid: bytes = UID, **kw) -> Communicator:
    cfg = None if route == "cupy" else Config(blocking=(route != "nonblocking"))
    return Communicator(n, r, uid, r, cfg, **kw)


def _arr(values, r: int, dtype=np.float32) -> DevArray:
    return DevArray(np.asarray(values, dtype=dtype), device=r)


def _on_ranks(n: int, fn, *args, **standin_kw):
    """``fn(rank, n, *args)`` on ``n`` thread-ranks over a fresh stand-in: (outputs, engine);
    no NCCL rule may have been broken."""
    with standin(**standin_kw) as eng:
        outs = run_ranks(n, fn, n, *args)
    assert eng.violations == []
    return outs, eng


def _collectives(r: int, n: int, route: str) -> dict:
    """Every call method once (and the plan steps behind the list and in-place forms);
    returns what this rank received."""
    c = _comm(r, n, route)
    assert c.rank == r and c.world_size == n and c.nonblocking == (route == "nonblocking")
    out = {}
    x = _arr(np.arange(4) + 10 * r, r)
    c.all_reduce(x).wait()
    out["all_reduce"] = x.a.copy()
    y, yr = _arr(np.arange(3) * (r + 1), r, np.int64), _arr(np.zeros(3), r, np.int64)
    c.reduce(y, yr, root=1, op="max").wait()
    out["reduce"] = yr.a.copy()
    b = _arr(np.full(5, r), r, np.int32)
    c.broadcast(b, root=n - 1).wait()
    out["broadcast"] = b.a.copy()
    g = _arr(np.zeros(2 * n), r)
    c.all_gather(_arr([r, -r], r), g).wait()
    out["all_gather"] = g.a.copy()
    lst = [_arr(np.zeros(2), r) for _ in range(n)]          # list form: scratch + copies
    c.all_gather(_arr([r, r + 0.5], r), lst).wait()
    out["all_gather_list"] = np.concatenate([t.a for t in lst])
    rs = _arr(np.zeros(2), r, np.float64)
    c.reduce_scatter(_arr(np.arange(2 * n) + r, r, np.float64), rs, op="avg").wait()
    out["reduce_scatter"] = rs.a.copy()
    a2a = _arr(np.zeros(n), r, np.int32)
    c.all_to_all(_arr(np.arange(n) + 100 * r, r, np.int32), a2a).wait()
    out["all_to_all"] = a2a.a.copy()
    ip = _arr(np.arange(n) + 100 * r, r, np.int32)           # in place: staged via scratch
    c.all_to_all(ip).wait()
    out["all_to_all_inplace"] = ip.a.copy()
    gat = _arr(np.zeros(n), r) if r == 0 else None
    c.gather(_arr([r + 1], r), gat, root=0).wait()
    out["gather"] = None if gat is None else gat.a.copy()
    sc = _arr(np.zeros(1), r)
    c.scatter(_arr(np.arange(n) * 3.0, r) if r == n - 1 else None, sc, root=n - 1).wait()
    out["scatter"] = sc.a.copy()
    ring = _arr(np.zeros(2), r)
    c.send_recv(_arr([r, r], r), ring, (r + 1) % n, (r - 1) % n).wait()
    out["send_recv"] = ring.a.copy()
    pm = _arr(np.ones(3) * (r + 1), r, np.float64)
    c.all_reduce(pm, op=ncclpy.premul_sum(0.5)).wait()
    out["premul_sum"] = pm.a.copy()
    c.barrier()
    c.close()
    assert c.closed and c.state == "closed" and c.handle == 0
    c.close()                                                 # idempotent
    return out


@pytest.mark.parametrize("route", ["cupy", "ctypes", "nonblocking"])
def test_every_collective_matches_numpy_on_three_ranks(route):
    n = 3
    outs, eng = _on_ranks(n, _collectives, route)
    for r, o in enumerate(outs):
        assert o["all_reduce"].tolist() == (np.arange(4) * 3 + 30).tolist()
        if r == 1:
            assert o["reduce"].tolist() == (np.arange(3) * 3).tolist()
        assert o["broadcast"].tolist() == [n - 1] * 5
        assert o["all_gather"].tolist() == [v for s in range(n) for v in (s, -s)]
        assert o["all_gather_list"].tolist() == [v for s in range(n) for v in (s, s + 0.5)]
        want = np.mean([np.arange(2 * n) + s for s in range(n)], axis=0)[2 * r:2 * r + 2]
        np.testing.assert_allclose(o["reduce_scatter"], want, rtol=1e-15)  # NCCL: x * fl(1/n)
        assert o["all_to_all"].tolist() == [r + 100 * s for s in range(n)]
        assert o["all_to_all_inplace"].tolist() == [r + 100 * s for s in range(n)]
        assert o["scatter"].tolist() == [3.0 * r]
        assert o["send_recv"].tolist() == [(r - 1) % n] * 2
        assert o["premul_sum"].tolist() == [0.5 * 6] * 3
    assert outs[0]["gather"].tolist() == [1, 2, 3]
    names = {c[0] for c in eng.calls}
    assert {"ncclAlltoAll", "ncclGather", "ncclScatter", "ncclRedOpCreatePreMulSum",
            "ncclRedOpDestroy", "ncclCommFinalize", "ncclCommDestroy"} <= names
    assert "ncclCommAbort" not in names


def test_an_nccl_without_native_gather_scatter_alltoall_uses_grouped_send_recv():
    n = 3
    outs, eng = _on_ranks(n, _collectives, "ctypes", version=22709)
    names = {c[0] for c in eng.calls}
    assert not {"ncclAlltoAll", "ncclGather", "ncclScatter"} & names
    assert {"ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd"} <= names
    assert outs[0]["gather"].tolist() == [1, 2, 3]
    assert [o["all_to_all"].tolist() for o in outs] == [[r, r + 100, r + 200]
                                                         for r in range(n)]


def _grouped(r: int, n: int, route: str) -> list:
    c = _comm(r, n, route)
    a, b = _arr([r], r), _arr([10 * r], r)
    with c.group():
        wa = c.all_reduce(a)
        wb = c.all_reduce(b)
        with pytest.raises(errors.NcclpyError, match="outermost group ends"):
            wa.wait()                       # recorded at the group end, not before
    wa.wait()
    wb.wait()
    s, rr = _arr([r], r), _arr([-1], r)
    with ncclpy.group():                    # NCCL's group across this thread's communicators
        c.send(s, (r + 1) % n)
        c.recv(rr, (r - 1) % n)
    c.barrier()
    res = [a.a[0], b.a[0], rr.a[0]]
    c.close()
    return res


@pytest.mark.parametrize("route", ["ctypes", "nonblocking"])
def test_groups_fuse_calls_and_record_works_at_the_outermost_end(route):
    outs, _ = _on_ranks(3, _grouped, route)
    for r, o in enumerate(outs):
        assert o == [3.0, 30.0, float((r - 1) % 3)]


def _replanned_in_group(r: int, n: int) -> tuple:
    """A gather made twice outside a group (the second from the fast path's entry), again in
    a group, then again in the same group after ``force_fallback`` changed, and once more
    after the group: the last two must be NCCL's send/recv, not the cached ncclGather.
    Returns this thread's ident and what the root gathered each time."""
    c = _comm(r, n, "ctypes")
    x = _arr([r + 1.0], r)
    out = _arr(np.zeros(n), r) if r == 0 else None
    got = []
    for _ in range(2):
        c.gather(x, out, root=0).wait()
    with ncclpy.group():
        w1 = c.gather(x, out, root=0)             # the same call: served from the cache
        c.force_fallback = True
        w2 = c.gather(x, out, root=0)             # the same call again, in the new context
    w1.wait()
    w2.wait()
    got.append(None if out is None else out.a.tolist())
    if out is not None:
        out.a[:] = 0
    c.gather(x, out, root=0).wait()               # after the group: the fast path's entry?
    got.append(None if out is None else out.a.tolist())
    c.close()
    return threading.get_ident(), got


def test_a_context_change_inside_a_group_replans_the_next_call():
    n = 3
    outs, eng = _on_ranks(n, _replanned_in_group)
    assert outs[0][1] == [[1.0, 2.0, 3.0]] * 2
    for r, (me, _) in enumerate(outs):
        calls = [c[0] for c in eng.calls
                 if c[2] == me and c[0] in ("ncclGather", "ncclSend", "ncclRecv")]
        p2p = ["ncclRecv"] * (n - 1) if r == 0 else ["ncclSend"]
        # twice outside, once in the group as cached, then the new plan in the group and after
        assert calls == ["ncclGather"] * 3 + p2p * 2, (r, calls)


def _prepared(r: int, n: int) -> list:
    c = _comm(r, n, "ctypes")
    x = _arr([1.0, 2.0], r)
    p = c.prepare("all_reduce", x, op="sum")
    assert p.name == "all_reduce"
    for _ in range(3):
        p().wait()
    lst = [_arr([0.0], r) for _ in range(n)]
    pg = c.prepare("all_gather", _arr([float(r)], r), lst)
    pg().wait()
    res = x.a.tolist() + [t.a[0] for t in lst]
    c.close()
    with pytest.raises(errors.NcclpyError, match="closed"):
        p()
    return res


def test_prepared_calls_repeat_the_same_nccl_calls():
    outs, eng = _on_ranks(2, _prepared)
    assert outs[0] == [8.0, 16.0, 0.0, 1.0] and outs[1] == outs[0]   # x doubled three times
    ar = [c for c in eng.calls if c[0] == "ncclAllReduce"]
    assert len(ar) == 2 * 3


def _split(r: int, n: int, route: str) -> list:
    c = _comm(r, n, route)
    child = c.split(r % 2, -r)              # evens and odds, in reverse rank order
    none = c.split(-1 if r else 0, 0)       # only rank 0 joins a one-rank child
    x = _arr([r + 1], r)
    child.all_reduce(x).wait()
    res = [child.rank, child.world_size, x.a[0], none is None]
    if none is not None:
        none.close()
    child.close()
    c.close()
    return res


@pytest.mark.parametrize("route", ["cupy", "ctypes", "nonblocking"])
def test_split_makes_independent_children(route):
    outs, _ = _on_ranks(4, _split, route)
    assert outs[0] == [1, 2, 1 + 3, False] and outs[2] == [0, 2, 4, True]
    assert outs[1] == [1, 2, 2 + 4, True] and outs[3] == [0, 2, 6, True]


def _register(r: int, n: int) -> list:
    c = _comm(r, n, "ctypes")
    x = _arr(np.zeros(8), r)
    reg1, reg2 = c.register(x), c.register(x)
    assert reg1 is not reg2 and reg1.ptr == reg2.ptr == x.ptr
    c.deregister(reg1)
    with pytest.raises(errors.ArgumentError, match="not a live registration"):
        c.deregister(reg1)
    buf = c.mem_alloc(16, "float32")
    assert buf.count == 16 and buf.dtype == "float32"
    buf2 = c.mem_alloc(4)
    c.mem_free(buf2)
    with pytest.raises(errors.ArgumentError, match="was not allocated"):
        c.mem_free(buf2)
    c.close()                               # deregisters reg2, frees buf
    with pytest.raises(errors.NcclpyError, match="closed"):
        c.register(x)
    return [reg2.handle]


def test_registrations_and_nccl_memory_are_released_by_close():
    with standin() as eng:
        run_ranks(2, _register, 2)
        assert eng.registrations == {} and eng.mem == {}
    assert eng.violations == []
    assert [c[0] for c in eng.calls].count("ncclCommDeregister") == 2 * 2
