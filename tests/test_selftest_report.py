"""CPU tests of the selftest's readers and reports: pytest's junit XML (sharded stages added
up), the check, bench and overhead JSON (samples written by the projects' own writers), a
stage's analysis, the report, the summary and the paste block, the probe."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ncclpy.selftest import parse as P, report as R, runner as RN
from ncclpy.selftest import stages as S

ROOT = Path(__file__).resolve().parents[1]


def _file(stage: str, ext: str) -> str:
    """The stage's numbered file name, as the runner makes it (its place in the table)."""
    return f"{S.NAMES.index(stage) + 1:02d}-{stage}.{ext}"


def _ctx(tmp_path: Path) -> S.Ctx:
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    return S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp))


# -- readers: samples written by the projects' own writers ----------------------------------

_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite \
name="pytest" errors="1" failures="1" skipped="1" tests="5" time="4.0"><testcase \
classname="tests.gpu.test_comm_gpu" name="test_collective_matrix[2]" time="30.1" /><testcase \
classname="tests.gpu.test_comm_gpu" name="test_lifecycle" time="0.0"><skipped \
type="pytest.skip" message="no CUDA">why</skipped></testcase><testcase \
classname="tests.gpu.test_check_gpu" name="test_check_on_one_gpu_is_bitwise[2]" time="1"><failure \
message="AssertionError: 3 failed checks">long text</failure></testcase><testcase \
classname="tests.gpu.test_fixes_gpu" name="test_nonblocking_split[2]" time="0"><error \
message="failed on setup with &quot;RuntimeError: x&quot;">trace</error></testcase><testcase \
time="0.000" /></testsuite></testsuites>"""


_JUNIT_SHARD2 = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" \
tests="1"><testcase classname="tests.gpu.test_check_gpu" name="test_injected[x]" time="2" />\
</testsuite></testsuites>"""


def test_junit_counts_and_failure_ids(tmp_path):
    f = tmp_path / "j.xml"
    f.write_text(_JUNIT)
    c = P.junit_counts(str(f))
    assert (c["passed"], c["failed"], c["errors"], c["skipped"], c["total"]) == (1, 1, 1, 1, 4)
    assert [x["id"] for x in c["failures"]] == [
        "tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[2]",
        "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[2]"]
    assert [x["kind"] for x in c["failures"]] == ["failed", "error"]
    assert c["failures"][0]["message"].startswith("AssertionError: 3 failed checks")
    f.write_text(_JUNIT[:300])                 # cut off by a kill
    assert P.junit_counts(str(f)) is None
    assert P.junit_counts(str(tmp_path / "missing.xml")) is None


@pytest.mark.parametrize("text,want", [
    ("....\n==== 1 failed, 3 passed, 2 skipped, 1 error in 4.01s ====\n", (3, 1, 1, 2)),
    ("2 passed, 5 deselected, 1 warning in 0.5s", (2, 0, 0, 0)),
    ("!!! KeyboardInterrupt !!!\n1 failed, 1 passed, 1 skipped in 4.01s\n", (1, 1, 0, 1)),
])
def test_pytest_log_counts(text, want):
    c = P.pytest_log_counts(text)
    assert (c["passed"], c["failed"], c["errors"], c["skipped"]) == want
    assert P.pytest_log_counts("no summary here\n") is None


def _check_doc(failed: int = 0) -> dict:
    from ncclpy.check import report as CR
    records = ([{"status": "pass"}] * 5 + [{"status": "torch divergence"}]
               + [{"status": "unsupported"}] * 2 + [{"status": "fail"}] * failed)
    records = [dict(r, ncclpy_ran=True) for r in records]
    counts = CR.summarize(records, skipped=3)
    return {"header": {"world_size": 2, "backend": "nccl", "device": "NVIDIA H100 80GB HBM3",
                       "libnccl": {"same": True, "ncclpy_nccl_version": "2.28.9",
                                   "problems": []}},
            "summary": counts, "exit_code": 1 if failed else 0, "problems": [],
            "seconds": 97.5, "cases": [], "skipped": []}


