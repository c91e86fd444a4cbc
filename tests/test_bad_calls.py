"""A catalogue of bad calls: each is rejected before any NCCL call, with the exception type and
the key words of its message asserted."""
from __future__ import annotations

import pytest

from ncclpy import errors
from ncclpy._nccl import dispatch
from ncclpy.buffers.buffer import Buffer, BufferSpec, as_buffer
from ncclpy.semantics.ops import premul_sum
from ncclpy.plan.collectives import (plan_all_gather, plan_all_reduce, plan_all_to_all,
                                     plan_barrier, plan_broadcast, plan_call, plan_gather,
                                     plan_recv, plan_reduce, plan_reduce_scatter, plan_scatter,
                                     plan_send, plan_send_recv)
from ncclpy.plan.types import PlanContext

S, R, O = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000
AE, ATE, UE = errors.ArgumentError, errors.ArgumentTypeError, errors.UnsupportedError


def B(ptr, n, dt="float32", dev=0):
    return as_buffer(Buffer(ptr, n, dt, dev))


def C(rank=0, n=4, ver=23203, **kw):
    return PlanContext(rank, n, 0, ver, **kw)


def host(n=4):
    return BufferSpec(S, n, "float32", -1, (n,), "raw")


def strided(n=4):
    return BufferSpec(S, n, "float32", 0, (n,), "cupy", contiguous=False)


def readonly(n=4):
    return BufferSpec(R, n, "float32", 0, (n,), "cai", readonly=True)


class NumpyLike:
    __array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0, False), "version": 3}


