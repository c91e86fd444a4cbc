"""How the CPU backend fails, as a new user meets it (issue 49), with real processes:

* a rank SIGKILLed while the others wait in a collective -- or ended by an uncaught exception
  -- is named dead within 5 s on every survivor, whoever hosted the store (rank 0 too: a job
  started by hand, as under mpirun), and no healthy rank is blamed; a rank stopped (SIGSTOP)
  past the watchdog's silence limit is not taken for dead;
* a killed job leaves nothing in /dev/shm, whether some of its ranks survive or none does;
* /dev/shm full (a small tmpfs in a private mount namespace) is said in one line naming the
  rank that ran out and ``--shm-size``, and no peer is suspected;
* a platform other than x86-64 Linux is refused in one line (``setarch i686``: a real i686
  personality);
* ``ncclpy.spawn`` without ``device="cpu"`` on a machine without a GPU says so in one line.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ncclpy
from ncclpy.errors import ProcessRaisedException
from ncclpy.rendezvous import free_port

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "cpu_failure_job.py"
pytestmark = pytest.mark.timeout(180)
_GUARDED = ("NCCLPY_", "NCCL_", "CUDA_", "TORCH_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_GUARDED)}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


class _Job:
    """Ranks started by hand, each its own process (rank 0 hosts the store)."""

    def __init__(self, out: Path, mode: str, victim: int, n: int = 3,
                 watchdog: bool = True) -> None:
        self.out, self.n, self.killed = out, n, set()
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
        self.logs = [open(out / f"{r}.log", "w") for r in range(n)]
        self.procs = [subprocess.Popen(
            [sys.executable, str(JOB), str(out), mode, str(victim), "1" if watchdog else "0"],
            env={**env, "RANK": str(r)}, stdout=self.logs[r], stderr=subprocess.STDOUT)
            for r in range(n)]

    def log(self, r: int) -> str:
        return (self.out / f"{r}.log").read_text()

    def wait_for(self, names: list, within: float) -> list:
        deadline = time.monotonic() + within
        while True:
            got = [self.out / n for n in names if (self.out / n).exists()]
            if len(got) == len(names):
                return [json.loads(p.read_text()) for p in got]
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None
                    and r not in self.killed and not (self.out / f"{r}.json").exists()]
            assert not dead, f"rank(s) {dead} ended early:\n" + "\n".join(
                self.log(r)[-3000:] for r in dead)
            assert time.monotonic() < deadline, (f"not written within {within:g} s: "
                                                 f"{sorted(set(names) - {p.name for p in got})}"
                                                 + "".join(f"\n--- rank {r}:\n{self.log(r)[-2000:]}"
                                                           for r in range(self.n)))
            time.sleep(0.02)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for f in self.logs:
            f.close()


@pytest.fixture
def jobs():
    made: list = []
    yield lambda *a, **k: made.append(_Job(*a, **k)) or made[-1]
    for j in made:
        j.close()


def _left_in_shm(ready: list) -> list:
    prefixes = {p for r in ready for p in r["prefixes"]}
    ends = tuple(f"-p{r['pid']}" for r in ready)
    return [n for n in os.listdir("/dev/shm") if n.startswith("ncclpy-")
            and (n.endswith(ends) or any(n.startswith(p) for p in prefixes))]


@pytest.mark.parametrize("victim,watchdog", [(0, True), (2, True), (0, False), (1, False)],
                         ids=["rank0-store-host", "rank2", "rank0-no-watchdog",
                              "rank1-no-watchdog"])
def test_a_killed_rank_is_named_dead_within_5_s_by_every_survivor(tmp_path, jobs, victim,
                                                                    watchdog):
    job = jobs(tmp_path, "kill", victim, watchdog=watchdog)
    ready = job.wait_for([f"{r}.ready" for r in range(3)], 90)
    survivors = [r for r in range(3) if r != victim]
    job.wait_for([f"{r}.inside" for r in survivors], 30)
    time.sleep(0.5)                                    # the survivors wait in the all_reduce
    killed_at = time.time()
    job.killed.add(victim)
    job.procs[victim].send_signal(signal.SIGKILL)
    _named_dead_within_5_s(job, ready, victim, watchdog, killed_at)


def test_a_rank_that_raises_is_named_dead_within_5_s_by_every_survivor(tmp_path, jobs):
    """An uncaught exception ends rank 0's process (the store's host) without closing its
    communicator: the same as a death to the ranks still waiting on it."""
    job = jobs(tmp_path, "raise", 0)
    job.killed.add(0)
    ready = job.wait_for([f"{r}.ready" for r in range(3)], 90)
    raised_at = job.wait_for(["0.raising"], 30)[0]["at"]
    assert job.procs[0].wait(timeout=30) == 1
    assert "RuntimeError: rank body failed" in job.log(0)
    _named_dead_within_5_s(job, ready, 0, True, raised_at)


def _named_dead_within_5_s(job: _Job, ready: list, victim: int, watchdog: bool,
                           died_at: float) -> None:
    survivors = [r for r in range(3) if r != victim]
    outs = job.wait_for([f"{r}.json" for r in survivors], 20)
    for r, o in zip(survivors, outs):
        err = o["error"] or ""
        assert f"rank(s) {victim} died" in err, (r, o, job.log(r)[-3000:])
        assert o["at"] - died_at < 5.0, (r, o["at"] - died_at, err)
        assert "every peer" not in err and "rank(s) 1, 2" not in err, (r, err)
        if watchdog:        # the watchdog's verdict: the dead rank, and no other, is suspected
            assert o["type"] == "CommAbortedError", (r, o)
            assert o["suspects"] == [victim], (r, o)
            assert f"suspected: rank(s) {victim};" in err, (r, err)
        else:               # NCCL's own error: ncclRemoteError, naming the rank and its pid
            assert "ncclRemoteError (6)" in err, (r, o)
            assert f"pid {ready[victim]['pid']}" in err, (r, o)
    for r in survivors:
        assert job.procs[r].wait(timeout=30) == 0, job.log(r)[-3000:]
    assert _left_in_shm(ready) == [], "the killed job left shared memory behind"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_job_killed_whole_leaves_nothing_in_dev_shm(tmp_path, jobs, sig):
    """No survivor, no launcher to sweep (what timeout or mpirun do to every rank): the names
    are gone once every peer connected, payload areas grown since included."""
    job = jobs(tmp_path, "stop", 0)
    ready = job.wait_for([f"{r}.ready" for r in range(3)], 90)
    job.killed.update(range(3))
    for p in job.procs:
        p.send_signal(sig)
    assert [p.wait(timeout=30) for p in job.procs] == [-sig] * 3
    assert all(r["prefixes"] for r in ready), ready
    assert _left_in_shm(ready) == [], "the killed job left shared memory behind"


def test_a_stopped_store_host_is_not_taken_for_dead(tmp_path, jobs):
    job = jobs(tmp_path, "stop", 0)
    job.wait_for([f"{r}.ready" for r in range(3)], 90)
    job.procs[0].send_signal(signal.SIGSTOP)     # the store and rank 0 stop; its lock stays
    try:
        (tmp_path / "go").write_text("")
        job.wait_for(["1.inside", "2.inside"], 30)
        time.sleep(5.0)                          # past the watchdog's silence limit (3 s)
        assert not any((tmp_path / f"{r}.json").exists() for r in (1, 2)), \
            [job.log(r)[-2000:] for r in (1, 2)]
    finally:
        job.procs[0].send_signal(signal.SIGCONT)
    outs = job.wait_for([f"{r}.json" for r in range(3)], 30)
    assert [o["error"] for o in outs] == [None] * 3, outs
    assert [o["sum"] for o in outs] == [9.0] * 3          # 3 ranks, twice
    for r in range(3):
        assert job.procs[r].wait(timeout=30) == 0, job.log(r)[-3000:]
        assert "died" not in job.log(r), job.log(r)[-3000:]


# -- /dev/shm full --------------------------------------------------------------------------
FULL = """
import sys, time
import numpy as np
import ncclpy

