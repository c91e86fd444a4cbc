"""``ncclpy check --backend cpu``: ncclpy's CPU backend (``ncclpy.init(device="cpu")``) against
torch's gloo and the reference, in real processes (2 and 4 ranks), plus the harness's parts:
the matrix, the ``reference only`` status (what gloo cannot run is judged by the reference
alone and never counted as passed), the report and the JSON."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_runs import module_runs, proc
from check_util import cmp, parts
from ncclpy.check import cases as C
from ncclpy.check import compare as K
from ncclpy.check import overview as O
from ncclpy.check import report as Rp

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


def _needs_torch() -> None:
    """The real runs compare with torch's gloo: they skip without torch (the harness's parts
    and the refusals made before a rank starts run without it)."""
    pytest.importorskip("torch")

#: the real runs' subset (the whole default matrix took 67 s at 2 ranks and 381 s at 4 on
#: a 2-core machine; docs/performance.md): every collective, every dtype (NCCL's 12, bool and
#: the complex types), every op, roots 0 and n-1, in and out of place, even and uneven
#: all_to_all, at element counts 0, 1 and 7 (the 1 MiB and 1024 sizes left out)
SUBSET = ("--sizes", "0,1,7")


def _env(extra: dict | None = None) -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT", "NCCLPY_DEVICE"):
        e.pop(k, None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra or {})
    return e


def _check(*args: str, env: dict | None = None, timeout: float = 240.0):
    """``ncclpy check ARGS``: the run, when called."""
    return proc([sys.executable, "-m", "ncclpy", "check", *args], _env(env), timeout)


def run_check(*args: str, env: dict | None = None, timeout: float = 240.0
              ) -> subprocess.CompletedProcess:
    return _check(*args, env=env, timeout=timeout)()


#: the ncclpy side's corruptions (spec, collective) and the runs each test reads
CORRUPT = [("broadcast:1:ncclpy:bit", "broadcast"), ("all_reduce:0:ncclpy:sign", "all_reduce")]
NEEDS = {"test_cpu_backend_check_passes_bit_for_bit[2]": ["subset-2"],
         "test_cpu_backend_check_passes_bit_for_bit[4]": ["subset-4"],
         **{f"test_a_corrupted_ncclpy_output_fails_even_where_gloo_cannot_compare[{s}-{c}]":
            [f"corrupt-{c}"] for s, c in CORRUPT},
         "test_a_cpu_backend_that_does_not_start_fails_the_run": ["no-start"]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's real runs (check_runs.py), started together as its tests begin, so that
    the 4-rank matrix runs while the 2-rank one and the small runs do: a test reads its run's
    output and JSON (``runs.json(name)``) as if it had started the run itself."""
    d = tmp_path_factory.mktemp("check_cpu_backend")
    t = {f"subset-{n}": _check("--backend", "cpu", "-n", str(n), *SUBSET, "-q", "--json",
                               str(d / f"subset-{n}.json")) for n in (2, 4)}
    t.update({f"corrupt-{c}": _check("--backend", "cpu", "-n", "2", "--collectives", c,
                                     "--dtypes", "int8,uint32", "--ops", "sum", "--sizes", "5",
                                     "--json", str(d / f"corrupt-{c}.json"),
                                     env={"NCCLPY_CHECK_INJECT": s}) for s, c in CORRUPT})
    t["no-start"] = _check("--backend", "cpu", "-n", "2", "--collectives", "broadcast",
                           "--dtypes", "i8", "--sizes", "3", "--json", str(d / "no-start.json"),
                           env={"NCCLPY_TRACE_BUFFER": "xyz"})
    needs = NEEDS if importlib.util.find_spec("torch") else {}   # else: the tests skip
    yield from module_runs(request, t, needs, d)


