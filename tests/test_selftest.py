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
from ncclpy.selftest import cli, report as R, runner as RN, schedule as SC
from ncclpy.selftest import stages as S
from sigint_util import sigint_handled
from wait_util import HANG

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
    rows = [ln.split()[0] for ln in p.stdout.splitlines()[1:len(S.DEFAULT) + 1]]
    assert rows == list(S.DEFAULT) and S.DEFAULT == tuple(n for n in S.NAMES
                                                           if n not in S.ON_REQUEST)
    assert ("only with --stage NAME (not in the default run): nccl-tests (420 s: "
            "nccl-tests 2.19.6 beside") in p.stdout
    assert "info          60 s  20 s     0      1  alone" in p.stdout
    assert "budget 480 s" in p.stdout
    assert "gpu2         300 s  90 s     2      2  shared" in p.stdout
    assert ("gpu2: NCCLPY_GPU_ARTIFACTS=WORK python -m pytest tests/gpu "
            "--ignore=tests/gpu/test_check_gpu.py") in p.stdout
    assert "--gpu-worlds 1,2 --gpu-shard 2/2 -m gpu" in p.stdout
    assert ("bench: python -m bench all_reduce -b 8 -e 256M -f 2 --nproc 2 --device cuda "
            f"--backend ncclpy,cupy,torch -J WORK/{_file('bench', 'json')}") in p.stdout
    assert "overhead: bash bench/install_wheels.sh --optional --python python" in p.stdout
    assert ("overhead: python -m bench.overhead --nproc 2 --modes eager,prepared,graph,capture "
            f"--breakdown -J WORK/{_file('overhead', 'json')}") in p.stdout
    assert (f"overhead: python -m bench.cuda_costs --json WORK/"
            f"{_file('overhead', 'cuda-costs.json')}") in p.stdout


def test_stage_selection_keeps_the_fixed_order_and_adds_info():
    p = _run("--list", "--stage", "bench", "--stage", "gpu2", "--stage", "bench")
    assert p.returncode == 0, p.stderr
    rows = [ln.split()[0] for ln in p.stdout.splitlines()[1:4]]
    assert rows == ["info", "gpu2", "bench"]
    assert p.stdout.splitlines()[4].startswith("budget ")


def test_select_and_by_name():
    assert S.select(None) == [s for s in S.STAGES if not s.on_request] == S.select([])
    assert [s.name for s in S.select(["nccl-tests"])] == ["info", "nccl-tests"]
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


@pytest.mark.parametrize("args,msg", [
    (["--jobs", "0", "/tmp/x"], "--jobs: expected 1..64 commands at once, got '0'"),
    (["--jobs", "two", "/tmp/x"], "--jobs: expected a whole number of commands at once, got "
                                  "'two'"),
    (["--debt", "/tmp/x"], "--debt: takes no OUTDIR, --stage or --list (it runs nothing)"),
    (["--debt", "--stage", "gpu2"], "--debt: takes no OUTDIR, --stage or --list"),
    (["--mps", "maybe", "/tmp/x"], "--mps: invalid choice: 'maybe'")])
def test_bad_new_flags_are_refused_in_one_line(args, msg):
    p = _run(*args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == ""
    assert msg in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_outdir_is_required_without_list():
    p = _run()
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().endswith("error: OUTDIR is required (the folder for the report), "
                                     "unless --list or --debt (see 'python -m ncclpy.selftest -h')")
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
    st = S.by_name("gpu2")                                 # bound 300 s, min 90 s
    assert S.decide(st, 1000) == (True, 300.0, "")
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
    # info, then every shared stage can start at once, and the timed ones still fit after
    info = S.by_name("info")
    default = S.select(None)
    alone = [s for s in default if s.exclusive]
    assert info.timeout_s + max(s.min_s for s in default if not s.exclusive) + \
        sum(s.min_s for s in alone) <= S.DEFAULT_BUDGET_S - S.RESERVE_S
    assert {s.name for s in alone} == {"bench", "overhead"}
    assert set(S.TIMED) == {"bench", "overhead", "nccl-tests"}
    assert S.ON_REQUEST == ("nccl-tests",)
    # the on-request stage's own call: info, then it, within the default budget
    side = S.by_name("nccl-tests")
    assert side.exclusive and info.timeout_s + side.min_s <= S.DEFAULT_BUDGET_S - S.RESERVE_S


def _stage(name: str, code: str, timeout: float = 30, min_s: float = 0.5) -> S.Stage:
    return S.Stage(name, f"test stage {name}", "cmd", timeout, min_s, args=("-c", code))


def _ctx(tmp_path: Path) -> S.Ctx:
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    return S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp))


def test_budget_skips_the_stages_that_cannot_fit(tmp_path):
    stages = [_stage("slow", "import time; time.sleep(300)", timeout=600, min_s=1),
              _stage("big", "pass", min_s=30), _stage("small", "pass", min_s=0.5)]
    said = []
    t0 = time.monotonic()
    res, interrupted = SC.run_stages(stages, _ctx(tmp_path), str(ROOT), S.RESERVE_S + 3,
                                     say=said.append, grace_s=2)
    assert not interrupted and time.monotonic() - t0 < HANG   # cut, not its 300 s
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
    res, interrupted = SC.run_stages(stages, ctx, str(ROOT), 120, say=lambda s: None,
                                     grace_s=2)
    assert time.monotonic() - t0 < HANG and not interrupted    # not the family's 60 s
    assert res[0].status == "did not finish" and res[0].commands[0]["timed_out"]
    assert 3 <= res[0].seconds < HANG                           # its bound, then stopped
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

    with sigint_handled():            # SIGINT raises KeyboardInterrupt, however pytest started
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
    res, _ = SC.run_stages([_pytest_stage(tmp_path, "sample", 0, 60)], ctx, str(ROOT), 120,
                           say=lambda s: None)
    r = res[0]
    assert r.status == "failed" and r.commands[0]["rc"] == 1
    c = r.counts
    assert (c["passed"], c["failed"], c["errors"], c["skipped"], c["total"]) == (2, 1, 0, 1, 4)
    assert c["failures"][0]["id"].endswith("test_sample.py::test_bad")
    assert "boom" in c["failures"][0]["message"]
    assert "00-sample.xml" in r.files and "00-sample.log" in r.files


@pytest.mark.parametrize("parent_sigint", ["default", "ignored (nohup)"])
def test_pytest_stage_stopped_at_its_bound_keeps_the_counts_of_what_finished(tmp_path,
                                                                             parent_sigint):
    """A stage is stopped by SIGINT at its bound and keeps what finished, also when the selftest
    itself runs with SIGINT ignored (started under nohup): the stage must not inherit that."""
    ctx = _ctx(tmp_path)
    prev = signal.signal(signal.SIGINT, signal.SIG_IGN if parent_sigint != "default"
                         else signal.default_int_handler)
    try:
        res, _ = SC.run_stages([_pytest_stage(tmp_path, "partial", 60, 5)], ctx, str(ROOT),
                               120, say=lambda s: None, grace_s=5)
    finally:
        signal.signal(signal.SIGINT, prev)
    r = res[0]
    assert r.status == "did not finish"
    assert (r.counts["passed"], r.counts["failed"], r.counts["skipped"]) == (1, 1, 1)
    assert R.stage_line(r).startswith("partial: did not finish (bound 5 s): 1 passed, 1 failed")