def body(rank, count):
    comm = ncclpy.init(device="cpu", timeout=30)
    x = np.ones(count, np.float32)
    try:
        comm.all_reduce(x).wait()
        print(f"RESULT {rank} ok", flush=True)
    except Exception as e:
        print(f"RESULT {rank} {type(e).__name__}: {e}", flush=True)

if __name__ == "__main__":
    try:
        ncclpy.spawn(body, 2, args=(int(sys.argv[1]),), device="cpu", timeout=60)
    except ncclpy.ProcessRaisedException as e:
        print("RAISED " + e.traceback.strip().splitlines()[-1], flush=True)
"""


def _cannot_unshare() -> str:
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, text=True, timeout=30)
    return "" if r.returncode == 0 else f"cannot mount a tmpfs in a mount namespace: {r.stderr}"


@pytest.mark.parametrize("size,count,where", [("2m", 1 << 20, "collective"),
                                              ("150k", 16, "init")])
def test_shm_full_names_the_rank_that_ran_out_and_the_remedy(tmp_path, size, count, where):
    why = _cannot_unshare()
    if why:
        pytest.skip(why)
    prog = tmp_path / "full.py"
    prog.write_text(FULL)
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
                        f"exec {sys.executable} {prog} {count}"],
                       env=_env(), capture_output=True, text=True, timeout=150)
    said = [line for line in r.stdout.splitlines() if line.startswith(("RESULT", "RAISED"))]
    assert said, r.stdout[-3000:] + r.stderr[-3000:]
    for line in said:
        assert " ran out of shared memory: /dev/shm has no room for " in line, line
        assert "docker run --shm-size=" in line and "no peer is at fault" in line, line
        assert "every peer" not in line and "Traceback" not in line, line
    if where == "collective":       # each rank ran out, and says so of itself
        assert sorted(line.split()[1] for line in said) == ["0", "1"], said
        for line in said:
            rank = line.split()[1]
            assert f"rank {rank} ran out" in line and "no peer is suspected" in line, line
            assert "ncclSystemError (2)" in line, line
    else:                           # the rank whose init found no room
        assert len(said) == 1 and "ncclCommInitRank failed: ncclSystemError (2)" in said[0], said
    assert "Traceback" not in r.stderr, r.stderr[-3000:]      # one line logged, no traceback


# -- the platform ------------------------------------------------------------------------------
def test_only_x86_64_linux_is_accepted():
    from ncclpy.cpu.backend import cannot_run
    assert cannot_run("x86_64", "linux", True) in (None, cannot_run())
    for machine in ("i686", "i386", "aarch64", "arm64", "ppc64le", ""):
        why = cannot_run(machine, "linux", True)
        assert why and "64-bit x86 (x86-64) Linux only" in why, machine
    assert "this system is darwin" in cannot_run("x86_64", "darwin", True)
    assert "this system is win32" in cannot_run("AMD64", "win32", True)
    assert "32-bit Python" in cannot_run("x86_64", "linux", False)


def test_an_i686_machine_is_refused_in_one_line():
    if shutil.which("setarch") is None:
        pytest.skip("no setarch command (util-linux)")
    code = ("import ncclpy\ntry:\n    ncclpy.init(device='cpu')\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    r = subprocess.run(["setarch", "i686", sys.executable, "-c", code], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("UnsupportedError the CPU backend cannot run here: it runs on "
                               "64-bit x86 (x86-64) Linux only"), r.stdout + r.stderr
    assert "this machine is i686" in r.stdout and r.stdout.count("\n") == 1, r.stdout
    r = subprocess.run(["setarch", "i686", sys.executable, "-m", "ncclpy", "info", "--json"],
                       env=_env(), capture_output=True, text=True, timeout=120)
    cpu = json.loads(r.stdout)["cpu_backend"]
    assert cpu["available"] is False and "this machine is i686" in cpu["error"], cpu


# -- spawn without device="cpu", no GPU ----------------------------------------------------
def _gpu_visible() -> bool:
    from ncclpy.info import gpu_device_reason
    try:
        return not gpu_device_reason()
    except Exception:  # noqa: BLE001 - no CUDA at all
        return False


def _init_on_gpu(rank: int) -> None:
    ncclpy.init()


SPAWN = """
import ncclpy

