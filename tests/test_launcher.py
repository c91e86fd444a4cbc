"""``ncclpy run``: real launcher processes running real rank processes (CPU only)."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ncclpy.launch.launcher import build_command, launch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)   # a deadline for a hang (the tests wait for events)


def _env(extra_path: str | None = None, **kw) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra_path,
                                                    env.get("PYTHONPATH")) if p)
    for k in ("CUDA_VISIBLE_DEVICES", "NCCLPY_STORE_TOKEN", "CUDA_MPS_PIPE_DIRECTORY"):
        env.pop(k, None)
    env["NCCLPY_MPS"] = "off"   # never a real MPS daemon here (tests/test_mps.py covers it)
    env.update(kw)
    return env


def _script(tmp_path: Path, body: str, name: str = "prog.py") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def run(args, *, env=None, timeout=30, **kw):
    t0 = time.monotonic()
    cp = subprocess.run([sys.executable, "-m", "ncclpy", "run", *map(str, args)],
                        env=env or _env(), capture_output=True, text=True, timeout=timeout, **kw)
    cp.elapsed = time.monotonic() - t0
    return cp


def summary_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ncclpy run: ")]


ENV_DUMP = """
    import json, os, sys
    keys = ["NCCLPY_RANK", "NCCLPY_WORLD_SIZE", "NCCLPY_LOCAL_RANK", "NCCLPY_LOCAL_WORLD_SIZE",
            "NCCLPY_MASTER_ADDR", "NCCLPY_MASTER_PORT", "NCCLPY_STORE_TOKEN", "NCCLPY_DEVICE",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PYTHONUNBUFFERED"]
    print(json.dumps({k: os.environ.get(k) for k in keys}))
    print("to stderr from", os.environ["RANK"], file=sys.stderr)
"""


def _parse_env_lines(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[rank (\d+)\] (\{.*\})", line)
        assert m, f"unprefixed or unexpected line {line!r}"
        out[int(m.group(1))] = json.loads(m.group(2))
    return out


def test_success_three_ranks_env_and_prefixes(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    cp = run(["-n", 3, prog], env=_env(NCCLPY_STORE_TOKEN="launcher-own-token"))
    assert cp.returncode == 0, cp.stderr
    envs = _parse_env_lines(cp.stdout)
    assert sorted(envs) == [0, 1, 2]
    tokens = {e["NCCLPY_STORE_TOKEN"] for e in envs.values()}
    assert len(tokens) == 1
    token = tokens.pop()
    assert re.fullmatch(r"[0-9a-f]{32}", token) and token != "launcher-own-token"
    ports = {e["NCCLPY_MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1
    port = int(ports.pop())
    for r, e in envs.items():
        assert e["NCCLPY_RANK"] == e["RANK"] == str(r)
        assert e["NCCLPY_LOCAL_RANK"] == e["LOCAL_RANK"] == str(r)
        assert e["NCCLPY_WORLD_SIZE"] == e["WORLD_SIZE"] == "3"
        assert e["NCCLPY_LOCAL_WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3"
        assert e["NCCLPY_MASTER_ADDR"] == e["MASTER_ADDR"] == "127.0.0.1"
        assert int(e["MASTER_PORT"]) != port          # torch's store never on ncclpy's port
        assert e["NCCLPY_DEVICE"] == str(r)            # no GPU here: device = local rank
        assert e["PYTHONUNBUFFERED"] == "1"
    err = cp.stderr.splitlines()
    assert sorted(line for line in err if line.startswith("[rank")) == [
        f"[rank {r}] to stderr from {r}" for r in range(3)]
    (placement,) = summary_lines(cp.stderr)
    assert "placement:" in placement and "no-gpu" in placement


def test_fresh_token_each_run(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    t = [_parse_env_lines(run(["-n", 1, prog]).stdout)[0]["NCCLPY_STORE_TOKEN"] for _ in range(2)]
    assert t[0] != t[1]


def test_explicit_master_addr_and_port(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    cp = run(["--nproc-per-node", 2, "--master_addr", "127.0.0.1", "--master-port", 29999, prog])
    assert cp.returncode == 0, cp.stderr
    envs = _parse_env_lines(cp.stdout)
    assert {e["NCCLPY_MASTER_PORT"] for e in envs.values()} == {"29999"}


def test_multi_node_ranks_and_shared_token(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    args = ["-n", 2, "--nnodes", 2, "--node_rank", 1, "--master-addr", "127.0.0.1",
            "--master_port", 29990, prog]
    cp = run(args, env=_env(NCCLPY_STORE_TOKEN="shared-secret"))
    assert cp.returncode == 0, cp.stderr
    envs = _parse_env_lines(cp.stdout)
    assert sorted(envs) == [2, 3]
    for r, e in envs.items():
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_RANK"] == str(r - 2)
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["NCCLPY_STORE_TOKEN"] == "shared-secret"
        assert e["NCCLPY_MASTER_PORT"] == "29990"
    assert "node 1 of 2" in summary_lines(cp.stderr)[0]


def test_multi_node_without_token_is_an_error(tmp_path):
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 2, "--nnodes", 2, "--node-rank", 0, "--master-addr", "127.0.0.1",
              "--master-port", 29991, prog])
    assert cp.returncode == 2 and "never" not in cp.stdout
    assert "NCCLPY_STORE_TOKEN" in cp.stderr and "shared" in cp.stderr


def test_multi_node_without_address_is_an_error(tmp_path):
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 1, "--nnodes", 2, "--node-rank", 1, prog],
             env=_env(NCCLPY_STORE_TOKEN="x"))
    assert cp.returncode == 2 and "--master-addr" in cp.stderr


def test_multi_node_non_local_master_without_port_says_to_pass_it(tmp_path):
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 1, "--nnodes", 2, "--node-rank", 1, "--master-addr", NON_LOCAL, prog],
             env=_env(NCCLPY_STORE_TOKEN="x"))
    assert cp.returncode == 2 and "Traceback" not in cp.stderr and "never" not in cp.stdout
    assert "ncclpy run: error: --master-port: a multi-node run (nnodes=2)" in cp.stderr
    assert "no port is picked" in cp.stderr


NON_LOCAL = "203.0.113.7"   # TEST-NET-3: never an address of this machine


def _bindable(addr: str) -> bool:
    import socket
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("extra", [[], ["--master-port", "29995"]])
def test_non_local_master_addr_on_one_node_is_a_precise_error(tmp_path, extra):
    if _bindable(NON_LOCAL):
        pytest.skip(f"this machine can bind {NON_LOCAL} (ip_nonlocal_bind?)")
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 2, "--master-addr", NON_LOCAL, *extra, prog])
    assert cp.returncode == 2 and "Traceback" not in cp.stderr and "never" not in cp.stdout
    (line,) = cp.stderr.splitlines()
    assert line.startswith(f"ncclpy run: error: --master-addr {NON_LOCAL}: not an address of "
                           f"this machine (")
    assert "leave --master-addr out (127.0.0.1)" in line


def test_local_master_addr_by_name(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    cp = run(["-n", 1, "--master-addr", "localhost", prog])
    assert cp.returncode == 0, cp.stderr
    assert _parse_env_lines(cp.stdout)[0]["NCCLPY_MASTER_ADDR"] == "localhost"


@pytest.mark.parametrize("port", [65535, 70000, 0, -5])
@pytest.mark.parametrize("nnodes", [1, 2])
def test_master_port_out_of_range_names_the_flag(tmp_path, port, nnodes):
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 1, "--nnodes", nnodes, "--master-addr", "127.0.0.1", "--master-port", port,
              prog], env=_env(NCCLPY_STORE_TOKEN="x"))
    assert cp.returncode == 2 and "never" not in cp.stdout
    assert cp.stderr.strip() == (f"ncclpy run: error: --master-port: expected a port in 1..65534 "
                                 f"(ncclpy's store listens on P, torch's on P+1), got {port}")


def test_master_port_65534_is_the_highest(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    cp = run(["-n", 1, "--master-port", 65534, prog])
    assert cp.returncode == 0, cp.stderr
    e = _parse_env_lines(cp.stdout)[0]
    assert (e["NCCLPY_MASTER_PORT"], e["MASTER_PORT"]) == ("65534", "65535")


@pytest.mark.parametrize("args, needle", [
    (["-n", 2], "PROGRAM"),
    (["-n", 0, "x.py"], "error: -n: "),
    (["-n", 1, "--nnodes", 2, "--node-rank", 2, "x.py"], "error: --node-rank: "),
    (["-n", 1, "--grace", -1, "x.py"], "error: --grace: "),
])
def test_usage_errors(args, needle):
    cp = run(args)
    assert cp.returncode == 2 and needle in cp.stderr, cp.stderr


def test_missing_program_cannot_start():
    cp = run(["-n", 2, "/nonexistent/ncclpy-no-such-program"])
    assert cp.returncode == 2 and "cannot start rank 0" in cp.stderr


FAILING = """
    import os, signal, sys, time
    out, n, failing = {out!r}, {n}, {failing}
    rank = int(os.environ["RANK"])
    def on_term(signum, frame):        # survivors: record when the launcher's SIGTERM came
        with open(os.path.join(out, f"term{{rank}}"), "w") as f:
            f.write(repr(time.time()))
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(out, f"ready{{rank}}"), "w").close()
    if rank == failing:                # fail once every rank runs (with its handler set)
        while not all(os.path.exists(os.path.join(out, f"ready{{r}}")) for r in range(n)):
            time.sleep(0.02)
        with open(os.path.join(out, "failed_at"), "w") as f:
            f.write(repr(time.time()))
        {fail}
    time.sleep(60)
    print("should have been stopped")
