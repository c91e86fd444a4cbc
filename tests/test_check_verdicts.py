"""``ncclpy check``'s comparison and verdicts (ncclpy/check/compare.py), fast and without torch:
compare() and judge() on hand-made arrays, the test-only corruptions, and merge()'s record for
every kind of case (pass, fail naming the ranks, within ULP, torch divergence, unsupported,
error, reference only, barrier).  Every expectation is a literal worked out by hand from the
rules in compare.py's docstring."""
from __future__ import annotations

import numpy as np
import pytest

from check_util import cmp, parts
from ncclpy.check import cases as C
from ncclpy.check import compare as K

INF = float("inf")
GLOO = {"n": 2, "backend": "gloo", "comm": None}          # torch only: ncclpy does not run
NCCL = {"n": 2, "backend": "nccl", "comm": object()}      # GPU: torch and ncclpy
CPU = {"n": 2, "backend": "cpu", "comm": object()}        # ncclpy's CPU backend and gloo

F32 = C.Case("all_reduce", "float32", "sum", None, 4)                  # claimed exact
LOOSE = C.Case("all_reduce", "float32", "premul_sum", INF, 4)          # not claimed exact
BSUM = C.Case("all_reduce", "bool", "sum", None, 4)                    # gloo's byte sum
U32 = C.Case("broadcast", "uint32", None, None, 7, root=0)
BOOL_DIV = ("gloo adds bool bytes (a bool tensor holding 2); torch's NCCL backend maps SUM to "
            "MAX")
U32_REFUSED = "TypeError: Input tensor data type is not supported for NCCL process group: UInt32"
U32_WHY = "torch's NCCL backend maps no uint32/uint64 tensor to an NCCL type"


def _u32(a: np.ndarray) -> list:
    return [int(x) for x in a.view(np.uint32)]


# -- Comparison and compare() ---------------------------------------------------------------
def test_a_comparison_is_its_dict_and_back():
    assert K.Comparison(True).as_dict() == {"equal": True, "max_ulp": 0.0, "ndiff": 0,
                                            "first_diff": -1, "note": ""}
    c = K.Comparison(False, 3.0, 2, 1, "x")
    assert K.Comparison(**c.as_dict()) == c
    assert K.Comparison(None) == K.Comparison(None, 0.0, 0, -1, "")


def test_nothing_to_compare_on_either_side():
    a = np.array([1.0, 2.0], np.float32)
    assert K.compare(None, a, "float32") == K.Comparison(None, 0.0, 0, -1, "")
    assert K.compare(a, None, "float32") == K.Comparison(None, 0.0, 0, -1, "")
    assert K.compare(None, None, "float32") == K.Comparison(None)


def test_identical_bytes_are_equal_in_any_shape():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert K.compare(a, a.copy(), "float32") == K.Comparison(True, 0.0, 0, -1, "")
    assert K.compare(np.zeros(0, np.int8), np.zeros(0, np.int8), "int8") == K.Comparison(True)
    # logical arrays of another numpy type are compared as the dtype's wire bits
    assert K.compare([1, 2, 3], np.array([1, 2, 3], np.int64), "int64").equal is True


def test_sizes_that_differ_are_infinitely_far():
    a, b = np.ones(3, np.float32), np.ones(2, np.float32)
    assert K.compare(a, b, "float32") == K.Comparison(False, INF, 3, 0,
                                                      "sizes differ: 3 vs 2 elements")
    assert K.compare(b, a, "float32") == K.Comparison(False, INF, 3, 0,
                                                      "sizes differ: 2 vs 3 elements")


def test_wire_sizes_that_differ_are_infinitely_far():
    # as many elements, but a complex64 is two floats on the wire: never equal
    c = K.compare(np.array([1 + 2j], np.complex64), np.array([1.0], np.float32), "complex64")
    assert (c.equal, c.max_ulp, c.first_diff, c.note) == (False, INF, 0, "wire sizes differ")


