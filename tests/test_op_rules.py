"""ncclpy's refusals held to NCCL's and torch's rules as tests/gpu/_op_rules.py writes them out
(issue 40): the GPU matrix decides from that table, not from ncclpy, which op/dtype pairs must
work, so a wrong refusal fails there; here, without a GPU, every reducing planner must accept
exactly the pairs the table says and refuse the others with UnsupportedError, on each NCCL
version and world size where the rules change."""
from __future__ import annotations

import os
import sys

import pytest

from ncclpy.buffers.buffer import Buffer, as_buffer
from ncclpy.semantics.dtypes import LOGICAL
from ncclpy.errors import UnsupportedError
from ncclpy.semantics.ops import premul_sum
from ncclpy.plan.collectives import plan_all_reduce, plan_reduce, plan_reduce_scatter
from ncclpy.plan.types import PlanContext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from _op_rules import OPS, VALID, must_work  # noqa: E402

PTR = 0x7F00_0000_0000
# below and at each version where an op or a dtype arrives, and today's
VERSIONS = (20907, 21000, 21004, 21100, 22309, 22400, 22809, 23007)
PLANNERS = {"all_reduce": lambda c, b, op: plan_all_reduce(c, b, op=op),
            "reduce": lambda c, b, op: plan_reduce(c, b, root=0, op=op),
            "reduce_scatter": lambda c, b, op: plan_reduce_scatter(c, b, op=op)}


def test_the_table_is_written_for_every_dtype():
    assert set(VALID) == set(LOGICAL) and set(OPS) == {"sum", "prod", "max", "min", "avg",
                                                      "premul_sum"}
    assert must_work("int32", "avg", 22809, 2)              # NCCL: SumPostDiv on integers
    assert must_work("float8_e4m3", "avg", 22809, 2)
    assert not must_work("float8_e4m3", "avg", 22809, 1)    # no float8 one-rank kernel
    assert not must_work("complex64", "max", 22809, 2) and not must_work("bool", "avg", 22809, 2)
    assert not must_work("float32", "avg", 20907, 2)        # ncclAvg arrived in 2.10


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("collective", list(PLANNERS))
def test_ncclpy_accepts_exactly_what_the_rules_allow(collective, world, version):
    wrong = []
    for dtype in VALID:
        for op in OPS:
            buf = as_buffer(Buffer(PTR, 4 * world, dtype, 0))
            try:
                PLANNERS[collective](PlanContext(0, world, 0, version, False), buf,
                                     premul_sum(2.0) if op == "premul_sum" else op)
                accepted = True
            except UnsupportedError as e:
                accepted = False
                assert dtype in str(e) or op in str(e), str(e)    # the refusal says which
            if accepted != must_work(dtype, op, version, world):
                wrong.append(f"{op} on {dtype}: " + ("accepted" if accepted else "refused"))
    assert not wrong, wrong
