"""The resolver's contracts that a wrong cache key, a dropped refusal or an unbounded cache would
break without any other test noticing (found unpinned by ``python -m tools.mutation run
resolver``).  CPU only, no communicator: made-up addresses, nothing dereferenced.

What a user would lose if one of these broke:

* the direct path's C arguments: a NULL (None) pointer that is not passed as 0, or a placeholder
  handed to C instead of going through the full executor;
* a key that forgets part of the call: a cached plan for another root, another count list, or a
  count list that the planner refuses (floats, bools that compare equal to ints);
* the default stream of an in-place call (sendbuf None) taken from nothing instead of recvbuf;
* the ``__cuda_array_interface__`` path accepting a negative or bool stream handle;
* ``config=``: a call that drops its config, accepts something that is not a CollConfig, a
  configured cache that is not a cache, not bounded, or not dropped by ``clear``.
"""
from __future__ import annotations

import gc
import weakref

import pytest

import ncclpy
from ncclpy import errors
from ncclpy.buffers.buffer import Buffer
from ncclpy.comm.execute import Resources
from ncclpy.comm.resolver import Resolved, Resolver
from ncclpy.semantics.ops import MAX, RedOp, premul_sum
from ncclpy.plan.types import PREMUL_OP, NcclCall, Plan, PlanContext, Scratch

S, R, O = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000
ST = 0x51
NEW = 23203
F32 = 7


def ctx(rank=0, n=2, ver=NEW, ff=False):
    return PlanContext(rank, n, 0, ver, ff)


def B(ptr=S, n=4, dt="float32"):
    return Buffer(ptr, n, dt, 0)


class Cai:
    """A plain __cuda_array_interface__ v3 producer (no device attribute)."""

    def __init__(self, ptr=S, n=4, stream=None):
        self.__cuda_array_interface__ = dict(shape=(n,), typestr="<f4", data=(ptr, False),
                                             strides=None, version=3)
        if stream is not None:
            self.__cuda_array_interface__["stream"] = stream


# -- Resolved: which plans take the direct path, with which C arguments ----------------------
def test_a_null_argument_is_passed_as_0_on_the_direct_path():
    """None in a call's arguments is C's NULL: the direct path passes 0, exactly what the full
    executor's Resources.value passes for it, and the rest unchanged."""
    plan = Plan("all_gather", (NcclCall("AllGather", (None, R, 4, F32)),
                               NcclCall("Send", (S, 4, F32, 1))), group=True)
    r = Resolved(plan, ST, False)
    assert r.calls == (("AllGather", (0, R, 4, F32)), ("Send", (S, 4, F32, 1)))
    assert all(type(v) is int for _fn, a in r.calls for v in a)
    assert r.group and r.stream == ST and r.plan is plan
    full = Resources.__new__(Resources)          # the executor's rule, without a communicator
    full.op, full.base = None, 0
    assert r.calls == tuple((c.fn, tuple(full.value(v) for v in c.args)) for c in plan.steps)
    tail = Resolved(Plan("send", (NcclCall("Send", (S, 4, F32, 1)),
                                  NcclCall("Recv", (None, 0, F32, 1)))), ST, True)
    assert tail.calls == (("Send", (S, 4, F32, 1)), ("Recv", (0, 0, F32, 1))) and tail.in_group


@pytest.mark.parametrize("placeholder", [Scratch(0), PREMUL_OP], ids=["scratch", "premul"])
def test_a_placeholder_never_reaches_the_direct_path(placeholder):
    """A call whose arguments still hold a placeholder (even in a plan that asks for no scratch
    and no op) is left to the full executor, which resolves or refuses it: never a Python
    object handed to C as an argument."""
    first = NcclCall("AllReduce", (S, S, 4, F32, 0))
    for args in [(S, placeholder, 4, F32, 0), (placeholder, None, 4, F32, 0)]:
        r = Resolved(Plan("all_reduce", (first, NcclCall("AllReduce", args))), ST, False)
        assert r.calls is None


# -- the key holds every argument -------------------------------------------------------------
def test_a_redop_call_keys_the_root_too():
    """With a RedOp object as op, the key is made per argument: the root is still in it."""
    res = Resolver(ctx(n=4))
    r0 = res.resolve("reduce", ST, B(), None, (0, MAX))
    r2 = res.resolve("reduce", ST, B(), None, (2, MAX))
    assert r0.calls[0][1][-2:] == (2, 0) and r2.calls[0][1][-2:] == (2, 2)
    assert res.resolve("reduce", ST, B(), None, (0, RedOp("max"))) is r0     # equal: a hit
    p0 = res.resolve("reduce", ST, B(), None, (0, premul_sum(0.5)))
    p3 = res.resolve("reduce", ST, B(), None, (3, premul_sum(0.5)))
    assert p0.plan.steps[0].args[-1] == 0 and p3.plan.steps[0].args[-1] == 3
    assert res.resolve("reduce", ST, B(), None, (3, premul_sum(0.5))) is p3
    assert res.misses == 4 and len(res) == 4


