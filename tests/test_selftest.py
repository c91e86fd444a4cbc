"""CPU tests of ``python -m ncclpy.selftest``: no GPU here gives exit 2 and one line; ``--list``,
stage selection and bad flags; the budget arithmetic; the runner's bounds, Ctrl-C and closed
stdout with real subprocesses (harmless commands, never a pretend GPU); the readers of pytest's
junit XML, the check, bench and overhead JSON (samples written by the projects' own writers),
the report and the paste block; and the GPU tests' world-size selection and time bounds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gpu_util import cuda_reason
from ncclpy.selftest import cli, parse as P, report as R, runner as RN, stages as S

ROOT = Path(__file__).resolve().parents[1]
PROG = [sys.executable, "-m", "ncclpy.selftest"]



def _file(stage: str, ext: str) -> str:
    """The stage's numbered file name, as the runner makes it (its place in the table)."""
    return f"{S.NAMES.index(stage) + 1:02d}-{stage}.{ext}"

def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PROG, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


# -- the command line ------------------------------------------------------------------------

def test_no_gpu_exits_2_at_once_with_one_line(tmp_path):
    if not cuda_reason():
        pytest.skip("a CUDA GPU is usable here: the selftest would run for real")
    out = tmp_path / "out"
    t0 = time.monotonic()
    p = _run(str(out))
    assert p.returncode == 2, p.stderr
    assert time.monotonic() - t0 < 30
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ncclpy.selftest: no CUDA GPU here (")
    assert lines[0].endswith("); nothing was run: it needs a machine with an NVIDIA GPU")
    assert p.stdout == "" and not out.exists()


def test_list_shows_every_stage_in_order_with_bounds_and_commands():
    p = _run("--list")
    assert p.returncode == 0, p.stderr
    rows = [ln.split()[0] for ln in p.stdout.splitlines()[1:len(S.STAGES) + 1]]
    assert rows == list(S.NAMES)
    assert "info          60 s" in p.stdout and "budget 540 s" in p.stdout
    assert "gpu2: NCCLPY_GPU_ARTIFACTS=WORK python -m pytest tests/gpu --gpu-worlds 1,2" in p.stdout
    assert ("bench: python -m bench all_reduce -b 8 -e 256M -f 2 --nproc 2 --device cuda "
            f"--backend ncclpy,cupy,torch -J WORK/{_file('bench', 'json')}") in p.stdout
    assert "overhead: python -m bench.overhead --nproc 2 --backend ncclpy,cupy,torch" in p.stdout


def test_stage_selection_keeps_the_fixed_order_and_adds_info():
    p = _run("--list", "--stage", "bench", "--stage", "gpu2", "--stage", "bench")
    assert p.returncode == 0, p.stderr
    rows = [ln.split()[0] for ln in p.stdout.splitlines()[1:4]]
    assert rows == ["info", "gpu2", "bench"]
    assert p.stdout.splitlines()[4].startswith("budget ")


def test_select_and_by_name():
    assert S.select(None) == list(S.STAGES) == S.select([])
    assert [s.name for s in S.select(["check2"])] == ["info", "check2"]
    assert [s.name for s in S.select(["examples", "info", "worlds34"])] == [
        "info", "worlds34", "examples"]
    with pytest.raises(ValueError, match="unknown stage 'gpu'; the stages are: info, gpu2, "):
        S.select(["gpu"])


def test_unknown_stage_is_refused_naming_the_stages():
    p = _run("--stage", "nope", "/tmp/never-made")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr == ("python -m ncclpy.selftest: error: --stage: unknown stage 'nope'; the "
                        "stages are: " + ", ".join(S.NAMES)
                        + " (see 'python -m ncclpy.selftest -h')\n")     # one line


@pytest.mark.parametrize("value,msg", [("-3", "expected seconds > 0, got '-3'"),
                                       ("0", "expected seconds > 0, got '0'"),
                                       ("nan", "expected seconds > 0, got 'nan'"),
                                       ("ten", "expected a number of seconds, got 'ten'")])
def test_bad_budget_is_refused(value, msg):
    p = _run("--budget", value, "/tmp/never-made")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr == (f"python -m ncclpy.selftest: error: --budget: {msg} (see 'python -m "
                        f"ncclpy.selftest -h')\n"), p.stderr         # one line, no usage block


def test_outdir_is_required_without_list():
    p = _run()
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().endswith("error: OUTDIR is required (the folder for the report), "
                                     "unless --list (see 'python -m ncclpy.selftest -h')")
    assert p.stderr.count("\n") == 1, p.stderr


def test_closed_stdout_gives_no_traceback():
    r, w = os.pipe()
    os.close(r)                 # every write to stdout fails with EPIPE
    try:
        p = subprocess.run([*PROG, "--list"], cwd=ROOT, env=_env(), stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.returncode == 0


# -- budget arithmetic -----------------------------------------------------------------------

def test_decide_runs_with_the_smaller_of_bound_and_time_left():
    st = S.by_name("gpu2")                                 # bound 240 s, min 90 s
    assert S.decide(st, 1000) == (True, 240.0, "")
    assert S.decide(st, 120) == (True, 120.0, "")
    assert S.decide(st, 90) == (True, 90.0, "")
    run, t, why = S.decide(st, 89.4)
    assert not run and t == 0.0
    assert why == "not enough time left: needs at least 90 s, 89 s left of the budget"
    assert "0 s left" in S.decide(st, -5)[2]


def test_default_bounds_fit_the_device_limit():
    assert S.DEFAULT_BUDGET_S <= 540
    assert S.RESERVE_S >= RN.GRACE_S + 5                     # a stopped command's grace fits
    for st in S.STAGES:
        assert 0 < st.min_s < st.timeout_s <= S.DEFAULT_BUDGET_S - S.RESERVE_S, st.name
    # the three most valuable stages always start in a default run, whatever they take
    info, gpu2, check2 = S.STAGES[:3]
    assert info.timeout_s + gpu2.timeout_s + check2.min_s <= S.DEFAULT_BUDGET_S - S.RESERVE_S


def _stage(name: str, code: str, timeout: float = 30, min_s: float = 0.5) -> S.Stage:
    return S.Stage(name, f"test stage {name}", "cmd", timeout, min_s, args=("-c", code))


def _ctx(tmp_path: Path) -> S.Ctx:
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    return S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp))