CASES = [
    # ---- buffers
    ("host-memory sendbuf", lambda: plan_all_reduce(C(), host()),
     AE, ["all_reduce", "sendbuf", "host memory"]),
    ("host-memory via __array_interface__", lambda: plan_all_reduce(C(), NumpyLike()),
     AE, ["sendbuf", "host memory"]),
    ("non-contiguous", lambda: plan_broadcast(C(), strided()),
     AE, ["broadcast", "not contiguous"]),
    ("read-only output", lambda: plan_all_reduce(C(), B(S, 4), readonly()),
     AE, ["recvbuf", "read-only"]),
    ("buffer on another device", lambda: plan_all_reduce(C(), B(S, 4, dev=1)),
     AE, ["device 1", "device 0", "communicator"]),
    ("recvbuf on another device", lambda: plan_reduce(C(), B(S, 4), B(R, 4, dev=2)),
     AE, ["recvbuf", "device 2"]),
    ("not a buffer: int", lambda: plan_all_reduce(C(), 1234),
     ATE, ["sendbuf", "expected", "ncclpy.Buffer"]),
    ("not a buffer: str", lambda: plan_send(C(), "abc", 1), ATE, ["buf", "str"]),
    ("list where one buffer is needed", lambda: plan_all_reduce(C(), [B(S, 4)]),
     ATE, ["sendbuf", "one buffer", "list"]),
    ("NULL pointer with elements", lambda: plan_all_reduce(C(), BufferSpec(0, 4, "float32", 0)),
     AE, ["NULL"]),
    ("unsupported dtype int16", lambda: plan_all_reduce(C(), Buffer(S, 4, "int16")),
     UE, ["int16", "no NCCL equivalent"]),
    ("unknown dtype in a hand-made spec",
     lambda: plan_all_reduce(C(), BufferSpec(S, 4, "float128", 0)), UE, ["float128"]),
    # ---- dtype / size rules
    ("all_reduce dtype mismatch", lambda: plan_all_reduce(C(), B(S, 4), B(R, 4, "float16")),
     AE, ["dtype mismatch", "float32", "float16", "sendbuf", "recvbuf"]),
    ("all_reduce size mismatch", lambda: plan_all_reduce(C(), B(S, 4), B(R, 5)),
     AE, ["recvbuf has 5 elements", "sendbuf (4)"]),
    ("all_gather recv size", lambda: plan_all_gather(C(), B(S, 3), B(R, 10)),
     AE, ["all_gather: recvbuf has 10 elements",
          "expected world_size(4) * sendbuf count(3) = 12"]),
    ("all_gather in place, not divisible", lambda: plan_all_gather(C(), None, B(R, 10)),
     AE, ["not divisible", "world_size (4)"]),
    ("all_gather without recvbuf", lambda: plan_all_gather(C(), B(S, 3), None),
     AE, ["recvbuf is required"]),
    ("all_gather list of wrong length", lambda: plan_all_gather(C(), B(S, 3), [B(R, 3)] * 3),
     AE, ["list of 3", "world_size (4)"]),
    ("all_gather list entry count", lambda: plan_all_gather(
        C(n=2), B(S, 3), [B(R, 3), B(O, 4)]), AE, ["recvbuf[1] has 4 elements", "(3)"]),
    ("all_gather list entries overlap", lambda: plan_all_gather(
        C(n=2), B(S, 4), [B(R, 4), B(R + 8, 4)]), AE, ["overlap each other"]),
    ("all_gather sendbuf overlaps recvbuf off its block", lambda: plan_all_gather(
        C(rank=1, n=2), B(R, 4), B(R, 8)), AE, ["overlaps", "recvbuff + rank*count"]),
    ("all_reduce partial overlap", lambda: plan_all_reduce(C(), B(S, 4), B(S + 4, 4)),
     AE, ["overlaps", "recvbuff == sendbuff"]),
    ("reduce_scatter send size", lambda: plan_reduce_scatter(C(), B(S, 10), B(R, 3)),
     AE, ["sendbuf has 10 elements", "world_size(4) * recvbuf count(3) = 12"]),
    ("reduce_scatter in place, not divisible", lambda: plan_reduce_scatter(C(), B(S, 6)),
     AE, ["6 elements, not divisible by world_size (4)"]),
    ("reduce_scatter list dtype", lambda: plan_reduce_scatter(
        C(n=2), [B(S, 2), B(O, 2, "int32")], B(R, 2)), AE, ["dtype mismatch", "int32"]),
    ("broadcast without buffers", lambda: plan_broadcast(C(), None, None),
     AE, ["sendbuf is required"]),
    ("all_to_all not divisible", lambda: plan_all_to_all(C(), B(S, 6), B(R, 6)),
     AE, ["6 elements, not divisible", "world_size (4)"]),
    ("all_to_all size mismatch", lambda: plan_all_to_all(C(), B(S, 8), B(R, 12)),
     AE, ["recvbuf has 12 elements", "sendbuf (8)"]),
    ("all_to_all counts wrong length", lambda: plan_all_to_all(
        C(), B(S, 6), B(R, 6), send_counts=[3, 3]), AE, ["send_counts has 2 entries",
                                                         "world_size (4)"]),
    ("all_to_all counts sum", lambda: plan_all_to_all(
        C(n=2), B(S, 6), B(R, 6), send_counts=[2, 2], recv_counts=[3, 3]),
     AE, ["sum(send_counts) = 4", "sendbuf has 6"]),
    ("all_to_all negative count", lambda: plan_all_to_all(
        C(n=2), B(S, 2), B(R, 2), send_counts=[3, -1], recv_counts=[1, 1]),
     AE, ["send_counts[1] is -1", ">= 0"]),
    ("all_to_all count not an int", lambda: plan_all_to_all(
        C(n=2), B(S, 2), B(R, 2), send_counts=[1.5, 0.5]), ATE, ["send_counts[0]", "int"]),
    ("all_to_all counts not a sequence", lambda: plan_all_to_all(
        C(n=2), B(S, 2), B(R, 2), send_counts=2), ATE, ["send_counts", "sequence"]),
    ("all_to_all own block mismatch", lambda: plan_all_to_all(
        C(rank=0, n=2), B(S, 4), B(R, 4), send_counts=[1, 3], recv_counts=[2, 2]),
     AE, ["rank 0 sends 1 elements to itself", "receives 2"]),
    ("all_to_all counts with a list", lambda: plan_all_to_all(
        C(n=2), [B(S, 1), B(O, 1)], B(R, 2), send_counts=[1, 1]),
     AE, ["send_counts cannot be combined with a list sendbuf"]),
    ("all_to_all overlapping buffers", lambda: plan_all_to_all(C(n=2), B(S, 4), B(S + 8, 4)),
     AE, ["overlaps sendbuf"]),
    ("all_to_all dtype mismatch", lambda: plan_all_to_all(C(n=2), B(S, 4), B(R, 4, "int32")),
     AE, ["dtype mismatch", "float32", "int32"]),
    ("gather recv size on root", lambda: plan_gather(C(rank=1), B(S, 2), B(R, 7), root=1),
     AE, ["gather: recvbuf has 7 elements", "world_size(4) * sendbuf count(2) = 8"]),
    ("gather without recvbuf on root", lambda: plan_gather(C(), B(S, 2), None, root=0),
     AE, ["recvbuf is required on the root rank (0)"]),
    ("gather without sendbuf off root", lambda: plan_gather(C(rank=2), None, None, root=0),
     AE, ["sendbuf is required on non-root rank 2"]),
    ("scatter send size on root", lambda: plan_scatter(C(), B(S, 9), B(R, 2)),
     AE, ["scatter: sendbuf has 9 elements", "world_size(4) * recvbuf count(2) = 8"]),
    ("scatter without recvbuf off root", lambda: plan_scatter(C(rank=3), B(S, 8), None),
     AE, ["recvbuf is required on non-root rank 3"]),
    ("scatter list wrong length", lambda: plan_scatter(C(), [B(S, 2)] * 2, B(R, 2)),
     AE, ["list of 2 buffers", "world_size (4)"]),
    # ---- ranks, peers, self
    ("root out of range", lambda: plan_reduce(C(), B(S, 4), root=4),
     AE, ["root 4 is out of range", "0 <= root < world_size (4)", "0..3"]),
    ("negative root", lambda: plan_broadcast(C(), B(S, 4), root=-1),
     AE, ["root -1 is out of range"]),
    ("root not an int", lambda: plan_gather(C(), B(S, 1), B(R, 4), root="0"),
     ATE, ["root must be an int"]),
    ("root is a bool", lambda: plan_scatter(C(), B(S, 4), root=True),
     ATE, ["root must be an int", "True"]),
    ("peer out of range", lambda: plan_send(C(), B(S, 4), 7),
     AE, ["send: peer 7 is out of range", "0..3"]),
    ("send to self outside a group", lambda: plan_send(C(rank=2), B(S, 4), 2),
     AE, ["send: peer 2 is this rank", "group"]),
    ("recv from self outside a group", lambda: plan_recv(C(rank=1), B(R, 4), 1),
     AE, ["recv: peer 1 is this rank", "send_recv"]),
    ("send_recv peer out of range", lambda: plan_send_recv(C(), B(S, 4), B(R, 4), 1, 9),
     AE, ["recv_peer 9 is out of range"]),
    ("send_recv overlapping buffers", lambda: plan_send_recv(C(), B(S, 4), B(S, 4), 1, 3),
     AE, ["overlaps sendbuf"]),
    ("send_recv missing recvbuf", lambda: plan_send_recv(C(), B(S, 4), None, 1, 3),
     AE, ["both sendbuf and recvbuf are required"]),
    # ---- ops
    ("bitwise op", lambda: plan_all_reduce(C(), B(S, 4, "int32"), op="band"),
     UE, ["no bitwise reductions", "BAND"]),
    ("bor", lambda: plan_reduce_scatter(C(), B(S, 4, "uint8"), op="BOR"),
     UE, ["no bitwise reductions"]),
    ("unknown op", lambda: plan_all_reduce(C(), B(S, 4), op="median"),
     AE, ["unknown reduction", "median"]),
    ("op enum out of range", lambda: plan_all_reduce(C(), B(S, 4), op=7),
     AE, ["enum value 7", "0..4"]),
    ("premul_sum without scalar", lambda: plan_all_reduce(C(), B(S, 4), op="premul_sum"),
     AE, ["premul_sum", "scalar"]),
    ("avg on bool", lambda: plan_all_reduce(C(), B(S, 4, "bool"), op="avg"),
     UE, ["avg", "bool", "torch.distributed"]),
    ("max on complex", lambda: plan_all_reduce(C(), B(S, 4, "complex64"), op="max"),
     UE, ["max", "complex64", "allowed are avg, premul_sum, sum"]),
    ("premul on bool", lambda: plan_all_reduce(C(), B(S, 4, "bool"), op=premul_sum(2)),
     UE, ["premul_sum", "bool"]),
    ("premul non-integral on int", lambda: plan_all_reduce(
        C(), B(S, 4, "int32"), op=premul_sum(0.5)), AE, ["0.5", "int32", "integral"]),
    ("premul negative on uint", lambda: plan_all_reduce(
        C(), B(S, 4, "uint32"), op=premul_sum(-1)), AE, ["out of range", "uint32"]),
    ("premul overflowing fp8", lambda: plan_all_reduce(
        C(), B(S, 4, "float8_e4m3"), op=premul_sum(1000)),
     AE, ["overflows float8_e4m3", "448"]),
    ("premul complex scalar", lambda: premul_sum(1j), UE, ["real scalar"]),
    ("premul string scalar", lambda: premul_sum("2"), ATE, ["real number"]),
    # ---- NCCL version gates
    ("bf16 on old NCCL", lambda: plan_all_reduce(C(ver=20907), B(S, 4, "bfloat16")),
     UE, ["bfloat16", "NCCL >= 2.10.0", "2.9.7"]),
    ("fp8 on old NCCL", lambda: plan_all_gather(C(ver=22304), B(S, 1, "float8_e5m2"),
                                                B(R, 4, "float8_e5m2")),
     UE, ["all_gather", "float8_e5m2", "NCCL >= 2.24.0"]),
    ("avg on old NCCL", lambda: plan_reduce(C(ver=20907), B(S, 4), op="avg"),
     UE, ["avg needs NCCL >= 2.10.0"]),
    ("premul on old NCCL", lambda: plan_all_reduce(C(ver=21004), B(S, 4), op=premul_sum(2)),
     UE, ["premul_sum needs NCCL >= 2.11.0"]),
    # ---- misc
    ("barrier buffer empty", lambda: plan_barrier(C(), B(S, 0, "int32")),
     AE, ["barrier buffer has 0 elements"]),
    ("unknown collective", lambda: plan_call("all_sum", C()),
     AE, ["collective 'all_sum' is unknown"]),
    ("bad context", lambda: plan_all_reduce(PlanContext(4, 4), B(S, 4)),
     AE, ["rank 4", "world_size 4"]),
    ("Buffer ptr bool", lambda: B(True, 4),
     ATE, ["Buffer: ptr must be an int", "True", "bool"]),
    ("Buffer count negative", lambda: B(S, -1),
     AE, ["Buffer: count is -1", ">= 0"]),
    ("all_to_all count float", lambda: plan_all_to_all(C(n=2), B(S, 4), B(O, 4),
                                                        send_counts=[2, 2.0],
                                                        recv_counts=[2, 2]),
     ATE, ["send_counts[1] must be an int", "2.0", "float"]),
    ("comm rank bool", lambda: dispatch.int_arg("rank", True, 0),
     ATE, ["rank must be an int", "True"]),
]


