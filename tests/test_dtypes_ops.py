"""dtypes x ops as the planners see them: wire types, torch's bool/complex rules, version gates,
and the PreMulSum scalar encoded bit-exactly as torch converts it."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ncclpy.buffers.buffer import Buffer, as_buffer
from ncclpy.semantics.dtypes import DTYPES, LOGICAL
from ncclpy.errors import ArgumentError, UnsupportedError
from ncclpy.semantics.ops import NCCL_OPS, premul_sum
from ncclpy.plan.collectives import plan_all_reduce, plan_reduce, plan_reduce_scatter
from ncclpy.semantics.scalars import (encode_scalar, float_to_bf16_bits, float_to_e4m3fn_bits,
                                      float_to_e5m2_bits)
from ncclpy.plan.types import PREMUL_OP, PlanContext

PTR = 0x7F00_0000_0000
FLOATS = ["float16", "bfloat16", "float32", "float64", "float8_e4m3", "float8_e5m2"]
INTS = ["int8", "uint8", "int32", "uint32", "int64", "uint64"]


def _torch():
    """torch and its dtypes by ncclpy name (the tests comparing with torch need it; the
    others run without it): (torch, {wire: dtype}, {itemsize: int view})."""
    torch = pytest.importorskip("torch")
    return torch, {"float16": torch.float16, "bfloat16": torch.bfloat16,
                   "float32": torch.float32, "float64": torch.float64,
                   "float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}, \
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def torch_bits(x: float, wire: str) -> int:
    """torch.tensor([x]).to(dtype) viewed as an unsigned integer."""
    torch, types, views = _torch()
    t = torch.tensor([x], dtype=torch.float64 if wire == "float64" else torch.float32).to(
        types[wire])
    size = DTYPES[wire].itemsize
    return int(t.view(views[size]).item()) & ((1 << (8 * size)) - 1)


def _values():
    rnd = random.Random(1234)
    vals = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 3.0, 0.1, -0.3, 1 / 3, 3.14159, 7.5, 100.0, 240.0,
            448.0, 449.0, 460.0, 464.0, 1e-3, 1e-5, 2 ** -6, 2 ** -7, 2 ** -9, 2 ** -10,
            1.5 * 2 ** -8, 2 ** -14, 2 ** -16, 2 ** -17, 6e-8, 1e-8, 1e-30, 1e-45, 57344.0,
            60000.0, 61439.0, 65504.0, 1.0009765625, 1.00048828125, 1.0 + 2 ** -8,
            1.0 + 3 * 2 ** -9, 1e30, 3.3e38]
    vals += [rnd.uniform(-460, 460) for _ in range(300)]
    vals += [math.ldexp(rnd.random(), rnd.randint(-40, 40)) * rnd.choice((1, -1))
             for _ in range(600)]
    return vals


VALUES = _values()


@pytest.mark.parametrize("wire", FLOATS)
def test_premul_scalar_matches_torch(wire):
    """Every value either encodes to exactly torch's bits or is rejected as an overflow, or as
    an underflow exactly where torch's bits are a zero for a non-zero value."""
    checked = underflows = 0
    for x in VALUES:
        ref = torch_bits(x, wire)
        try:
            got = encode_scalar(x, wire)
        except ArgumentError as e:
            if "underflows" in str(e):
                sign = 1 << (8 * DTYPES[wire].itemsize - 1)
                assert x != 0 and ref & (sign - 1) == 0 and wire in str(e), (wire, x)
                underflows += 1
                continue
            assert "overflows" in str(e) and wire in str(e)
            continue
        assert int.from_bytes(got, "little") == ref, (wire, x)
        checked += 1
    assert checked > 480 and checked + underflows > 600, (checked, underflows)


@pytest.mark.parametrize("fn, wire", [(float_to_bf16_bits, "bfloat16"),
                                      (float_to_e4m3fn_bits, "float8_e4m3"),
                                      (float_to_e5m2_bits, "float8_e5m2")])
def test_bit_converters_match_torch_everywhere(fn, wire):
    """The raw converters agree with torch including saturation/inf (NaN: any NaN)."""
    torch, types, views = _torch()
    for x in VALUES + [1e6, -1e6, 480.0, 500.0, 70000.0, 1e39, float("inf"), float("-inf")]:
        assert fn(x) == torch_bits(x, wire), (wire, x)
    nan = fn(float("nan"))
    t = torch.tensor([float("nan")]).to(types[wire]).float()
    assert math.isnan(t.item())
    size = DTYPES[wire].itemsize
    back = torch.tensor([nan], dtype=torch.int64).to(views[size]).view(types[wire]).float()
    assert math.isnan(back.item())


def test_float8_saturation_and_overflow():
    assert float_to_e4m3fn_bits(1e6) == 0x7E and float_to_e4m3fn_bits(-1e6) == 0xFE
    assert float_to_e4m3fn_bits(464.0) == 0x7E              # tie to even: 448
    assert float_to_e5m2_bits(1e6) == 0x7C                  # e5m2 has inf
    assert encode_scalar(448.0, "float8_e4m3") == b"\x7e"
    assert encode_scalar(464.0, "float8_e4m3") == b"\x7e"
    for x, wire in ((465.0, "float8_e4m3"), (1e6, "float8_e5m2"), (70000.0, "float16"),
                    (1e39, "bfloat16"), (1e39, "float32")):
        with pytest.raises(ArgumentError, match="overflows"):
            encode_scalar(x, wire)
    for x in (float("inf"), float("-inf"), float("nan")):     # one rule: finite scalars only
        with pytest.raises(ArgumentError, match="not finite"):
            encode_scalar(x, "float16")
        with pytest.raises(ArgumentError, match="finite real number"):
            premul_sum(x)
    for x, wire in ((1e-320, "float16"), (1e-320, "float32"), (1e-8, "float8_e5m2")):
        with pytest.raises(ArgumentError, match="underflows"):
            encode_scalar(x, wire)
    assert encode_scalar(1e-320, "float64") == (0x7E8).to_bytes(8, "little")  # subnormal