def test_budget_skips_the_stages_that_cannot_fit(tmp_path):
    stages = [_stage("slow", "import time; time.sleep(30)", timeout=60, min_s=1),
              _stage("big", "pass", min_s=30), _stage("small", "pass", min_s=0.5)]
    said = []
    t0 = time.monotonic()
    res, interrupted = RN.run_stages(stages, _ctx(tmp_path), str(ROOT), S.RESERVE_S + 3,
                                     say=said.append, grace_s=2)
    assert not interrupted and time.monotonic() - t0 < 15
    assert [r.status for r in res] == ["did not finish", "not run", "not run"]
    assert res[0].timeout_s <= 3.01 and res[0].commands[0]["timed_out"]
    assert res[1].reason.startswith("not enough time left: needs at least 30 s")
    assert any(s.startswith("[selftest] big: not run: not enough time left") for s in said)


# -- the runner, with real subprocesses ------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


_FAMILY = textwrap.dedent("""
    import os, subprocess, sys, time
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(sys.argv[1], "w").write(f"{os.getpid()} {kid.pid}")
    time.sleep(60)
""")


def _family_stage(tmp_path: Path, name: str, timeout: float) -> S.Stage:
    script = tmp_path / "family.py"
    script.write_text(_FAMILY)
    return S.Stage(name, "a process and its child", "cmd", timeout, 0.5,
                   args=(str(script), str(tmp_path / f"{name}.pids")))


def _pids(tmp_path: Path, name: str) -> list:
    path = tmp_path / f"{name}.pids"
    for _ in range(100):
        if path.exists() and path.read_text().strip():
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.1)
    raise AssertionError("the stage never wrote its pids")


