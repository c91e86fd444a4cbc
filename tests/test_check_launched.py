"""``ncclpy check`` with a launcher's environment (often left over from another job), in real
processes on real sockets: the first line on stderr says it runs as rank r of N and what it
read, before it waits; not meeting the peers, a missing or malformed variable and a port in
use end in one line each, exit status 2, no traceback, no C++ log (issue 38, item 5)."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, Dict

import pytest

from check_runs import module_runs
from ncclpy.check.launched import announce, from_env, rendezvous_failure

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)
UNSET = "unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to let ncclpy check start its own"
#: a one-case run, so that a run that does start ends quickly (on gloo: the rendezvous is
#: what these tests check; the CPU backend under a launcher: test_check_exact.py)
ONE_CASE = ["--collectives", "all_reduce", "--dtypes", "float32", "--sizes", "4", "-q",
            "--backend", "gloo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(base: Dict[str, str] | None = None, **launch: str) -> Dict[str, str]:
    """``base`` (default: this process's environment) without any launcher's variables and
    NCCLPY_*, with ``launch``'s."""
    e = dict(os.environ if base is None else base)
    for k in list(e):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NCCLPY_CHECK_INJECT") or \
                k.startswith("NCCLPY_"):
            e.pop(k)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    e.update(launch)
    return e


def _check(env: Dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncclpy", "check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)


def _store(rank: int, n: int, port: int, base: Dict[str, str] | None = None
           ) -> Dict[str, str]:
    return _env(base, RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _no_traceback(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr and "frame #" not in p.stderr and \
        "Error(" not in p.stderr, p.stderr


def _first_line_then_peer(base: Dict[str, str]) -> Dict[str, Any]:
    """Rank 0 started alone; rank 1 only once rank 0's first stderr line is read (and looks
    like the announcement: else rank 1 is not started, and the test fails on the line)."""
    port = _free_port()
    r0 = subprocess.Popen([sys.executable, "-m", "ncclpy", "check", "--timeout", "120",
                           *ONE_CASE], cwd=ROOT, env=_store(0, 2, port, base), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got: Dict[str, Any] = {"port": port, "r1": None}
    try:
        got["first"] = r0.stderr.readline()
        if got["first"].startswith("ncclpy check: running as rank 0 of 2"):
            got["r1"] = _check(_store(1, 2, port, base), "--timeout", "120", *ONE_CASE)
        got["out"], got["err"] = r0.communicate(timeout=150)
    finally:
        if r0.poll() is None:
            r0.kill()
            r0.wait()
    got["rc"] = r0.returncode
    return got


def _lonely(rank: int, base: Dict[str, str]) -> Dict[str, Any]:
    """A rank whose peer never comes (--timeout 2)."""
    port = _free_port()
    return {"port": port, "p": _check(_store(rank, 2, port, base), "--timeout", "2", *ONE_CASE)}


def _store_port_in_use(base: Dict[str, str]) -> Dict[str, Any]:
    """Rank 0 told to host torch's store on a port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = _check(_store(0, 2, port, base), "--timeout", "5", *ONE_CASE)
    return {"port": port, "p": p}


NEEDS = {"test_the_first_line_comes_before_the_wait_and_the_peer_then_completes_the_run":
         ["first-line"],
         "test_peers_that_never_come_end_in_one_line[rank0-hosts-the-store]": ["lonely-0"],
         "test_peers_that_never_come_end_in_one_line[rank1-connects]": ["lonely-1"],
         "test_a_store_port_in_use_is_one_line": ["port-in-use"]}


@pytest.fixture(scope="module")
def runs(request):
    """This file's runs that start ranks (check_runs.py), started together as the first of
    their tests begins: three of them mostly wait (for a peer, a timeout), the first
    line's pair one after the other as before; each test reads its run's outcome."""
    base = dict(os.environ)             # read here, not by the runs' threads
    t = {"first-line": partial(_first_line_then_peer, base),
         "lonely-0": partial(_lonely, 0, base), "lonely-1": partial(_lonely, 1, base),
         "port-in-use": partial(_store_port_in_use, base)}
    yield from module_runs(request, t, NEEDS if importlib.util.find_spec("torch") else {})


def test_the_first_line_comes_before_the_wait_and_the_peer_then_completes_the_run(runs):
    """Rank 0 with a leftover-like environment says what it is on its first stderr line while
    it waits: only after that line is read is rank 1 started, and the two then run."""
    got = runs["first-line"]
    port, first, r1, out, err = got["port"], got["first"], got["r1"], got["out"], got["err"]
    assert first.startswith(
        f"ncclpy check: running as rank 0 of 2 of a launched job: RANK=0 WORLD_SIZE=2 "
        f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} set, by no launcher ncclpy knows"), first
    assert f"waiting up to 120 s for the other rank (RANK=1) at 127.0.0.1:{port}" in first
    assert UNSET in first
    assert got["rc"] == 0, out + err                   # rank 0
    assert r1.returncode == 0, r1.stdout + r1.stderr
    assert " 0 failed" in out and " cases on 2 ranks (gloo)" in out, out
    assert r1.stderr.startswith("ncclpy check: running as rank 1 of 2 of a launched job: RANK=1")


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0-hosts-the-store", "rank1-connects"])
def test_peers_that_never_come_end_in_one_line(rank, runs):
    got = runs[f"lonely-{rank}"]
    port, p = got["port"], got["p"]
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == ""
    _no_traceback(p)
    lines = p.stderr.splitlines()
    assert len(lines) == 2, p.stderr
    assert lines[0].startswith(f"ncclpy check: running as rank {rank} of 2 of a launched job")
    other = 1 - rank
    assert lines[1].startswith(
        f"ncclpy check: rank {rank} of 2 did not meet the other rank (RANK={other}) at "
        f"127.0.0.1:{port} (--timeout 2 s; Dist"), lines[1]
    assert f"start the other rank (RANK={other}) with WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 " \
           f"MASTER_PORT={port}, or {UNSET}" in lines[1]


def test_no_store_address_is_refused_before_anything_waits():
    p = _check(_env(RANK="0", WORLD_SIZE="1"), *ONE_CASE)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == ""
    _no_traceback(p)
    lines = p.stderr.splitlines()
    assert lines == [
        "ncclpy check: running as rank 0 of 1 of a launched job: RANK=0 WORLD_SIZE=1 set, by "
        "no launcher ncclpy knows (left over from another job?) (" + UNSET + " ranks)",
        "ncclpy check: error: MASTER_ADDR and MASTER_PORT are not set: rank 0 of 1 still "
        "needs torch's store at MASTER_ADDR:MASTER_PORT; set MASTER_ADDR and "
        "MASTER_PORT, or " + UNSET + " ranks"], p.stderr


@pytest.mark.parametrize("launch, want", [
    ({"RANK": "x", "WORLD_SIZE": "2"},
     "RANK='x' in the environment is not a rank of WORLD_SIZE=2; expected an integer in 0..1"),
    ({"RANK": "2", "WORLD_SIZE": "2"},
     "RANK='2' in the environment is not a rank of WORLD_SIZE=2; expected an integer in 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "0"},
     "WORLD_SIZE='0' in the environment is not a number of ranks; expected an integer >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
     "MASTER_PORT='99999' in the environment is not a port; expected an integer in 1..65535"),
], ids=["rank-not-int", "rank-too-big", "world-0", "port-99999"])
def test_a_malformed_variable_is_one_error_line(launch, want):
    p = _check(_env(**launch), *ONE_CASE)
    assert p.returncode == 2, p.stdout + p.stderr
    _no_traceback(p)
    err = p.stderr.splitlines()[-1]
    assert err.startswith(f"ncclpy check: error: {want}"), p.stderr
    assert UNSET in err
    assert len(p.stderr.splitlines()) <= 2, p.stderr      # the announcement, then the error


def test_a_store_port_in_use_is_one_line(runs):
    got = runs["port-in-use"]                  # _store_port_in_use: a socket listens there
    port, p = got["port"], got["p"]
    assert p.returncode == 2, p.stdout + p.stderr
    _no_traceback(p)
    lines = p.stderr.splitlines()
    assert len(lines) == 2, p.stderr
    assert lines[1].startswith(f"ncclpy check: rank 0 of 2 could not open torch's store at "
                               f"127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT): the port is in use")
    assert "set another MASTER_PORT on every rank" in lines[1]


def test_the_launcher_is_named_from_its_own_variables():
    base = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    assert from_env({"RANK": "0"}) is None and from_env({}) is None
    assert from_env(dict(base, NCCLPY_RANK="1")).launcher == "ncclpy run"
    assert from_env(dict(base, TORCHELASTIC_RUN_ID="x")).launcher == "torchrun"
    job = from_env(base)
    assert (job.rank, job.world_size, job.launcher) == (1, 3, "")
    line = announce(from_env(dict(base, NCCLPY_RANK="1")), 30)
    assert line == ("ncclpy check: running as rank 1 of 3 under ncclpy run (RANK=1 WORLD_SIZE=3 "
                    "MASTER_ADDR=h MASTER_PORT=5); waiting up to 30 s for the other 2 ranks "
                    "(RANK=0, 2) at h:5")
    assert rendezvous_failure(ZeroDivisionError("x"), 0, 2, 5, job.to_cfg()) is None
