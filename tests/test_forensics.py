"""Hang forensics end to end on CPU (issue 23): real ``ncclpy run`` jobs of three processes, the
launcher's real store, ncclpy's real call path, flight recorder, watchdog, dumps,
``ncclpy trace`` and ``ncclpy status`` -- on ncclpy's CPU backend (``ncclpy.init(device="cpu")``:
an operation completes when every rank made the same one, its data through shared memory).
tests/gpu/test_forensics_gpu.py runs the same scenarios on real NCCL.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from forensics_util import (cli, dumps_named, findings, line_of, run_job, start_job,
                            trace)
from sigint_util import popen_kwargs

pytestmark = pytest.mark.timeout(180)
FAST = {"NCCLPY_TIMEOUT": "3", "JOB_IDLE": "40"}


def _site(marker: str) -> str:
    return f"forensics_job.py:{line_of(marker)}:play"


def test_a_skipped_collective_names_the_rank_and_the_lines(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("skip", d, FAST)
    assert rc == 1, err
    named = dumps_named(err)          # the aborted ranks' errors name their dump
    assert named and all(os.path.exists(p) for p in named), err
    assert "where every rank is (ncclpy status)" in err, err
    assert f"flight-recorder dump(s) in {d}; see what went wrong: ncclpy trace {d}" in err
    code, doc, text = trace(d)
    assert code == 1 and not doc["ok"]
    first = findings(doc)[0]
    assert first["kind"] == "never_issued" and first["ranks"] == [2], first
    body = "\n".join(first["text"])
    assert "never by rank(s) 2" in body and "rank 0 issued it at" in body
    assert _site("third") in body and _site("second") in body, body
    assert text.splitlines()[0] == "ncclpy trace: PROBLEMS FOUND on 1 of 1 communicator"
    assert "  1. collective #2 (all_reduce count=8 dtype=float32" in text, text


def test_a_send_without_its_recv_is_an_unmatched_pair(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("unmatched", d, FAST)
    assert rc == 70, err                               # ncclpy.comm.teardown.STUCK_EXIT
    # the pair's first send connects on the host and never returns (as on a GPU): the
    # watchdog times the blocked launch itself; NCCL cannot end a blocking communicator's
    # call safely (ncclCommAbort would free the communicator under it), so the abort waits,
    # and the process exits once the call stayed stuck a timeout more: the job stops
    assert ("send (sequence 2) was still blocked inside its NCCL call on the host" in err
            and "suspected: rank(s) 1, which never issued it" in err), err   # its peer only
    assert "the abort waits until that call returns" in err, err
    assert "still stuck inside NCCL" in err and "exits with status 70" in err, err
    code, doc, _ = trace(d)
    assert code == 1
    p2p = [f for f in findings(doc) if f["kind"] == "unmatched_p2p"]
    assert p2p and p2p[0]["ranks"] == [0], findings(doc)
    assert any("rank 0: send #0 to rank 1 (8xfloat32, at" in t and _site("lonely-send") in t
               and "has no matching recv on rank 1" in t for t in p2p[0]["text"]), p2p


def test_a_stopped_rank_is_named_and_its_missing_dump_said(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("stop", d, FAST)
    assert rc == 1, err
    assert "suspected: rank(s) 2" in err, err          # the watchdog's verdict
    code, doc, _ = trace(d)
    fs = {f["kind"]: f for f in findings(doc)}
    assert code == 1 and fs["missing_dump"]["ranks"] == [2], fs
    assert fs["not_completed"]["ranks"] == [0, 1], fs
    assert "collective #2" in fs["not_completed"]["text"][0]


def test_status_shows_the_laggard_while_the_job_hangs_and_sigusr1_dumps(tmp_path):
    d = str(tmp_path / "dumps")
    p = start_job("skip", d, {"NCCLPY_TIMEOUT": "120", "JOB_IDLE": "120"})
    try:
        rows = None
        for _ in range(120):
            time.sleep(0.25)
            st = cli("status", "--job", str(p.pid), "--json")
            if st.returncode != 0:
                continue
            comms = json.loads(st.stdout)["communicators"]
            if comms and [r["issued"] for r in comms[0]["ranks"]] == [3, 3, 2]:
                rows = comms[0]["ranks"]
                break
        assert rows is not None, (st.stdout, st.stderr)
        text = cli("status", "--job", str(p.pid)).stdout.splitlines()
        assert text[0].startswith("communicator 'job' (3 ranks; laggards first")
        first = text[2].split()
        assert first[:3] == ["2", "2", "2"] and _site("second") in text[2], text
        assert text[3].split()[:3] in (["0", "3", "2"], ["1", "3", "2"]), text
        p.send_signal(signal.SIGUSR1)               # the table on stderr, and every dump
        end = time.monotonic() + 60                 # a deadline for a hang
        while time.monotonic() < end and not (os.path.isdir(d) and len(os.listdir(d)) == 3):
            time.sleep(0.1)
        assert sorted(f[-11:] for f in os.listdir(d)) == [f"rank{r}.jsonl" for r in range(3)]
        code, doc, _ = trace(d)
        assert code == 1 and findings(doc)[0]["ranks"] == [2]
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert "ncclpy run: received SIGUSR1; where every rank is (ncclpy status):" in err, err
    assert f"asked rank(s) 0, 1, 2 for their flight-recorder dumps, in {d}" in err


def test_status_watch_ends_quietly_on_ctrl_c(tmp_path):
    import subprocess
    import sys
    from forensics_util import ROOT
    from ncclpy.store import StoreServer
    srv = StoreServer("127.0.0.1", 0, token="t0k").start()
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, NCCLPY_STORE_TOKEN="t0k", PYTHONUNBUFFERED="1")
        q = subprocess.Popen([sys.executable, "-m", "ncclpy", "status", "--master-port",
                              str(srv.port), "--watch", "0.2"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kwargs())
        seen = []                                   # two frames shown: then Ctrl-C
        while sum(x.startswith("--- ") for x in seen) < 2:
            line = q.stdout.readline()
            assert line, (seen, q.stderr.read())
            seen.append(line)
        q.send_signal(signal.SIGINT)
        out, err = q.communicate(timeout=60)
    finally:
        srv.close()
    out = "".join(seen) + out
    assert q.returncode == 0 and err == "", err
    assert out.count("--- ") >= 2 and "no communicator has registered" in out


@pytest.mark.parametrize("args,env,expect", [
    (["status", "--master-port", "70000"], {}, "--master-port: expected a port 1..65535, got "
                                               "70000"),
    (["status", "--watch", "x"], {}, "--watch: expected seconds between 0.1 and 86400"),
    (["status", "--job", "1"], {}, "--job 1: no running ncclpy run with that pid"),
    (["trace"], {}, "the following arguments are required: DIR"),
    (["trace", "/nonexistent/dumps"], {}, "/nonexistent/dumps: no such file or directory"),
    (["trace", "--last", "-1", "x"], {}, "--last: expected a number of calls >= 0, got -1"),
])
def test_a_user_mistake_in_the_new_clis_is_one_line(args, env, expect):
    r = cli(*args, env=env)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and expect in r.stderr, r.stderr


def test_status_of_a_closed_port_or_with_a_wrong_token_is_one_line(tmp_path):
    from ncclpy.rendezvous import free_port
    from ncclpy.store import StoreServer
    port = free_port()
    r = cli("status", "--master-port", str(port))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"cannot reach the job's store at 127.0.0.1:{port} (from --master-port)" in r.stderr
    srv = StoreServer("127.0.0.1", 0, token="right").start()
    try:
        r = cli("status", "--master-port", str(srv.port), env={"NCCLPY_STORE_TOKEN": "wrong"})
    finally:
        srv.close()
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "refused the token" in r.stderr and "wrong token" in r.stderr


def test_trace_of_a_directory_without_dumps_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    r = cli("trace", str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "no flight-recorder dump (ncclpy-trace-*.jsonl) found" in r.stderr
    bad = tmp_path / "ncclpy-trace-x-1-rank0.jsonl"
    bad.write_text("{not json\n")
    r = cli("trace", str(tmp_path))
    assert r.returncode == 2 and "no readable flight-recorder dump" in r.stderr, r.stderr


def test_run_timeout_prints_the_table_and_collects_every_dump(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("skip", d, {"NCCLPY_TIMEOUT": "60", "JOB_IDLE": "60"},
                         run_args=("--timeout", "8"))
    assert rc == 124, err
    assert "ncclpy run: --timeout 8 s passed; where every rank is (ncclpy status):" in err, err
    assert f"3 flight-recorder dump(s) in {d}" in err, err
    code, doc, _ = trace(d)
    assert code == 1 and findings(doc)[0]["ranks"] == [2]


def test_checked_mode_compares_the_configs_before_nccl_is_called():
    import types
    from ncclpy._nccl.config import Config
    from ncclpy.comm import Communicator
    from ncclpy.errors import EnvironmentMismatchError
    from ncclpy.store import StoreServer, TCPStore
    from nccl_standin import run_ranks, standin
    srv = StoreServer("127.0.0.1", 0).start()
    try:
        def body(r: int, n: int) -> str:
            bs = types.SimpleNamespace(world_size=n, rank=r, uid=bytes(range(128)), device=r,
                                       name="cfg", generation=0,
                                       store=TCPStore("127.0.0.1", srv.port, timeout=10))
            cfg = Config(blocking=True, cga_cluster_size=2) if r == 1 else None
            with pytest.raises(EnvironmentMismatchError) as ei:
                Communicator.from_bootstrap(bs, cfg, checked=True, watchdog=False)
            return str(ei.value)
        with standin() as eng:
            msgs = run_ranks(2, body, 2)
    finally:
        srv.close()
    assert not [c for c in eng.calls if "Init" in c[0]], eng.calls      # NCCL never called
    for m in msgs:
        assert "the ranks differ in what changes NCCL's behaviour (1):" in m, m
        assert "config: rank 0: (unset); rank 1: " in m and "cga_cluster_size" in m, m


def test_status_says_which_rank_is_blocked_inside_a_send_and_where(tmp_path):
    """A send whose recv never comes blocks inside its NCCL launch (the pair connects there): the
    table run by ``ncclpy run --timeout`` shows rank 0's send as BLOCKED, with its line."""
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("unmatched", d, {"NCCLPY_TIMEOUT": "60", "JOB_IDLE": "60"},
                         run_args=("--timeout", "8"))
    assert rc == 124, err
    row = next((ln for ln in err.splitlines() if ln.split()[:1] == ["0"]), "")
    issued, done, waiting = row.split()[1:4]
    assert (issued, done) == ("2", "2") and float(waiting.rstrip("s")) > 1.0, row
    assert "  #2 send BLOCKED inside NCCL on the host at " in row, err
    assert row.endswith("/" + _site("lonely-send")), row