def test_a_stage_at_its_bound_did_not_finish_its_processes_end_and_the_next_runs(tmp_path):
    stages = [_family_stage(tmp_path, "hang", timeout=3), _stage("next", "print('hello')")]
    ctx = _ctx(tmp_path)
    t0 = time.monotonic()
    res, interrupted = RN.run_stages(stages, ctx, str(ROOT), 120, say=lambda s: None,
                                     grace_s=2)
    assert time.monotonic() - t0 < 20 and not interrupted
    assert res[0].status == "did not finish" and res[0].commands[0]["timed_out"]
    assert 3 <= res[0].seconds < 10
    assert res[1].status == "passed" and res[1].commands[0]["rc"] == 0
    for pid in _pids(tmp_path, "hang"):
        assert not _alive(pid), f"process {pid} of the stopped stage is still running"
    log = (Path(ctx.work) / "00-next.log").read_text()
    assert log.startswith("$ ") and "hello" in log and "exited: exit status 0" in log
    assert "stopped at its bound" in (Path(ctx.work) / "00-hang.log").read_text()


def test_ctrl_c_stops_the_stage_writes_the_report_and_returns_130(tmp_path):
    stages = [_family_stage(tmp_path, "long", timeout=60), _stage("later", "pass")]
    out = tmp_path / "out"
    said = []

    def interrupt() -> None:
        _pids(tmp_path, "long")
        os.kill(os.getpid(), signal.SIGINT)

    th = threading.Thread(target=interrupt, daemon=True)
    th.start()
    rc = cli.execute(stages, str(out), 120, command="PYTHONPATH=. python3 -m ncclpy.selftest "
                     "$OUT", python=sys.executable, out=said.append, grace_s=2)
    th.join(5)
    assert rc == 130
    for pid in _pids(tmp_path, "long"):
        assert not _alive(pid)
    doc = json.loads((out / "summary.json").read_text())
    assert doc["interrupted"] and doc["exit_code"] == 130
    assert [s["status"] for s in doc["stages"]] == ["interrupted", "not run"]
    assert sorted(os.listdir(out)) == ["report.md", "stages.tar.gz", "summary.json"]
    import tarfile
    with tarfile.open(out / "stages.tar.gz") as tar:
        assert "stages/00-long.log" in tar.getnames()
    text = "\n".join(said)
    assert "INTERRUPTED" in text and "- Did not finish: long" in text
    assert "- To finish: `PYTHONPATH=. python3 -m ncclpy.selftest $OUT --stage long --stage " \
           "later`" in text
    assert said[-2] == "----- end -----"
    assert said[-1] == ("[selftest] INTERRUPTED: 0 of 2 stages passed; interrupted: long; "
                        "not run (proves nothing): later")


_TESTS = textwrap.dedent("""
    import time
    import pytest
    pytestmark = pytest.mark.gpu

    def test_ok():
        pass

    @pytest.mark.skip(reason="not here")
    def test_skip():
        pass

    def test_bad():
        assert 1 == 2, "boom"

    def test_slow():
        time.sleep({sleep})
""")


def _pytest_stage(tmp_path: Path, name: str, sleep: float, timeout: float) -> S.Stage:
    f = tmp_path / f"test_{name}.py"
    f.write_text(_TESTS.replace("{sleep}", str(sleep)))
    return S.Stage(name, "pytest on a sample file", "pytest", timeout, 0.5, args=(str(f),))


def test_pytest_stage_counts_come_from_its_junit_file(tmp_path):
    ctx = _ctx(tmp_path)
    res, _ = RN.run_stages([_pytest_stage(tmp_path, "sample", 0, 60)], ctx, str(ROOT), 120,
                           say=lambda s: None)
    r = res[0]
    assert r.status == "failed" and r.commands[0]["rc"] == 1
    c = r.counts
    assert (c["passed"], c["failed"], c["errors"], c["skipped"], c["total"]) == (2, 1, 0, 1, 4)
    assert c["failures"][0]["id"].endswith("test_sample.py::test_bad")
    assert "boom" in c["failures"][0]["message"]
    assert "00-sample.xml" in r.files and "00-sample.log" in r.files


