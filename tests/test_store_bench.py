"""``python -m bench.store_bench`` for real at small sizes: it runs, prints its tables and writes
JSON whose every number is a positive, consistent min / median / max."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import store_bench
from sigint_util import popen_kwargs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("NCCLPY_STORE_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "bench.store_bench", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _check_stats(rec: dict, suffix: str, repeat: int) -> None:
    runs = rec[f"runs{suffix}"]
    assert len(runs) == repeat and all(v > 0 for v in runs), rec
    assert rec[f"min{suffix}"] == min(runs) and rec[f"max{suffix}"] == max(runs), rec
    assert rec[f"min{suffix}"] <= rec[f"median{suffix}"] <= rec[f"max{suffix}"], rec


def _validate(doc: dict, stores, cells, repeat: int, floor: bool = True) -> None:
    assert doc["benchmark"] == "store" and doc["version"] == store_bench.JSON_VERSION
    stores = stores + ["floor"] if floor else stores
    assert doc["stores"] == stores
    assert doc["machine"]["cpus"] >= 1 and doc["config"]["repeat"] == repeat
    assert any("unacknowledged" in n or "not acknowledged" in n for n in doc["notes"])
    got = {(r["mode"], r["ranks"], r["store"]) for r in doc["rendezvous"]}
    assert got == {(m, n, s) for m, n in cells for s in stores}
    for rec in doc["rendezvous"]:
        _check_stats(rec, "_s", repeat)
        assert rec["max_s"] < 120  # seconds: a real rendezvous, not a timeout
    got = {(r["server"], r["op"], r["store"]) for r in doc["ops_per_second"]}
    assert got == {(w, op, s) for w in ("same process", "other process")
                   for op in store_bench.OPS for s in stores}
    for rec in doc["ops_per_second"]:
        _check_stats(rec, "_ops_s", repeat)


def test_bench_runs_threads_and_processes_and_writes_json(tmp_path):
    out = tmp_path / "store.json"
    cp = _run("--ranks", "8", "--process-ranks", "8", "--ops", "200", "--repeat", "2",
              "--warmup", "0", "--no-torch", "--json", str(out))
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "rendezvous" in cp.stdout and "set+get" in cp.stdout and str(out) in cp.stdout
    assert "median ±half its range" in cp.stdout and "ncclpy/floor" in cp.stdout
    assert all(len(ln) <= store_bench.WIDTH for ln in cp.stdout.splitlines()), cp.stdout
    doc = json.loads(out.read_text())
    _validate(doc, ["ncclpy"], [("threads", 8), ("processes", 8)], 2)
    assert doc["config"]["ranks"] == [8] and doc["config"]["process_ranks"] == [8]


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_bench_compares_with_torch(tmp_path):
    out = tmp_path / "store.json"
    cp = _run("--ranks", "8", "--process-ranks", "", "--ops", "100", "--repeat", "1",
              "--warmup", "0", "--json", str(out))
    assert cp.returncode == 0, cp.stderr[-3000:]
    for table in cp.stdout.split("one client"):   # rendezvous, then ops/s: three speed ratios
        assert "ncclpy/torch" in table and "floor/torch" in table and "ncclpy/floor" in table
    doc = json.loads(out.read_text())
    _validate(doc, ["ncclpy", "torch"], [("threads", 8)], 1)
    assert doc["machine"]["torch"]


def test_no_json_file_unless_asked(tmp_path):
    """Nothing is written into the source tree (or anywhere) without --json."""
    args = store_bench.build_parser().parse_args([])
    assert args.json is None
    cp = _run("--ranks", "2", "--process-ranks", "", "--ops", "20", "--repeat", "1",
              "--warmup", "0", "--no-torch", timeout=120)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "wrote" not in cp.stdout and not (ROOT / "bench" / "results").exists()


def test_floor_column_can_be_left_out(tmp_path):
    out = tmp_path / "store.json"
    cp = _run("--ranks", "2", "--process-ranks", "", "--ops", "20", "--repeat", "1",
              "--warmup", "0", "--no-torch", "--no-floor", "--json", str(out), timeout=120)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "floor min/med/max" not in cp.stdout and "/floor" not in cp.stdout.split("wrote")[0]
    _validate(json.loads(out.read_text()), ["ncclpy"], [("threads", 2)], 1, floor=False)


BAD = [(["--ranks", "x"], "--ranks: expected comma-separated rank counts, got 'x'"),
       (["--ranks", "0"], "--ranks: expected rank counts >= 1, got 0"),
       (["--process-ranks", "8,-1"], "--process-ranks: expected rank counts >= 1, got -1"),
       (["--ops", "0"], "--ops: expected an integer >= 1, got 0"),
       (["--repeat", "0"], "--repeat: expected an integer >= 1, got 0"),
       (["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
       (["--ranks", "100000"], "--ranks: 100000 ranks is more than this machine allows one cell"),
       (["--json", "/etc/passwd/x.json"], "--json: cannot write '/etc/passwd/x.json'"),
       (["--json", "/nonexistent-ncclpy/x.json"],
        "--json: cannot write '/nonexistent-ncclpy/x.json': directory '/nonexistent-ncclpy' "
        "does not exist"),
       (["--frob"], "unrecognized arguments: --frob")]


@pytest.mark.parametrize("args, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_one_line_before_anything_runs(args, words):
    cp = _run(*args, "--no-torch", timeout=60)
    assert cp.returncode == 2 and cp.stdout == "", (args, cp.stdout, cp.stderr)
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith(f"python -m bench.store_bench: error: {words}"), cp.stderr
    assert not os.path.exists("/nonexistent-ncclpy")


def test_closed_pipe_and_ctrl_c_end_quietly():
    import signal
    import time
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bench.store_bench", "--ranks", "2,2,2,2,2,2", "--process-ranks",
           "", "--ops", "50", "--repeat", "20", "--warmup", "0", "--no-torch"]
    # | head -1: the reader goes away after the first line
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode() if p.stderr else ""
    assert p.wait(timeout=120) == 141 and "Traceback" not in err, err
    # Ctrl-C while it runs
    p = subprocess.Popen(cmd + ["--ops", "20000"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, **popen_kwargs())
    try:
        assert p.stdout is not None and p.stdout.readline()
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:        # not stopped: it would run on long after the test
            p.kill()
            p.communicate()
    assert p.returncode == 130, err.decode()
    assert err.decode().strip().splitlines()[-1] == "python -m bench.store_bench: interrupted"
    assert "Traceback" not in err.decode()
