"""What ``ncclpy run`` and ``ncclpy status`` say (issue 38, items 15 and 16): the status section of
a failed run only when a communicator registered one; ``ncclpy status`` without the token says
so once and where the token is (and finds it itself for a running single-node job); a bad
``--timeout`` is one line naming the flag, the value and what is accepted.  Real ``ncclpy run``
jobs and real stores."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(180)

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SECTION = "where every rank is (ncclpy status)"


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for k in ("NCCLPY_STORE_TOKEN", "NCCLPY_MASTER_PORT", "MASTER_PORT", "NCCLPY_MASTER_ADDR",
              "MASTER_ADDR", "NCCLPY_CHECKED", "NCCLPY_RANK", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _ncclpy(*args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncclpy", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(**extra), cwd=ROOT)


# ------------------------------------------------------------------ item 15: the status section
def test_a_run_that_fails_before_any_communicator_prints_no_status_section(tmp_path):
    r = _ncclpy("run", "-n", "2", sys.executable, "/nonexistent.py",
                NCCLPY_TRACE_DIR=str(tmp_path / "dumps"))
    assert r.returncode == 2, r.stderr
    assert "ncclpy run: rank " in r.stderr and "exited with code 2" in r.stderr, r.stderr
    assert SECTION not in r.stderr and "no communicator has registered" not in r.stderr, r.stderr


_COMM_THEN_FAIL = """
    import os, sys, time
    import numpy as np
    import ncclpy
    from ncclpy.store import TCPStore
    env = os.environ
    store = TCPStore(env["NCCLPY_MASTER_ADDR"], int(env["NCCLPY_MASTER_PORT"]), timeout=60)
    comm = ncclpy.init("reported", device="cpu")
    comm.all_reduce(np.ones(8, np.float32)).wait()
    if comm.rank == 1:
        store.get("ncclpy/status/1", timeout=60)   # rank 0 registered the table
        sys.stdout.flush()
        os._exit(3)
    time.sleep(120)                                # stopped by the launcher
"""


def test_a_run_that_fails_with_a_communicator_prints_its_table(tmp_path):
    script = tmp_path / "comm_then_fail.py"
    script.write_text(textwrap.dedent(_COMM_THEN_FAIL))
    r = _ncclpy("run", "-n", "2", "--grace", "2", str(script),
                NCCLPY_TRACE_DIR=str(tmp_path / "dumps"))
    assert r.returncode == 3, r.stderr
    assert f"ncclpy run: rank 1 exited with code 3; {SECTION}:" in r.stderr, r.stderr
    assert "communicator 'reported' (2 ranks" in r.stderr, r.stderr


# ------------------------------------------------------------ item 16: ncclpy status and the token
def test_status_without_the_token_says_it_once_and_where_the_token_is():
    from ncclpy.debug.jobfile import jobs_dir
    from ncclpy.store import StoreServer
    srv = StoreServer("127.0.0.1", 0, token="the-job-token").start()
    try:
        r = _ncclpy("status", "--master-port", str(srv.port))
    finally:
        srv.close()
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith(f"ncclpy status: error: the store at 127.0.0.1:{srv.port} (from "
                           f"--master-port) requires the job's token and none was given"), line
    assert line.count("token and") == 1 and line.count("gave none") == 0, line   # said once
    assert "in every rank's environment as NCCLPY_STORE_TOKEN" in line, line    # where it is
    assert f"job file in {jobs_dir()}" in line, line
    assert "Traceback" not in r.stderr


_WAIT_FOR_GO = """
    import os, sys, time
    d = sys.argv[1]
    with open(os.path.join(d, "port.tmp"), "w") as f:
        f.write(os.environ["NCCLPY_MASTER_PORT"])
    os.replace(os.path.join(d, "port.tmp"), os.path.join(d, "port"))
    end = time.monotonic() + 90                    # a deadline for a hang, not a duration
    while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < end:
        time.sleep(0.05)
"""


def test_status_finds_the_token_of_a_running_single_node_job_by_its_port(tmp_path):
    script = tmp_path / "wait_for_go.py"
    script.write_text(textwrap.dedent(_WAIT_FOR_GO))
    job = subprocess.Popen([sys.executable, "-m", "ncclpy", "run", "-n", "1", str(script),
                            str(tmp_path)], env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 90
        while not (tmp_path / "port").exists() and job.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "port").exists(), job.communicate(timeout=30)
        port = (tmp_path / "port").read_text()
        r = _ncclpy("status", "--master-port", port)      # no NCCLPY_STORE_TOKEN given
    finally:
        (tmp_path / "go").write_text("")
        out, err = job.communicate(timeout=60)
    assert r.returncode == 0 and r.stderr == "", r
    assert "no communicator has registered its progress yet" in r.stdout, r.stdout
    assert job.returncode == 0, err


# ------------------------------------------------------------------ item 16: run --timeout
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e400", "-inf"])
def test_run_timeout_out_of_range_is_one_line_naming_flag_value_and_what_is_accepted(value):
    # "-inf" after a space would be read as an option by argparse: the = form passes it
    flag = ["--timeout=-inf"] if value == "-inf" else ["--timeout", value]
    r = _ncclpy("run", "-n", "1", *flag, sys.executable, "-c", "pass", timeout=60)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [
        f"ncclpy run: error: --timeout: expected seconds > 0, got {value!r} (for no limit, leave "
        f"--timeout out) (see 'ncclpy run -h')"], r.stderr
    assert "None" not in r.stderr


def test_run_timeout_not_a_number_is_one_line_saying_what_is_accepted():
    r = _ncclpy("run", "-n", "1", "--timeout", "soon", sys.executable, "-c", "pass", timeout=60)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [
        "ncclpy run: error: --timeout: invalid float value: 'soon' (expected seconds > 0; for no "
        "limit, leave --timeout out) (see 'ncclpy run -h')"], r.stderr


def test_launch_timeout_in_python_names_none_for_no_limit():
    from ncclpy.errors import ArgumentError
    from ncclpy.launch.launcher import launch
    with pytest.raises(ArgumentError, match=r"^timeout: expected seconds > 0, got -1 \(or None "
                                            r"for no limit\)$"):
        launch([sys.executable, "-c", "pass"], 1, timeout=-1)
