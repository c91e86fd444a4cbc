"""Planning (pure, no GPU): every collective x dtype x op, in place and out of place, world sizes
1..4, even/uneven all_to_all, native vs send/recv paths by NCCL version.

Buffers are BufferSpecs with made-up device pointers: planning never dereferences them.
"""
from __future__ import annotations

import itertools

import pytest

import ncclpy
from ncclpy.semantics import registry
from ncclpy.buffers.buffer import Buffer, BufferSpec, as_buffer
from ncclpy.semantics.dtypes import DTYPES, LOGICAL
from ncclpy.errors import UnsupportedError
from ncclpy.semantics.ops import NCCL_OPS, premul_sum
from ncclpy.plan.collectives import (plan_all_gather, plan_all_reduce, plan_all_to_all,
                                     plan_barrier, plan_broadcast, plan_call, plan_gather,
                                     plan_recv, plan_reduce, plan_reduce_scatter, plan_scatter,
                                     plan_send, plan_send_recv)
from ncclpy.semantics.scalars import encode_scalar
from ncclpy.plan.types import PREMUL_OP, Copy, NcclCall, Plan, PlanContext, Scratch

DTYPE_NAMES = list(DTYPES) + ["bool", "complex32", "complex64", "complex128"]
WORLD = [1, 2, 3, 4]
SEND, RECV, OTHER = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000
NEW, OLD = 22800, 22703


def B(ptr: int, count: int, dtype: str = "float32", device: int = 0) -> BufferSpec:
    return as_buffer(Buffer(ptr, count, dtype, device))


def ctx(rank: int, n: int, ver: int = 23203, ff: bool = False, **kw) -> PlanContext:
    return PlanContext(rank, n, 0, ver, ff, **kw)


def isz(dt: str) -> int:
    return LOGICAL[dt].itemsize


def wc(dt: str, n: int) -> int:
    """NCCL (wire) count of n logical elements."""
    return n * LOGICAL[dt].factor


def enum(dt: str) -> int:
    return LOGICAL[dt].wire.nccl


def ops_for(dt: str, n: int = 2):
    """(op given, expected NCCL op arg, expected premul scalar bytes or None) on ``n`` ranks
    (float8 avg and premul_sum are refused on one rank: test_one_rank_float8_refusal)."""
    lg = LOGICAL[dt]
    allowed = lg.ops if lg.ops is not None else set(NCCL_OPS) | {"premul_sum"}
    if n == 1 and lg.wire.name.startswith("float8"):
        allowed = allowed - {"avg", "premul_sum"}
    out = []
    for name in ("sum", "prod", "max", "min", "avg"):
        if name in allowed:
            eff = (lg.op_map or {}).get(name, name)
            out.append((name, NCCL_OPS[eff], None))
    if "premul_sum" in allowed:
        out.append((premul_sum(3), PREMUL_OP, encode_scalar(3, lg.wire.name)))
    return out