def test_differences_count_their_elements_the_first_and_the_largest_ulp():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    b = a.copy()
    b.view(np.uint32)[0, 1] += 3              # 3 ULPs up at flat index 1
    b.view(np.uint32)[1, 1] -= 1              # 1 ULP down at flat index 3
    assert K.compare(a, b, "float32") == K.Comparison(False, 3.0, 2, 1, "")
    # integers: the largest absolute difference
    got = K.compare(np.array([10, 20, 30], np.int32), np.array([10, 27, 25], np.int32), "int32")
    assert got == K.Comparison(False, 7.0, 2, 1, "")
    got = K.compare(np.array([True, False, True]), np.array([True, True, True]), "bool")
    assert got == K.Comparison(False, 1.0, 1, 1, "")


# -- judge() ---------------------------------------------------------------------------------
def test_judge_is_bitwise_when_exact_and_within_the_tolerance_otherwise():
    two = K.Comparison(False, 2.0, 1, 0)
    assert K.judge(K.Comparison(None), True, 0.0) is None
    assert K.judge(K.Comparison(None), False, 5.0) is None
    assert K.judge(K.Comparison(True), True, 0.0) is True
    assert K.judge(K.Comparison(True), False, 0.0) is True
    assert K.judge(two, True, 0.0) is False
    assert K.judge(two, True, 8.0) is False          # exact: no tolerance applies at all
    assert K.judge(two, False, 2.0) is True          # the bound itself is allowed
    assert K.judge(two, False, 1.0) is False
    assert K.judge(K.Comparison(False, INF, 3, 0), False, 1e9) is False


# -- the test-only corruptions ---------------------------------------------------------------
def test_flip_one_bit_flips_the_lowest_bit_of_the_first_byte_of_a_copy():
    x = np.array([1.0, 2.0], np.float32)               # 0x3F800000, 0x40000000
    y = K.flip_one_bit(x)
    assert _u32(y) == [0x3F800001, 0x40000000] and y.dtype == np.float32
    assert _u32(x) == [0x3F800000, 0x40000000]         # the input is untouched
    one = np.array([7], np.int32)
    assert list(K.flip_one_bit(one)) == [6] and list(one) == [7]
    m = np.array([[True, True], [False, False]])
    assert K.flip_one_bit(m).tolist() == [[False, True], [False, False]]
    empty = np.zeros(0, np.float32)
    assert K.flip_one_bit(empty).size == 0


def test_corrupt_bit_invert_and_sign():
    x = np.array([1.0, 2.0], np.float32)
    assert _u32(K.corrupt(x)) == [0x3F800001, 0x40000000]
    assert _u32(K.corrupt(x, "bit")) == [0x3F800001, 0x40000000]
    assert _u32(K.corrupt(x, "invert")) == [0xC07FFFFF, 0xBFFFFFFF]
    assert _u32(K.corrupt(x, "sign")) == [0x3F800000, 0xC0000000]
    assert _u32(x) == [0x3F800000, 0x40000000]         # never in place
    i = np.array([1, -2, 3], np.int16)
    assert list(K.corrupt(i, "invert")) == [-2, 1, -4] and list(i) == [1, -2, 3]
    assert list(K.corrupt(i, "sign")) == [1, -2, 3 - 32768]
    b = np.array([True, False, False])                # bool bytes stay 0/1
    assert list(K.corrupt(b, "invert")) == [False, True, True]
    assert list(K.corrupt(b, "invert").view(np.uint8)) == [0, 1, 1]
    assert list(K.corrupt(b, "sign").view(np.uint8)) == [1, 0, 1]
    assert list(b) == [True, False, False]
    for how in K.INJECT_KINDS:
        assert K.corrupt(np.zeros(0, np.float32), how).size == 0
    with pytest.raises(ValueError, match="unknown corruption 'scramble'; expected one of "
                                         "bit, invert, sign"):
        K.corrupt(x, "scramble")


