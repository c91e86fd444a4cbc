"""``ncclpy bench`` (issue 38, item 9): the sweep of ``python -m bench`` from any directory, as
an installed command; ``python -m bench`` stays for the checkout."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from module_run import ROOT

pytestmark = pytest.mark.timeout(300)


def _ncclpy(*args: str, cwd: Path, env_path: str = str(ROOT), timeout: float = 240
            ) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=env_path)
    env.pop("NCCL_TESTS_MIN_BW", None)
    return subprocess.run([sys.executable, "-m", "ncclpy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_ncclpy_bench_runs_a_gloo_sweep_outside_the_checkout(tmp_path):
    cp = _ncclpy("bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K", "-e",
                 "4K", "-f", "4", "-n", "2", "-q", "-J", "r.json", cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "# Collective test starting: all_reduce_perf" in cp.stdout
    assert "# Out of bounds values : 0 OK" in cp.stdout
    sizes = [line.split()[0] for line in cp.stdout.splitlines()
             if line.strip() and not line.startswith("#")]
    assert sizes == ["1024", "4096"]
    assert (tmp_path / "r.json").exists()                      # relative to where it ran
    import json
    assert json.loads((tmp_path / "r.json").read_text())["args"][0] == "ncclpy bench"


def test_ncclpy_bench_speaks_as_ncclpy_bench(tmp_path):
    cp = _ncclpy("bench", "all_reduce", "--device", "cpu", "-g", "2", cwd=tmp_path)
    assert cp.returncode == 2 and cp.stdout == "", cp.stderr
    assert cp.stderr.startswith("ncclpy bench: error: -g 2: one GPU per rank here"), cp.stderr
    assert cp.stderr.endswith("(see 'ncclpy bench -h')\n")
    cp = _ncclpy("bench", "--help", cwd=tmp_path)
    assert cp.returncode == 0 and cp.stdout.startswith("usage: ncclpy bench "), cp.stdout[:200]
    cp = _ncclpy("--help", cwd=tmp_path)
    assert cp.returncode == 0 and "bench" in cp.stdout


def test_the_wheel_carries_the_bench_as_ncclpy_bench_and_its_data(tmp_path):
    """The wheel installs ncclpy and the bench/ folder as ``ncclpy_bench`` (issue 50: never a
    top-level ``bench``, which would clash with a user's own), its backends and every data
    file its code opens, so a non-editable ``pip install .`` has ``ncclpy bench``."""
    import glob
    import zipfile
    cp = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                         "--no-build-isolation", "-q", "-w", str(tmp_path)],
                        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert cp.returncode == 0, cp.stderr[-2000:]
    (wheel,) = glob.glob(str(tmp_path / "ncclpy-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ncclpy", "ncclpy_bench"}, tops
    assert "ncclpy_bench/backends/ncclpy_cpu.py" in names and "ncclpy_bench/__main__.py" in names
    read = {p.name for p in (ROOT / "bench").iterdir() if p.suffix == ".json"}
    assert read and {f"ncclpy_bench/{n}" for n in read} <= set(names), read


def test_the_checkout_runs_its_own_bench_folder_and_an_install_ncclpy_bench():
    from ncclpy.cli import bench_package
    assert bench_package() == "bench"            # this checkout's bench/, importable as bench


def _can_build_offline() -> bool:
    if importlib.util.find_spec("wheel") is not None:
        return True
    import setuptools
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)              # bdist_wheel inside setuptools itself


@pytest.mark.slow
def test_a_non_editable_install_has_ncclpy_bench(tmp_path):
    if not _can_build_offline():
        pytest.skip("no offline wheel build here (neither 'wheel' nor setuptools >= 70.1)")
    import shutil
    src, target = tmp_path / "src", tmp_path / "site"    # built from a copy: no build/ left here
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("ncclpy", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, src / name)
    cp = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                         "--no-build-isolation", "--target", str(target), str(src)],
                        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert (target / "ncclpy_bench" / "schema.json").exists()
    assert not (target / "bench").exists()        # no top-level bench to clash with
    probe = ("import ncclpy.cli as c, ncclpy_bench; print(c.bench_package()); "
             "print(ncclpy_bench.__file__)")
    cp = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=60, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(target)))
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["ncclpy_bench", str(target / "ncclpy_bench" / "__init__.py")]
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    cp = _ncclpy("bench", "all_reduce", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "1",
                 "-q", cwd=run_dir, env_path=str(target))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "# Out of bounds values : 0 OK" in cp.stdout
