"""nccl-tests' flags on ``python -m bench`` (issue 38, item 8): a pasted nccl-tests line runs as
nccl-tests would run it, or says in one line (exit 2) what is not offered and why.

The flags that change what runs are checked twice: in the timed loop itself (a recording backend
and clock give the exact sequence of calls, waits and barriers, with no dependence on the
machine's speed) and end to end on gloo (the table, header and JSON say what ran)."""
from __future__ import annotations

import contextlib
import json
import re
from typing import List

import pytest

from bench.backends import Backend, Buffers, layout
from bench.cli import main, parse_args
from bench.sweep import Coord, SweepConfig, _Rank
from module_run import run_module

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------ refused in one line
@pytest.mark.parametrize("flags, words", [
    (["-g", "2"], "-g 2: one GPU per rank here; for N GPUs start N ranks with --nproc N"),
    (["--ngpus", "8"], "--ngpus 8: one GPU per rank here"),
    (["-t", "2"], "-t 2: one rank per process here, each on one thread; start N ranks with "
                  "--nproc N"),
    (["-N", "0"], "-N 0: 0 (run forever) is not offered"),
    (["-m", "0"], "-m 0: expected an integer >= 1"),
    (["-m", "4"], "-m 4: aggregates the calls in one NCCL group (ncclGroupStart/End): "
                  "--backend ncclpy or cupy; torch cannot"),
    (["-z", "4"], "-z 4: expected 0 or 1 or 2 or 3"),
    (["--device", "cuda", "-z", "3", "--timer", "events"],
     "-z 3: excludes the barriers from a host-timed window"),
    (["-p", "2"], "-p 2: expected 0 or 1"),
    (["--device", "cuda", "-C", "1", "--timer", "events"],
     "-C 1: reports the host's time; --timer events times the device"),
    (["-y", "1"], "-y 1: every backend here runs on its own stream"),
    (["-u", "-1"], "-u -1: expected an integer >= 0"),
    (["-I", "2"], "-I 2: expected 0 or 1"),
    (["--device", "cuda", "-I", "1", "-G", "2"], "-I 1: per-iteration timing is incompatible "
                                                 "with CUDA graph mode (-G), as in nccl-tests"),
    (["-K", "2"], "-K 2: leaves samples out of -I's statistics: it needs -I/--per_iter_timing 1"),
    (["-I", "1", "-n", "5", "-K", "5"], "-K 5: expected 0 to 4 (fewer than -n/--iters 5"),
    (["-I", "1", "-K", "-1"], "-K -1: expected 0 to 19"),
    (["-D", "1"], "-D 1: nccl-tests' own device-API kernels are not offered"),
    (["-V", "32"], "-V 32: goes with -D"),
    (["-T", "-1"], "-T: expected seconds >= 0 (0: no limit), got '-1'"),
    (["-T", "x"], "-T: expected seconds >= 0 (0: no limit), got 'x'"),
    (["--device", "cuda", "--backend", "torch", "-x", "1"], "-x: needs --backend ncclpy only"),
    (["-x", "1"], "-x 1: sets NCCL's CTA policy, and --device cpu runs no NCCL"),
    (["--device", "cuda", "-x", "3"], "-x: '3' is not a CTA policy"),
    (["--device", "cuda", "-z", "1", "-G", "2"], "-z 1: waits between the calls, which a CUDA "
                                                 "graph (-G) cannot hold"),
    (["--device", "cuda", "-z", "2", "-m", "2"], "-z 2: waits after each call, inside the -m "
                                                 "group"),
    (["-g", "x"], "-g: expected an integer, got 'x'"),
    (["-V", "x"], "-V: expected an integer, got 'x'"),
])
def test_refused_flags_are_one_line_exit_2(flags, words, capsys, monkeypatch):
    import bench.cli
    monkeypatch.setattr(bench.cli, "_no_gpu_reason", lambda: "")     # parse as on a GPU
    device = [] if "--device" in flags else ["--device", "cpu"]
    rc = main(["all_reduce", *device, *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"python -m bench: error: {words}"), err


def test_a_pasted_nccl_tests_line_with_g_2_is_one_line_from_the_command_line():
    cp = run_module("bench", "all_reduce", "-b", "8", "-e", "128M", "-f", "2", "-g", "2",
                    "--device", "cpu", timeout=60)
    assert cp.returncode == 2 and cp.stdout == "" and cp.stderr.count("\n") == 1, cp.stderr
    assert cp.stderr.startswith("python -m bench: error: -g 2: one GPU per rank here"), cp.stderr


def test_accepted_flags_parse_to_nccl_tests_meanings():
    cfg = parse_args(["all_reduce", "--device", "cpu", "-g", "1", "-t", "1", "-p", "1",
                      "-z", "2", "-N", "3", "-C", "1", "-S", "1", "-T", "45", "-y", "0",
                      "-u", "0", "-I", "0", "-K", "0", "-D", "0", "-V", "16", "-m", "1"])
    assert (cfg.blocking, cfg.run_cycles, cfg.parallel_init, cfg.report_cputime,
            cfg.report_timestamps, cfg.agg_iters) == (2, 3, 1, True, True, 1)
    # -T bounds the stream syncs only (nccl-tests' testStreamSynchronize); the waits for the
    # other ranks keep their 300 s, so a small pasted -T cannot trip the start-up
    assert cfg.timeout == 300.0 and cfg.sync_timeout == 45.0
    cfg = parse_args(["all_reduce", "--device", "cpu"])
    assert cfg.timeout == 300.0 and cfg.sync_timeout is None      # no -T: syncs unbounded
    cfg = parse_args(["all_reduce", "--device", "cpu", "--timeout", "0.5"])
    assert cfg.timeout == 300.0 and cfg.sync_timeout == 0.5
    cfg = parse_args(["all_reduce", "--device", "cpu", "-T", "0"])      # nccl-tests' no limit
    assert cfg.timeout == 300.0 and cfg.sync_timeout is None


def test_x_is_nccl_tests_cta_policy_numbers(monkeypatch):
    import bench.cli
    monkeypatch.setattr(bench.cli, "_no_gpu_reason", lambda: "")
    for num, name in (("0", "default"), ("1", "efficiency"), ("2", "zero")):
        assert parse_args(["all_reduce", "--device", "cuda", "-x", num]).cta_policy == name
    cfg = parse_args(["all_reduce", "--device", "cuda", "-m", "4", "--backend", "ncclpy,cupy"])
    assert cfg.agg_iters == 4


# ------------------------------------------------------------------------ the timed loop
class _Recorder(Backend):
    """A backend that logs what the harness asks of it; each call takes 1 s of the test's clock
    and each stream sync 100 s, so the times reported are exact."""

    name = label = "rec"

    def __init__(self, clock: List[float], log: List[str], grouping: bool = True) -> None:
        super().__init__()
        self.clock, self.log, self.grouping = clock, log, grouping

    def run(self, collective, bufs, op, root, in_place) -> None:
        self.log.append("run")
        self.clock[0] += 1.0

    def sync(self) -> None:
        self.log.append("sync")
        self.clock[0] += 100.0

    def group(self):
        @contextlib.contextmanager
        def scope():
            self.log.append("(")
            yield
            self.log.append(")")
        return scope() if self.grouping else None


class _LoggingCoord(Coord):
    def __init__(self, log: List[str]) -> None:
        super().__init__(None, 0, 1, 10.0)
        self.log = log

    def barrier(self) -> None:
        self.log.append("barrier")


def _measure(**flags):
    """(log of the timed part, the Side) of one out-of-place measurement, -n 2."""
    clock, log = [0.0], []
    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=2, check=0, **flags)
    b = _Recorder(clock, log)
    state = _Rank(cfg, "all_reduce", 0, 1, _LoggingCoord(log), [b])
    state.clock = lambda: clock[0]
    lay = layout("all_reduce", 256, 1, 0)
    bufs = Buffers("all_reduce", "float32", lay, None, None, None, None, None)
    side = state.bench_time(b, bufs, "sum", -1, False)
    assert log[:3] == ["run", "sync", "barrier"]           # the untimed call before the window
    return log[3:], side


