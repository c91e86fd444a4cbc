"""``ncclpy trace`` on real dumps (written by the flight recorder of communicators on the
stand-in for libnccl, tests/nccl_standin.py), read by the real command in a subprocess:
``--last 0`` shows no call, a dump of a schema this ncclpy does not read is refused in one line
(exit status 2), and what a rank did past the end of its cut-short dump is unknown, never
"not issued" (issue 38, item 7)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest

from ncclpy.comm import Communicator
from ncclpy.debug import recorder as R
from nccl_standin import DevArray, run_ranks, standin

ROOT = Path(__file__).resolve().parents[1]
UID = bytes(range(128))
pytestmark = pytest.mark.timeout(120)


def _play(r: int, n: int, d: str, waited: int, extra: List[int]) -> str:
    """``waited`` all_reduces on every rank, then one more (not waited) on the ranks in
    ``extra``; the dump of rank ``r``."""
    c = Communicator(n, r, UID, r)
    x = DevArray(np.ones(4, np.float32), device=r)
    for _ in range(waited):
        c.all_reduce(x).wait()
    if r in extra:
        c.all_reduce(x)                                   # left unfinished
    p = c.dump_trace(d)
    if extra:
        c.abort()
    else:
        c.close()
    return p


def _dumps(tmp_path: Path, n: int, waited: int, extra: List[int] = ()) -> List[str]:
    with standin() as eng:
        paths = run_ranks(n, _play, n, str(tmp_path) + "/", waited, list(extra))
    assert eng.violations == []
    return paths


def _trace(*args: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "ncclpy", "trace", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=90)


def test_last_0_shows_no_call_and_last_1_one_per_rank(tmp_path):
    _dumps(tmp_path, 2, 3)
    p = _trace(str(tmp_path), "--last", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("ncclpy trace: no problem found"), p.stdout
    assert "timeline of" not in p.stdout and "all_reduce" not in p.stdout, p.stdout
    j = _trace(str(tmp_path), "--last", "0", "--json")
    assert j.returncode == 0, j.stderr
    assert json.loads(j.stdout)["communicators"][0]["timeline"] == {"0": [], "1": []}
    one = _trace(str(tmp_path), "--last", "1")
    assert one.returncode == 0, one.stdout + one.stderr
    rows = [ln.strip() for ln in one.stdout.splitlines() if "all_reduce" in ln]
    assert len(rows) == 2 and all(r.startswith("#2 ") for r in rows), one.stdout


def test_a_dump_of_an_unknown_schema_is_refused_in_one_line(tmp_path):
    paths = _dumps(tmp_path, 2, 2)
    lines = Path(paths[1]).read_text().splitlines()
    head = json.loads(lines[0])
    assert head["schema"] == R.SCHEMA == "ncclpy-trace/1"
    head["schema"] = "ncclpy-trace/2"
    Path(paths[1]).write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    p = _trace(str(tmp_path))
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"ncclpy trace: error: {paths[1]}: "), p.stderr
    assert "'ncclpy-trace/2'" in p.stderr and "'ncclpy-trace/1'" in p.stderr, p.stderr
    assert "PROBLEMS FOUND" not in p.stderr


def test_calls_past_the_end_of_a_cut_short_dump_are_unknown_not_never_issued(tmp_path):
    """3 ranks, 2 all_reduces everywhere, then a third on rank 0 only: rank 2 (whole dump)
    never issued #2; rank 1's dump is cut short after its first call (mid-line), so whether
    it issued #1 and #2 is unknown."""
    paths = _dumps(tmp_path, 3, 2, extra=[0])
    lines = Path(paths[1]).read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["header", "call", "call", "end"]
    Path(paths[1]).write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])
    p = _trace(str(tmp_path), "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads(p.stdout)["communicators"][0]
    kinds = [f["kind"] for f in rep["findings"]]
    assert kinds[0] == "truncated" and "never_issued" in kinds, rep["findings"]
    never = next(f for f in rep["findings"] if f["kind"] == "never_issued")
    assert never["ranks"] == [2], never
    head = never["text"][0]
    assert head.startswith("collective #2 (all_reduce") and \
        "issued by rank(s) 0 but never by rank(s) 2; by rank(s) 1: unknown (dump cut short)" \
        in head, head
    assert any(t.startswith("  rank 1: unknown (dump cut short)") for t in never["text"])
    text = _trace(str(tmp_path))
    assert text.returncode == 1 and "PROBLEMS FOUND" in text.stdout
    assert "never issued by rank 1" not in text.stdout and "never by rank(s) 1" not in \
        text.stdout, text.stdout


def test_a_cut_short_dump_alone_makes_no_never_issued_claim(tmp_path):
    """2 ranks, 3 all_reduces each; rank 1's dump cut after its first call: the only problem
    is the cut-short dump (the missing calls are unknown), and no call is 'not issued'."""
    paths = _dumps(tmp_path, 2, 3)
    lines = Path(paths[1]).read_text().splitlines()
    Path(paths[1]).write_text("\n".join(lines[:2]) + "\n" + lines[2][:30])
    p = _trace(str(tmp_path), "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads(p.stdout)["communicators"][0]
    assert [f["kind"] for f in rep["findings"]] == ["truncated"], rep["findings"]
    assert "not issued" not in p.stdout and "never" not in p.stdout, p.stdout
