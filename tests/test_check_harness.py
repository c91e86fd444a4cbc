"""``ncclpy check``'s harness, in process: the matrix and its tables (sizes, refusals,
exactness claims, divergence predictions, merging, uneven counts), the comparisons and the
report, and the torch side's conversions (split from tests/test_check_gloo.py, whose real
gloo runs use them)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ncclpy.semantics import numerics as nm
from check_util import cmp, parts
from ncclpy.check import cases as C
from ncclpy.check import compare as K
from ncclpy.check import report as Rp
from ncclpy.check import runner as Rn   # imports no torch itself: torch is passed in


def _torch():
    """torch, for the conversions' tests; the harness's other parts run without it."""
    return pytest.importorskip("torch")


# -- the matrix and its tables --------------------------------------------------------------
def test_parse_sizes():
    assert C.parse_sizes("0,1, 7,1MiB,64KB,2B") == [
        ("0", 0, None), ("1", 1, None), ("7", 7, None), ("1MiB", None, 1 << 20),
        ("64KB", None, 64000), ("2B", None, 2)]
    with pytest.raises(ValueError, match="not a size"):
        C.parse_sizes("1 parsec")


def test_default_cpu_matrix_covers_everything_gloo_runs():
    cases, skipped = C.build_matrix(2, backend="gloo")
    colls = {c.collective for c in cases}
    assert colls == set(C.COLLECTIVES)
    dtypes = {c.dtype for c in cases if c.dtype and c.collective != "send_recv"}
    assert dtypes == {"int8", "uint8", "int32", "int64", "float16", "float32", "float64",
                      "bfloat16", "bool", "complex32", "complex64", "complex128"}
    sizes = {c.size_label for c in cases}
    assert sizes == {"0", "1", "7", "1024", "1MiB"}
    big = [c for c in cases if c.size_label == "1MiB" and c.dtype == "float32"]
    assert big and all(c.count * 4 >= 1 << 20 for c in big)
    assert {c.root for c in cases if c.collective in ("reduce", "gather")} == {0, 1}
    assert {c.in_place for c in cases if c.collective == "all_gather"} == {False, True}
    assert {c.variant for c in cases if c.collective == "all_to_all"} == {"even", "uneven"}
    assert {c.op for c in cases if c.collective == "all_reduce" and c.dtype == "float32"} == \
        {"sum", "prod", "min", "max", "avg"}
    # what gloo refuses is skipped with its reason, never run
    reasons = {(s["collective"], s["dtype"], s["op"]): s["reason"] for s in skipped}
    assert "Invalid scalar type" in reasons[("broadcast", "uint32", None)]
    # gloo's send/recv moves bytes: no dtype dispatch, so it runs every dtype (measured)
    assert {c.dtype for c in cases if c.collective == "send_recv"} == set(C.ALL_DTYPES)
    assert not any(k[0] == "send_recv" for k in reasons)
    assert "PREMUL_SUM" in reasons[("all_reduce", "float32", "premul_sum")]
    assert "Float can't be cast" in reasons[("reduce", "int32", "avg")]
    assert ("gather", "complex64", None) in reasons
    assert not any((c.collective, c.dtype, c.op) in reasons for c in cases)


def test_nccl_matrix_has_all_dtypes_ops_and_inplace():
    cases, skipped = C.build_matrix(4, backend="nccl", sizes="0,7")
    assert not skipped
    assert {c.dtype for c in cases if c.dtype} == set(C.ALL_DTYPES)
    assert {c.op for c in cases if c.collective == "reduce_scatter" and c.dtype == "bfloat16"} \
        == set(C.REDUCING_OPS)
    assert {c.op for c in cases if c.dtype == "complex64" and c.op} == {"sum", "avg",
                                                                        "premul_sum"}
    assert {c.in_place for c in cases if c.collective == "gather"} == {False, True}
    assert {c.root for c in cases if c.collective == "scatter"} == {0, 3}


def test_exactness_claims_and_divergences():
    case = lambda **k: C.Case(**{"collective": "all_reduce", "dtype": "float32", **k})  # noqa
    # the inputs make every finite case exact (tests/test_numerics.py proves it for n 1..16)
    for n in (1, 3, 4, 5, 6, 7, 12):
        assert C.exact_claim(case(op="sum"), n) and C.exact_claim(case(op="avg"), n)
        assert C.exact_claim(case(op="premul_sum", scalar=0.3), n)
        assert C.exact_claim(case(dtype="float8_e5m2", op="sum"), n)
    assert not C.exact_claim(case(op="premul_sum", scalar=float("inf")), 2)
    assert C.exact_claim(case(dtype="int8", op="avg"), 7)
    d = C.divergence("nccl", case(dtype="bfloat16", op="premul_sum", scalar=2.0), 2)
    assert d is not None and d.model == "bf16_premul_low16" and "low 16 bits" in d.reason
    assert C.divergence("gloo", case(dtype="bfloat16", op="premul_sum", scalar=2.0), 2) is None
    assert C.divergence("gloo", case(op="avg"), 3).model == "gloo_avg_div"
    assert C.divergence("gloo", case(dtype="bool", op="sum"), 2).model == "gloo_bool_bytesum"
    assert C.divergence("gloo", case(dtype="bool", op="max"), 2) is None


def test_divergence_predictions():
    """Each divergence predicts torch's wrong output; the check calls a difference a divergence
    only when torch's bytes equal the prediction."""
    from ncclpy.semantics import reference
    from ncclpy.check import divergences as D
    from ncclpy.semantics.scalars import float32_bits
    # torch NCCL bf16 premul_sum(2.0): NCCL reads the float32's low 16 bits (0): zeros
    x = [nm.encode(np.array([1.5, -3.0, 0.25]), "bfloat16") for _ in range(3)]
    c = C.Case("all_reduce", "bfloat16", "premul_sum", 2.0, 3)
    pred = D.predicted_outputs(C.divergence("nccl", c), c, x, 3, "nccl")
    assert all(list(nm.decode(p, "bfloat16")) == [0.0, 0.0, 0.0] for p in pred)
    c = C.Case("reduce_scatter", "bfloat16", "premul_sum", 1.1, 1)
    pred = D.predicted_outputs(C.divergence("nccl", c), c, x, 3, "nccl", rank=1)
    want = reference.reduce_arrays([a[1:2] for a in x], c.op_obj(), "bfloat16", 3,
                                   scalar_bits=float32_bits(1.1) & 0xFFFF)
    assert pred[0] is None and pred[2] is None and np.array_equal(pred[1], want)
    # gloo AVG: sum, then divide (float16 1025 x 3: gloo 1025, NCCL's premultiply 1024)
    h = [np.array([1025.0], np.float16)] * 3
    c = C.Case("reduce", "float16", "avg", None, 1, root=2)
    pred = D.predicted_outputs(C.divergence("gloo", c), c, h, 3, "gloo")
    assert pred[0] is None and pred[1] is None and pred[2][0] == 1025.0
    assert reference.reduce(h, op="avg", root=2)[2][0] == 1024.0
    # gloo's complex reduce divides by complex(n): a multiplication by 1/n rounded
    z = [np.array([0.25 + 0.25j], np.complex64)] * 2 + [np.array([0j], np.complex64)] * 3
    c = C.Case("reduce", "complex64", "avg", None, 1, root=0)
    got = D.predicted_outputs(C.divergence("gloo", c), c, z, 5, "gloo")[0]
    assert got[0] == np.complex64(0.5) * (np.float32(1) / np.float32(5)) * (1 + 1j)
    # gloo bool SUM adds the bytes
    b = [np.array([True, False, True])] * 3
    c = C.Case("all_reduce", "bool", "sum", None, 3)
    got = D.predicted_outputs(C.divergence("gloo", c), c, b, 3, "gloo")[0]
    assert list(got.view(np.uint8)) == [3, 0, 3]


