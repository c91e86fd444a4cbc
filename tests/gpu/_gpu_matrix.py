"""The collective x dtype x op matrix (one world size per spawn); see _gpu_common."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from _gpu_common import (ALL_DTYPES, B, C, DT, OPS, Session, Skip, a2a_data, dev_buf, done,
                         expected_reduce, gen, host, op_arg, same, sub, supported, tolerance,
                         uneven_count)


def _reduction(s: Session, dt: DT, op: str, run: Callable[[], Any]) -> bool:
    """True when the op/dtype pair must work (``_op_rules``: NCCL's and torch's rules, not
    ncclpy's); else assert ncclpy refuses it precisely.  A pair that must work and that ncclpy
    refuses fails the check where the caller runs it."""
    if dt.name.startswith("float8") and not s.fp8_reductions:
        raise Skip("FP8 reductions need compute capability >= 9.0")
    if supported(s, dt, op):
        return True
    try:
        run()
    except s.ncclpy.UnsupportedError:
        return False
    raise AssertionError(f"{op} on {dt.name} was accepted; expected UnsupportedError")


def chk_all_reduce(s: Session, dt: DT, op: str, inplace: bool) -> None:
    xs = [gen(dt, r, C, op) for r in range(s.n)]
    a, sb = dev_buf(s, dt, xs[s.rank])
    b, rb = dev_buf(s, dt, dt.sentinel(C))
    if not _reduction(s, dt, op, lambda: s.comm.all_reduce(sb, rb, op=op_arg(s, op))):
        return
    done(s.comm.all_reduce(sb, op=op_arg(s, op)) if inplace
         else s.comm.all_reduce(sb, rb, op=op_arg(s, op)))
    want = expected_reduce(dt, op, xs)
    same(dt, host(dt, a if inplace else b), want, "result", tolerance(dt, op, s.n))
    if not inplace:
        same(dt, host(dt, a), dt.decode(dt.encode(xs[s.rank])), "sendbuf changed")


def chk_reduce(s: Session, dt: DT, op: str, inplace: bool) -> None:
    root = s.n - 1
    xs = [gen(dt, r, C, op, salt=1) for r in range(s.n)]
    a, sb = dev_buf(s, dt, xs[s.rank])
    b, rb = dev_buf(s, dt, dt.sentinel(C))
    if not _reduction(s, dt, op, lambda: s.comm.reduce(sb, rb, root=root, op=op_arg(s, op))):
        return
    done(s.comm.reduce(sb, root=root, op=op_arg(s, op)) if inplace
         else s.comm.reduce(sb, rb, root=root, op=op_arg(s, op)))
    if s.rank == root:
        same(dt, host(dt, a if inplace else b), expected_reduce(dt, op, xs), "root result",
             tolerance(dt, op, s.n))
    elif not inplace:
        same(dt, host(dt, b), dt.decode(dt.encode(dt.sentinel(C))), "non-root recvbuf touched")


def chk_reduce_scatter(s: Session, dt: DT, op: str, inplace: bool) -> None:
    xs = [gen(dt, r, s.n * B, op, salt=2) for r in range(s.n)]
    a, sb = dev_buf(s, dt, xs[s.rank])
    b, rb = dev_buf(s, dt, dt.sentinel(B))
    if not _reduction(s, dt, op, lambda: s.comm.reduce_scatter(sb, rb, op=op_arg(s, op))):
        return
    done(s.comm.reduce_scatter(sb, op=op_arg(s, op)) if inplace
         else s.comm.reduce_scatter(sb, rb, op=op_arg(s, op)))
    want = expected_reduce(dt, op, xs)[s.rank * B:(s.rank + 1) * B]
    got = host(dt, a)[s.rank * B:(s.rank + 1) * B] if inplace else host(dt, b)
    same(dt, got, want, "block", tolerance(dt, op, s.n))


def chk_reduce_scatter_list(s: Session, dt: DT) -> None:
    if dt.name.startswith("float8") and not s.fp8_reductions:
        raise Skip("FP8 reductions need compute capability >= 9.0")
    xs = [gen(dt, r, s.n * B, "sum", salt=3) for r in range(s.n)]
    arrs = [dev_buf(s, dt, xs[s.rank][d * B:(d + 1) * B]) for d in range(s.n)]
    b, rb = dev_buf(s, dt, dt.sentinel(B))
    op = "sum" if dt.kind != "bool" else "max"
    done(s.comm.reduce_scatter([o for _, o in arrs], rb, op=op))
    same(dt, host(dt, b), expected_reduce(dt, op, xs)[s.rank * B:(s.rank + 1) * B], "block")


def chk_broadcast(s: Session, dt: DT, inplace: bool) -> None:
    root = s.n - 1
    xs = [gen(dt, r, C, salt=4) for r in range(s.n)]
    a, sb = dev_buf(s, dt, xs[s.rank])
    b, rb = dev_buf(s, dt, dt.sentinel(C))
    done(s.comm.broadcast(sb, root=root) if inplace else s.comm.broadcast(sb, rb, root=root))
    same(dt, host(dt, a if inplace else b), dt.decode(dt.encode(xs[root])), "result")


def chk_all_gather(s: Session, dt: DT, inplace: bool, as_list: bool = False) -> None:
    xs = [gen(dt, r, B, salt=5) for r in range(s.n)]
    want = dt.decode(dt.encode(np.concatenate(xs)))
    a, sb = dev_buf(s, dt, xs[s.rank])
    if as_list:
        outs = [dev_buf(s, dt, dt.sentinel(B)) for _ in range(s.n)]
        done(s.comm.all_gather(sb, [o for _, o in outs]))
        got = np.concatenate([host(dt, arr) for arr, _ in outs])
    elif inplace:
        init = dt.sentinel(s.n * B).astype(np.asarray(xs[0]).dtype)
        init[s.rank * B:(s.rank + 1) * B] = xs[s.rank]
        b, rb = dev_buf(s, dt, init)
        done(s.comm.all_gather(None, rb))
        got = host(dt, b)
    else:
        b, rb = dev_buf(s, dt, dt.sentinel(s.n * B))
        done(s.comm.all_gather(sb, rb))
        got = host(dt, b)
    same(dt, got, want, "gathered")


def chk_all_to_all(s: Session, dt: DT, inplace: bool, as_list: bool = False) -> None:
    blocks = [a2a_data(dt, s.rank, d, B) for d in range(s.n)]
    want = dt.decode(dt.encode(np.concatenate([a2a_data(dt, src, s.rank, B)
                                               for src in range(s.n)])))
    if as_list:
        ins = [dev_buf(s, dt, blk) for blk in blocks]
        outs = [dev_buf(s, dt, dt.sentinel(B)) for _ in range(s.n)]
        done(s.comm.all_to_all([o for _, o in ins], [o for _, o in outs]))
        same(dt, np.concatenate([host(dt, arr) for arr, _ in outs]), want, "received (lists)")
        return
    a, sb = dev_buf(s, dt, np.concatenate(blocks))
    if inplace:
        done(s.comm.all_to_all(sb))
        same(dt, host(dt, a), want, "received in place")
    else:
        b, rb = dev_buf(s, dt, dt.sentinel(s.n * B))
        done(s.comm.all_to_all(sb, rb))
        same(dt, host(dt, b), want, "received")


def chk_all_to_all_uneven(s: Session, dt: DT) -> None:
    send_counts = [uneven_count(s.rank, d) for d in range(s.n)]
    recv_counts = [uneven_count(src, s.rank) for src in range(s.n)]
    send = np.concatenate([a2a_data(dt, s.rank, d, send_counts[d]) for d in range(s.n)])
    want = dt.decode(dt.encode(np.concatenate([a2a_data(dt, src, s.rank, recv_counts[src])
                                               for src in range(s.n)])))
    a, sb = dev_buf(s, dt, send)
    b, rb = dev_buf(s, dt, dt.sentinel(sum(recv_counts)))
    done(s.comm.all_to_all(sb, rb, send_counts=send_counts, recv_counts=recv_counts))
    same(dt, host(dt, b), want, f"received (send {send_counts}, recv {recv_counts})")


def chk_gather(s: Session, dt: DT, inplace: bool, as_list: bool = False) -> None:
    root = s.n - 1
    xs = [gen(dt, r, B, salt=6) for r in range(s.n)]
    want = dt.decode(dt.encode(np.concatenate(xs)))
    a, sb = dev_buf(s, dt, xs[s.rank])
    if s.rank != root:
        done(s.comm.gather(sb, None, root=root))
        return
    if as_list:
        outs = [dev_buf(s, dt, dt.sentinel(B)) for _ in range(s.n)]
        done(s.comm.gather(sb, [o for _, o in outs], root=root))
        got = np.concatenate([host(dt, arr) for arr, _ in outs])
    elif inplace:  # NCCL's in-place rule: sendbuff == recvbuff + root*count
        init = dt.sentinel(s.n * B).astype(np.asarray(xs[0]).dtype)
        init[root * B:(root + 1) * B] = xs[root]
        b, rb = dev_buf(s, dt, init)
        done(s.comm.gather(sub(s, dt, b, root * B, (root + 1) * B), rb, root=root))
        got = host(dt, b)
    else:
        b, rb = dev_buf(s, dt, dt.sentinel(s.n * B))
        done(s.comm.gather(sb, rb, root=root))
        got = host(dt, b)
    same(dt, got, want, "gathered on root")


def chk_scatter(s: Session, dt: DT, inplace: bool, as_list: bool = False) -> None:
    root = s.n - 1
    full = gen(dt, root, s.n * B, salt=7)
    want = dt.decode(dt.encode(full[s.rank * B:(s.rank + 1) * B]))
    b, rb = dev_buf(s, dt, dt.sentinel(B))
    if s.rank != root:
        done(s.comm.scatter(None, rb, root=root))
        same(dt, host(dt, b), want, "scattered block")
        return
    if as_list:
        ins = [dev_buf(s, dt, full[d * B:(d + 1) * B]) for d in range(s.n)]
        done(s.comm.scatter([o for _, o in ins], rb, root=root))
        same(dt, host(dt, b), want, "root block (lists)")
        return
    a, sb = dev_buf(s, dt, full)
    if inplace:  # NCCL's in-place rule: recvbuff == sendbuff + root*count
        done(s.comm.scatter(sb, sub(s, dt, a, root * B, (root + 1) * B), root=root))
        same(dt, host(dt, a), dt.decode(dt.encode(full)), "root sendbuf after in-place scatter")
    else:
        done(s.comm.scatter(sb, rb, root=root))
        same(dt, host(dt, b), want, "root block")


def chk_send_recv(s: Session, dt: DT) -> None:
    if s.n < 2:
        raise Skip("needs 2 ranks")
    nxt, prv = (s.rank + 1) % s.n, (s.rank - 1) % s.n
    a, sb = dev_buf(s, dt, a2a_data(dt, s.rank, nxt, C))
    b, rb = dev_buf(s, dt, dt.sentinel(C))
    done(s.comm.send_recv(sb, rb, nxt, prv))
    same(dt, host(dt, b), dt.decode(dt.encode(a2a_data(dt, prv, s.rank, C))), "ring shift")


def chk_send_then_recv(s: Session, dt: DT) -> None:
    if s.n < 2:
        raise Skip("needs 2 ranks")
    pairs = s.n - s.n % 2
    if s.rank >= pairs:
        return
    if s.rank % 2 == 0:
        a, sb = dev_buf(s, dt, a2a_data(dt, s.rank, s.rank + 1, B))
        done(s.comm.send(sb, s.rank + 1))
    else:
        b, rb = dev_buf(s, dt, dt.sentinel(B))
        done(s.comm.recv(rb, s.rank - 1))
        same(dt, host(dt, b), dt.decode(dt.encode(a2a_data(dt, s.rank - 1, s.rank, B))),
             "received")


def chk_zero_size(s: Session) -> None:
    import cupy
    e = cupy.empty(0, dtype=cupy.float32)
    f = cupy.empty(0, dtype=cupy.float32)
    c = s.comm
    root = s.n - 1
    works = [c.all_reduce(e), c.all_reduce(e, f, op="max"), c.reduce(e, f, root=root),
             c.broadcast(e, f, root=root), c.all_gather(e, f), c.reduce_scatter(e, f),
             c.all_to_all(e, f), c.gather(e, f if s.rank == root else None, root=root),
             c.scatter(e if s.rank == root else None, f, root=root)]
    if s.n > 1:
        works.append(c.send_recv(e, f, (s.rank + 1) % s.n, (s.rank - 1) % s.n))
    for w in works:
        done(w)


def chk_groups(s: Session) -> None:
    import cupy
    ncclpy = s.ncclpy
    x = cupy.full(C, float(s.rank + 1), dtype=cupy.float32)
    y = cupy.full(C, 2.0 * (s.rank + 1), dtype=cupy.float32)
    total = s.n * (s.n + 1) / 2
    with s.comm.group():
        w1 = s.comm.all_reduce(x)
        w2 = s.comm.all_reduce(y, op=ncclpy.premul_sum(0.5))
        try:
            w1.wait()
            raise AssertionError("waiting inside a group should raise")
        except ncclpy.NcclpyError:
            pass
    done(w1)
    done(w2)
    assert float(x[0]) == total and bool(cupy.all(x == total)), x
    assert bool(cupy.all(y == total)), y
    # the block raises: the group still ends (the op runs) and the block's error propagates
    z = cupy.full(C, 1.0, dtype=cupy.float32)
    try:
        with ncclpy.group():
            with s.comm.group():
                wz = s.comm.all_reduce(z)
            raise KeyError("boom")
    except KeyError:
        pass
    else:
        raise AssertionError("the block's KeyError did not propagate")
    done(wz)
    assert bool(cupy.all(z == s.n)), z
    # and the communicator still works
    done(s.comm.all_reduce(z, op="max"))
    assert bool(cupy.all(z == s.n))


def chk_barrier(s: Session) -> None:
    w = s.comm.barrier()
    assert w.is_completed()


def chk_fallback(s: Session, dt: DT) -> None:
    s.comm.force_fallback = True
    try:
        chk_gather(s, dt, False)
        chk_scatter(s, dt, False)
        chk_all_to_all(s, dt, False)
        chk_all_to_all(s, dt, True)
    finally:
        s.comm.force_fallback = False


def matrix(rank: int, outdir: str) -> None:
    """Every collective x dtype x op, in place and out of place, on one world size."""
    s = Session(rank, outdir, "matrix")
    for name in ALL_DTYPES:
        dt = DT(name)
        for op in OPS:
            for inplace in (False, True):
                mode = "inplace" if inplace else "outofplace"
                s.check(f"all_reduce/{name}/{op}/{mode}", chk_all_reduce, dt, op, inplace)
                s.check(f"reduce/{name}/{op}/{mode}", chk_reduce, dt, op, inplace)
                s.check(f"reduce_scatter/{name}/{op}/{mode}", chk_reduce_scatter, dt, op,
                        inplace)
        for inplace in (False, True):
            mode = "inplace" if inplace else "outofplace"
            s.check(f"broadcast/{name}/{mode}", chk_broadcast, dt, inplace)
            s.check(f"all_gather/{name}/{mode}", chk_all_gather, dt, inplace)
            s.check(f"all_to_all/{name}/{mode}", chk_all_to_all, dt, inplace)
            s.check(f"gather/{name}/{mode}", chk_gather, dt, inplace)
            s.check(f"scatter/{name}/{mode}", chk_scatter, dt, inplace)
        s.check(f"all_gather/{name}/list", chk_all_gather, dt, False, True)
        s.check(f"reduce_scatter/{name}/list", chk_reduce_scatter_list, dt)
        s.check(f"all_to_all/{name}/list", chk_all_to_all, dt, False, True)
        s.check(f"all_to_all/{name}/uneven", chk_all_to_all_uneven, dt)
        s.check(f"gather/{name}/list", chk_gather, dt, False, True)
        s.check(f"scatter/{name}/list", chk_scatter, dt, False, True)
        s.check(f"send_recv/{name}", chk_send_recv, dt)
        s.check(f"send+recv/{name}", chk_send_then_recv, dt)
    for name in ("float32", "int8", "bfloat16", "complex128"):
        s.check(f"fallback/{name}", chk_fallback, DT(name))
    s.check("zero_size", chk_zero_size)
    s.check("groups", chk_groups)
    s.check("barrier", chk_barrier)
    s.finish()
