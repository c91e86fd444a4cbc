"""Hang forensics on real NCCL (issue 23): the scenarios of tests/test_forensics.py -- a rank that
skips a collective, a send without its recv, a SIGSTOPped rank, ``ncclpy status`` while the job
hangs -- as 3-rank ``ncclpy run`` jobs on one GPU (tests/forensics_job.py --real), with
``ncclpy trace`` naming the rank and the line of the program.  Each test is bounded well below
the device tool's 10 minutes: the job's own watchdog timeout (10 s), then the subprocess
timeout (150 s), then the test's mark (240 s)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from forensics_util import cli, findings, line_of, run_job, start_job, trace
from gpu_util import cuda_reason

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_world(3), pytest.mark.timeout(240),
              pytest.mark.skipif(bool(cuda_reason()), reason=cuda_reason() or "CUDA present")]
HANG = {"NCCLPY_TIMEOUT": "10", "JOB_IDLE": "90"}


def _site(marker: str) -> str:
    return f"forensics_job.py:{line_of(marker)}:play"


def test_gpu_a_skipped_collective_names_rank_2_and_the_lines(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("skip", d, HANG, real=True, timeout=150)
    assert rc != 0, err
    code, doc, _ = trace(d)
    first = findings(doc)[0]
    assert code == 1 and first["kind"] == "never_issued" and first["ranks"] == [2], doc
    body = "\n".join(first["text"])
    assert _site("third") in body and _site("second") in body, body


def test_gpu_a_send_without_its_recv_is_unmatched(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("unmatched", d, HANG, real=True, timeout=150)
    assert rc != 0, err
    # NCCL connects the pair inside the send's launch: the watchdog times that blocked call;
    # ncclCommAbort would free the communicator under it, so the abort waits for the call
    # (then the rank exits with ncclpy.comm.teardown.STUCK_EXIT if it stays stuck)
    assert "send (sequence 2) was still blocked inside its NCCL call on the host" in err, err
    assert "the abort waits until that call returns" in err, err
    code, doc, _ = trace(d)
    p2p = [f for f in findings(doc) if f["kind"] == "unmatched_p2p"]
    assert code == 1 and p2p and p2p[0]["ranks"] == [0], doc
    assert any(_site("lonely-send") in t for t in p2p[0]["text"]), p2p


def test_gpu_status_says_the_send_is_blocked_inside_nccl(tmp_path):
    """The same send, the watchdog's timeout out of reach (120 s): ``ncclpy run --timeout 40``
    prints the table, where rank 0's send is BLOCKED inside NCCL at the send's line."""
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("unmatched", d, {"NCCLPY_TIMEOUT": "120", "JOB_IDLE": "120"},
                         real=True, timeout=150, run_args=("--timeout", "40"))
    assert rc == 124, err
    row = next((ln for ln in err.splitlines() if ln.split()[:1] == ["0"]), "")
    assert "  #2 send BLOCKED inside NCCL on the host at " in row, err
    assert row.endswith("/" + _site("lonely-send")), row


def test_gpu_a_stopped_rank_is_suspected_and_its_dump_missing(tmp_path):
    d = str(tmp_path / "dumps")
    rc, _, err = run_job("stop", d, HANG, real=True, timeout=150)
    assert rc != 0 and "suspected: rank(s) 2" in err, err
    code, doc, _ = trace(d)
    kinds = {f["kind"]: f["ranks"] for f in findings(doc)}
    assert code == 1 and kinds.get("missing_dump") == [2], doc


def test_gpu_status_shows_the_laggard_while_the_job_hangs(tmp_path):
    d = str(tmp_path / "dumps")
    p = start_job("skip", d, {"NCCLPY_TIMEOUT": "120", "JOB_IDLE": "120"}, real=True)
    try:
        issued = None
        for _ in range(240):
            time.sleep(0.25)
            st = cli("status", "--job", str(p.pid), "--json")
            if st.returncode == 0:
                comms = json.loads(st.stdout)["communicators"]
                if comms and [r["issued"] for r in comms[0]["ranks"]] == [3, 3, 2]:
                    issued = comms[0]["ranks"]
                    break
        assert issued is not None, (st.stdout, st.stderr)
        first = cli("status", "--job", str(p.pid)).stdout.splitlines()[2].split()
        assert first[:3] == ["2", "2", "2"], first
        p.send_signal(signal.SIGUSR1)
        for _ in range(100):
            time.sleep(0.1)
            if os.path.isdir(d) and len(os.listdir(d)) == 3:
                break
        code, doc, _ = trace(d)
        assert code == 1 and findings(doc)[0]["ranks"] == [2], doc
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