# -- the matrix -----------------------------------------------------------------------------
def test_cpu_matrix_runs_what_gloo_cannot_on_ncclpys_side():
    cases, skipped = C.build_matrix(2, backend="cpu")
    assert not skipped                      # nothing is left out: ncclpy runs every case
    assert {c.dtype for c in cases if c.dtype} == set(C.ALL_DTYPES)
    assert {c.op for c in cases if c.collective == "all_reduce" and c.dtype == "uint32"} == \
        set(C.REDUCING_OPS)
    assert {c.in_place for c in cases if c.collective == "broadcast"} == {False, True}
    assert {c.size_label for c in cases} == {"0", "1", "7", "1024", "64KiB"}
    assert C.default_sizes("cpu") == C.DEFAULT_SIZES_CPU_BACKEND != C.default_sizes("gloo")
    # normal and revealing inputs join for the float sums of the reductions, only there
    odd = [c for c in cases if c.inputs != "verifiable"]
    assert {c.inputs for c in odd} == {"normal", "reveal"}
    assert {(c.collective, c.op) for c in odd} == {(k, "sum") for k in C.FLOAT_REDUCTIONS}
    assert {c.dtype for c in odd} == {"float16", "float32", "float64", "bfloat16", "float8_e4m3",
                                      "float8_e5m2", "complex32", "complex64", "complex128"}
    gloo, _ = C.build_matrix(2, backend="gloo", sizes=C.DEFAULT_SIZES_CPU_BACKEND)
    assert {c.key for c in gloo} <= {c.key for c in cases}
    u32 = C.Case("broadcast", "uint32", None, None, 7, root=0)
    assert "Invalid scalar type" in C.torch_not_called("cpu", u32)
    assert C.torch_not_called("gloo", u32) is None          # gloo skips it instead
    assert C.torch_not_called("cpu", C.Case("broadcast", "int32", None, None, 7, root=0)) \
        is None
    assert "PREMUL_SUM" in C.torch_not_called(
        "cpu", C.Case("all_reduce", "float32", "premul_sum", 2.0, 7))
    assert [C.torch_family(b) for b in C.BACKENDS] == ["nccl", "gloo", "gloo"]
    with pytest.raises(ValueError, match="--backend"):
        C.build_matrix(2, backend="mpi")


# -- merging: "reference only" ------------------------------------------------------------
_parts, _cmp = parts, cmp


def test_reference_only_is_its_own_status_never_passed():
    ctx = {"n": 2, "backend": "cpu", "comm": object()}
    case = C.Case("broadcast", "uint32", None, None, 7, root=0)
    why = C.torch_not_called("cpu", case)
    ok = K.merge(case, _parts(2, torch_not_called=why, t_ref=_cmp(None), n_ref=_cmp(True),
                              n_t=_cmp(None)), ctx)
    assert ok["status"] == "reference only" and ok["ncclpy_ref"] is True, ok
    assert ok["torch_ref"] is None and ok["ncclpy_torch"] is None
    assert ok["reason"].startswith("ncclpy == reference; torch not compared: gloo: ")
    bad = K.merge(case, _parts(2, torch_not_called=why, t_ref=_cmp(None),
                               n_ref=[_cmp(True), _cmp(False, 2.0)], n_t=_cmp(None)), ctx)
    assert bad["status"] == "fail" and "ncclpy != reference on rank(s) [1]" in bad["reason"]
    err = K.merge(case, _parts(2, torch_not_called=why, t_ref=_cmp(None), n_ref=_cmp(None),
                               n_t=_cmp(None), ncclpy_exc="RuntimeError: boom",
                               ncclpy_typed=False), ctx)
    assert err["status"] == "error" and "boom" in err["reason"]
    # torch ran: the usual three-way comparison; a gloo divergence is judged as on gloo
    f32 = C.Case("all_reduce", "float32", "sum", None, 7)
    both = K.merge(f32, _parts(2, t_ref=_cmp(True), n_ref=_cmp(True), n_t=_cmp(True)), ctx)
    assert both["status"] == "pass" and both["ncclpy_torch"] is True
    bsum = C.Case("all_reduce", "bool", "sum", None, 7)
    div = K.merge(bsum, _parts(2, t_ref=_cmp(False, 1), t_pred=_cmp(True), p_ref=_cmp(False, 1),
                               n_ref=_cmp(True), n_t=_cmp(False, 1)), ctx)
    assert div["status"] == "torch divergence"
    counts = Rp.summarize([ok, bad, both, div])
    assert (counts["passed"], counts["passed_reference_only"], counts["failed"],
            counts["torch_divergence"], counts["ncclpy_cases"]) == (1, 1, 1, 1, 4)
    lines = Rp.summary_lines(counts, 1.0, "cpu vs gloo", 2)
    assert lines[0].endswith("1 passed bit for bit, 1 failed")
    assert lines[1].startswith("  1 with ncclpy vs the reference only (torch cannot run them")
    assert all(len(ln) <= Rp.WIDTH for ln in lines)
    # the report: an r cell, its legend line, one entry per reason
    m = O.matrix_lines([ok, both], [])
    assert O.LEGEND_REFERENCE_ONLY in m and any(ln.startswith("broadcast") and " r" in ln
                                                 for ln in m)
    assert O.LEGEND_REFERENCE_ONLY not in O.matrix_lines([both], [])
    probs = O.problem_lines([ok, dict(ok, key="x")], [], "cpu")
    assert any(ln.startswith("ncclpy vs the reference only") and "2 cases" in ln
               for ln in probs)
    assert any("broadcast uint32 (2 cases): ncclpy == reference" in ln for ln in probs)


