"""Which runs of the suite are spread over the cores (tests/suite_workers.py, from
tests/conftest.py): only the whole CPU suite, only when nobody chose, never a collection or a
run that selects GPU tests."""
from __future__ import annotations

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


def test_a_run_under_dontwritebytecode_caches_outside_the_tree_and_removes_the_cache(tmp_path):
    """A real pytest run (this conftest) under PYTHONDONTWRITEBYTECODE=1: its child processes
    see the run's cache folder instead of the variable; the folder holds bytecode during the
    run and is gone after it; nothing is written beside the sources."""
    probe = tmp_path / "test_probe.py"
    pkg = tmp_path / "probe_mod.py"
    pkg.write_text("X = 1\n")
    child = (f"import json, os, sys; sys.path.insert(0, {str(tmp_path)!r}); import probe_mod; "
             "print(json.dumps([os.environ.get('PYTHONDONTWRITEBYTECODE'), "
             "os.environ.get('PYTHONPYCACHEPREFIX')]))")
    probe.write_text(
        "import json, os, subprocess, sys\n"
        "def test_env():\n"
        f"    out = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True,\n"
        "                         text=True, check=True).stdout\n"
        "    dwb, prefix = json.loads(out)\n"
        "    assert dwb is None and prefix and os.path.isdir(prefix)\n"
        "    assert [f for _, _, fs in os.walk(prefix) for f in fs if 'probe_mod' in f]\n"
        f"    open({str(tmp_path / 'prefix.txt')!r}, 'w').write(prefix)\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPYCACHEPREFIX", None)
    here = os.path.dirname(os.path.abspath(__file__))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "-c", os.devnull,
                          "--confcutdir", here, "-p", "conftest", str(probe)],
                         cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    prefix = (tmp_path / "prefix.txt").read_text()
    assert not os.path.exists(prefix)
    assert not (tmp_path / "__pycache__").exists()