# -- several torch backends -------------------------------------------------------------------
def test_with_side_puts_one_backends_verdicts_in_and_joins_the_barrier_times():
    p = {"rank": 1, "barrier": {"ncclpy": (0.0, 1.0)}, "n_ref": cmp(True),
         "by_torch_backend": {"gloo": {"barrier": {"torch": (0.5, 1.5)}, "t_ref": cmp(False, 2)},
                              "nccl": {"barrier": {"torch": (0.6, 1.6)}, "t_ref": cmp(True)}}}
    q = K.with_side(p, p["by_torch_backend"]["gloo"])
    assert q == {"rank": 1, "barrier": {"ncclpy": (0.0, 1.0), "torch": (0.5, 1.5)},
                 "n_ref": cmp(True), "t_ref": cmp(False, 2)}
    assert p["barrier"] == {"ncclpy": (0.0, 1.0)} and "t_ref" not in p
    # a later side's verdicts replace the earlier ones (except the barrier times)
    r = K.with_side({"rank": 0, "t_ref": cmp(True)}, {"t_ref": cmp(None)})
    assert r == {"rank": 0, "t_ref": cmp(None)}
    split = K.backend_parts([p], "nccl")
    assert split == [{"rank": 1, "barrier": {"ncclpy": (0.0, 1.0), "torch": (0.6, 1.6)},
                      "n_ref": cmp(True), "t_ref": cmp(True)}]
    plain = [{"rank": 0, "t_ref": cmp(True)}]
    assert K.backend_parts(plain, "gloo") == plain and K.backend_parts(plain, "x")[0] is plain[0]


# -- merge(): pass, fail, within ULP --------------------------------------------------------
def test_a_bitwise_pass_and_its_whole_record():
    ps = parts(2, t_ref=cmp(True))
    rec = K.merge(F32, ps, GLOO)
    assert rec == {"case": {"collective": "all_reduce", "dtype": "float32", "op": "sum",
                            "scalar": None, "count": 4, "size_label": "0", "root": None,
                            "in_place": False, "variant": "", "inputs": "verifiable"},
                   "key": "all_reduce/float32/sum/4/-/oop", "ncclpy_ran": False,
                   "exact": True, "tolerance": 0.0, "torch_ref": True, "max_ulp": 0.0,
                   "ranks": ps, "status": "pass"}
    g = K.merge(F32, parts(2, t_ref=cmp(True), n_ref=cmp(True), n_t=cmp(True)), NCCL)
    assert (g["status"], g["ncclpy_ran"], g["torch_ref"], g["ncclpy_ref"], g["ncclpy_torch"],
            g["max_ulp"]) == ("pass", True, True, True, True, 0.0)
    assert "reason" not in g and "injected" not in g
    # a rank with nothing to compare (an undefined output) does not spoil the pass
    r = K.merge(F32, parts(2, t_ref=[cmp(True), cmp(None)]), GLOO)
    assert (r["status"], r["torch_ref"]) == ("pass", True)


def test_an_exact_case_fails_on_one_bit_and_names_the_ranks():
    r = K.merge(F32, parts(3, t_ref=[cmp(True), cmp(False, 1), cmp(False, 4)]),
                dict(GLOO, n=3))
    assert (r["status"], r["torch_ref"], r["max_ulp"]) == ("fail", False, 4.0)
    assert r["reason"] == "torch != reference on rank(s) [1, 2]"
    # ncclpy wrong on rank 0 only, torch right everywhere: torch is not blamed
    r = K.merge(F32, parts(2, t_ref=cmp(True), n_ref=[cmp(False, 7), cmp(True)],
                           n_t=[cmp(False, 7), cmp(True)]), NCCL)
    assert (r["status"], r["torch_ref"], r["ncclpy_ref"], r["ncclpy_torch"], r["max_ulp"]) == \
        ("fail", True, False, False, 7.0)
    assert r["reason"] == "ncclpy != reference on rank(s) [0]; ncclpy != torch on rank(s) [0]"
    # ncclpy and torch agree with each other but not with the reference
    r = K.merge(F32, parts(2, t_ref=[cmp(True), cmp(False, 2)], n_ref=[cmp(True), cmp(False, 2)],
                           n_t=cmp(True)), NCCL)
    assert r["reason"] == ("torch != reference on rank(s) [1]; "
                           "ncclpy != reference on rank(s) [1]")
    assert (r["ncclpy_torch"], r["max_ulp"]) == (True, 2.0)