# -- real runs ------------------------------------------------------------------------------
def _summary(out: str) -> str:
    lines = out.splitlines()
    at = [i for i, ln in enumerate(lines) if " cases on " in ln]
    assert at, out
    return " ".join(ln.strip() for ln in lines[at[-1]:])


@pytest.mark.parametrize("n", [2, 4])
def test_cpu_backend_check_passes_bit_for_bit(n, runs):
    """Every collective x dtype x op (``SUBSET``'s sizes) through ncclpy's CPU backend and
    gloo: ncclpy bit for bit with the reference in every case, with gloo wherever gloo runs;
    what gloo cannot run is 'reference only', never 'pass'; the report and JSON say the
    ncclpy side ran on the CPU backend, not NCCL."""
    _needs_torch()
    p = runs[f"subset-{n}"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = runs.json(f"subset-{n}")
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads((ROOT / "ncclpy" / "check" / "schema.json").read_text()))
    want, skipped = C.build_matrix(n, backend="cpu", sizes=SUBSET[1])
    s = doc["summary"]
    assert doc["exit_code"] == 0 and s["failed"] == 0 and s["cases"] == len(want) > 1500
    assert s["ncclpy_cases"] == s["cases"] and s["passed_torch_only"] == 0
    assert s["unsupported"] == 0 and s["skipped"] == len(skipped) == 0
    assert s["passed"] + s["passed_reference_only"] + s["torch_divergence"] + s["within_ulp"] \
        == s["cases"]
    # ncclpy's float reductions are judged against NCCL's order, and exact against it
    exact = [c for c in doc["cases"] if c.get("reference") == "nccl-order"]
    assert len(exact) == s["nccl_order_cases"] == s["exact_nccl_order"] > 300
    assert all(c["ncclpy_ref"] is True and c["exact_nccl_order"] for c in exact)
    assert all(c["torch_reference"] == "rank-order" and c["torch_reference_reason"] ==
               "gloo: not NCCL" for c in exact)
    assert s["passed_reference_only"] > 300 and s["passed"] > 800
    h = doc["header"]
    assert h["backend"] == "cpu" and h["world_size"] == n and "ncclpy_error" not in h
    assert h["ncclpy_backend"]["name"] == "cpu" and h["ncclpy_backend"]["nccl"] is False
    assert "no NCCL and no GPU ran" in h["ncclpy_backend"]["note"]
    assert "not NCCL" in h["ncclpy_backend"]["engine"]
    assert [tb["name"] for tb in h["torch_backends"]] == ["gloo"]
    assert doc["compared"].startswith("ncclpy on its CPU backend (not NCCL, no GPU) vs torch "
                                      "(gloo) vs numpy reference")
    assert {c["case"]["dtype"] for c in doc["cases"] if c["case"]["dtype"]} == \
        set(C.ALL_DTYPES)
    assert {c["case"]["collective"] for c in doc["cases"]} == set(C.COLLECTIVES)
    for c in doc["cases"]:
        assert c["ncclpy_ran"] is True, c
        coll, dt, op = c["case"]["collective"], c["case"]["dtype"], c["case"]["op"]
        gloo_refuses = coll != "barrier" and bool(C.gloo_skip_reason(coll, dt, op))
        if coll == "barrier":
            assert c["status"] == "pass" and c["ncclpy_ref"] and c["torch_ref"], c
        elif gloo_refuses:                 # judged by the reference alone, said per case
            assert c["status"] == "reference only", c
            assert c["ncclpy_ref"] is True and c["torch_ref"] is None, c
            assert c["ncclpy_torch"] is None and "torch not compared" in c["reason"]
        elif c["status"] == "torch divergence":   # gloo's bool sums; ncclpy == reference
            assert (dt, op) == ("bool", "sum") and c["ncclpy_ref"] is True, c
        elif c["case"]["inputs"] != "verifiable":     # gloo against rank order, bounded
            assert c["status"] in ("pass", "within ULP") and c["ncclpy_ref"] is not False, c
            if c["case"]["count"]:
                assert c["reference"] == "nccl-order" and c["ncclpy_torch"] is None, c
            if c["status"] == "within ULP":
                assert all(r["t_ref"].get("bound_ok") is not False for r in c["ranks"]), c
                assert c["reason"].startswith("ncclpy == NCCL's order bit for bit; torch "
                                              "within the order-free bound"), c
        else:
            assert c["status"] == "pass" and c["ncclpy_ref"] is not False, c
            assert c["torch_ref"] is not False and c["ncclpy_torch"] is not False, c
    text = p.stdout
    assert "ncclpy side: ncclpy ran on its CPU backend (ncclpy.init(device='cpu'))" in text
    summ = _summary(text)
    assert f"cases on {n} ranks (cpu vs gloo)" in summ and " 0 failed" in summ
    assert f"{s['passed_reference_only']} with ncclpy vs the reference only" in summ
    assert "ncclpy ran on its CPU backend, not on NCCL (no GPU)" in summ