def test_pytest_stage_stopped_at_its_bound_keeps_the_counts_of_what_finished(tmp_path):
    ctx = _ctx(tmp_path)
    res, _ = RN.run_stages([_pytest_stage(tmp_path, "partial", 60, 5)], ctx, str(ROOT), 120,
                           say=lambda s: None, grace_s=5)
    r = res[0]
    assert r.status == "did not finish"
    assert (r.counts["passed"], r.counts["failed"], r.counts["skipped"]) == (1, 1, 1)
    assert R.stage_line(r).startswith("partial: did not finish (bound 5 s): 1 passed, 1 failed")


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
    assert c["summary"] == {"cases": 8, "passed": 5, "passed_torch_only": 0, "failed": 0,
                            "within_ulp": 0, "torch_divergence": 1, "unsupported": 2,
                            "skipped": 3, "ncclpy_cases": 8}
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
    (w / "03-check2.xml").write_text(_JUNIT.replace("tests.gpu.test_comm_gpu", "tests.gpu.x"))
    CR.write_json(str(w / "check-n2.json"), _check_doc())
    (w / _file("bench", "json")).write_text(json.dumps(_bench_doc()))
    (w / _file("overhead", "json")).write_text(json.dumps(_overhead_doc()))
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
    assert c2.figures["check_n2"]["summary"]["passed"] == 5
    assert c2.files == ["03-check2.xml", "check-n2.json"]
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
    assert "| info | passed |  |  |  |  | 12 s |" in lines
    assert "| check2 | FAILED | 1 | 1 | 1 | 1 | 12 s |" in lines
    assert "| gpu2 | FAILED: no test ran |  |  |  |  | 12 s |" in lines
    assert "| worlds34 | did not finish (bound 240 s) |  |  |  |  | 12 s |" in lines
    assert ("| examples | not run: not enough time left: needs at least 120 s, 40 s left of the "
            "budget |  |  |  |  |  |") in lines
    check = next(ln for ln in lines if ln.startswith("- `ncclpy check -n 2"))
    assert "8 cases, 5 passed bit for bit, 0 failed, 0 within ULP, 1 torch divergences, " \
           "2 unsupported, 3 skipped; one libnccl; exit 0; 98 s" in check
    bench = next(ln for ln in lines if ln.startswith("- bench "))
    assert "ncclpy/torch 64 MiB 1.25, 128 MiB 1.25, 256 MiB 1.25 (mean 1.25)" in bench
    assert "busbw GB/s at 256 MiB: ncclpy 20.0, cupy 20.4, torch 16.0" in bench
    over = next(ln for ln in lines if ln.startswith("- overhead "))
    assert "eager: ncclpy - cupy = 3.25 us (ncclpy 9.50, cupy 6.25, torch 14.00)" in over
    assert ("- Failed tests: tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[2], "
            "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[2]") in lines
    assert "- Did not finish: worlds34" in lines
    assert "- Not run: check4, examples, benchtests" in lines
    assert ("- To finish: `PYTHONPATH=. python3 -m ncclpy.selftest $OUT --stage worlds34 "
            "--stage check4 --stage examples --stage benchtests`") in lines


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


# -- the GPU tests: world-size selection and time bounds (collected, never run, here) --------

def _collect(*args: str, env_extra: dict = None) -> list:
    env = _env()
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [ln for ln in p.stdout.splitlines() if "::" in ln]


def test_gpu_worlds_selects_by_largest_world_size():
    base = ["tests/gpu", "-m", "gpu"]
    one_two = _collect(*base, "--gpu-worlds", "1,2")
    three_four = _collect(*base, env_extra={"NCCLPY_GPU_WORLDS": "3,4"})
    everything = _collect(*base)
    assert "tests/gpu/test_comm_gpu.py::test_collective_matrix[2]" in one_two
    assert "tests/gpu/test_comm_gpu.py::test_collective_matrix[3]" not in one_two
    assert "tests/gpu/test_comm_gpu.py::test_register_same_buffer_twice" in one_two
    assert "tests/gpu/test_fixes_gpu.py::test_nccl_comm_blocking_0_in_the_environment" in one_two
    assert "tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[4]" in three_four
    assert "tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[2]" in one_two
    assert "tests/gpu/test_comm_gpu.py::test_split_into_halves" in three_four
    assert "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[4]" in three_four
    assert not set(one_two) & set(three_four)
    # every GPU test has a world size: the union over 1..6 is everything
    assert sorted(_collect(*base, "--gpu-worlds", "1,2,3,4,5,6")) == sorted(everything)
    # the examples that spawn 6 ranks belong to 6
    assert "tests/gpu/test_examples_gpu.py::test_example_standalone_spawn[02_all_gather.py]" in \
        _collect(*base, "--gpu-worlds", "6")


