"""GPU checks of issue 25 (NCCL 2.27-2.32's host API, part 2) on two ranks, real NCCL: window
collectives against numpy's reference (CuPy and torch arrays in NCCL memory, the symmetric
flag, ``Config(cta_policy="zero")``), put/signal/wait between the two ranks, suspend/resume with
the memory statistics before and after, revoke then shrink without a failure.  A check whose
NCCL is too old, or whose machine gives no symmetric support (NCCL registers no window where
ranks share a GPU), records Skip with the reason.  The 3-rank jobs (shrink after a SIGKILLed
rank, grow 2 -> 3) are tests/gpu/_gpu_part2_job.py."""
from __future__ import annotations

from typing import Any

import numpy as np

from _gpu_common import Session, Skip, need_nccl

N = 1 << 12                       # elements per rank: 16 KiB of float32, 4 pages


def chk_window_collectives(s: Session) -> None:
    need_nccl(s, 22703, "ncclCommWindowRegister")
    import cupy
    n, r = s.n, s.rank
    x = s.ncclpy.nccl_empty(N, "float32")
    x[...] = cupy.arange(N, dtype=cupy.float32) % 7 + r
    g = s.ncclpy.nccl_empty(N * n, "float32")
    with s.comm.register_window(x) as wx, s.comm.register_window(g) as wg:
        s.comm.all_reduce(x).wait()
        s.comm.all_gather(x, g).wait()
        s.rec.write({"name": "_window_info", "ok": True, "rank": r,
                     "registered": [wx.registered, wg.registered]})
    base = np.arange(N, dtype=np.float32) % 7
    want = base * n + sum(range(n))
    assert np.array_equal(cupy.asnumpy(x), want), "all_reduce on a window"
    assert np.array_equal(cupy.asnumpy(g), np.tile(want, n)), "all_gather on a window"
    import torch                                   # the torch route: same memory, a tensor
    t = s.ncclpy.nccl_empty(64, "bfloat16", framework="torch")
    t.fill_(r + 1)
    with s.comm.register_window(t):
        s.comm.all_reduce(t).wait()
    assert bool((t == float(n * (n + 1) // 2)).all()) and t.dtype == torch.bfloat16


def chk_window_zero_cta(s: Session) -> None:
    need_nccl(s, 22803, "Config(cta_policy='zero') with windows (copy-engine collectives)")
    import cupy
    comm = s.ncclpy.init(name=f"zero{s.gen}", config=s.ncclpy.Config(cta_policy="zero"))
    try:
        x = s.ncclpy.nccl_empty(N, "float32")
        x[...] = s.rank + 1
        g = s.ncclpy.nccl_empty(N * s.n, "float32")
        with comm.register_window(x), comm.register_window(g):
            comm.all_gather(x, g).wait()
        want = np.repeat(np.arange(1, s.n + 1, dtype=np.float32), N)
        assert np.array_equal(cupy.asnumpy(g), want)
    finally:
        comm.close()


def chk_put_signal(s: Session) -> None:
    """Each rank puts its source window into the next rank's window, then signals it (index
    0: NCCL before 2.32 takes no other); the source lies in a symmetric window, as NCCL
    requires (enqueue.cc rmaTaskAppend)."""
    need_nccl(s, 22902, "ncclPutSignal")
    import cupy
    n, r = s.n, s.rank
    w = s.ncclpy.nccl_empty(N, "int32")
    w[...] = -1
    src = s.ncclpy.nccl_empty(N // 2, "int32")
    src[...] = cupy.arange(N // 2, dtype=cupy.int32) + 100 * r
    cupy.cuda.Device(s.dev).synchronize()
    with s.comm.register_window(w) as win, s.comm.register_window(src) as swin:
        if not (win.registered and swin.registered):
            raise Skip("NCCL registered no window here (no symmetric support on this "
                       "machine, e.g. ranks sharing one GPU): one-sided puts cannot run")
        peer = (r + 1) % n
        with s.comm.group():
            s.comm.put_signal(src, peer, win, offset=4 * (N // 2))
        s.comm.wait_signal([((r - 1) % n, 1)]).wait()             # (peer, count)
        s.comm.signal(peer).wait()
        s.comm.wait_signal({(r - 1) % n: 1}).wait()
        got = cupy.asnumpy(w)
    left = (r - 1) % n
    assert (got[:N // 2] == -1).all(), "the put wrote outside its offset"
    assert np.array_equal(got[N // 2:], np.arange(N // 2, dtype=np.int32) + 100 * left)


def chk_suspend_resume(s: Session) -> None:
    need_nccl(s, 22907, "ncclCommSuspend")
    import cupy
    x = cupy.ones(1 << 20, cupy.float32)
    s.comm.all_reduce(x).wait()
    before = s.comm.mem_stats()
    s.comm.suspend()
    during = s.comm.mem_stats()
    try:
        s.comm.all_reduce(x)
        raise AssertionError("a suspended communicator accepted a call")
    except s.ncclpy.NcclpyError as e:
        assert "suspended" in str(e)
    s.comm.resume()
    s.comm.all_reduce(x).wait()
    after = s.comm.mem_stats()
    s.rec.write({"name": "_mem_stats", "ok": True, "rank": s.rank, "before": before,
                 "during": during, "after": after})
    assert before["suspended"] == 0 and during["suspended"] == 1 and after["suspended"] == 0
    assert during["suspendable_bytes"] <= before["suspendable_bytes"]
    assert float(x[0]) == s.n ** 2


def chk_revoke_shrink(s: Session) -> None:
    """Every rank revokes; the last leaves (its close aborts the revoked communicator), the
    others shrink it out (NCCL refuses an empty exclude list) and reduce on the child."""
    need_nccl(s, 22807, "ncclCommRevoke")
    import cupy
    comm = s.ncclpy.init(name=f"rev{s.gen}")
    gone = s.n - 1
    try:
        x = cupy.ones(256, cupy.float32)
        comm.all_reduce(x).wait()
        comm.revoke()
        assert comm.state == "revoked"
        if s.rank != gone:
            child = comm.shrink([gone])
            try:
                y = cupy.full(256, s.rank + 1, cupy.float32)
                child.all_reduce(y).wait()
                assert child.world_size == s.n - 1 and child.rank == s.rank
                assert float(y[0]) == (s.n - 1) * s.n / 2
            finally:
                child.close()
    finally:
        comm.close()
    assert comm.state == "aborted"


def part2_worker(rank: int, outdir: str) -> Any:
    s = Session(rank, outdir, "part2")
    for name, fn in (("window_collectives", chk_window_collectives),
                     ("window_zero_cta", chk_window_zero_cta),
                     ("put_signal", chk_put_signal),
                     ("suspend_resume", chk_suspend_resume),
                     ("revoke_shrink", chk_revoke_shrink)):
        s.check(name, fn)
    s.finish()
