"""The bench's command lines and outputs never claim more than was done (issue 22): without a
GPU ``--device cuda`` is one line; ``-c 0`` reads "not checked"; a run in which every case was
skipped fails saying nothing was measured; every bench tool's usage error is one line."""
from __future__ import annotations

import json

import pytest

from module_run import run_module

pytestmark = pytest.mark.timeout(300)
_run = run_module


def test_bench_device_cuda_without_a_gpu_is_one_line():
    from gpu_util import cuda_reason
    if not cuda_reason():
        pytest.skip("a GPU is present: --device cuda runs")
    cp = _run("bench", "all_reduce", "--device", "cuda", "--nproc", "2")
    assert cp.returncode == 2 and cp.stdout == "" and "Traceback" not in cp.stderr
    assert cp.stderr.startswith("python -m bench: error: --device cuda: no usable GPU here (")


def test_bench_never_says_ok_for_what_it_did_not_do(tmp_path):
    """-c 0: the footer says "not checked" (the JSON "unchecked"); every case skipped: the run
    fails, saying nothing was measured (a verdict, not a crashed rank)."""
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K", "-e", "1K",
              "-n", "2", "-c", "0", "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stderr
    assert "# Out of bounds values : not checked (-c 0)" in cp.stdout
    assert json.loads(js.read_text())["out_of_bounds"]["okay"] == "unchecked"
    cp = _run("bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K", "-e", "1K",
              "-n", "2", "-d", "f8e4m3", "-q")
    assert cp.returncode == 1, cp.stderr
    assert "nothing measured: every case was skipped (see above) FAILED" in cp.stdout
    assert "a rank failed" not in cp.stderr


@pytest.mark.parametrize("module, args, words", [
    ("bench.overhead", ["--calls", "0"], "--calls: expected >= 1, got 0"),
    ("bench.overhead", ["--calls", "x"], "--calls: invalid int value: 'x'"),
    ("bench.overhead", ["--breakdown", "--device", "cpu"],
     "--breakdown: times the steps of ncclpy's eager all_reduce on a GPU"),
    ("bench.checked_bench", ["--worlds", "1"], "--worlds: expected world sizes >= 2"),
    ("bench.checked_bench", ["--json", "/nonexistent-ncclpy/x.json"], "--json: cannot write"),
    ("bench.host_overhead", ["--batch", "0"], "--batch: expected an integer >= 1, got 0"),
    ("bench.host_overhead", ["--json", "/nonexistent-ncclpy/x.json"], "--json: cannot write"),
    ("bench.scale", ["--window", "x"], "--window: "),
])
def test_every_bench_tool_refuses_in_one_line(module, args, words):
    cp = _run(module, *args, timeout=60)
    assert cp.returncode == 2 and cp.stdout == "", (cp.stdout, cp.stderr)
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith(f"python -m {module}: error: {words}"), cp.stderr
