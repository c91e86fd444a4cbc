"""ncclpy.launch.mps: the MPS daemon's life cycle, with a stand-in ``nvidia-cuda-mps-control``.

The stand-in is a real executable on PATH (``fake_mps`` below), so these tests exercise the real
process management (start in the foreground, readiness, the ``quit`` command, signals, the
directories) without a GPU: only what the daemon would do to the GPU is left out.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ncclpy
from ncclpy.errors import ArgumentError, LaunchError, ProcessRaisedException
from ncclpy.launch.mps import (CONTROL, DEFAULT_MPS, MPS_CHECK_ENV, MPS_ENV, STOP_TIMEOUT_S,
                               MpsDaemon, check_client, daemon_ready, resolve_mode, setup_mps)

pytestmark = pytest.mark.timeout(60)

FAKE_CONTROL = """#!{python}
# Stand-in for nvidia-cuda-mps-control: "-f" runs the daemon (in the foreground), anything else
# is the control client reading one command from stdin. Each event goes to $FAKE_MPS_RECORD.
import json, os, signal, sys, time
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
def note(**kw):
    with open(os.environ["FAKE_MPS_RECORD"], "a") as f:
        f.write(json.dumps(kw) + "\\n")
if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("fake failure: no usable GPU", flush=True)
        sys.exit(3)
    note(event="start", pid=os.getpid(), pipe=pipe, log=os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
         cvd=os.environ.get("CUDA_VISIBLE_DEVICES"), sid=os.getsid(0))
    def on_term(signum, frame):
        note(event="sigterm")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    if os.environ.get("FAKE_MPS_NEVER_READY"):
        time.sleep(120)
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(os.getpid()))
    open(os.path.join(pipe, "control"), "w").close()
    while not os.path.exists(os.path.join(pipe, "quit")):
        time.sleep(0.02)
    note(event="stopped")
    sys.exit(0)
cmd = sys.stdin.read().strip()
note(event="command", cmd=cmd, pipe=pipe)
if cmd == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
    open(os.path.join(pipe, "quit"), "w").close()
