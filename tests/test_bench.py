"""``python -m bench``: flags, size sweeps, nccl-tests' bandwidth formulas, and real sweeps on
torch.distributed's gloo backend at 2 ranks (CPU, real processes).  The output's formatting and
JSON document are tests/test_bench_format.py."""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from bench_jobs import Commands, Job, start_jobs

from ncclpy.semantics import registry
from ncclpy.errors import ArgumentError

from bench import verify
from bench.backends import layout
from bench.backends.cupy_raw import P2P_COLLECTIVES, p2p_ops
from bench.backends.ncclpy import call_args
from bench.sweep import per_call_seconds, timed_calls
from bench.cli import parse_args, parse_size, size_list

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "bench" / "schema.json").read_text())
# 300 s (was 120): a test may wait for its run behind others started with it (see ``runs``)
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench")]
_CLI_MISTAKES = ((["-f", "0.5"], "-f: expected an integer, got '0.5'"),
                 (["-a", "7"], "-a: expected 0 (rank 0), 1 (average), 2 (min) or 3"),
                 (["--timeout", "-3"],
                  "--timeout: expected seconds >= 0 (0: no limit), got '-3'"),
                 (["--nproc", "2", "-J", "/nonexistent-ncclpy/d/out.json"],
                  "-J: cannot write"),
                 (["--nproc", "2", "--plot", "out.txt"], "--plot: 'out.txt'"))