def test_exactness_and_the_tolerance_are_recorded():
    r = K.merge(F32, parts(3, t_ref=cmp(True)), dict(GLOO, n=3))
    assert (r["exact"], r["tolerance"]) == (True, 0.0)
    r = K.merge(LOOSE, parts(3, t_ref=cmp(True)), dict(GLOO, n=3))
    assert (r["exact"], r["tolerance"], r["status"]) == (False, 3.0, "pass")


def test_a_case_not_claimed_exact_is_within_ulp_up_to_the_tolerance_and_no_further():
    ctx = dict(GLOO, n=3)                                  # tolerance: 3 ULPs
    w = K.merge(LOOSE, parts(3, t_ref=[cmp(True), cmp(False, 3), cmp(False, 1)]), ctx)
    assert (w["status"], w["torch_ref"], w["max_ulp"]) == ("within ULP", False, 3.0)
    assert w["reason"] == ("not bitwise: max 3 ULP from the reference <= 3 "
                           "(this case is not claimed exact)")
    f = K.merge(LOOSE, parts(3, t_ref=[cmp(True), cmp(False, 4), cmp(False, 1)]), ctx)
    assert (f["status"], f["max_ulp"]) == ("fail", 4.0)
    assert f["reason"] == "torch != reference on rank(s) [1, 2]"


def test_within_ulp_with_ncclpy_allows_twice_the_tolerance_between_ncclpy_and_torch():
    # tolerance 2 (n = 2): each side within 2 ULPs of the reference, so up to 4 between them
    ok = parts(2, t_ref=cmp(False, 2), n_ref=cmp(False, 1), n_t=cmp(False, 3))
    w = K.merge(LOOSE, ok, NCCL)
    assert (w["status"], w["max_ulp"], w["ncclpy_ref"], w["ncclpy_torch"]) == \
        ("within ULP", 3.0, False, False)
    assert w["reason"] == ("not bitwise: max 2 ULP from the reference <= 2, ncclpy vs torch "
                           "max 3 ULP <= 4 (this case is not claimed exact)")
    w = K.merge(LOOSE, parts(2, t_ref=cmp(False, 2), n_ref=cmp(False, 2), n_t=cmp(False, 4)),
                NCCL)
    assert w["status"] == "within ULP"
    f = K.merge(LOOSE, parts(2, t_ref=cmp(False, 2), n_ref=cmp(False, 2),
                             n_t=[cmp(True), cmp(False, 5)]), NCCL)
    assert (f["status"], f["max_ulp"]) == ("fail", 5.0)
    assert "ncclpy != torch on rank(s) [1]" in f["reason"]
    assert "torch != reference" not in f["reason"]       # torch itself is within its bound
    # ncclpy past the tolerance, torch within it: only ncclpy is blamed
    f = K.merge(LOOSE, parts(2, t_ref=[cmp(True), cmp(False, 1)], n_ref=[cmp(False, 9), cmp(True)],
                             n_t=[cmp(False, 9), cmp(False, 1)]), NCCL)
    assert f["reason"] == ("ncclpy != reference on rank(s) [0]; "
                           "ncclpy != torch on rank(s) [0, 1]")
    # torch past it: torch is blamed even where ncclpy is within it
    f = K.merge(LOOSE, parts(2, t_ref=cmp(False, 3), n_ref=cmp(True), n_t=cmp(False, 3)),
                NCCL)
    assert f["reason"].startswith("torch != reference on rank(s) [0, 1]; ")


