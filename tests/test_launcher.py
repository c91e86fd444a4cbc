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
from ncclpy.rendezvous import free_port
from sigint_util import sigint_handled

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


#: a deadline for a hang in tests whose ranks would otherwise sleep 60 s: on an idle machine
#: the launcher acts within a fraction of a second, on a loaded one later, never this late
HANG = 30


def _user_port() -> int:
    """A port P the test passes as --master-port (the user's choice), free now with P+1 (torch's
    store): never a fixed number another run on this machine may hold."""
    return free_port("127.0.0.1", span=2)


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
    port = _user_port()
    cp = run(["--nproc-per-node", 2, "--master_addr", "127.0.0.1", "--master-port", port, prog])
    assert cp.returncode == 0, cp.stderr
    envs = _parse_env_lines(cp.stdout)
    assert {e["NCCLPY_MASTER_PORT"] for e in envs.values()} == {str(port)}


def test_multi_node_ranks_and_shared_token(tmp_path):
    prog = _script(tmp_path, ENV_DUMP)
    port = _user_port()
    args = ["-n", 2, "--nnodes", 2, "--node_rank", 1, "--master-addr", "127.0.0.1",
            "--master_port", port, prog]
    cp = run(args, env=_env(NCCLPY_STORE_TOKEN="shared-secret"))
    assert cp.returncode == 0, cp.stderr
    envs = _parse_env_lines(cp.stdout)
    assert sorted(envs) == [2, 3]
    for r, e in envs.items():
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_RANK"] == str(r - 2)
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["NCCLPY_STORE_TOKEN"] == "shared-secret"
        assert e["NCCLPY_MASTER_PORT"] == str(port)
    assert "node 1 of 2" in summary_lines(cp.stderr)[0]


def test_multi_node_without_token_is_an_error(tmp_path):
    prog = _script(tmp_path, "print('never')")
    cp = run(["-n", 2, "--nnodes", 2, "--node-rank", 0, "--master-addr", "127.0.0.1",
              "--master-port", _user_port(), prog])
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


@pytest.mark.parametrize("with_port", [False, True])
def test_non_local_master_addr_on_one_node_is_a_precise_error(tmp_path, with_port):
    if _bindable(NON_LOCAL):
        pytest.skip(f"this machine can bind {NON_LOCAL} (ip_nonlocal_bind?)")
    extra = ["--master-port", _user_port()] if with_port else []
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
    with sigint_handled():            # the handler an interactive start gives, not pytest's own
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
    prog = _script(tmp_path, "import os; print('checked=' + "
                             "str(os.environ.get('NCCLPY_CHECKED')))\n")
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
