"""The bench's #wrong (bench/verify.py), pinned on literal values: bitwise means bitwise (+0 and
-0, NaN payloads), AVG on floats allows 2 ULP and not 3, a size mismatch is all wrong, and the
inputs and references are the ones a rank can rebuild for any other rank."""
from __future__ import annotations

import numpy as np
import pytest

from bench import verify


def test_bitwise_counts_each_differing_element_once():
    exp = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    out = exp.copy()
    out[[1, 3]] = [2.5, -4.0]
    assert verify.count_wrong(out, exp, "float32", "sum") == 2
    assert verify.count_wrong(exp.copy(), exp, "float32", "sum") == 0


def test_plus_and_minus_zero_and_nan_payloads_are_different_bits():
    exp = np.array([0.0, np.nan], np.float32)
    out = np.array([-0.0, np.nan], np.float32)
    assert verify.count_wrong(out, exp, "float32", "sum") == 1         # -0 vs +0
    payload = exp.copy().view(np.uint32)
    payload[1] ^= 1                                                       # another quiet NaN
    assert verify.count_wrong(payload.view(np.float32), exp, "float32", "max") == 1
    same_nan = exp.copy()
    assert verify.count_wrong(same_nan, exp, "float32", "sum") == 0


def test_avg_on_floats_accepts_two_ulp_and_not_three():
    exp = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    out = exp.view(np.uint32).copy()
    out += np.array([0, 1, 2, 3], np.uint32)
    got = out.view(np.float32)
    assert verify.count_wrong(got, exp, "float32", "avg") == 1            # only the 3 ULP one
    assert verify.count_wrong(got, exp, "float32", "sum") == 3            # bitwise otherwise
    ints = np.array([5, 6], np.int32)
    assert verify.count_wrong(ints + 1, ints, "int32", "avg") == 2         # ints: exact


def test_a_size_mismatch_is_wrong_everywhere_and_empty_is_right():
    a = np.zeros(3, np.int32)
    assert verify.count_wrong(a, np.zeros(5, np.int32), "int32", "sum") == 5
    assert verify.count_wrong(np.zeros(6, np.int32), a, "int32", "sum") == 6
    assert verify.count_wrong(np.zeros(0, np.int32), np.zeros(0, np.int32), "int32", "sum") == 0


def test_corrupt_flips_the_low_bit_of_the_first_n_only():
    out = np.array([4, 4, 4, 4], np.int32)
    got = verify.corrupt(out, 2)
    assert got.tolist() == [5, 5, 4, 4]
    assert out.tolist() == [4, 4, 4, 4]                                    # a copy
    assert verify.corrupt(np.zeros(0, np.int32), 3).size == 0


def test_rank_inputs_differ_by_rank_and_are_reproducible():
    a0 = verify.rank_input("all_reduce", "int32", "sum", 0, 2, 8, 7)
    a1 = verify.rank_input("all_reduce", "int32", "sum", 1, 2, 8, 7)
    assert a0.shape == (8,) and a0.dtype == np.int32
    assert not np.array_equal(a0, a1)
    assert np.array_equal(a0, verify.rank_input("all_reduce", "int32", "sum", 0, 2, 8, 7))
    b = verify.rank_input("all_reduce", "bfloat16", "sum", 0, 2, 8, 7)
    assert b.dtype == np.uint16 and b.shape == (8,)                        # the host view


def test_expected_on_literal_inputs():
    ins = [np.array([1, 2], np.int32), np.array([10, 20], np.int32)]
    assert [o.tolist() for o in verify.expected("all_reduce", ins, "int32", "sum", -1, 2,
                                                False)] == [[11, 22], [11, 22]]
    assert [o.tolist() for o in verify.expected("all_reduce", ins, "int32", "max", -1, 2,
                                                False)] == [[10, 20], [10, 20]]
    red = verify.expected("reduce", ins, "int32", "sum", 1, 2, False)
    assert red[0] is None and red[1].tolist() == [11, 22]                  # root 1 only
    bc = verify.expected("broadcast", ins, "int32", "none", 1, 2, False)
    assert [o.tolist() for o in bc] == [[10, 20], [10, 20]]
    ag = verify.expected("all_gather", ins, "int32", "none", -1, 2, False)
    assert [o.tolist() for o in ag] == [[1, 2, 10, 20]] * 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_expected_is_returned_as_the_host_view(dtype):
    ins = [verify.rank_input("all_reduce", dtype, "sum", r, 2, 4, 1) for r in range(2)]
    outs = verify.expected("all_reduce", ins, dtype, "sum", -1, 2, False)
    assert all(o.dtype == ins[0].dtype and o.shape == (4,) for o in outs)