def test_a_corruption_on_purpose_is_named_in_the_record_and_the_reason():
    ps = parts(2, t_ref=[cmp(False, 1), cmp(True)], injected=["torch:bit", "reference:sign"])
    r = K.merge(F32, ps, GLOO)
    assert r["injected"] == "reference:sign, torch:bit"
    assert r["reason"] == ("torch != reference on rank(s) [0] (corrupted on purpose by "
                           "NCCLPY_CHECK_INJECT: reference:sign, torch:bit)")
    r = K.merge(F32, parts(2, t_ref=[cmp(False, 1), cmp(True)], injected=["", "torch:bit"]),
                GLOO)
    assert r["injected"] == "torch:bit"
    assert "injected" not in K.merge(F32, parts(2, t_ref=cmp(False, 1)), GLOO)


# -- merge(): documented torch divergences ---------------------------------------------------
def test_a_divergence_explains_torch_only_where_torch_equals_its_prediction():
    d = K.merge(BSUM, parts(2, t_ref=cmp(False, 1), t_pred=cmp(True), p_ref=cmp(False, 1)),
                GLOO)
    assert (d["status"], d["reason"], d["torch_ref"], d["max_ulp"]) == \
        ("torch divergence", BOOL_DIV, False, 1.0)
    # reduce_scatter: the divergence shows on rank 0's block only; rank 1 is plainly right
    rs = C.Case("reduce_scatter", "bool", "sum", None, 4)
    d = K.merge(rs, parts(2, t_ref=[cmp(False, 1), cmp(True)], t_pred=cmp(True),
                          p_ref=[cmp(False, 1), cmp(True)]), GLOO)
    assert d["status"] == "torch divergence"
    # reduce: only the root's output is defined
    red = C.Case("reduce", "bool", "sum", None, 4, root=0)
    d = K.merge(red, parts(2, t_ref=[cmp(False, 1), cmp(None)], t_pred=[cmp(True), cmp(None)],
                           p_ref=[cmp(False, 1), cmp(None)]), GLOO)
    assert d["status"] == "torch divergence"


def test_a_divergence_that_does_not_explain_torch_is_a_failure():
    # torch differs from its prediction on rank 1: a real mismatch
    f = K.merge(BSUM, parts(2, t_ref=cmp(False, 1), t_pred=[cmp(True), cmp(False, 1)],
                            p_ref=cmp(False, 1)), GLOO)
    assert f["status"] == "fail"
    assert f["reason"] == ("torch != reference on rank(s) [0, 1]; torch also differs from the "
                           "documented divergence's prediction (gloo_bool_bytesum)")
    # the prediction equals NCCL's semantics on rank 0: the divergence cannot be what shows
    f = K.merge(BSUM, parts(2, t_ref=cmp(False, 1), t_pred=cmp(True),
                            p_ref=[cmp(True), cmp(False, 1)]), GLOO)
    assert f["status"] == "fail"
    # no prediction at all (torch's output was not compared with one)
    f = K.merge(BSUM, parts(2, t_ref=cmp(False, 1)), GLOO)
    assert f["status"] == "fail" and "prediction" in f["reason"]


def test_torch_right_in_a_divergence_cell_passes():
    p = K.merge(BSUM, parts(2, t_ref=cmp(True), t_pred=cmp(True), p_ref=cmp(True)), GLOO)
    assert p["status"] == "pass"
    # a divergence cell where torch is right and ncclpy is not: no word of the divergence
    f = K.merge(BSUM, parts(2, t_ref=cmp(True), n_ref=[cmp(True), cmp(False, 1)],
                            n_t=[cmp(True), cmp(False, 1)]), CPU)
    assert f["reason"] == ("ncclpy != reference on rank(s) [1]; "
                           "ncclpy != torch on rank(s) [1]")


def test_a_divergence_does_not_excuse_ncclpy():
    ok = K.merge(BSUM, parts(2, t_ref=cmp(False, 1), t_pred=cmp(True), p_ref=cmp(False, 1),
                             n_ref=cmp(True), n_t=cmp(False, 1)), CPU)
    assert (ok["status"], ok["reason"], ok["ncclpy_ref"]) == ("torch divergence", BOOL_DIV, True)
    bad = K.merge(BSUM, parts(2, t_ref=cmp(False, 1), t_pred=cmp(True), p_ref=cmp(False, 1),
                              n_ref=[cmp(True), cmp(False, 1)], n_t=cmp(False, 1)), CPU)
    assert (bad["status"], bad["reason"]) == \
        ("fail", f"ncclpy != reference on rank(s) [1] (torch: {BOOL_DIV})")