"""


#: a deadline for a hang in tests whose ranks would otherwise sleep 60 s: on an idle machine
#: the launcher acts within a fraction of a second, on a loaded one later, never this late
HANG = 30


def _assert_the_others_were_stopped(out: Path, n: int, failing: int, end: float):
    """Every other rank got the launcher's SIGTERM (its handler wrote ``term<r>``) after the
    failure, and the launcher ended long before the ranks' own 60 s."""
    failed_at = float((out / "failed_at").read_text())
    for r in range(n):
        if r != failing:
            got_term = float((out / f"term{r}").read_text())
            assert 0 <= got_term - failed_at <= HANG, f"rank {r} stopped " \
                                                      f"{got_term - failed_at} s after the failure"
    assert end - failed_at <= HANG, f"the launcher ended {end - failed_at:.2f} s after the failure"


def test_rank_exit_3_stops_the_others(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prog = _script(tmp_path, FAILING.format(out=str(out), n=4, failing=2, fail="sys.exit(3)"))
    cp = run(["-n", 4, prog], timeout=120)
    end = time.time()
    assert cp.returncode == 3, cp.stderr
    _assert_the_others_were_stopped(out, 4, 2, end)
    assert "should have been stopped" not in cp.stdout
    assert summary_lines(cp.stderr)[-1] == ("ncclpy run: rank 2 exited with code 3; "
                                            "stopped the other 3 ranks")


def test_ranks_ignoring_sigterm_get_sigkill_after_grace(tmp_path):
    prog = _script(tmp_path, f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = int(os.environ["RANK"])
        open(os.path.join({str(tmp_path)!r}, f"armed{{rank}}"), "w").close()
        if rank == 0:      # fail once the others ignore SIGTERM
            while not all(os.path.exists(os.path.join({str(tmp_path)!r}, f"armed{{r}}"))
                          for r in (1, 2)):
                time.sleep(0.02)
            sys.exit(4)
        time.sleep(60)
    """)
    cp = run(["-n", 3, "--grace", 1, prog], timeout=120)
    assert cp.returncode == 4
    assert 1.0 <= cp.elapsed < HANG      # SIGKILL after the grace, not the ranks' 60 s
    assert summary_lines(cp.stderr)[-1] == ("ncclpy run: rank 0 exited with code 4; stopped the "
                                            "other 2 ranks (2 with SIGKILL after 1 s)")


def test_first_failure_wins(tmp_path):
    prog = _script(tmp_path, """
        import os, sys, time
        import signal
        r = int(os.environ["RANK"])
        if r == 1:
            sys.exit(5)
        # a later failure: the launcher's SIGTERM (after rank 1's) makes the others exit 7
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        time.sleep(60)
    """)
    cp = run(["-n", 3, prog], timeout=120)
    assert cp.returncode == 5
    assert "rank 1 exited with code 5" in summary_lines(cp.stderr)[-1]


def test_rank_killed_by_sigkill(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prog = _script(tmp_path, FAILING.format(out=str(out), n=3, failing=1,
                                            fail="os.kill(os.getpid(), signal.SIGKILL)"))
    cp = run(["-n", 3, prog], timeout=120)
    end = time.time()
    assert cp.returncode == 128 + signal.SIGKILL == 137, cp.stderr
    _assert_the_others_were_stopped(out, 3, 1, end)
    assert summary_lines(cp.stderr)[-1] == ("ncclpy run: rank 1 was killed by signal SIGKILL; "
                                            "stopped the other 2 ranks")


def test_only_rank_fails_summary(tmp_path):
    prog = _script(tmp_path, "import sys; sys.exit(9)")
    cp = run(["-n", 1, prog])
    assert cp.returncode == 9
    assert summary_lines(cp.stderr)[-1] == ("ncclpy run: rank 0 exited with code 9; "
                                            "no other rank was running")


def _start_and_wait_ready(tmp_path, body, n, sig_extra=()):
    prog = _script(tmp_path, body)
    p = subprocess.Popen([sys.executable, "-m", "ncclpy", "run", "-n", str(n), *sig_extra,
                          str(prog)], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    lines = []
    while len([x for x in lines if x.endswith("ready")]) < n:
        line = p.stdout.readline()
        assert line, f"launcher ended early: {lines} {p.stderr.read()}"
        lines.append(line.rstrip("\n"))
    return p, lines


HANDLER = """
    import signal, sys, time
    def handler(signum, frame):
        print("got " + signal.Signals(signum).name, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_forwarded_to_every_rank_once(tmp_path, sig):
    p, lines = _start_and_wait_ready(tmp_path, HANDLER, 3)
    t0 = time.monotonic()
    p.send_signal(sig)
    out, err = p.communicate(timeout=2 * HANG)
    assert time.monotonic() - t0 < HANG
    lines += out.splitlines()
    got = sorted(x for x in lines if "got" in x)
    assert got == [f"[rank {r}] got {sig.name}" for r in range(3)]   # exactly once each
    assert p.returncode == 128 + sig
    assert f"received {sig.name}; forwarded it to 3 ranks" in summary_lines(err)[-1]


def test_sigint_default_handler_ranks(tmp_path):
    body = """
        import time
        print("ready", flush=True)
        time.sleep(60)
    """
    p, _ = _start_and_wait_ready(tmp_path, body, 2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 130
    assert err.count("KeyboardInterrupt") == 2
    assert "rank 0 SIGINT" in summary_lines(err)[-1]


def test_ranks_that_ignore_a_forwarded_signal_are_killed_after_grace(tmp_path):
    body = """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """
    p, _ = _start_and_wait_ready(tmp_path, body, 2, ("--grace", "0.5"))
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=2 * HANG)
    assert time.monotonic() - t0 < HANG
    assert p.returncode == 130
    assert "killed 2 still running after 0.5 s" in summary_lines(err)[-1]


def test_ranks_die_with_a_killed_launcher(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    body = f"""
        import os, time
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        print("ready", flush=True)
        time.sleep(60)
    """
    p, _ = _start_and_wait_ready(tmp_path, body, 2)
    p.kill()
    p.communicate(timeout=HANG)
    ranks = [int(x.name) for x in pids.iterdir()]
    assert len(ranks) == 2
    deadline = time.monotonic() + HANG
    alive = ranks
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in ranks if _alive(pid)]
        time.sleep(0.05)
    assert not alive, f"ranks {alive} outlived the launcher"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_module_mode_passes_arguments(tmp_path):
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "ncclpy_test_mod.py").write_text(textwrap.dedent("""
        import os, sys
        print(os.environ["RANK"], __name__, sys.argv[1:])
    """))
    cp = run(["-n", 2, "-m", "ncclpy_test_mod", "--flag", "value", "-n", "9"],
             env=_env(str(pkg)))
    assert cp.returncode == 0, cp.stderr
    assert sorted(cp.stdout.splitlines()) == [
        "[rank 0] 0 __main__ ['--flag', 'value', '-n', '9']",
        "[rank 1] 1 __main__ ['--flag', 'value', '-n', '9']"]


def test_python_script_form_and_double_dash(tmp_path):
    prog = _script(tmp_path, "import sys; print('args', sys.argv[1:])")
    cp = run(["-n", 1, "--", sys.executable, prog, "a", "--b"])
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == "[rank 0] args ['a', '--b']\n"


def test_non_python_program(tmp_path):
    cp = run(["-n", 2, "sh", "-c", 'echo "hello from $NCCLPY_RANK"; exit $NCCLPY_RANK'])
    assert cp.returncode == 1
    assert "[rank 0] hello from 0" in cp.stdout


def test_rank0_gets_stdin_others_devnull(tmp_path):
    prog = _script(tmp_path, """
        import os, sys
        print(os.environ["RANK"], repr(sys.stdin.read()))
    """)
    cp = run(["-n", 2, prog], input="hello")
    assert sorted(cp.stdout.splitlines()) == ["[rank 0] 0 'hello'", "[rank 1] 1 ''"]


def test_placement_variables_reach_the_ranks(tmp_path):
    prog = _script(tmp_path, """
        import os
        print(os.environ["NCCLPY_DEVICE"], os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE"),
              os.environ.get("NCCL_HOSTID"), os.environ.get("NCCL_NET"))
    """)
    # CUDA_VISIBLE_DEVICES="0" makes the launcher see one GPU (it counts entries, no CUDA
    # needed); the ranks only print their environment.
    cp = run(["-n", 3, prog],
             env=_env(CUDA_VISIBLE_DEVICES="0", NCCL_NET="IB", NCCL_MAX_CTAS="5"))
    assert cp.returncode == 0, cp.stderr
    (line,) = summary_lines(cp.stderr)
    assert "3 ranks on 1 GPU" in line and line.endswith("; MPS: off")
    assert ", NCCL_MAX_CTAS=" not in line and "kept the user's NCCL_MAX_CTAS=5 (" in line
    from ncclpy.launch.placement import loaded_nccl_version
    v = loaded_nccl_version()
    rows = sorted(cp.stdout.splitlines())
    assert [r.split()[2] for r in rows] == ["0", "0", "0"]      # NCCLPY_DEVICE
    if v is not None and v >= 23000:
        assert "multi-rank-gpu" in line
        assert all(r.split()[3] == "1" for r in rows)
    else:
        assert "hostid-socket" in line and "kept the user's NCCL_NET=IB" in line
        assert len({r.split()[4] for r in rows}) == 3
    assert all(r.split()[-1] == "IB" for r in rows)             # the user's setting kept


def test_ranks_per_gpu_reaches_the_ranks(tmp_path):
    prog = _script(tmp_path, "import os; print(os.environ['NCCLPY_DEVICE'])")
    cp = run(["-n", 4, "--ranks-per-gpu", 2, prog], env=_env(CUDA_VISIBLE_DEVICES="0,1,2,3"))
    assert cp.returncode == 0, cp.stderr
    devs = dict(x.split("] ") for x in cp.stdout.splitlines())
    assert [devs[f"[rank {r}"] for r in range(4)] == ["0", "1", "0", "1"]   # r mod 2 GPUs used
    (line,) = summary_lines(cp.stderr)
    assert "4 ranks on 2 GPUs of 4, rank r -> GPU r mod 2" in line
    assert "NCCL_MAX_CTAS" not in line        # 2 ranks per GPU: NCCL's defaults fit


@pytest.mark.parametrize("args, env, message", [
    (["--mps", "sometimes"], {}, "ncclpy run: error: --mps: invalid choice: 'sometimes'"),
    ([], {"NCCLPY_MPS": "yes"},
     "ncclpy run: error: NCCLPY_MPS: expected one of auto, on, off, got 'yes'"),
])
def test_bad_mps_mode(tmp_path, args, env, message):
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 2, *args, prog], env=_env(**env))
    assert cp.returncode == 2 and cp.stdout == ""
    assert message in cp.stderr.splitlines()[-1]


