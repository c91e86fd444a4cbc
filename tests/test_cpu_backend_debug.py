"""ncclpy's debugging tools on the CPU backend, as on a GPU (issue 39): real processes
(``ncclpy run -n 2`` and ``ncclpy.spawn``) on ``ncclpy.init(device="cpu")``, the launcher's
real store, real data through shared memory.  Three hangs (tests/cpu_debug_job.py): a skipped
collective, a send without its recv, a collective whose count differs between the ranks.  For
each: the watchdog's verdict (the call, the suspected ranks), checked mode, the flight
recorder's dumps and ``ncclpy trace``, and ``ncclpy status`` (the launcher's table when a rank
fails; live, for a job that hangs).  NCCLPY_TIMEOUT=3 ends each job in seconds; nothing waits
for a fixed time: the tests wait for processes, files and status rows, each under a deadline.

The seven jobs are independent and mostly wait (for NCCLPY_TIMEOUT, the grace, a status row):
:func:`jobs` runs them three at a time, each ``ncclpy run`` with its ``ncclpy trace``, and each
test checks its own.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from forensics_util import ROOT, cli, dumps_named, findings, trace

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("cpu_backend_debug")]

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "cpu_debug_job.py")
SECTION = "where every rank is (ncclpy status):"


def _site(marker: str) -> str:
    """``cpu_debug_job.py:<line>:play`` of the line marked ``# CALL <marker>``."""
    with open(JOB) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# CALL {marker}"):
                return f"cpu_debug_job.py:{i}:play"
    raise AssertionError(f"no '# CALL {marker}' in {JOB}")


def _at(marker: str) -> str:
    """How a call site of the job ends: ``/cpu_debug_job.py:<line>:play``."""
    return "/" + _site(marker)


def _env(trace_dir: str, checked: bool, timeout: int) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), NCCLPY_TRACE_DIR=trace_dir,
        NCCLPY_TIMEOUT=str(timeout), JOB_IDLE="60", NCCLPY_MPS="off")
    for k in ("NCCLPY_STORE_TOKEN", "NCCLPY_MASTER_PORT", "MASTER_PORT", "NCCLPY_CHECKED",
              "NCCLPY_WATCHDOG", "NCCLPY_TRACE_BUFFER", "NCCLPY_TRACE_SIGNAL"):
        env.pop(k, None)
    if checked:
        env["NCCLPY_CHECKED"] = "1"
    return env


def _run(scenario: str, tmp_path, checked: bool = False) -> Tuple[int, str, str]:
    """``ncclpy run -n 2 cpu_debug_job.py SCENARIO`` to its end: (exit code, stderr, dumps)."""
    d = str(tmp_path / "dumps")
    cmd = [sys.executable, "-m", "ncclpy", "run", "-n", "2", "--grace", "2", JOB, scenario]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=_env(d, checked, 3), capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert time.monotonic() - t0 < 60, p.stderr       # the hang ended in seconds
    return p.returncode, p.stderr, d


#: the jobs of this file: (scenario, checked mode) -> whether its test reads ``ncclpy trace``
_JOBS = {("skip", False): True, ("skip", True): True, ("unpaired", False): True,
         ("unpaired", True): True, ("mismatch", False): True, ("mismatch", True): False}


def _job(scenario: str, checked: bool, traced: bool, tmp) -> Tuple[int, str, str, Any]:
    """:func:`_run`, then (if ``traced``) ``ncclpy trace`` of its dumps: (exit code, stderr,
    dumps, trace's (exit code, JSON, text) or None)."""
    rc, err, d = _run(scenario, tmp, checked)
    return rc, err, d, (trace(d) if traced else None)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Iterator[Dict[Any, Future]]:
    """Every job of this file (the spawned job's status first, then the ``ncclpy run`` ones),
    three at a time (see the module docstring); a test waits for its own (whose errors it
    raises)."""
    tmps = {k: tmp_path_factory.mktemp(f"{k[0]}-{'checked' if k[1] else 'plain'}")
            for k in _JOBS}
    status = tmp_path_factory.mktemp("status")
    with ThreadPoolExecutor(3) as pool:
        out: Dict[Any, Future] = {"status": pool.submit(_live_status, status)}
        out.update({k: pool.submit(_job, *k, traced, tmps[k]) for k, traced in _JOBS.items()})
        yield out


