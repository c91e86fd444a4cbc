"""Reduction ops: SUM, PROD, MIN, MAX, AVG, premul_sum -- and why BAND/BOR/BXOR fail.

Seeds: 004 lists torch's ReduceOps SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM;
002 adds AVG ("only available with the NCCL backend").

  OPS.<op>  all_reduce of x_r = [r+1, -(r+1), 2**r, 8-r] (float32, 4 ranks) with each op:
            sum [10,-10,15,26]  prod [24,24,64,1680]  min [1,-4,1,5]  max [4,-1,8,8]
            avg [2.5,-2.5,3.75,6.5]  premul_sum(0.5) [5,-5,7.5,13]
  OPS.band, OPS.bor, OPS.bxor  (int32): NCCL has no bitwise reductions; ncclpy says so
            before any NCCL call (torch only has them on gloo/MPI).

Ops are given as strings ("sum", "prod", "min", "max", "avg"), as ncclpy.SUM/PROD/MIN/MAX/AVG,
or as torch.distributed.ReduceOp values; premul_sum needs its scalar: ncclpy.premul_sum(0.5)
computes sum(0.5 * x_r) with NCCL's ncclRedOpCreatePreMulSum.  AVG is NCCL's native ncclAvg.

Run:  python examples/12_reduce_ops.py           (spawns 4 ranks)
      ncclpy run -n 4 python examples/12_reduce_ops.py
      python examples/12_reduce_ops.py --cpu     (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/12_reduce_ops.py
"""
from __future__ import annotations

import numpy as np

import ncclpy
from _common import Section, array_module, emit, emit_error, emit_input, main

#: label suffix -> the op argument passed to comm.all_reduce
OPS = {
    "sum": "sum",
    "prod": "prod",
    "min": "min",
    "max": "max",
    "avg": "avg",
    "premul_sum": ncclpy.premul_sum(0.5),
}
BITWISE = ("band", "bor", "bxor")


def ops_input(rank: int, world: int) -> np.ndarray:
    """[r+1, -(r+1), 2**r, 8-r]: exact in float32 for every op at 4 ranks."""
    return np.array([rank + 1, -(rank + 1), 2 ** rank, 8 - rank], np.float32)


def bitwise_input(rank: int, world: int) -> np.ndarray:
    """int32 bit patterns: 1 << rank, and all ones."""
    return np.array([1 << rank, -1], np.int32)


INPUTS = {f"OPS.{name}": ops_input for name in OPS}

#: what every rank holds after all_reduce with each op (4 ranks); the CPU test checks these
#: against ncclpy.reference, the GPU test checks the printed values against them
EXPECTED = {
    "OPS.sum": [10, -10, 15, 26],
    "OPS.prod": [24, 24, 64, 1680],
    "OPS.min": [1, -4, 1, 5],
    "OPS.max": [4, -1, 8, 8],
    "OPS.avg": [2.5, -2.5, 3.75, 6.5],
    "OPS.premul_sum": [5, -5, 7.5, 13],
}


def ops(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(ops_input(comm.rank, comm.world_size))
    emit_input("OPS", comm.rank, x)
    for name, op in OPS.items():
        out = xp.empty_like(x)
        comm.all_reduce(x, out, op=op).wait()   # out of place: x stays the input
        emit(f"OPS.{name}", comm.rank, out)
    bits = xp.asarray(bitwise_input(comm.rank, comm.world_size))
    for name in BITWISE:                        # dist.ReduceOp.BAND etc. would fail the same way
        try:
            comm.all_reduce(bits, op=name)
        except ncclpy.NcclpyError as e:
            emit_error(f"OPS.{name}", comm.rank, e)


SECTIONS = [
    Section("OPS", 4, ops, "all_reduce with every op; bitwise ops refused (004, 002)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