"""


def install_fake_control(bindir: Path) -> Path:
    """Write the stand-in ``nvidia-cuda-mps-control`` into ``bindir``; returns its path."""
    bindir.mkdir(parents=True, exist_ok=True)
    exe = bindir / CONTROL
    exe.write_text(FAKE_CONTROL.format(python=sys.executable))
    exe.chmod(0o755)
    return exe


def read_record(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(tmp_path):
    """(env with the stand-in first on PATH and a record file, the record path)."""
    bindir = tmp_path / "bin"
    install_fake_control(bindir)
    record = tmp_path / "record.jsonl"
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", MPS_ENV)}
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    env["FAKE_MPS_RECORD"] = str(record)
    # the stand-in has no MPS server: a real CUDA client (where a driver exists) must not try it
    env[MPS_CHECK_ENV] = "0"
    return env, record


# ---------------------------------------------------------------- the mode
def test_resolve_mode():
    assert DEFAULT_MPS == "auto"
    assert resolve_mode(None, {}) == "auto"
    assert resolve_mode(None, {MPS_ENV: "OFF "}) == "off"
    assert resolve_mode("on", {MPS_ENV: "off"}) == "on"          # the flag/keyword wins
    assert resolve_mode(None, {MPS_ENV: ""}) == "auto"
    with pytest.raises(ArgumentError, match=r"^--mps: expected None or one of 'auto', 'on', "
                                            r"'off', got 'sometimes'$"):
        resolve_mode("sometimes", {}, name="--mps")
    with pytest.raises(ArgumentError, match=r"^NCCLPY_MPS: expected one of auto, on, off, "
                                            r"got 'yes'$"):
        resolve_mode(None, {MPS_ENV: "yes"})


# ---------------------------------------------------------------- setup_mps decisions
def test_nothing_when_no_gpu_is_shared(fake):
    env, record = fake
    s = setup_mps("on", False, env)
    assert s.status is None and s.daemon is None and s.env == {} and read_record(record) == []


def test_off_never_starts_it(fake):
    env, record = fake
    s = setup_mps("off", True, env)
    assert s.status == "off" and s.daemon is None and s.env == {}
    assert read_record(record) == []


def test_auto_without_the_binary_runs_without(tmp_path):
    s = setup_mps("auto", True, {"PATH": str(tmp_path)})
    assert s.status == "not available (nvidia-cuda-mps-control not on PATH)" and s.daemon is None


def test_on_without_the_binary_is_a_precise_error(tmp_path):
    with pytest.raises(LaunchError, match=r"^--mps on: nvidia-cuda-mps-control is not on PATH, "
                                          r"so ncclpy cannot start CUDA MPS .* or pass --mps "
                                          r"auto or --mps off$"):
        setup_mps("on", True, {"PATH": str(tmp_path)}, name="--mps")
    with pytest.raises(LaunchError, match=r"^mps='on': nvidia-cuda-mps-control is not on PATH, "
                                          r".* or pass mps='auto' or mps='off'$"):
        setup_mps("on", True, {"PATH": str(tmp_path)}, name="mps")


def test_user_daemon_is_used_not_started(fake, tmp_path):
    env, record = fake
    pipe = tmp_path / "user-pipe"
    pipe.mkdir()
    (pipe / "nvidia-cuda-mps-control.pid").write_text("1")
    s = setup_mps("on", True, {**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
    assert s.status == f"already running (the user's CUDA_MPS_PIPE_DIRECTORY={pipe})"
    assert s.daemon is None and s.env == {} and read_record(record) == []


def test_user_pipe_dir_without_a_daemon(fake, tmp_path):
    env, record = fake
    env = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "nothing")}
    s = setup_mps("auto", True, env)
    assert s.status.startswith("none (the user's CUDA_MPS_PIPE_DIRECTORY=") and s.daemon is None
    with pytest.raises(LaunchError, match="holds no MPS control daemon"):
        setup_mps("on", True, env)
    assert read_record(record) == []


# ---------------------------------------------------------------- the daemon's life cycle
@pytest.mark.parametrize("mode", ["auto", "on"])
def test_started_with_its_own_dirs_and_stopped(fake, mode):
    env, record = fake
    env["CUDA_VISIBLE_DEVICES"] = "1,0"
    s = setup_mps(mode, True, env)
    try:
        d = s.daemon
        assert d is not None and alive(d.pid)
        root = Path(d.root)
        assert root.name.startswith("ncclpy-mps-")
        assert s.env == {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
                         "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
        assert s.status == (f"started (CUDA_MPS_PIPE_DIRECTORY={root / 'pipe'}, daemon given "
                            f"CUDA_VISIBLE_DEVICES=1,0, ranks not)")
        assert s.unset == ("CUDA_VISIBLE_DEVICES",)   # MPS remaps the daemon's devices
        (start,) = read_record(record)
        assert start["event"] == "start" and start["pid"] == d.pid
        assert start["pipe"] == str(root / "pipe") and start["log"] == str(root / "log")
        assert start["cvd"] == "1,0"                  # the daemon sees the user's GPUs
        assert start["sid"] == d.pid                  # own session: a terminal ^C misses it
        assert daemon_ready(str(root / "pipe"))
    finally:
        assert s.stop() is None
    assert not alive(d.pid) and not root.exists()
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    assert events[1] == {"event": "command", "cmd": "quit", "pipe": str(root / "pipe")}
    assert s.stop() is None                           # idempotent


def test_no_cuda_visible_devices_nothing_to_unset(fake):
    env, _ = fake
    env.pop("CUDA_VISIBLE_DEVICES", None)
    s = setup_mps("auto", True, env)
    try:
        assert s.unset == () and s.status.endswith("/pipe)")
    finally:
        s.stop()


def test_failed_run_keeps_the_logs(fake):
    env, record = fake
    s = setup_mps("auto", True, env)
    kept = s.stop(failed=True)
    try:
        assert kept == s.daemon.log_dir and Path(kept).is_dir()
        assert (Path(kept) / "ncclpy-control-output.log").exists()
        assert not alive(s.daemon.pid) and read_record(record)[-1]["event"] == "stopped"
    finally:
        shutil.rmtree(s.daemon.root, ignore_errors=True)


def test_daemon_that_exits_at_once(fake):
    env, record = fake
    env["FAKE_MPS_FAIL"] = "1"
    s = setup_mps("auto", True, env)
    assert s.daemon is None and s.env == {}
    assert s.status.startswith("failed to start (") and s.status.endswith("; running without")
    assert "exited with code 3: fake failure: no usable GPU" in s.status
    with pytest.raises(LaunchError, match=r"^--mps on: cannot start CUDA MPS: .* exited with "
                                          r"code 3: fake failure: no usable GPU$"):
        setup_mps("on", True, env, name="--mps")


def test_daemon_that_never_gets_ready_is_stopped(fake):
    env, record = fake
    env["FAKE_MPS_NEVER_READY"] = "1"
    starter = functools.partial(MpsDaemon.start, ready_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"created no control pipe in .*/pipe within 0.5 s"):
        setup_mps("on", True, env, starter=starter)
    assert time.monotonic() - t0 < STOP_TIMEOUT_S   # not a quit's wait (10 s) before SIGTERM
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "sigterm"]   # no quit sent: SIGTERM
    assert not alive(events[0]["pid"])
    assert not Path(events[0]["pipe"]).parent.exists()       # its directory is gone too


def test_daemon_that_ignores_quit_gets_sigterm(fake):
    env, record = fake
    env["FAKE_MPS_IGNORE_QUIT"] = "1"
    s = setup_mps("on", True, env)
    t0 = time.monotonic()
    s.daemon.stop(timeout=0.5)
    # SIGTERM after its 0.5 s, not after the default STOP_TIMEOUT_S (10 s)
    assert time.monotonic() - t0 < STOP_TIMEOUT_S and not alive(s.daemon.pid)
    assert [e["event"] for e in read_record(record)] == ["start", "command", "sigterm"]


def test_daemon_dies_with_its_parent(fake, tmp_path):
    """PR_SET_PDEATHSIG: a launcher killed outright does not leave the daemon behind."""
    env, record = fake
    code = ("import os, sys, time\n"
            "from ncclpy.launch.mps import setup_mps\n"
            "s = setup_mps('on', True, dict(os.environ))\n"
            "print(s.daemon.pid, flush=True)\n"
            "time.sleep(120)\n")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True)
    pid = int(parent.stdout.readline())
    assert alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    events = read_record(record)
    assert events[-1]["event"] == "sigterm"
    shutil.rmtree(Path(events[0]["pipe"]).parent, ignore_errors=True)


def test_a_daemon_whose_first_client_fails_is_not_used(fake):
    env, record = fake
    env["CUDA_VISIBLE_DEVICES"] = "0"
    seen = []

    def check(client_env):
        seen.append(dict(client_env))
        return "a first CUDA client failed under it: cuInit returned CUresult 805"
    s = setup_mps("auto", True, env, check=check)
    assert s.daemon is None and s.env == {} and s.unset == ()
    assert s.status.startswith("failed to start (a first CUDA client failed under it: cuInit "
                               "returned CUresult 805 (MPS logs kept in ")
    (client,) = seen   # the client saw the daemon's pipe, and no CUDA_VISIBLE_DEVICES
    assert client["CUDA_MPS_PIPE_DIRECTORY"].endswith("/pipe")
    assert "CUDA_VISIBLE_DEVICES" not in client
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    logs = Path(events[0]["log"])
    assert logs.is_dir() and str(logs) in s.status
    shutil.rmtree(logs.parent)
    with pytest.raises(LaunchError, match=r"^--mps on: cannot start CUDA MPS: a first CUDA "):
        setup_mps("on", True, env, name="--mps", check=check)
    shutil.rmtree(Path(read_record(record)[-3]["log"]).parent)


def test_check_client_here():
    # without a CUDA driver there is nothing to ask: None; with one, a real client must work
    # outside MPS (no pipe directory: CUDA runs without MPS), so None as well
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
    assert check_client(env) is None
    assert check_client({**env, MPS_CHECK_ENV: "0"}) is None


# ---------------------------------------------------------------- through ncclpy run
RANK_PROG = """
    import json, os, sys
    from ncclpy.launch.mps import daemon_ready
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    print(json.dumps({k: os.environ.get(k) for k in (
        "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_VISIBLE_DEVICES",
        "NCCL_MAX_CTAS", "NCCLPY_DEVICE")} | {"ready": bool(pipe) and daemon_ready(pipe)}))
    sys.exit(int(os.environ["RANK"] == os.environ.get("FAIL_RANK")) * 3)
