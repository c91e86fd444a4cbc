"""The resolver (CPU, no GPU, no communicator): a repeated call is served from the cache with the
exact NCCL arguments the planner gives, and every change that alters the outcome misses or
clears the cache.  Buffers are ncclpy.Buffer, plain ``__cuda_array_interface__`` objects and real
``cupy.ndarray`` objects over ``cupy.cuda.UnownedMemory`` at made-up addresses: nothing here
dereferences a pointer."""
from __future__ import annotations

import gc

import pytest

import ncclpy
from ncclpy import errors
from ncclpy.buffers.buffer import Buffer, as_buffer
from ncclpy.buffers.key import Uncacheable, buffer_key
from ncclpy.semantics.ops import premul_sum
from ncclpy.plan import collectives as pc
from ncclpy.plan.types import PlanContext
from ncclpy.comm.resolver import PLANNERS, Resolved, Resolver, first_buffer

S, R, O = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000
ST, ST2 = 0x51, 0x52
NEW, OLD = 23203, 22703
F32, F16, SUM, PROD, MAX = 7, 6, 0, 1, 2


def ctx(rank=0, n=2, ver=NEW, ff=False):
    return PlanContext(rank, n, 0, ver, ff)


def B(ptr=S, n=4, dt="float32", dev=0):
    return Buffer(ptr, n, dt, dev)


class Cai:
    """A plain __cuda_array_interface__ v3 producer (numba-like; no device attribute)."""

    def __init__(self, ptr=S, n=4, typestr="<f4", stream=None, **extra):
        self.__cuda_array_interface__ = dict(shape=(n,), typestr=typestr, data=(ptr, False),
                                             strides=None, version=3, **extra)
        if stream is not None:
            self.__cuda_array_interface__["stream"] = stream


def cupy_array(ptr=S, n=4, dtype="float32"):
    cupy = pytest.importorskip("cupy")
    mem = cupy.cuda.UnownedMemory(ptr, n * cupy.dtype(dtype).itemsize, None, 0)
    return cupy.ndarray((n,), dtype, cupy.cuda.MemoryPointer(mem, 0))


def ar(res, x, op="sum", stream=ST, recv=None):
    return res.resolve("all_reduce", stream, x, recv, (op,))


# -- what is resolved ------------------------------------------------------------------------
CALLS = [
    ("all_reduce", (B(), None, "sum")),
    ("all_reduce", (B(), B(R), "max")),
    ("reduce", (B(), None, 1, "prod")),
    ("broadcast", (B(), B(R), 0)),
    ("all_gather", (B(), B(R, 8))),
    ("all_gather", (None, B(R, 8))),
    ("reduce_scatter", (B(S, 8), B(R, 4), "sum")),
    ("all_to_all", (B(S, 8), B(R, 8), None, None)),
    ("all_to_all", (B(S, 8), B(R, 8), [4, 4], [4, 4])),
    ("all_to_all", (B(S, 8), B(R, 9), [3, 5], [3, 6])),
    ("gather", (B(), B(R, 8), 0)),
    ("scatter", (B(S, 8), B(R, 4), 0)),
    ("send_recv", (B(), B(R), 1, 1)),
    ("send", (B(), 1)),
    ("recv", (B(), 1)),
    ("barrier", (B(S, 1),)),
]


@pytest.mark.parametrize("name, args", CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CALLS)])
def test_resolved_call_is_the_planners_call(name, args):
    nbuf = len(PLANNERS[name][1])
    bufs, params = args[:nbuf], args[nbuf:]
    planner = PLANNERS[name][0]
    want = planner(ctx(), *[None if b is None else as_buffer(b) for b in bufs], *params)
    res = Resolver(ctx())
    r = res.resolve(name, ST, bufs[0], bufs[1] if nbuf > 1 else None, params)
    assert isinstance(r, Resolved) and r.stream == ST and not r.in_group
    assert r.plan == want and r.plan.meta == want.meta
    assert r.group == want.group
    if want.calls != want.steps or want.premul is not None:   # copies, an op to create
        assert r.calls is None
    else:
        assert r.calls == tuple((c.fn, c.args) for c in want.steps)
        for _fn, a in r.calls:        # final: nothing left for the executor to fill in
            assert all(type(v) is int for v in a)
    again = res.resolve(name, ST, bufs[0], bufs[1] if nbuf > 1 else None, params)
    assert again is r and res.misses == 1 and len(res) == 1