def _jobs(commands: Commands, mktemp) -> Dict[str, Job]:
    """Every command the real-run tests at the end of this module run, by name."""
    from gpu_util import cuda_reason
    run = commands.module
    jobs: Dict[str, Job] = {}
    jobs["sweep"] = Job(lambda d=mktemp("sweep"): (run(
        "bench", "all_reduce", "--nproc", "2", "--device", "cpu", "--backend", "torch",
        "-b", "64", "-e", "4K", "-f", "4", "-n", "3", "-w", "1", "-c", "1",
        "-d", "float,int32", "-J", str(d / "r.json"), "--csv", str(d / "r.csv"), "--plot",
        str(d / "r.png")), d), ["test_gloo_sweep_end_to_end"])
    env = dict(commands.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    jobs["launcher"] = Job(lambda js=mktemp("launcher") / "r.json": (commands.run(
        [sys.executable, "-m", "ncclpy", "run", "-n", "2", sys.executable, "-m", "bench",
         "all_gather", "--device", "cpu", "-b", "1K", "-e", "4K", "-f", "2", "-n", "2", "-q",
         "-J", str(js)], env=env, cwd=ROOT, timeout=120), js),
        ["test_runs_under_ncclpy_run_launcher"])
    jobs["every"] = Job(lambda every=mktemp("every"): (run(
        "bench", "all", "--nproc", "2", "--device", "cpu", "-b", "1K", "-e", "1K", "-n", "2",
        "-w", "1", "-c", "1", "-q", "-o", "sum,prod", "-r", "all", "-J", str(every / "r.json")),
        every), ["test_gloo_every_collective_is_correct"])
    jobs["wrong"] = Job(lambda wrong=mktemp("wrong") / "r.json": (run(
        "bench", "all_reduce", "--nproc", "2", "--device", "cpu", "-b", "256", "-e", "256",
        "-n", "2", "-c", "1", "-q", "-J", str(wrong), "--test-corrupt", "3"), wrong),
        ["test_wrong_result_is_counted"])
    jobs["no check"] = Job(lambda: run(
        "bench", "all_reduce", "--device", "cpu", "-b", "8", "-e", "8", "-n", "2", "-c", "0",
        "-q"), ["test_no_check_reports_na_and_single_rank_runs"])
    cli = ["test_cli_errors_exit_2"]
    jobs["-G 1"] = Job(lambda: run("bench", "all_reduce", "--device", "cpu", "-G", "1"), cli)
    jobs["-b > -e"] = Job(lambda: run("bench", "all_reduce", "--device", "cpu", "-b", "1M",
                                      "-e", "1K"), cli)
    for i, (args, _) in enumerate(_CLI_MISTAKES):
        jobs[f"mistake {i}"] = Job(lambda args=args: run("bench", "all_reduce", "--device",
                                                         "cpu", *args), cli)
    over = ["test_overhead_without_gpu_says_so"]

    def no_gpu() -> bool:                    # the test skips where a GPU is present
        return bool(cuda_reason())
    jobs["overhead"] = Job(lambda: run("bench.overhead"), over, no_gpu)
    jobs["overhead cpu"] = Job(lambda o=mktemp("overhead") / "o.json": (run(
        "bench.overhead", "--device", "cpu", "--calls", "20", "--warmup", "2", "--sizes",
        "8,4K", "-J", str(o)), o), over, no_gpu)
    return jobs


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The real runs at the end of this module (most of them 2 gloo ranks), started together
    in the background while its ~100 in-process tests run; each test reads its own
    (tests/bench_jobs.py)."""
    yield from start_jobs(request, lambda commands: _jobs(commands, tmp_path_factory.mktemp))


def _validate(doc):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, SCHEMA)


# ---------------------------------------------------------------------------- flags and sizes
@pytest.mark.parametrize("text,expected", [
    ("8", 8), ("0", 0), ("1K", 1024), ("64k", 64 << 10), ("1M", 1 << 20), ("1.5M", 3 << 19),
    ("2G", 2 << 30), ("1KB", 1024), ("4KiB", 4096), (" 16 ", 16), ("32m", 32 << 20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "1T", "-1", "1.2.3", "K"])
def test_parse_size_rejects(bad):
    with pytest.raises(ArgumentError, match="K/M/G"):
        parse_size(bad, "-b/--minbytes")


def test_size_sweeps_like_nccl_tests():
    assert size_list(8, 128, 2) == [8, 16, 32, 64, 128]
    assert size_list(8, 100, 2) == [8, 16, 32, 64]               # stops before passing -e
    assert size_list(1 << 10, 4 << 10, 1, 1 << 10) == [1024, 2048, 3072, 4096]   # -i
    assert size_list(1000, 2500, 1, 1000) == [1000, 2000]
    assert size_list(32 << 20, 32 << 20) == [32 << 20]           # nccl-tests' defaults
    assert size_list(8, 8, 2) == [8]
    assert size_list(0, 0, 2) == [0]
    assert size_list(1, 4096, 8) == [1, 8, 64, 512, 4096]


@pytest.mark.parametrize("args,match", [
    ((4096, 8, 2), "minbytes"), ((0, 64, 2), "never grows"), ((8, 64, 1, 0), "stepbytes")])
def test_size_sweep_errors(args, match):
    with pytest.raises(ArgumentError, match=match):
        size_list(*args)


def test_parse_args_defaults_are_nccl_tests():
    cfg = parse_args(["all_reduce", "--device", "cpu"])
    assert cfg.collective == "all_reduce"
    assert cfg.sizes == [32 << 20] and cfg.minbytes == cfg.maxbytes == 32 << 20
    assert (cfg.iters, cfg.warmup_iters, cfg.check, cfg.average) == (20, 1, 1, 1)
    assert cfg.stepbytes == 1 << 20 and cfg.stepfactor == 1
    assert cfg.ops == ["sum"] and cfg.dtypes == ["float32"] and cfg.root == 0
    assert cfg.cudagraph == 0 and cfg.backends == ["torch"] and cfg.device == "cpu"


def test_parse_args_short_and_long_flags_agree():
    short = parse_args(["all_gather", "--device", "cpu", "-b", "8", "-e", "1M", "-f", "4",
                        "-n", "7", "-w", "3", "-c", "2", "-o", "max", "-d", "half", "-r", "1",
                        "-a", "3", "-J", "x.json"])
    long_ = parse_args(["all_gather", "--device", "cpu", "--minbytes", "8", "--maxbytes", "1M",
                        "--stepfactor", "4", "--iters", "7", "--warmup_iters", "3", "--check",
                        "2", "--op", "max", "--datatype", "half", "--root", "1", "--average",
                        "3", "--output_file", "x.json"])
    for cfg in (short, long_):
        assert cfg.sizes == [8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288]
        assert (cfg.iters, cfg.warmup_iters, cfg.check, cfg.average) == (7, 3, 2, 3)
        assert cfg.ops == ["max"] and cfg.dtypes == ["float16"] and cfg.root == 1
        assert cfg.output_file == "x.json"


def test_parse_args_all_and_names():
    cfg = parse_args(["all_reduce_perf", "--device", "cpu", "-o", "all", "-d", "all", "-r", "all",
                      "-i", "4K", "-b", "4K", "-e", "12K"])
    assert cfg.collective == "all_reduce"
    assert cfg.ops == ["sum", "prod", "max", "min", "avg"]
    assert cfg.dtypes == ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
                          "float32", "float64", "bfloat16", "float8_e4m3", "float8_e5m2"]
    assert cfg.root == -1 and cfg.sizes == [4096, 8192, 12288]
    assert parse_args(["alltoall", "--device", "cpu"]).collective == "all_to_all"
    assert parse_args(["sendrecv", "--device", "cpu"]).collective == "send_recv"
    assert parse_args(["gather", "--device", "cpu", "-d", "f8e4m3,bfloat16"]).dtypes == \
        ["float8_e4m3", "bfloat16"]
    assert parse_args(["all_reduce", "--device", "cpu", "--backend", "gloo"]).backends == ["torch"]


@pytest.mark.parametrize("argv,match", [
    (["all_reduce", "--device", "cpu", "--backend", "cupy"], "cupy needs a GPU"),
    (["all_reduce", "--device", "cpu", "-G", "2"], "unsupported with --device cpu"),
    (["all_reduce", "--device", "cpu", "--timer", "events"], "unsupported with --device cpu"),
    (["all_reduce", "--device", "cpu", "-o", "band"], "^-o: "),
    (["all_reduce", "--device", "cpu", "-o", "mulsum"], "mulsum"),
    (["all_reduce", "--device", "cpu", "-d", "int16"], "^-d: "),
    (["all_reduce", "--device", "cpu", "-d", "complex64"], "not an NCCL type"),
    (["all_reduce", "--device", "cpu", "-r", "x"], "^-r: "),
    (["all_reduce", "--device", "cpu", "-n", "0"], "^-n: expected an integer >= 1, got 0"),
    (["all_reduce", "--device", "cpu", "--backend", "mpi"], "--backend"),
    (["all_reduce", "--device", "cpu", "--iters", "0"], "^--iters: "),
    (["all_reduce", "--device", "cpu", "--datatype", "int16"], "^--datatype: "),
    (["reduce", "--device", "cpu", "--nproc", "2", "-r", "5"],
     "^-r: 5 is not a rank of a run of 2 ranks; expected 0..1 or all"),
    (["all_reduce", "--device", "cpu", "-J", "/nonexistent-ncclpy/x.json"],
     "^-J: cannot write '/nonexistent-ncclpy/x.json': directory '/nonexistent-ncclpy' does not"),
    (["all_reduce", "--device", "cpu", "--output_file", "/nonexistent-ncclpy/x.json"],
     "^--output_file: cannot write"),
    (["all_reduce", "--device", "cpu", "--csv", "/nonexistent-ncclpy/x.csv"], "^--csv: "),
    (["all_reduce", "--device", "cpu", "--plot", "out.txt"],
     "^--plot: 'out.txt': matplotlib cannot write .txt files; expected one of "),
    (["all_reduce", "--device", "cpu", "-b", "1M", "-e", "1K"],
     r"^-b 1M is larger than -e 1K \(1048576 > 1024 bytes\)"),
    (["barrier", "--device", "cpu"], "no data"),
    (["nope", "--device", "cpu"], "unknown"),
])
def test_parse_args_errors(argv, match):
    with pytest.raises(ArgumentError, match=match):
        parse_args(argv)


# ---------------------------------------------------------------------------- bandwidth formulas
# nccl-tests' definitions, written out here independently of ncclpy's registry: for a run at
# "size" S bytes (count = S / typesize elements), getCollByteCount gives NCCL's count and the
# reported size, and GetBw turns seconds into algbw (GB/s, 1e9) and busbw.
def _nccl_tests(coll, count, n, ts, sec):
    per = count // n
    if coll == "all_reduce":
        nccl_count, size, base, factor = count, count * ts, count * ts, 2 * (n - 1) / n
    elif coll in ("reduce", "broadcast"):
        nccl_count, size, base, factor = count, count * ts, count * ts, 1.0
    elif coll == "send_recv":
        nccl_count, size, base, factor = count, count * ts, count * ts, 1.0
    elif coll in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        nccl_count, size, base, factor = per, per * n * ts, per * n * ts, (n - 1) / n
    else:
        raise AssertionError(coll)
    alg = base / 1e9 / sec
    return nccl_count, size, alg, alg * factor


@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "broadcast", "all_gather",
                                  "reduce_scatter", "all_to_all", "gather", "scatter",
                                  "send_recv"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bandwidth_formulas_match_nccl_tests(coll, n):
    c = registry.get(coll)
    for count, ts, sec in ((1 << 20, 4, 1e-3), (1000, 2, 2.5e-5), (7, 8, 1e-6), (1, 1, 1e-6)):
        lay = layout(coll, count, n, rank=0)
        want_count, want_size, want_alg, want_bus = _nccl_tests(coll, count, n, ts, sec)
        assert lay.count == want_count
        assert lay.nbytes(ts) == want_size
        alg, bus = c.bandwidths(lay.nbytes(ts), sec, n)
        assert alg == pytest.approx(want_alg, rel=1e-12)
        assert bus == pytest.approx(want_bus, rel=1e-12, abs=1e-15)


def test_busbw_factors_by_name():
    n = 4
    assert registry.get("all_reduce").busbw_factor(n) == pytest.approx(1.5)
    for name in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert registry.get(name).busbw_factor(n) == pytest.approx(0.75)
    for name in ("reduce", "broadcast", "send_recv"):
        assert registry.get(name).busbw_factor(n) == 1.0


def test_in_place_layout_follows_nccl():
    lay = layout("all_gather", 4096, 4, rank=2)      # input sits at rank*count of the output
    assert (lay.count, lay.whole, lay.ip_send, lay.ip_recv) == (1024, 4096, (2048, 1024),
                                                                (0, 4096))
    lay = layout("reduce_scatter", 4096, 4, rank=3)  # output sits at rank*count of the input
    assert (lay.count, lay.whole, lay.ip_send, lay.ip_recv) == (1024, 4096, (0, 4096),
                                                                (3072, 1024))
    lay = layout("all_reduce", 10, 4, rank=1)
    assert (lay.count, lay.whole, lay.ip_send, lay.ip_recv) == (10, 10, (0, 10), (0, 10))


def test_timing_divides_like_nccl_tests_benchtime():
    """nccl-tests: deltaSec = elapsed / (iters * agg_iters), then / cudaGraphLaunches with -G
    (the graph holds the -n iterations and is launched -G times)."""
    assert timed_calls(20, 0) == 20
    assert timed_calls(20, 1) == 20
    assert timed_calls(20, 10) == 200
    assert per_call_seconds(0.5, 20, 0) == pytest.approx(0.025)
    assert per_call_seconds(0.5, 20, 10) == pytest.approx(0.0025)
    import bench.cli
    real, bench.cli._no_gpu_reason = bench.cli._no_gpu_reason, lambda: ""   # parse as on a GPU
    try:
        cfg = parse_args(["all_reduce", "--device", "cuda", "-n", "7", "-G", "3", "-a", "2"])
    finally:
        bench.cli._no_gpu_reason = real
    assert (cfg.iters, cfg.cudagraph, cfg.average) == (7, 3, 2)


def test_average_flag_takes_nccl_tests_values_only():
    for a in ("0", "1", "2", "3"):
        assert parse_args(["all_reduce", "--device", "cpu", "-a", a]).average == int(a)
    with pytest.raises(SystemExit):
        parse_args(["all_reduce", "--device", "cpu", "-a", "4"])


def _simulate_p2p(coll, n, root, total):
    """Pair every rank's p2p_ops as NCCL does (the k-th send from a to b meets the k-th recv on
    b from a) and move the blocks; returns each rank's receive buffer."""
    ins = [verify.rank_input(coll, "int32", "none", r, n, layout(coll, total, n, r).send, 7)
           for r in range(n)]
    outs = [np.zeros(layout(coll, total, n, r).recv, np.int32) for r in range(n)]
    count = layout(coll, total, n, 0).count
    queues = {}
    for r in range(n):
        for kind, block, peer in p2p_ops(coll, r, n, root):
            if kind == "send":
                queues.setdefault((r, peer), []).append(ins[r][block * count:(block + 1) * count])
    for r in range(n):
        for kind, block, peer in p2p_ops(coll, r, n, root):
            if kind == "recv":
                outs[r][block * count:(block + 1) * count] = queues[(peer, r)].pop(0)
    assert all(not q for q in queues.values()), "a send without a matching recv"
    return ins, outs


