"""Which runs of the suite are spread over the cores (tests/suite_workers.py, from
tests/conftest.py): only the whole CPU suite, only when nobody chose, never a collection or a
run that selects GPU tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from suite_workers import WORKERS_ENV, bytecode_cache_env, whole_suite_workers


def _n(whole=True, numprocesses=None, collectonly=False, markexpr="", env=None, cpus=2):
    return whole_suite_workers(whole, numprocesses, collectonly, markexpr, env or {}, cpus)


def test_the_whole_suite_gets_one_worker_per_core_up_to_eight():
    assert [_n(cpus=c) for c in (1, 2, 3, 16)] == [0, 2, 3, 8]


@pytest.mark.parametrize("kw", [dict(whole=False), dict(numprocesses=0), dict(numprocesses=3),
                                dict(collectonly=True), dict(markexpr="gpu"),
                                dict(markexpr="not gpu and slow")])
def test_anything_else_stays_in_one_process(kw):
    """Some files, a chosen ``-n`` (0 included), a collection, any selection naming the GPU
    marker (GPU tests share one GPU under a device-time budget)."""
    assert _n(**kw) == 0


def test_the_environment_chooses_the_count():
    assert _n(env={WORKERS_ENV: "4"}) == 4
    assert _n(env={WORKERS_ENV: "1"}) == _n(env={WORKERS_ENV: "0"}) == 0
    assert _n(env={WORKERS_ENV: "lots"}, cpus=2) == 2          # not a count: the default


def test_bytecode_cache_only_where_no_process_would_write_bytecode(tmp_path):
    """Under PYTHONDONTWRITEBYTECODE the run gets a cache folder of its own (never beside the
    sources); where bytecode is written anyway, or a cache folder is chosen, nothing changes."""
    d = str(tmp_path)
    assert bytecode_cache_env({"PYTHONDONTWRITEBYTECODE": "1"}, d) == {
        "PYTHONDONTWRITEBYTECODE": None, "PYTHONPYCACHEPREFIX": d}
    assert bytecode_cache_env({}, d) == {}
    assert bytecode_cache_env({"PYTHONDONTWRITEBYTECODE": ""}, d) == {}
    assert bytecode_cache_env({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/x"},
                              d) == {}


def test_the_whole_suite_under_dontwritebytecode_caches_outside_the_tree_and_removes_it(tmp_path):
    """A real pytest run of a whole suite (this conftest, copied with a probe test into a folder
    of its own, run without paths as the README runs it) under PYTHONDONTWRITEBYTECODE=1: its
    child processes see the run's cache folder instead of the variable; the folder holds their
    bytecode during the run and is gone after it; nothing is written beside the sources.  The
    same probe run by path (some files, not the whole suite) gets no cache."""
    import shutil
    here = os.path.dirname(os.path.abspath(__file__))
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("conftest.py", "suite_workers.py"):
        shutil.copy(os.path.join(here, name), suite / name)
    (suite / "probe_mod.py").write_text("X = 1\n")
    child = (f"import json, os, sys; sys.path.insert(0, {str(suite)!r}); import probe_mod; "
             "print(json.dumps([os.environ.get('PYTHONDONTWRITEBYTECODE'), "
             "os.environ.get('PYTHONPYCACHEPREFIX')]))")
    (suite / "test_probe.py").write_text(
        "import json, os, subprocess, sys\n"
        "def test_env():\n"
        f"    out = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True,\n"
        "                         text=True, check=True).stdout\n"
        "    dwb, prefix = json.loads(out)\n"
        "    if prefix:\n"
        "        assert dwb is None and os.path.isdir(prefix)\n"
        "        assert [f for _, _, fs in os.walk(prefix) for f in fs if 'probe_mod' in f]\n"
        f"    open({str(tmp_path / 'seen.json')!r}, 'w').write(json.dumps([dwb, prefix]))\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", NCCLPY_TEST_WORKERS="0")
    env.pop("PYTHONPYCACHEPREFIX", None)

    def run(*args: str) -> list:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-c", os.devnull, "--rootdir", str(suite), *args],
                             cwd=suite, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return json.loads((tmp_path / "seen.json").read_text())

    dwb, prefix = run()
    assert dwb is None and prefix and not os.path.exists(prefix)
    assert not (suite / "__pycache__").exists()
    assert run("test_probe.py") == ["1", None]
