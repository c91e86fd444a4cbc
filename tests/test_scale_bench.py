"""``python -m bench.scale`` (issue 26) runs end to end at a small size: the real store process,
simulated ranks over the real protocol, one real Watchdog process, checked-mode votes, the JSON
it promises; and its flags fail precisely.  The figures themselves are in docs/performance.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.scale", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def test_a_small_run_writes_every_promised_field(tmp_path):
    out = tmp_path / "scale.json"
    cp = _run("--ranks", "16", "--window", "1", "--checked-calls", "3", "--key-rounds", "50",
              "--json", str(out))
    assert cp.returncode == 0, cp.stderr
    data = json.loads(out.read_text())
    (r,) = data["results"]
    for key in ("ranks", "spread_s", "false_aborts", "beat_p99_s", "store_cpu_fraction",
                "store_requests_per_s", "checked_call_ms", "store_keys_after", "connections"):
        assert key in r, key
    assert r["ranks"] == 16 and r["false_aborts"] == 0 and r["checked_mismatches"] == 0
    assert r["connections"] == 2 * 16 - 1          # a beat and a vote connection per simulated
    assert r["store_requests_per_s"] > 0           # rank, the real rank's one
    assert data["checked_keys"]["keys_after"] == data["checked_keys"]["keys_before"]
    table = _run("--markdown", str(out))
    assert table.returncode == 0 and table.stdout.startswith("| ranks |")


@pytest.mark.parametrize("args, msg", [
    (["--ranks", "1"], "--ranks: expected world sizes >= 2, got '1'"),
    (["--ranks", "x"], "--ranks: expected world sizes like 64,1024, got 'x'"),
    (["--window", "0"], "--window: expected a number >= 0.5, got 0"),
    (["--json", "/nonexistent-dir/x.json"], "--json: the folder of"),
    (["--markdown", "/nonexistent.json"], "--markdown: cannot read"),
])
def test_bad_flags_fail_with_one_line_naming_them(args, msg):
    cp = _run(*args)
    assert cp.returncode == 2 and msg in cp.stderr and "Traceback" not in cp.stderr, cp.stderr