def test_known_refusals_are_narrow():
    from ncclpy.check import divergences as D
    c = lambda coll, dt, op=None: C.Case(coll, dt, op, 2.0 if op == "premul_sum" else None)  # noqa
    # uint32/uint64 and gather of complex are never handed to torch's NCCL backend (its scatter
    # refuses them inside an NCCL group it leaves open): "not called", for nccl only
    assert "leaves open" in D.not_called("nccl", c("scatter", "uint32"))
    assert D.not_called("nccl", c("send_recv", "uint64"))
    assert D.not_called("nccl", c("gather", "complex64"))
    assert D.not_called("nccl", c("scatter", "complex64")) is None     # torch moves these
    assert D.not_called("nccl", c("broadcast", "int32")) is None       # not that dtype
    assert D.not_called("gloo", c("broadcast", "uint32")) is None      # not that backend
    cx = "TypeError: Input tensor data type is not supported for NCCL process group: Complex"
    assert D.known_refusal("nccl", c("reduce", "complex64", "sum"), cx)
    assert D.known_refusal("nccl", c("gather", "complex64"), cx) is None     # not called now
    pm = "TypeError: PreMulSum Data type must be half, float, bfloat16 or double"
    assert D.known_refusal("nccl", c("all_reduce", "int8", "premul_sum"), pm)
    assert D.known_refusal("nccl", c("all_reduce", "float32", "premul_sum"), pm) is None
    assert D.known_refusal("nccl", c("all_reduce", "int8", "premul_sum"),
                           "RuntimeError: NCCL error: unhandled cuda error") is None
    f8 = "RuntimeError: Float8 dtypes are not currenlty supported for NCCL reductions"
    assert D.known_refusal("nccl", c("reduce", "float8_e4m3", "sum"), f8)
    assert D.known_refusal("nccl", c("broadcast", "float8_e4m3"), f8) is None