"""


def run_launcher(tmp_path: Path, env: dict, *args, timeout: float = 60):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(RANK_PROG))
    env = {**env, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p), "CUDA_VISIBLE_DEVICES": "0"}
    env.pop("NCCLPY_STORE_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "ncclpy", "run", *map(str, args), str(prog)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def _rank_rows(stdout: str) -> list[dict]:
    return [json.loads(line.split("] ", 1)[1]) for line in sorted(stdout.splitlines())]


def _placement_line(stderr: str, who: str = "ncclpy run") -> str:
    (line,) = [x for x in stderr.splitlines() if x.startswith(f"{who}: placement:")]
    return line


def test_run_starts_mps_for_shared_gpu_and_stops_it(fake, tmp_path):
    env, record = fake
    cp = run_launcher(tmp_path, env, "-n", 3)            # default mode: auto
    assert cp.returncode == 0, cp.stderr
    rows = _rank_rows(cp.stdout)
    pipes = {r["CUDA_MPS_PIPE_DIRECTORY"] for r in rows}
    assert len(pipes) == 1 and all(r["ready"] for r in rows)   # the daemon ran during the run
    pipe = pipes.pop()
    assert all(r["CUDA_VISIBLE_DEVICES"] is None for r in rows)   # MPS docs: clients unset it
    assert [r["NCCLPY_DEVICE"] for r in rows] == ["0", "0", "0"]
    line = _placement_line(cp.stderr)
    ctas = rows[0]["NCCL_MAX_CTAS"]
    assert ctas is not None and {r["NCCL_MAX_CTAS"] for r in rows} == {ctas}
    assert f"NCCL_MAX_CTAS={ctas} (3 ranks per GPU, " in line
    assert line.endswith(f"; MPS: started (CUDA_MPS_PIPE_DIRECTORY={pipe}, daemon given "
                         f"CUDA_VISIBLE_DEVICES=0, ranks not)")
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    assert events[0]["cvd"] == "0" and events[1]["cmd"] == "quit"
    assert not alive(events[0]["pid"]) and not Path(pipe).parent.exists()


def test_run_stops_mps_when_a_rank_fails_and_keeps_its_logs(fake, tmp_path):
    env, record = fake
    cp = run_launcher(tmp_path, {**env, "FAIL_RANK": "1"}, "-n", 3, "--mps", "on")
    assert cp.returncode == 3, cp.stderr
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    assert not alive(events[0]["pid"])
    last = cp.stderr.splitlines()[-1]
    logs = Path(events[0]["log"])
    assert last == f"ncclpy run: the run failed; MPS logs kept in {logs}" and logs.is_dir()
    shutil.rmtree(logs.parent)


def test_run_stops_mps_on_sigterm(fake, tmp_path):
    env, record = fake
    prog = tmp_path / "sleep.py"
    prog.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    env = {**env, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "0"}
    p = subprocess.Popen([sys.executable, "-m", "ncclpy", "run", "-n", "2", str(prog)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(2):
        assert p.stdout.readline().endswith("up\n")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    assert not alive(events[0]["pid"])
    shutil.rmtree(Path(events[0]["log"]).parent, ignore_errors=True)   # kept: the run failed


def test_run_mps_off_and_env_var(fake, tmp_path):
    env, record = fake
    cp = run_launcher(tmp_path, env, "-n", 2, "--mps", "off")
    assert cp.returncode == 0, cp.stderr
    assert _placement_line(cp.stderr).endswith("; MPS: off")
    assert all(r["CUDA_MPS_PIPE_DIRECTORY"] is None and r["CUDA_VISIBLE_DEVICES"] == "0"
               for r in _rank_rows(cp.stdout))
    cp = run_launcher(tmp_path, {**env, MPS_ENV: "off"}, "-n", 2)
    assert _placement_line(cp.stderr).endswith("; MPS: off")
    assert read_record(record) == []
    cp = run_launcher(tmp_path, {**env, MPS_ENV: "off"}, "-n", 2, "--mps", "auto")
    assert "; MPS: started (" in _placement_line(cp.stderr)     # the flag wins


def test_run_mps_on_without_the_binary(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cp = run_launcher(tmp_path, {**os.environ, "PATH": str(empty)}, "-n", 2, "--mps", "on")
    assert cp.returncode == 2 and cp.stdout == ""
    assert cp.stderr.splitlines()[-1].startswith(
        "ncclpy run: error: --mps on: nvidia-cuda-mps-control is not on PATH")


def test_run_one_rank_per_gpu_starts_nothing(fake, tmp_path):
    env, record = fake
    cp = run_launcher(tmp_path, env, "-n", 1, "--mps", "on")
    assert cp.returncode == 0, cp.stderr
    assert "MPS" not in _placement_line(cp.stderr) and read_record(record) == []


# ---------------------------------------------------------------- through ncclpy.spawn
def _spawn_child(rank: int, outdir: str) -> None:
    keys = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_VISIBLE_DEVICES", "NCCL_MAX_CTAS")
    with open(os.path.join(outdir, f"mps{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    if rank == 1 and os.environ.get("FAIL_RANK") == "1":
        raise RuntimeError("rank 1 fails")


def test_spawn_starts_and_stops_mps(fake, tmp_path, capfd):
    env, record = fake
    user = {"CUDA_VISIBLE_DEVICES": "0", "PATH": env["PATH"], "FAKE_MPS_RECORD": str(record),
            MPS_CHECK_ENV: "0"}
    ncclpy.spawn(_spawn_child, 3, args=(str(tmp_path),), env=user, mps="on", timeout=120)
    rows = [json.loads((tmp_path / f"mps{r}.json").read_text()) for r in range(3)]
    line = _placement_line(capfd.readouterr().err, "ncclpy spawn")
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    pipe = events[0]["pipe"]
    assert {r["CUDA_MPS_PIPE_DIRECTORY"] for r in rows} == {pipe}
    assert {r["CUDA_VISIBLE_DEVICES"] for r in rows} == {None}  # unset though env= gave it
    assert f"; MPS: started (CUDA_MPS_PIPE_DIRECTORY={pipe}" in line
    assert not alive(events[0]["pid"]) and not Path(pipe).parent.exists()


def test_spawn_stops_mps_when_a_rank_raises(fake, tmp_path, capfd):
    env, record = fake
    user = {"CUDA_VISIBLE_DEVICES": "0", "PATH": env["PATH"], "FAKE_MPS_RECORD": str(record),
            "FAIL_RANK": "1", MPS_ENV: "auto", MPS_CHECK_ENV: "0"}  # the mode from NCCLPY_MPS
    with pytest.raises(ProcessRaisedException, match="rank 1 fails"):
        ncclpy.spawn(_spawn_child, 2, args=(str(tmp_path),), env=user, timeout=120)
    events = read_record(record)
    assert [e["event"] for e in events] == ["start", "command", "stopped"]
    assert not alive(events[0]["pid"])
    logs = Path(events[0]["log"])
    assert f"ncclpy spawn: a rank failed; MPS logs kept in {logs}" in capfd.readouterr().err
    shutil.rmtree(logs.parent)
