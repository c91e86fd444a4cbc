"""``python -m bench`` on a GPU: every collective on the ncclpy and cupy backends at 2 ranks on one
GPU with #wrong = 0, graph mode, the torch backend, the algorithm x protocol bench with its bits
column, and the overhead benchmark.  Skipped with a reason where CUDA is absent."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import gpu_count, requires_gpu

from ncclpy.semantics import registry

ROOT = Path(__file__).resolve().parents[2]
#: each bench run is bounded by SUBPROCESS_S, each test by its mark (TEST_S), both below the
#: device tool's 600 s; every test here runs 2 ranks (on one GPU where there is one)
SUBPROCESS_S = 240
TEST_S = 300
pytestmark = [pytest.mark.timeout(TEST_S), pytest.mark.gpu_world(2)]


def _run(module, *args, timeout=SUBPROCESS_S):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _results(path):
    """The JSON file, validated against bench/schema.json where jsonschema is installed (the
    lent GPU machine has none: the schema is then checked by the CPU tests only)."""
    doc = json.loads(Path(path).read_text())
    try:
        import jsonschema
    except ImportError:
        return doc
    jsonschema.validate(doc, json.loads((ROOT / "bench" / "schema.json").read_text()))
    return doc


def _all_right(doc, cp):
    """Every series' rows (``ncclpy.results``; nccl-tests' ``results`` holds the first's)
    measured and checked."""
    assert doc["results"] and doc["ncclpy"]["results"], cp.stdout + cp.stderr
    for r in doc["ncclpy"]["results"]:
        for side in ("out_of_place", "in_place"):
            assert r[side]["nwrong"] in (0, None), (r, cp.stdout)
        assert r["out_of_place"]["nwrong"] == 0, (r, cp.stdout)
        assert r["out_of_place"]["time"] > 0


@requires_gpu
@pytest.mark.parametrize("coll", registry.names())
def test_sweep_every_collective_ncclpy_and_cupy(coll, tmp_path):
    js = tmp_path / "r.json"
    extra = ["-o", "all"] if registry.get(coll).reduces else []
    cp = _run("bench", coll, "--nproc", "2", "--device", "cuda", "--backend", "ncclpy,cupy",
              "-b", "8", "-e", "1M", "-f", "32", "-n", "5", "-w", "2", "-c", "2", "-q",
              "-J", str(js), *extra)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = _results(js)
    _all_right(doc, cp)
    assert {r["series"] for r in doc["ncclpy"]["results"]} == {"ncclpy", "cupy"}
    assert "# Ratios ncclpy / cupy" in cp.stdout
    devices = doc["config"]["devices"]
    assert [d["rank"] for d in devices] == [0, 1]
    if gpu_count() == 1:                        # the setting: 2 ranks share one GPU
        assert [d["device"] for d in devices] == [0, 0]


@requires_gpu
def test_sweep_all_dtypes_all_reduce(tmp_path):
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce", "--nproc", "2", "--device", "cuda", "--backend",
              "ncclpy,cupy", "-b", "64", "-e", "64K", "-f", "32", "-n", "3", "-d", "all",
              "-o", "all", "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    _all_right(_results(js), cp)


@requires_gpu
@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "all_to_all"])
def test_graph_mode_runs(coll, tmp_path):
    js = tmp_path / "r.json"
    cp = _run("bench", coll, "--nproc", "2", "--device", "cuda", "--backend", "ncclpy,cupy",
              "-b", "1K", "-e", "256K", "-f", "16", "-n", "4", "-G", "3", "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = _results(js)
    assert doc["config"]["graph"] == 3
    _all_right(doc, cp)


@requires_gpu
def test_torch_nccl_backend_and_events_timer(tmp_path):
    pytest.importorskip("torch")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce", "--nproc", "2", "--device", "cuda", "--backend",
              "ncclpy,torch", "-b", "1K", "-e", "1M", "-f", "32", "-n", "5", "--timer",
              "events", "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = _results(js)
    _all_right(doc, cp)
    assert {r["series"] for r in doc["ncclpy"]["results"]} == {"ncclpy", "torch"}


@requires_gpu
def test_overhead_benchmark_runs(tmp_path):
    """Every default backend (issue 37) on one shared stream and one set of buffers, every
    mode; ncclpy with its watchdog and flight recorder, ncclpy-bare without."""
    pytest.importorskip("torch")
    js = tmp_path / "o.json"
    names = ("ncclpy", "ncclpy-bare", "cupy", "torch")
    cp = _run("bench.overhead", "--backends", ",".join(names), "--calls", "200",
              "--graph-calls", "40", "--sizes", "8,4K", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = json.loads(js.read_text())
    modes = {(r["backend"], r["mode"]) for r in doc["results"]}
    assert modes == {(b, m) for b in names for m in ("eager", "prepared", "graph", "capture")}
    assert all(r["median_us"] > 0 for r in doc["results"])
    assert {(d["backend"], d["size"]) for d in doc["derived"]} == {
        (f, s) for f in ("ncclpy", "ncclpy-bare") for s in (8, 4096)}
    assert {d["mode"] for d in doc["derived"]} == {"eager", "prepared"}
    ran = {b["name"]: b["settings"] for b in doc["backends"]}
    assert ran["ncclpy"]["watchdog"] and ran["ncclpy"]["flight_recorder_calls"] > 0
    assert ran["ncclpy-bare"] == {"watchdog": False, "flight_recorder_calls": 0}
    assert "## one-off" in cp.stdout and "## graph replay" in cp.stdout


@requires_gpu
def test_overhead_benchmark_nccl4py(tmp_path):
    """nccl4py beside the raw floor, where it is installed (bench/install_wheels.sh)."""
    from bench.backends.nccl4py import INSTALL_HINT, missing
    if missing():
        pytest.skip(f"nccl4py is not installed ({missing()}); {INSTALL_HINT}")
    js = tmp_path / "o.json"
    cp = _run("bench.overhead", "--backends", "cupy,nccl4py", "--calls", "100",
              "--graph-calls", "20", "--sizes", "8", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = json.loads(js.read_text())
    assert {(r["backend"], r["mode"]) for r in doc["results"]} == {
        (b, m) for b in ("cupy", "nccl4py") for m in ("eager", "prepared", "graph", "capture")}
    assert doc["versions"]["nccl4py"]["nccl4py"] == "0.6.0", doc["versions"]


@requires_gpu
def test_cuda_costs_measures_every_call(tmp_path):
    js = tmp_path / "c.json"
    cp = _run("bench.cuda_costs", "--repeats", "50", "--json", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = json.loads(js.read_text())
    from bench.cuda_costs import CALLS, SCHEMA
    assert doc["schema"] == SCHEMA and doc["device"] and doc["cuda_runtime"]
    assert set(doc["costs_ns"]) == {n for n, _ in CALLS}, doc["not_measured"]
    assert all(v > 0 for v in doc["costs_ns"].values()), doc["costs_ns"]


@requires_gpu
def test_predicted_time_column_and_a_forced_algorithm(tmp_path):
    """--predict: NCCL's estimate (ncclGroupSimulateEnd) beside each measured out-of-place
    time; --algo ring: the communicator made with NCCL_ALGO=Ring."""
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce", "--nproc", "2", "--device", "cuda", "--backend", "ncclpy",
              "-b", "1K", "-e", "16M", "-f", "16", "-n", "5", "--predict", "--algo", "ring",
              "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    doc = _results(js)
    _all_right(doc, cp)
    pred = doc["ncclpy"]["predicted"]
    assert len(pred) == len(doc["ncclpy"]["results"]) == len(doc["results"])
    assert doc["ncclpy"]["combinations"][0]["env"] == {"NCCL_ALGO": "Ring"}
    assert all(p["predicted_us"] is not None and p["predicted_us"] > 0 for p in pred), pred
    big = pred[-1]                                  # 16 MiB: the model is meant for this
    assert big["predicted_us"] / 20 < big["measured_us"] < big["predicted_us"] * 20, big
    assert "predict" in cp.stdout


@requires_gpu
def test_algorithm_by_protocol_bench_with_the_bits_column(tmp_path):
    """Issue 51: ring and tree x LL, LL128, Simple, one communicator each (NCCL_ALGO and
    NCCL_PROTO at init), all_reduce and reduce_scatter at 2 ranks: every combination NCCL has
    a kernel for runs and checks (#wrong 0); Tree for reduce_scatter is one line, never run;
    at 2 ranks every order folds the same two operands, so every output is the model's
    (exact), the same as the first combination's, and the same in both runs of --repeat-bits.
    Bounded by SUBPROCESS_S (the run) and TEST_S (the test)."""
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce,reduce_scatter", "--nproc", "2", "--device", "cuda",
              "--backend", "ncclpy", "--algo", "ring,tree", "--proto", "ll,ll128,simple",
              "--repeat-bits", "2", "-b", "1K", "-e", "1M", "-f", "32", "-n", "5", "-w", "2",
              "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    labels = [f"{a}/{p}" for a in ("ring", "tree") for p in ("ll", "ll128", "simple")]
    for coll, runs in (("all_reduce", labels), ("reduce_scatter", labels[:3])):
        doc = _results(tmp_path / f"r.{coll}.json")
        _all_right(doc, cp)
        assert [c["label"] for c in doc["ncclpy"]["combinations"]] == labels
        rows = doc["ncclpy"]["results"]                       # every combination's rows
        got = {(r["series"], r["size"]) for r in rows}
        assert {name for name, _ in got} == {f"ncclpy {lab}" for lab in runs}, got
        assert len(rows) == len(runs) * 3 and len(doc["results"]) == 3   # 1K, 32K, 1M
        for r in rows:
            bits = r["bits"]
            assert bits["model"]["verdict"] == "exact", (r["series"], bits)
            assert bits["repeats"]["differing"] == 0, bits
            assert bits["first"]["is_reference"] or bits["first"]["differing"] == 0, bits
        assert doc["ncclpy"]["bits"]["summary"]["mismatch"] == 0
    assert ("# ncclpy tree/ll, ncclpy tree/ll128, ncclpy tree/simple: not run for "
            "reduce_scatter: NCCL has no Tree kernel for ReduceScatter") in cp.stdout
    assert "from NCCL's source" in cp.stdout and "# Bits vs the model    : 18 exact" in cp.stdout


@requires_gpu
def test_registered_buffers_windows_cta_policy_and_the_memory_report(tmp_path):
    """-R 1 (ncclCommRegister) and -R 2 (symmetric windows on NCCL memory) give checked,
    correct results; --cta-policy zero with -R 2 runs; -M reports ncclCommMemStats (2.29.7)."""
    for flags in (["-R", "1"], ["-R", "2", "--cta-policy", "zero"], ["-M", "1"]):
        js = tmp_path / f"r{len(flags)}{flags[1]}.json"
        cp = _run("bench", "all_reduce,all_gather", "--nproc", "2", "--device", "cuda",
                  "--backend", "ncclpy", "-b", "4K", "-e", "1M", "-f", "16", "-n", "3", "-q",
                  *flags, "-J", str(js))
        if "needs NCCL >=" in cp.stderr:
            pytest.skip(cp.stderr.strip().splitlines()[-1])
        assert cp.returncode == 0, (flags, cp.stdout + cp.stderr)
        for coll in ("all_reduce", "all_gather"):
            doc = _results(tmp_path / f"{js.stem}.{coll}.json")
            _all_right(doc, cp)
            ext = doc["ncclpy"]
            assert ext["registration"] == (int(flags[1]) if flags[0] == "-R" else 0), ext
            if flags[0] == "-M":
                mem = ext["memory"]["ncclpy"]
                assert mem["total_bytes"] >= mem["persistent_bytes"] > 0, mem
        if flags[0] == "-M":
            assert "NCCL memory of rank 0's communicator (ncclCommMemStats)" in cp.stdout
        if flags[0] == "-R":
            got, asked = doc["ncclpy"]["registered"]
            assert asked > 0 and f"NCCL registered {got} of the {asked}" in cp.stdout


@requires_gpu
@pytest.mark.parametrize("flags, agg, blocking", [
    (["-m", "4", "-z", "3", "-T", "60"], 4, "true"),   # grouped calls, waits, a bounded sync
    (["-m", "2", "-G", "2"], 2, "false"),              # the groups captured in a graph
    (["-z", "1", "-C", "1"], 1, "true"),               # a wait and barrier after every call
])
def test_nccl_tests_aggregation_and_blocking_flags(flags, agg, blocking, tmp_path):
    """nccl-tests' -m, -z, -T, -C on the backends that drive NCCL's group calls (issue 38):
    the calls still check with #wrong = 0, and the JSON says what ran."""
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce,all_to_all", "--nproc", "2", "--device", "cuda",
              "--backend", "ncclpy,cupy", "-b", "1K", "-e", "1M", "-f", "32", "-n", "4", "-q",
              *flags, "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    for coll in ("all_reduce", "all_to_all"):
        doc = _results(tmp_path / f"r.{coll}.json")
        assert doc["config"]["aggregated_iterations"] == agg
        assert doc["config"]["blocking_collectives"] == blocking
        key = "cpu_time" if "-C" in flags else "time"
        for r in doc["ncclpy"]["results"]:                # both backends' rows
            assert r["out_of_place"]["nwrong"] == 0 and r["out_of_place"][key] > 0, r


@requires_gpu
@pytest.mark.timeout(TEST_S)
@pytest.mark.parametrize("backends, flags", [
    ("ncclpy,cupy,torch", ["-u", "1"]),
    ("ncclpy,cupy,torch", ["-u", "3"]),
    ("ncclpy", ["-u", "3", "-R", "1"]),      # the registrations hold the moved pointers
])
def test_misaligned_buffers_check_clean(backends, flags):
    """nccl-tests' -u N (common.cu TimeTest: every send and receive pointer moved by N x the
    type's size): every collective on each backend that takes an offset pointer (ncclpy and
    cupy on CuPy views, torch on a tensor view), 1-, 2- and 4-byte types, #wrong = 0.  ``-w 0``
    (one untimed call per case) keeps the 81 cases x backends inside the device budget."""
    if "torch" in backends:
        _torch_cuda_or_skip()
    cp = _run("bench", "all", "--nproc", "2", "--device", "cuda", "--backend", backends,
              "-b", "8", "-e", "256K", "-f", "32", "-n", "2", "-w", "0", "-c", "1",
              "-d", "float,half,int8", "-q", *flags)
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-4000:]
    n = len(registry.names())
    assert cp.stdout.count(f" unalign: {flags[1]}\n") == n, cp.stdout
    assert cp.stdout.count("# Out of bounds values : 0 OK") == n, cp.stdout
    assert "skipped" not in cp.stdout, cp.stdout
    rows = [ln.split() for ln in cp.stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s", ln)]
    assert len(rows) == n * len(backends.split(",")) * 3 * 4, cp.stdout   # dtypes x sizes
    for r in rows:
        assert r[8] == "0" and r[12] in ("0", "N/A"), r
    if "-R" in flags:    # the registrations were asked for (moved pointers inside them)
        assert re.search(r"# ncclpy: -R 1: NCCL registered \d+ of the [1-9]\d* buffers",
                         cp.stdout), cp.stdout


def _torch_cuda_or_skip() -> None:
    pytest.importorskip("torch")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")


@requires_gpu
@pytest.mark.timeout(TEST_S)
@pytest.mark.parametrize("flags", [[], ["-z", "3"]])
def test_per_iteration_timing_is_cuda_event_times(flags, tmp_path):
    """nccl-tests' -I 1 -K 1 (common.cu BenchTime: a CUDA event at each iteration boundary on
    the stream, paired start/stop events with -z 3) on ncclpy, cupy and torch at 2 ranks: the
    header says CUDA event timing, each side has -n samples, positive, whose mean is near the
    row's whole-window time per call, and one row of samples per rank."""
    _torch_cuda_or_skip()
    js = tmp_path / "r.json"
    cp = _run("bench", "all_reduce", "--nproc", "2", "--device", "cuda", "--backend",
              "ncclpy,cupy,torch", "-b", "1K", "-e", "4M", "-f", "64", "-n", "10", "-w", "2",
              "-I", "1", "-K", "1", "-q", *flags, "-J", str(js))
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-4000:]
    assert ("# Per-Iteration Report: CUDA event timing; i_* uses max over process rows; "
            "summary skips first 1 iterations \n") in cp.stdout, cp.stdout
    doc = _results(js)
    _all_right(doc, cp)
    # every series' records: the ncclpy extension's list where there are several backends
    recs = doc.get("ncclpy", {}).get("results") or doc["results"]
    assert len(recs) == 3 * 3, recs                         # backends x sizes
    for r in recs:
        for side in ("out_of_place", "in_place"):
            pi, time_us = r[f"{side}_per_iter"], r[side]["time"]
            t = pi["times_us"]
            assert len(t) == 10 and min(t) > 0 and pi["skipped_iterations"] == 1, (r, side)
            assert 0.2 * time_us <= sum(t) / len(t) <= 5 * time_us, (r, side)
            rows = pi["per_process_max_times_us"]          # each rank's samples
            assert len(rows) == 2 and all(len(x) == 10 for x in rows), (r, side)
            assert t == pytest.approx([max(a, b) for a, b in zip(*rows)]), (r, side)
            assert pi["min_us"] == pytest.approx(min(t[1:])), (r, side)     # -K 1