_parts, _cmp = parts, cmp


def test_merge_a_torch_side_not_called_is_unsupported_and_ncclpy_still_judged():
    case = C.Case("scatter", "uint32", None, None, 7, root=0)
    why = "torch's NCCL backend maps no uint32/uint64 tensor (not called)"
    ctx = {"n": 2, "backend": "nccl", "comm": object()}
    ok = K.merge(case, _parts(2, torch_not_called=why, t_ref=_cmp(None), n_ref=_cmp(True),
                              n_t=_cmp(None)), ctx)
    assert ok["status"] == "unsupported" and why in ok["reason"], ok
    bad = K.merge(case, _parts(2, torch_not_called=why, t_ref=_cmp(None),
                               n_ref=[_cmp(True), _cmp(False, 3.0)], n_t=_cmp(None)), ctx)
    assert bad["status"] == "fail" and "ncclpy != reference on rank(s) [1]" in bad["reason"], bad


def test_merge_statuses():
    ctx = {"n": 2, "backend": "gloo", "comm": None}
    bsum = C.Case("all_reduce", "bool", "sum", None, 4)
    ok = K.merge(bsum, _parts(2, t_ref=_cmp(True)), ctx)
    assert ok["status"] == "pass" and ok["torch_ref"] is True
    div = K.merge(bsum, _parts(2, t_ref=_cmp(False, 1), t_pred=_cmp(True), p_ref=_cmp(False, 1)),
                  ctx)
    assert div["status"] == "torch divergence" and div["torch_ref"] is False
    # the prediction equals NCCL's semantics here: torch != reference is not explained by it
    odd = K.merge(bsum, _parts(2, t_ref=_cmp(False, 1), t_pred=_cmp(True), p_ref=_cmp(True)), ctx)
    assert odd["status"] == "fail"
    # torch differs from the reference AND from the prediction: a mismatch, not a divergence
    bad = K.merge(bsum, _parts(2, t_ref=_cmp(False, 1), t_pred=[_cmp(True), _cmp(False, 1)]),
                  ctx)
    assert bad["status"] == "fail" and "prediction" in bad["reason"]
    f32 = C.Case("all_reduce", "float32", "sum", None, 4)
    assert K.merge(f32, _parts(2, t_ref=[_cmp(True), _cmp(False, 1)]), ctx)["status"] == "fail"
    err = K.merge(f32, _parts(2, t_ref=_cmp(None), torch_exc="RuntimeError: boom"), ctx)
    assert err["status"] == "error" and "boom" in err["reason"]
    # not claimed exact (a non-finite scalar): within the tolerance is reported apart
    inf = C.Case("all_reduce", "float32", "premul_sum", float("inf"), 4)
    w = K.merge(inf, _parts(2, t_ref=_cmp(False, 1)), ctx)
    assert w["status"] == "within ULP" and w["torch_ref"] is False and w["max_ulp"] == 1
    # GPU: refusals by torch must be known ones, and ncclpy must still be right
    g = {"n": 2, "backend": "nccl", "comm": object()}
    u32 = C.Case("broadcast", "uint32", None, None, 4, root=0)
    refused = "TypeError: Input tensor data type is not supported for NCCL process group: UInt32"
    r = K.merge(u32, _parts(2, t_ref=_cmp(None), n_ref=_cmp(True), n_t=_cmp(None),
                            torch_exc=refused), g)
    assert r["status"] == "unsupported" and "uint32" in r["reason"]
    r = K.merge(u32, _parts(2, t_ref=_cmp(None), n_ref=_cmp(False, 3), n_t=_cmp(None),
                            torch_exc=refused), g)
    assert r["status"] == "fail"
    r = K.merge(u32, _parts(2, t_ref=_cmp(None), n_ref=_cmp(True), n_t=_cmp(None),
                            torch_exc="RuntimeError: NCCL communicator was aborted"), g)
    assert r["status"] == "error"
    bp = C.Case("all_reduce", "bfloat16", "premul_sum", 2.0, 4)
    r = K.merge(bp, _parts(2, t_ref=_cmp(False, 9), t_pred=_cmp(True), p_ref=_cmp(False, 9),
                           n_ref=_cmp(True), n_t=_cmp(False, 9)), g)
    assert r["status"] == "torch divergence" and r["ncclpy_torch"] is False
    r = K.merge(bp, _parts(2, t_ref=_cmp(False, 9), t_pred=_cmp(True), p_ref=_cmp(False, 9),
                           n_ref=_cmp(False, 2), n_t=_cmp(False, 9)), g)
    assert r["status"] == "fail"


