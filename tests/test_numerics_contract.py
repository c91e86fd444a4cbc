"""Contracts of ncclpy.numerics the mutation run found unpinned (docs/testing.md), on literal
bit patterns: the precision of each format, float8 e4m3's NaN (no infinity), and ULP distances
across negative numbers and zero in both the <= 32-bit and the 64-bit paths."""
from __future__ import annotations

import numpy as np
import pytest

from ncclpy import numerics as nm


@pytest.mark.parametrize("dtype,p", [("float64", 53), ("float32", 24), ("float16", 11),
                                     ("bfloat16", 8), ("float8_e4m3", 4), ("float8_e5m2", 3)])
def test_mantissa_bits_is_the_precision(dtype, p):
    assert nm.mantissa_bits(dtype) == p


def test_float8_e4m3_has_nan_at_the_top_and_no_infinity():
    got = nm.decode(np.array([0x7F, 0xFF, 0x7E, 0xFE, 0x78], np.uint8), "float8_e4m3")
    assert np.isnan(got[0]) and np.isnan(got[1])
    assert got[2:].tolist() == [448.0, -448.0, 256.0]
    e5 = nm.decode(np.array([0x7C, 0xFC, 0x7D, 0x7B], np.uint8), "float8_e5m2")
    assert e5[0] == np.inf and e5[1] == -np.inf and np.isnan(e5[2]) and e5[3] == 57344.0


@pytest.mark.parametrize("dtype,bits,one", [("float32", np.uint32, 0x3F800000),
                                            ("float16", np.uint16, 0x3C00),
                                            ("float64", np.uint64, 0x3FF0000000000000)])
def test_ulp_distance_is_monotone_through_negatives_and_zero(dtype, bits, one):
    sign = bits(1) << bits(8 * np.dtype(bits).itemsize - 1)
    a = np.array([one | sign, one | sign, 0, 1 | sign, sign, one], bits)
    b = np.array([(one + 1) | sign, (one + 3) | sign, 1, 1, 0, one | sign], bits)
    got = nm.ulp_distance(a, b, dtype)
    # -1 vs the next below it; 3 apart; +0 vs the smallest subnormal; -tiny vs +tiny is 2
    # (through both zeros, which are 0 apart); -0 vs +0; +1 vs -1
    assert [int(x) for x in got[:5]] == [1, 3, 1, 2, 0]
    assert int(got[5]) == 2 * one
