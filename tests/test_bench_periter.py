"""``-I 1`` / ``-K N`` on ``python -m bench`` (issue 50, item 1): nccl-tests 2.19.6's
per-iteration timing (common.cu ``BenchTime``; util.cu ``computeIterStats``,
``writePerIterReport``, ``writeResultHeader``).

Checked three ways: the statistics against hand-computed values (the nearest-rank percentiles'
edges included), the marks in the timed loop with a recording backend and clock (exact, no
dependence on the machine's speed), and end to end on ncclpy's CPU backend and on gloo (the
header line, the four columns per side, the JSON's ``*_per_iter`` objects)."""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Dict, List

import pytest

from bench import periter
from bench.backends import Buffers, layout
from bench.output import Row, Side, float_str, format_row, table_header
from bench.sweep import SweepConfig, _Rank
from bench_jobs import Commands, Job, start_jobs
from test_bench_nccl_tests_flags import _LoggingCoord, _measure, _Recorder

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_periter")]

KEYS = ["skipped_iterations", "min_us", "max_us", "avg_us", "p50_us", "p95_us", "p99_us",
        "stdev_us", "cv_pct", "times_us"]


# ------------------------------------------------------------------------ the statistics
def test_iter_stats_by_hand():
    st = periter.iter_stats([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (st.min, st.max, st.avg, st.p50, st.p95, st.p99) == (1.0, 5.0, 3.0, 3.0, 5.0, 5.0)
    assert st.stdev == pytest.approx(math.sqrt((4 + 1 + 0 + 1 + 4) / 5))     # population
    assert st.cv_pct == pytest.approx(math.sqrt(2) / 3 * 100)


@pytest.mark.parametrize("n, p50, p95, p99", [
    (1, 1, 1, 1),
    (2, 2, 2, 2),          # sorted[n/2] is the upper middle; p95, p99: the max
    (50, 26, 48, 50),      # n < 100: p99 is the max (nearest rank)
    (99, 50, 95, 99),
    (100, 51, 95, 99),     # p99 below the max from 100 samples on
    (200, 101, 190, 198),
])
def test_nearest_rank_percentiles_as_util_cu(n, p50, p95, p99):
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)                     # sorted inside, as computeIterStats
    st = periter.iter_stats(values)
    assert (st.min, st.max) == (1.0, float(n))
    assert (st.p50, st.p95, st.p99) == (p50, p95, p99)


def test_percentile_index_and_degenerate_samples():
    assert [periter.percentile_index(n, 99) for n in (1, 2, 99, 100, 101, 1000)] == [
        0, 1, 98, 98, 99, 989]
    one = periter.iter_stats([7.0])
    assert (one.min, one.p50, one.p99, one.stdev, one.cv_pct) == (7.0, 7.0, 7.0, 0.0, 0.0)
    assert periter.iter_stats([0.0, 0.0]).cv_pct == 0.0          # avg 0: cv 0, no division
    with pytest.raises(ValueError):
        periter.iter_stats([])


def test_report_is_the_max_over_ranks_with_K_left_out_of_the_statistics():
    ranks = [[10e-6, 1e-6, 2e-6, 3e-6], [1e-6, 2e-6, 1e-6, 6e-6]]
    doc = periter.report(ranks, 1)
    assert list(doc) == KEYS + ["per_process_max_times_us"]        # writePerIterReport's order
    assert doc["times_us"] == pytest.approx([10, 2, 2, 6])          # every sample, K's too
    avg = 10 / 3
    sd = math.sqrt((2 * (2 - avg) ** 2 + (6 - avg) ** 2) / 3)
    assert doc["skipped_iterations"] == 1
    assert [doc[k] for k in KEYS[1:9]] == pytest.approx([2, 6, avg, 2, 6, 6, sd, sd / avg * 100])
    assert doc["per_process_max_times_us"] == [pytest.approx([10, 1, 2, 3]),
                                               pytest.approx([1, 2, 1, 6])]
    alone = periter.report(ranks[:1], 0)
    assert "per_process_max_times_us" not in alone and alone["max_us"] == pytest.approx(10)
    with pytest.raises(ValueError, match="same count"):
        periter.report([[1.0], [1.0, 2.0]], 0)


def test_every_rank_gets_rank_0s_report_over_a_real_store():
    from store_util import run_ranks
    from ncclpy.store import TCPStore
    from bench.sweep import Coord

    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
    got: Dict[int, dict] = {}

    def rank_main(rank):
        st = TCPStore("127.0.0.1", server.port, timeout=30)
        c = Coord(st, rank, 2, 30)
        got[rank] = periter.gather_report(c, [[3e-6, 1e-6, 4e-6], [2e-6, 5e-6, 1e-6]][rank], 0)
        c.barrier()
        st.close()

    try:
        run_ranks(2, rank_main)
    finally:
        server.close()
    assert got[0] == got[1]
    assert got[0]["times_us"] == pytest.approx([3, 5, 4])
    assert len(got[0]["per_process_max_times_us"]) == 2


# ------------------------------------------------------------------------ the marks in the loop
def test_host_clock_marks_each_boundary_after_a_sync_and_the_window_keeps_them():
    # each call 1 s, each sync 100 s of the test's clock: the first mark finds the stream idle,
    # one sync per iteration after it; the row's time is the whole window, those syncs in it
    log, side = _measure(per_iter_timing=True)
    assert log == ["run", "sync", "run", "sync", "sync"]
    assert side.per_iter["times_us"] == pytest.approx([101e6, 101e6])
    assert side.time_us == pytest.approx((2 + 2 * 100 + 100) / 2 * 1e6)
    plain_log, plain = _measure()
    assert plain_log == ["run", "run", "sync"] and side.time_us > plain.time_us
    assert "per_process_max_times_us" not in side.per_iter and plain.per_iter is None


def test_host_clock_with_m_divides_each_sample_by_the_calls_of_the_iteration():
    log, side = _measure(per_iter_timing=True, agg_iters=3, per_iter_skip=1)
    one = ["(", "run", "run", "run", ")"]
    assert log == one + ["sync"] + one + ["sync", "sync"]
    assert side.per_iter["times_us"] == pytest.approx([103 / 3 * 1e6] * 2)
    assert side.per_iter["skipped_iterations"] == 1


def test_host_clock_with_z_3_adds_no_sync_and_leaves_the_barrier_out():
    clock, log = [0.0], []

    class SlowBarrier(_LoggingCoord):
        def barrier(self) -> None:
            super().barrier()
            clock[0] += 1000.0

    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=2, check=0, blocking=3,
                      per_iter_timing=True)
    b = _Recorder(clock, log)
    state = _Rank(cfg, "all_reduce", 0, 1, SlowBarrier(log), [b])
    state.clock = lambda: clock[0]
    bufs = Buffers("all_reduce", "float32", layout("all_reduce", 256, 1, 0), *[None] * 5)
    side = state.bench_time(b, bufs, "sum", -1, False)
    assert log[3:] == ["run", "sync", "barrier"] * 2 + ["sync"]     # as without -I
    assert side.per_iter["times_us"] == pytest.approx([101e6, 101e6])   # no barrier's 1000 s
    assert side.time_us == pytest.approx((2 * 101 + 100) / 2 * 1e6)