def test_counts_the_planner_refuses_are_refused_after_equal_int_counts():
    """[1.0, ...] and [True, ...] compare (and hash) equal to [1, ...]: the key must not serve
    the int call's plan for them; the planner refuses them every time."""
    res = Resolver(ctx(n=4))
    good = res.resolve("all_to_all", ST, B(S, 8), B(R, 8), ([1, 1, 3, 3], [1, 3, 3, 1]))
    assert list(good.plan.meta["send_counts"]) == [1, 1, 3, 3]
    for bad, words in [([1.0, 1, 3, 3], "float"), ([True, 1, 3, 3], "bool"),
                       ((1, 1, 3.0, 3), "float")]:
        for _ in range(2):
            with pytest.raises(errors.ArgumentTypeError, match=f"send_counts.*{words}"):
                res.resolve("all_to_all", ST, B(S, 8), B(R, 8), (bad, [1, 3, 3, 1]))
    assert res.resolve("all_to_all", ST, B(S, 8), B(R, 8), ((1, 1, 3, 3), [1, 3, 3, 1])) is good
    assert len(res) == 1


def test_an_in_place_call_takes_recvbufs_default_stream_and_is_cached():
    """all_gather(None, recvbuf): no sendbuf, so the default stream is recvbuf's (its export's
    stream here), and the call is still served from the cache."""
    res = Resolver(ctx())
    x = Cai(R, 8, stream=0xABC)
    r = res.resolve("all_gather", None, None, x, ())
    assert r.stream == 0xABC and r.calls == (("AllGather", (R, R, 4, F32)),)
    assert res.resolve("all_gather", None, None, x, ()) is r and res.misses == 1
    x.__cuda_array_interface__["stream"] = 0xDEF
    assert res.resolve("all_gather", None, None, x, ()).stream == 0xDEF
    lst = res.resolve("all_gather", None, None, [Cai(R, 4, stream=0xABC), Cai(O, 4)], ())
    assert lst.stream == 0xABC


def test_a_list_sendbuf_takes_its_first_buffers_default_stream_and_is_cached():
    """scatter([...], recvbuf) on the root: the default stream is the list's first buffer's
    (not the list's, which has none), and the call is served from the cache."""
    res = Resolver(ctx())
    parts = [Cai(S, 4, stream=0xABC), Cai(O, 4, stream=0xDEF)]
    call = ("scatter", None, parts, Cai(R, 4, stream=0x99), (0,))
    r = res.resolve(*call)
    assert r.stream == 0xABC and r.plan.collective == "scatter"
    assert res.resolve(*call) is r and res.misses == 1
    parts[0].__cuda_array_interface__["stream"] = 0x123
    assert res.resolve(*call).stream == 0x123 and res.misses == 2


# -- the __cuda_array_interface__ path's stream ------------------------------------------------
@pytest.mark.parametrize("bad, words", [(-1, ">= 0"), (True, "bool")])
def test_a_cai_buffer_refuses_a_bad_stream_every_time(bad, words):
    res = Resolver(ctx())
    ar = ("all_reduce", bad, Cai(S, 4, stream=0xABC), None, ("sum",))
    for _ in range(2):
        with pytest.raises(errors.ArgumentTypeError, match=words):
            res.resolve(*ar)
    assert len(res) == 0


def test_a_cai_buffer_with_a_stream_object_is_cached():
    class Proto:
        def __cuda_stream__(self):
            return (0, 0x77)
    res = Resolver(ctx())
    x = Cai(S, 4, stream=0xABC)
    r = res.resolve("all_reduce", Proto(), x, None, ("sum",))
    assert r.stream == 0x77 and r.calls == (("AllReduce", (S, S, 4, F32, 0)),)
    assert res.resolve("all_reduce", Proto(), x, None, ("sum",)) is r and res.misses == 1
    z = res.resolve("all_reduce", 0, x, None, ("sum",))       # 0: the legacy default stream
    assert z.stream == 0 and res.resolve("all_reduce", 0, x, None, ("sum",)) is z


# -- config= ------------------------------------------------------------------------------------
def _cfg(**kw):
    return ncclpy.CollConfig(**kw)


def test_a_config_call_is_the_config_variant_with_the_structs_address():
    res = Resolver(ctx())
    cfg = _cfg(max_ctas=4)
    r = res.resolve("all_reduce", ST, B(), None, ("sum",), config=cfg)
    assert isinstance(r, Resolved) and r.stream == ST
    assert r.calls == (("AllReduceConfig", (S, S, 4, F32, 0, cfg.pointer(NEW))),)
    assert r.plan.meta["config"] == {"max_ctas": 4}
    plain = res.resolve("all_reduce", ST, B(), None, ("sum",))
    assert plain.calls == (("AllReduce", (S, S, 4, F32, 0)),)     # not the configured one
    with ncclpy.group():
        g = res.resolve("all_reduce", ST, B(), None, ("sum",), config=cfg)
    assert g.in_group and g.calls == r.calls