def test_plans_needing_the_full_executor_keep_their_plan():
    res = Resolver(ctx())
    r = ar(res, B(), op=premul_sum(0.5))             # a PreMulSum op to create per call
    assert r.calls is None and r.plan.premul is not None
    r = res.resolve("all_to_all", ST, B(S, 8), None, (None, None))   # in place: staged
    assert r.calls is None and r.plan.scratch_bytes == 32
    r = res.resolve("gather", ST, B(), [B(R), B(O)], (0,))            # a list: staged
    assert r.calls is None and r.plan.path == "staged"
    r = res.resolve("all_gather", ST, B(S), [B(R), B(O)], ())         # staged too
    assert r.calls is None and r.plan.scratch_bytes == 32


# -- every change misses ---------------------------------------------------------------------
def _arg(r):
    return r.calls[0][1] if r.calls else None


def test_pointer_count_dtype_and_recvbuf_changes_miss():
    res = Resolver(ctx())
    base = ar(res, B())
    assert _arg(base) == (S, S, 4, F32, SUM)
    assert _arg(ar(res, B(S + 16))) == (S + 16, S + 16, 4, F32, SUM)
    assert _arg(ar(res, B(S, 6))) == (S, S, 6, F32, SUM)
    assert _arg(ar(res, B(S, 4, "float16"))) == (S, S, 4, F16, SUM)
    assert _arg(ar(res, B(S, 4, "complex64"))) == (S, S, 8, F32, SUM)   # 2 floats each
    assert _arg(ar(res, B(), recv=B(R))) == (S, R, 4, F32, SUM)
    assert res.misses == 6 and ar(res, B()) is base


def test_device_change_is_refused_every_time():
    res = Resolver(ctx())
    ar(res, B())
    for _ in range(2):
        with pytest.raises(errors.ArgumentError, match="device 1"):
            ar(res, B(dev=1))
    assert len(res) == 1


@pytest.mark.parametrize("op, code", [("sum", SUM), ("prod", PROD), ("max", MAX), (3, 3),
                                      ("avg", 4)])
def test_op_changes_miss(op, code):
    res = Resolver(ctx())
    ar(res, B(), "sum")
    assert _arg(ar(res, B(), op))[-1] == code


def test_root_peer_and_counts_change_miss():
    res = Resolver(ctx(rank=0, n=4))
    r0 = res.resolve("reduce", ST, B(), None, (0, "sum"))
    r2 = res.resolve("reduce", ST, B(), None, (2, "sum"))
    assert _arg(r0)[-1] == 0 and _arg(r2)[-1] == 2 and r0 is not r2
    assert _arg(res.resolve("send", ST, B(), None, (1,)))[-1] == 1
    assert _arg(res.resolve("send", ST, B(), None, (3,)))[-1] == 3
    a = res.resolve("all_to_all", ST, B(S, 8), B(R, 8), ([2, 2, 2, 2], [2, 2, 2, 2]))
    b = res.resolve("all_to_all", ST, B(S, 8), B(R, 8), ([2, 1, 3, 2], [2, 2, 2, 2]))
    assert a.plan != b.plan and a.plan.meta["send_counts"] != b.plan.meta["send_counts"]
    assert res.resolve("all_to_all", ST, B(S, 8), B(R, 8), ((2, 2, 2, 2), [2, 2, 2, 2])) is a