class _EventRecorder(_Recorder):
    """A backend with 'CUDA events': each mark logs ``evK`` and reads the test's clock."""

    supports_events = True

    def event_marks(self, n):
        at: List[float] = [0.0] * n

        def record(k: int) -> None:
            self.log.append(f"ev{k}")
            at[k] = self.clock[0]

        return record, lambda j, k: at[k] - at[j]


@pytest.mark.parametrize("blocking, timed", [
    (0, ["ev0", "run", "ev1", "run", "ev2", "sync"]),
    (3, ["ev0", "run", "sync", "ev1", "barrier", "ev2", "run", "sync", "ev3", "barrier",
         "sync"]),                   # common.cu: paired start/stop events with -z 3
])
def test_events_mark_the_boundaries_on_the_stream_and_add_no_sync(blocking, timed):
    clock, log = [0.0], []
    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=2, check=0,
                      blocking=blocking, per_iter_timing=True)
    b = _EventRecorder(clock, log)
    state = _Rank(cfg, "all_reduce", 0, 1, _LoggingCoord(log), [b])
    state.clock = lambda: clock[0]
    bufs = Buffers("all_reduce", "float32", layout("all_reduce", 256, 1, 0), *[None] * 5)
    side = state.bench_time(b, bufs, "sum", -1, False)
    assert log[3:] == timed
    expect = 101e6 if blocking == 3 else 1e6
    assert side.per_iter["times_us"] == pytest.approx([expect, expect])


def test_the_header_line_says_what_timed_the_iterations():
    ev, host = _EventRecorder([0.0], []), _Recorder([0.0], [])
    ev.label, host.label = "ncclpy", "torch/gloo"
    flags = SweepConfig(collectives=["all_reduce"], sizes=[8], per_iter_timing=True,
                        per_iter_skip=2)
    assert periter.header_line([ev], flags) == (
        "# Per-Iteration Report: CUDA event timing; i_* uses max over process rows; summary "
        "skips first 2 iterations ")                          # nccl-tests' line, word for word
    line = periter.header_line([host], flags)
    assert line.startswith("# Per-Iteration Report: host clock timing on torch/gloo (no CUDA "
                           "events there: a sync of the stream or queue and a clock read at "
                           "each iteration boundary; the reported time includes those syncs)")
    flags.per_iter_timing = False
    assert periter.header_line([ev], flags) == ""