def _table(err: str) -> List[Tuple[int, int, int, str]]:
    """The launcher's status table: (rank, issued, done, the rest of the row), in its order
    (laggards first)."""
    assert SECTION in err, err
    rows = []
    for line in err.split(SECTION, 1)[1].splitlines()[3:]:
        m = re.match(r"\s+(\d+)\s+(\d+)\s+(\d+)\s+(.*)$", line)
        if m is None:
            break
        rows.append((int(m[1]), int(m[2]), int(m[3]), m[4]))
    return rows


def _both_dumps(d: str, err: str) -> None:
    """Both ranks dumped: the failing one itself, the other on the launcher's signal."""
    names = sorted(f[-11:] for f in os.listdir(d) if f.endswith(".jsonl"))
    assert names == ["rank0.jsonl", "rank1.jsonl"], (names, err)
    assert f"2 flight-recorder dump(s) in {d}; see what went wrong: ncclpy trace {d}" in err


# ------------------------------------------------------------------ (a) a skipped collective
def test_a_skipped_collective_the_watchdog_names_rank_1_and_trace_the_call(jobs):
    rc, err, d, traced = jobs[("skip", False)].result()
    assert rc == 1, err
    assert ("[rank 0] ncclpy watchdog: communicator 'job' rank 0/2: all_reduce (sequence 1) "
            "did not complete within the communicator's timeout of 3 s; suspected: rank(s) 1, "
            "which never issued it (rank 1 issued 1 calls); the communicator was aborted "
            "(ncclCommAbort)") in err, err
    named = dumps_named(err)
    assert len(named) == 1 and named[0].endswith("rank0.jsonl") and os.path.exists(named[0])
    rows = _table(err)                                 # the laggard first
    assert [r[:3] for r in rows] == [(1, 1, 1), (0, 2, 1)], err
    assert "#0 all_reduce at " in rows[0][3] and rows[0][3].endswith(_at("first")), rows
    assert "aborted  #1 all_reduce at " in rows[1][3] and rows[1][3].endswith(_at("skipped"))
    assert ("rank 0 aborted: timeout: all_reduce (sequence 1) did not complete within the "
            "communicator's timeout of 3 s (suspected: rank(s) 1)") in err
    _both_dumps(d, err)
    code, doc, text = traced
    assert code == 1 and text.startswith("ncclpy trace: PROBLEMS FOUND on 1 of 1 communicator")
    first = findings(doc)[0]
    assert first["kind"] == "never_issued" and first["ranks"] == [1], first
    body = "\n".join(first["text"])
    assert ("collective #1 (all_reduce count=8 dtype=float32 op=SUM in_place=True) was issued "
            "by rank(s) 0 but never by rank(s) 1") in body, body
    assert re.search(rf"rank 0 issued it at \S+{re.escape(_at('skipped'))} \(issued\)", body)
    assert "rank 1 never issued it; its last call: #0 all_reduce" in body
    assert body.endswith(_at("first")), body


def test_a_skipped_collective_in_checked_mode_names_the_rank_that_never_arrived(jobs):
    rc, err, d, traced = jobs[("skip", True)].result()
    assert rc == 1, err
    assert ("[rank 0] ncclpy.errors.CallCheckTimeout: checked mode: rank 0 timed out after 3 s "
            "waiting for every rank to compare on communicator 'job' (check 1, sequence 1); "
            "rank(s) 1 never arrived") in err, err
    assert "nothing of this round was given to NCCL" in err
    assert "ncclpy watchdog:" not in err               # checked mode caught it first
    assert "flight recorder of 'job' rank 0: checked mode timeout; dump written" in err
    rows = {r[0]: r for r in _table(err)}
    # the refused call never reached NCCL: rank 0's row names the last call it issued
    assert rows[0][1:3] == (1, 1) and rows[0][3].endswith(_at("first")), rows
    _both_dumps(d, err)
    code, doc, _ = traced
    first = findings(doc)[0]
    assert code == 1 and first["kind"] == "never_issued" and first["ranks"] == [1], first
    assert any(re.search(rf"rank 0 issued it at \S+{re.escape(_at('skipped'))} \(failed\)", t)
               for t in first["text"]), first