def test_check_summary(tmp_path):
    from ncclpy.check import report as CR
    f = tmp_path / "check-n2.json"
    CR.write_json(str(f), _check_doc())
    c = P.check_summary(str(f))
    assert c["world_size"] == 2 and c["same_libnccl"] is True and c["exit_code"] == 0
    assert c["summary"] == {"cases": 8, "passed": 5, "passed_torch_only": 0,
                            "passed_reference_only": 0, "failed": 0,
                            "within_ulp": 0, "torch_divergence": 1, "unsupported": 2,
                            "skipped": 3, "ncclpy_cases": 8, "nccl_order_cases": 0,
                            "exact_nccl_order": 0}
    assert c["nccl"] == "2.28.9" and c["seconds"] == 97.5
    f.write_text('{"header": ')
    assert P.check_summary(str(f)) is None


def _bench_doc(wrong: int = 0) -> dict:
    from bench import output as O
    mib = 1 << 20
    rows = {}
    speed = {"ncclpy": 1.0, "cupy": 1.02, "torch": 0.8}
    for b, k in speed.items():
        rows[b] = [O.Row(b, s, s // 4, "float", "float32", "sum", -1,
                         O.Side(100.0, 10.0 * k, 10.0 * k * (1 + s / (256 * mib)),
                                wrong if b == "ncclpy" and s == 8 else 0),
                         O.Side(100.0, 10.0 * k, 10.0 * k, 0), iters=20)
                   for s in (8, 32 * mib, 64 * mib, 128 * mib, 256 * mib)]
    return O.build_json(rows_by_backend=rows, args=["python -m bench", "all_reduce"],
                        nccl_version=22809, config={}, devices=[], start_time="x",
                        extension={"collective": "all_reduce", "world_size": 2})


def test_bench_figures(tmp_path):
    f = tmp_path / "b.json"
    f.write_text(json.dumps(_bench_doc()))
    b = P.bench_figures(str(f))
    assert b["collective"] == "all_reduce" and b["world_size"] == 2
    assert b["backends"] == ["ncclpy", "cupy", "torch"] and b["out_of_bounds"] == 0
    t = b["ratios"]["torch"]
    assert sorted(t["by_size"]) == [64 << 20, 128 << 20, 256 << 20]       # >= 64 MiB only
    assert all(v == pytest.approx(1.25) for v in t["by_size"].values())
    assert t["mean"] == pytest.approx(1.25)
    assert b["ratios"]["cupy"]["mean"] == pytest.approx(1 / 1.02)
    assert b["max_size"] == 256 << 20
    assert b["busbw_at_max"]["ncclpy"] == pytest.approx(20.0)
    f.write_text(json.dumps(_bench_doc(wrong=3)))
    assert P.bench_figures(str(f))["out_of_bounds"] == 1


def test_bench_figures_reads_every_series_and_the_layout_before(tmp_path):
    """Every backend's rows are in ``ncclpy.results`` (nccl-tests' ``results``: the first
    backend's only); a file of the version-2 layout (all rows in ``results``, named by
    ``experiment_name``) reads the same."""
    doc = _bench_doc()
    assert {r["experiment_name"] for r in doc["results"]} == {""}
    f = tmp_path / "b.json"
    f.write_text(json.dumps(doc))
    new = P.bench_figures(str(f))
    old = dict(doc, version=2, results=[dict(r, experiment_name=r["series"])
                                        for r in doc["ncclpy"].pop("results")])
    f.write_text(json.dumps(old))
    assert P.bench_figures(str(f)) == new and new["backends"] == ["ncclpy", "cupy", "torch"]


