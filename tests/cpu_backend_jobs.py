"""Rank bodies for tests/test_cpu_backend*.py: each runs in its own process under
``ncclpy.spawn`` on the CPU backend (``ncclpy.init(device="cpu")``), checks its own results
against :mod:`ncclpy.reference` bit for bit, and writes what it saw to
``out/<rank>.json``."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

import numpy as np

import ncclpy
from ncclpy.semantics import reference as R

__all__ = ["collectives", "p2p_and_groups", "lifecycle", "mismatch", "two_nodes", "edges", "report"]


def report(out: str, rank: int, data: Dict[str, Any]) -> None:
    """What this rank saw, for the test to read, with its pid, its channels' shared-memory
    name prefixes (what it must not leave in /dev/shm) and the NCCL rules its engine saw
    broken (``violations``)."""
    from ncclpy.cpu.backend import get_engine
    eng = get_engine()
    prefixes = sorted({ch.prefix.lstrip("/") for ch in eng.channels.values()})
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(dict(data, pid=os.getpid(), prefixes=prefixes,
                       violations=list(eng.violations)), f)


def _inputs(n: int, count: int, dtype: str, seed: int) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("float"):
        return [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    return [rng.integers(-50, 50, count).astype(dtype) for _ in range(n)]


def _same(got: np.ndarray, want: Any, what: str) -> None:
    want = np.asarray(want)
    assert got.tobytes() == want.astype(got.dtype).tobytes(), f"{what}: {got} != {want}"


#: hand-computed results (the engine reduces with the reference, so the reference alone cannot
#: judge it) for n ranks, rank r holding x = [2r+1, 2r+2], y = (r+1) * [1..2n],
#: t = [10r + d for d < n]; by rank, None: no output
LITERALS: Dict[int, Dict[str, List[Any]]] = {
    2: {"sum": [[4, 6]] * 2, "avg": [[2, 3]] * 2, "premul": [[2, 3]] * 2,
        "reduce": [None, [3, 4]], "broadcast": [[3, 4]] * 2, "all_gather": [[1, 2, 3, 4]] * 2,
        "reduce_scatter": [[3, 6], [9, 12]], "all_to_all": [[0, 10], [1, 11]],
        "gather": [[1, 2, 3, 4], None], "scatter": [[11, 12], [13, 14]],
        "ring": [[3, 4], [1, 2]]},
    4: {"sum": [[16, 20]] * 4, "avg": [[4, 5]] * 4, "premul": [[8, 10]] * 4,
        "reduce": [None, None, None, [7, 8]], "broadcast": [[7, 8]] * 4,
        "all_gather": [[1, 2, 3, 4, 5, 6, 7, 8]] * 4,
        "reduce_scatter": [[10, 20], [30, 40], [50, 60], [70, 80]],
        "all_to_all": [[0, 10, 20, 30], [1, 11, 21, 31], [2, 12, 22, 32], [3, 13, 23, 33]],
        "gather": [[1, 2, 3, 4, 5, 6, 7, 8], None, None, None],
        "scatter": [[11, 12], [13, 14], [15, 16], [17, 18]],
        "ring": [[7, 8], [1, 2], [3, 4], [5, 6]]},
}


def _literals(comm: Any, rank: int) -> int:
    """Each collective once on small inputs, against :data:`LITERALS`; how many checked."""
    n, f = comm.world_size, np.float32
    want = LITERALS[n]
    x = np.array([2 * rank + 1, 2 * rank + 2], f)
    got: Dict[str, Any] = {}
    for name, op in (("sum", "sum"), ("avg", "avg"), ("premul", ncclpy.premul_sum(0.5))):
        y = x.copy()
        comm.all_reduce(y, op=op).wait()
        got[name] = y
    y = np.full(2, -1, f)
    comm.reduce(x, y, root=n - 1, op="max").wait()
    got["reduce"] = y if rank == n - 1 else None
    assert rank == n - 1 or y.tolist() == [-1, -1], "reduce: a non-root's output was written"
    y = x.copy()
    comm.broadcast(y, root=n - 1).wait()
    got["broadcast"] = y
    got["all_gather"] = np.zeros(2 * n, f)
    comm.all_gather(x, got["all_gather"]).wait()
    got["reduce_scatter"] = np.zeros(2, f)
    comm.reduce_scatter(np.arange(1, 2 * n + 1, dtype=f) * (rank + 1),
                        got["reduce_scatter"]).wait()
    got["all_to_all"] = np.zeros(n, np.int32)
    comm.all_to_all(np.arange(n, dtype=np.int32) + 10 * rank, got["all_to_all"]).wait()
    got["gather"] = np.zeros(2 * n, f) if rank == 0 else None
    comm.gather(x, got["gather"], root=0).wait()
    got["scatter"] = np.zeros(2, f)
    comm.scatter(np.arange(11, 11 + 2 * n, dtype=f) if rank == 0 else None, got["scatter"],
                 root=0).wait()
    got["ring"] = np.zeros(2, f)
    comm.send_recv(x, got["ring"], (rank + 1) % n, (rank - 1) % n).wait()
    for name, w in want.items():
        g = got[name]
        assert (None if g is None else g.tolist()) == w[rank], f"{name}: {g} != {w[rank]}"
    return len(want)


def _reduced(kind: str, ins: List[np.ndarray], op: str, dt: str, rank: int,
             root: int = 0) -> np.ndarray:
    """What ``rank`` must get from the reduction ``kind`` over ``ins``: the CPU backend folds
    in NCCL's order (ncclpy/cpu/folds.py), which only changes the bits of a float sum, prod or
    avg on 3 ranks or more: there the model's prediction for what the communicator runs (its
    default, nothing pinned: Ring, Simple, one channel), elsewhere the reference's rank order
    (the same bits: an add of two commutes, integers wrap, min/max are order-free)."""
    n = len(ins)
    if dt.startswith("float") and op in ("sum", "prod", "avg") and n >= 3:
        from ncclpy.order import Pins, predict
        count = ins[0].size // (n if kind == "reduce_scatter" else 1)
        cfg = Pins.from_env().cpu_choice(kind).config(kind, n, count, dtype=dt, op=op,
                                                      root=root)
        return predict(cfg).outputs(ins)[rank]
    return getattr(R, kind)(ins, op=op, root=root)[rank]


def collectives(rank: int, out: str) -> None:
    """Every collective against hand-computed values (:data:`LITERALS`); then flat form, in
    and out of place, every root, float32/float64/int32/int8 with each op NCCL has for them:
    bit for bit with the reference, or, for a float sum/prod/avg on 3 ranks or more, with the
    model's prediction of NCCL's order (:func:`_reduced`)."""
    comm = ncclpy.init(device="cpu")
    n, seen = comm.world_size, _literals(comm, rank)
    for dt in ("float32", "float64", "int32", "int8", "uint8"):
        ops = ("sum", "prod", "max", "min", "avg") if dt.startswith("float") else \
            ("sum", "prod", "max", "min")
        for k, op in enumerate(ops):
            ins = _inputs(n, 7, dt, seed=k)
            want = _reduced("all_reduce", ins, op, dt, rank)
            x = ins[rank].copy()
            comm.all_reduce(x, op=op).wait()                 # in place
            _same(x, want, f"all_reduce {dt} {op}")
            y = np.zeros_like(x)
            comm.all_reduce(ins[rank], y, op=op).wait()
            _same(y, want, f"all_reduce {dt} {op} out of place")
            for root in range(n):
                y = np.full_like(ins[rank], 99)
                comm.reduce(ins[rank], y, root=root, op=op).wait()
                if rank == root:
                    _same(y, _reduced("reduce", ins, op, dt, root, root), f"reduce {dt} {op}")
                else:
                    _same(y, np.full_like(y, 99), "reduce: a non-root's output is untouched")
            big = _inputs(n, 7 * n, dt, seed=10 + k)
            y = np.zeros(7, dt)
            comm.reduce_scatter(big[rank], y, op=op).wait()
            _same(y, _reduced("reduce_scatter", big, op, dt, rank),
                  f"reduce_scatter {dt} {op}")
            seen += 4
        ins = _inputs(n, 5, dt, seed=3)
        for root in range(n):
            x = ins[rank].copy()
            comm.broadcast(x, root=root).wait()
            _same(x, ins[root], f"broadcast {dt} root {root}")
            y = np.zeros(5 * n, dt) if rank == root else None
            comm.gather(ins[rank], y, root=root).wait()
            if rank == root:
                _same(y, np.concatenate(ins), f"gather {dt}")
            big = _inputs(n, 5 * n, dt, seed=4)
            y = np.zeros(5, dt)
            comm.scatter(big[rank] if rank == root else None, y, root=root).wait()
            _same(y, big[root][5 * rank:5 * (rank + 1)], f"scatter {dt}")
        y = np.zeros(5 * n, dt)
        comm.all_gather(ins[rank], y).wait()
        _same(y, np.concatenate(ins), f"all_gather {dt}")
        a2a = _inputs(n, 3 * n, dt, seed=5)
        y = np.zeros(3 * n, dt)
        comm.all_to_all(a2a[rank], y).wait()
        _same(y, R.all_to_all(a2a)[rank], f"all_to_all {dt}")
        seen += 5
    comm.barrier().wait()
    comm.close()
    report(out, rank, {"checked": seen})


class _DLPackOnly:
    """A producer seen only through DLPack (numpy's capsule)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kw: Any) -> Any:
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self.a.__dlpack_device__()


def p2p_and_groups(rank: int, out: str) -> None:
    """send/recv, a ring in one group, send_recv, list forms, premul_sum, object collectives,
    prepared calls, eager calls completed by ncclpy.cpu.synchronize, torch CPU tensors."""
    import ncclpy.cpu
    comm = ncclpy.init(device="cpu")
    n = comm.world_size
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    got = np.zeros(4, np.float64)
    with comm.group():
        comm.send(np.full(4, rank, np.float64), nxt)
        comm.recv(got, prv)
    ncclpy.cpu.synchronize()
    _same(got, np.full(4, prv, np.float64), "ring in a group")
    got2 = np.zeros(3, np.int64)
    comm.send_recv(np.arange(3, dtype=np.int64) + rank, got2, nxt, prv).wait()
    _same(got2, np.arange(3) + prv, "send_recv")
    if n >= 2:                                  # two sends in a row, received one by one
        if rank == 0:
            comm.send(np.ones(2, np.float32), 1)
            comm.send(np.full(2, 2, np.float32), 1).wait()
        elif rank == 1:
            a, b = np.zeros(2, np.float32), np.zeros(2, np.float32)
            comm.recv(a, 0).wait()
            comm.recv(b, 0).wait()
            _same(a, np.ones(2), "first of two sends")
            _same(b, np.full(2, 2), "second of two sends")
    parts = [np.zeros(2, np.float32) for _ in range(n)]
    comm.all_gather(np.full(2, rank, np.float32), parts).wait()
    for r, p in enumerate(parts):
        _same(p, np.full(2, r, np.float32), "all_gather list form")
    x = np.full(6, rank + 1, np.float32)
    comm.all_reduce(x, op=ncclpy.premul_sum(0.5)).wait()
    want = R.all_reduce([np.full(6, r + 1, np.float32) for r in range(n)],
                        op=ncclpy.premul_sum(0.5))[rank]
    _same(x, want, "premul_sum")
    objs = comm.all_gather_object({"rank": rank})
    assert objs == [{"rank": r} for r in range(n)], objs
    assert comm.broadcast_object("hello" if rank == 0 else None) == "hello"
    buf = np.full(8, rank, np.int32)
    p = comm.prepare("all_reduce", buf)
    p().wait()
    p().wait()
    _same(buf, np.full(8, sum(range(n)) * n, np.int32), "a prepared call, twice")
    z = np.full(4, 1.0, np.float32)
    w = comm.all_reduce(z, stream=5)             # any int names its own CPU stream
    assert w.stream == 5
    w.wait(0)                                    # the default stream waits on it: no host block
    later = np.zeros(4, np.float32)
    comm.all_reduce(z, later).wait()             # on stream 0, after stream 5's call
    _same(later, np.full(4, float(n * n), np.float32), "a call ordered after another stream's")
    raw = np.full(6, rank, np.int32)             # a raw pointer to host memory
    comm.all_reduce(ncclpy.Buffer(raw.ctypes.data, 6, "int32", device="cpu")).wait()
    _same(raw, np.full(6, sum(range(n)), np.int32), "ncclpy.Buffer(device='cpu')")
    dl = np.full(3, 2.0, np.float64)             # DLPack from CPU: only __dlpack__ to go by
    comm.all_reduce(_DLPackOnly(dl)).wait()
    _same(dl, np.full(3, 2.0 * n), "a DLPack CPU buffer")
    eager = np.full(16, 1.0, np.float32)
    w = comm.all_reduce(eager)
    ncclpy.cpu.synchronize()
    assert w.is_completed()
    _same(eager, np.full(16, float(n), np.float32), "an eager call, then synchronize")
    torch_seen = False
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.full((5,), float(rank), dtype=torch.bfloat16)
        comm.all_reduce(t).wait()
        want = R.all_reduce([np.full(5, float(r), np.float32) for r in range(n)],
                            dtype="bfloat16")[rank]
        assert t.view(torch.int16).numpy().view(np.uint16).tobytes() == \
            np.asarray(want).tobytes(), (t, want)
        torch_seen = True
    comm.close()
    comm.close()                                 # idempotent
    report(out, rank, {"torch": torch_seen})


def lifecycle(rank: int, out: str) -> None:
    """split (two colours), a nonblocking communicator, abort, a GPU buffer refused."""
    from nccl_standin import DevArray          # tests/ is on the path (this module is)
    comm = ncclpy.init(device="cpu")
    n = comm.world_size
    child = comm.split(color=rank % 2, key=-rank)
    members = [r for r in range(n) if r % 2 == rank % 2]
    assert child.world_size == len(members), (child.world_size, members)
    assert child.rank == sorted(members, reverse=True).index(rank), child.rank
    x = np.full(3, rank, np.float32)
    child.all_reduce(x).wait()
    _same(x, np.full(3, sum(members), np.float32), "all_reduce on a split child")
    child.close()
    try:
        comm.all_reduce(DevArray(np.zeros(2, np.float32)))
        refused = ""
    except ncclpy.NcclpyError as e:
        refused = str(e)
    nb = ncclpy.init("nb", device="cpu", config=ncclpy.Config(blocking=False))
    y = np.full(2, 1.0, np.float32)
    nb.all_reduce(y).wait()
    _same(y, np.full(2, float(n), np.float32), "a nonblocking communicator")
    nb.close()
    comm.barrier().wait()
    comm.abort()
    comm.close()
    report(out, rank, {"refused": refused})


def edges(rank: int, out: str, rounds: int) -> None:
    """What review found (2026-11-27): a send/recv ping-pong (the descriptor's seqlock), a
    send to oneself in a group, an unmatched one refused, one group on two streams, a group too
    big for a control block, premul_sum with each rank's own scalar."""
    import ncclpy.cpu
    comm = ncclpy.init(device="cpu")
    n, peer = comm.world_size, 1 - rank
    a = np.zeros(1, np.int64)
    for i in range(rounds):                      # rank 0 sends then receives; rank 1 the reverse
        if rank == 0:
            comm.send(np.full(1, i, np.int64), peer)
            comm.recv(a, peer).wait()
        else:
            comm.recv(a, peer).wait()
            comm.send(a + 1, peer).wait()
        assert int(a[0]) == i + (rank == 0), (i, a)
    me = np.zeros(3, np.float32)
    with comm.group():
        comm.send(np.full(3, 7, np.float32), rank)
        comm.recv(me, rank)
    ncclpy.cpu.synchronize()
    _same(me, np.full(3, 7, np.float32), "a send to oneself in a group")
    try:                                         # ncclpy's own check, outside a group
        comm.send(np.ones(2, np.float32), rank)
        alone = ""
    except ncclpy.NcclpyError as e:
        alone = f"{type(e).__name__}: {e}"
    try:                                         # NCCL's, at the group's end
        with comm.group():
            comm.send(np.ones(2, np.float32), rank)
        unmatched = ""
    except ncclpy.NcclpyError as e:
        unmatched = f"{type(e).__name__}: {e}"
    got = np.zeros(2, np.float32)
    with comm.group():                           # one communicator's group on two streams
        comm.send(np.full(2, rank, np.float32), peer, stream=5)
        comm.recv(got, peer, stream=6)
    ncclpy.cpu.synchronize()
    _same(got, np.full(2, peer, np.float32), "a group on two streams")
    many = [np.zeros(1, np.int32) for _ in range(3000)]
    with comm.group():                           # a descriptor bigger than a control block
        for k, b in enumerate(many):
            comm.send(np.full(1, k, np.int32), peer)
            comm.recv(b, peer)
    ncclpy.cpu.synchronize()
    assert [int(b[0]) for b in many] == list(range(3000))
    x = np.ones(4, np.float32)
    comm.all_reduce(x, op=ncclpy.premul_sum(float(rank + 1))).wait()
    _same(x, np.full(4, sum(range(1, n + 1)), np.float32), "premul_sum, a scalar per rank")
    comm.close()
    report(out, rank, {"unmatched": unmatched, "alone": alone})


def two_nodes(rank: int, out: str) -> None:
    """A job that says its ranks are on two machines: the CPU backend refuses it on every rank."""
    try:
        ncclpy.init(device="cpu", local_world_size=1, local_rank=0)
        err = ""
    except ncclpy.NcclpyError as e:
        err = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"error": err}, f)


def mismatch(rank: int, out: str, kind: str) -> None:
    """A collective that does not match (``kind``: 'count' or 'skip'): the waiting rank's
    Work.wait times out; what each rank saw goes to the report."""
    comm = ncclpy.init(device="cpu", timeout=3, watchdog=False)
    x = np.ones(4 if (kind == "count" and rank == 1) else 8, np.float32)
    t0 = time.monotonic()
    err = ""
    try:
        if not (kind == "skip" and rank == 1):
            comm.all_reduce(x).wait(timeout=2)
    except ncclpy.NcclpyError as e:
        err = type(e).__name__
    report(out, rank, {"error": err, "waited": time.monotonic() - t0})
    comm.abort()