def test_catalogue_is_large_enough():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, call, exc, words", CASES, ids=[c[0] for c in CASES])
def test_bad_call(name, call, exc, words):
    with pytest.raises(exc) as ei:
        call()
    msg = str(ei.value)
    assert isinstance(ei.value, errors.NcclpyError)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


# -- the same refusals through the resolver, after the good call was cached (issue 14) -----------
def _warm_resolver(n=4):
    from ncclpy.comm.resolver import Resolver
    res = Resolver(C(n=n))
    for name, a, b, params in (("all_reduce", B(S, 4), None, ("sum",)),
                               ("reduce", B(S, 4), None, (0, "sum")),
                               ("send", B(S, 4), None, (1,)),
                               ("all_gather", B(S, 3), B(R, 12), ())):
        res.resolve(name, 0x51, a, b, params)
    return res


THROUGH_RESOLVER = [
    ("host memory", ("all_reduce", host(), None, ("sum",)), AE, ["sendbuf", "host memory"]),
    ("other device", ("all_reduce", B(S, 4, dev=1), None, ("sum",)), AE, ["device 1"]),
    ("read-only output", ("all_reduce", B(S, 4), readonly(), ("sum",)), AE, ["read-only"]),
    ("non-contiguous", ("all_reduce", strided(), None, ("sum",)), AE, ["not contiguous"]),
    ("count mismatch", ("all_reduce", B(S, 4), B(R, 5), ("sum",)), AE, ["recvbuf has 5"]),
    ("bitwise op", ("all_reduce", B(S, 4), None, ("bxor",)), UE, ["no bitwise"]),
    ("bool op", ("all_reduce", B(S, 4), None, (True,)), ATE, ["op"]),
    ("root out of range", ("reduce", B(S, 4), None, (4, "sum")), AE, ["root 4"]),
    ("root bool", ("reduce", B(S, 4), None, (False, "sum")), ATE, ["root must be an int"]),
    ("send to self", ("send", B(S, 4), None, (0,)), AE, ["peer 0 is this rank"]),
    ("all_gather size", ("all_gather", B(S, 3), B(R, 10), ()), AE, ["recvbuf has 10"]),
    ("not a buffer", ("all_reduce", 1234, None, ("sum",)), ATE, ["ncclpy.Buffer"]),
]


@pytest.mark.parametrize("name, call, exc, words", THROUGH_RESOLVER,
                         ids=[c[0] for c in THROUGH_RESOLVER])
def test_bad_call_through_a_warm_resolver(name, call, exc, words):
    res = _warm_resolver()
    cached = len(res)
    for _ in range(2):               # refused every time: an error is never cached
        with pytest.raises(exc) as ei:
            res.resolve(call[0], 0x51, *call[1:])
        for w in words:
            assert w in str(ei.value), f"{w!r} not in {str(ei.value)!r}"
    assert len(res) == cached