def _overhead_doc() -> dict:
    from bench.overhead import derive
    med = {"ncclpy": 9.5, "cupy": 6.25, "torch": 14.0}
    results = [{"backend": b, "label": b, "collective": "all_reduce", "size": size,
                "mode": mode, "calls": 2000, "median_us": m + (1.0 if mode == "graph" else 0),
                "p10_us": m, "p90_us": m, "mean_us": m, "min_us": m}
               for size in (8, 4096) for mode in ("eager", "capture", "graph")
               for b, m in med.items()]
    return {"start_time": "x", "world_size": 2, "device": "cuda", "calls": 2000,
            "results": results, "derived": derive(results)}


def test_overhead_figures(tmp_path):
    f = tmp_path / "o.json"
    f.write_text(json.dumps(_overhead_doc()))
    o = P.overhead_figures(str(f))
    assert o["size"] == 8 and o["sizes"] == [8, 4096] and o["world_size"] == 2
    e = o["modes"]["eager"]
    assert e["ncclpy_minus_cupy_us"] == pytest.approx(3.25)
    assert e["ncclpy_minus_torch_us"] == pytest.approx(-4.5)
    assert o["modes"]["graph"]["ncclpy"] == pytest.approx(10.5)
    assert P.overhead_figures(str(tmp_path / "none.json")) is None


# -- analysis of a stage's files, the report and the paste block ------------------------------

def _work_with_samples(tmp_path: Path) -> S.Ctx:
    from ncclpy.check import report as CR
    ctx = _ctx(tmp_path)
    w = Path(ctx.work)
    # check2 runs in two shards: its counts are both junit files added up
    (w / "03-check2.s1.xml").write_text(_JUNIT.replace("tests.gpu.test_comm_gpu", "tests.gpu.x"))
    (w / "03-check2.s2.xml").write_text(_JUNIT_SHARD2)
    CR.write_json(str(w / "check-n2.json"), _check_doc())
    (w / _file("bench", "json")).write_text(json.dumps(_bench_doc()))
    (w / _file("overhead", "json")).write_text(json.dumps(_overhead_doc()))
    (w / _file("overhead", S.CUDA_COSTS_SUFFIX)).write_text(json.dumps(
        {"schema": "ncclpy-cuda-costs/1", "device": "NVIDIA H100 80GB HBM3",
         "cuda_runtime": "13.0", "cupy": "14.2.0", "floor_ns": 31.0,
         "costs_ns": {"cudaEventRecord": 1480.0, "cudaGetDevice": 95.0}}))
    (w / "01-info.json").write_text(json.dumps(_INFO))
    return ctx


_INFO = {
    "date_utc": "2026-11-25 10:00 UTC", "nvidia_driver": "580.159.04", "nvidia_smi": [],
    "mps_control": None, "cuda_reason": "",
    "ncclpy_info": {
        "ncclpy": "0.1.0", "python": "3.12.3",
        "cupy": {"installed": True, "version": "14.2.0"},
        "nccl": {"runtime_str": "2.28.9", "library": "/x/nvidia/nccl/lib/libnccl.so.2"},
        "cuda": {"driver_str": "13.0", "runtime_str": "13.0",
                 "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3",
                           "memory_bytes": 85520809984, "compute_capability": "9.0"}]},
        "torch": {"installed": True, "version": "2.11.0+cu130", "cuda_available": True,
                  "cuda": "13.0", "nccl": "2.28.9"}}}


def _cmd(rc: int, timed_out: bool = False) -> dict:
    return {"argv": ["python"], "shell": "python", "rc": rc, "seconds": 1.0,
            "timed_out": timed_out}


def _analysed(ctx: S.Ctx) -> list:
    out = []
    for name, cmds in (("info", [_cmd(0), _cmd(0)]), ("gpu2", [_cmd(0)]), ("check2", [_cmd(1)]),
                       ("worlds34", [_cmd(-2, timed_out=True)]), ("check4", []),
                       ("bench", [_cmd(0)]),
                       ("overhead", [_cmd(0)]), ("examples", []), ("benchtests", [])):
        st = S.by_name(name)
        r = R.StageResult(name, st.title, timeout_s=st.timeout_s, seconds=12.0, commands=cmds)
        if cmds:
            RN.analyse(st, r, ctx)
        else:
            r.reason = "not enough time left: needs at least 120 s, 40 s left of the budget"
        out.append(r)
    return out


