"""ncclpy.spawn with real child processes: bootstrap inside, exceptions, signals, exit codes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ncclpy
from ncclpy.errors import ArgumentError, ArgumentTypeError, LaunchError, ProcessRaisedException
from ncclpy.launch import spawn as spawn_mod
from ncclpy.launch.spawn import spawn
from sigint_util import popen_kwargs
from wait_util import HANG

SLEEP = 300  # children that should be stopped sleep this long: far past any bound (HANG)


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
    barrier(boot.store, boot.rank, boot.world_size, timeout=30)  # the parent hosts the store


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
    assert elapsed < HANG          # the others were stopped, not waited for (they sleep 300 s)
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
    assert stopped - killed_at < HANG, "the other ranks (sleeping 300 s) were not stopped"
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
    (_ok_child, 1, {"ranks_per_gpu": 0}, ArgumentError),
    (_ok_child, 1, {"ranks_per_gpu": "2"}, ArgumentError),
    (_ok_child, 1, {"mps": "sometimes"}, ArgumentError),
    (_ok_child, 1, {"mps": True}, ArgumentError),
    (_ok_child, 1, {"env": {"NCCLPY_MPS": "yes"}}, ArgumentError),
])
def test_spawn_argument_errors(fn, nprocs, kwargs, exc):
    with pytest.raises(exc):
        spawn(fn, nprocs, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"mps": "sometimes"}, "mps: expected None or one of 'auto', 'on', 'off', got 'sometimes'"),
    ({"env": {"NCCLPY_MPS": "yes"}}, "NCCLPY_MPS: expected one of auto, on, off, got 'yes'"),
])
def test_spawn_bad_mps_mode_is_named(kwargs, message):
    with pytest.raises(ArgumentError) as ei:
        spawn(_ok_child, 1, **kwargs)
    assert str(ei.value) == message


def test_spawn_is_exported():
    assert ncclpy.spawn is spawn


# --- the parent goes away or is signalled ---------------------------------------------------------
PARENT_SCRIPT = """
import os, signal, sys, time
import ncclpy


