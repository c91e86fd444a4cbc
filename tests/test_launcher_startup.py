"""``ncclpy run`` before and while its ranks start, for real (CPU): a job larger than the
machine allows is refused before the first fork; a rank that fails during start-up stops the
start-up; a closed output pipe stops the ranks (141); ``--nproc`` is a spelling of ``-n``."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ncclpy.errors import ArgumentError
from ncclpy.launch.limits import check_start_limits, fds_needed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("NCCLPY_STORE_TOKEN", None)
    env["NCCLPY_MPS"] = "off"
    return env


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncclpy", "run", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_more_ranks_than_open_files_is_refused_before_anything_starts(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = hard if hard != resource.RLIM_INFINITY else soft
    if cap == resource.RLIM_INFINITY:
        pytest.skip("no open-file limit here")
    n = cap // 2 + 1                      # two pipes per rank: more than the hard limit allows
    marker = tmp_path / "started"
    cp = run("-n", str(n), "--", sys.executable, "-c",
             f"open({str(marker)!r}, 'a').write('x')")
    assert cp.returncode == 2 and not marker.exists(), cp.stderr[-2000:]
    assert cp.stderr == (f"ncclpy run: error: -n {n}: starting {n} ranks here needs about "
                         f"{fds_needed(n)} open files (2 output pipes per rank) but this process "
                         f"may open {cap} (ulimit -n; hard limit {cap}); start fewer ranks per "
                         f"node or raise the limit\n")


def test_the_soft_limit_is_raised_when_the_hard_one_allows_it():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 256:
        pytest.skip("needs a finite hard open-file limit of 256 or more")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        check_start_limits(100, "-n")             # needs 264 > 128: raised, not refused
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= fds_needed(100)
        with pytest.raises(ArgumentError, match=r"^--nprocs \d+: starting"):
            check_start_limits(hard, "--nprocs")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_rank_failing_during_start_up_stops_the_start_up():
    """Rank 1 fails at once; of 3,000 ranks, those not yet started never are, and the summary
    names rank 1 and how many never started (before: every rank was forked first)."""
    n = 3000
    if fds_needed(n) > resource.getrlimit(resource.RLIMIT_NOFILE)[1]:
        pytest.skip("the open-file limit is below what 3,000 ranks need")
    t0 = time.monotonic()
    cp = run("-n", str(n), "--", "sh", "-c", 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 60',
             timeout=110)
    took = time.monotonic() - t0
    assert cp.returncode == 3, cp.stderr[-2000:]
    last = cp.stderr.strip().splitlines()[-1]
    assert last.startswith("ncclpy run: rank 1 exited with code 3; stopped the other "), last
    never = int(last.split("; ")[-1].split()[0])
    assert 0 < never < n and last.endswith("never started (the failure came during start-up)")
    assert took < 100, took


def test_a_closed_output_pipe_stops_the_ranks_with_141(tmp_path):
    marker = tmp_path / "done"
    prog = ("import sys, time\n"
            "for i in range(3000):\n"
            "    print('line', i, flush=True); time.sleep(0.01)\n"
            f"open({str(marker)!r}, 'a').write('finished')\n")
    p = subprocess.Popen([sys.executable, "-m", "ncclpy", "run", "-n", "2", "--", sys.executable,
                          "-c", prog], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline()       # `| head -1`
    p.stdout.close()
    rc = p.wait(timeout=120)                                   # a deadline for a hang
    err = p.stderr.read().decode() if p.stderr else ""
    assert rc == 141 and "Traceback" not in err, err
    assert not marker.exists()     # the ranks did not run on (their 3,000 lines take 30 s+)


def test_nproc_is_a_spelling_of_n():
    cp = run("--nproc", "2", "--", sys.executable, "-c", "import os; print(os.environ['RANK'])")
    assert cp.returncode == 0, cp.stderr
    assert sorted(cp.stdout.splitlines()) == ["[rank 0] 0", "[rank 1] 1"]
    cp = run("--nproc", "0", "--", "true")
    assert cp.returncode == 2 and cp.stderr.startswith("ncclpy run: error: --nproc: ")