# -- merge(): exceptions, refusals, reference only ------------------------------------------
def test_an_unknown_torch_exception_is_an_error():
    ps = parts(2, t_ref=cmp(None))
    ps[1]["torch_exc"] = "RuntimeError: boom"
    r = K.merge(F32, ps, GLOO)
    assert (r["status"], r["reason"]) == ("error", "torch rank 1: RuntimeError: boom")
    # gloo has no known refusals: NCCL's refusal text means nothing there
    r = K.merge(U32, parts(2, t_ref=cmp(None), torch_exc=U32_REFUSED), GLOO)
    assert (r["status"], r["reason"]) == ("error", f"torch rank 0: {U32_REFUSED}")
    r = K.merge(U32, parts(2, t_ref=cmp(None), n_ref=cmp(True), n_t=cmp(None),
                           torch_exc="RuntimeError: NCCL communicator was aborted"), NCCL)
    assert (r["status"], r["reason"]) == \
        ("error", "torch rank 0: RuntimeError: NCCL communicator was aborted")


def test_a_known_torch_refusal_is_unsupported_and_ncclpy_is_still_judged():
    ok = K.merge(U32, parts(2, t_ref=cmp(None), n_ref=cmp(True), n_t=cmp(None),
                            torch_exc=U32_REFUSED), NCCL)
    assert (ok["status"], ok["reason"]) == ("unsupported",
                                            f"torch rank 0: {U32_WHY} ({U32_REFUSED})")
    bad = K.merge(U32, parts(2, t_ref=cmp(None), n_ref=[cmp(True), cmp(False, 3)],
                             n_t=cmp(None), torch_exc=U32_REFUSED), NCCL)
    assert (bad["status"], bad["reason"]) == \
        ("fail", f"ncclpy != reference on rank(s) [1]; torch rank 0: {U32_WHY} ({U32_REFUSED})")


def test_torch_not_called_on_nccl_is_unsupported_not_reference_only():
    why = C.torch_not_called("nccl", U32)
    ok = K.merge(U32, parts(2, torch_not_called=why, t_ref=cmp(None), n_ref=cmp(True),
                            n_t=cmp(None)), NCCL)
    assert (ok["status"], ok["reason"]) == ("unsupported", f"torch rank 0: {why}")
    bad = K.merge(U32, parts(2, torch_not_called=why, t_ref=cmp(None),
                             n_ref=[cmp(False, 3), cmp(True)], n_t=cmp(None)), NCCL)
    assert (bad["status"], bad["reason"]) == \
        ("fail", f"ncclpy != reference on rank(s) [0]; torch rank 0: {why}")


def test_ncclpy_exceptions_typed_refusals_are_unsupported_others_errors():
    typed = K.merge(F32, parts(2, t_ref=cmp(True), n_ref=cmp(None), n_t=cmp(None),
                               ncclpy_exc="UnsupportedError: no", ncclpy_typed=True), NCCL)
    assert (typed["status"], typed["reason"]) == ("unsupported",
                                                  "ncclpy rank 0: UnsupportedError: no")
    err = K.merge(F32, parts(2, t_ref=cmp(True), n_ref=cmp(None), n_t=cmp(None),
                             ncclpy_exc="RuntimeError: boom", ncclpy_typed=False), NCCL)
    assert (err["status"], err["reason"]) == ("error", "ncclpy rank 0: RuntimeError: boom")
    ps = parts(2, t_ref=cmp(True), n_ref=cmp(None), n_t=cmp(None))
    ps[1]["ncclpy_exc"] = "RuntimeError: late"            # no ncclpy_typed at all
    r = K.merge(F32, ps, NCCL)
    assert (r["status"], r["reason"]) == ("error", "ncclpy rank 1: RuntimeError: late")


