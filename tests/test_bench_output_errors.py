"""The bench's output files that cannot be written (issue 38, item 16): ``--csv /dev/full`` and
the like end in one line naming the flag, the file and the error, exit status 1, no traceback,
no rank left waiting; a reader that closes stdout early (``| head -1``) ends the run quietly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from bench_jobs import Commands, Job, start_jobs
from module_run import ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_output_errors"),
              pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")]

_SWEEP = ["all_reduce", "--device", "cpu", "-b", "1K", "-e", "2K", "-f", "2", "-n", "1", "-q"]
_ENOSPC = "cannot write: No space left on device (ENOSPC)\n"


_FULL = [("--csv", "--csv"), ("-J", "-J/--output_file"), ("--plot", "--plot")]
_RANKS = [[], ["--nproc", "2"]]


def _full_disk(commands: Commands, tmp: Path, flag: str, ranks: List[str]):
    path = "/dev/full"
    if flag == "--plot":                 # matplotlib takes its format from the extension
        path = str(tmp / "full.png")
        os.symlink("/dev/full", path)
    return commands.module("bench", *_SWEEP, *ranks, flag, path, timeout=240), path


def _names_itself(commands: Commands, tmp: Path):
    js = tmp / "r.json"
    env = dict(commands.env, PYTHONPATH=str(ROOT))
    cp = commands.run([sys.executable, "-m", "ncclpy", "bench", *_SWEEP, "--nproc", "2",
                       "--csv", "/dev/full", "-J", str(js)], cwd=tmp, env=env, timeout=240)
    return cp, js


def _head_1(env: Dict[str, str], tmp: Path):
    """``python -m bench ... --csv F | head -1``: the first line, the exit status, stderr."""
    err = open(tmp / "err", "w+")
    env = dict(env, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "bench", *_SWEEP, "--nproc", "2", "--csv",
                          str(tmp / "r.csv")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=err, text=True, start_new_session=True)
    try:
        first = p.stdout.readline()
        p.stdout.close()                                          # head -1 has what it wants
        rc = p.wait(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err.seek(0)
    return first, rc, err.read()


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """Every test here reads one bench run of its own (8 in all, most of them 2 gloo ranks):
    started together in the background (tests/bench_jobs.py), each test reads its own."""
    def make(commands: Commands) -> Dict[str, Job]:
        mk = tmp_path_factory.mktemp
        jobs = {f"full {flag} {len(ranks)}": Job(
            lambda flag=flag, ranks=ranks, tmp=mk("full"): _full_disk(commands, tmp, flag,
                                                                       ranks),
            ["test_a_full_disk_is_one_line_naming_the_file"])
            for ranks in _RANKS for flag, _ in _FULL}
        jobs["names itself"] = Job(lambda tmp=mk("named"): _names_itself(commands, tmp),
                                   ["test_ncclpy_bench_names_itself_and_the_other_files_still_"
                                    "get_written"])
        jobs["head -1"] = Job(lambda tmp=mk("head"): _head_1(commands.env, tmp),
                              ["test_a_reader_that_stops_after_one_line_ends_the_run_quietly"])
        return jobs
    yield from start_jobs(request, make)


@pytest.mark.parametrize("flag, shown", _FULL)
@pytest.mark.parametrize("ranks", _RANKS, ids=["1 rank", "2 ranks"])
def test_a_full_disk_is_one_line_naming_the_file(flag, shown, ranks, runs):
    cp, path = runs[f"full {flag} {len(ranks)}"]
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert cp.stderr == f"python -m bench: {shown} {path}: {_ENOSPC}", cp.stderr
    assert "# Out of bounds values : 0 OK" in cp.stdout        # the run itself was fine
    assert "# Writing" not in cp.stdout                         # and claims no file


def test_ncclpy_bench_names_itself_and_the_other_files_still_get_written(runs):
    cp, js = runs["names itself"]
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert cp.stderr == f"ncclpy bench: --csv /dev/full: {_ENOSPC}", cp.stderr
    assert f"# Writing JSON output to {js}" in cp.stdout and js.exists()


def test_a_reader_that_stops_after_one_line_ends_the_run_quietly(runs):
    """``python -m bench ... --csv F | head -1``: nothing on stderr, exit status 141."""
    first, rc, err = runs["head -1"]
    assert first.startswith("# ncclpy bench")
    assert err == "" and rc == 141