def test_stage_commands_select_what_they_say():
    ctx = S.Ctx(python=sys.executable, work="/tmp/w", tmp="/tmp/t")
    gpu2 = S.commands(S.by_name("gpu2"), ctx)[0].argv
    args = [a for a in gpu2[3:] if not a.startswith(("--junitxml", "--basetemp", "-q"))]
    ids = _collect(*args)
    # gpu2: every GPU test file except the check, bench and examples ones (their own stages)
    assert ids and not [i for i in ids if i.startswith((
        "tests/gpu/test_check_gpu.py", "tests/gpu/test_bench_gpu.py",
        "tests/gpu/test_examples_gpu.py"))]
    assert "tests/gpu/test_comm_gpu.py::test_collective_matrix[1]" in ids
    assert "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[2]" in ids
    assert any(i.startswith("tests/gpu/test_prepared_gpu.py") for i in ids)


_MARKS_PLUGIN = """
import json, os
def pytest_collection_finish(session):
    out = []
    for item in session.items:
        t = item.get_closest_marker("timeout")
        out.append({"id": item.nodeid, "gpu": item.get_closest_marker("gpu") is not None,
                    "timeout": t.args[0] if t and t.args else None,
                    "worlds": sorted({a for m in item.iter_markers("gpu_world") for a in m.args})})
    with open(os.environ["MARKS_OUT"], "w") as f:
        json.dump(out, f)
"""


def test_every_gpu_test_has_an_explicit_bound_below_the_device_limit(tmp_path):
    (tmp_path / "marks_plugin.py").write_text(_MARKS_PLUGIN)
    out = tmp_path / "marks.json"
    env = {"MARKS_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get(
               "PYTHONPATH", "")])}
    _collect("tests/gpu", "-p", "marks_plugin", env_extra=env)
    items = [i for i in json.loads(out.read_text()) if i["gpu"]]
    assert len(items) > 40
    for i in items:
        assert i["timeout"] is not None and 0 < i["timeout"] <= 540, i
        assert i["worlds"], i
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import _gpu_common as G
        from _gpu_spawn import (SHORT_SPAWN_TIMEOUT, SHORT_TEST_TIMEOUT, SPAWN_TIMEOUT,
                                TEST_TIMEOUT)
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
    # a hung check is reported by its rank's watchdog before the spawn bound, which comes
    # before the test's mark
    assert G.HANG_S + 60 < SPAWN_TIMEOUT < TEST_TIMEOUT <= 540
    assert G.HANG_S + 60 < SHORT_SPAWN_TIMEOUT < SHORT_TEST_TIMEOUT <= 540


def test_checks_skipped_inside_a_passing_test_are_counted_and_reported(tmp_path):
    """Issue 21, defect 10: a GPU test whose sub-checks raised Skip passes, but its junit
    property ``skipped_checks`` says which did not run, and the report's block repeats it."""
    f = tmp_path / "j.xml"
    f.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                 '<testcase classname="tests.gpu.test_comm_gpu" name="test_collective_matrix[2]">'
                 '<properties><property name="skipped_checks" value="24: FP8 reductions need '
                 'compute capability &gt;= 9.0"/></properties></testcase>'
                 '</testsuite></testsuites>')
    c = P.junit_counts(str(f))
    assert (c["passed"], c["skipped"]) == (1, 0)
    assert c["skipped_checks"] == [{"id": "tests/gpu/test_comm_gpu.py::test_collective_matrix[2]",
                                    "checks": "24: FP8 reductions need compute capability >= 9.0"}]
