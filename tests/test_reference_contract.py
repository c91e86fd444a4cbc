"""Contracts of ncclpy.reference the mutation run found unpinned (docs/testing.md), on
literal values: its documented tie rule for MIN/MAX, the default axis of all_gather, and the
refusals of the data-movement collectives (an op they take none of, ranks with different shapes)."""
from __future__ import annotations

import numpy as np
import pytest

from ncclpy.semantics import reference as R
from ncclpy.errors import ArgumentError


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_tie_of_plus_and_minus_zero_keeps_the_accumulator(op):
    """The module docstring's rule (no bit claim against NCCL for this tie): rank order, the
    first value is kept when the next one is equal."""
    pz, nz = np.array([0.0], np.float32), np.array([-0.0], np.float32)
    out = R.all_reduce([pz, nz], op=op)
    assert not np.signbit(out[0][0]) and not np.signbit(out[1][0])
    out = R.all_reduce([nz, pz], op=op)
    assert np.signbit(out[0][0]) and np.signbit(out[1][0])


def test_max_and_min_take_the_larger_and_smaller_in_rank_order():
    ins = [np.array([1, 5, -2], np.int32), np.array([3, 5, -7], np.int32),
           np.array([2, 0, -1], np.int32)]
    assert R.all_reduce(ins, op="max")[0].tolist() == [3, 5, -1]
    assert R.all_reduce(ins, op="min")[2].tolist() == [1, 0, -7]


def test_all_gather_joins_along_the_first_axis_by_default():
    a = np.array([[1, 2], [3, 4]], np.int32)
    b = np.array([[5, 6], [7, 8]], np.int32)
    out = R.all_gather([a, b])
    assert [o.tolist() for o in out] == [[[1, 2], [3, 4], [5, 6], [7, 8]]] * 2
    assert R.all_gather([a, b], axis=1)[0].tolist() == [[1, 2, 5, 6], [3, 4, 7, 8]]


@pytest.mark.parametrize("coll", ["all_gather", "send_recv", "broadcast", "barrier"])
def test_collectives_without_a_reduction_refuse_an_op(coll):
    ins = [np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int32)]
    with pytest.raises(ArgumentError, match=f"op: {coll} takes no reduction, got 'sum'"):
        getattr(R, coll)(ins, op="sum")


@pytest.mark.parametrize("coll", ["all_gather", "send_recv"])
def test_ranks_with_different_shapes_are_refused(coll):
    ins = [np.arange(2, dtype=np.int32), np.arange(3, dtype=np.int32)]
    with pytest.raises(ArgumentError, match=f"{coll} needs the same shape on every rank, got "
                                            r"\[\(2,\), \(3,\)\]"):
        getattr(R, coll)(ins)


def test_send_recv_shifts_by_one_by_default():
    ins = [np.array([r, r], np.int32) for r in range(3)]
    assert [o.tolist() for o in R.send_recv(ins)] == [[2, 2], [0, 0], [1, 1]]
    assert [o.tolist() for o in R.send_recv(ins, shift=2)] == [[1, 1], [2, 2], [0, 0]]


def test_barrier_leaves_at_the_latest_arrival():
    assert R.barrier(arrivals=[1.0, 3.5, 2.0]) == [3.5, 3.5, 3.5]
    assert R.barrier(world_size=2) == [None, None]
    with pytest.raises(ArgumentError, match="arrivals: expected 3 times, got 2"):
        R.barrier(arrivals=[1.0, 2.0], world_size=3)