def test_float16_through_float32_like_torch():
    # torch.tensor([x]) rounds to float32 first; 1 + 2**-11 + 2**-30 is a case where the
    # double-rounded result differs from a direct double->half rounding
    x = 1 + 2 ** -11 + 2 ** -30
    assert np.float16(x) != np.float16(np.float32(x))    # the case is a real one
    assert int.from_bytes(encode_scalar(x, "float16"), "little") == torch_bits(x, "float16")


@pytest.mark.parametrize("wire", INTS)
def test_premul_scalar_integers(wire):
    d = DTYPES[wire]
    signed = d.kind == "int"
    for v in (0, 1, 3, 7.0, 100):
        assert encode_scalar(v, wire) == int(v).to_bytes(d.itemsize, "little", signed=signed)
    if signed:
        assert encode_scalar(-2, wire) == (-2).to_bytes(d.itemsize, "little", signed=True)
    else:
        with pytest.raises(ArgumentError, match="out of range"):
            encode_scalar(-1, wire)
    with pytest.raises(ArgumentError, match="integral"):
        encode_scalar(0.5, wire)
    with pytest.raises(ArgumentError, match="out of range"):
        encode_scalar(1 << (8 * d.itemsize), wire)


def _ctx(ver=23203):
    return PlanContext(0, 2, 0, ver)


def _b(dt, n=4):
    return as_buffer(Buffer(PTR, n, dt, 0))


@pytest.mark.parametrize("dt", list(LOGICAL))
def test_every_dtype_every_op(dt):
    """Allowed ops plan with the right NCCL op; the others are UnsupportedError."""
    lg = LOGICAL[dt]
    for name in ("sum", "prod", "max", "min", "avg", "premul"):
        op = premul_sum(2) if name == "premul" else name
        key = "premul_sum" if name == "premul" else name
        allowed = lg.ops is None or key in lg.ops
        if not allowed:
            with pytest.raises(UnsupportedError) as ei:
                plan_all_reduce(_ctx(), _b(dt), op=op)
            assert key in str(ei.value) and dt in str(ei.value)
            continue
        p = plan_all_reduce(_ctx(), _b(dt), op=op)
        call = p.calls[0]
        assert call.arg("datatype") == lg.wire.nccl and call.arg("count") == 4 * lg.factor
        if key == "premul_sum":
            assert call.arg("op") is PREMUL_OP and p.premul.datatype == lg.wire.nccl
            assert p.premul.scalar == encode_scalar(2, lg.wire.name)
            assert len(p.premul.scalar) == lg.wire.itemsize
        else:
            eff = (lg.op_map or {}).get(key, key)
            assert call.arg("op") == NCCL_OPS[eff] and p.premul is None


def test_bool_maps_like_torch():
    assert plan_all_reduce(_ctx(), _b("bool"), op="sum").calls[0].arg("op") == NCCL_OPS["max"]
    assert plan_reduce(_ctx(), _b("bool"), op="prod").calls[0].arg("op") == NCCL_OPS["min"]
    assert plan_all_reduce(_ctx(), _b("bool")).calls[0].arg("datatype") == 1   # uint8


def test_ops_accept_enums_and_aliases():
    for op, v in ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), ("SUM", 0), ("mean", 4), ("Max", 2)):
        assert plan_all_reduce(_ctx(), _b("float32"), op=op).calls[0].arg("op") == v


@pytest.mark.parametrize("dt, ver", [("bfloat16", 20907), ("float8_e4m3", 22304),
                                     ("float8_e5m2", 22399)])
def test_dtype_version_gates(dt, ver):
    with pytest.raises(UnsupportedError) as ei:
        plan_all_reduce(_ctx(ver), _b(dt))
    msg = str(ei.value)
    need = "2.10.0" if dt == "bfloat16" else "2.24.0"
    assert need in msg and dt in msg and "all_reduce" in msg
    assert plan_all_reduce(_ctx(22400), _b(dt)).calls


def test_op_version_gates():
    with pytest.raises(UnsupportedError, match=r"avg needs NCCL >= 2\.10\.0"):
        plan_all_reduce(_ctx(20907), _b("float32"), op="avg")
    with pytest.raises(UnsupportedError, match=r"premul_sum needs NCCL >= 2\.11\.0"):
        plan_reduce_scatter(_ctx(21004), _b("float32"), op=premul_sum(2.0))
    assert plan_all_reduce(_ctx(21100), _b("float32"), op=premul_sum(2.0)).premul


def test_wire_table_is_ncclS():
    """The enum values ncclpy passes are NCCL's ncclDataType_t."""
    expect = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
              "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9, "float8_e4m3": 10,
              "float8_e5m2": 11}
    assert {n: d.nccl for n, d in DTYPES.items()} == expect
    assert NCCL_OPS == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
    for n, d in DTYPES.items():
        if d.numpy:
            assert np.dtype(d.numpy).itemsize == d.itemsize
