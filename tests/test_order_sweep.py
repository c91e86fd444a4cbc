"""``ncclpy order --sweep``: the sizes at which NCCL's channels, chunking and folds change.

The boundaries asserted here are derived by hand from NCCL's source (enqueue.cc:1864-1890 for
the channel tuning, enqueue.cc:2021-2028 and all_reduce.h:32-64 for the chunks), not read back
from the model; the fast per-element answers of :mod:`ncclpy.order.sweep` are checked against
the model's per-element maps on random configurations."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from ncclpy.order.cli import main
from ncclpy.order.config import OrderConfig
from ncclpy.order.model import predict
from ncclpy.order.pins import Pins
from ncclpy.order.sweep import (SweepError, count_for, differing, distinct_folds, fold_of,
                                format_bytes, parse_sizes, sweep)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASIS = "from NCCL's source, not yet checked on a GPU"


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, sizes", [
    ("1K,4K,64K", [1024, 4096, 65536]),
    ("64K,1K,1K", [1024, 65536]),
    ("8..64", [8, 16, 32, 64]),
    ("8..100", [8, 16, 32, 64]),
    ("1K..1M:4", [1024, 4096, 16384, 65536, 262144, 1048576]),
    ("1KiB,1KB,1k,1.5K,8B,3", [3, 8, 1024, 1536]),
    ("2G", [1 << 31]),
    ("4,8..16", [4, 8, 16]),
])
def test_sizes_are_lists_and_ranges_of_bytes(text, sizes):
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize("text, msg", [
    ("1x", "expected a size in bytes such as 8, 64K"),
    ("1.3", "'1.3' is not a whole number of bytes"),
    ("64..8", "'64..8': the first size (64 bytes) is above the last (8)"),
    ("8..1K:1", "expected a factor >= 2 after ':'"),
    ("0..8", "a range starts at 1 byte or more"),
    ("1K,,4K", "an empty item"),
    ("", "expected sizes such as 1K,64K,4M"),
])
def test_bad_sizes_say_what_is_wrong(text, msg):
    with pytest.raises(SweepError) as e:
        parse_sizes(text)
    assert msg in str(e.value)


def test_sizes_are_bytes_per_rank_as_nccl_tests_counts_them():
    assert count_for("all_reduce", 8, 4096, 2, "bfloat16") == 2048
    assert count_for("reduce", 8, 4096, 4, "float32") == 1024
    # reduce_scatter's size is each rank's input: nranks x count elements
    assert count_for("reduce_scatter", 4, 4096, 4, "float32") == 256
    with pytest.raises(SweepError, match="1001 bytes is not a multiple of 2 bytes"):
        count_for("all_reduce", 8, 1001, 2, "bfloat16")
    with pytest.raises(SweepError, match=r"not a multiple of 12 bytes \(3 ranks x 4-byte"):
        count_for("reduce_scatter", 3, 16, 4, "float32")
    assert format_bytes(98304) == "96 KiB" and format_bytes(6148) == "6148 B"


# -- the fast answers agree with the per-element model --------------------------------------
def test_one_elements_fold_the_distinct_folds_and_differences_match_the_order_maps():
    rng = random.Random(51)
    for _ in range(120):
        coll = rng.choice(["all_reduce", "all_reduce", "reduce_scatter", "reduce"])
        algo = "tree" if coll == "all_reduce" and rng.random() < 0.2 else "ring"
        proto = rng.choice(["ll", "ll128", "simple"])
        n, k = rng.randint(1, 6), rng.randint(1, 4)
        ring = list(range(n))
        rng.shuffle(ring)
        cfg = OrderConfig.make(
            coll, n, rng.randint(1, 6000), dtype=rng.choice(["float32", "bfloat16", "int8"]),
            algo=algo, proto=proto, channels=k, ring=ring, root=rng.randrange(n),
            buffsizes={"ll": rng.choice([256, 4096]), "simple": rng.choice([4096, 16384])},
            max_threads={(algo, proto): 32}, thresholds={(algo, proto): 1})
        rank = cfg.root if coll == "reduce" else rng.randrange(n)
        a, b = predict(cfg), predict(cfg.with_(count=rng.randint(1, 6000)))
        ma, mb = a.order_map(rank), b.order_map(rank)
        for e in rng.sample(range(cfg.count), min(cfg.count, 40)) + [cfg.count - 1]:
            assert fold_of(a, rank, e) == ma.expr(e), (cfg, e)
        assert sorted(map(repr, distinct_folds(a, rank))) == sorted(
            {repr(ma.expr(e)) for e in range(cfg.count)}), cfg
        shared = min(a.config.count, b.config.count)
        want = sum(ma.expr(e) != mb.expr(e) for e in range(shared))
        assert differing(a, b, rank) == want, cfg


# -- boundaries -----------------------------------------------------------------------------
def test_the_tuned_channel_count_changes_where_nccl_source_says():
    """enqueue.cc:1864-1890: nc = nChannels, lowered while nBytes < nc*nThreads*threshold.
    float32, 256 threads, Ring/Simple threshold 64: 16384 bytes a channel, so 2 channels from
    8192 elements (32 KiB), 3 from 12288, 4 from 16384, 5 (all) from 20480."""
    base = OrderConfig.make("all_reduce", 3, 1, channels=5,
                            max_threads={("ring", "simple"): 256})
    sw = sweep(base, parse_sizes("4K,1M"), element=5000)
    found = [(p.count, p.task_channels) for p in sw.points if not p.given]
    assert found == [(8192, 2), (12288, 3), (16384, 4), (20480, 5)]
    for count, nc in found:   # one element less still has the channels before
        assert predict(base.with_(count=count - 1)).split.task_channels == nc - 1
    assert [p.task_channels for p in sw.points if p.given] == [1, 5]
    # reduce_scatter counts nranks x count bytes (ncclFuncMaxSendRecvCount): the same bytes
    rs = OrderConfig.make("reduce_scatter", 4, 1, channels=4,
                          max_threads={("ring", "simple"): 256})
    sw = sweep(rs, parse_sizes("16K,1M"))
    assert [(p.nbytes, p.task_channels) for p in sw.points if not p.given] == [
        (32768, 2), (49152, 3), (65536, 4)]


def test_the_cli_prints_a_row_per_change_and_the_exact_boundaries(capsys):
    rc, out, err = _run(capsys, "all_reduce", "-n", "3", "--channels", "5", "--nthreads",
                        "256", "--sweep", "4K,1M", "--element", "5000")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("ncclpy order --sweep: all_reduce ring/simple, 3 ranks, "
                               "float32, sum, 5 channels, NCCL 2.28.9")
    assert lines[1].startswith(BASIS)
    assert any("fixed by the flags" in ln and "does not port" in ln for ln in lines)
    rows = [ln for ln in lines if ln.startswith(("* ", "4 KiB", "1 MiB"))]
    assert [r.split()[:3] for r in rows[:5]] == [
        ["4", "KiB", "1024"], ["*", "32", "KiB"], ["*", "48", "KiB"], ["*", "64", "KiB"],
        ["*", "80", "KiB"]]
    assert lines[lines.index(rows[0]) + 1] == (
        "  changes: tuned channels 1 -> 2; channels used 1 -> 2; 680 of the first 1024 "
        "elements fold differently")
    assert lines[lines.index(rows[1]) + 1] == ("  changes: tuned channels 2 -> 3; channels used "
                                               "2 -> 3")
    assert "- (beyond the output)" in rows[0]
    assert lines[-1].startswith("to pin this configuration: NCCL_ALGO=Ring NCCL_PROTO=Simple "
                                "NCCL_MIN_NCHANNELS=5 NCCL_MAX_NCHANNELS=5, ")
    assert "NCCL still tunes the channels down for small sizes" in lines[-1]


def test_the_chunking_changes_where_nccl_source_says(capsys):
    """NCCL_BUFFSIZE 4096: chunkSize = 4096/NCCL_STEPS x ALLREDUCE_CHUNKSTEPS(4) = 2048 bytes
    (enqueue.cc:2021-2028), 512 floats; 3 ranks loop over 3 x 512 = 1536 elements, so 1537 is
    the first count with a second loop.  At 1024 elements the one, short loop's chunk is
    alignUp(divUp(1024, 3), 16/4) = 344 (all_reduce.h:36); at 2048 the second loop's rest of
    512 gives alignUp(171, 4) = 172."""
    rc, out, _ = _run(capsys, "all_reduce", "-n", "3", "--buffsize", "4096", "--sweep",
                      "4K,8K")
    assert rc == 0
    lines = out.splitlines()
    assert "loops of 3 chunks of 512 elements" in out
    first = next(ln for ln in lines if ln.startswith("4 KiB"))
    assert first.split()[2:8] == ["1024", "1", "1", "1", "344", "3"]
    i = lines.index(first)
    assert lines[i + 1].startswith("  changes: loops 1 -> 2; ")
    assert lines[i + 2].split()[:7] == ["*", "6148", "B..8", "KiB", "(2)", "1537..2048", "1"]
    assert lines[i + 2].split()[7:11] == ["1", "2", "172", "3"]
    assert lines[-1].startswith("to pin this configuration: NCCL_ALGO=Ring NCCL_PROTO=Simple "
                                "NCCL_MIN_NCHANNELS=1 NCCL_MAX_NCHANNELS=1 NCCL_BUFFSIZE=4096")


def test_an_elements_fold_follows_the_short_loops_chunk(capsys):
    """3 ranks, one channel: 12 floats are chunks of 4 (positions 1, 2, 0 start them), 24
    floats chunks of 8: element 5 moves from chunk 1, (2 + 0) + 1, to chunk 0, (1 + 2) + 0,
    and elements 4-11 of the first 12 fold differently (all_reduce.h:36-64)."""
    rc, out, _ = _run(capsys, "all_reduce", "-n", "3", "--sweep", "48,96", "--element", "5")
    assert rc == 0
    lines = out.splitlines()
    assert lines[-5].endswith("fold of element 5")
    assert lines[-4].startswith("48 B") and lines[-4].endswith("  (2 + 0) + 1")
    assert lines[-3] == ("  changes: 8 of the first 12 elements fold differently; element 5's "
                         "fold changes")
    assert lines[-2].startswith("96 B") and lines[-2].endswith("  (1 + 2) + 0")


def test_sizes_that_fold_alike_share_one_row():
    """A one-channel tree folds every element by tree 0, whatever the size: one row."""
    base = OrderConfig.make("all_reduce", 4, 1, algo="tree")
    sw = sweep(base, parse_sizes("1K..1M:4"), element=100)
    assert len(sw.rows) == 1 and len(sw.rows[0].points) == 6
    assert all(p.differ == 0 for p in sw.points[1:])
    # ncclGetBtree (trees.cc:32-64) at 4 ranks: 0 is the root with child 2, 2 has 1 and 3
    assert {p.element for p in sw.points} == {(0, (2, 1, 3))}


# -- JSON, errors, exit codes ---------------------------------------------------------------
def test_json_has_every_point_the_rows_and_the_pin(capsys):
    rc, out, _ = _run(capsys, "all_reduce", "-n", "3", "--channels", "5", "--nthreads", "256",
                      "--sweep", "4K,1M", "--element", "5000", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["mode"] == "sweep" and doc["verdict"] == "PREDICTED"
    assert doc["basis"] == BASIS and doc["element"] == 5000 and "count" not in doc["config"]
    assert [p["bytes"] for p in doc["points"]] == [4096, 32768, 49152, 65536, 81920, 1048576]
    assert [p["given"] for p in doc["points"]] == [True, False, False, False, False, True]
    assert [p["task_channels"] for p in doc["points"]] == [1, 2, 3, 4, 5, 5]
    p = doc["points"][-1]
    assert sum(p["counts"]) == p["count"] == 262144 and p["channel_hi"] - p["channel_lo"] == 4
    assert doc["points"][0]["element_order"] is None
    rc, one, _ = _run(capsys, "all_reduce", "-n", "3", "--channels", "5", "--nthreads", "256",
                      "--count", "262144", "--element", "5000", "--json")
    assert doc["points"][-1]["element_order"] == json.loads(one)["elements"][0]["order"]
    assert [i for r in doc["rows"] for i in r["points"]] == list(range(6))
    assert doc["rows"][1]["changes"][0] == "tuned channels 1 -> 2"
    pins = Pins.from_env(doc["pin"])
    assert pins.pinned("all_reduce") == ("ring", "simple", "")
    assert pins.pinned_channels() == 5


@pytest.mark.parametrize("argv, msg", [
    (["all_reduce", "-n", "2", "--count", "4", "--sweep", "1K"], "--count: not with --sweep"),
    (["all_reduce", "-n", "2", "--sweep", "1K", "--observe"], "--sweep: not with --observe"),
    (["all_reduce", "-n", "2", "--sweep", "1Q"], "--sweep: expected a size in bytes"),
    (["all_reduce", "-n", "2", "--swe", "1001", "--dtype", "bf16"], "--swe: 1001 bytes is not "
     "a multiple of 2 bytes (the bfloat16 element size)"),
    (["reduce_scatter", "-n", "3", "--sweep", "8..1M"], "--sweep: 8 bytes is not a multiple "
     "of 12 bytes (3 ranks x 4-byte float32"),
    (["all_reduce", "-n", "2", "--sweep", "1K", "--element", "1", "2"], "--element: --sweep "
     "follows one element, got 2 (1 2)"),
    (["all_reduce", "-n", "2", "--sweep", "64,1K", "--element", "256"], "--element: expected "
     "an element 0..255 of the largest size's 256-element output, got 256"),
    (["--sweep", "1K", "-n", "2"], "collective: required"),
    (["all_reduce", "--sweep", "1K"], "--ranks: required"),
    (["reduce", "-n", "3", "--sweep", "1K", "--rank", "1"], "--rank: only reduce's root (0)"),
    (["all_reduce", "-n", "3", "--sweep", "1K", "--proto", "ll64"], "--proto: expected"),
])
def test_usage_errors_are_one_line_naming_the_flag(capsys, argv, msg):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ncclpy order: error: "), err
    assert msg in err, err


def test_cannot_predict_is_exit_1_with_the_reason(capsys):
    rc, out, _ = _run(capsys, "reduce_scatter", "-n", "4", "--algo", "tree", "--sweep", "1K")
    assert rc == 1
    assert out.startswith("ncclpy order --sweep: reduce_scatter tree/simple, 4 ranks")
    assert "CANNOT_PREDICT: NCCL has no Tree kernel for reduce_scatter" in out
    assert "order-free bound, not a prediction" in out
    rc, out, _ = _run(capsys, "all_reduce", "-n", "4", "--nccl-version", "2.21.5", "--sweep",
                      "1K,2K", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["verdict"] == "CANNOT_PREDICT" and "points" not in doc
    assert "NCCL 2.21.5 is not a version whose source" in doc["reason"]


def test_ctrl_c_is_130(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("ncclpy.order.cli.sweep", interrupted)
    rc, out, err = _run(capsys, "all_reduce", "-n", "3", "--sweep", "1K")
    assert rc == 130 and err == "ncclpy order: interrupted\n"


def test_a_closed_pipe_ends_quietly_with_141():
    sizes = ",".join(str(4 * k) for k in range(1, 3001))
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "ncclpy", "order", "all_reduce", "-n", "3",
                          "--sweep", sizes, "--json"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    head = p.stdout.read(200)
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert head.startswith(b'{"mode": "sweep"')
    assert p.returncode == 141 and err == b"", err


def test_element_0_folds_alike_at_every_size():
    """What the docs tell a user: a lone call starts on channel 0 (enqueue.cc:625-629 moves it
    only when the first channel gets no cells) and element 0 is the first chunk's, so a change
    in element 0's bits is no size effect."""
    rng = random.Random(7)
    for _ in range(60):
        n, k = rng.randint(3, 8), rng.randint(1, 8)
        algo, proto = rng.choice(["ring", "tree"]), rng.choice(["ll", "ll128", "simple"])
        base = OrderConfig.make("all_reduce", n, 1, algo=algo, proto=proto, channels=k,
                                dtype=rng.choice(["float32", "bfloat16"]))
        sw = sweep(base, parse_sizes("16..64M:8"), element=0)
        assert len({p.element for p in sw.points}) == 1, base


def test_limits_are_said_not_hidden(capsys, monkeypatch):
    monkeypatch.setattr("ncclpy.order.sweep.MAX_BOUNDARIES", 2)
    monkeypatch.setattr("ncclpy.order.cli.MAX_BOUNDARIES", 2)
    monkeypatch.setattr("ncclpy.order.sweep.MAX_RUNS", 1)
    rc, out, _ = _run(capsys, "all_reduce", "-n", "3", "--channels", "5", "--nthreads", "256",
                      "--sweep", "4K,1M")
    assert rc == 0
    assert "(more than 2 changes between 4 KiB and 1 MiB: the rest not searched)" in out
    assert "folds not compared (too many runs)" in out
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("* ") and "KiB" in ln] \
        == ["32", "48"]