# ------------------------------------------------------------------------ the text
def test_table_header_with_I_is_nccl_tests_writeResultHeader():
    lead = "# %10s  %12s  %8s  %6s  %6s"
    e = ("", "", "", "", "")
    fmt = lead + "  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s" * 2 + " "   # tsPad 0: "%*s" is ""
    assert table_header(per_iter=True) == [
        "#",
        lead % e + "              out-of-place (+ per-iteration)                              "
                   "  in-place (+ per-iteration)",
        fmt % ("size", "count", "type", "redop", "root",
               *["time", "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99", "i_cv%"] * 2),
        fmt % ("(B)", "(elements)", "", "", "",
               *["(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)"] * 2),
    ]


def _ends(line: str) -> List[int]:
    return [m.end() for m in re.finditer(r"\S+", line)]


def test_each_side_gets_its_four_columns_after_wrong_under_their_headings():
    pi = {"min_us": 9.62, "max_us": 123.456, "p99_us": 12345.6, "cv_pct": 0.0}
    row = Row("ncclpy", 1024, 256, "float", "float32", "sum", -1,
              Side(10.0, 0.1, 0.1, 0, dict(pi)), Side(11.0, 0.1, 0.1, None, dict(pi)), 5)
    line = format_row(row)
    assert "       0     9.62   123.46  12345.6     0.00    11.00" in line
    assert line.endswith("    N/A     9.62   123.46  12345.6     0.00")
    head = table_header(per_iter=True)
    checked = Row(**{**row.__dict__, "ip": Side(11.0, 0.1, 0.1, 0, dict(pi))})
    # every value ends under its heading (nccl-tests' "    N/A" is a character short of "  %6g":
    # its columns after an unchecked #wrong sit one to the left, as nccl-tests prints them)
    assert _ends(format_row(checked)) == _ends(head[2])[1:]
    multi = table_header(True, cputime=True, timestamps=True, per_iter=True)
    assert multi[2].split()[-6:] == ["i_min", "i_max", "i_p99", "i_cv%", "timestamp", "backend"]


# ------------------------------------------------------------------------ end to end
def _run(commands: Commands, tmp_path: Path, backend: str, *flags: str):
    js = tmp_path / f"{backend.replace(',', '-')}.json"
    cp = commands.module("bench", "all_reduce", "--device", "cpu", "--backend", backend,
                         "--nproc", "2", "-b", "1K", "-e", "2K", "-f", "2", "-n", "5", "-I",
                         "1", "-K", "1", "-q", "-J", str(js), *flags)
    return cp, js


def _ok(cp_js):
    cp, js = cp_js
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return cp.stdout, js


