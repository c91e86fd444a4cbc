"""The GPU ledger and the GPU debt, on CPU: which files a process and each test executed (the
file tracer in real subprocesses and pytest runs, fixtures and pooled ranks included), the
ledger a run writes, and the debt of a tree against it -- a change to a file that a passing GPU
test executed makes that test debt, a test skipped for its NCCL version does not."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import proc_speed
from ncclpy.selftest import debt as D, ledger as L, record
from ncclpy.selftest.stages import TIMED

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ncclpy" / "selftest" / "_sitehook"
def _python312():
    """A Python 3.12+ to run the sys.monitoring path with, if this machine has one."""
    if sys.version_info >= (3, 12):
        return sys.executable
    for p in (shutil.which("python3.13"), shutil.which("python3.12"),
              "/root/.pyenv/versions/3.12.1/bin/python"):
        if p and os.path.exists(p) and subprocess.run([p, "-c", "import sys; sys.monitoring"],
                                                      capture_output=True).returncode == 0:
            return p
    return None


PY312 = _python312()

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("gpu_ledger")]


def _trace_env(root: Path, folder: Path, context: str = "base") -> dict:
    env = dict(os.environ)
    env.update(NCCLPY_LEDGER_DIR=str(folder), NCCLPY_LEDGER_ROOT=str(root),
               NCCLPY_LEDGER_CONTEXT=context,
               PYTHONPATH=os.pathsep.join([str(HOOK), str(root), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    return env


_PROG = """
import sys
import ncclpy.semantics.dtypes
ft = sys.modules["ncclpy.selftest.filetrace"]
ft.begin("inner")
import ncclpy.launch.limits
ncclpy.dtypes.dtype_name("float32")
ft.end()
"""


@pytest.mark.parametrize("python", [sys.executable, PY312], ids=["this-python", "python3.12"])
def test_a_process_records_what_it_executes_per_context(tmp_path, python):
    if python is None:
        pytest.skip("no Python 3.12 here for sys.monitoring (this Python uses the profiler)")
    folder = tmp_path / "trace"
    folder.mkdir()
    subprocess.run([python, "-c", _PROG], env=_trace_env(ROOT, folder), check=True, timeout=60)
    recs = {r["context"]: r for r in L_records(folder)}
    assert set(recs) == {"base", "inner"}
    inner, base = recs["inner"]["files"], recs["base"]["files"]
    assert "ncclpy/launch/limits.py" in inner and "ncclpy/launch/__init__.py" in inner
    assert "ncclpy/semantics/dtypes.py" in inner                     # called again: seen again
    assert ("ncclpy/__init__.py" in base
            and "ncclpy/semantics/dtypes.py" in base)   # module bodies count
    assert recs["base"]["base"] is True and "base" not in recs["inner"]
    assert not any(f.startswith("ncclpy/selftest/") for f in inner + base)
    assert all(not os.path.isabs(f) and f.endswith(".py") for f in inner + base)


def L_records(folder: Path) -> list:
    from ncclpy.selftest.filetrace import read_records
    return read_records(str(folder))


# -- a pytest run in a small repository of its own --------------------------------------------
_CONFTEST = """
import pytest

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: gpu")
    config.addinivalue_line("markers", "gpu_world(n): ranks")
"""
_HELPER = "def value():\n    return 41 + 1\n"
_CHILD = "import sys\nsys.path.insert(0, sys.argv[1])\nimport _child_helper\n_child_helper.go()\n"
_TESTS = """
import os, subprocess, sys
import pytest
import _helper

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_world(2)]
HERE = os.path.dirname(os.path.abspath(__file__))

@pytest.fixture(scope="module")
def child():
    subprocess.run([sys.executable, os.path.join(HERE, "_child.py"), HERE], check=True)
    return 1

def test_uses_helper_and_fixture(child):
    import _lazy                  # imported by this test alone
    assert _helper.value() == _lazy.value() == 42

def test_uses_fixture_only(child):
    pass

def test_plain_pass():
    pass

def test_needs_newer_nccl():
    pytest.skip("config_fields: NCCL 2.28.9 < 2.29.2: ncclConfig_t's 2.29 fields")

def test_fails():
    assert False, "boom"