def test_stream_changes_miss():
    res = Resolver(ctx())
    a, b = ar(res, B(), stream=ST), ar(res, B(), stream=ST2)
    assert (a.stream, b.stream) == (ST, ST2) and a is not b

    class Proto:
        def __cuda_stream__(self):
            return (0, ST2)
    assert ar(res, B(), stream=Proto()) is b


def test_premul_scalar_changes_miss_to_the_bit():
    res = Resolver(ctx())
    half = ar(res, B(), premul_sum(0.5))
    assert ar(res, B(), premul_sum(0.5)) is half
    two = ar(res, B(), premul_sum(2.0))
    assert two is not half and two.plan.premul.scalar != half.plan.premul.scalar
    pz, nz = ar(res, B(), premul_sum(0.0)), ar(res, B(), premul_sum(-0.0))
    assert pz is not nz and pz.plan.premul.scalar != nz.plan.premul.scalar   # the sign bit


def test_bool_and_float_arguments_are_not_taken_for_ints():
    res = Resolver(ctx())
    assert _arg(ar(res, B(), 1))[-1] == PROD
    with pytest.raises(errors.ArgumentTypeError):
        ar(res, B(), True)                       # == 1, but a bool is no reduction
    res.resolve("reduce", ST, B(), None, (0, "sum"))
    for bad in (False, 0.0):
        with pytest.raises(errors.ArgumentTypeError, match="root"):
            res.resolve("reduce", ST, B(), None, (bad, "sum"))


def test_numpy_int_root_is_resolved_in_full():
    np = pytest.importorskip("numpy")
    res = Resolver(ctx())
    r = res.resolve("reduce", ST, B(), None, (np.int64(1), "sum"))
    assert _arg(r)[-1] == 1 and len(res) == 0     # no cheap key: planned each time


def test_group_state_is_part_of_the_key():
    res = Resolver(ctx())
    send_self = ("send", ST, B(), None, (0,))
    with pytest.raises(errors.ArgumentError, match="inside a group"):
        res.resolve(*send_self)
    with ncclpy.group():
        r = res.resolve(*send_self)
        assert r.in_group and _arg(r) == (S, 4, F32, 0)
        assert res.resolve(*send_self) is r
    with pytest.raises(errors.ArgumentError, match="inside a group"):
        res.resolve(*send_self)                  # not served from the in-group entry
    a = ar(res, B())
    with ncclpy.group():
        b = ar(res, B())
    assert a is not b and b.in_group and a.calls == b.calls


# -- the context and the mode: changing them clears -----------------------------------------
def _fns(r):
    return [f for f, _ in r.calls]


def test_force_fallback_and_nccl_version_replan():
    res = Resolver(ctx(rank=1))                     # not the root: one call either way
    gather = ("gather", ST, B(), None, (0,))
    assert _fns(res.resolve(*gather)) == ["Gather"]
    gen = res.generation
    res.set_context(ctx(rank=1, ff=True))
    assert res.generation > gen and len(res) == 0
    p2p = res.resolve(*gather)
    assert _fns(p2p) == ["Send"] and p2p.group and p2p.plan.path == "p2p"
    res.set_context(ctx(rank=1))
    assert _fns(res.resolve(*gather)) == ["Gather"]
    res.set_context(ctx(rank=1, ver=OLD))
    assert _fns(res.resolve(*gather)) == ["Send"]
    res.set_context(ctx(ver=20900))   # bfloat16 needs NCCL >= 2.10
    with pytest.raises(errors.UnsupportedError, match="bfloat16"):
        ar(res, B(dt="bfloat16"))


