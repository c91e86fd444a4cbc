"""Where the seed tests read the tutorials, and what ``NCCLPY_SEEDS`` does (docs/design.md,
"Cross-check"): a directory, ``none`` (the committed snapshot alone), or a bad path (an error
naming it).  The last two run the seed tests themselves in a real pytest subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import seed_util as U

ROOT = Path(__file__).resolve().parents[1]


def test_none_means_the_snapshot_alone(monkeypatch):
    monkeypatch.setenv("NCCLPY_SEEDS", "none")
    assert U.workspace_seeds() is None
    assert U.seeds_dir() == U.SNAPSHOT and (U.SNAPSHOT / "README.md").is_file()


def test_a_directory_with_a_readme_is_used(monkeypatch):
    monkeypatch.setenv("NCCLPY_SEEDS", str(U.SNAPSHOT))
    assert U.workspace_seeds() == U.SNAPSHOT == U.seeds_dir()


def test_a_bad_path_is_an_error_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCLPY_SEEDS", str(tmp_path / "nowhere"))
    with pytest.raises(AssertionError, match="nowhere.*no README.md"):
        U.seeds_dir()


def _seed_tests(tmp_path: Path, seeds: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NCCLPY_SEEDS=seeds)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_seed_examples_reference.py", "-q",
         "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'bt'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_seed_tests_pass_with_seeds_none(tmp_path):
    """NCCLPY_SEEDS=none: every seed test runs on the snapshot and passes; only the comparison
    with a workspace copy skips."""
    p = _seed_tests(tmp_path, "none")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    tail = p.stdout.strip().splitlines()[-1]
    assert " passed" in tail and "1 skipped" in tail and "failed" not in tail, tail
    assert "NCCLPY_SEEDS=none" in p.stdout


def test_seed_tests_fail_naming_a_bad_seeds_path(tmp_path):
    bad = str(tmp_path / "no-seeds-here")
    p = _seed_tests(tmp_path, bad)
    assert p.returncode == 1, p.stdout[-3000:]
    assert f"NCCLPY_SEEDS={bad!r}: no README.md there" in p.stdout
