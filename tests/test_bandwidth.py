"""algbw and busbw as nccl-tests defines them (its src/*.cu ``*GetBw``), and the size convention
of its ``size`` column, pinned on a literal table — not on the registry's own formulas."""
from __future__ import annotations

import pytest

from ncclpy.semantics import registry

#: nccl-tests busbw/algbw factors: all_reduce 2(n-1)/n; all_gather, reduce_scatter, alltoall,
#: gather, scatter (n-1)/n; broadcast, reduce, sendrecv 1 (src/all_reduce.cu AllReduceGetBw ...)
FACTOR = {
    "all_reduce": {1: 0.0, 2: 1.0, 4: 1.5, 8: 1.75},
    "all_gather": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "reduce_scatter": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "all_to_all": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "gather": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "scatter": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "broadcast": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    "reduce": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    "send_recv": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    "barrier": {1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0},
}


@pytest.mark.parametrize("name", sorted(FACTOR))
def test_busbw_factor_is_nccl_tests(name):
    c = registry.get(name)
    for n, want in FACTOR[name].items():
        assert c.busbw_factor(n) == pytest.approx(want), (name, n)
    if name not in ("broadcast", "reduce", "send_recv"):
        assert c.busbw_factor(0) == 0.0


def test_bandwidths_in_gb_per_s_of_1e9_bytes():
    ar = registry.get("all_reduce")
    assert ar.bandwidths(4_000_000_000, 2.0, 4) == pytest.approx((2.0, 3.0))
    assert registry.get("all_gather").bandwidths(1_000_000, 1e-3, 2) == pytest.approx((1.0, 0.5))
    assert ar.bandwidths(1000, 0.0, 4) == (0.0, 0.0)          # no time measured: no figure
    assert ar.bandwidths(1000, -1.0, 4) == (0.0, 0.0)


#: (total elements = the size column / itemsize, nranks 4, itemsize 4) -> (send, recv) bytes
#: per rank, the count NCCL is given, and what total must be a multiple of
SIZES = {
    "all_reduce": ((4800, 4800), 1200, 1), "reduce": ((4800, 4800), 1200, 1),
    "broadcast": ((4800, 4800), 1200, 1), "send_recv": ((4800, 4800), 1200, 1),
    "all_gather": ((1200, 4800), 300, 4), "reduce_scatter": ((4800, 1200), 300, 4),
    "all_to_all": ((4800, 4800), 300, 4), "gather": ((1200, 4800), 300, 4),
    "scatter": ((4800, 1200), 300, 4), "barrier": ((0, 0), 0, 1),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_sizes_follow_the_nccl_tests_convention(name):
    c = registry.get(name)
    sizes, count, div = SIZES[name]
    assert c.sizes(1200, 4, 4) == sizes
    assert c.param_count(1200, 4) == count
    assert c.divisor(4) == div
    assert c.divisor(1) == 1


def test_a_total_not_a_multiple_of_the_ranks_is_cut_to_whole_blocks():
    assert registry.get("all_gather").sizes(10, 4, 1) == (2, 8)
    assert registry.get("reduce_scatter").sizes(10, 4, 1) == (8, 2)