def test_reference_only_where_gloo_cannot_run_the_case():
    why = C.torch_not_called("cpu", U32)
    ok = K.merge(U32, parts(2, torch_not_called=why, t_ref=cmp(None), n_ref=cmp(True),
                            n_t=cmp(None)), CPU)
    assert (ok["status"], ok["reason"]) == ("reference only",
                                            f"ncclpy == reference; torch not compared: {why}")
    assert (ok["torch_ref"], ok["ncclpy_ref"], ok["ncclpy_torch"]) == (None, True, None)
    bad = K.merge(U32, parts(2, torch_not_called=why, t_ref=cmp(None),
                             n_ref=[cmp(True), cmp(False, 2)], n_t=cmp(None)), CPU)
    assert (bad["status"], bad["reason"]) == \
        ("fail", f"ncclpy != reference on rank(s) [1]; torch rank 0: {why}")
    # ncclpy refused on one rank: nothing was compared there, so not "reference only"
    ps = parts(2, torch_not_called=why, t_ref=cmp(None), n_ref=[cmp(None), cmp(True)],
               n_t=cmp(None))
    ps[0].update(ncclpy_exc="UnsupportedError: no", ncclpy_typed=True)
    r = K.merge(U32, ps, CPU)
    assert (r["status"], r["reason"]) == ("unsupported", f"torch rank 0: {why}")
    # one rank (ncclpy check -n 1 --backend cpu)
    one = K.merge(U32, parts(1, torch_not_called=why, t_ref=cmp(None), n_ref=cmp(True),
                             n_t=cmp(None)), dict(CPU, n=1))
    assert (one["status"], one["reason"]) == ("reference only",
                                              f"ncclpy == reference; torch not compared: {why}")
    # ncclpy compared nothing at all: not "reference only" either
    r = K.merge(U32, parts(2, torch_not_called=why, t_ref=cmp(None), n_ref=cmp(None),
                           n_t=cmp(None)), CPU)
    assert r["status"] == "unsupported"


# -- merge(): barrier -----------------------------------------------------------------------
BAR = C.Case("barrier", None, None, None, 0)


def _bar(**sides):
    """Per-rank barrier parts from ``side=[(arrival, leave), ...]``."""
    n = len(next(iter(sides.values())))
    return [{"rank": r, "barrier": {s: t[r] for s, t in sides.items() if t[r] is not None}}
            for r in range(n)]


def test_a_barrier_passes_when_no_rank_leaves_before_the_last_arrival():
    ok = K.merge(BAR, _bar(torch=[(0.0, 1.5), (1.0, 1.2)]), GLOO)
    assert ok == {"case": {"collective": "barrier", "dtype": None, "op": None, "scalar": None,
                           "count": 0, "size_label": "0", "root": None, "in_place": False,
                           "variant": "",
                           "inputs": "verifiable"},
                  "key": "barrier/-/-/0/-/oop", "ncclpy_ran": False, "torch_ref": True,
                  "max_ulp": None, "status": "pass"}
    # leaving at the last arrival itself, or up to 1e-4 s before it (clock skew), is fine
    assert K.merge(BAR, _bar(torch=[(0.0, 1.0), (1.0, 1.0)]), GLOO)["status"] == "pass"
    assert K.merge(BAR, _bar(torch=[(0.0, 1.0 - 1e-4), (1.0, 1.1)]), GLOO)["status"] == "pass"
    early = K.merge(BAR, _bar(torch=[(0.0, 1.0 - 2e-4), (1.0, 1.1)]), GLOO)
    assert (early["status"], early["torch_ref"]) == ("fail", False)
    assert early["reason"] == "a rank left the barrier before the last one arrived"


