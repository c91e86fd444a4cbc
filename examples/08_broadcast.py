"""Broadcast: every rank receives the root's buffer.

Seeds: 000 §9 (E13), 001 §2 (E16), 002 §7.2 (E22).

  E13  broadcast from 0   rank 0 ones(5,2), others zeros   -> every rank: ones(5,2)
  E16  (1,) values        rank 0: 2, others 1              -> every rank: 2
  E22  3 ranks            rank 0 [1,2,3,4,5], others zeros -> every rank: [1,2,3,4,5]

dist.broadcast(t, src) is in place; so is comm.broadcast(buf, root=src) without a recvbuf.

Run:  python examples/08_broadcast.py            (spawns 4 ranks, then 3 for E22)
      ncclpy run -n 4 python examples/08_broadcast.py
      ncclpy run -n 3 python examples/08_broadcast.py --only E22
      python examples/08_broadcast.py --cpu      (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/08_broadcast.py
"""
from __future__ import annotations

import numpy as np

from _common import Section, array_module, emit, emit_input, main

ROOT = 0


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e13_input(rank: int, world: int) -> np.ndarray:
    """rank 0: torch.ones(5, 2); others: torch.zeros(5, 2)"""
    return (np.ones if rank == ROOT else np.zeros)((5, 2), np.float32)


def e16_input(rank: int, world: int) -> np.ndarray:
    """torch.zeros(1) + (2 on rank 0, 1 elsewhere)"""
    return np.array([2.0 if rank == ROOT else 1.0], np.float32)


def e22_input(rank: int, world: int) -> np.ndarray:
    """rank 0: torch.tensor([1, 2, 3, 4, 5.]); others: torch.zeros(5)"""
    if rank == ROOT:
        return np.array([1, 2, 3, 4, 5], np.float32)
    return np.zeros(5, np.float32)


INPUTS = {"E13": e13_input, "E16": e16_input, "E22": e22_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def _broadcast_in_place(comm, label: str, x_host: np.ndarray) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(x_host)
    emit_input(label, comm.rank, x)
    comm.broadcast(x, root=ROOT).wait()         # dist.broadcast(x, src=0)
    emit(label, comm.rank, x)


def e13(comm) -> None:
    _broadcast_in_place(comm, "E13", e13_input(comm.rank, comm.world_size))


def e16(comm) -> None:
    _broadcast_in_place(comm, "E16", e16_input(comm.rank, comm.world_size))


def e22(comm) -> None:
    _broadcast_in_place(comm, "E22", e22_input(comm.rank, comm.world_size))


SECTIONS = [
    Section("E13", 4, e13, "broadcast ones(5,2) from rank 0 (000 §9)"),
    Section("E16", 4, e16, "broadcast of 2 over 1s (001 §2)"),
    Section("E22", 3, e22, "broadcast [1..5], 3 ranks (002 §7.2)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
