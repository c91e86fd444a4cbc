"""Gather: every rank sends one buffer; the root receives all of them in rank order.

Seeds: 000 §2 (E1, E2), 001 §2 (E20), 002 §7.5 (E25).

  E1   row gather      rank r holds ones(1,5)*r        -> rank 0: (4,5), row i = i
  E2   column gather   rank r holds (5,2), col j=10r+j -> rank 0: (5,8), rows 0 1 10 11 20 21 30 31
  E20  list form       rank r holds ones(1)            -> rank 0: [1,1,1,1]
  E25  3 ranks         rank r holds (r+1)*ones(5)      -> rank 0: [1s, 2s, 3s]

NCCL writes rank i's block to offset i*count of the receive buffer: one contiguous block per
rank.  Gathering rows (dim 0) is therefore just "receive into a (world, 5) buffer".  Gathering
columns (torch.cat(..., dim=1)) cannot write into column views of the final (5, 8) array:
receive the blocks contiguously, (world, 5, 2), and reorder them afterwards.

Run:  python examples/01_gather.py            (spawns 4 ranks, then 3 for E25)
      ncclpy run -n 4 python examples/01_gather.py
      ncclpy run -n 3 python examples/01_gather.py --only E25
      python examples/01_gather.py --cpu      (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/01_gather.py
"""
from __future__ import annotations

import numpy as np

import ncclpy
from _common import Section, array_module, column_views, emit, emit_error, emit_input, main

ROOT = 0


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e1_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1, 5) * rank"""
    return np.ones((1, 5), np.float32) * rank


def e2_input(rank: int, world: int) -> np.ndarray:
    """(5, 2), column j = 10*rank + j"""
    x = np.zeros((5, 2), np.float32)
    for j in range(2):
        x[:, j] = 10 * rank + j
    return x


def e2_layout(blocks):
    """(world, 5, 2) blocks in rank order -> (5, 2*world): torch.cat(gather_list, dim=1).
    Works on numpy and CuPy arrays alike."""
    return blocks.transpose(1, 0, 2).reshape(blocks.shape[1], -1)


def e20_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1)"""
    return np.ones(1, np.float32)


def e25_input(rank: int, world: int) -> np.ndarray:
    """torch.tensor([rank + 1] * 5)"""
    return np.full(5, rank + 1, np.float32)


INPUTS = {"E1": e1_input, "E2": e2_input, "E20": e20_input, "E25": e25_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def e1(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(e1_input(comm.rank, comm.world_size))
    emit_input("E1", comm.rank, x)
    # one (world, 5) receive buffer on the root only; other ranks pass none
    out = xp.empty((comm.world_size, 5), np.float32) if comm.rank == ROOT else None
    comm.gather(x, out, root=ROOT).wait()
    emit("E1", comm.rank, out)                  # non-root ranks print null: they hold nothing


def e2(comm) -> None:
    xp = array_module()
    n = comm.world_size
    x = xp.asarray(e2_input(comm.rank, n))
    emit_input("E2", comm.rank, x)
    if comm.rank == ROOT:
        # Wrong on purpose: receive straight into the columns of the final (5, 2n) array.
        # Column views are not contiguous, and NCCL only writes contiguous blocks: ncclpy refuses
        # (before any NCCL call, so the other ranks need not take part in this attempt).
        final = xp.empty((5, 2 * n), np.float32)
        try:
            comm.gather(x, column_views(final, 2), root=ROOT)
        except ncclpy.NcclpyError as e:
            emit_error("E2", comm.rank, e)
    # Right: receive the (5, 2) blocks contiguously, then lay them side by side.
    blocks = xp.empty((n, 5, 2), np.float32) if comm.rank == ROOT else None
    comm.gather(x, blocks, root=ROOT).wait()
    emit("E2", comm.rank, e2_layout(blocks) if comm.rank == ROOT else None)


def e20(comm) -> None:
    xp = array_module()
    x = xp.asarray(e20_input(comm.rank, comm.world_size))
    # list form, as seed 001: a list of world_size buffers on the root
    out = [xp.zeros(1, np.float32) for _ in range(comm.world_size)] if comm.rank == ROOT else None
    comm.gather(x, out, root=ROOT).wait()
    emit("E20", comm.rank, xp.concatenate(out) if out is not None else None)


def e25(comm) -> None:
    xp = array_module()
    x = xp.asarray(e25_input(comm.rank, comm.world_size))
    emit_input("E25", comm.rank, x)
    out = [xp.zeros(5, np.float32) for _ in range(comm.world_size)] if comm.rank == ROOT else None
    comm.gather(x, out, root=ROOT).wait()
    emit("E25", comm.rank, out)                 # rank 0: [[1,1,1,1,1],[2,...],[3,...]]


SECTIONS = [
    Section("E1", 4, e1, "row gather to rank 0 (000 §2.1)"),
    Section("E2", 4, e2, "column gather, cat on dim 1 (000 §2.2)"),
    Section("E20", 4, e20, "gather of ones(1), list form (001 §2)"),
    Section("E25", 3, e25, "gather, 3 ranks (002 §7.5)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
