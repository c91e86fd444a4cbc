"""Encode a PreMulSum scalar in an NCCL wire dtype, bit-exactly as torch converts it.

``ncclRedOpCreatePreMulSum`` reads the scalar as one element of the buffer's datatype, so the
scalar must be converted to that type on the host (torch's bf16 PREMUL_SUM hands NCCL a float
and gets zeros; ncclpy does not).  Floating types narrower than float32 go through float32 first,
exactly like ``torch.tensor([x]).to(dtype)`` (round-to-nearest-even at each step):

* float16: IEEE binary16 via numpy;
* bfloat16: RNE of the float32 bits, NaN -> 0x7FC0 (c10::BFloat16);
* float8_e4m3 (e4m3fn: no inf, max 448): torch's ``fp8e4m3fn_from_fp32_value`` (torch >= 2.9):
  RNE, finite overflow and inf saturate to +-448 (0x7E), NaN -> 0x7F;
* float8_e5m2: RNE, overflow to inf 0x7C, NaN 0x7F (``fp8e5m2_from_fp32_value``).

Integer dtypes take an integral scalar (NCCL multiplies integers by an integer).
"""
from __future__ import annotations

import math
import struct
from typing import Any

from .dtypes import DTYPES
from ..errors import ArgumentError, UnsupportedError

__all__ = ["encode_scalar", "float_to_bf16_bits", "float_to_e4m3fn_bits",
           "float_to_e5m2_bits", "float32_bits", "is_finite_bits"]


def float32_bits(x: float) -> int:
    """Bits of ``x`` rounded to float32 (RNE; overflow -> inf, like a C cast)."""
    import numpy as np
    with np.errstate(over="ignore"):
        return int(np.array([x], dtype=np.float64).astype(np.float32).view(np.uint32)[0])


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _f32_add(a_bits: int, b_bits: int) -> int:
    """float32 addition (RNE) of two float32 bit patterns -> bits."""
    import numpy as np
    a = np.array([a_bits], dtype=np.uint32).view(np.float32)
    b = np.array([b_bits], dtype=np.uint32).view(np.float32)
    return int((a + b).view(np.uint32)[0])


def float_to_bf16_bits(x: float) -> int:
    """bfloat16 bits of ``x`` (via float32, round to nearest even; NaN -> 0x7FC0)."""
    if math.isnan(x):
        return 0x7FC0
    u = float32_bits(x)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16) & 0xFFFF


def float_to_e4m3fn_bits(x: float) -> int:
    """float8_e4m3fn bits of ``x`` (via float32), as c10's fp8e4m3fn_from_fp32_value."""
    f = float32_bits(x)
    sign = f & 0x80000000
    f ^= sign
    if f >= (1087 << 20):                    # >= 480.0f in magnitude, inf, NaN
        res = 0x7F if f > 0x7F800000 else 0x7E   # NaN stays NaN, the rest saturates
    elif f < (121 << 23):                    # below 2^-6: denormal via float addition
        denorm = 141 << 23
        res = (_f32_add(f, denorm) - denorm) & 0xFF
    else:
        mant_odd = (f >> 20) & 1
        f = (f + (((7 - 127) << 23) & 0xFFFFFFFF) + 0x7FFFF) & 0xFFFFFFFF
        f += mant_odd
        res = (f >> 20) & 0xFF
        if res == 0x7F:                      # rounding carried into NaN: saturate
            res = 0x7E
    return res | (sign >> 24)


def float_to_e5m2_bits(x: float) -> int:
    """float8_e5m2 bits of ``x`` (via float32), as c10's fp8e5m2_from_fp32_value."""
    f = float32_bits(x)
    sign = f & 0x80000000
    f ^= sign
    if f >= (143 << 23):                     # >= 65536.0f, inf, NaN
        res = 0x7F if f > (255 << 23) else 0x7C
    elif f < (113 << 23):                    # below 2^-14: denormal via float addition
        denorm = 134 << 23
        res = (_f32_add(f, denorm) - denorm) & 0xFF
    else:
        mant_odd = (f >> 21) & 1
        f = (f + (((15 - 127) << 23) & 0xFFFFFFFF) + 0xFFFFF) & 0xFFFFFFFF
        f += mant_odd
        res = (f >> 21) & 0xFF
    return res | (sign >> 24)


