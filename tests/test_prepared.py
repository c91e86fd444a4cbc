"""Prepared calls, the GPU-less part (a real Resolver, no communicator): argument binding as the
communicator's methods take them, validation at prepare time, the resolved call per stream and
group state, re-planning after the context changes.  The communicator-bound ``Prepared`` (calls
on a GPU, graphs, refusal once closed) is tested in tests/gpu/test_prepared_gpu.py."""
from __future__ import annotations

import pytest

import ncclpy
from ncclpy import errors
from ncclpy.buffers.buffer import Buffer
from ncclpy.plan.types import PlanContext
from ncclpy.comm.prepared import SIGNATURES, PreparedCall, _memory_owners, bind_call
from ncclpy.comm.resolver import PLANNERS, Resolver

S, R = 0x7F00_0000_0000, 0x7F10_0000_0000
ST, ST2 = 0x51, 0x52


def ctx(rank=0, n=2, ff=False):
    return PlanContext(rank, n, 0, 23203, ff)


def B(ptr=S, n=4, dt="float32"):
    return Buffer(ptr, n, dt, 0)


# -- binding arguments ------------------------------------------------------------------------
def test_bind_call_positional_keyword_and_defaults():
    x, y = B(), B(R)
    assert bind_call("all_reduce", (x,), {}) == ("all_reduce", x, None, ("sum",))
    assert bind_call("all_reduce", (x, y, "max"), {}) == ("all_reduce", x, y, ("max",))
    assert bind_call("all_reduce", (x,), {"op": "min", "recvbuf": y}) == \
        ("all_reduce", x, y, ("min",))
    assert bind_call("reduce", (x,), {"op": "max", "root": 1}) == ("reduce", x, None, (1, "max"))
    assert bind_call("send", (x, 1), {}) == ("send", x, None, (1,))
    assert bind_call("recv", (x,), {"peer": 0}) == ("recv", x, None, (0,))
    assert bind_call("send_recv", (x, y, 1, 0), {}) == ("send_recv", x, y, (1, 0))
    assert bind_call("all_to_all", (x, y), {"send_counts": [1, 3]})[3] == ([1, 3], None)
    assert bind_call("allreduce", (x,), {})[0] == "all_reduce"     # nccl-tests stem
    assert bind_call("AllGather", (x, y), {})[0] == "all_gather"   # NCCL name


@pytest.mark.parametrize("name, args, kwargs, exc, words", [
    ("all_reduce", (B(), None, "sum", 9), {}, errors.ArgumentTypeError, ["at most 3"]),
    ("all_reduce", (B(),), {"oops": 1}, errors.ArgumentTypeError, ["'oops'"]),
    ("all_reduce", (B(),), {"sendbuf": B()}, errors.ArgumentTypeError, ["given twice"]),
    ("send", (B(),), {}, errors.ArgumentTypeError, ["missing", "'peer'"]),
    ("barrier", (), {}, errors.ArgumentError, ["blocks the host", "comm.barrier()"]),
    ("all_reduce_twice", (), {}, errors.ArgumentError, ["unknown call"]),
    (42, (), {}, errors.ArgumentTypeError, ["string"]),
])
def test_bind_call_refuses(name, args, kwargs, exc, words):
    with pytest.raises(exc) as ei:
        bind_call(name, args, kwargs)
    for w in words:
        assert w in str(ei.value)


def test_signatures_match_the_communicator_methods():
    import inspect
    for name, (bufs, others) in SIGNATURES.items():
        params = [p for p in inspect.signature(getattr(ncclpy.Communicator, name)).parameters
                  if p not in ("self", "stream", "config")]     # prepare() takes no config
        assert params == list(bufs) + [n for n, _ in others], name
        assert name in PLANNERS


# -- prepared once, bound per call ----------------------------------------------------------
def test_prepared_call_gives_the_resolvers_call():
    res = Resolver(ctx())
    pc = PreparedCall(res, "all_reduce", B(), None, ("sum",), stream=ST)
    r = pc.bind()
    want = res.resolve("all_reduce", ST, B(), None, ("sum",))
    assert r.calls == want.calls == (("AllReduce", (S, S, 4, 7, 0)),)
    assert r.stream == ST and pc.bind() is r                      # nothing new per call
    r2 = pc.bind(stream=ST2)
    assert r2.stream == ST2 and r2.calls == r.calls and pc.bind(stream=ST2) is r2
    assert pc.bind() is r


