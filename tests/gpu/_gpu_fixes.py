"""GPU workers for the fixes of issue 13 that only a GPU can show: a split of a nonblocking
communicator, and communicators made nonblocking by ``NCCL_COMM_BLOCKING=0``.  (Registering
one buffer twice is ``chk_register_twice`` in the ``misc`` spawn of ``_gpu_features``.)"""
from __future__ import annotations

import os
from typing import Any

from _gpu_common import B, C, Session, done


def _sum_to(lo: int, hi: int) -> float:
    """(lo+1) + ... + (hi+1): the all_reduce of ``rank + 1`` over ranks lo..hi."""
    return float(sum(r + 1 for r in range(lo, hi + 1)))


def chk_nonblocking_split(s: Session) -> None:
    import cupy
    parent = s.ncclpy.init(name="nb-split-parent", config=s.ncclpy.Config(blocking=False))
    try:
        assert parent.nonblocking, "Config(blocking=False) made a blocking communicator"
        # 1. every rank keeps a colour: pairs of ranks (one pair on 2 ranks), key -rank
        #    reverses the order inside each pair
        color = s.rank // 2
        lo, hi = 2 * color, min(2 * color + 1, s.n - 1)
        child = parent.split(color, -s.rank)
        assert child is not None, (f"rank {s.rank}: split(color={color}) of a nonblocking "
                                   f"communicator returned None")
        try:
            size = hi - lo + 1
            assert child.world_size == size, (child.world_size, size)
            assert child.rank == hi - s.rank, (child.rank, hi - s.rank)
            x = cupy.full(C, float(s.rank + 1), dtype=cupy.float32)
            done(child.all_reduce(x))
            assert bool(cupy.all(x == _sum_to(lo, hi))), (float(x[0]), _sum_to(lo, hi))
        finally:
            child.close()
        # 2. the last rank opts out (colour < 0): None there, a working communicator elsewhere
        last = s.n - 1
        sub = parent.split(-1 if s.rank == last else 0, s.rank)
        if s.rank == last:
            assert sub is None, f"split with colour -1 returned {sub!r}, expected None"
        else:
            assert sub is not None, f"rank {s.rank}: split(color=0) returned None"
            try:
                assert (sub.rank, sub.world_size) == (s.rank, s.n - 1), (sub.rank,
                                                                          sub.world_size)
                y = cupy.ones(C, dtype=cupy.float32)
                done(sub.all_reduce(y))
                assert bool(cupy.all(y == s.n - 1)), float(y[0])
            finally:
                sub.close()
        # the parent still works after its children are gone
        z = cupy.ones(C, dtype=cupy.float32)
        done(parent.all_reduce(z))
        assert bool(cupy.all(z == s.n)), float(z[0])
    finally:
        parent.close()
    assert parent.closed


def chk_min_ctas_alone(s: Session) -> None:
    """Config(min_ctas=2) without max_ctas: NCCL refuses min > unset max unless ncclpy fills
    the max (issue 13, defect 6)."""
    import cupy
    comm = s.ncclpy.init(name="min-ctas", config=s.ncclpy.Config(min_ctas=2))
    try:
        x = cupy.ones(C, dtype=cupy.float32)
        done(comm.all_reduce(x))
        assert bool(cupy.all(x == s.n)), float(x[0])
    finally:
        comm.close()


def nonblocking_split(rank: int, outdir: str) -> None:
    s = Session(rank, outdir, "nbsplit")
    s.check("nonblocking_split", chk_nonblocking_split)
    s.check("min_ctas_alone", chk_min_ctas_alone)
    s.finish()


def _nonblocking_round(s: Session, comm: Any) -> None:
    """all_reduce, then a group of send/recv around a ring, on ``comm``."""
    import cupy
    n, r = comm.world_size, comm.rank
    x = cupy.full(C, float(r + 1), dtype=cupy.float32)
    done(comm.all_reduce(x))
    assert bool(cupy.all(x == n * (n + 1) / 2)), float(x[0])
    a = cupy.full(B, float(r), dtype=cupy.float32)
    b = cupy.full(B, -1.0, dtype=cupy.float32)
    with comm.group():
        ws = comm.send(a, peer=(r + 1) % n)
        wr = comm.recv(b, peer=(r - 1) % n)
    done(ws)
    done(wr)
    assert bool(cupy.all(b == (r - 1) % n)), (b.tolist(), (r - 1) % n)


def chk_env_nonblocking_session(s: Session) -> None:
    assert os.environ.get("NCCL_COMM_BLOCKING") == "0", "the ranks did not inherit the variable"
    assert s.comm.nonblocking is True, (
        "ncclpy.init() under NCCL_COMM_BLOCKING=0 reports a blocking communicator")
    _nonblocking_round(s, s.comm)


def chk_env_nonblocking_init(s: Session) -> None:
    comm = s.ncclpy.init(name="env-nonblocking")
    try:
        assert comm.nonblocking is True, (
            "ncclpy.init() under NCCL_COMM_BLOCKING=0 reports a blocking communicator")
        _nonblocking_round(s, comm)
    finally:
        comm.close()
    assert comm.closed


def env_nonblocking(rank: int, outdir: str) -> None:
    """Run with NCCL_COMM_BLOCKING=0 in the environment (the session's own communicator is
    then nonblocking too)."""
    s = Session(rank, outdir, "envnb")
    s.check("env_nonblocking_session", chk_env_nonblocking_session)
    s.check("env_nonblocking_init", chk_env_nonblocking_init)
    s.finish()