def test_default_loop_is_calls_back_to_back_then_one_sync():
    log, side = _measure()
    assert log == ["run", "run", "sync"]
    assert side.time_us == pytest.approx((2 + 100) / 2 * 1e6)


def test_m_aggregates_each_iteration_in_one_group_and_divides_by_every_call():
    log, side = _measure(agg_iters=3)
    assert log == ["(", "run", "run", "run", ")", "(", "run", "run", "run", ")", "sync"]
    assert side.time_us == pytest.approx((6 + 100) / 6 * 1e6)   # elapsed / (iters * agg)


@pytest.mark.parametrize("mode, per_iteration", [
    (1, ["run", "sync", "barrier"]),
    (2, ["run", "sync"]),
    (3, ["run", "sync", "barrier"]),
])
def test_z_waits_where_nccl_tests_waits(mode, per_iteration):
    log, side = _measure(blocking=mode)
    assert log == per_iteration * 2 + ["sync"]


def test_z_3_excludes_the_barriers_from_the_time():
    clock, log = [0.0], []

    class SlowBarrier(_LoggingCoord):
        def barrier(self) -> None:
            super().barrier()
            clock[0] += 1000.0

    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=2, check=0, blocking=3)
    b = _Recorder(clock, log)
    state = _Rank(cfg, "all_reduce", 0, 1, SlowBarrier(log), [b])
    state.clock = lambda: clock[0]
    bufs = Buffers("all_reduce", "float32", layout("all_reduce", 256, 1, 0), *[None] * 5)
    side = state.bench_time(b, bufs, "sum", -1, False)
    # two iterations of (1 s call + 100 s sync), the final sync (100 s); no barrier's 1000 s
    assert side.time_us == pytest.approx((2 * 101 + 100) / 2 * 1e6)


