"""The bench's command lines and outputs never claim more than was done (issue 22): without a
GPU ``--device cuda`` is one line; ``-c 0`` reads "not checked"; a run in which every case was
skipped fails saying nothing was measured; every bench tool's usage error is one line."""
from __future__ import annotations

import json
from typing import Dict

import pytest

from bench_jobs import Commands, Job, start_jobs

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_cli")]

_REFUSALS = [
    ("bench.overhead", ["--calls", "0"], "--calls: expected >= 1, got 0"),
    ("bench.overhead", ["--calls", "x"], "--calls: invalid int value: 'x'"),
    ("bench.overhead", ["--breakdown", "--device", "cpu"],
     "--breakdown: times the steps of ncclpy's eager all_reduce on a GPU"),
    ("bench.checked_bench", ["--worlds", "1"], "--worlds: expected world sizes >= 2"),
    ("bench.checked_bench", ["--json", "/nonexistent-ncclpy/x.json"], "--json: cannot write"),
    ("bench.host_overhead", ["--batch", "0"], "--batch: expected an integer >= 1, got 0"),
    ("bench.host_overhead", ["--json", "/nonexistent-ncclpy/x.json"], "--json: cannot write"),
    ("bench.scale", ["--window", "x"], "--window: "),
]


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """Every command the tests below run (two of them 2 gloo ranks), started together in the
    background; each test reads its own (tests/bench_jobs.py)."""
    from gpu_util import cuda_reason

    def make(commands: Commands) -> Dict[str, Job]:
        run = commands.module
        jobs: Dict[str, Job] = {}
        jobs["cuda"] = Job(            # the test skips where a GPU is present
            lambda: run("bench", "all_reduce", "--device", "cuda", "--nproc", "2"),
            ["test_bench_device_cuda_without_a_gpu_is_one_line"], lambda: bool(cuda_reason()))
        js = tmp_path_factory.mktemp("c0") / "r.json"
        never = ["test_bench_never_says_ok_for_what_it_did_not_do"]
        jobs["-c 0"] = Job(lambda: (run(
            "bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K", "-e", "1K",
            "-n", "2", "-c", "0", "-q", "-J", str(js)), js), never)
        jobs["all skipped"] = Job(lambda: run(
            "bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K", "-e", "1K",
            "-n", "2", "-d", "f8e4m3", "-q"), never)
        for i, (module, args, _) in enumerate(_REFUSALS):
            jobs[f"refusal {i}"] = Job(lambda module=module, args=args: run(module, *args,
                                                                            timeout=60),
                                       ["test_every_bench_tool_refuses_in_one_line"])
        return jobs
    yield from start_jobs(request, make)


def test_bench_device_cuda_without_a_gpu_is_one_line(runs):
    from gpu_util import cuda_reason
    if not cuda_reason():
        pytest.skip("a GPU is present: --device cuda runs")
    cp = runs["cuda"]
    assert cp.returncode == 2 and cp.stdout == "" and "Traceback" not in cp.stderr
    assert cp.stderr.startswith("python -m bench: error: --device cuda: no usable GPU here (")


def test_bench_never_says_ok_for_what_it_did_not_do(runs):
    """-c 0: the footer says "not checked" (the JSON "unchecked"); every case skipped: the run
    fails, saying nothing was measured (a verdict, not a crashed rank)."""
    cp, js = runs["-c 0"]
    assert cp.returncode == 0, cp.stderr
    assert "# Out of bounds values : not checked (-c 0)" in cp.stdout
    assert json.loads(js.read_text())["out_of_bounds"]["okay"] == "unchecked"
    cp = runs["all skipped"]
    assert cp.returncode == 1, cp.stderr
    assert "nothing measured: every case was skipped (see above) FAILED" in cp.stdout
    assert "a rank failed" not in cp.stderr


@pytest.mark.parametrize("module, args, words", _REFUSALS)
def test_every_bench_tool_refuses_in_one_line(module, args, words, runs):
    cp = runs[f"refusal {_REFUSALS.index((module, args, words))}"]
    assert cp.returncode == 2 and cp.stdout == "", (cp.stdout, cp.stderr)
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith(f"python -m {module}: error: {words}"), cp.stderr
