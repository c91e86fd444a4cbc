"""``ncclpy order`` as a user meets it: the summary per run of elements, ``--element``,
``--json`` (orders one per output element), CANNOT_PREDICT with the reason (exit 1), usage
errors in one line naming the flag (exit 2), --observe without a GPU, a closed pipe."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ncclpy.order.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_summary_lists_runs_and_the_elements_sharing_each_fold(capsys):
    rc, out, err = _run(capsys, "all_reduce", "--ranks", "3", "--count", "12")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == ("ncclpy order: all_reduce ring/simple, 3 ranks, 12 float32, sum, "
                        "1 channel, NCCL 2.28.9")
    assert lines[1].startswith("from NCCL's source, not yet checked on a GPU")
    assert "  elements 0-3                  channel 0  (1 + 2) + 0" in lines
    assert "  elements 8-11                 channel 0  (0 + 1) + 2" in lines
    assert any(ln.startswith("  (2 + 0) + 1") and ln.endswith("4 elements in 1 run")
               for ln in lines)


def test_many_runs_are_summarized_and_elements_can_be_asked_for(capsys):
    rc, out, _ = _run(capsys, "all_reduce", "-n", "4", "--count", "1M", "--proto", "ll",
                      "--channels", "2")
    assert rc == 0
    assert "channels 0..1: 524288 + 524288 elements, chunk of 8192" in out
    assert "more runs (--element E or --json for any element)" in out
    rc, out, _ = _run(capsys, "all_reduce", "-n", "4", "--count", "1M", "--proto", "ll",
                      "--channels", "2", "--element", "0", "8192", "524288")
    assert rc == 0
    assert "  element 0          channel 0  ((1 + 2) + 3) + 0" in out
    assert "  element 8192       channel 0  ((2 + 3) + 0) + 1" in out
    assert "  element 524288     channel 1  ((1 + 2) + 3) + 0" in out


def test_json_has_one_order_per_output_element(capsys):
    rc, out, _ = _run(capsys, "reduce_scatter", "--ranks", "4", "--count", "6", "--ring",
                      "0,2,1,3", "--json", "--element", "5")
    assert rc == 0
    doc = json.loads(out)
    assert doc["verdict"] == "PREDICTED" and doc["rank"] == 0
    assert doc["orders"] == [[2, 1, 3, 0]] * 6
    assert doc["elements"] == [{"element": 5, "order": [2, 1, 3, 0]}]
    assert doc["config"]["rings"] == [[0, 2, 1, 3]]
    assert doc["basis"] == "from NCCL's source, not yet checked on a GPU"
    rc, out, _ = _run(capsys, "all_reduce", "--ranks", "4", "--count", "3", "--algo",
                      "tree", "--json")
    assert json.loads(out)["orders"] == [[0, [2, 1, 3]]] * 3


def test_cannot_predict_is_exit_1_with_the_reason_and_the_order_free_bound(capsys):
    rc, out, _ = _run(capsys, "all_reduce", "--ranks", "4", "--count", "8",
                      "--nccl-version", "2.21.5")
    assert rc == 1
    assert "CANNOT_PREDICT: NCCL 2.21.5 is not a version whose source" in out
    assert "order-free bound, not a prediction" in out
    rc, out, _ = _run(capsys, "reduce", "--ranks", "4", "--count", "8", "--algo", "tree",
                      "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["verdict"] == "CANNOT_PREDICT" and "orders" not in doc
    assert "no Tree kernel for reduce" in doc["reason"]


@pytest.mark.parametrize("argv, msg", [
    (["all_gather", "--ranks", "2", "--count", "4"], "collective: the model covers"),
    (["all_reduce", "--count", "4"], "--ranks: required"),
    (["all_reduce", "--ranks", "2"], "--count: required"),
    (["all_reduce", "-n", "2", "--count", "4", "--algo", "nvls"], "--algo: expected an "
     "algorithm the model covers (ring, tree), got 'nvls'"),
    (["all_reduce", "-n", "2", "--count", "4", "--proto", "ll64"], "--proto: expected"),
    (["all_reduce", "-n", "2", "--count", "4", "--dtype", "int16"], "--dtype: dtype 'int16' "
     "has no NCCL equivalent"),
    (["all_reduce", "-n", "2", "--count", "4", "--dtype", "complex64"], "--dtype: complex64 "
     "travels through NCCL as another type"),
    (["all_reduce", "-n", "3", "--count", "4", "--ring", "0,1"], "--ring: expected each of "
     "the 3 ranks"),
    (["all_reduce", "-n", "3", "--count", "4", "--ring", "a,b"], "--ring: expected ranks in "
     "ring order"),
    (["all_reduce", "-n", "3", "--count", "4", "--element", "4"], "--element: expected an "
     "element 0..3"),
    (["reduce", "-n", "3", "--count", "4", "--root", "3"], "--root: expected a rank 0..2"),
    (["reduce", "-n", "3", "--count", "4", "--rank", "1"], "--rank: only reduce's root (0)"),
    (["all_reduce", "-n", "3", "--count", "4", "--op", "premul_sum:x"], "--op: expected "
     "premul_sum:X with a number X"),
    (["all_reduce", "-n", "3", "--count", "4", "--op", "band"], "--op: expected one of"),
    (["all_reduce", "-n", "3", "--count", "4", "--nccl-version", "two"], "--nccl-version: "
     "expected an NCCL version such as 2.28.9, got 'two'"),
    (["all_reduce", "-n", "3", "--count", "4", "--matrix", "proof"], "--matrix: only with "
     "--observe"),
    (["all_reduce", "-n", "3", "--count", "1x"], "--count: expected a number of elements"),
    (["all_reduce", "-n", "0", "--count", "4"], "-n: expected a number of ranks >= 1"),
    (["all_reduce", "-n", "2", "--count", "4", "--channels", "65"], "--channels: NCCL 2.28.9 "
     "has at most 64 channels"),
    (["all_reduce", "-n", "2", "--count", "4", "--channels", "33", "--nccl-version",
      "2.24.3"], "--channels: NCCL 2.24.3 has at most 32 channels"),
    (["all_reduce", "-n", "2", "--count", "4", "--nthreads", "8"], "--nthreads: expected "
     "threads >= 32"),
])
def test_usage_errors_are_one_line_naming_the_flag(capsys, argv, msg):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ncclpy order: error: "), err
    assert msg in err, err


def test_observe_without_a_gpu_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("ncclpy.info.no_gpu_reason", lambda: "no CUDA driver")
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    rc, out, err = _run(capsys, "all_reduce", "-n", "2", "--count", "4", "--observe")
    assert rc == 2 and out == ""
    assert err == ("ncclpy order --observe: needs a GPU: no CUDA driver (ncclpy order without "
                   "--observe predicts without one)\n")
    rc, _, err = _run(capsys, "all_reduce", "-n", "2", "--count", "4", "--observe", "--json")
    assert rc == 2 and "--json: not with --observe" in err
    rc, _, err = _run(capsys, "--observe", "--matrix", "proof", "all_reduce")
    assert rc == 2 and "--matrix proof runs its own configurations" in err
    rc, _, err = _run(capsys, "--observe", "--matrix", "other")
    assert rc == 2 and "--matrix: expected 'proof'" in err


def test_the_ncclpy_command_runs_it_and_a_closed_pipe_ends_quietly():
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(f"{sys.executable} -m ncclpy order all_reduce -n 8 --count 16M "
                       f"--proto ll --json | head -c 100", shell=True, cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith('{"verdict": "PREDICTED"') and p.stderr == "", p.stderr
    p = subprocess.run([sys.executable, "-m", "ncclpy", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert "order" in p.stdout


def test_nthreads_decides_how_many_channels_a_small_call_uses(capsys):
    """tuning.cc:231: Ring/Simple runs 256 threads where the ring is no faster than PCI; the
    channel tuning (enqueue.cc:1888) then keeps 2 channels for 16383 floats, 512 keeps 1."""
    rc, out, _ = _run(capsys, "all_reduce", "-n", "3", "--count", "16383", "--channels", "2")
    assert rc == 0 and "split: channels 0..0: 16383 elements" in out
    rc, out, _ = _run(capsys, "all_reduce", "-n", "3", "--count", "16383", "--channels", "2",
                      "--nthreads", "256")
    assert rc == 0 and "split: channels 0..1: 8192 + 8191 elements" in out


@pytest.mark.parametrize("value, reads, why", [
    ("1048576", 1048576, ""), ("0x100000", 1048576, ""), ("01000000", 262144, ""),
    ("4M", 4, "it stops at 'M'"), ("junk", 0, "no digits")])
def test_buffer_variables_are_read_as_nccl_reads_them(capsys, monkeypatch, value, reads, why):
    from ncclpy.order.args import c_strtoll
    assert c_strtoll(value) == (reads, why)
    monkeypatch.setenv("NCCL_LL_BUFFSIZE", value)
    rc, out, err = _run(capsys, "all_reduce", "-n", "2", "--count", "8", "--proto", "ll",
                        "--json")
    if why:
        assert rc == 2 and f"$NCCL_LL_BUFFSIZE: NCCL reads {value!r} with strtoll as {reads}" \
            in err
    else:
        assert rc == 0 and json.loads(out)["config"]["buffsizes"]["ll"] == reads


def test_observe_under_a_launcher_needs_a_shared_out_directory(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc, _, err = _run(capsys, "all_reduce", "--count", "8", "--observe")
    assert rc == 2 and "--out: required under a launcher" in err