def test_analyse_gives_each_stage_its_status_counts_and_figures(tmp_path):
    res = {r.name: r for r in _analysed(_work_with_samples(tmp_path))}
    assert res["info"].status == "passed" and res["info"].figures["info"] == _INFO
    assert res["gpu2"].status == "failed" and res["gpu2"].reason == "no test ran"
    c2 = res["check2"]
    assert c2.status == "failed" and c2.counts["failed"] == 1 and c2.counts["errors"] == 1
    assert c2.counts["passed"] == 2 and c2.counts["total"] == 5
    assert c2.figures["check_n2"]["summary"]["passed"] == 5
    assert c2.files == ["03-check2.s1.xml", "03-check2.s2.xml", "check-n2.json"]
    assert res["worlds34"].status == "did not finish"
    assert res["bench"].status == "passed" and res["bench"].figures["bench"]["ratios"]
    assert res["overhead"].status == "passed"
    assert res["examples"].status == "not run"


def test_a_machine_without_pytest_is_said_in_info_and_in_each_pytest_stage(tmp_path):
    """Issue 21, defect 11: no empty reasons."""
    ctx = _ctx(tmp_path)
    (Path(ctx.work) / "01-info.json").write_text(json.dumps(
        {**_INFO, "cuda_reason": "", "missing_tools": ["pytest", "pytest-timeout"]}))
    info = R.StageResult("info", "i", commands=[_cmd(0), _cmd(0)])
    RN.analyse(S.by_name("info"), info, ctx)
    assert info.status == "failed"
    assert info.reason == ("missing pytest, pytest-timeout (pip install pytest pytest-timeout): "
                           "the pytest stages cannot run")
    (Path(ctx.work) / "02-gpu2.log").write_text("/usr/bin/python3: No module named pytest\n")
    g = R.StageResult("gpu2", "g", commands=[_cmd(1)])
    RN.analyse(S.by_name("gpu2"), g, ctx)
    assert g.status == "failed" and g.reason.startswith("pytest is not installed here")


def test_analyse_bench_with_wrong_elements_fails(tmp_path):
    ctx = _ctx(tmp_path)
    (Path(ctx.work) / _file("bench", "json")).write_text(json.dumps(_bench_doc(wrong=2)))
    r = R.StageResult("bench", "b", commands=[_cmd(0)])
    RN.analyse(S.by_name("bench"), r, ctx)
    assert r.status == "failed" and r.reason == "1 results with wrong elements"


def _record(tmp_path: Path) -> R.RunRecord:
    stages = _analysed(_work_with_samples(tmp_path))
    info = stages[0].figures.pop("info")
    return R.RunRecord(date=info["date_utc"], command="PYTHONPATH=. python3 -m ncclpy.selftest "
                       "$OUT", budget_s=540, stages=stages, elapsed_s=531.2, info=info)