def ranks(n: int):
    return sorted({0, n - 1, n // 2})


def check_premul(plan: Plan, dt: str, premul) -> None:
    if premul is None:
        assert plan.premul is None
    else:
        assert plan.premul.scalar == premul and plan.premul.datatype == enum(dt)


# -- reductions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_all_reduce(dt, n):
    for rank, (op, opv, pre), in_place in itertools.product(ranks(n), ops_for(dt, n), (0, 1)):
        c = ctx(rank, n)
        p = plan_all_reduce(c, B(SEND, 7, dt), None if in_place else B(RECV, 7, dt), op=op)
        rp = SEND if in_place else RECV
        assert p.steps == (NcclCall("AllReduce", (SEND, rp, wc(dt, 7), enum(dt), opv)),)
        assert not p.group and p.path == "native" and p.scratch_bytes == 0
        assert p.meta["in_place"] == bool(in_place) and p.nbytes == 7 * isz(dt)
        check_premul(p, dt, pre)
    # recvbuf given as the very same buffer: in place
    p = plan_all_reduce(ctx(0, n), B(SEND, 7, dt), B(SEND, 7, dt))
    assert p.meta["in_place"] and p.calls[0].args[:2] == (SEND, SEND)


@pytest.mark.parametrize("dt", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("op", ["avg", premul_sum(0.5)])
def test_one_rank_float8_refusal(dt, op):
    """NCCL's one-rank path has no float8 PreMulSum kernel (ncclInvalidArgument on an H100,
    NCCL 2.28.9): refused precisely when planning on 1 rank, planned on 2."""
    for plan in (lambda c: plan_all_reduce(c, B(SEND, 7, dt), op=op),
                 lambda c: plan_reduce(c, B(SEND, 7, dt), root=0, op=op),
                 lambda c: plan_reduce_scatter(c, B(SEND, 7 * c.world_size, dt), op=op)):
        with pytest.raises(UnsupportedError, match=r"1-rank communicator.*ncclLaunchOneRank"
                                                   r".*2 or more ranks"):
            plan(ctx(0, 1))
        assert plan(ctx(0, 2)).steps
    # the other ops stay plain copies on one rank
    assert plan_all_reduce(ctx(0, 1), B(SEND, 7, dt), op="max").steps


@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_reduce(dt, n):
    for rank, root, (op, opv, pre) in itertools.product(ranks(n), ranks(n), ops_for(dt, n)):
        for in_place in (0, 1):
            p = plan_reduce(ctx(rank, n), B(SEND, 5, dt), None if in_place else B(RECV, 5, dt),
                            root=root, op=op)
            rp = SEND if in_place else RECV
            assert p.steps == (NcclCall("Reduce", (SEND, rp, wc(dt, 5), enum(dt), opv, root)),)
            assert not p.group and p.meta["root"] == root
            check_premul(p, dt, pre)


@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_broadcast(dt, n):
    for rank, root in itertools.product(ranks(n), ranks(n)):
        c = ctx(rank, n)
        p = plan_broadcast(c, B(SEND, 6, dt), B(RECV, 6, dt), root=root)
        assert p.steps == (NcclCall("Broadcast", (SEND, RECV, wc(dt, 6), enum(dt), root)),)
        assert not p.meta["in_place"]
        for p in (plan_broadcast(c, B(SEND, 6, dt), root=root),
                  plan_broadcast(c, None, B(SEND, 6, dt), root=root)):
            assert p.steps == (NcclCall("Broadcast", (SEND, SEND, wc(dt, 6), enum(dt), root)),)
            assert p.meta["in_place"] and p.premul is None


# -- all_gather / reduce_scatter -----------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_all_gather(dt, n):
    k, e = 3, isz(dt)
    for rank in ranks(n):
        c = ctx(rank, n)
        out = plan_all_gather(c, B(SEND, k, dt), B(RECV, n * k, dt))
        assert out.steps == (NcclCall("AllGather", (SEND, RECV, wc(dt, k), enum(dt))),)
        assert not out.meta["in_place"] and out.nbytes == n * k * e
        # in place: sendbuf None, or sendbuf exactly block `rank` of recvbuf
        blk = RECV + rank * k * e
        for p in (plan_all_gather(c, None, B(RECV, n * k, dt)),
                  plan_all_gather(c, B(blk, k, dt), B(RECV, n * k, dt))):
            assert p.steps == (NcclCall("AllGather", (blk, RECV, wc(dt, k), enum(dt))),)
            assert p.meta["in_place"]
        # list of adjacent views -> the single call
        adj = [B(RECV + i * k * e, k, dt) for i in range(n)]
        assert plan_all_gather(c, B(SEND, k, dt), adj).steps == out.steps
        # list of separate buffers -> AllGather into scratch, then one Copy per block
        sep = [B(OTHER + i * 0x10000, k, dt) for i in range(n)]
        p = plan_all_gather(c, B(SEND, k, dt), sep)
        if n == 1:   # one entry is always "adjacent"
            assert p.steps == (NcclCall("AllGather", (SEND, OTHER, wc(dt, k), enum(dt))),)
            continue
        assert p.path == "staged" and p.scratch_bytes == n * k * e and not p.group
        assert p.steps == (NcclCall("AllGather", (SEND, Scratch(0), wc(dt, k), enum(dt))),
                           *[Copy(OTHER + i * 0x10000, Scratch(i * k * e), k * e)
                             for i in range(n)])
        # in place on a separate list: the own block is not copied back onto itself
        p = plan_all_gather(c, None, sep)
        assert p.calls[0].args[0] == sep[rank].ptr and p.meta["in_place"]
        assert [s.dst for s in p.steps[1:]] == [b.ptr for i, b in enumerate(sep) if i != rank]


@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_reduce_scatter(dt, n):
    k, e = 4, isz(dt)
    for rank, (op, opv, pre) in itertools.product(ranks(n), ops_for(dt, n)):
        c = ctx(rank, n)
        p = plan_reduce_scatter(c, B(SEND, n * k, dt), B(RECV, k, dt), op=op)
        assert p.steps == (NcclCall("ReduceScatter", (SEND, RECV, wc(dt, k), enum(dt), opv)),)
        check_premul(p, dt, pre)
        assert p.nbytes == n * k * e and not p.meta["in_place"]
        blk = SEND + rank * k * e
        for p in (plan_reduce_scatter(c, B(SEND, n * k, dt), op=op),
                  plan_reduce_scatter(c, B(SEND, n * k, dt), B(blk, k, dt), op=op)):
            assert p.steps == (NcclCall("ReduceScatter", (SEND, blk, wc(dt, k), enum(dt), opv)),)
            assert p.meta["in_place"]
        adj = [B(SEND + i * k * e, k, dt) for i in range(n)]
        p = plan_reduce_scatter(c, adj, B(RECV, k, dt), op=op)
        assert p.steps == (NcclCall("ReduceScatter", (SEND, RECV, wc(dt, k), enum(dt), opv)),)
        sep = [B(OTHER + i * 0x10000, k, dt) for i in range(n)]
        p = plan_reduce_scatter(c, sep, B(RECV, k, dt), op=op)
        if n == 1:
            assert p.steps == (NcclCall("ReduceScatter", (OTHER, RECV, wc(dt, k), enum(dt),
                                                          opv)),)
            continue
        assert p.path == "staged" and p.scratch_bytes == n * k * e
        assert p.steps == (*[Copy(Scratch(i * k * e), OTHER + i * 0x10000, k * e)
                             for i in range(n)],
                           NcclCall("ReduceScatter", (Scratch(0), RECV, wc(dt, k), enum(dt),
                                                      opv)))
        check_premul(p, dt, pre)
        p = plan_reduce_scatter(c, sep, op=op)   # in place: into sendbuf[rank]
        assert p.calls[0].args[1] == sep[rank].ptr and p.meta["in_place"]


# -- all_to_all ----------------------------------------------------------------------------------
def _a2a_p2p_expect(n, rank, dt, sptrs, rptrs, scounts, rcounts, own_src=None):
    e = isz(dt)
    steps = []
    if scounts[rank] and (own_src or sptrs[rank]) != rptrs[rank]:
        steps.append(Copy(rptrs[rank], own_src or sptrs[rank], scounts[rank] * e))
    for p in range(n):
        if p == rank:
            continue
        if scounts[p]:
            steps.append(NcclCall("Send", (sptrs[p], wc(dt, scounts[p]), enum(dt), p)))
        if rcounts[p]:
            steps.append(NcclCall("Recv", (rptrs[p], wc(dt, rcounts[p]), enum(dt), p)))
    return tuple(steps)


@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_all_to_all_even(dt, n):
    k, e = 2, isz(dt)
    for rank in ranks(n):
        # native where NCCL >= 2.28
        p = plan_all_to_all(ctx(rank, n, NEW), B(SEND, n * k, dt), B(RECV, n * k, dt))
        assert p.steps == (NcclCall("AlltoAll", (SEND, RECV, wc(dt, k), enum(dt))),)
        assert p.path == "native" and not p.group and p.nbytes == n * k * e
        # grouped send/recv on older NCCL and with force_fallback
        for c in (ctx(rank, n, OLD), ctx(rank, n, NEW, ff=True)):
            p = plan_all_to_all(c, B(SEND, n * k, dt), B(RECV, n * k, dt))
            blocks_s = [SEND + i * k * e for i in range(n)]
            blocks_r = [RECV + i * k * e for i in range(n)]
            assert p.steps == _a2a_p2p_expect(n, rank, dt, blocks_s, blocks_r, [k] * n, [k] * n)
            assert p.group == (n > 1) and p.path == "p2p" and p.meta["via"] == "p2p"
        # in place: staged through scratch
        p = plan_all_to_all(ctx(rank, n, NEW), B(SEND, n * k, dt))
        assert p.steps == (Copy(Scratch(0), SEND, n * k * e),
                           NcclCall("AlltoAll", (Scratch(0), SEND, wc(dt, k), enum(dt))))
        assert p.path == "staged" and p.scratch_bytes == n * k * e and p.meta["in_place"]
        p2 = plan_all_to_all(ctx(rank, n, NEW), B(SEND, n * k, dt), B(SEND, n * k, dt))
        assert p2.steps == p.steps
        p = plan_all_to_all(ctx(rank, n, OLD), B(SEND, n * k, dt))
        scr = [Scratch(i * k * e) for i in range(n)]
        body = _a2a_p2p_expect(n, rank, dt, scr, [SEND + i * k * e for i in range(n)],
                               [k] * n, [k] * n, own_src=SEND + rank * k * e)
        assert p.steps == (Copy(Scratch(0), SEND, n * k * e), *body)
        assert p.path == "staged" and p.meta["via"] == "p2p"


UNEVEN = {  # world size -> (send_counts of rank r, recv_counts of rank r) built from a matrix
    n: [[(3 * s + 2 * d + 1) % 4 for d in range(n)] for s in range(n)] for n in WORLD}


@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", ["float32", "bfloat16", "complex128", "bool", "int64"])
def test_all_to_all_uneven(dt, n):
    m = UNEVEN[n]                  # m[s][d]: elements rank s sends to rank d
    e = isz(dt)
    for rank in range(n):
        sc = m[rank]
        rc = [m[s][rank] for s in range(n)]
        sd = [sum(sc[:i]) for i in range(n)]
        rd = [sum(rc[:i]) for i in range(n)]
        for ver in (OLD, NEW):     # uneven: always grouped send/recv
            p = plan_all_to_all(ctx(rank, n, ver), B(SEND, sum(sc), dt), B(RECV, sum(rc), dt),
                                send_counts=sc, recv_counts=rc)
            assert p.steps == _a2a_p2p_expect(n, rank, dt, [SEND + d * e for d in sd],
                                              [RECV + d * e for d in rd], sc, rc)
            assert p.meta["send_counts"] == sc and p.meta["recv_counts"] == rc
            assert p.nbytes == max(sum(sc), sum(rc)) * e
            zero = [q for q in range(n) if q != rank and sc[q] == 0]
            sends = {c.arg("peer") for c in p.calls if c.fn == "Send"}
            assert not sends & set(zero)            # zero-count pairs are skipped
        if sum(sc) == sum(rc):                        # in place, uneven
            p = plan_all_to_all(ctx(rank, n, NEW), B(SEND, sum(sc), dt), None,
                                send_counts=sc, recv_counts=rc)
            body = _a2a_p2p_expect(n, rank, dt, [Scratch(d * e) for d in sd],
                                   [SEND + d * e for d in rd], sc, rc,
                                   own_src=Scratch(sd[rank] * e))
            if sd[rank] == rd[rank]:
                body = tuple(s for s in body if not isinstance(s, Copy))
            stage = (Copy(Scratch(0), SEND, sum(sc) * e),) if sum(sc) else ()
            assert p.steps == stage + body


def test_all_to_all_counts_one_side():
    # send_counts only: recvbuf split evenly; uniform explicit counts still use send/recv
    p = plan_all_to_all(ctx(0, 2, NEW), B(SEND, 4), B(RECV, 4), send_counts=[2, 2])
    assert p.path == "p2p" and p.group
    assert p.steps == (Copy(RECV, SEND, 8), NcclCall("Send", (SEND + 8, 2, 7, 1)),
                       NcclCall("Recv", (RECV + 8, 2, 7, 1)))
    p = plan_all_to_all(ctx(1, 2, NEW), B(SEND, 4), B(RECV, 6), recv_counts=[4, 2])
    assert p.steps == (Copy(RECV + 16, SEND + 8, 8), NcclCall("Send", (SEND, 2, 7, 0)),
                       NcclCall("Recv", (RECV, 4, 7, 0)))


@pytest.mark.parametrize("n", WORLD)
def test_all_to_all_lists(n):
    dt, k = "float16", 3
    for rank in range(n):
        sl = [B(SEND + i * 0x1000, k + i, dt) for i in range(n)]   # uneven through the lists
        rl = [B(RECV + i * 0x1000, k + rank, dt) for i in range(n)]
        for ver in (OLD, NEW):
            p = plan_all_to_all(ctx(rank, n, ver), sl, rl)
            assert p.steps == _a2a_p2p_expect(n, rank, dt, [b.ptr for b in sl],
                                              [b.ptr for b in rl], [b.count for b in sl],
                                              [b.count for b in rl])
            assert p.path == "p2p"
        # mixed: list send, single recv (even)
        sl = [B(SEND + i * 0x1000, k, dt) for i in range(n)]
        p = plan_all_to_all(ctx(rank, n, NEW), sl, B(RECV, n * k, dt))
        assert p.steps == _a2a_p2p_expect(n, rank, dt, [b.ptr for b in sl],
                                          [RECV + i * k * 2 for i in range(n)], [k] * n, [k] * n)
        # in place on a list: staged copies of each entry
        p = plan_all_to_all(ctx(rank, n, NEW), sl)
        assert p.steps[:n] == tuple(Copy(Scratch(i * k * 2), b.ptr, k * 2)
                                    for i, b in enumerate(sl))
        assert p.scratch_bytes == n * k * 2 and p.path == "staged"
        assert all(c.arg("sendbuff") == Scratch(c.arg("peer") * k * 2)
                   for c in p.calls if c.fn == "Send")


# -- gather / scatter ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_gather(dt, n):
    k, e = 3, isz(dt)
    for rank, root in itertools.product(ranks(n), ranks(n)):
        for ver, ff in ((NEW, False), (OLD, False), (NEW, True)):
            c = ctx(rank, n, ver, ff)
            native = ver >= NEW and not ff
            if rank != root:
                p = plan_gather(c, B(SEND, k, dt), None, root=root)
                if native:
                    assert p.steps == (NcclCall("Gather", (SEND, SEND, wc(dt, k), enum(dt),
                                                           root)),)
                else:
                    assert p.steps == (NcclCall("Send", (SEND, wc(dt, k), enum(dt), root)),)
                    assert p.group and p.path == "p2p"
                continue
            blk = RECV + root * k * e
            for sb, inpl in ((B(SEND, k, dt), False), (None, True), (B(blk, k, dt), True)):
                p = plan_gather(c, sb, B(RECV, n * k, dt), root=root)
                sp = SEND if not inpl else blk
                assert p.meta["in_place"] == inpl
                if native:
                    assert p.steps == (NcclCall("Gather", (sp, RECV, wc(dt, k), enum(dt),
                                                           root)),)
                    assert p.path == "native"
                else:
                    exp = [] if inpl else [Copy(blk, SEND, k * e)]
                    exp += [NcclCall("Recv", (RECV + q * k * e, wc(dt, k), enum(dt), q))
                            for q in range(n) if q != root]
                    assert p.steps == tuple(exp) and p.path == "p2p"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gather_lists(n):
    dt, k, e = "int32", 5, 4
    root = n - 1
    sep = [B(OTHER + i * 0x1000, k, dt) for i in range(n)]
    adj = [B(RECV + i * k * e, k, dt) for i in range(n)]
    c_new, c_old = ctx(root, n, NEW), ctx(root, n, OLD)
    assert plan_gather(c_new, B(SEND, k, dt), adj, root).steps == \
        plan_gather(c_new, B(SEND, k, dt), B(RECV, n * k, dt), root).steps
    p = plan_gather(c_new, B(SEND, k, dt), sep, root)
    assert p.steps == (NcclCall("Gather", (SEND, Scratch(0), k, 2, root)),
                       *[Copy(b.ptr, Scratch(i * k * e), k * e) for i, b in enumerate(sep)])
    assert p.path == "staged" and p.scratch_bytes == n * k * e
    p = plan_gather(c_old, B(SEND, k, dt), sep, root)
    assert p.steps == (Copy(sep[root].ptr, SEND, k * e),
                       *[NcclCall("Recv", (b.ptr, k, 2, i)) for i, b in enumerate(sep)
                         if i != root])
    p = plan_gather(c_old, None, sep, root)        # in place on the list
    assert p.meta["in_place"] and not any(isinstance(s, Copy) for s in p.steps)


@pytest.mark.parametrize("n", WORLD)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_scatter(dt, n):
    k, e = 2, isz(dt)
    for rank, root in itertools.product(ranks(n), ranks(n)):
        for ver, ff in ((NEW, False), (OLD, False), (NEW, True)):
            c = ctx(rank, n, ver, ff)
            native = ver >= NEW and not ff
            if rank != root:
                p = plan_scatter(c, None, B(RECV, k, dt), root=root)
                if native:
                    assert p.steps == (NcclCall("Scatter", (RECV, RECV, wc(dt, k), enum(dt),
                                                            root)),)
                else:
                    assert p.steps == (NcclCall("Recv", (RECV, wc(dt, k), enum(dt), root)),)
                continue
            blk = SEND + root * k * e
            for rb, inpl in ((B(RECV, k, dt), False), (None, True), (B(blk, k, dt), True)):
                p = plan_scatter(c, B(SEND, n * k, dt), rb, root=root)
                rp = RECV if not inpl else blk
                assert p.meta["in_place"] == inpl and p.nbytes == n * k * e
                if native:
                    assert p.steps == (NcclCall("Scatter", (SEND, rp, wc(dt, k), enum(dt),
                                                            root)),)
                else:
                    exp = [] if inpl else [Copy(RECV, blk, k * e)]
                    exp += [NcclCall("Send", (SEND + q * k * e, wc(dt, k), enum(dt), q))
                            for q in range(n) if q != root]
                    assert p.steps == tuple(exp) and p.group == (n > 1)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_scatter_lists(n):
    dt, k, e = "float64", 2, 8
    root = 0
    sep = [B(OTHER + i * 0x1000, k, dt) for i in range(n)]
    p = plan_scatter(ctx(root, n, NEW), sep, B(RECV, k, dt), root)
    assert p.steps == (*[Copy(Scratch(i * k * e), b.ptr, k * e) for i, b in enumerate(sep)],
                       NcclCall("Scatter", (Scratch(0), RECV, k, 8, root)))
    p = plan_scatter(ctx(root, n, OLD), sep, B(RECV, k, dt), root)
    assert p.steps == (Copy(RECV, sep[root].ptr, k * e),
                       *[NcclCall("Send", (b.ptr, k, 8, i)) for i, b in enumerate(sep)
                         if i != root])
    adj = [B(SEND + i * k * e, k, dt) for i in range(n)]
    assert plan_scatter(ctx(root, n, NEW), adj, B(RECV, k, dt), root).steps == \
        (NcclCall("Scatter", (SEND, RECV, k, 8, root)),)


# -- point to point, barrier -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_send_recv(dt):
    c = ctx(1, 3)
    assert plan_send(c, B(SEND, 9, dt), 2).steps == \
        (NcclCall("Send", (SEND, wc(dt, 9), enum(dt), 2)),)
    assert plan_recv(c, B(RECV, 9, dt), 0).steps == \
        (NcclCall("Recv", (RECV, wc(dt, 9), enum(dt), 0)),)
    p = plan_send_recv(c, B(SEND, 9, dt), B(RECV, 9, dt), 2, 0)
    assert p.group and p.path == "p2p" and p.steps == (
        NcclCall("Send", (SEND, wc(dt, 9), enum(dt), 2)),
        NcclCall("Recv", (RECV, wc(dt, 9), enum(dt), 0)))
    p = plan_send_recv(c, B(SEND, 9, dt), B(RECV, 9, dt), 1, 1)   # self: fine, grouped
    assert [x.arg("peer") for x in p.calls] == [1, 1] and p.group
    ig = ctx(1, 3, in_group=True)                                  # self inside a user group
    assert plan_send(ig, B(SEND, 9, dt), 1).calls[0].arg("peer") == 1


def test_barrier():
    p = plan_barrier(ctx(0, 4), B(SEND, 1, "int32"))
    assert p.steps == (NcclCall("AllReduce", (SEND, SEND, 1, 2, 0)),) and p.nbytes == 0
    p = plan_barrier(ctx(0, 4), B(SEND, 1, "float32"))
    assert p.steps == (NcclCall("AllReduce", (SEND, SEND, 1, 7, 0)),)


# -- zero-size, registry, misc -------------------------------------------------------------------
def test_zero_size_buffers_plan():
    c, z = ctx(1, 2, NEW), (lambda p=0: B(p, 0))
    assert plan_all_reduce(c, z(), z()).calls[0].args == (0, 0, 0, 7, 0)
    assert plan_all_gather(c, z(), z()).calls[0].fn == "AllGather"
    assert plan_reduce_scatter(c, z(), z()).calls[0].arg("recvcount") == 0
    assert plan_all_to_all(c, z(SEND), z(RECV)).calls[0].arg("count") == 0
    assert plan_all_to_all(ctx(1, 2, OLD), z(SEND), z(RECV)).steps == ()
    assert plan_broadcast(c, z()).calls[0].arg("count") == 0
    assert plan_gather(c, z(), root=0).calls[0].fn == "Gather"
    assert plan_scatter(ctx(0, 2, NEW), z(), z(RECV), root=0).calls[0].fn == "Scatter"
    assert plan_send(c, z(), 0).calls[0].arg("count") == 0
    p = plan_all_gather(c, z(), [z(SEND), z(RECV)])
    assert p.scratch_bytes == 0 and len(p.steps) == 1


def test_registry_planners_resolve():
    c = ctx(0, 2)
    args = {
        "all_reduce": (B(SEND, 4),), "reduce": (B(SEND, 4),), "broadcast": (B(SEND, 4),),
        "all_gather": (B(SEND, 2), B(RECV, 4)), "reduce_scatter": (B(SEND, 4),),
        "all_to_all": (B(SEND, 4), B(RECV, 4)), "gather": (B(SEND, 2), B(RECV, 4)),
        "scatter": (B(SEND, 4), B(RECV, 2)), "send_recv": (B(SEND, 4), B(RECV, 4), 1, 1),
        "barrier": (B(SEND, 1, "int32"),)}
    assert set(args) == set(registry.COLLECTIVES)
    for name, a in args.items():
        p = registry.get(name).plan(c, *a)
        assert isinstance(p, Plan) and p.collective == name and p.calls
        assert plan_call(name, c, *a) == p
    assert plan_call("send", c, buf=B(SEND, 4), peer=1).calls[0].fn == "Send"
    assert plan_call("recv", c, B(RECV, 4), 1).calls[0].fn == "Recv"
    assert plan_call("AllReduce", c, B(SEND, 4)).collective == "all_reduce"


def test_planners_parse_raw_objects():
    """Planners accept anything as_buffer accepts (here: ncclpy.Buffer) and lists/tuples."""
    c = ctx(0, 2)
    p = plan_all_reduce(c, Buffer(SEND, 4, "float32", 0), Buffer(RECV, 4, "float32", 0))
    assert p.calls[0].args[:2] == (SEND, RECV)
    p = plan_all_gather(c, Buffer(SEND, 2), (Buffer(RECV, 2), Buffer(RECV + 8, 2)))
    assert p.steps == (NcclCall("AllGather", (SEND, RECV, 2, 7)),)


def test_unknown_device_buffers_accepted():
    """device -2 (a CAI object that does not say): left for the executor to resolve."""
    b = BufferSpec(SEND, 4, "float32", -2, (4,), "cai")
    assert plan_all_reduce(PlanContext(0, 2, 3), b).calls


def test_premul_on_complex_and_int():
    p = plan_all_reduce(ctx(0, 2), B(SEND, 4, "complex64"), op=premul_sum(0.25))
    assert p.premul.datatype == 7 and p.premul.scalar == encode_scalar(0.25, "float32")
    assert p.calls[0].arg("count") == 8 and p.calls[0].arg("op") is PREMUL_OP
    p = plan_all_reduce(ctx(0, 2), B(SEND, 4, "int64"), op=premul_sum(-3))
    assert p.premul.scalar == (-3).to_bytes(8, "little", signed=True)
    p = plan_reduce_scatter(ctx(0, 2), B(SEND, 4, "float8_e5m2"), op=ncclpy.premul_sum(1.5))
    assert p.premul.scalar == bytes([0x3E]) and p.premul.datatype == 11


# -- the planner's memos (wire types, reductions) never change an outcome -----------------------
def test_reduction_memo_tells_scalars_apart_to_the_bit():
    from ncclpy.plan.types import PREMUL_OP
    c = ctx(0, 2)
    pz = plan_all_reduce(c, B(SEND, 4), None, premul_sum(0.0))
    nz = plan_all_reduce(c, B(SEND, 4), None, premul_sum(-0.0))
    assert pz.premul.scalar == b"\x00\x00\x00\x00" and nz.premul.scalar == b"\x00\x00\x00\x80"
    assert pz.calls[0].arg("op") is PREMUL_OP
    again = plan_all_reduce(c, B(SEND, 4), None, premul_sum(-0.0))
    assert again.premul.scalar == nz.premul.scalar
    # the same op on another dtype or NCCL version is decided again
    assert plan_all_reduce(c, B(SEND, 4, "float16"), None, premul_sum(-0.0)).premul.scalar \
        == b"\x00\x80"
    with pytest.raises(ncclpy.errors.UnsupportedError, match="premul_sum"):
        plan_all_reduce(ctx(0, 2, ver=21000), B(SEND, 4), None, premul_sum(2.0))
    # bools are never taken for the int op codes they equal
    assert plan_all_reduce(c, B(SEND, 4), None, 1).calls[0].arg("op") == NCCL_OPS["prod"]
    with pytest.raises(ncclpy.errors.ArgumentTypeError):
        plan_all_reduce(c, B(SEND, 4), None, True)


def test_one_call_plans_equal_make_plan():
    from ncclpy.plan.checks import make_plan, one_call
    call = NcclCall("AllReduce", (SEND, SEND, 4, 7, 0))
    a = one_call("all_reduce", call, 16, {"in_place": True})
    b = make_plan("all_reduce", [call], nbytes=16, in_place=True)
    assert a == b and a.meta == b.meta and a.steps == (call,) and not a.group


def test_count_rule_is_filled_in_on_failure_only():
    with pytest.raises(ncclpy.errors.ArgumentError) as ei:
        plan_all_reduce(ctx(0, 2), B(SEND, 4), B(RECV, 5))
    assert str(ei.value) == ("all_reduce: recvbuf has 5 elements; expected the count of "
                             "sendbuf (4)")


def test_nccl_call_and_one_call_plan_equal_the_classes():
    from ncclpy.plan.checks import one_call
    from ncclpy.plan.types import nccl_call, one_call_plan
    args = (SEND, SEND, 4, 7, 0)
    c = nccl_call("AllReduce", args)
    assert type(c) is NcclCall and c == NcclCall("AllReduce", args) and c.arg("count") == 4
    p = one_call_plan("all_reduce", "AllReduce", args, 16, {"in_place": True})
    assert type(p) is Plan and p == one_call("all_reduce", c, 16, {"in_place": True})
    assert p.meta == {"in_place": True} and p.steps == (c,) and not p.group
    for make in (NcclCall, nccl_call):
        with pytest.raises(ValueError, match="unknown NCCL function"):
            make("AllReduceTwice", args)
        with pytest.raises(ValueError, match="takes 5 args"):
            make("AllReduce", args[:4])
    with pytest.raises(ValueError, match="takes 5 args"):
        one_call_plan("all_reduce", "AllReduce", args[:4], 16, {})
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.fn = "Reduce"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.nbytes = 0