"""


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    gpu = root / "tests" / "gpu"
    gpu.mkdir(parents=True)
    (gpu / "conftest.py").write_text(_CONFTEST)
    (gpu / "_helper.py").write_text(_HELPER)
    (gpu / "_lazy.py").write_text(_HELPER)
    (gpu / "_child_helper.py").write_text("def go():\n    return 'child'\n")
    (gpu / "_child.py").write_text(_CHILD)
    (gpu / "test_sample_gpu.py").write_text(_TESTS)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t",
                    "commit", "-qm", "sample"], check=True)
    return root


def _pytest_run(root: Path, folder: Path) -> None:
    env = proc_speed.pytest_env(_trace_env(root, folder, context="pytest:gpu2"))
    env["NCCLPY_SELFTEST_STAGE"] = "gpu2"
    subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
                    "-p", "ncclpy.selftest.ledger_plugin"], cwd=root, env=env, timeout=120,
                   capture_output=True)


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory) -> tuple:
    """The sample repository and the records of one traced pytest run in it: (root, work).
    The same run for the two tests that read it (each copies it before changing anything)."""
    base = tmp_path_factory.mktemp("sample-run")
    root = _repo(base)
    work = base / "work"
    (work / "trace").mkdir(parents=True)
    _pytest_run(root, work / "trace")
    return root, work


def _copy_run(sample_run: tuple, tmp_path: Path) -> tuple:
    """A copy of the sample run (repository with its git, records) under ``tmp_path``."""
    root, work = tmp_path / "repo", tmp_path / "work"
    shutil.copytree(sample_run[0], root, symlinks=True)
    shutil.copytree(sample_run[1], work, symlinks=True)
    return root, work


def test_each_test_gets_its_outcome_and_the_files_it_and_its_fixtures_executed(sample_run,
                                                                                  tmp_path):
    _, work = _copy_run(sample_run, tmp_path)
    res = record.results_of_run(record.RunRecord("d", "c", 1, []), str(work))
    t = {k.split("::")[1]: v for k, v in res.items()}
    assert {k: v["outcome"] for k, v in t.items()} == {
        "test_uses_helper_and_fixture": "passed", "test_uses_fixture_only": "passed",
        "test_plain_pass": "passed", "test_needs_newer_nccl": "skipped", "test_fails": "failed"}
    assert all(v["stage"] == "gpu2" for v in t.values())
    assert "NCCL 2.28.9 < 2.29.2" in t["test_needs_newer_nccl"]["reason"]
    assert "boom" in t["test_fails"]["reason"]
    both = t["test_uses_helper_and_fixture"]["files"]
    assert "tests/gpu/_helper.py" in both and "tests/gpu/test_sample_gpu.py" in both
    assert "tests/gpu/_lazy.py" in both
    # a module body runs once per process: it counts for every test of that process (the
    # tests after an import run on what it defined), here the pytest process's
    assert "tests/gpu/_helper.py" in t["test_fails"]["files"]
    assert "tests/gpu/_lazy.py" in t["test_plain_pass"]["files"]
    # the module fixture's subprocess ran once, for both tests that use it
    assert "tests/gpu/_child_helper.py" in both and "tests/gpu/_child.py" in both
    assert "tests/gpu/_child_helper.py" in t["test_uses_fixture_only"]["files"]
    assert "tests/gpu/_child_helper.py" not in t["test_fails"]["files"]
    assert "tests/gpu/_child_helper.py" not in t["test_plain_pass"]["files"]
    assert "tests/gpu/conftest.py" in both                  # the pytest process's start-up


def test_a_change_to_a_file_a_passing_test_executed_makes_it_debt(sample_run, tmp_path):
    root, work = _copy_run(sample_run, tmp_path)
    rec = record.RunRecord("2026-11-27 10:00", "cmd", 480, [])
    path = tmp_path / "ledger.json"
    doc, n = record.update_ledger(rec, str(work), str(root), str(path), "abc1234",
                                  copy_to=str(tmp_path))
    assert n == 5 and json.loads((tmp_path / "gpu-ledger.json").read_text()) == doc
    tests = [{"id": i, "stage": "gpu2", "worlds": [2]} for i in doc["items"]]
    tests.append({"id": "tests/gpu/test_sample_gpu.py::test_new", "stage": "gpu2"})
    d = D.compute(L.load(str(path)), str(root), tests, timed=("bench",))
    by = {i.id.split("::")[-1]: i for i in d.items}
    assert by["test_uses_helper_and_fixture"].status == "proven", by
    assert by["test_uses_fixture_only"].status == "proven"
    assert by["test_needs_newer_nccl"].status == "version-skipped"
    assert by["test_needs_newer_nccl"].detail == "skipped: NCCL 2.28.9 < 2.29.2"
    assert (by["test_fails"].status, by["test_fails"].why) == ("debt", "never passed")
    assert (by["test_new"].why, by["stage:bench"].why) == ("never run", "never run")
    # change what only the fixture's subprocess ran: the two tests that use the fixture become
    # debt, the one that passed without it stays proven
    (root / "tests" / "gpu" / "_child_helper.py").write_text(
        "def go():\n    return 'child'\n\n\ndef more():\n    pass\n")
    d = D.compute(L.load(str(path)), str(root), tests, timed=())
    by = {i.id.split("::")[-1]: i for i in d.items}
    for name in ("test_uses_helper_and_fixture", "test_uses_fixture_only"):
        changed = by[name]
        assert (changed.status, changed.why) == ("debt", "changed")
        assert changed.changed == [{"path": "tests/gpu/_child_helper.py", "added": 4,
                                    "removed": 0, "how": "+4 -0 lines"}]
    assert by["test_plain_pass"].status == "proven"
    text = "\n".join(D.format_text(d, "ledger.json"))
    assert "changed since they passed on a GPU (2):" in text
    assert "tests/gpu/_child_helper.py (+4 -0 lines)" in text
    assert "skipped on the GPU for their NCCL version, not debt (1):" in text
    # a later run where it fails: debt as "failed last", whatever the files say
    L.update(doc, "r2", {"files": L.tree_hashes(str(root))},
             {tests[0]["id"]: {"stage": "gpu2", "outcome": "failed", "reason": "x"}})
    again = {i.id: i for i in D.compute(doc, str(root), tests[:1], timed=()).items}
    assert again[tests[0]["id"]].why == "failed last"


def test_seeded_runs_count_every_file_and_unused_runs_are_dropped(tmp_path):
    root = _repo(tmp_path)
    doc = L.empty()
    table = L.tree_hashes(str(root))
    L.update(doc, "seed", {"files": table, "files_recorded": False},
             {"t::a": {"stage": "gpu2", "outcome": "passed", "files": "*"}})
    L.update(doc, "old", {"files": {}}, {"t::b": {"stage": "gpu2", "outcome": "failed"}})
    L.update(doc, "new", {"files": {}}, {"t::b": {"stage": "gpu2", "outcome": "failed"}})
    assert set(doc["runs"]) == {"seed", "new"}               # "old" is no item's run now
    d = D.compute(doc, str(root), [{"id": "t::a", "stage": "gpu2"}], timed=())
    assert d.items[0].status == "proven"
    (root / "tests" / "gpu" / "_child_helper.py").write_text("x = 1\n")
    d = D.compute(doc, str(root), [{"id": "t::a", "stage": "gpu2"}], timed=())
    assert d.items[0].why == "changed" and "may have executed" in d.items[0].detail


def test_version_skip_reasons():
    assert L.version_skip("x: NCCL 2.28.9 < 2.29.2: y") == "NCCL 2.28.9 < 2.29.2"
    assert L.version_skip("ncclCollConfig_t needs NCCL >= 23100; this is 22809") == \
        "NCCL 2.28.9 < 2.31.0"
    assert L.version_skip("config=CollConfig(...) needs NCCL >= 2.31.0; the loaded NCCL is "
                          "2.28.9") == "NCCL 2.28.9 < 2.31.0"
    assert L.version_skip("ncclCommGrow needs NCCL >= 2.29.2; this is 22809") == \
        "NCCL 2.28.9 < 2.29.2"
    assert L.version_skip("--algo needs NCCL >= 2.31: x; the loaded NCCL is 2.28.9") == \
        "NCCL 2.28.9 < 2.31.0"
    assert L.version_skip("no CUDA driver") is None and L.version_skip("") is None
    assert L.blob_hash(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_the_debt_command_reports_and_exits_0_only_without_debt(tmp_path):
    def run(ledger: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ncclpy.selftest", "--debt", "--ledger",
                               str(ledger), *extra], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env=proc_speed.pytest_env())
    empty = tmp_path / "empty.json"
    L.save(L.empty(), str(empty))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    # the commands that need nothing of each other, started together (each collects tests/gpu
    # with pytest, bytecode cached: proc_speed)
    with ThreadPoolExecutor(3) as pool, proc_speed.pytest_environ():
        tests = D.collect_tests(str(ROOT))          # alone while the bytecode cache is empty
        on_empty, on_bad = pool.submit(run, empty, "--json"), pool.submit(run, bad)
        json_alone = pool.submit(subprocess.run, [sys.executable, "-m", "ncclpy.selftest",
                                                  "--json"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=60)
        full = L.empty()
        L.update(full, "all", {"files": L.tree_hashes(str(ROOT))},
                 {**{t["id"]: {"stage": t["stage"], "outcome": "passed", "files": []}
                     for t in tests},
                  **{f"stage:{s}": {"stage": s, "outcome": "passed", "files": []}
                     for s in TIMED}})         # bench, overhead, nccl-tests
        good = tmp_path / "good.json"
        L.save(full, str(good))
        p_good = run(good)
        p = on_empty.result()
        assert p.returncode == 1, p.stderr
        doc = json.loads(p.stdout)
        assert doc["debt"] == doc["items"] > 90 and doc["proven"] == 0
        assert {e["why"] for e in doc["entries"]} == {"never run"}
        p = p_good
        assert p.returncode == 0, p.stdout + p.stderr
        n = len(tests) + len(TIMED)
        assert p.stdout.startswith(f"GPU debt of this tree against {good}: {n} GPU "
                                   f"tests and timed stages; {n} proven, 0 skipped")
        p = on_bad.result()
        assert p.returncode == 2 and "not a readable GPU ledger" in p.stderr
        assert "Traceback" not in p.stderr
        p = json_alone.result()
        assert p.returncode == 2 and "--json: only with --debt" in p.stderr


def test_pooled_ranks_record_each_task_and_their_start_up(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    import pool_tasks as T
    from rank_pool import RankPool
    folder = tmp_path / "trace"
    folder.mkdir()
    env = _trace_env(ROOT, folder, context="started-by-t1")
    pool = RankPool(2, base_environ={**env, "NCCLPY_MPS": "off"})
    try:
        for ctx in ("t1", "t2"):
            d = tmp_path / ctx
            d.mkdir()
            assert pool.run(T.report, [str(d)], timeout=60, context=ctx).ok
        pids = pool.pids
    finally:
        pool.close()
    recs = L_records(folder)
    tasks = {(r["context"], r["pid"]) for r in recs if not r.get("base")}
    assert tasks == {(c, p) for c in ("t1", "t2") for p in pids}
    for r in recs:
        if not r.get("base"):
            assert "tests/pool_tasks.py" in r["files"]
    starts = [r for r in recs if r.get("base") and r["pid"] in pids]
    assert starts and all("tests/rank_pool.py" in r["files"] for r in starts)
    files = L.files_by_test(recs, {"t2": {"contexts": ["t2"]}})["t2"]
    assert {"tests/pool_tasks.py", "tests/rank_pool.py"} <= files


def test_a_run_adds_its_results_to_the_ledger_and_says_the_debt_after(tmp_path):
    from ncclpy.selftest import cli, stages as S
    root = _repo(tmp_path)
    with proc_speed.pytest_environ():            # its pytest processes: bytecode cached
        tests = D.collect_tests(str(root))
        assert {t["stage"] for t in tests} == {"gpu2"} and len(tests) == 5
        st = S.Stage("gpu2", "the sample's GPU tests", "pytest", 120, 1, paths=("tests/gpu",))
        ledger, out, said = tmp_path / "ledger.json", tmp_path / "out", []
        rc = cli.execute([st], str(out), 120,
                         command="PYTHONPATH=. python3 -m ncclpy.selftest $OUT",
                         root=str(root), ledger=str(ledger), commit="abc1234", tests=tests,
                         out=said.append)
    assert rc == 1                                           # test_fails failed
    doc = L.load(str(ledger))
    assert json.loads((out / "gpu-ledger.json").read_text()) == doc
    (run_id, run), = doc["runs"].items()
    assert run["commit"] == "abc1234" and "tests/gpu/_helper.py" in run["files"]
    assert "UTC" not in run_id and run_id.split(" ")[0].count("T") == 1   # 2026-11-26T21:50
    assert {i.split("::")[1]: e["last"]["outcome"] for i, e in doc["items"].items()} == {
        "test_uses_helper_and_fixture": "passed", "test_uses_fixture_only": "passed",
        "test_plain_pass": "passed", "test_needs_newer_nccl": "skipped", "test_fails": "failed"}
    text = "\n".join(said)
    assert "- GPU ledger: " in text and "updated with 5 results (commit it with this block)" \
        in text
    assert ("- GPU debt after this run: 4 of 8 items (3 proven, 1 skipped for their NCCL "
            "version); by stage: bench 1, gpu2 1, nccl-tests 1, overhead 1") in text
    assert "[selftest] wrote report.md, summary.json, stages.tar.gz, gpu-ledger.json" in text
    import tarfile
    with tarfile.open(out / "stages.tar.gz") as tar:     # the records the ledger came from
        names = tar.getnames()
    assert any(n.startswith("stages/trace/trace-") for n in names)
    assert any(n.startswith("stages/trace/pytest-") for n in names)