@pytest.mark.parametrize("coll", P2P_COLLECTIVES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_raw_cupy_backend_p2p_decomposition_matches_the_reference(coll, n):
    """The cupy backend builds all_to_all/gather/scatter/send_recv from grouped send/recv (as
    nccl-tests does); the blocks it moves give the reference's outputs."""
    for root in (range(n) if registry.get(coll).rooted else [-1]):
        ins, outs = _simulate_p2p(coll, n, root, 12 * n)
        want = verify.expected(coll, ins, "int32", "none", root, n, in_place=False)
        for r in range(n):
            if want[r] is not None:
                assert np.array_equal(outs[r], want[r]), (coll, n, root, r)


def test_ncclpy_backend_call_forms():
    """Out of place (send, recv); in place ncclpy's documented forms; rooted sides only on the
    root."""
    a = {k: k for k in ("send", "recv", "whole", "ip_send", "ip_recv")}
    for coll in ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_to_all"):
        assert call_args(coll, a, False, 0, 0) == ("send", "recv")
        assert call_args(coll, a, True, 1, 0) == ("whole", None)
    assert call_args("all_gather", a, True, 1, -1) == (None, "whole")
    assert call_args("all_gather", a, False, 1, -1) == ("send", "recv")
    assert call_args("gather", a, True, 1, 1) == ("ip_send", "whole")
    assert call_args("gather", a, True, 0, 1) == ("ip_send", None)
    assert call_args("gather", a, False, 0, 1) == ("send", None)
    assert call_args("scatter", a, True, 1, 1) == ("whole", "ip_recv")
    assert call_args("scatter", a, True, 0, 1) == (None, "ip_recv")
    assert call_args("scatter", a, False, 0, 1) == (None, "recv")
    assert call_args("send_recv", a, True, 0, -1) == ("whole", "whole")


def test_gpu_backends_refuse_cpu_before_any_communicator():
    from ncclpy.errors import UnsupportedError
    from bench.backends import get_backend
    for name in ("ncclpy", "cupy"):
        b = get_backend(name)
        assert b.name == name and b.supports_graphs and b.supports_events
        with pytest.raises(UnsupportedError, match="needs a CUDA device"):
            b.setup(0, 1, None, None)
        b.teardown()                              # nothing was opened: a no-op
        assert b.comm is None


# ---------------------------------------------------------------------------- real runs (gloo)
def _table_rows(stdout):
    return [ln.split() for ln in stdout.splitlines() if ln and not ln.startswith("#")]


def test_gloo_sweep_end_to_end(runs):
    cp, tmp_path = runs["sweep"]
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = cp.stdout
    assert "# Collective test starting: all_reduce_perf" in out
    assert "#  Rank  0 Group  0 Pid" in out and "#  Rank  1 Group  0 Pid" in out
    assert "# Out of bounds values : 0 OK" in out and "# Avg bus bandwidth    : " in out
    rows = _table_rows(out)
    assert [r[0] for r in rows] == ["64", "256", "1024", "4096"] * 2   # per dtype
    assert [r[2] for r in rows] == ["float"] * 4 + ["int32"] * 4
    for r in rows:
        assert r[4] == "-1" and r[3] == "sum"
        assert r[8] == "0" and r[12] == "0", r       # #wrong out of place and in place
    assert "[bench]" in cp.stderr                    # progress on stderr
    doc = json.loads(js.read_text())
    _validate(doc)
    assert doc["ncclpy"]["world_size"] == 2 and doc["config"]["step_factor"] == 4
    assert {r["type"] for r in doc["results"]} == {"float", "int32"}
    assert all(r["out_of_place"]["nwrong"] == 0 and r["in_place"]["nwrong"] == 0
               for r in doc["results"])
    _assert_nccl_tests_json_layout(doc)
    with open(cs) as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(doc["results"]) and lines[0]["backend"] == "torch"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 200 and img.shape[1] > 400 and img.std() > 0   # a drawn figure


# nccl-tests' -J writer (src/util.cu: jsonOutputInit, writeDeviceReport, jsonRankInfo,
# writeBenchmarkLinePreamble/Body/Terminator, writeResultFooter, writeErrors,
# jsonOutputFinalize), key by key and in order.  Our document must read the same to its tools.
NCCL_TESTS_TOP = ["version", "start_time", "args", "env", "nccl_version", "config", "results",
                  "out_of_bounds", "average_bus_bandwidth", "errors", "end_time"]
NCCL_TESTS_CONFIG = ["nthreads", "ngpus", "minimum_bytes", "maximum_bytes", "<step>",
                     "warmup_iters", "iterations", "aggregated_iterations", "validation",
                     "graph", "blocking_collectives", "per_iter_timing", "per_iter_skip",
                     "parallel_init", "devices"]
NCCL_TESTS_DEVICE = ["rank", "group", "pid", "hostname", "device", "device_hex", "device_info"]
NCCL_TESTS_RESULT = ["size", "count", "type", "redop", "root", "out_of_place", "in_place",
                     "actual_iterations", "experiment_name"]
NCCL_TESTS_SIDE = ["time", "alg_bw", "bus_bw", "nwrong"]


def _assert_nccl_tests_json_layout(doc):
    assert [k for k in doc if k != "ncclpy"] == NCCL_TESTS_TOP
    assert doc["version"] == 3                       # JSON_FILE_VERSION (2.19)
    cfg = [("<step>" if k in ("step_factor", "step_bytes") else k) for k in doc["config"]]
    assert cfg == NCCL_TESTS_CONFIG
    for d in doc["config"]["devices"]:
        assert list(d) == NCCL_TESTS_DEVICE
    for b in ("blocking_collectives", "per_iter_timing", "parallel_init"):
        assert doc["config"][b] in ("true", "false")   # jsonBool writes strings
    for r in doc["results"]:
        assert list(r) == NCCL_TESTS_RESULT
        assert isinstance(r["root"], str) and len(r["root"]) >= 6   # sprintf("%6i")
        for side in ("out_of_place", "in_place"):
            assert list(r[side]) == NCCL_TESTS_SIDE
    assert list(doc["out_of_bounds"]) == ["count", "okay"]
    assert list(doc["average_bus_bandwidth"]) == ["bandwidth", "okay"]


def test_runs_under_ncclpy_run_launcher(runs):
    """No --nproc: the ranks come from an outer launcher (ncclpy run -n 2), as under torchrun,
    mpirun or srun; rank 0 alone prints the table and writes the JSON."""
    cp, js = runs["launcher"]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    table = [ln.split("] ", 1)[-1] for ln in cp.stdout.splitlines()]
    rows = _table_rows("\n".join(table))
    assert [r[0] for r in rows] == ["1024", "2048", "4096"]
    assert all(r[8] == "0" and r[12] == "0" for r in rows), rows
    assert sum("Collective test starting" in ln for ln in table) == 1    # rank 0 only
    doc = json.loads(js.read_text())
    _validate(doc)
    assert doc["ncclpy"]["world_size"] == 2 and len(doc["config"]["devices"]) == 2


def test_gloo_every_collective_is_correct(runs):
    """Every collective in one run (``all``), reducing ones with sum and prod, rooted ones at
    every root: in place and out of place checked against the reference, #wrong = 0."""
    cp, tmp_path = runs["every"]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert cp.stderr.count("[bench]") == 0     # -q
    seen = {}
    for coll in registry.names():
        doc = json.loads((tmp_path / f"r.{coll}.json").read_text())
        _validate(doc)
        assert doc["ncclpy"]["collective"] == coll
        seen[coll] = {(r["redop"], r["root"].strip()) for r in doc["results"]}
        for r in doc["results"]:
            assert r["out_of_place"]["nwrong"] == 0, (coll, r)
            assert r["in_place"]["nwrong"] in (0, None), (coll, r)
            if coll not in ("all_to_all", "send_recv"):
                assert r["in_place"]["nwrong"] == 0, (coll, r)
    assert seen["all_reduce"] == {("sum", "-1"), ("prod", "-1")}
    assert seen["reduce"] == {(op, root) for op in ("sum", "prod") for root in ("0", "1")}
    assert seen["broadcast"] == seen["gather"] == seen["scatter"] == {("none", "0"),
                                                                       ("none", "1")}
    assert seen["all_gather"] == seen["all_to_all"] == seen["send_recv"] == {("none", "-1")}
    assert cp.stdout.count("# Collective test starting:") == len(registry.names())


def test_wrong_result_is_counted(runs):
    cp, js = runs["wrong"]
    assert cp.returncode != 0
    assert "# Out of bounds values : 2 FAILED" in cp.stdout
    row = _table_rows(cp.stdout)[0]
    assert row[8] == "3" and row[12] == "3"
    doc = json.loads(js.read_text())
    _validate(doc)
    assert doc["results"][0]["out_of_place"]["nwrong"] == 3
    assert doc["out_of_bounds"] == {"count": 2, "okay": "false"}


def test_no_check_reports_na_and_single_rank_runs(runs):
    cp = runs["no check"]
    assert cp.returncode == 0, cp.stderr
    row = _table_rows(cp.stdout)[0]
    assert row[:5] == ["8", "2", "float", "sum", "-1"] and row[8] == "N/A" and row[12] == "N/A"


def test_cli_errors_exit_2(runs):
    cp = runs["-G 1"]
    assert cp.returncode == 2 and "CUDA graphs are unsupported" in cp.stderr
    cp = runs["-b > -e"]
    assert cp.returncode == 2 and "-b 1M is larger than -e 1K" in cp.stderr
    # every mistake: one line naming the flag as typed, exit 2, before anything starts
    for i, (args, words) in enumerate(_CLI_MISTAKES):
        cp = runs[f"mistake {i}"]
        assert cp.returncode == 2 and cp.stdout == "", (args, cp.stderr)
        assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
        assert cp.stderr.startswith(f"python -m bench: error: {words}"), cp.stderr
        assert cp.stderr.rstrip().endswith("(see 'python -m bench -h')")


def test_overhead_without_gpu_says_so(runs):
    from gpu_util import cuda_reason
    if not cuda_reason():
        pytest.skip("a GPU is present: the no-GPU message does not apply")
    cp = runs["overhead"]
    assert cp.returncode == 2 and "needs a CUDA GPU" in cp.stderr
    cp, js = runs["overhead cpu"]
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(js.read_text())
    assert [(r["backend"], r["size"], r["mode"]) for r in doc["results"]] == [
        ("torch", 8, "eager"), ("torch", 4096, "eager")]
    r = doc["results"][0]
    assert r["p10_us"] <= r["median_us"] <= r["p90_us"] and r["calls"] == 20


def test_coord_aggregates_across_ranks_like_nccl_tests():
    """-a 0/1/2/3 (rank 0, mean, min, max) and the #wrong sum, over a real store, 3 ranks."""
    from store_util import run_ranks
    from ncclpy.store import TCPStore
    from bench.sweep import AVERAGE_NAMES, Coord

    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
    results = {}

    def rank_main(rank):
        st = TCPStore("127.0.0.1", server.port, timeout=30)
        c = Coord(st, rank, 3, 30)
        value = [3.0, 1.0, 8.0][rank]
        got = {AVERAGE_NAMES[a]: c.reduce(value, AVERAGE_NAMES[a]) for a in range(4)}
        got["sum"] = c.reduce(rank + 1, "sum")
        got["any"] = c.any("rank 2 failed" if rank == 2 else None)
        got["none"] = c.any(None)
        got["gather"] = c.gather(str(rank).encode())
        c.barrier()
        results[rank] = got
        st.close()

    try:
        run_ranks(3, rank_main)
    finally:
        server.close()
    for rank, got in results.items():
        assert (got["rank0"], got["avg"], got["min"], got["max"], got["sum"]) == (3.0, 4.0, 1.0,
                                                                                  8.0, 6.0)
        assert got["any"] == "rank 2 failed" and got["none"] is None
        assert got["gather"] == ([b"0", b"1", b"2"] if rank == 0 else [])
