"""Reduce-scatter: block r of op(x_0, ..., x_{n-1}) lands on rank r.

Seeds: 000 §7 (E8, E9, E10), 002 §7.8 (E28), 003 (E31).

  E8   list form, chunks (1,5)    row i = 10r+i          -> rank r: 60+4r (60, 64, 68, 72)
  E9   one (4,5) input            as E8                  -> as E8
  E10  column chunks (5,1)        (5,4), col j = 10r+j   -> rank r: a column of 60+4r
  E28  3 ranks                    chunk j = [(r+1), 2(r+1)]**(j+1)
                                                         -> [6,12], [14,56], [36,288]
  E31  reduce_scatter_tensor of arange(4)+r              -> rank r: [6+4r]

dist.reduce_scatter(out, list) and dist.reduce_scatter_tensor(out, tensor) are both
comm.reduce_scatter(sendbuf, recvbuf): sendbuf one world*count buffer or a list of world
buffers.  Columns: the chunks torch.split(data, 1, dim=1) gives are strided views, and a raw
buffer must be contiguous -- ncclpy says so.  Transpose to a contiguous (4,5) copy so each
column becomes a row, reduce-scatter rows, and reshape the (5,) result back to (5,1).

Run:  python examples/06_reduce_scatter.py       (spawns 4 ranks, then 3 for E28)
      ncclpy run -n 4 python examples/06_reduce_scatter.py
      ncclpy run -n 3 python examples/06_reduce_scatter.py --only E28
      python examples/06_reduce_scatter.py --cpu (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/06_reduce_scatter.py
"""
from __future__ import annotations

import numpy as np

import ncclpy
from _common import Section, array_module, column_views, emit, emit_error, emit_input, main


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e8_input(rank: int, world: int) -> np.ndarray:
    """(world, 5), row i = 10*rank + i"""
    x = np.zeros((world, 5), np.float32)
    for i in range(world):
        x[i] = 10 * rank + i
    return x


e9_input = e8_input


def e10_input(rank: int, world: int) -> np.ndarray:
    """(5, world), column j = 10*rank + j"""
    x = np.zeros((5, world), np.float32)
    for j in range(world):
        x[:, j] = 10 * rank + j
    return x


def e28_input(rank: int, world: int) -> list:
    """chunk j = tensor([(rank+1)*1, (rank+1)*2]) ** (j+1), for j in range(world)"""
    base = np.array([(rank + 1) * i for i in range(1, 3)], np.float32)
    return [base ** (j + 1) for j in range(world)]


def e31_input(rank: int, world: int) -> np.ndarray:
    """torch.arange(world, dtype=float32) + rank"""
    return np.arange(world, dtype=np.float32) + rank


INPUTS = {"E8": e8_input, "E9": e9_input, "E10": e10_input, "E28": e28_input,
          "E31": e31_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def e8(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    data = xp.asarray(e8_input(comm.rank, comm.world_size))
    emit_input("E8", comm.rank, data)
    chunks = [data[i:i + 1] for i in range(comm.world_size)]   # rows: contiguous (1,5) views
    out = xp.empty((1, 5), np.float32)
    comm.reduce_scatter(chunks, out, op="sum").wait()
    emit("E8", comm.rank, out)


def e9(comm) -> None:
    xp = array_module()
    data = xp.asarray(e9_input(comm.rank, comm.world_size))  # one (world, 5) buffer
    out = xp.empty((1, 5), np.float32)
    comm.reduce_scatter(data, out, op="sum").wait()
    emit("E9", comm.rank, out)


def e10(comm) -> None:
    xp = array_module()
    n = comm.world_size
    data = xp.asarray(e10_input(comm.rank, n))
    emit_input("E10", comm.rank, data)
    out = xp.empty((5, 1), np.float32)
    # Wrong on purpose: torch.split(data, 1, dim=1) -- (5,1) column views, strided in memory.
    try:
        comm.reduce_scatter(column_views(data, 1), out, op="sum")
    except ncclpy.NcclpyError as e:
        emit_error("E10", comm.rank, e)
    # Right: make each column a contiguous row, reduce-scatter rows, reshape back to (5, 1).
    rows = xp.ascontiguousarray(data.T)         # (world, 5): row j = column j
    col = xp.empty(5, np.float32)
    comm.reduce_scatter(rows, col, op="sum").wait()
    emit("E10", comm.rank, col.reshape(5, 1))


def e28(comm) -> None:
    xp = array_module()
    chunks = [xp.asarray(c) for c in e28_input(comm.rank, comm.world_size)]
    emit_input("E28", comm.rank, chunks)
    out = xp.zeros(2, np.float32)
    comm.reduce_scatter(chunks, out, op="sum").wait()
    emit("E28", comm.rank, out)


def e31(comm) -> None:
    xp = array_module()
    comm.barrier()                              # seed 003 aligns the ranks before each step
    x = xp.asarray(e31_input(comm.rank, comm.world_size))
    emit_input("E31", comm.rank, x)
    out = xp.zeros(1, np.float32)
    comm.reduce_scatter(x, out, op="sum").wait()
    emit("E31", comm.rank, out)


SECTIONS = [
    Section("E8", 4, e8, "reduce_scatter, list of (1,5) chunks (000 §7.1)"),
    Section("E9", 4, e9, "reduce_scatter_tensor, one (4,5) input (000 §7.2)"),
    Section("E10", 4, e10, "column reduce_scatter, (5,1) chunks (000 §7.3)"),
    Section("E31", 4, e31, "reduce_scatter_tensor of arange(4)+r (003)"),
    Section("E28", 3, e28, "reduce_scatter, 3 ranks (002 §7.8)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