def test_force_fallback_and_nccl_version_replan_inside_a_group():
    """The same changes made inside ``ncclpy.group()``: a call resolved in the group before the
    change is not served after it, and the in-group planning context follows the new one."""
    res = Resolver(ctx(rank=1))
    gather = ("gather", ST, B(), None, (0,))
    assert _fns(res.resolve(*gather)) == ["Gather"]          # cached outside, too
    with ncclpy.group():
        native = res.resolve(*gather)
        assert native.in_group and _fns(native) == ["Gather"]
        assert res.resolve(*gather) is native                 # served from the cache
        res.set_context(ctx(rank=1, ff=True))
        p2p = res.resolve(*gather)
        assert p2p.in_group and _fns(p2p) == ["Send"] and p2p.plan.path == "p2p"
        res.set_context(ctx(rank=1))
        assert _fns(res.resolve(*gather)) == ["Gather"]
        res.set_context(ctx(rank=1, ver=OLD))                 # no native gather before 2.28
        assert _fns(res.resolve(*gather)) == ["Send"]
        res.set_context(ctx(ver=20900))                       # bfloat16 needs NCCL >= 2.10
        with pytest.raises(errors.UnsupportedError, match="bfloat16"):
            ar(res, B(dt="bfloat16"))
        res.set_context(ctx(rank=1, n=2))
        send_self = ("send", ST, B(), None, (1,))             # to itself: fine in a group
        assert _fns(res.resolve(*send_self)) == ["Send"]
    assert _fns(res.resolve(*gather)) == ["Gather"]           # and outside again


def test_mode_and_clear_drop_everything():
    res = Resolver(ctx(), mode="blocking")
    a = ar(res, B())
    res.set_context(ctx(), mode="nonblocking")
    assert res.mode == "nonblocking" and len(res) == 0
    b = ar(res, B())
    assert b is not a and b.calls == a.calls
    gen = res.generation
    res.clear()       # what close, abort, finalize and split call
    assert res.generation == gen + 1 and len(res) == 0 and ar(res, B()) is not b


def test_contexts_do_not_share_entries():
    parent, child = Resolver(ctx(rank=1, n=4)), Resolver(ctx(rank=0, n=2))
    a = parent.resolve("reduce", ST, B(), None, (3, "sum"))
    assert _arg(a)[-1] == 3
    with pytest.raises(errors.ArgumentError, match="out of range"):
        child.resolve("reduce", ST, B(), None, (3, "sum"))


# -- keys come from values, read each call ------------------------------------------------------
def test_a_mutated_cai_dict_is_seen():
    res = Resolver(ctx())
    x = Cai(S, 4)
    assert _arg(ar(res, x)) == (S, S, 4, F32, SUM)
    cai = x.__cuda_array_interface__
    cai["data"] = (R, False)
    assert _arg(ar(res, x)) == (R, R, 4, F32, SUM)
    cai["shape"] = (6,)
    assert _arg(ar(res, x)) == (R, R, 6, F32, SUM)
    cai["typestr"] = "<f2"
    assert _arg(ar(res, x)) == (R, R, 6, F16, SUM)
    cai["strides"] = (4,)                          # 4-byte strides on 2-byte elements
    with pytest.raises(errors.ArgumentError, match="not C-contiguous"):
        ar(res, x)
    cai["strides"] = None
    cai["data"] = (R, True)                        # read-only, written by all_reduce
    with pytest.raises(errors.ArgumentError, match="read-only"):
        ar(res, x)


def test_default_stream_from_the_cai_export():
    res = Resolver(ctx())
    x = Cai(S, 4, stream=0xABC)
    assert ar(res, x, stream=None).stream == 0xABC
    x.__cuda_array_interface__["stream"] = 0xDEF
    assert ar(res, x, stream=None).stream == 0xDEF
    x.__cuda_array_interface__["stream"] = 1       # the legacy default stream
    assert ar(res, x, stream=None).stream == 0


def test_a_reused_id_cannot_serve_a_stale_call():
    res = Resolver(ctx())
    seen = set()
    for i in range(64):
        x = Cai(S + 256 * i, 4)
        seen.add(id(x))
        assert _arg(ar(res, x))[0] == S + 256 * i
        del x
        gc.collect()
    assert len(res) == 64


def test_an_object_repointed_in_place_is_seen():
    res = Resolver(ctx())
    b = B()
    ar(res, b)
    object.__setattr__(b, "ptr", R)                # a Buffer is frozen; force it
    assert _arg(ar(res, b))[0] == R