def test_paste_block(tmp_path):
    text = R.paste_block(_record(tmp_path))
    lines = text.splitlines()
    assert lines[0] == "### 2026-11-25 10:00 UTC: ncclpy.selftest on NVIDIA H100 80GB HBM3 " \
                       "(cc 9.0, 80 GiB)"
    assert ("- GPU: NVIDIA H100 80GB HBM3 (cc 9.0, 80 GiB); driver 580.159.04 (CUDA driver API "
            "13.0); CUDA runtime 13.0; MPS: not installed (no nvidia-cuda-mps-control)") in lines
    assert ("- NCCL 2.28.9 (libnccl.so.2); CuPy 14.2.0; torch 2.11.0+cu130 (CUDA 13.0, NCCL "
            "2.28.9); Python 3.12.3; ncclpy 0.1.0") in lines
    assert ("- Command: `PYTHONPATH=. python3 -m ncclpy.selftest $OUT` (budget 540 s, took "
            "531 s)") in lines
    assert "| info | passed |  |  |  |  | 12 s | 0 s |" in lines
    assert "| check2 | FAILED | 2 | 1 | 1 | 1 | 12 s | 0 s |" in lines
    assert "| gpu2 | FAILED: no test ran |  |  |  |  | 12 s | 0 s |" in lines
    assert "| worlds34 | did not finish (bound 240 s) |  |  |  |  | 12 s | 0 s |" in lines
    assert ("| examples | not run: not enough time left: needs at least 120 s, 40 s left of the "
            "budget |  |  |  |  |  |  |") in lines
    check = next(ln for ln in lines if ln.startswith("- `ncclpy check -n 2"))
    assert "8 cases, 5 passed bit for bit, 0 failed, 0 within ULP, 1 torch divergences, " \
           "2 unsupported, 3 skipped; one libnccl; exit 0; 98 s" in check
    bench = next(ln for ln in lines if ln.startswith("- bench "))
    assert "ncclpy/torch 64 MiB 1.25, 128 MiB 1.25, 256 MiB 1.25 (mean 1.25)" in bench
    assert "busbw GB/s at 256 MiB: ncclpy 20.0, cupy 20.4, torch 16.0" in bench
    over = next(ln for ln in lines if ln.startswith("- overhead "))
    assert "eager: ncclpy - cupy = 3.25 us (ncclpy 9.50, cupy 6.25, torch 14.00)" in over
    assert "graph replay, the same kind of graph for all: ncclpy 10.50" in over
    assert ("- CUDA calls' host cost, ns per call (median) on NVIDIA H100 80GB HBM3, CUDA "
            "runtime 13.0, CuPy 14.2.0: cudaEventRecord 1480, cudaGetDevice 95 (Python loop "
            "floor 31)") in lines
    assert ("- Failed tests: tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[2], "
            "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[2]") in lines
    assert "- Did not finish: worlds34" in lines
    assert "- Not run: check4, examples, benchtests" in lines
    assert ("- To finish: `PYTHONPATH=. python3 -m ncclpy.selftest $OUT --stage worlds34 "
            "--stage check4 --stage examples --stage benchtests`") in lines


def test_paste_block_says_how_the_stages_shared_the_gpu_and_the_debt_after(tmp_path):
    rec = _record(tmp_path)
    rec.setup = {"jobs": 8, "capacity": 12, "max_ctas": "11 (132 SMs / 12 ranks at once)",
                 "mps": "started (CUDA_MPS_PIPE_DIRECTORY=/tmp/x)"}
    rec.debt = {"recorded": 61, "ledger": "docs/gpu-ledger.json", "items": 107, "proven": 90,
                "version_skipped": 4, "debt": 13, "by_stage": {"part2": 9, "examples": 4},
                "open": [f"t{i} (failed last: x)" for i in range(13)]}
    lines = R.paste_block(rec).splitlines()
    assert ("- Side by side: 8 commands at once, at most 12 ranks; NCCL_MAX_CTAS 11 (132 SMs / "
            "12 ranks at once); MPS started (CUDA_MPS_PIPE_DIRECTORY=/tmp/x)") in lines
    assert ("- GPU ledger: docs/gpu-ledger.json updated with 61 results (commit it with this "
            "block)") in lines
    assert ("- GPU debt after this run: 13 of 107 items (90 proven, 4 skipped for their NCCL "
            "version); by stage: part2 9, examples 4") in lines
    assert "  - t11 (failed last: x)" in lines and "  - t12 (failed last: x)" not in lines
    assert lines[-1] == "  - ... (python -m ncclpy.selftest --debt lists all)"
    rec.debt = {"error": "ledger not updated: disk full"}
    assert "- GPU ledger: ledger not updated: disk full" in R.paste_block(rec).splitlines()


