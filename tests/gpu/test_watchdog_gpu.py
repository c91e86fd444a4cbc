"""GPU tests of the watchdog's abort (issue 15): a rank killed in the middle of a long
all_reduce loop, and a rank that skips a collective; and checked mode's one vote per rank per
call on real communicators, which leaves no key (issue 26).  The other ranks must raise
CommAbortedError naming the collective, its sequence number and the suspected rank within
timeout + 5 s.  Ranks are plain processes (not ncclpy.spawn, whose fail-fast would stop the
survivors before they report)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, n: int, outdir: str) -> list:
    """Start n plain rank processes placed as ``ncclpy run`` places them (several ranks on one
    GPU need a distinct NCCL_HOSTID each, or NCCL refuses them as duplicate GPUs; MPS when the
    driver has it), wait for them, and read what each survivor wrote."""
    from ncclpy.launch.mps import setup_mps
    from ncclpy.launch.placement import place, with_mps
    port = _free_port()
    plan = place(n, single_node=True)
    mps = setup_mps("auto", plan.shared, os.environ, name="mps")
    if mps.status is not None:
        plan = with_mps(plan, mps.status, mps.env, mps.unset)
    ps = []
    try:
        for r in range(n):
            env = {k: v for k, v in os.environ.items() if k not in plan.unset}
            env.update(plan.env(r), NCCLPY_RANK=str(r), NCCLPY_WORLD_SIZE=str(n),
                       NCCLPY_LOCAL_RANK=str(r), NCCLPY_LOCAL_WORLD_SIZE=str(n),
                       NCCLPY_MASTER_ADDR="127.0.0.1", NCCLPY_MASTER_PORT=str(port),
                       NCCLPY_TIMEOUT=str(TIMEOUT), PYTHONPATH=os.pathsep.join(
                           p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
            ps.append(subprocess.Popen([sys.executable, os.path.join(HERE, "_gpu_watchdog.py"),
                                        mode, outdir], env=env))
        for p in ps:
            try:
                p.wait(timeout=240)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{mode}: a rank did not finish within 240 s: the "
                                     f"watchdog did not abort") from None
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
        mps.stop()
    res = []
    for r in range(n):
        path = os.path.join(outdir, f"rank{r}.json")
        res.append(json.load(open(path)) if os.path.exists(path) else None)
    return res


@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.gpu_world(3)
def test_killed_rank_aborts_the_others_with_a_named_error(tmp_path):
    res = _run("kill", 3, str(tmp_path))
    killed = json.load(open(tmp_path / "killed.json"))["at"]
    assert res[2] is None
    for r in res[:2]:
        assert r is not None and r["error"] == "CommAbortedError", r
        assert 2 in r["suspects"] and r["collective"] == "all_reduce" and r["seq"] >= 0, r
        assert "rank(s) 2" in r["message"] and "all_reduce (sequence" in r["message"], r
        assert r["at"] - killed <= TIMEOUT + 5.0, (r["at"] - killed, r)


@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.gpu_world(3)
def test_a_skipped_collective_times_out_with_a_named_error(tmp_path):
    res = _run("skip", 3, str(tmp_path))
    for r in res[:2]:
        assert r is not None and r["error"] == "CommAbortedError", r
        assert r["suspects"] == [2] and r["seq"] == 20, r
        assert "all_reduce (sequence 20) did not complete" in r["message"], r
        assert r["at"] - r["t_event"] <= TIMEOUT + 5.0, r


@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.gpu_world(3)
def test_checked_mode_votes_on_real_communicators_and_leaves_no_key(tmp_path):
    res = _run("checked", 3, str(tmp_path))
    for r in res:
        assert r["keys_after_200"] == r["keys_before"], r   # 200 checked calls, no key
        assert r["error"] == "CallMismatchError" and "*count=1000*" in r["message"], r
        assert r["checked_call_ms"] < 1000, r
