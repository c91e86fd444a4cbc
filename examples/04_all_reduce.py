"""All-reduce: every rank receives op(x_0, ..., x_{n-1}), element-wise.

Seeds: 000 §5 (E6), 001 §2 (E19), 002 §7.4 (E24), 003 (E30), 004 (E35).

  E6   all_reduce SUM, shapes (1,5) and (2,5)   value r   -> every rank: all 6
       (printed as E6-1x5 and E6-2x5)
  E19  ones(1)                                            -> every rank: 4
  E24  3 ranks, (r+1)*ones(5)                             -> every rank: 6s
  E30  [0,1,2,3] + r                                      -> every rank: [6,10,14,18]
  E35  int64 [2,3] + 2r, 6 ranks                          -> every rank: [42,48]

dist.all_reduce(t) is in place; so is comm.all_reduce(buf) without a recvbuf.  Shape does not
matter to NCCL, only the element count: the (2,5) case is 10 elements.
The reduction ops lesson (SUM, PROD, MIN, MAX, AVG, premul_sum; no bitwise ops) is in
12_reduce_ops.py.

E35 is a 2-node x 3-device run in the seed (torchrun over a hostfile); here it runs as 6 ranks
on one node.  For two real nodes: ncclpy run -n 3 --nnodes 2 --node-rank K --master-addr HOST
python examples/04_all_reduce.py --only E35

Run:  python examples/04_all_reduce.py           (spawns 4 ranks, then 3, then 6)
      ncclpy run -n 4 python examples/04_all_reduce.py
      ncclpy run -n 3 python examples/04_all_reduce.py --only E24
      ncclpy run -n 6 python examples/04_all_reduce.py --only E35
      python examples/04_all_reduce.py --cpu     (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/04_all_reduce.py
"""
from __future__ import annotations

import numpy as np

from _common import Section, array_module, emit, emit_input, main


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e6_1x5_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1, 5) * rank"""
    return np.ones((1, 5), np.float32) * rank


def e6_2x5_input(rank: int, world: int) -> np.ndarray:
    """torch.full((2, 5), rank)"""
    return np.full((2, 5), rank, np.float32)


def e19_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1)"""
    return np.ones(1, np.float32)


def e24_input(rank: int, world: int) -> np.ndarray:
    """torch.tensor([rank + 1] * 5)"""
    return np.full(5, rank + 1, np.float32)


def e30_input(rank: int, world: int) -> np.ndarray:
    """torch.tensor([0., 1, 2, 3]) + rank"""
    return np.array([0, 1, 2, 3], np.float32) + rank


def e35_input(rank: int, world: int) -> np.ndarray:
    """torch.tensor([2, 3]) + rank * 2  (int64, as torch.tensor of ints)"""
    return np.array([2, 3], np.int64) + rank * 2


INPUTS = {"E6-1x5": e6_1x5_input, "E6-2x5": e6_2x5_input, "E19": e19_input, "E24": e24_input,
          "E30": e30_input, "E35": e35_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def _all_reduce_in_place(comm, label: str, x_host: np.ndarray) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(x_host)
    emit_input(label, comm.rank, x)
    comm.all_reduce(x, op="sum").wait()         # dist.all_reduce(x, op=ReduceOp.SUM)
    emit(label, comm.rank, x)


def e6(comm) -> None:
    _all_reduce_in_place(comm, "E6-1x5", e6_1x5_input(comm.rank, comm.world_size))
    _all_reduce_in_place(comm, "E6-2x5", e6_2x5_input(comm.rank, comm.world_size))


def e19(comm) -> None:
    _all_reduce_in_place(comm, "E19", e19_input(comm.rank, comm.world_size))


def e24(comm) -> None:
    _all_reduce_in_place(comm, "E24", e24_input(comm.rank, comm.world_size))


def e30(comm) -> None:
    comm.barrier()                              # seed 003 aligns the ranks before each step
    _all_reduce_in_place(comm, "E30", e30_input(comm.rank, comm.world_size))


def e35(comm) -> None:
    _all_reduce_in_place(comm, "E35", e35_input(comm.rank, comm.world_size))


SECTIONS = [
    Section("E6", 4, e6, "all_reduce SUM, shapes (1,5) and (2,5) (000 §5)"),
    Section("E19", 4, e19, "all_reduce of ones(1) (001 §2)"),
    Section("E30", 4, e30, "all_reduce of [0,1,2,3]+r (003)"),
    Section("E24", 3, e24, "all_reduce, 3 ranks (002 §7.4)"),
    Section("E35", 6, e35, "all_reduce of [2,3]+2r, 6 ranks on one node (004: 2 nodes x 3)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