def test_cupy_arrays_keyed_by_type():
    res = Resolver(ctx())
    a = cupy_array(S, 8)
    assert _arg(ar(res, a)) == (S, S, 8, F32, SUM)
    assert ar(res, cupy_array(S, 8)) is ar(res, a)   # another array, same values: a hit
    assert _arg(ar(res, a[2:])) == (S + 8, S + 8, 6, F32, SUM)
    assert _arg(ar(res, a.view("float16"))) == (S, S, 16, F16, SUM)
    for _ in range(2):
        with pytest.raises(errors.ArgumentError, match="not C-contiguous"):
            ar(res, a[::2])
    assert res.misses == 5


def test_torch_keys_follow_set_and_resize():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4)
    k = buffer_key(t)
    assert buffer_key(t) == k
    t.resize_(1 << 16)                              # a new allocation, same object
    assert buffer_key(t) != k
    k = buffer_key(t)
    t.set_(torch.zeros(4).untyped_storage())
    assert buffer_key(t) != k
    assert buffer_key(t.t() if t.dim() > 1 else t[::2]) != buffer_key(t)
    c = torch.zeros(4, dtype=torch.complex64)
    assert buffer_key(c.conj()) != buffer_key(c)
    res = Resolver(ctx())
    for _ in range(2):                              # host memory: refused every time
        with pytest.raises(errors.ArgumentError, match="host memory"):
            ar(res, torch.ones(4), stream=ST)
    assert len(res) == 0


# -- what is never cached ------------------------------------------------------------------
def test_errors_are_never_cached():
    res = Resolver(ctx())
    for _ in range(3):
        with pytest.raises(errors.ArgumentError, match="recvbuf has 5 elements"):
            ar(res, B(), recv=B(R, 5))
    assert len(res) == 0 and res.misses == 3


def test_objects_without_a_cheap_key_resolve_in_full():
    from test_buffers import DLPackCuda
    res = Resolver(ctx())
    d = DLPackCuda((4,), dev=(2, 0))
    with pytest.raises(Uncacheable):
        buffer_key(d)
    for _ in range(3):
        assert _arg(ar(res, d)) == (0x7F00_0000_1000,) * 2 + (4, F32, SUM)
    assert res.misses == 3 and len(res) == 0
    x = Cai(S, 4)
    x.__cuda_array_interface__["shape"] = [4]      # a list: unhashable, still correct
    assert _arg(ar(res, x)) == (S, S, 4, F32, SUM) and len(res) == 0


def test_bad_stream_and_bad_buffer_report_the_buffer_first():
    res = Resolver(ctx())
    with pytest.raises(errors.ArgumentTypeError, match="sendbuf"):
        ar(res, 1234, stream="s")
    with pytest.raises(errors.ArgumentTypeError, match="not a CUDA stream"):
        ar(res, B(), stream="s")
    with pytest.raises(errors.ArgumentTypeError, match=">= 0"):
        ar(res, B(), stream=-1)


def test_the_cache_is_bounded():
    res = Resolver(ctx(), maxsize=4)
    first = ar(res, B(S))
    for i in range(1, 10):
        ar(res, B(S + 64 * i))
    assert len(res) == 4
    assert ar(res, B(S)) is not first               # the oldest entry went first


def test_first_buffer_and_unknown_calls():
    assert first_buffer(None, [None, "y"]) == "y" and first_buffer(["x"], "y") == "x"
    assert first_buffer(None, None) is None
    with pytest.raises(ValueError, match="unknown call"):
        Resolver(ctx()).resolve("all_reduce_twice", ST, B())
    with pytest.raises(TypeError, match="PlanContext"):
        Resolver("not a context")


