"""``ncclpy.spawn``: a rank's own subprocesses do not outlive it. Each rank leads a process group
(a session) of its own and every stop signal goes to the group: on fail-fast, on ``timeout`` and
on Ctrl-C (whether the terminal's, to the parent's whole group, or a SIGINT to the parent
alone). Real processes: every rank starts ``sleep 300`` and the test checks that it is gone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ncclpy.errors import LaunchError, ProcessRaisedException
from ncclpy.launch.spawn import spawn
from sigint_util import popen_kwargs

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GONE_WITHIN = 15.0      # seconds a stopped rank's subprocess may take to disappear


# --- child functions (module level: the spawn start method pickles them by name) ------------
def _start_sleep(rank: int, outdir: str) -> None:
    """Start ``sleep 300`` (inherits the rank's process group) and publish both pids."""
    proc = subprocess.Popen(["sleep", "300"])
    for name, pid in ((f"sleep{rank}", proc.pid), (f"pid{rank}", os.getpid())):
        tmp = os.path.join(outdir, f".{name}")
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.replace(tmp, os.path.join(outdir, name))


def _wait_for(outdir: str, names) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(outdir, n)) for n in names):
        time.sleep(0.05)


def _sleep_then_raise(rank: int, outdir: str, nprocs: int) -> None:
    _start_sleep(rank, outdir)
    if rank == nprocs - 1:
        _wait_for(outdir, [f"sleep{r}" for r in range(nprocs)])
        raise RuntimeError(f"rank {rank} fails after starting a subprocess")
    time.sleep(120)


def _sleep_forever(rank: int, outdir: str) -> None:
    _start_sleep(rank, outdir)
    time.sleep(120)


# --- helpers -------------------------------------------------------------------------------------
def _read_pids(outdir, prefix: str, n: int) -> list:
    out = []
    for r in range(n):
        path = os.path.join(outdir, f"{prefix}{r}")
        if os.path.exists(path):
            with open(path) as f:
                out.append(int(f.read()))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # pragma: no cover - a reused pid of another user
        return False
    try:  # a zombie still answers kill(0); it has stopped running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _assert_gone(pids, what: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:            # do not leave them behind for the next test
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"{what}: pids {left} outlived the ranks that started them"


# --- tests ---------------------------------------------------------------------------------------
def test_fail_fast_ends_the_subprocesses_of_every_rank(tmp_path):
    n = 3
    with pytest.raises(ProcessRaisedException, match="fails after starting a subprocess"):
        spawn(_sleep_then_raise, n, args=(str(tmp_path), n), timeout=120)
    sleeps = _read_pids(tmp_path, "sleep", n)
    assert len(sleeps) == n
    # the failed rank's own subprocess too, though that rank had exited by itself
    _assert_gone(sleeps, "fail-fast")
    _assert_gone(_read_pids(tmp_path, "pid", n), "fail-fast (ranks)")


def test_timeout_ends_the_subprocesses_of_every_rank(tmp_path):
    with pytest.raises(LaunchError, match="timeout"):
        spawn(_sleep_forever, 2, args=(str(tmp_path),), timeout=10)
    sleeps = _read_pids(tmp_path, "sleep", 2)
    assert len(sleeps) == 2, "the ranks did not start their subprocess within the timeout"
    _assert_gone(sleeps, "timeout")


def test_stop_of_a_join_false_context_ends_the_subprocesses(tmp_path):
    ctx = spawn(_sleep_forever, 2, args=(str(tmp_path),), join=False)
    try:
        _wait_for(tmp_path, ["sleep0", "sleep1"])
        assert not ctx.join(timeout=0.1)
    finally:
        ctx.stop(grace=2.0)
    _assert_gone(_read_pids(tmp_path, "sleep", 2), "SpawnContext.stop")


def test_each_rank_leads_its_own_process_group(tmp_path):
    ctx = spawn(_sleep_forever, 2, args=(str(tmp_path),), join=False)
    try:
        _wait_for(tmp_path, ["sleep0", "sleep1"])
        for rank, pid in enumerate(ctx.pids()):
            assert os.getpgid(pid) == pid != os.getpgrp()
            sleep = _read_pids(tmp_path, "sleep", 2)[rank]
            assert os.getpgid(sleep) == pid
    finally:
        ctx.stop(grace=2.0)


PARENT = """
import sys, time
import ncclpy
sys.path.insert(0, {tests!r})
from test_spawn_groups import _sleep_forever

if __name__ == "__main__":
    try:
        ncclpy.spawn(_sleep_forever, 2, args=(sys.argv[1],), timeout=300)
    except KeyboardInterrupt:
        print("parent: KeyboardInterrupt", flush=True)
        sys.exit(42)
"""


@pytest.mark.parametrize("to_group", [False, True], ids=["kill-INT-parent", "terminal-Ctrl-C"])
def test_ctrl_c_ends_the_ranks_and_their_subprocesses(tmp_path, to_group):
    """A terminal's Ctrl-C goes to the foreground group, which holds the parent but no longer
    the ranks: the parent stops them (and what they started) and then raises
    KeyboardInterrupt, as it did when the ranks shared its group."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(tests=os.path.join(ROOT, "tests")))
    outdir = tmp_path / "out"
    outdir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    parent = subprocess.Popen([sys.executable, str(script), str(outdir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True,   # its own foreground-like group
                              **popen_kwargs())         # SIGINT: KeyboardInterrupt
    try:
        deadline = time.monotonic() + 120
        while len(_read_pids(outdir, "sleep", 2)) < 2:
            assert parent.poll() is None, parent.communicate()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        if to_group:
            os.killpg(parent.pid, signal.SIGINT)
        else:
            parent.send_signal(signal.SIGINT)
        out, err = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    assert parent.returncode == 42 and "parent: KeyboardInterrupt" in out, err
    _assert_gone(_read_pids(outdir, "pid", 2), "Ctrl-C (ranks)")
    _assert_gone(_read_pids(outdir, "sleep", 2), "Ctrl-C")