@pytest.mark.parametrize("bad", ["ring", {"max_ctas": 4}, 4])
def test_a_config_that_is_not_a_collconfig_is_refused(bad):
    res = Resolver(ctx())
    for _ in range(2):
        with pytest.raises(errors.ArgumentTypeError, match="all_reduce: config must be"):
            res.resolve("all_reduce", ST, B(), None, ("sum",), config=bad)
    assert res.misses == 0 and len(res) == 0      # refused before anything is planned


def test_configured_calls_are_cached_per_config():
    """A repeated config call is served from the cache (the same Resolved), per config, as
    long as the bound allows: two configs in turn both stay cached."""
    res = Resolver(ctx(), maxsize=8)
    a, b = _cfg(max_ctas=4), _cfg(min_ctas=2)
    call = ("all_reduce", ST, B(), None, ("sum",))
    res.resolve(*call, config=a)                   # the plain call's miss: not kept yet
    ra = res.resolve(*call, config=a)
    rb = res.resolve(*call, config=b)
    rb = res.resolve(*call, config=b)
    for _ in range(3):
        assert res.resolve(*call, config=a) is ra
        assert res.resolve(*call, config=b) is rb
    assert ra.calls[0][1][-1] == a.pointer(NEW) and rb.calls[0][1][-1] == b.pointer(NEW)
    assert res.misses == 1


def _kept_configs(res, tags):
    """Resolve with one config per tag (each twice, so each is kept), drop them: weak
    references to them (alive while the resolver holds them)."""
    refs = []
    call = ("all_reduce", ST, B(), None, ("sum",))
    for tag in tags:
        cfg = _cfg(profiler_tag=tag)
        res.resolve(*call, config=cfg)
        res.resolve(*call, config=cfg)
        refs.append(weakref.ref(cfg))
        del cfg
    gc.collect()
    return refs


def _alive(refs):
    gc.collect()
    return sum(r() is not None for r in refs)


def test_the_configured_cache_is_bounded():
    res = Resolver(ctx(), maxsize=3)
    assert 1 <= _alive(_kept_configs(res, range(1, 21))) <= 3   # cached, never more than 3


def test_clear_and_a_new_context_release_configured_calls():
    """close/abort/finalize/split call clear(): nothing the configured cache held (the user's
    CollConfig, its event) stays alive afterwards; a new context drops it too."""
    res = Resolver(ctx())
    refs = _kept_configs(res, (1, 2, 3))
    assert _alive(refs) == 3
    res.clear()
    assert _alive(refs) == 0
    refs = _kept_configs(res, (7, 8))
    assert _alive(refs) == 2
    res.set_context(ctx(ver=23100))
    assert _alive(refs) == 0
    cfg = _cfg(max_ctas=2)
    r = res.resolve("all_reduce", ST, B(), None, ("sum",), config=cfg)
    assert r.calls[0][1][-1] == cfg.pointer(23100)   # planned for the new context's NCCL


def test_a_config_is_planned_for_the_current_context():
    """A config call cached under one context is planned again after the context changes:
    on a forced fallback (grouped send/recv, no config variant) it is refused, and below NCCL
    2.31 too, each time."""
    res = Resolver(ctx(rank=1))
    cfg = _cfg(max_ctas=4)
    gather = ("gather", ST, B(), None, (0,))
    for _ in range(3):
        assert res.resolve(*gather, config=cfg).calls[0][0] == "GatherConfig"
    res.set_context(ctx(rank=1, ff=True))
    for _ in range(2):
        with pytest.raises(errors.UnsupportedError, match="config= applies"):
            res.resolve(*gather, config=cfg)
    res.set_context(ctx(rank=1, ver=23000))
    for _ in range(2):
        with pytest.raises(errors.VersionError, match="2.31"):
            res.resolve(*gather, config=cfg)


# -- parse and plan (what prepared calls use) --------------------------------------------------
def test_parse_names_each_buffer_as_the_method_does():
    res = Resolver(ctx())
    (one,) = res.parse("send", B())
    assert one.ptr == S and one.count == 4
    s, r = res.parse("all_reduce", B(), B(R))
    assert (s.ptr, r.ptr) == (S, R)
    assert res.parse("all_gather", None, B(R, 8))[0] is None
    with pytest.raises(errors.ArgumentTypeError, match="sendbuf"):
        res.parse("all_reduce", 1234, B(R))
    with pytest.raises(errors.ArgumentTypeError, match="recvbuf"):
        res.parse("all_reduce", B(), 1234)
    with pytest.raises(errors.ArgumentTypeError, match="^buf: "):
        res.parse("send", 1234)
    with pytest.raises(ValueError, match="unknown call"):
        res.parse("all_reduce_twice", B())


def test_plan_honours_the_group_state_it_is_given():
    res = Resolver(ctx())
    (spec,) = res.parse("send", B())
    with pytest.raises(errors.ArgumentError, match="inside a group"):
        res.plan("send", (spec,), (0,))                    # to self, outside a group
    p = res.plan("send", (spec,), (0,), in_group=True)
    assert [(c.fn, c.args) for c in p.steps] == [("Send", (S, 4, F32, 0))]