def test_uneven_counts():
    for n in (2, 3, 4):
        t = C.uneven_counts(5, n)
        assert all(sum(row) > 0 for row in t)
        assert all(sum(t[s][d] for s in range(n)) > 0 for d in range(n))
        assert len({c for row in t for c in row}) > 1
        assert any(c == 0 for row in t for c in row) or n == 2


# -- compare and report ---------------------------------------------------------------------
def test_compare_and_judge():
    a = nm.encode(np.array([1.0, 2.0, 3.0]), "bfloat16")
    b = a.copy()
    b[1] += 2
    c = K.compare(a, b, "bfloat16")
    assert c.equal is False and c.ndiff == 1 and c.first_diff == 1 and c.max_ulp == 2.0
    assert K.judge(c, exact=True, tolerance=0) is False
    assert K.judge(c, exact=False, tolerance=2) is True
    assert K.compare(a, a, "bfloat16").equal is True
    assert K.compare(None, a, "bfloat16").equal is None and K.judge(K.Comparison(None), True, 0) \
        is None
    assert K.compare(a, a[:2], "bfloat16").max_ulp == float("inf")
    flipped = K.flip_one_bit(np.array([True, False]))
    assert list(flipped) == [False, False]
    assert K.flip_one_bit(np.zeros(0, np.float32)).size == 0
    x = np.array([1.0, 2.0], np.float32)
    assert list(K.corrupt(x, "sign")) == [1.0, -2.0]
    assert list(K.corrupt(x, "invert").view(np.uint32)) == list(~x.view(np.uint32))
    assert list(K.corrupt(np.array([True, False]), "invert")) == [False, True]
    with pytest.raises(ValueError):
        K.corrupt(x, "scramble")


