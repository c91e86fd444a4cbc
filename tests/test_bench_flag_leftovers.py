"""What issue 50 noted and left on ``python -m bench`` and the collective names: ``-T`` bounds only
the stream synchronisations (nccl-tests' ``testStreamSynchronize``), never the waits for the
other ranks; ``-w 0`` with a case gloo refuses is the usual skip line, not a traceback; an op
NCCL lacks is said with "op" once; ``ncclRecv`` names the send/recv test as ``ncclSend`` does."""
from __future__ import annotations

import json
from typing import Dict

import pytest

from ncclpy.semantics import registry
from ncclpy.comm.prepared import _call_name

from bench.cli import parse_args
from bench_jobs import Commands, Job, start_jobs

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_flag_leftovers")]


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The three commands below (two of them 2 or 3 gloo ranks), started together in the
    background while the in-process tests run (tests/bench_jobs.py)."""
    def make(commands: Commands) -> Dict[str, Job]:
        run = commands.module
        js = tmp_path_factory.mktemp("small_T") / "r.json"
        return {
            "small -T": Job(lambda: (run(
                "bench", "all_reduce", "--backend", "torch", "--device", "cpu", "--nproc", "3",
                "-b", "8", "-e", "1M", "-f", "4", "-n", "1", "-c", "1", "-q", "-T", "0.01",
                "-J", str(js), timeout=240), js), ["test_a_small_T_does_not_trip_the_start_up"]),
            "-w 0": Job(lambda: run(
                "bench", "all_reduce", "--backend", "torch", "--device", "cpu", "--nproc", "2",
                "-w", "0", "-o", "avg,sum", "-d", "int8", "-b", "8", "-e", "8", "-n", "1", "-c",
                "1", "-q", timeout=240), ["test_w_0_with_a_case_gloo_refuses_is_a_skip_line"]),
            "plan band": Job(lambda: run("ncclpy", "plan", "all_reduce", "--op", "band",
                                         timeout=120), ["test_a_bitwise_op_is_said_with_op_once"]),
        }
    yield from start_jobs(request, make)


# ------------------------------------------------------------------------ -T: stream syncs only
@pytest.mark.parametrize("argv, sync", [
    (["-T", "0.01"], 0.01), (["--timeout", "45"], 45.0), (["-T", "0"], None), ([], None)])
def test_T_sets_the_stream_bound_and_leaves_the_rank_waits_at_300_s(argv, sync):
    cfg = parse_args(["all_reduce", "--device", "cpu", *argv])
    assert cfg.sync_timeout == sync and cfg.timeout == 300.0


def test_a_small_T_does_not_trip_the_start_up(runs):
    """-T 0.01 used to bound the store and the process group too: 3 gloo ranks timed out
    waiting for each other at set-up (StoreTimeout / DistStoreError)."""
    cp, js = runs["small -T"]
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    ext = json.loads(js.read_text())["ncclpy"]
    assert (ext["timeout"], ext["stream_timeout"]) == (300.0, 0.01)


def test_T_help_says_it_bounds_only_the_stream_syncs(capsys):
    with pytest.raises(SystemExit):
        parse_args(["-h"])
    text = " ".join(capsys.readouterr().out.split())
    assert "bounds only the stream syncs" in text and "keep their own bound of 300 s" in text


# ---------------------------------------------------------------------- -w 0: a skip, no traceback
def test_w_0_with_a_case_gloo_refuses_is_a_skip_line(runs):
    """gloo cannot average int8 (a RuntimeError of torch): with -w 0 there was no warm-up to
    find that out, and the measurement ended in a traceback."""
    cp = runs["-w 0"]
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "Traceback" not in cp.stderr, cp.stderr
    assert ("# torch/gloo: skipped all_reduce int8 avg root -1: RuntimeError: result type Float "
            "can't be cast to the desired output type Char") in cp.stdout
    rows = [ln.split() for ln in cp.stdout.splitlines() if ln and not ln.startswith("#")]
    assert len(rows) == 1 and rows[0][3] == "sum" and rows[0][8] == rows[0][12] == "0", rows


# ------------------------------------------------------------------------ an op NCCL lacks
def test_a_bitwise_op_is_said_with_op_once(runs):
    cp = runs["plan band"]
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    line = cp.stderr.strip().splitlines()[-1]
    assert line.startswith("ncclpy plan: error: --op: 'band': NCCL has no bitwise reductions"), \
        line
    assert "op 'band'" not in line and line.count("op:") == 1, line     # was "--op: op 'band'"


# ------------------------------------------------------------------------ NCCL's names
@pytest.mark.parametrize("name", ["ncclRecv", "Recv", "NCCLRECV", "ncclSend", "sendrecv_perf"])
def test_ncclRecv_names_the_send_recv_test_as_ncclSend_does(name):
    assert registry.get(name).name == "send_recv"
    assert parse_args([name, "--device", "cpu"]).collectives == ["send_recv"]


def test_prepare_keeps_ncclSend_and_ncclRecv_the_single_calls():
    """comm.prepare's own send and recv calls: NCCL's names of them are those calls, not the
    registry's send/recv test."""
    assert [_call_name(n) for n in ("ncclSend", "ncclRecv", "send", "recv", "ncclAllReduce")] \
        == ["send", "recv", "send", "recv", "all_reduce"]