@pytest.mark.parametrize("spec, coll", CORRUPT)
def test_a_corrupted_ncclpy_output_fails_even_where_gloo_cannot_compare(spec, coll, runs):
    """The ncclpy side is really compared: one flipped bit of its output fails the case, both
    where gloo runs (int8) and where only the reference judges it (uint32)."""
    _needs_torch()
    p = runs[f"corrupt-{coll}"]                   # NCCLPY_CHECK_INJECT=spec
    assert p.returncode == 1, p.stdout + p.stderr
    doc = runs.json(f"corrupt-{coll}")
    assert doc["summary"]["passed_reference_only"] == 0 and doc["summary"]["failed"] == \
        len(doc["cases"]) > 0
    for c in doc["cases"]:
        assert c["status"] == "fail" and c["ncclpy_ref"] is False, c
        assert "ncclpy != reference on rank(s)" in c["reason"]


def test_cpu_backend_refusals_are_one_line():
    p = run_check("--backend", "cpu", "--torch-backend", "nccl", "-n", "2")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--torch-backend nccl: torch's NCCL backends run on a GPU" in p.stderr
    assert "this run's backend is cpu (--backend cpu), whose torch side is gloo" in p.stderr
    p = run_check("--backend", "cpu", "--window", "-n", "2")
    assert p.returncode == 2 and "--window: needs --backend nccl" in p.stderr
    assert "Traceback" not in p.stderr
    p = run_check("--backend", "cpu", "-n", "2", "--list")
    assert p.returncode == 0 and p.stdout.rstrip().endswith("(cpu)")


def test_a_cpu_backend_that_does_not_start_fails_the_run(runs):
    """ncclpy's side not starting (here: a bad NCCLPY_TRACE_BUFFER) is a failure (exit 1), never
    a run of torch alone that passes; the header and the summary say it did not start."""
    _needs_torch()
    p = runs["no-start"]
    assert p.returncode == 1, p.stdout + p.stderr
    assert "ncclpy side: its CPU backend (ncclpy.init(device='cpu')) did not start" in p.stdout
    assert "ncclpy's CPU backend did not start: ArgumentError: NCCLPY_TRACE_BUFFER" in p.stdout
    doc = runs.json("no-start")
    assert doc["exit_code"] == 1 and doc["summary"]["ncclpy_cases"] == 0
    assert doc["problems"][0].startswith("ncclpy's CPU backend did not run: ArgumentError")
    assert doc["compared"] == "torch (gloo) vs numpy reference only; ncclpy (CPU backend) did " \
                              "not run"


def test_auto_is_cpu_where_the_environment_asks_for_the_cpu_backend():
    """``ncclpy run --cpu`` sets NCCLPY_DEVICE=cpu: ``--backend auto`` then checks ncclpy's CPU
    backend; an explicit --backend still wins."""
    env = {"NCCLPY_DEVICE": "cpu"}
    p = run_check("-n", "2", "--list", "--collectives", "broadcast", "--dtypes", "u32",
                  "--sizes", "3", env=env)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("on 2 ranks (cpu)"), p.stdout
    p = run_check("-n", "2", "--list", "--backend", "gloo", "--collectives", "broadcast",
                  "--dtypes", "i8", "--sizes", "3", env=env)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("(gloo)"), p.stdout
    p = run_check("-n", "2", "--torch-backend", "nccl", env=env)
    assert p.returncode == 2 and "this run's backend is cpu (NCCLPY_DEVICE=cpu)" in p.stderr