def test_report_row_and_summary(tmp_path):
    rec = {"case": {"collective": "reduce", "dtype": "bfloat16", "op": "premul_sum", "scalar": 2.0,
                    "count": 7, "size_label": "7", "root": 1, "in_place": True, "variant": ""},
           "status": "torch divergence", "reason": "why", "torch_ref": False, "max_ulp": 3.0,
           "ncclpy_ran": False}
    row = Rp.format_row(rec)
    assert "premul_sum(2)" in row and "needs GPU" in row and row.endswith("torch divergence: why")
    assert len(Rp.format_header_row().split()) >= 10
    counts = Rp.summarize([rec, dict(rec, status="pass"), dict(rec, status="error"),
                           dict(rec, status="within ULP")], skipped=4)
    assert counts == {"cases": 4, "passed": 0, "passed_torch_only": 1, "passed_reference_only": 0,
                      "failed": 1,
                      "within_ulp": 1, "torch_divergence": 1, "unsupported": 0, "skipped": 4,
                      "ncclpy_cases": 0, "nccl_order_cases": 0, "exact_nccl_order": 0}
    ran = Rp.summarize([dict(rec, status="pass", ncclpy_ran=True), dict(rec, status="pass")])
    assert (ran["passed"], ran["passed_torch_only"], ran["ncclpy_cases"]) == (1, 1, 1)
    assert "float8 reductions" in Rp.format_skip_row(
        {"collective": "all_reduce", "dtype": "float8_e4m3", "op": "sum",
         "reason": "float8 reductions need compute capability 9.0+"})
    p = tmp_path / "x.json"
    Rp.write_json(str(p), {"u": float("inf")})
    assert json.loads(p.read_text()) == {"u": "inf"}


# -- the torch side's conversions -----------------------------------------------------------
@pytest.mark.parametrize("dtype", C.ALL_DTYPES)
def test_torch_roundtrip_keeps_every_bit(dtype):
    torch = _torch()
    a = nm.verifiable_input(dtype, 33, op=None, world_size=2, seed=5, rank=0, random_bits=True)
    t = Rn.to_torch(torch, a, dtype)
    assert t.numel() == 33 and t.dtype == Rn._torch_dtype(torch, dtype)
    back = Rn.from_torch(torch, t, dtype)
    assert np.array_equal(nm.as_bits(back, dtype), nm.as_bits(a, dtype))
    empty = Rn.to_torch(torch, a[:0], dtype)
    assert empty.numel() == 0 and Rn.from_torch(torch, empty, dtype).size == 0


def test_rank_local_inputs_give_the_same_reference():
    cases, _ = C.build_matrix(3, backend="nccl", sizes="5")
    for case in cases[::3]:
        if case.collective == "barrier":
            continue
        full = Rn.case_inputs(case, 3, 9)
        want = Rn.reference_outputs(case, full, 3)
        for r in range(3):
            part = Rn.case_inputs(case, 3, 9, r)
            assert np.array_equal(nm.as_bits(part[r], case.dtype), nm.as_bits(full[r], case.dtype))
            got = Rn.reference_outputs(case, part, 3)[r]
            assert (got is None) == (want[r] is None)
            if got is not None:
                assert np.array_equal(nm.as_bits(got, case.dtype), nm.as_bits(want[r], case.dtype))


def test_inject_spec_parsing():
    assert Rn.parse_inject("all_reduce:1,gather:*:reference:invert") == [
        ("all_reduce", 1, "torch", "bit"), ("gather", None, "reference", "invert")]
    with pytest.raises(ValueError, match="side"):
        Rn.parse_inject("all_reduce:0:harness")
