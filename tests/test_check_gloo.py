"""``ncclpy check`` on CPU: torch.distributed's gloo backend against the reference, in real
processes (2, 3 and 4 ranks), plus the harness's parts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ncclpy import numerics as nm
from ncclpy.check import cases as C
from ncclpy.check import compare as K
from ncclpy.check import report as Rp

torch = pytest.importorskip("torch")
from ncclpy.check import runner as Rn  # noqa: E402  (imports no torch itself, but uses it)

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str, env: dict | None = None, timeout: float = 240.0,
              launcher: bool = False) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT"):
        e.pop(k, None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    cmd = [sys.executable, "-m", "ncclpy"]
    if launcher:
        n = args[args.index("-n") + 1]
        cmd += ["run", "-n", n, "-m", "ncclpy", "check"] + [a for a in args]
    else:
        cmd += ["check", *args]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


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
    dtypes = {c.dtype for c in cases if c.dtype}
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
    assert C.exact_claim(case(op="sum"), 3)
    assert C.exact_claim(case(op="avg"), 4) and C.exact_claim(case(op="avg"), 3)
    assert not C.exact_claim(case(op="avg"), 5)
    assert C.exact_claim(case(op="premul_sum", scalar=0.5), 6)
    assert not C.exact_claim(case(op="premul_sum", scalar=0.3), 2)
    assert C.exact_claim(case(dtype="int8", op="avg"), 7)
    d = C.divergence("nccl", case(dtype="bfloat16", op="premul_sum", scalar=2.0), 2)
    assert d is not None and d.when == "always" and "float" in d.reason
    assert C.divergence("gloo", case(dtype="bfloat16", op="premul_sum", scalar=2.0), 2) is None
    assert C.divergence("gloo", case(op="avg"), 4) is None          # power of two: exact
    assert C.divergence("gloo", case(op="avg"), 3).when == "mismatch"
    assert C.divergence("gloo", case(dtype="bool", op="sum"), 2) is not None


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


def test_report_row_and_summary(tmp_path):
    rec = {"case": {"collective": "reduce", "dtype": "bfloat16", "op": "premul_sum", "scalar": 2.0,
                    "count": 7, "size_label": "7", "root": 1, "in_place": True, "variant": ""},
           "status": "torch divergence", "reason": "why", "torch_ref": False, "max_ulp": 3.0,
           "ncclpy_ran": False}
    row = Rp.format_row(rec)
    assert "premul_sum(2)" in row and "needs GPU" in row and row.endswith("torch divergence: why")
    assert len(Rp.format_header_row().split()) >= 10
    counts = Rp.summarize([rec, dict(rec, status="pass"), dict(rec, status="error")], skipped=4)
    assert counts == {"cases": 3, "passed": 1, "failed": 1, "torch_divergence": 1,
                      "unsupported": 0, "skipped": 4}
    p = tmp_path / "x.json"
    Rp.write_json(str(p), {"u": float("inf")})
    assert json.loads(p.read_text()) == {"u": "inf"}


# -- the torch side's conversions -----------------------------------------------------------
@pytest.mark.parametrize("dtype", C.ALL_DTYPES)
def test_torch_roundtrip_keeps_every_bit(dtype):
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


# -- real runs ------------------------------------------------------------------------------
def _summary(out: str) -> str:
    lines = [ln for ln in out.splitlines() if " cases on " in ln]
    assert lines, out
    return lines[-1]


def test_check_two_ranks_default_matrix(tmp_path):
    js = tmp_path / "check.json"
    p = run_check("-n", "2", "-q", "--json", str(js))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = _summary(p.stdout)
    assert " 0 failed" in s and "(gloo)" in s
    doc = json.loads(js.read_text())
    assert doc["exit_code"] == 0 and doc["summary"]["failed"] == 0
    assert doc["summary"]["passed"] > 1500
    assert doc["header"]["backend"] == "gloo" and doc["header"]["world_size"] == 2
    statuses = {c["status"] for c in doc["cases"]}
    assert statuses <= {"pass", "torch divergence"}
    for c in doc["cases"]:
        if c["status"] == "torch divergence":    # the documented gloo ones only
            assert c["case"]["dtype"] in ("bool", "float16", "float32", "float64", "bfloat16",
                                          "complex32", "complex64", "complex128")
    assert {c["case"]["collective"] for c in doc["cases"]} == set(C.COLLECTIVES)
    assert "ncclpy column: needs GPU" in p.stdout


#: every collective, fewer dtypes and sizes (the 2-rank run covers all of them)
FILTER = {3: ["--dtypes", "float32,bfloat16,int32,bool,complex64", "--sizes", "0,1,7,1MiB"],
          4: ["--dtypes", "float32,bfloat16,int32,bool,complex64", "--sizes", "0,1,7,65536"]}


@pytest.mark.parametrize("n", [3, 4])
def test_check_three_and_four_ranks_every_collective(n, tmp_path):
    js = tmp_path / "check.json"
    p = run_check("-n", str(n), "-q", "--json", str(js), *FILTER[n])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(js.read_text())
    assert doc["summary"]["failed"] == 0 and doc["header"]["world_size"] == n
    assert {c["case"]["collective"] for c in doc["cases"]} == set(C.COLLECTIVES)
    assert {c["case"]["root"] for c in doc["cases"] if c["case"]["collective"] == "scatter"} \
        == {0, n - 1}


def test_injected_corruption_is_a_mismatch(tmp_path):
    js = tmp_path / "inj.json"
    p = run_check("-n", "2", "--collectives", "reduce_scatter,broadcast", "--dtypes",
                  "float32,int8", "--sizes", "0,5", "--json", str(js),
                  env={"NCCLPY_CHECK_INJECT": "reduce_scatter:1"})
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(js.read_text())
    bad = [c for c in doc["cases"] if c["status"] == "fail"]
    assert bad and all(c["case"]["collective"] == "reduce_scatter" and c.get("injected")
                       for c in bad)
    assert all(c["case"]["count"] == 5 for c in bad)       # size 0 has no byte to flip
    assert all(c["status"] == "pass" for c in doc["cases"]
               if c["case"]["collective"] == "broadcast")
    assert "torch != reference on rank(s) [1]" in p.stdout
    assert " failed" in _summary(p.stdout) and " 0 failed" not in _summary(p.stdout)


def test_runs_under_the_launcher_with_rank_env():
    p = run_check("-n", "2", "--collectives", "all_to_all,send_recv,barrier", "--dtypes",
                  "float16", "--sizes", "3", launcher=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[rank 0]" in p.stdout and " 0 failed" in _summary(p.stdout)


def test_cli_listing_and_errors():
    p = run_check("--list-skips", "-n", "2")
    assert p.returncode == 0 and "PREMUL_SUM" in p.stdout and "uint64" in p.stdout
    p = run_check("--list", "-n", "3", "--collectives", "gather", "--dtypes", "int8",
                  "--sizes", "4")
    assert p.returncode == 0 and "gather/int8/-/4/0/oop" in p.stdout
    p = run_check("--ops", "band")
    assert p.returncode == 2 and "--ops" in p.stderr
    p = run_check("--backend", "nccl", "-n", "2")
    if p.returncode == 2:   # no GPU here
        assert "--backend nccl" in p.stderr