def body(rank):
    ncclpy.init()

if __name__ == "__main__":
    ncclpy.spawn(body, 2)
"""


def test_spawn_without_device_cpu_and_no_gpu_names_the_remedy_in_one_line(tmp_path):
    if _gpu_visible():
        pytest.skip("a GPU is visible here: spawn places the ranks on it")
    with pytest.raises(ProcessRaisedException) as info:
        ncclpy.spawn(_init_on_gpu, 2, timeout=120)
    e = info.value
    msg = str(e)
    assert "\n" not in msg and 'ncclpy.spawn(..., device="cpu")' in msg, msg
    assert "no usable CUDA device" in msg and msg.startswith(f"rank {e.rank}: "), msg
    assert e.__cause__ is None and e.__suppress_context__, msg
    assert "CudaUnavailableError" in e.traceback          # the child's traceback is kept
    prog = tmp_path / "job.py"                          # what a user's terminal shows
    prog.write_text(SPAWN)
    r = subprocess.run([sys.executable, str(prog)], env=_env(), capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) <= 8, r.stderr
    assert lines[-1].startswith("ncclpy.errors.ProcessRaisedException: rank ") and \
        lines[-1].endswith('ncclpy.spawn(..., device="cpu")'), r.stderr
    assert "During handling" not in r.stderr and "direct cause" not in r.stderr, r.stderr
