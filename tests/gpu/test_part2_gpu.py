"""GPU tests of issue 25 (NCCL 2.27-2.32's host API, part 2) on one GPU: window collectives vs
the reference, put/signal/wait between two ranks, suspend/resume with the memory statistics,
revoke then shrink (tests/gpu/_gpu_part2.py, two ranks by ncclpy.spawn); shrink after a
SIGKILLed rank in a 3-rank job and grow 2 -> 3 (tests/gpu/_gpu_part2_job.py under ``ncclpy run
-n 3 --keep-going``).  The CPU side is tests/test_nccl_part2.py.  Each test is bounded: the
spawn's own bound, the jobs' subprocess bound (180 s), the marks (300 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest

from gpu_util import cuda_reason, requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_part2 as P  # noqa: E402
from _gpu_spawn import SHORT_TEST_TIMEOUT, feature, short_run  # noqa: E402

pytestmark = pytest.mark.timeout(SHORT_TEST_TIMEOUT)
JOB_S = 180


@pytest.fixture(scope="module")
def part2_run(tmp_path_factory):
    return short_run(P.part2_worker, 2, tmp_path_factory, "part2")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_collectives_on_symmetric_windows_match_the_reference(part2_run):
    feature(part2_run, "window_collectives", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_zero_cta_policy_with_windows(part2_run):
    feature(part2_run, "window_zero_cta", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_put_signal_and_wait_between_two_ranks(part2_run):
    feature(part2_run, "put_signal", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_suspend_and_resume_with_memory_statistics(part2_run):
    feature(part2_run, "suspend_resume", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_revoke_then_shrink_without_a_failure(part2_run):
    feature(part2_run, "revoke_shrink", 2)


def _job(scenario: str) -> Dict[int, dict]:
    """``ncclpy run -n 3 --keep-going`` of the scenario: {rank: its RESULT}, and the run."""
    env = {k: v for k, v in os.environ.items() if k != "NCCLPY_STORE_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env.setdefault("NCCLPY_TIMEOUT", "60")
    p = subprocess.run([sys.executable, "-m", "ncclpy", "run", "-n", "3", "--keep-going",
                        "--grace", "5", "--timeout", str(JOB_S - 20),
                        os.path.join(HERE, "_gpu_part2_job.py"), scenario],
                       capture_output=True, text=True, timeout=JOB_S, env=env, cwd=ROOT)
    out: Dict[int, dict] = {}
    for line in p.stdout.splitlines():
        if "] RESULT " in line:
            rank = int(line.split("]", 1)[0].split()[-1])
            out[rank] = json.loads(line.split("RESULT ", 1)[1])
    out[-1] = {"rc": p.returncode, "stderr": p.stderr[-4000:], "stdout": p.stdout[-4000:]}
    _keep_logs(scenario, p)
    return out


def _keep_logs(scenario: str, p: "subprocess.CompletedProcess[str]") -> None:
    """The job's whole output and its trace folder (``ncclpy trace`` reads it) in the selftest's
    artifacts (NCCLPY_GPU_ARTIFACTS), when there are any: a failure is read from them."""
    art = os.environ.get("NCCLPY_GPU_ARTIFACTS")
    if not art:
        return
    import re
    import shutil
    with open(os.path.join(art, f"part2-{scenario}.log"), "w") as f:
        f.write(f"rc {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n")
    m = re.search(r"ncclpy trace (\S+)", p.stderr)
    if m and os.path.isdir(m.group(1)):
        shutil.copytree(m.group(1), os.path.join(art, f"part2-{scenario}-trace"),
                        dirs_exist_ok=True)


def _skip_if(res: Dict[int, dict], ranks: List[int]) -> None:
    skips = {res[r].get("skip") for r in ranks if r in res and res[r].get("skip")}
    if skips:
        pytest.skip("; ".join(sorted(skips)))


@pytest.mark.gpu
@pytest.mark.gpu_world(3)
@pytest.mark.skipif(bool(cuda_reason()), reason=cuda_reason() or "CUDA present")
def test_shrink_after_a_sigkilled_rank_and_carry_on():
    res = _job("recover")
    _skip_if(res, [0, 1])
    run = res[-1]
    assert run["rc"] == 128 + 9, run                    # rank 2's death is still the outcome
    assert "--keep-going: the others ran to their end" in run["stderr"], run
    refused = [r for r in (0, 1) if "refused" in (res.get(r) or {})]
    assert refused in ([], [0, 1]), (res, run)          # the survivors agree, never one alone
    for r in (0, 1):
        got = res.get(r)
        assert got is not None and "error" not in got, (got, run)
        assert got["suspects"] == [2] and got["parent_state"] == "aborted", got
        assert "revoked (ncclCommRevoke" in got["message"], got
        if refused:      # a survivor's proxy saw the death: NCCL refuses its shrink (2.28.9)
            assert "ncclCommShrink failed" in got["refused"] and \
                "not called: NCCL refuses to shrink" in got["refused"], got
        else:
            assert got["child"] == [r, 2] and got["sum"] == 3.0, got


@pytest.mark.gpu
@pytest.mark.gpu_world(3)
@pytest.mark.skipif(bool(cuda_reason()), reason=cuda_reason() or "CUDA present")
def test_grow_two_ranks_to_three():
    res = _job("grow")
    _skip_if(res, [0, 1, 2])
    run = res[-1]
    assert run["rc"] == 0, run
    for r in (0, 1, 2):
        assert res.get(r) == {"rank": r, "grown": [r, 3], "sum": 6.0}, (res.get(r), run)
