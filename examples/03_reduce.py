"""Reduce: the root receives op(x_0, ..., x_{n-1}); the other ranks' buffers are untouched.

Seeds: 000 §4 (E5), 001 §2 (E18), 002 §7.3 (E23).

  E5   reduce SUM to rank 0   rank r holds ones(1,5)*r    -> rank 0: all 6; others keep input
  E18  reduce of ones(1)      1 on every rank             -> rank 0: 4
  E23  3 ranks                (r+1)*ones(5)               -> rank 0: 6s; ranks 1, 2 unchanged

torch's dist.reduce(tensor, dst) works in place; comm.reduce(buf, root=...) with no recvbuf does
the same (NCCL in place: recvbuf == sendbuf).  NCCL leaves the receive buffer of non-root ranks
alone, so with in-place they keep their input -- what the seed prints as "undefined".
Other reductions (prod, min, max, avg, premul_sum) are in 12_reduce_ops.py.

Run:  python examples/03_reduce.py               (spawns 4 ranks, then 3 for E23)
      ncclpy run -n 4 python examples/03_reduce.py
      ncclpy run -n 3 python examples/03_reduce.py --only E23
      python examples/03_reduce.py --cpu         (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/03_reduce.py
"""
from __future__ import annotations

import numpy as np

from _common import Section, array_module, emit, emit_input, main

ROOT = 0


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e5_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1, 5) * rank"""
    return np.ones((1, 5), np.float32) * rank


def e18_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1)"""
    return np.ones(1, np.float32)


def e23_input(rank: int, world: int) -> np.ndarray:
    """torch.tensor([rank + 1] * 5)"""
    return np.full(5, rank + 1, np.float32)


INPUTS = {"E5": e5_input, "E18": e18_input, "E23": e23_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def _reduce_in_place(comm, label: str, x_host: np.ndarray) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(x_host)
    emit_input(label, comm.rank, x)
    comm.reduce(x, root=ROOT, op="sum").wait()  # dist.reduce(x, dst=0, op=ReduceOp.SUM)
    emit(label, comm.rank, x)                   # root: the sum; others: their input


def e5(comm) -> None:
    _reduce_in_place(comm, "E5", e5_input(comm.rank, comm.world_size))


def e18(comm) -> None:
    _reduce_in_place(comm, "E18", e18_input(comm.rank, comm.world_size))


def e23(comm) -> None:
    _reduce_in_place(comm, "E23", e23_input(comm.rank, comm.world_size))


SECTIONS = [
    Section("E5", 4, e5, "reduce SUM to rank 0 (000 §4)"),
    Section("E18", 4, e18, "reduce of ones(1) (001 §2)"),
    Section("E23", 3, e23, "reduce, 3 ranks (002 §7.3)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