def _float16_bits(x: float) -> int:
    import numpy as np
    with np.errstate(over="ignore"):
        v = np.array([x], dtype=np.float64).astype(np.float32).astype(np.float16)
    return int(v.view(np.uint16)[0])


#: exponent-all-ones mask per float wire type (bits value & mask == mask: inf or NaN)
_NONFINITE = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000,
              "float64": 0x7FF0000000000000, "float8_e5m2": 0x7C,
              "float8_e4m3": 0x7F}   # e4m3fn has no inf: this pattern is NaN
_MAX_FINITE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
               "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308,
               "float8_e4m3": 448.0, "float8_e5m2": 57344.0}


def is_finite_bits(bits: int, wire: str) -> bool:
    """Whether ``bits`` of float wire type ``wire`` is a finite value."""
    m = _NONFINITE[wire]
    return (bits & m) != m


def _float_bits(x: float, wire: str) -> int:
    if wire == "float64":
        return struct.unpack("<Q", struct.pack("<d", x))[0]
    if wire == "float32":
        return float32_bits(x)
    if wire == "float16":
        return _float16_bits(x)
    if wire == "bfloat16":
        return float_to_bf16_bits(x)
    if wire == "float8_e4m3":
        return float_to_e4m3fn_bits(x)
    if wire == "float8_e5m2":
        return float_to_e5m2_bits(x)
    raise UnsupportedError(f"no float encoding for wire dtype {wire!r}")  # pragma: no cover


def encode_scalar(value: Any, wire: str, *, what: str = "premul_sum scalar") -> bytes:
    """``value`` as one little-endian element of NCCL wire dtype ``wire``.

    Raises ArgumentError for a finite value that overflows the type (it would become inf/NaN),
    for a non-integral or out-of-range value on an integer type.
    """
    d = DTYPES[wire]
    if d.kind == "float":
        x = float(value)
        bits = _float_bits(x, wire)
        # e4m3fn saturates instead of overflowing: treat what would round past 448 as overflow
        sat = wire == "float8_e4m3" and math.isfinite(x) and \
            (float32_bits(x) & 0x7FFFFFFF) > float32_bits(464.0)
        if math.isfinite(x) and (sat or not is_finite_bits(bits, wire)):
            raise ArgumentError(
                f"{what} {value!r} overflows {wire} (largest finite value "
                f"{_MAX_FINITE[wire]:g}); it would become inf or saturate")
        if not math.isfinite(x):
            raise ArgumentError(f"{what} {value!r} is not finite; expected a finite number")
        if x != 0 and not bits & ((1 << (8 * d.itemsize - 1)) - 1):
            raise ArgumentError(f"{what} {value!r} underflows {wire}: it would become 0; "
                                f"expected 0 or a magnitude {wire} can hold")
        return int(bits).to_bytes(d.itemsize, "little")
    x = float(value) if not isinstance(value, int) else value
    if isinstance(x, float):
        if not math.isfinite(x) or not x.is_integer():
            raise ArgumentError(
                f"{what} {value!r} on integer dtype {wire}: NCCL multiplies integers by an "
                f"integer scalar; expected an integral value")
        x = int(x)
    bits = 8 * d.itemsize
    if d.kind == "int":
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    else:
        lo, hi = 0, (1 << bits) - 1
    if not lo <= x <= hi:
        raise ArgumentError(f"{what} {value!r} is out of range for {wire}; expected "
                            f"{lo} <= scalar <= {hi}")
    return int(x).to_bytes(d.itemsize, "little", signed=d.kind == "int")