# ------------------------------------------------------------------ (b) a send without its recv
def test_an_unpaired_send_blocks_inside_nccl_and_every_tool_names_it(jobs):
    rc, err, d, traced = jobs[("unpaired", False)].result()
    # the pair's first send connects it on the host, inside the launch (as NCCL does): the
    # watchdog times the blocked launch, the abort waits for it, the rank exits with 70
    assert rc == 70, err
    assert ("rank 0/2: send (sequence 1) was still blocked inside its NCCL call on the host "
            "(the launch never returned: a peer never made the matching call, e.g. a "
            "send/recv's first use, which connects the pair) after the communicator's timeout "
            "of 3 s; suspected: rank(s) 1, which never issued it") in err, err
    assert "the abort waits until that call returns" in err
    assert "the process exits with status 70 so that the job stops" in err
    rows = _table(err)
    assert [r[:3] for r in rows] == [(1, 1, 1), (0, 1, 1)], err
    assert "#1 send BLOCKED inside NCCL on the host at " in rows[1][3], rows
    assert rows[1][3].endswith(_at("unpaired-send")), rows
    _both_dumps(d, err)
    code, doc, _ = traced
    p2p = [f for f in findings(doc) if f["kind"] == "unmatched_p2p"]
    assert code == 1 and p2p and p2p[0]["ranks"] == [0], findings(doc)
    assert any("rank 0: send #0 to rank 1 (8xfloat32, at " in t and _at("unpaired-send") in t
               and "has no matching recv on rank 1" in t for t in p2p[0]["text"]), p2p


def test_an_unpaired_send_in_checked_mode_says_what_the_peer_posted(jobs):
    rc, err, d, traced = jobs[("unpaired", True)].result()
    assert rc == 1, err
    assert ("[rank 0] ncclpy.errors.CallCheckTimeout: checked mode: send/recv on communicator "
            "'job' do not pair up (rank 0); nothing of this round was given to NCCL") in err, err
    assert ("- rank 0: send #0 to rank 1 (8xfloat32) was not met by rank 1's recv #0 within 3 "
            "s; rank 1 posted nothing for rank 0") in err, err
    assert "BLOCKED" not in err and "ncclpy watchdog:" not in err   # never reached NCCL
    _both_dumps(d, err)
    code, doc, _ = traced
    p2p = [f for f in findings(doc) if f["kind"] == "unmatched_p2p"]
    assert code == 1 and p2p and p2p[0]["ranks"] == [0], findings(doc)
    assert any("has no matching recv on rank 1" in t for t in p2p[0]["text"]), p2p


# ------------------------------------------------------------ (c) a collective of another count
def test_a_mismatched_count_waits_as_nccl_would_and_trace_marks_the_count(jobs):
    rc, err, d, traced = jobs[("mismatch", False)].result()
    assert rc == 1, err
    assert "they do not match, and wait (NCCL would hang" in err, err    # the engine says so
    said = re.findall(r"CPU backend: collective #\d+ on this communicator is (ncclAllReduce\("
                      r"float32, count \d+, op sum\)) on rank (\d), (ncclAllReduce\(float32, "
                      r"count \d+, op sum\)) on rank (\d)", err)
    assert said and said[0][0] != said[0][2], err     # in words: the counts differ
    verdicts = re.findall(r"\[rank (\d)\] ncclpy watchdog: communicator 'job' rank \d/2: "
                          r"(.*)", err)
    assert verdicts, err                # every peer issued it: nobody is behind
    assert any(v.startswith("all_reduce (sequence 1) did not complete within the "
                            "communicator's timeout of 3 s; suspected: every peer (%d): all "
                            "issued it, none is known dead" % (1 - int(r)))
               for r, v in verdicts), verdicts
    rows = _table(err)
    assert sorted(r[:3] for r in rows) == [(0, 2, 1), (1, 2, 1)], err
    assert all("#1 all_reduce at " in r[3] and r[3].endswith(_at("mismatched"))
               for r in rows), rows
    _both_dumps(d, err)
    code, doc, text = traced
    first = findings(doc)[0]
    assert code == 1 and first["kind"] == "differs" and first["ranks"] == [1], first
    assert "collective #1: the ranks' calls differ (in count); compared with rank 0's:" in text
    assert re.search(r"rank +1 +#1 all_reduce \*count=4\* dtype=float32", text), text


