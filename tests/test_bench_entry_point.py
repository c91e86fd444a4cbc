"""``ncclpy bench`` (issue 38, item 9): the sweep of ``python -m bench`` from any directory, as
an installed command; ``python -m bench`` stays for the checkout."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from bench_jobs import Commands, Job, start_jobs
from module_run import ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_entry_point")]


def _ncclpy(commands: Commands, *args: str, cwd: Path, env_path: str = str(ROOT),
            timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(commands.env, PYTHONPATH=env_path)
    env.pop("NCCL_TESTS_MIN_BW", None)
    return commands.run([sys.executable, "-m", "ncclpy", *args], cwd=cwd, env=env,
                        timeout=timeout)


def _wheel(commands: Commands, tmp_path: Path):
    cp = commands.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                       "--no-build-isolation", "-q", "-w", str(tmp_path)], timeout=240,
                      cwd=tmp_path)
    return cp, tmp_path


def _install(commands: Commands, tmp_path: Path):
    """``pip install --target`` of a copy of the checkout, then what the test reads: the
    probe of the installed packages and ``ncclpy bench`` run from elsewhere."""
    import shutil
    src, target = tmp_path / "src", tmp_path / "site"    # built from a copy: no build/ left here
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("ncclpy", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, src / name)
    install = commands.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--no-build-isolation", "--target", str(target), str(src)],
                           timeout=240, cwd=tmp_path)
    if install.returncode != 0:
        return install, None, None, target
    probe = ("import ncclpy.cli as c, ncclpy_bench; print(c.bench_package()); "
             "print(ncclpy_bench.__file__)")
    probed = commands.run([sys.executable, "-c", probe], timeout=60, cwd=tmp_path,
                          env=dict(commands.env, PYTHONPATH=str(target)))
    if probed.returncode != 0:
        return install, probed, None, target
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    ran = _ncclpy(commands, "bench", "all_reduce", "--device", "cpu", "-b", "1K", "-e", "1K",
                  "-n", "1", "-q", cwd=run_dir, env_path=str(target))
    return install, probed, ran, target


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The module's commands (a gloo sweep, pip's wheel build and install), started together
    in the background; each test reads its own (tests/bench_jobs.py)."""
    def make(commands: Commands) -> Dict[str, Job]:
        mk = tmp_path_factory.mktemp
        speaks = ["test_ncclpy_bench_speaks_as_ncclpy_bench"]
        tmp = mk("speaks")
        jobs = {
            "sweep": Job(lambda tmp=mk("sweep"): (_ncclpy(
                commands, "bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K",
                "-e", "4K", "-f", "4", "-n", "2", "-q", "-J", "r.json", cwd=tmp), tmp),
                ["test_ncclpy_bench_runs_a_gloo_sweep_outside_the_checkout"]),
            "-g 2": Job(lambda: _ncclpy(commands, "bench", "all_reduce", "--device", "cpu",
                                        "-g", "2", cwd=tmp), speaks),
            "bench --help": Job(lambda: _ncclpy(commands, "bench", "--help", cwd=tmp), speaks),
            "--help": Job(lambda: _ncclpy(commands, "--help", cwd=tmp), speaks),
            "wheel": Job(lambda tmp=mk("wheel"): _wheel(commands, tmp),
                         ["test_the_wheel_carries_the_bench_as_ncclpy_bench_and_its_data"]),
        }
        if _can_build_offline():     # the test skips without it: nothing to run
            jobs["install"] = Job(lambda tmp=mk("install"): _install(commands, tmp),
                                  ["test_a_non_editable_install_has_ncclpy_bench"])
        return jobs
    yield from start_jobs(request, make)


def test_ncclpy_bench_runs_a_gloo_sweep_outside_the_checkout(runs):
    cp, tmp_path = runs["sweep"]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "# Collective test starting: all_reduce_perf" in cp.stdout
    assert "# Out of bounds values : 0 OK" in cp.stdout
    sizes = [line.split()[0] for line in cp.stdout.splitlines()
             if line.strip() and not line.startswith("#")]
    assert sizes == ["1024", "4096"]
    assert (tmp_path / "r.json").exists()                      # relative to where it ran
    import json
    assert json.loads((tmp_path / "r.json").read_text())["args"][0] == "ncclpy bench"


def test_ncclpy_bench_speaks_as_ncclpy_bench(runs):
    cp = runs["-g 2"]
    assert cp.returncode == 2 and cp.stdout == "", cp.stderr
    assert cp.stderr.startswith("ncclpy bench: error: -g 2: one GPU per rank here"), cp.stderr
    assert cp.stderr.endswith("(see 'ncclpy bench -h')\n")
    cp = runs["bench --help"]
    assert cp.returncode == 0 and cp.stdout.startswith("usage: ncclpy bench "), cp.stdout[:200]
    cp = runs["--help"]
    assert cp.returncode == 0 and "bench" in cp.stdout


def test_the_wheel_carries_the_bench_as_ncclpy_bench_and_its_data(runs):
    """The wheel installs ncclpy and the bench/ folder as ``ncclpy_bench`` (issue 50: never a
    top-level ``bench``, which would clash with a user's own), its backends and every data
    file its code opens, so a non-editable ``pip install .`` has ``ncclpy bench``."""
    import glob
    import zipfile
    cp, tmp_path = runs["wheel"]
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
def test_a_non_editable_install_has_ncclpy_bench(runs):
    if not _can_build_offline():
        pytest.skip("no offline wheel build here (neither 'wheel' nor setuptools >= 70.1)")
    cp, probed, ran, target = runs["install"]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert (target / "ncclpy_bench" / "schema.json").exists()
    assert not (target / "bench").exists()        # no top-level bench to clash with
    cp = probed
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["ncclpy_bench", str(target / "ncclpy_bench" / "__init__.py")]
    cp = ran
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "# Out of bounds values : 0 OK" in cp.stdout