def _rows(out: str) -> List[List[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The module's three 2-rank runs, started together in the background while its
    in-process tests run (tests/bench_jobs.py)."""
    def make(commands: Commands) -> Dict[str, Job]:
        jobs = {b: Job(lambda b=b, tmp=tmp_path_factory.mktemp(b): _run(commands, tmp, b),
                       ["test_cpu_backend_and_gloo_print_the_per_iteration_columns",
                        "test_the_json_holds_every_sample_and_nccl_tests_statistics"])
                for b in ("ncclpy", "torch")}
        tmp = tmp_path_factory.mktemp("z3")
        jobs["z3"] = Job(lambda: _run(commands, tmp, "ncclpy,torch", "-z", "3", "-C", "1",
                                      "-S", "1"),
                         ["test_z_3_C_1_S_1_and_two_backends_keep_nccl_tests_column_order"])
        return jobs
    yield from start_jobs(request, make)


@pytest.fixture(scope="module", params=["ncclpy", "torch"])
def run(request, runs):
    """One 2-rank run per backend: ncclpy's CPU backend and torch on gloo."""
    out, js = _ok(runs[request.param])
    return request.param, out, js


def test_cpu_backend_and_gloo_print_the_per_iteration_columns(run):
    backend, out, _ = run
    label = {"ncclpy": "ncclpy/cpu-backend", "torch": "torch/gloo"}[backend]
    assert (f"# Per-Iteration Report: host clock timing on {label} (no CUDA events there: "
            in out)
    assert "; i_* uses max over process rows; summary skips first 1 iterations \n" in out
    assert "i_min    i_max    i_p99    i_cv%" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["1024", "2048"]
    for r in rows:
        assert len(r) == 5 + 8 + 8
        for side in (r[5:13], r[13:21]):
            i_min, i_max, i_p99, cv = (float(x) for x in side[4:])
            assert 0 < i_min <= i_p99 <= i_max and cv >= 0
            assert side[6] == side[5]      # 4 samples after -K 1: p99 is the max (nearest rank)


def test_the_json_holds_every_sample_and_nccl_tests_statistics(run):
    # results[].out_of_place_per_iter / in_place_per_iter are written by bench/output.py's
    # build_json (util.cu writePerIterReport's keys); this checks them against the samples
    _, out, js = run
    doc = json.loads(js.read_text())
    assert len(doc["results"]) == 2
    for rec, row in zip(doc["results"], _rows(out)):
        for key, cols in (("out_of_place_per_iter", row[9:13]),
                          ("in_place_per_iter", row[17:21])):
            pi = rec[key]
            assert list(pi)[:len(KEYS)] == KEYS
            times = pi["times_us"]
            assert len(times) == 5 and pi["skipped_iterations"] == 1 and min(times) > 0
            st = periter.iter_stats(times[1:])
            assert [pi[k] for k in ("min_us", "max_us", "avg_us", "p50_us", "p95_us",
                                    "p99_us", "stdev_us")] == pytest.approx(
                [st.min, st.max, st.avg, st.p50, st.p95, st.p99, st.stdev])
            assert pi["min_us"] <= pi["p50_us"] <= pi["max_us"]
            per_rank = pi["per_process_max_times_us"]
            assert len(per_rank) == 2 and all(len(r) == 5 for r in per_rank)
            assert [max(col) for col in zip(*per_rank)] == pytest.approx(times)
            assert cols == [float_str(pi[k], 7).strip() for k in ("min_us", "max_us",
                                                                  "p99_us", "cv_pct")]


def test_z_3_C_1_S_1_and_two_backends_keep_nccl_tests_column_order(runs):
    out, _ = _ok(runs["z3"])
    assert ("before its barrier, as -z 3's paired events; no sync added); i_* uses max over "
            "process rows" in out)
    head = next(line for line in out.splitlines() if "#wrong" in line).split()
    assert head[6] == "cputime" and head[10:15] == ["i_min", "i_max", "i_p99", "i_cv%",
                                                    "cputime"]
    assert head[-6:] == ["i_min", "i_max", "i_p99", "i_cv%", "timestamp", "backend"]
    rows = _rows(out)
    assert [r[-1] for r in rows] == ["ncclpy", "torch"] * 2
    for r in rows:     # the timestamp once per row, after the in-place side's columns
        assert len(r) == 21 + 2 + 1
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", r[21]) and re.fullmatch(r"\d\d:\d\d:\d\d", r[22])


@pytest.mark.parametrize("per_iter", [False, True])
def test_the_timestamp_heading_is_util_cus(per_iter):
    """-S 1: writeResultHeader's " %*s" of width 19, "timestamp" over its strftime format."""
    from bench.output import table_header
    i = ("  %7s  %7s  %7s  %7s", ("i_min", "i_max", "i_p99", "i_cv%"), ("(us)",) * 3 + ("(%)",))
    side = "  %7s  %6s  %6s  %6s" + (i[0] if per_iter else "")
    fmt = "# %10s  %12s  %8s  %6s  %6s" + side + side + " %19s"
    names = ("time", "algbw", "busbw", "#wrong") + (i[1] if per_iter else ())
    units = ("(us)", "(GB/s)", "(GB/s)", "") + (i[2] if per_iter else ())
    lines = table_header(timestamps=True, per_iter=per_iter)
    assert lines[2] == fmt % (("size", "count", "type", "redop", "root") + names + names
                              + ("timestamp",))
    assert lines[3] == fmt % (("(B)", "(elements)", "", "", "") + units + units
                              + ("%Y-%m-%d %H:%M:%S",))


def test_the_stdev_is_util_cus_two_pass_sum_of_squared_deviations_to_the_bit():
    """computeIterStats: ``d = sorted[i] - avg; var += d * d`` over the sorted samples, then
    sqrt(var / n): equal in exact arithmetic to other forms (sum (x+avg)(x-avg)), not in bits."""
    s = [1.8989821e-05, 2.3031859e-05, 2.5774467e-05, 1.1877192e-05, 1.056695e-05]
    xs = sorted(s)
    avg = 0.0
    for x in xs:
        avg += x
    avg /= len(xs)
    var = 0.0
    for x in xs:
        d = x - avg
        var += d * d
    assert periter.iter_stats(s).stdev == math.sqrt(var / len(xs)) == 5.991145968655258e-06