def test_a_mismatched_count_in_checked_mode_is_refused_on_both_ranks(jobs):
    rc, err, _d, _ = jobs[("mismatch", True)].result()
    assert rc == 1, err
    for r in (0, 1):
        assert (f"[rank {r}] ncclpy.errors.CallMismatchError: checked mode: the ranks' calls "
                f"on communicator 'job' do not match (check 1); nothing of this round was "
                f"given to NCCL") in err, err
        assert re.search(rf"\[rank {r}\] .*\*count=4\*", err), err
    assert "they do not match, and wait" not in err    # NCCL (the engine) never saw it
    assert "ncclpy watchdog:" not in err


# ------------------------------------------------------- ncclpy status of a live, spawned job
def test_status_of_a_live_spawned_job_shows_the_laggard_and_a_signal_dumps(jobs):
    jobs["status"].result()


def _live_status(tmp_path) -> None:
    """The spawned job's status table, then its dumps on SIGUSR1 (asserted as it goes)."""
    import ncclpy
    import cpu_debug_job
    d = str(tmp_path / "dumps")
    env = {"NCCLPY_TRACE_DIR": d, "NCCLPY_TIMEOUT": "120", "JOB_IDLE": "120",
           "NCCLPY_MPS": "off"}
    ctx = ncclpy.spawn(cpu_debug_job.spawned, 2, args=("skip",), join=False, env=env)
    try:
        port, token = ctx.envs[0]["NCCLPY_MASTER_PORT"], ctx.envs[0]["NCCLPY_STORE_TOKEN"]
        look = {"NCCLPY_STORE_TOKEN": token}
        rows, end = None, time.monotonic() + 60          # a deadline for a hang
        while rows is None and time.monotonic() < end:
            st = cli("status", "--master-port", port, "--json", env=look)
            comms = json.loads(st.stdout)["communicators"] if st.returncode == 0 else []
            got = {r["rank"]: r for r in comms[0]["ranks"]} if comms else {}
            if {r: (g["issued"], g["done"]) for r, g in got.items()} == {0: (2, 1), 1: (1, 1)}:
                rows = got
            else:
                time.sleep(0.1)
        assert rows is not None, (st.stdout, st.stderr)
        assert rows[0]["site"].endswith(_at("skipped")), rows
        text = cli("status", "--master-port", port, env=look).stdout.splitlines()
        assert text[0].startswith("communicator 'job' (2 ranks; laggards first; most calls "
                                  "issued: 2)"), text
        first, second = text[2].split(), text[3].split()
        assert first[:4] == ["1", "1", "1", "-"] and text[2].endswith(_at("first")), text
        assert second[:3] == ["0", "2", "1"] and text[3].endswith(_at("skipped")), text
        for pid in ctx.pids():                           # NCCLPY_TRACE_SIGNAL's default
            os.kill(pid, signal.SIGUSR1)
        end = time.monotonic() + 60
        while time.monotonic() < end and not (
                os.path.isdir(d) and len([f for f in os.listdir(d) if f.endswith(".jsonl")]) == 2):
            time.sleep(0.05)
        code, doc, _ = trace(d)
        first_finding = findings(doc)[0]
        assert code == 1 and first_finding["kind"] == "never_issued", first_finding
        assert first_finding["ranks"] == [1], first_finding
    finally:
        ctx.stop(grace=2)