def test_errors_surface_at_prepare_time():
    res = Resolver(ctx())
    with pytest.raises(errors.ArgumentError, match="recvbuf has 5 elements"):
        PreparedCall(res, "all_reduce", B(), B(R, 5), ("sum",))
    with pytest.raises(errors.ArgumentTypeError, match="sendbuf"):
        PreparedCall(res, "all_reduce", "not a buffer", None, ("sum",))
    with pytest.raises(errors.ArgumentTypeError, match="not a CUDA stream"):
        PreparedCall(res, "all_reduce", B(), None, ("sum",), stream="s")


def test_a_new_context_replans_from_the_same_buffers():
    res = Resolver(ctx(rank=1))
    pc = PreparedCall(res, "gather", B(), None, (0,), stream=ST)
    assert [f for f, _ in pc.bind().calls] == ["Gather"]
    res.set_context(ctx(rank=1, ff=True))           # what comm.force_fallback = True does
    r = pc.bind()
    assert [f for f, _ in r.calls] == ["Send"] and r.group
    res.set_context(ctx(rank=1))
    assert [f for f, _ in pc.bind().calls] == ["Gather"]


def test_a_new_context_replans_inside_a_group_too():
    """A prepared call bound in a group before and after the context changes (in the group)
    gives the new plan, in the group and out of it afterwards."""
    res = Resolver(ctx(rank=1))
    pc = PreparedCall(res, "gather", B(), None, (0,), stream=ST)
    with ncclpy.group():
        r = pc.bind()
        assert r.in_group and [f for f, _ in r.calls] == ["Gather"]
        res.set_context(ctx(rank=1, ff=True))
        r = pc.bind()
        assert r.in_group and [f for f, _ in r.calls] == ["Send"] and r.group
        res.set_context(ctx(rank=1))
        assert [f for f, _ in pc.bind().calls] == ["Gather"]
        res.set_context(ctx(rank=1, ff=True))
    r = pc.bind()
    assert not r.in_group and [f for f, _ in r.calls] == ["Send"]


def test_the_group_state_is_planned_for():
    res = Resolver(ctx())
    with pytest.raises(errors.ArgumentError, match="inside a group"):
        PreparedCall(res, "send", B(), None, (0,), stream=ST)     # to self, outside a group
    with ncclpy.group():
        pc = PreparedCall(res, "send", B(), None, (0,), stream=ST)
        r = pc.bind()
        assert r.in_group and r.calls == (("Send", (S, 4, 7, 0)),)
    with pytest.raises(errors.ArgumentError, match="inside a group"):
        pc.bind()                                    # alone it would hang: refused
    ok = PreparedCall(res, "all_reduce", B(), None, ("sum",), stream=ST)
    with ncclpy.group():
        assert ok.bind().in_group
    assert not ok.bind().in_group


def test_pointers_are_those_read_at_prepare_time():
    class Cai:
        def __init__(self):
            self.__cuda_array_interface__ = dict(shape=(4,), typestr="<f4", data=(S, False),
                                                 version=3, stream=ST)
    x = Cai()
    res = Resolver(ctx())
    pc = PreparedCall(res, "all_reduce", x, None, ("sum",))
    assert pc.bind().stream == ST                  # the default: the export's stream
    x.__cuda_array_interface__["data"] = (R, False)
    x.__cuda_array_interface__["stream"] = ST2
    r = pc.bind()
    assert r.calls[0][1][0] == S and r.stream == ST2   # pointers fixed, stream per call
    assert res.resolve("all_reduce", None, x, None, ("sum",)).calls[0][1][0] == R


def test_memory_owners_keep_cupy_memory():
    cupy = pytest.importorskip("cupy")
    mem = cupy.cuda.UnownedMemory(S, 16, None, 0)
    a = cupy.ndarray((4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    res = Resolver(ctx())
    pc = PreparedCall(res, "all_reduce", a, None, ("sum",), stream=ST)
    owners = _memory_owners(pc.specs)
    assert len(owners) == 1 and owners[0].mem is mem
    assert _memory_owners((None,)) == () and _memory_owners((PreparedCall(
        res, "all_reduce", B(), None, ("sum",), stream=ST).specs[0],)) == ()
