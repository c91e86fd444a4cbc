"""A CPU-backend rank killed mid-job leaves nothing in /dev/shm: its file's name is unlinked once
every peer has opened it (issue 49; a job killed whole: tests/test_cpu_backend_failures.py);
what a rank killed while still connecting left, ``ncclpy.spawn`` and ``ncclpy run`` unlink once
every rank has ended, whether the job asked for the CPU backend or each rank chose it.  Real
processes, a real SIGKILL."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ncclpy
from ncclpy.errors import LaunchError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)

#: a rank: a 1 MiB all_reduce (its payload area grows), its pid written, then rank 1 dies by
#: SIGKILL while rank 0 waits in a second all_reduce (the launcher stops it)
RANK = """
    import os, signal, sys
    import numpy as np
    import ncclpy

    def rank_body(rank, outdir):
        comm = ncclpy.init(device="cpu", timeout=60, watchdog=False)   # the rank chooses
        x = np.ones(1 << 18, np.float32)
        comm.all_reduce(x).wait()
        with open(os.path.join(outdir, f"{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        comm.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.all_reduce(x).wait()

    if __name__ == "__main__":
        rank_body(int(os.environ["RANK"]), sys.argv[1])
"""


def _rank(rank: int, outdir: str) -> None:
    ns: dict = {"__name__": "rank"}
    exec(textwrap.dedent(RANK), ns)
    ns["rank_body"](rank, outdir)


def _left(tmp_path: Path) -> list:
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    return [n for n in os.listdir("/dev/shm") if n.startswith("ncclpy-")
            and any(n.endswith(f"-p{p}") for p in pids)]


@pytest.mark.parametrize("device", [{"device": "cpu"}, {}], ids=["device-cpu", "rank-chooses"])
def test_spawn_unlinks_what_a_killed_rank_left(tmp_path, device):
    with pytest.raises(LaunchError, match=r"rank 1 .*SIGKILL"):
        ncclpy.spawn(_rank, 2, args=(str(tmp_path),), timeout=120, **device)
    assert _left(tmp_path) == []


@pytest.mark.parametrize("flag", [["--cpu"], []], ids=["cpu-flag", "rank-chooses"])
def test_ncclpy_run_unlinks_what_a_killed_rank_left(tmp_path, flag):
    prog = tmp_path / "rank.py"
    prog.write_text(textwrap.dedent(RANK))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLPY_", "RANK", "WORLD"))}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", "ncclpy", "run", *flag, "-n", "2",
                        sys.executable, str(prog), str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode != 0, r.stderr[-2000:]
    assert "SIGKILL" in r.stderr, r.stderr[-2000:]
    assert _left(tmp_path) == []