def test_report_and_summary_files(tmp_path):
    rec = _record(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    R.write_outputs(rec, str(out))
    assert sorted(os.listdir(out)) == ["report.md", "summary.json"]
    md = (out / "report.md").read_text()
    assert md.startswith("# ncclpy selftest report\n\n### 2026-11-25")
    assert "### worlds34: GPU tests at world sizes 3-4" in md
    assert "failed: `tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[2]`" in md
    doc = json.loads((out / "summary.json").read_text())
    assert doc["exit_code"] == 1 and doc["versions"]["nccl"] == "2.28.9 (libnccl.so.2)"
    assert [s["status"] for s in doc["stages"]] == [
        "passed", "failed", "failed", "did not finish", "not run", "passed", "passed",
        "not run", "not run"]
    part = R.RunRecord("d", "c", 1, [R.StageResult("a", "a", "passed"),
                                     R.StageResult("b", "b", "skipped")])
    assert R.exit_code(part) == 1          # a stage whose tests all skipped proved nothing
    assert R.verdict_line(part) == ("[selftest] NOT PASSED: 1 of 2 stages passed; skipped "
                                    "(proves nothing): b")
    full = R.RunRecord("d", "c", 1, [R.StageResult("a", "a", "passed")])
    assert R.exit_code(full) == 0 and R.verdict_line(full) == "[selftest] PASSED: all 1 stages " \
        "passed"
    assert R.exit_code(R.RunRecord("d", "c", 1, [])) == 1


def test_versions_without_a_probe():
    v = R.versions({})
    assert v["gpu"] == "?" and v["nccl"] == "?" and v["torch"] == "not installed"
    assert R.paste_block(R.RunRecord("today", "cmd", 540, [])).startswith(
        "### today: ncclpy.selftest on ?")


def test_probe_on_this_machine(tmp_path):
    from ncclpy.selftest import probe
    f = tmp_path / "info.json"
    rc = probe.main([str(f)])
    doc = json.loads(f.read_text())
    assert set(doc) >= {"date_utc", "ncclpy_info", "nvidia_driver", "mps_control",
                        "cuda_reason", "test_tools", "missing_tools"}
    assert doc["test_tools"]["pytest"] == pytest.__version__ and doc["missing_tools"] == []
    assert rc == (0 if not doc["cuda_reason"] else 1)
    assert doc["cuda_reason"] == probe.cuda_reason()
    assert probe.main([]) == 2




def test_a_device_wide_fault_is_flagged_in_each_stage_and_the_block_names_the_first(tmp_path):
    """2026-11-26: one rank killed with a kernel in flight faulted every MPS client; the
    stages that failed on it read as failures of their own.  The block now says so."""
    ctx = _ctx(tmp_path)
    (Path(ctx.work) / "07-check4.log").write_text(
        "rank 1: CUDA error: an illegal memory access was encountered\nmore\n")
    (Path(ctx.work) / "10-forensics.s1.log").write_text(
        "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable\n")
    (Path(ctx.work) / "02-gpu2.s1.log").write_text("1 failed\nAssertionError: wrong sum\n")
    stages = []
    for name, start in (("check4", 128.0), ("forensics", 189.0), ("gpu2", 12.0)):
        r = R.StageResult(name, name, commands=[_cmd(1)], seconds=60.0, start_s=start)
        RN.analyse(S.by_name(name), r, ctx)
        stages.append(r)
    got = {r.name: r.figures.get("device_fault") for r in stages}
    assert got == {"check4": "rank 1: CUDA error: an illegal memory access was encountered",
                   "forensics": "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are "
                                "busy or unavailable", "gpu2": None}
    block = R.paste_block(R.RunRecord("today", "cmd", 540, stages))
    line = next(x for x in block.splitlines() if x.startswith("- A device-wide CUDA fault"))
    assert "shows in check4, forensics" in line and "illegal memory access" in line, line
    assert "check4)" in line and "may share one cause" in line, line
