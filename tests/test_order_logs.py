"""The NCCL debug-log parser (ncclpy/order/logs.py) on lines written with NCCL's own format
strings (tests/order_logs_util.py): version, channels, rings, trees, tuning tables, buffer-size
overrides, tuner plugins, per-call lines (Ring/Tree, NVLS, symmetric), and one block per
communicator."""
from __future__ import annotations

import pytest

from order_logs_util import call_line, comm_block, info
from ncclpy.order.logs import LogError, merge_rings, merge_trees, parse_log
from ncclpy.order.topology import default_trees

RINGS = [[0, 2, 1], [0, 1, 2]]
TREES = default_trees(3, 2)


def _text(rank: int, extra=(), head=("NCCL version 2.28.9+cuda13.0",)) -> str:
    msgs = list(head) + comm_block(rank, 3, 2, RINGS, TREES,
                                   max_threads={("ring", "simple"): 256}) + list(extra)
    return "\n".join(info(m) for m in msgs) + "\n"


def test_a_block_holds_what_nccl_printed_at_init() -> None:
    (b,) = parse_log(_text(0))
    assert (b.version, b.rank, b.nranks, b.nnodes, b.channels) == (22809, 0, 3, 3, 2)
    assert b.ring == {0: (1, 2), 1: (2, 1)}
    assert b.tree[0] == TREES[0][0] and b.tree[1] == TREES[1][0]
    assert b.thresholds[("ring", "ll")] == 24 and b.thresholds[("tree", "simple")] == 64
    assert b.max_threads[("ring", "simple")] == 256
    assert b.max_threads[("tree", "ll128")] == 640
    assert b.tuner == "" and b.calls == []


def test_call_lines_become_calls_in_order() -> None:
    extra = [call_line("AllReduce", 48, "RING", "LL", 0, 0),
             call_line("ReduceScatter", 4000, "RING", "SIMPLE", 0, 1),
             call_line("AllReduce", 1 << 20, "NVLS", "SIMPLE", 0, 15),
             "AllReduce [Symmetric]: 1024 Bytes -> Kernel AllReduce_AGxLL_R nchannels 2 "
             "nthreads 512 nWorks 1"]
    (b,) = parse_log(_text(0, extra))
    got = [(c.func, c.nbytes, c.algo, c.proto, c.channel_lo, c.channel_hi, c.symmetric)
           for c in b.calls]
    assert got == [("all_reduce", 48, "ring", "ll", 0, 0, False),
                   ("reduce_scatter", 4000, "ring", "simple", 0, 1, False),
                   ("all_reduce", 1 << 20, "nvls", "simple", 0, 15, False),
                   ("all_reduce", 1024, "symmetric", "", -1, -1, True)]
    assert b.calls[3].kernel == "AllReduce_AGxLL_R"


def test_each_communicator_is_its_own_block_and_globals_carry_over() -> None:
    head = ("NCCL version 2.30.7+cuda13.0", "NCCL_BUFFSIZE set by environment to 1048576.",
            "TUNER/Plugin: Using example (v5)")
    text = _text(1, head=head) + _text(1, head=())
    blocks = parse_log(text)
    assert len(blocks) == 2
    for b in blocks:
        assert b.version == 23007 and b.env["NCCL_BUFFSIZE"] == "1048576"
        assert b.tuner.startswith("TUNER/Plugin: Using example")
        assert b.rank == 1


def test_lines_that_are_not_nccl_info_are_ignored() -> None:
    text = "random output\n" + info("NCCL version 2.28.9+cuda13.0") + "\n" + \
        "gpu-host:1:2 [0] NCCL WARN something\n"
    assert parse_log(text) == []


def test_rings_and_trees_merge_from_every_rank() -> None:
    logs = [parse_log(_text(r))[0] for r in range(3)]
    assert merge_rings(logs, 2) == ((0, 2, 1), (0, 1, 2))
    assert merge_trees(logs, 2) == tuple(TREES)


def test_a_missing_rank_or_a_broken_ring_is_a_log_error() -> None:
    logs = [parse_log(_text(r))[0] for r in range(3)]
    with pytest.raises(LogError, match="no 'Ring 01' line in rank 1"):
        del logs[1].ring[1]
        merge_rings(logs, 2)
    logs = [parse_log(_text(r))[0] for r in range(3)]
    logs[2].ring[0] = (0, 0)                      # next of 2 is 0: 1 is never reached
    with pytest.raises(LogError, match="do not make one ring"):
        merge_rings(logs, 1)
    logs = [parse_log(_text(r))[0] for r in range(3)]
    del logs[0].tree[1]
    with pytest.raises(LogError, match=r"no '\[1\]' entry in rank 0"):
        merge_trees(logs, 2)
