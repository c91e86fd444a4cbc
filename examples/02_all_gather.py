"""All-gather: every rank receives every rank's buffer, in rank order.

Seeds: 000 §3 (E3, E4), 001 §2 (E21), 002 §7.6 (E26), 003 (E32), 004 (E34).

  E3   row all_gather      rank r holds ones(1,5)*r        -> every rank: (4,5), row i = i
  E4   column all_gather   rank r holds (5,2), col j=10r+j -> every rank: (5,8) as E2
  E21  list form           ones(1)                         -> every rank: [1,1,1,1]
  E26  3 ranks, list form  (r+1)*ones(5)                   -> every rank: [1s, 2s, 3s]
  E32  all_gather_into_tensor of E31's reduce_scatter output [6+4r] -> [6,10,14,18]
  E34  all_gather of randn(4), list form, 6 ranks          -> every rank: all six inputs

torch.distributed.all_gather (list) and all_gather_into_tensor (one buffer) are both
comm.all_gather(sendbuf, recvbuf) with recvbuf a list of world buffers or one world*count buffer.
Columns: rank i's block lands contiguously at offset i*count, so for a dim-1 concatenation
either gather (5,2) blocks and reorder them, or -- shown in E4 -- send the transpose (2,5),
gather rows into (2*world, 5) and transpose back.

E34 is a 2-node x 3-device run in the seed (torchrun over a hostfile); here it runs as 6 ranks
on one node (ncclpy puts several ranks on one GPU when there are fewer GPUs).  For two real
nodes, on node K of 2:
  ncclpy run -n 3 --nnodes 2 --node-rank K --master-addr HOST \
      python examples/02_all_gather.py --only E34

Run:  python examples/02_all_gather.py          (spawns 4 ranks, then 3, then 6)
      ncclpy run -n 4 python examples/02_all_gather.py
      ncclpy run -n 3 python examples/02_all_gather.py --only E26
      ncclpy run -n 6 python examples/02_all_gather.py --only E34
      python examples/02_all_gather.py --cpu    (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/02_all_gather.py
"""
from __future__ import annotations

import numpy as np

import ncclpy
from _common import Section, array_module, column_views, emit, emit_error, emit_input, main


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e3_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1, 5) * rank"""
    return np.ones((1, 5), np.float32) * rank


def e4_input(rank: int, world: int) -> np.ndarray:
    """(5, 2), column j = 10*rank + j"""
    x = np.zeros((5, 2), np.float32)
    for j in range(2):
        x[:, j] = 10 * rank + j
    return x


def e4_layout(rows_of_columns):
    """(2*world, 5) -- every rank's columns as rows, in rank order -> (5, 2*world).
    Works on numpy and CuPy arrays alike."""
    return rows_of_columns.T


def e21_input(rank: int, world: int) -> np.ndarray:
    """torch.ones(1)"""
    return np.ones(1, np.float32)


def e26_input(rank: int, world: int) -> np.ndarray:
    """torch.tensor([rank + 1] * 5)"""
    return np.full(5, rank + 1, np.float32)


def e32_input(rank: int, world: int) -> np.ndarray:
    """Seed 003: the input is E31's reduce_scatter output, i.e. reduce_scatter of
    arange(world)+r summed over ranks: rank r holds [world*r + world*(world-1)/2]."""
    return np.array([world * rank + world * (world - 1) // 2], np.float32)


def e34_input(rank: int, world: int) -> np.ndarray:
    """torch.randn(4), made reproducible: a seeded generator per rank."""
    return np.random.default_rng([34, rank]).standard_normal(4).astype(np.float32)


INPUTS = {"E3": e3_input, "E4": e4_input, "E21": e21_input, "E26": e26_input,
          "E32": e32_input, "E34": e34_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def e3(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(e3_input(comm.rank, comm.world_size))
    emit_input("E3", comm.rank, x)
    out = xp.empty((comm.world_size, 5), np.float32)     # all_gather_into_tensor style
    comm.all_gather(x, out).wait()
    emit("E3", comm.rank, out)


def e4(comm) -> None:
    xp = array_module()
    n = comm.world_size
    x = xp.asarray(e4_input(comm.rank, n))
    emit_input("E4", comm.rank, x)
    # Wrong on purpose: receive straight into the columns of the final (5, 2n) array.
    # Every rank makes this call, and every rank gets the same clear error.
    final = xp.empty((5, 2 * n), np.float32)
    try:
        comm.all_gather(x, column_views(final, 2))
    except ncclpy.NcclpyError as e:
        emit_error("E4", comm.rank, e)
    # Right: send the transpose (2, 5) as contiguous rows, gather (2n, 5), transpose back.
    xt = xp.ascontiguousarray(x.T)
    rows = xp.empty((2 * n, 5), np.float32)
    comm.all_gather(xt, rows).wait()
    emit("E4", comm.rank, e4_layout(rows))


def e21(comm) -> None:
    xp = array_module()
    x = xp.asarray(e21_input(comm.rank, comm.world_size))
    out = [xp.zeros(1, np.float32) for _ in range(comm.world_size)]   # list form
    comm.all_gather(x, out).wait()
    emit("E21", comm.rank, xp.concatenate(out))


def e26(comm) -> None:
    xp = array_module()
    x = xp.asarray(e26_input(comm.rank, comm.world_size))
    emit_input("E26", comm.rank, x)
    out = [xp.zeros(5, np.float32) for _ in range(comm.world_size)]
    comm.all_gather(x, out).wait()
    emit("E26", comm.rank, out)                 # [[1,1,1,1,1],[2,...],[3,...]]


def e32(comm) -> None:
    xp = array_module()
    n = comm.world_size
    # seed 003 runs reduce_scatter_tensor first (E31) and all-gathers its output
    rs_in = xp.arange(n, dtype=np.float32) + comm.rank
    x = xp.zeros(1, np.float32)
    comm.reduce_scatter(rs_in, x).wait()
    emit_input("E32", comm.rank, x)             # [6 + 4r] with 4 ranks
    out = xp.zeros(n, np.float32)
    comm.all_gather(x, out).wait()
    emit("E32", comm.rank, out)


def e34(comm) -> None:
    xp = array_module()
    x = xp.asarray(e34_input(comm.rank, comm.world_size))
    emit_input("E34", comm.rank, x)
    out = [xp.empty_like(x) for _ in range(comm.world_size)]
    comm.all_gather(x, out).wait()
    emit("E34", comm.rank, out)                 # six lists of 4: rank i's input at index i


SECTIONS = [
    Section("E3", 4, e3, "row all_gather (000 §3.1)"),
    Section("E4", 4, e4, "column all_gather (000 §3.2)"),
    Section("E21", 4, e21, "all_gather of ones(1), list form (001 §2)"),
    Section("E32", 4, e32, "all_gather_into_tensor of the reduce_scatter output (003)"),
    Section("E26", 3, e26, "all_gather, 3 ranks (002 §7.6)"),
    Section("E34", 6, e34, "all_gather of randn(4), 6 ranks on one node (004: 2 nodes x 3)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