def child(rank, outdir):
    def on_term(signum, frame):
        open(os.path.join(outdir, f"term{rank}"), "w").close()
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    tmp = os.path.join(outdir, f".pid{rank}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(outdir, f"pid{rank}"))
    time.sleep(120)


if __name__ == "__main__":
    try:
        ncclpy.spawn(child, 2, args=(sys.argv[1],), timeout=300)
    except KeyboardInterrupt:
        print("parent: KeyboardInterrupt", flush=True)
        sys.exit(42)
"""


def _start_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    outdir = tmp_path / "out"
    outdir.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    parent = subprocess.Popen([sys.executable, str(script), str(outdir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **popen_kwargs())   # SIGINT: KeyboardInterrupt, however we started
    deadline = time.monotonic() + 120
    while len(_pids(outdir, 2)) < 2:   # both children run, with their SIGTERM handler set
        assert parent.poll() is None, parent.communicate()
        assert time.monotonic() < deadline, "the children never started"
        time.sleep(0.05)
    return parent, outdir, _pids(outdir, 2)


def test_spawn_children_die_when_the_parent_is_killed(tmp_path):
    parent, outdir, pids = _start_parent(tmp_path)
    parent.kill()                        # SIGKILL: the parent cannot clean anything up
    parent.communicate(timeout=30)
    deadline = time.monotonic() + 30     # generous: the kernel signals them at once
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "children outlived their SIGKILLed parent"
    # they got SIGTERM (PR_SET_PDEATHSIG), not SIGKILL: their handler ran
    assert sorted(os.listdir(outdir)) == ["pid0", "pid1", "term0", "term1"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_spawn_parent_signal_stops_the_children_first(tmp_path, sig):
    parent, outdir, pids = _start_parent(tmp_path)
    parent.send_signal(sig)              # the parent alone, not its process group
    out, err = parent.communicate(timeout=60)
    # the parent stopped (and reaped) its children before acting on the signal itself
    assert (outdir / "term0").exists() and (outdir / "term1").exists(), err
    assert not any(_alive(p) for p in pids)
    if sig == signal.SIGTERM:
        assert parent.returncode == -signal.SIGTERM, err   # then died of it, as by default
    else:
        assert parent.returncode == 42 and "parent: KeyboardInterrupt" in out, err


# --- placement ------------------------------------------------------------------------------------
def _env_child(rank: int, outdir: str) -> None:
    keys = ("NCCLPY_DEVICE", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_HOSTID", "NCCL_NET",
            "NCCL_MAX_CTAS", "CUDA_VISIBLE_DEVICES")
    with open(os.path.join(outdir, f"env{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)


def _placement_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("ncclpy spawn: placement:")]


def test_spawn_states_a_shared_gpu_mode_in_one_line(tmp_path, capfd):
    # CUDA_VISIBLE_DEVICES="0" makes spawn count one GPU without touching CUDA; the children
    # only record their environment
    spawn(_env_child, 3, args=(str(tmp_path),), env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=120,
          mps="off")   # a real MPS daemon is tests/test_mps.py's business (with a stand-in)
    (line,) = _placement_lines(capfd.readouterr().err)
    assert line.endswith("; MPS: off")
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [e["NCCLPY_DEVICE"] for e in envs] == ["0", "0", "0"]
    assert line.startswith("ncclpy spawn: placement: 3 ranks on 1 GPU (")
    from ncclpy.launch.placement import loaded_nccl_version
    v = loaded_nccl_version()
    if v is not None and v >= 23000:
        assert "multi-rank-gpu" in line
        assert {e["NCCL_MULTI_RANK_GPU_ENABLE"] for e in envs} == {"1"}
    else:
        assert "hostid-socket" in line and len({e["NCCL_HOSTID"] for e in envs}) == 3
    # 3 ranks on one GPU: a CTA limit for all of them, stated in the line
    (ctas,) = {e["NCCL_MAX_CTAS"] for e in envs}
    assert int(ctas) >= 1 and f"NCCL_MAX_CTAS={ctas} (3 ranks per GPU, " in line
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0"}   # no MPS: nothing unset


def test_spawn_ranks_per_gpu(tmp_path, capfd):
    spawn(_env_child, 4, args=(str(tmp_path),),
          env={"CUDA_VISIBLE_DEVICES": "0,1,2,3", "NCCLPY_MPS": "off"}, ranks_per_gpu=2,
          timeout=120)
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4)]
    assert [e["NCCLPY_DEVICE"] for e in envs] == ["0", "1", "0", "1"]   # r mod 2 GPUs used
    (line,) = _placement_lines(capfd.readouterr().err)
    assert "4 ranks on 2 GPUs of 4, rank r -> GPU r mod 2" in line and line.endswith("MPS: off")
    assert {e["NCCL_MAX_CTAS"] for e in envs} == {None}   # 2 per GPU: NCCL's defaults fit


def test_spawn_one_rank_per_gpu_prints_nothing(tmp_path, capfd):
    spawn(_env_child, 2, args=(str(tmp_path),), env={"CUDA_VISIBLE_DEVICES": "0,1"},
          timeout=120)
    assert _placement_lines(capfd.readouterr().err) == []
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)]
    assert [e["NCCLPY_DEVICE"] for e in envs] == ["0", "1"]
    assert {e["NCCL_MULTI_RANK_GPU_ENABLE"] for e in envs} == {None}


def _checked_child(rank: int, outdir: str, want: str) -> None:
    got = os.environ.get("NCCLPY_CHECKED")
    if got != want:
        raise AssertionError(f"rank {rank}: NCCLPY_CHECKED={got!r}, expected {want!r}")


@pytest.mark.parametrize("checked, want", [(True, "1"), (False, "0")])
def test_spawn_checked_sets_the_variable_in_every_child(tmp_path, checked, want):
    spawn(_checked_child, 2, args=(str(tmp_path), want), checked=checked, mps="off")


def test_spawn_checked_must_be_a_bool():
    with pytest.raises(ArgumentTypeError, match="checked: expected None, True or False"):
        spawn(_checked_child, 1, args=("", ""), checked="yes")