def test_launch_in_process_to_binary_streams(tmp_path):
    prog = _script(tmp_path, "import os; print('hi', os.environ['NCCLPY_RANK'])")
    out, err = io.BytesIO(), io.BytesIO()
    rc = launch(build_command([str(prog)]), 2, stdout=out, stderr=err, env=_env())
    assert rc == 0
    assert sorted(out.getvalue().decode().splitlines()) == ["[rank 0] hi 0", "[rank 1] hi 1"]
    assert b"placement:" in err.getvalue()
    # the launcher restored the test process's own signal handlers
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_build_command():
    assert build_command(["x.py", "a"]) == [sys.executable, "x.py", "a"]
    assert build_command(["m", "a"], module=True) == [sys.executable, "-m", "m", "a"]
    assert build_command(["--", "prog", "a"]) == ["prog", "a"]
    with pytest.raises(ValueError):
        build_command([])


def test_ranks_rendezvous_through_the_real_store_and_libnccl(tmp_path):
    """End to end: the environment the launcher sets is enough for ncclpy's bootstrap (store
    + ncclGetUniqueId through CuPy), and every rank ends up with the same 128-byte uid."""
    pytest.importorskip("ncclpy.bootstrap")
    try:
        from cupy.cuda import nccl
        assert nccl.available
    except Exception as e:
        pytest.skip(f"CuPy's NCCL is not usable: {e}")
    prog = _script(tmp_path, """
        import hashlib, os, time
        from ncclpy.bootstrap import bootstrap
        if os.environ["RANK"] != "0":
            time.sleep(1.0)             # late readers: rank 0 must wait for them
        b = bootstrap(timeout=30)
        print(b.rank, b.world_size, b.device, len(bytes(b.uid)),
              hashlib.sha256(bytes(b.uid)).hexdigest(), flush=True)
        # rank 0 (the store's host) exits at once: bootstrap returned only after every rank
        # had read the uid
    """)
    cp = run(["-n", 4, prog], timeout=60)
    assert cp.returncode == 0, cp.stderr
    rows = sorted(cp.stdout.splitlines())
    assert [r.split()[:5] for r in rows] == [
        ["[rank", f"{r}]", str(r), "4", str(r)] for r in range(4)]
    assert {r.split()[5] for r in rows} == {"128"}
    assert len({r.split()[6] for r in rows}) == 1


