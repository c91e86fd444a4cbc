"""ncclpy.spawn with real child processes: bootstrap inside, exceptions, signals, exit codes."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

import ncclpy
from ncclpy.errors import ArgumentError, ArgumentTypeError, LaunchError, ProcessRaisedException
from ncclpy.launch import spawn as spawn_mod
from ncclpy.launch.spawn import spawn

SLEEP = 60  # children that should be stopped sleep this long


# --- child functions (module level: the spawn start method pickles them by name) ------------
def _bootstrap_child(rank: int, outdir: str) -> None:
    from ncclpy.store import barrier
    boot = ncclpy.bootstrap("spawned", timeout=30)
    env = {k: os.environ.get(k) for k in (
        "NCCLPY_STORE_TOKEN", "NCCLPY_MASTER_PORT", "MASTER_PORT", "RANK", "LOCAL_RANK",
        "NCCLPY_DEVICE", "EXTRA_VAR")}
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"rank": boot.rank, "world": boot.world_size, "local": boot.local_rank,
                   "device": boot.device, "uid": boot.uid.hex(), "source": boot.info.source,
                   "env": env}, f)
    barrier(boot.store, boot.rank, boot.world_size, timeout=30)  # rank 0 hosts the store


def _write_pid(outdir: str, rank: int) -> None:
    with open(os.path.join(outdir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))


def _wait_for_pids(outdir: str, n: int) -> None:
    """The failing rank waits until every rank runs, so the test can check they were stopped."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(outdir, f"pid{r}")) for r in range(n)):
        time.sleep(0.05)


def _raising_child(rank: int, outdir: str) -> None:
    _write_pid(outdir, rank)
    if rank == 2:
        _wait_for_pids(outdir, 3)
        _helper_that_raises(rank)
    time.sleep(SLEEP)


def _helper_that_raises(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


def _killed_child(rank: int, outdir: str) -> None:
    _write_pid(outdir, rank)
    if rank == 1:
        _wait_for_pids(outdir, 3)
        with open(os.path.join(outdir, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(SLEEP)


def _exit3_child(rank: int, outdir: str) -> None:
    _write_pid(outdir, rank)
    if rank == 0:
        _wait_for_pids(outdir, 2)
        sys.exit(3)
    time.sleep(SLEEP)


def _stubborn_child(rank: int, outdir: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write_pid(outdir, rank)
    if rank == 0:
        _wait_for_pids(outdir, 2)
        raise RuntimeError("first")
    time.sleep(SLEEP)


def _ok_child(rank: int, outdir: str) -> None:
    with open(os.path.join(outdir, f"ok{rank}"), "w") as f:
        f.write(os.environ["NCCLPY_RANK"])


def _sleepy_child(rank: int, outdir: str) -> None:
    _write_pid(outdir, rank)
    time.sleep(SLEEP)


# --- helpers -------------------------------------------------------------------------------------
def _pids(outdir, n):
    out = []
    for r in range(n):
        path = os.path.join(outdir, f"pid{r}")
        if os.path.exists(path):
            with open(path) as f:
                out.append(int(f.read()))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it has stopped running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --- tests ---------------------------------------------------------------------------------------
def test_spawn_runs_bootstrap_in_4_children(tmp_path):
    assert spawn(_bootstrap_child, 4, args=(str(tmp_path),), env={"EXTRA_VAR": "x"},
                 timeout=120) is None
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    assert {r["world"] for r in res} == {4} and [r["local"] for r in res] == [0, 1, 2, 3]
    assert len({r["uid"] for r in res}) == 1 and len(bytes.fromhex(res[0]["uid"])) == 128
    assert {r["source"] for r in res} == {"NCCLPY"}
    tokens = {r["env"]["NCCLPY_STORE_TOKEN"] for r in res}
    assert len(tokens) == 1 and len(tokens.pop()) >= 32  # a fresh shared secret
    for r in res:
        assert r["env"]["NCCLPY_MASTER_PORT"] != r["env"]["MASTER_PORT"]  # torch gets its own
        assert r["env"]["RANK"] == str(r["rank"]) and r["env"]["EXTRA_VAR"] == "x"
        assert r["env"]["NCCLPY_DEVICE"] is not None
        assert r["device"] == int(r["env"]["NCCLPY_DEVICE"])


def test_spawn_propagates_a_child_exception(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ProcessRaisedException) as ei:
        spawn(_raising_child, 3, args=(str(tmp_path),), timeout=120)
    elapsed = time.monotonic() - t0
    err = ei.value
    assert err.rank == 2 and err.exitcode == 1
    assert "ValueError: boom from rank 2" in err.traceback
    assert "_helper_that_raises" in err.traceback and "Traceback" in err.traceback
    assert "rank 2" in str(err) and "boom from rank 2" in str(err)
    assert elapsed < 30
    pids = _pids(tmp_path, 3)
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_spawn_child_killed_by_sigkill(tmp_path):
    with pytest.raises(LaunchError) as ei:
        spawn(_killed_child, 3, args=(str(tmp_path),), timeout=120)
    stopped = time.time()
    assert not isinstance(ei.value, ProcessRaisedException)
    msg = str(ei.value)
    assert "rank 1" in msg and "SIGKILL" in msg and "signal" in msg
    killed_at = float((tmp_path / "killed_at").read_text())
    assert stopped - killed_at < 5.0, "the other ranks were not stopped within 5 s"
    pids = _pids(tmp_path, 3)
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_spawn_child_exit_code(tmp_path):
    with pytest.raises(LaunchError, match=r"rank 0 .*exited with code 3"):
        spawn(_exit3_child, 2, args=(str(tmp_path),), timeout=120)
    assert not any(_alive(p) for p in _pids(tmp_path, 2))


def test_spawn_sigkills_children_that_ignore_sigterm(tmp_path, monkeypatch):
    monkeypatch.setattr(spawn_mod, "TERM_GRACE_S", 0.5)
    with pytest.raises(ProcessRaisedException, match="RuntimeError: first"):
        spawn(_stubborn_child, 2, args=(str(tmp_path),), timeout=120)
    assert not any(_alive(p) for p in _pids(tmp_path, 2))


def test_spawn_join_false_and_timeout(tmp_path):
    ctx = spawn(_ok_child, 2, args=(str(tmp_path),), join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline
    assert ctx.join() is True
    assert [(tmp_path / f"ok{r}").read_text() for r in range(2)] == ["0", "1"]

    with pytest.raises(LaunchError, match="timeout"):
        spawn(_sleepy_child, 2, args=(str(tmp_path),), timeout=3)
    assert not any(_alive(p) for p in _pids(tmp_path, 2))


@pytest.mark.parametrize("fn,nprocs,kwargs,exc", [
    (_ok_child, 0, {}, ArgumentError),
    (_ok_child, "2", {}, ArgumentError),
    ("not callable", 1, {}, ArgumentTypeError),
    (_ok_child, 1, {"args": "abc"}, ArgumentTypeError),
    (_ok_child, 1, {"timeout": -1}, ArgumentError),
    (_ok_child, 1, {"start_method": "teleport"}, ArgumentError),
])
def test_spawn_argument_errors(fn, nprocs, kwargs, exc):
    with pytest.raises(exc):
        spawn(fn, nprocs, **kwargs)


def test_spawn_is_exported():
    assert ncclpy.spawn is spawn