def test_a_barrier_with_ncclpy_judges_both_sides():
    good = [(0.0, 1.5), (1.0, 1.2)]
    bad = [(0.0, 0.5), (1.0, 1.2)]
    ok = K.merge(BAR, _bar(torch=good, ncclpy=good), NCCL)
    assert (ok["status"], ok["torch_ref"], ok["ncclpy_ref"], ok["ncclpy_ran"]) == \
        ("pass", True, True, True)
    assert "reason" not in ok
    r = K.merge(BAR, _bar(torch=good, ncclpy=bad), NCCL)
    assert (r["status"], r["torch_ref"], r["ncclpy_ref"]) == ("fail", True, False)
    r = K.merge(BAR, _bar(torch=bad, ncclpy=good), NCCL)
    assert (r["status"], r["torch_ref"], r["ncclpy_ref"]) == ("fail", False, True)
    # a side without times on some rank did not pass
    r = K.merge(BAR, _bar(torch=good, ncclpy=[good[0], None]), NCCL)
    assert (r["status"], r["ncclpy_ref"]) == ("fail", False)
    r = K.merge(BAR, _bar(torch=[None, good[1]]), GLOO)
    assert (r["status"], r["torch_ref"]) == ("fail", False)


def test_a_barrier_that_raised_is_an_error():
    ps = _bar(torch=[(0.0, 1.5), (1.0, 1.2)], ncclpy=[(0.0, 1.5), (1.0, 1.2)])
    ps[1]["ncclpy_error"] = "RuntimeError: boom"
    r = K.merge(BAR, ps, NCCL)
    assert (r["status"], r["reason"]) == ("error", "ncclpy_error rank 1: RuntimeError: boom")
    ps = _bar(torch=[(0.0, 1.5), (1.0, 1.2)])
    ps[0]["torch_error"] = "RuntimeError: gone"
    r = K.merge(BAR, ps, GLOO)
    assert (r["status"], r["reason"]) == ("error", "torch_error rank 0: RuntimeError: gone")


# -- within ULP: each side's own words; which sides are exact ------------------------------------
BOUND = {**cmp(False, 5), "bound_ok": True}     # normal/revealing inputs: within the bound


def test_within_ulp_by_the_order_free_bound_names_each_side_that_ran_and_only_those():
    """A side with nothing compared, and ncclpy where it did not run, say nothing; a side
    exact against rank order says so; one within the bound says that, not a ULP count."""
    gloo = K.merge(LOOSE, parts(2, t_ref=BOUND, n_ref=cmp(True)), GLOO)   # ncclpy did not run
    assert (gloo["status"], gloo["reason"]) == (
        "within ULP", "torch within the order-free bound of the rank-order reference (not "
                      "claimed exact: verifiable inputs)")
    both = K.merge(LOOSE, parts(2, t_ref=BOUND, n_ref=cmp(True), n_t=cmp(False, 1)), NCCL)
    assert (both["status"], both["reason"]) == (
        "within ULP", "ncclpy == the rank-order reference bit for bit; torch within the "
                      "order-free bound of the rank-order reference (not claimed exact: "
                      "verifiable inputs)")
    unseen = K.merge(LOOSE, parts(2, t_ref=BOUND, n_t=cmp(False, 1)), NCCL)   # no n_ref at all
    assert unseen["reason"] == gloo["reason"]


def test_ncclpy_in_nccls_order_and_gloo_in_rank_order_are_not_held_to_each_other():
    """CPU backend, a case not claimed exact: ncclpy is judged against NCCL's order and gloo
    against rank order, so ncclpy vs torch is not compared (they fold differently on
    purpose); the case is exact only where torch was not called at all."""
    ps = parts(2, ref_kind="nccl-order", ref_config="x", n_nccl=cmp(True), n_ref=cmp(False, 1),
               t_ref=cmp(True), n_t=cmp(False, 50))
    r = K.merge(LOOSE, ps, CPU)
    assert (r["status"], r["ncclpy_torch"], r["exact"]) == ("pass", None, False)
    ps = parts(2, ref_kind="nccl-order", ref_config="x", n_nccl=cmp(True), n_ref=cmp(True),
               torch_not_called="gloo cannot", n_t=cmp(None))
    r = K.merge(LOOSE, ps, CPU)
    assert (r["status"], r["exact"]) == ("reference only", True)
    assert r["reason"] == "ncclpy == NCCL's order; torch not compared: gloo cannot"