def test_the_cold_path_runs_every_check():
    """A miss goes through the same planner as a direct call: the whole bad-call catalogue
    gives the same error through the resolver, for a fresh and for a warmed resolver."""
    from test_bad_calls import CASES  # noqa: F401 - the catalogue exists alongside
    res = Resolver(ctx(n=4))
    ar(res, B())
    cases = [(("all_reduce", (B(), B(R, 4, "float16"), "sum")), "dtype mismatch"),
             (("reduce", (B(), None, 9, "sum")), "out of range"),
             (("broadcast", (B(), B(S + 4), 0)), "overlaps"),
             (("send", (B(), 0)), "inside a group"),
             (("all_reduce", (B(), None, "band")), "bitwise"),
             (("all_to_all", (B(S, 6), B(R, 6), None, None)), "not divisible")]
    for (name, args), words in cases:
        nbuf = len(PLANNERS[name][1])
        b = args[1] if nbuf > 1 else None
        with pytest.raises(errors.NcclpyError, match=words):
            res.resolve(name, ST, args[0], b, args[nbuf:])
        with pytest.raises(errors.NcclpyError, match=words):
            PLANNERS[name][0](ctx(n=4), *[None if x is None else as_buffer(x)
                                          for x in args[:nbuf]], *args[nbuf:])


def test_planner_table_matches_the_planners():
    assert PLANNERS["all_reduce"][0] is pc.plan_all_reduce
    assert set(PLANNERS) >= {"all_reduce", "reduce", "broadcast", "all_gather",
                             "reduce_scatter", "all_to_all", "gather", "scatter", "send",
                             "recv", "send_recv", "barrier"}


# -- a __cuda_array_interface__ export is read once per call ------------------------------------
class CountingCai:
    """A CAI producer whose export is a property (as numba's and most producers' are): each
    read counts, and each read may give a different dict."""

    def __init__(self, *exports):
        self.exports, self.reads = list(exports), 0

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        return self.exports[min(self.reads, len(self.exports)) - 1]


def _export(ptr=S, n=4, stream=0xABC, **extra):
    return {**dict(shape=(n,), typestr="<f4", data=(ptr, False), strides=None, version=3,
                   stream=stream), **extra}


def test_the_cai_export_is_read_once_per_call():
    res = Resolver(ctx())
    x = CountingCai(_export())
    r = ar(res, x, stream=None)                     # cold: stream, key and parse share it
    assert x.reads == 1 and res.misses == 1 and r.stream == 0xABC
    assert ar(res, x, stream=None) is r and x.reads == 2 and res.misses == 1   # cached
    assert _arg(ar(res, x, stream=ST)) == (S, S, 4, F32, SUM) and x.reads == 3


def test_stream_key_and_parse_come_from_the_same_export():
    """A producer whose export changes between reads cannot pair one read's stream or key
    with another read's pointer: the call is resolved from the one export it read."""
    res = Resolver(ctx())
    x = CountingCai(_export(S, stream=0xABC), _export(R, stream=0xDEF))
    r = ar(res, x, stream=None)
    assert r.stream == 0xABC and _arg(r) == (S, S, 4, F32, SUM)
    r2 = ar(res, x, stream=None)                    # the second export: a different call
    assert r2.stream == 0xDEF and _arg(r2) == (R, R, 4, F32, SUM) and res.misses == 2


def test_odd_cai_exports_take_the_general_path_with_the_same_errors():
    res = Resolver(ctx())
    for bad, err, words in [([1, 2], errors.ArgumentTypeError, "must be a dict"),
                            (_export(mask=object()), errors.UnsupportedError, "masked"),
                            (_export(version=9), errors.UnsupportedError, "version 9"),
                            ({"shape": (4,)}, errors.ArgumentError, "lacks typestr, data")]:
        for _ in range(2):                          # refused every time, never cached
            with pytest.raises(err, match=words):
                ar(res, CountingCai(bad), stream=None)
            with pytest.raises(err, match=words):
                as_buffer(CountingCai(bad), "sendbuf")
    assert len(res) == 0

    class Raising:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("export failed")
    with pytest.raises(RuntimeError, match="export failed"):
        ar(res, Raising(), stream=None)