# ---------------------------------------------------------------- issue 15/16: timeout, groups
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pid: int, bound: float = 30.0) -> bool:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


GRANDCHILD = """
    import os, subprocess, sys, time
    rank = int(os.environ["RANK"])
    child = subprocess.Popen(["sleep", "300"])
    with open(sys.argv[1] + f".{rank}.tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(sys.argv[1] + f".{rank}.tmp", sys.argv[1] + f".{rank}")
    if rank == 1 and sys.argv[2] == "fail":
        end = time.monotonic() + 60                      # a deadline for a hang only
        while not os.path.exists(sys.argv[1] + ".0"):   # rank 0's pid is written: fail now
            if time.monotonic() > end:
                sys.exit("rank 0 never wrote its pid file")
            time.sleep(0.01)
        sys.exit(3)
    time.sleep(300)
"""


@pytest.mark.parametrize("how", ["fail", "timeout"])
def test_a_ranks_own_children_do_not_outlive_it(tmp_path, how):
    prog = _script(tmp_path, GRANDCHILD)
    # "fail": rank 1 fails once rank 0's pid file is there (an event).  "timeout": --timeout
    # must pass after both ranks started their child; on a loaded machine starting them may
    # take longer than the first limit, so a run where a pid file is missing (a rank stopped
    # before its child existed: nothing to check) is tried again with twice the limit
    for limit in ([None] if how == "fail" else [2, 4, 8, 16, 32]):
        pidfile = tmp_path / f"pid-{limit}"
        extra = [] if limit is None else ["--timeout", str(limit)]
        cp = run(["-n", "2", "--grace", "1", *extra, prog, pidfile, how],
                 timeout=60 + 2 * (limit or 0))
        assert cp.returncode == (3 if how == "fail" else 124), cp.stderr
        files = [tmp_path / f"pid-{limit}.{r}" for r in range(2)]
        if all(f.exists() for f in files):
            break
    pids = [int(f.read_text()) for f in files]
    for pid in pids:   # the sleeps were the ranks' children, in the ranks' process groups
        assert _wait_gone(pid), f"grandchild {pid} outlived its rank ({how})"
    if how == "timeout":
        line = summary_lines(cp.stderr)[-1]
        assert f"--timeout {limit} s passed with ranks 0, 1 still running" in line, cp.stderr
        assert "exit code 124" in line