def test_C_reports_the_host_time_of_issuing_and_keeps_the_bandwidth_of_the_latency():
    _, latency = _measure()
    _, cpu = _measure(report_cputime=True)
    assert cpu.time_us == pytest.approx(2 / 2 * 1e6)          # the calls, not the stream sync
    assert cpu.busbw == pytest.approx(latency.busbw) and latency.time_us > cpu.time_us


# ------------------------------------------------------------------------ end to end on gloo
def _rows(out: str) -> List[List[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]


def test_nccl_tests_flags_end_to_end_on_gloo(tmp_path):
    """A pasted nccl-tests line (-g 1 -t 1 -p 1 -z 3 -N 2 -C 1 -S 1 -T 60 -m 1) runs: the
    sweep twice, the blocking and parallel-init header lines, a timestamp per row, the JSON's
    config, ``cpu_time`` and the bounds as given."""
    js = tmp_path / "r.json"
    cp = run_module("bench", "all_reduce", "--device", "cpu", "--nproc", "2", "-b", "1K",
                    "-e", "2K", "-f", "2", "-n", "2", "-g", "1", "-t", "1", "-p", "1", "-z", "3",
                    "-N", "2", "-C", "1", "-S", "1", "-T", "60", "-m", "1", "-q", "-J", str(js))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = cp.stdout
    assert "nThread 1 nGpus 1 " in out and " agg iters: 1 " in out
    assert ("# Blocking Enabled: wait and barrier after each outer iteration (-n); time "
            "excludes barrier") in out
    assert "# Parallel Init Enabled:" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["1024", "2048"] * 2                     # -N 2
    for r in rows:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", r[13]) and re.fullmatch(r"\d\d:\d\d:\d\d", r[14])
    doc = json.loads(js.read_text())
    c = doc["config"]
    assert (c["nthreads"], c["ngpus"], c["aggregated_iterations"]) == (1, 1, 1)
    assert (c["blocking_collectives"], c["parallel_init"]) == ("true", "true")
    assert all("cpu_time" in r["out_of_place"] and "time" not in r["out_of_place"]
               for r in doc["results"]) and len(doc["results"]) == 4
    ext = doc["ncclpy"]
    assert [r["cycle"] for r in ext["results"]] == [0, 0, 1, 1]        # -N, -S: ncclpy's own
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", r["timestamp"])
               for r in ext["results"])
    assert (ext["blocking"], ext["run_cycles"], ext["timeout"], ext["stream_timeout"]) == (
        3, 2, 300.0, 60.0)
    import jsonschema
    from pathlib import Path
    schema = json.loads((Path(__file__).resolve().parents[1] / "bench" / "schema.json")
                        .read_text())
    jsonschema.validate(doc, schema)


class _GraphRecorder(_Recorder):
    """A graph replay of ``iters`` calls takes ``iters`` seconds of the test's clock to issue."""

    def capture(self, fn):
        fn()
        return "graph"

    def replay(self, graph) -> None:
        self.log.append("replay")
        self.clock[0] += 2.0

    def release(self, graph) -> None:
        pass


def test_C_with_G_divides_the_cpu_time_by_the_calls_of_one_launch_as_nccl_tests():
    # common.cu: cputimeSec /= iters*agg_iters; only deltaSec is divided by the graph launches
    clock, log = [0.0], []
    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=2, check=0, cudagraph=3,
                      report_cputime=True)
    b = _GraphRecorder(clock, log)
    state = _Rank(cfg, "all_reduce", 0, 1, _LoggingCoord(log), [b])
    state.clock = lambda: clock[0]
    bufs = Buffers("all_reduce", "float32", layout("all_reduce", 256, 1, 0), None, None, None,
                   None, None)
    side = state.bench_time(b, bufs, "sum", -1, False)
    assert log.count("replay") == 3
    assert side.time_us == pytest.approx(3 * 2.0 / 2 * 1e6)     # 6 s of issuing / (2 x 1)


def test_the_header_says_cputime_and_timestamp_as_nccl_tests():
    from bench import output
    plain = output.table_header()
    assert plain[2].split()[6] == "time" and "timestamp" not in plain[2]
    head = output.table_header(False, False, cputime=True, timestamps=True)
    words = head[2].split()
    assert words[6] == "cputime" and words[10] == "cputime" and words[-1] == "timestamp"
    assert len(head[3]) == len(head[2])            # the units line as wide as the labels
