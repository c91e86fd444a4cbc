"""Contracts of ncclpy.semantics.numerics the mutation run found unpinned (docs/testing.md), on
literal bit patterns: the precision of each format, float8 e4m3's NaN (no infinity), and ULP
distances across negative numbers and zero in both the <= 32-bit and the 64-bit paths."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from ncclpy.semantics import numerics as nm


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


@pytest.mark.parametrize("x,e", [(1.0, 0), (8.0, 3), (0.25, -2), (-0.5, -1), (3.0, None),
                                 (0.75, None), (0.0, None), (float("inf"), None),
                                 (float("nan"), None)])
def test_pow2_exp(x, e):
    assert nm._pow2_exp(x) == e


@pytest.mark.parametrize("dtype,k", [("float64", 10 ** 6), ("float32", 10 ** 6),
                                     ("float16", 2047), ("bfloat16", 255), ("float8_e4m3", 15),
                                     ("float8_e5m2", 7)])
def test_min_max_values_are_integers_the_format_holds_exactly(dtype, k):
    assert nm.exact_plan(dtype, "max", 4) == ("minmax", k)
    assert nm.exact_plan(dtype, "min", 2) == ("minmax", k)


def test_a_power_of_two_premul_scalar_keeps_the_sum_exact_and_others_do_not():
    plain = nm.exact_plan("float16", "premul_sum", 4, scalar=1.0)
    assert nm.exact_plan("float16", "premul_sum", 4, scalar=2.0) == plain
    assert nm.exact_plan("float16", "premul_sum", 4, scalar=3.0) == ("unit", 2)


def test_slot_units_deal_to_every_rank_and_no_more_than_k():
    n, k, count = 4, 3, 4000
    for distinct in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # clean numpy: no division by zero etc.
            ms = [nm._slot_units(np.random.default_rng(5), count, n, r, k, distinct)
                  for r in range(n)]
        for r, m in enumerate(ms):
            assert np.count_nonzero(m > 0) > count // 20, (distinct, r)   # every rank dealt
            assert np.count_nonzero(m < 0) > count // 20, (distinct, r)
            assert np.abs(m).max() <= (1 if distinct else k)
        total = np.sum(ms, axis=0)
        assert np.abs(total).max() <= k                  # at most k slots of each sign


def test_values_of_gives_the_values():
    assert nm.values_of(np.array([1.5, -2.0], np.float32), "float32").tolist() == [1.5, -2.0]
    assert nm.values_of(np.array([0x3FC0], np.uint16), "bfloat16").tolist() == [1.5]
