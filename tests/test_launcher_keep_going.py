"""``ncclpy run --keep-going`` (the recovery recipe's launcher side), with real launcher and rank
processes on CPU: a failed rank does not stop the others, its death is still published in the
store for their watchdogs, and the exit code and summary still say that a rank failed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(90)

PROG = """
    import os, sys, time
    from ncclpy.store import TCPStore
    rank = int(os.environ["RANK"])
    s = TCPStore(os.environ["NCCLPY_MASTER_ADDR"], int(os.environ["NCCLPY_MASTER_PORT"]),
                 token=os.environ["NCCLPY_STORE_TOKEN"], timeout=30)
    if rank == 2:
        s.get("up/0"); s.get("up/1")
        os.kill(os.getpid(), 9)                  # dies like a crashed GPU process
    s.set(f"up/{rank}", b"1")
    epoch = int(s.get("ncclpy/dead/epoch", timeout=25))
    print("survivor saw:", s.get("ncclpy/dead/2").decode(), "epoch", epoch, flush=True)
    time.sleep(float(os.environ["SURVIVOR_SLEEP"]))   # outlives the death, unless stopped
    print("finished", flush=True)
"""


def _run(tmp_path, *flags: str, survivor_sleep: float = 1.0) -> subprocess.CompletedProcess:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG))
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "NCCLPY_STORE_TOKEN")}
    env.update(PYTHONPATH=ROOT, NCCLPY_MPS="off", SURVIVOR_SLEEP=str(survivor_sleep))
    return subprocess.run([sys.executable, "-m", "ncclpy", "run", "-n", "3", *flags,
                           str(prog)], capture_output=True, text=True, timeout=80, env=env)


def test_keep_going_lets_the_survivors_finish_and_still_reports_the_failure(tmp_path):
    cp = _run(tmp_path, "--keep-going")
    assert cp.returncode == 128 + 9, (cp.stdout, cp.stderr)
    for r in (0, 1):
        assert f"[rank {r}] survivor saw: was killed by signal SIGKILL epoch 1" in cp.stdout
        assert f"[rank {r}] finished" in cp.stdout, (cp.stdout, cp.stderr)
    assert ("ncclpy run: 1 rank failed; --keep-going: the others ran to their end (rank 0 "
            "exit 0, rank 1 exit 0, rank 2 was killed by signal SIGKILL); exit code of the "
            "first failure") in cp.stderr, cp.stderr


def test_without_keep_going_the_survivors_are_stopped(tmp_path):
    """The survivors would sleep 300 s after seeing the death: only the launcher's stop ends
    them (the run's 80 s bound is a hang's)."""
    cp = _run(tmp_path, "--grace", "1", survivor_sleep=300)
    assert cp.returncode == 128 + 9
    assert "finished" not in cp.stdout and "stopped the other 2 ranks" in cp.stderr, cp.stderr