def test_timeout_names_only_the_ranks_still_running(tmp_path):
    prog = _script(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] != "2":
            sys.exit(0)
        time.sleep(300)
    """)
    # ranks 0 and 1 must end before --timeout passes: on a loaded machine starting them may
    # take longer than the first limit (the summary then names them too), so try twice as long
    for limit in (1.5, 3, 6, 12, 24):
        cp = run(["-n", "3", "--timeout", str(limit), "--grace", "1", prog], timeout=120)
        assert cp.returncode == 124, cp.stderr
        if "ranks" not in summary_lines(cp.stderr)[-1]:
            break
    assert "passed with rank 2 still running; stopped it" in summary_lines(cp.stderr)[-1]


def test_timeout_not_reached_exits_zero(tmp_path):
    prog = _script(tmp_path, "print('ok')\n")
    cp = run(["-n", "2", "--timeout", "60", prog])
    assert cp.returncode == 0, cp.stderr
    assert "--timeout" in run(["-h"]).stdout and "124" in run(["-h"]).stdout


def test_checked_flag_sets_the_variable_for_every_rank(tmp_path):
    prog = _script(tmp_path, "import os; print('checked=' + str(os.environ.get('NCCLPY_CHECKED')))\n")
    on = run(["-n", "2", "--checked", prog])
    off = run(["-n", "2", prog], env=_env())
    assert on.returncode == 0 and on.stdout.count("checked=1") == 2, on.stdout
    assert off.returncode == 0 and "checked=1" not in off.stdout


def test_nprocs_is_an_alias_of_n(tmp_path):
    prog = _script(tmp_path, "import os; print('r' + os.environ['RANK'])\n")
    cp = run(["--nprocs", "2", prog])
    assert cp.returncode == 0, cp.stderr
    assert "[rank 1] r1" in cp.stdout


@pytest.mark.parametrize("args, needle", [
    (["--nprocs", "0", "x.py"], "ncclpy run: error: --nprocs: expected an int >= 1, got 0"),
    (["-n", "0", "x.py"], "ncclpy run: error: -n: expected an int >= 1, got 0"),
    (["-n", "1", "--node-rank", "3", "x.py"], "error: --node-rank: expected 0 <= --node-rank"),
    (["-n", "1", "--grace", "-1", "x.py"], "error: --grace: expected seconds >= 0, got -1.0"),
    (["-n", "1", "--timeout", "0", "x.py"], "error: --timeout: expected seconds > 0"),
    (["-n", "1", "--timeout", "soon", "x.py"], "error: --timeout: invalid float value: 'soon'"),
])
def test_cli_errors_are_one_line_naming_the_flag_as_typed(args, needle):
    cp = run(args)
    assert cp.returncode == 2, cp.stderr
    assert cp.stderr.count("\n") == 1 and needle in cp.stderr, cp.stderr
    assert "Traceback" not in cp.stderr


def test_master_port_whose_p_plus_1_is_taken_is_a_precise_error(tmp_path):
    import socket
    prog = _script(tmp_path, "print('ran')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        p1 = busy.getsockname()[1]
        cp = run(["-n", "1", "--master-port", p1 - 1, prog])
    assert cp.returncode == 2, cp.stderr
    assert cp.stderr.count("\n") == 1 and "ran" not in cp.stdout
    assert (f"--master-port {p1 - 1}: port {p1} (torch's store, P+1) on 127.0.0.1 is not free"
            in cp.stderr), cp.stderr


def test_a_failed_rank_is_published_in_the_store(tmp_path):
    """The launcher hosts the store; rank 1 dies; the launcher publishes its death (the key,
    the dead list and the epoch) before stopping rank 0, which reads it."""
    prog = _script(tmp_path, """
        import os, sys
        from ncclpy.store import TCPStore
        rank = int(os.environ["RANK"])
        host, port = os.environ["NCCLPY_MASTER_ADDR"], int(os.environ["NCCLPY_MASTER_PORT"])
        tok = os.environ["NCCLPY_STORE_TOKEN"]
        if rank == 0:
            import signal   # the fail-fast SIGTERM races the read: wait for the grace SIGKILL
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            assert os.environ["NCCLPY_STORE_HOSTED_BY"] == "launcher"
            s = TCPStore(host, port, token=tok, timeout=30)
            s.set("up", b"1")
            epoch = int(s.get("ncclpy/dead/epoch", timeout=25))   # bumped last
            print("dead:", s.get("ncclpy/dead/1").decode(), flush=True)
            print("list:", s.get("ncclpy/dead/ranks").decode(), epoch, flush=True)
            sys.exit(0)   # done: the grace below is only a deadline for the reads
        else:
            TCPStore(host, port, token=tok, timeout=30).get("up")
            sys.exit(7)
    """)
    cp = run(["-n", "2", "--grace", str(HANG), prog], timeout=4 * HANG)
    assert cp.returncode == 7, cp.stderr
    assert "[rank 0] dead: exited with code 7" in cp.stdout, (cp.stdout, cp.stderr)
    assert "[rank 0] list: 1 1" in cp.stdout, cp.stdout


def test_the_store_outlives_rank_0_and_its_death_is_published(tmp_path):
    """Under ncclpy run the store is the launcher's: rank 0 dies, rank 1 still reaches the
    store and reads rank 0's death notice there."""
    prog = _script(tmp_path, """
        import os, sys, signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the fail-fast SIGTERM races the read
        from ncclpy.store import TCPStore
        rank = int(os.environ["RANK"])
        host, port = os.environ["NCCLPY_MASTER_ADDR"], int(os.environ["NCCLPY_MASTER_PORT"])
        s = TCPStore(host, port, token=os.environ["NCCLPY_STORE_TOKEN"], timeout=30)
        if rank == 0:
            s.get("ready")
            os.kill(os.getpid(), signal.SIGKILL)
        s.set("ready", b"1")
        print("dead:", s.get("ncclpy/dead/0", timeout=25).decode(), flush=True)
    """)
    cp = run(["-n", "2", "--grace", str(HANG), prog], timeout=4 * HANG)
    assert cp.returncode == 128 + 9, cp.stderr
    assert "[rank 1] dead: was killed by signal SIGKILL" in cp.stdout, (cp.stdout, cp.stderr)
