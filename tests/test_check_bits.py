""""Bit for bit" is not "0 ULP" (issue 40).  ``ncclpy check`` compares outputs as their wire
bits (ncclpy/check/compare.py); the ULP distance only says by how much they differ.  +0 and -0,
and two NaNs whose payload (or sign) differs, are 0 ULP apart -- the monotone mapping puts +0 and
-0 on the same point, and NaN against NaN counts 0 -- yet their bits differ:

* in a case claimed exact (every integer case, and every float case whose verifiable inputs
  make each partial result exact), such a difference is a **failure** (status ``fail``,
  counted in ``failed``: exit status 1);
* in a case not claimed exact (a non-finite premul_sum scalar), the same difference is judged
  by its ULP distance: 0 <= the tolerance, so ``within ULP`` -- reported apart, not a failure.

The comparisons here are computed from real arrays by :func:`compare`, then judged and merged
by the verdict code exactly as ``ncclpy check`` does with what its ranks report.
"""
from __future__ import annotations

import numpy as np
import pytest

from ncclpy.check import cases as C
from ncclpy.check import compare as K
from ncclpy.check import report as Rp

# (dtype, what, reference's bits, output's bits): same value as far as ULPs go, other bits
PAIRS = [
    ("float32", "+0/-0", 0x0000_0000, 0x8000_0000),
    ("float32", "NaN payloads", 0x7FC0_0000, 0x7FC0_0001),
    ("float32", "NaN signs", 0x7FC0_0000, 0xFFC0_0000),
    ("float64", "+0/-0", 0, 0x8000_0000_0000_0000),
    ("float64", "NaN payloads", 0x7FF8_0000_0000_0000, 0x7FF8_0000_0000_0001),
    ("float16", "+0/-0", 0x0000, 0x8000),
    ("float16", "NaN payloads", 0x7E00, 0x7E01),
    ("bfloat16", "+0/-0", 0x0000, 0x8000),
    ("bfloat16", "NaN payloads", 0x7FC0, 0x7FC1),
    ("float8_e4m3", "+0/-0", 0x00, 0x80),
    ("float8_e4m3", "NaN signs", 0x7F, 0xFF),          # e4m3fn's only NaNs
    ("float8_e5m2", "+0/-0", 0x00, 0x80),
    ("float8_e5m2", "NaN payloads", 0x7D, 0x7E),
    ("complex64", "+0/-0 imaginary", 0x0000_0000, 0x8000_0000),
]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ITEM = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "float8_e4m3": 1,
         "float8_e5m2": 1, "complex64": 4}


def _arrays(dtype: str, ref_bits: int, out_bits: int):
    """Four elements as each side reports them: 1.0-ish filler, then the pair at index 2."""
    u = _UINT[_ITEM[dtype]]
    one = {"float32": 0x3F80_0000, "float64": 0x3FF0_0000_0000_0000, "float16": 0x3C00,
           "bfloat16": 0x3F80, "float8_e4m3": 0x38, "float8_e5m2": 0x3C,
           "complex64": 0x3F80_0000}[dtype]
    ref = np.array([one, one, ref_bits, one], dtype=u)
    out = np.array([one, one, out_bits, one], dtype=u)
    if dtype in ("bfloat16", "float8_e4m3", "float8_e5m2"):
        return ref, out                     # carried as their uint view, as the ranks do
    view = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
            "complex64": np.complex64}[dtype]
    return ref.view(view), out.view(view)   # complex64: two elements from four floats


@pytest.mark.parametrize("dtype, what, ref_bits, out_bits", PAIRS,
                         ids=[f"{d}-{w}" for d, w, _, _ in PAIRS])
def test_zero_ulp_apart_is_not_bit_for_bit(dtype, what, ref_bits, out_bits):
    ref, out = _arrays(dtype, ref_bits, out_bits)
    cmp = K.compare(ref, out, dtype)
    assert cmp.equal is False and cmp.ndiff == 1, (what, cmp)
    assert cmp.first_diff == 2          # wire elements: complex64's third float, too
    assert cmp.max_ulp == 0.0, f"{what}: the ULP distance says 'the same value'"
    assert K.judge(cmp, exact=True, tolerance=0.0) is False       # exact: the bits decide
    assert K.judge(cmp, exact=False, tolerance=0.0) is True       # ULPs: 0 <= 0
    assert K.compare(ref, ref.copy(), dtype).equal is True        # the control


def _merged(case: C.Case, cmp: K.Comparison) -> dict:
    """``ncclpy check``'s record of a case in which rank 1's ncclpy output differs from the
    reference (and from torch, which matched it) as ``cmp`` says; rank 0 matched."""
    eq = K.Comparison(True).as_dict()
    parts = [{"rank": 0, "t_ref": eq, "n_ref": eq, "n_t": eq},
             {"rank": 1, "t_ref": eq, "n_ref": cmp.as_dict(), "n_t": cmp.as_dict()}]
    return K.merge(case, parts, {"n": 2, "backend": "gloo", "comm": object()})


@pytest.mark.parametrize("dtype, what, ref_bits, out_bits", PAIRS,
                         ids=[f"{d}-{w}" for d, w, _, _ in PAIRS])
def test_an_exact_case_fails_on_them_and_an_inexact_one_is_within_ulp(dtype, what, ref_bits,
                                                                      out_bits):
    cmp = K.compare(*_arrays(dtype, ref_bits, out_bits), dtype)
    exact_case = C.Case("all_reduce", dtype, "sum", None, 4)
    inexact_case = C.Case("all_reduce", dtype, "premul_sum", float("inf"), 4)
    assert C.exact_claim(exact_case, 2) and not C.exact_claim(inexact_case, 2)

    rec = _merged(exact_case, cmp)
    assert rec["status"] == "fail", rec
    assert rec["exact"] is True and rec["max_ulp"] == 0.0
    assert rec["ncclpy_ref"] is False and rec["ncclpy_torch"] is False
    assert "ncclpy != reference on rank(s) [1]" in rec["reason"]
    assert "ncclpy != torch on rank(s) [1]" in rec["reason"]
    row = Rp.format_row(rec)
    assert " NO " in row and " fail: ncclpy != reference" in row

    soft = _merged(inexact_case, cmp)
    assert soft["status"] == "within ULP", soft
    assert soft["exact"] is False and soft["tolerance"] == 2.0
    assert soft["reason"] == ("not bitwise: max 0 ULP from the reference <= 2, ncclpy vs torch "
                              "max 0 ULP <= 4 (this case is not claimed exact)")
    assert soft["ncclpy_ref"] is False          # still reported as not bit for bit

    counts = Rp.summarize([rec, soft])
    assert (counts["failed"], counts["within_ulp"], counts["passed"]) == (1, 1, 0)
