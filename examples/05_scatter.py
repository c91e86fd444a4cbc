"""Scatter: the root holds world blocks; rank r receives block r.

Seeds: 000 §6 (E7), 001 §2 (E17), 002 §7.7 (E27).

  E7   scatter from 0      rank 0 holds (4,5), row i = i          -> rank r: five r's
  E17  list form           rank 0 holds [1],[2],[3],[4]           -> rank r: r+1
  E27  3 ranks, list form  rank 0 holds [1s, 2s, 3s] (5 each)     -> rank r: (r+1)s

dist.scatter(out, scatter_list, src) is comm.scatter(sendbuf, recvbuf, root): sendbuf (one
world*count buffer or a list of world buffers) only on the root, None elsewhere.  Rows of a
C-order array are contiguous, so scattering rows needs no copy.

Run:  python examples/05_scatter.py              (spawns 4 ranks, then 3 for E27)
      ncclpy run -n 4 python examples/05_scatter.py
      ncclpy run -n 3 python examples/05_scatter.py --only E27
      python examples/05_scatter.py --cpu        (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/05_scatter.py
"""
from __future__ import annotations

import numpy as np

from _common import Section, array_module, emit, emit_input, main

ROOT = 0


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e7_input(rank: int, world: int):
    """Root: torch.arange(world).float().unsqueeze(1).repeat(1, 5); others: nothing."""
    if rank != ROOT:
        return None
    return np.repeat(np.arange(world, dtype=np.float32)[:, None], 5, axis=1)


def e17_input(rank: int, world: int):
    """Root: [tensor([1.]), tensor([2.]), tensor([3.]), tensor([4.])]; others: nothing."""
    if rank != ROOT:
        return None
    return [np.array([i + 1], np.float32) for i in range(world)]


def e27_input(rank: int, world: int):
    """Root: [torch.tensor([i + 1] * 5) for i in range(world)]; others: nothing."""
    if rank != ROOT:
        return None
    return [np.full(5, i + 1, np.float32) for i in range(world)]


INPUTS = {"E7": e7_input, "E17": e17_input, "E27": e27_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def _on_device(host):
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    if host is None:
        return None
    if isinstance(host, list):
        return [xp.asarray(h) for h in host]
    return xp.asarray(host)


def e7(comm) -> None:
    xp = array_module()
    data = _on_device(e7_input(comm.rank, comm.world_size))   # (world, 5) on the root only
    if data is not None:
        emit_input("E7", comm.rank, data)
    out = xp.empty(5, np.float32)
    comm.scatter(data, out, root=ROOT).wait()
    emit("E7", comm.rank, out)


def e17(comm) -> None:
    xp = array_module()
    parts = _on_device(e17_input(comm.rank, comm.world_size))  # list on the root only
    out = xp.zeros(1, np.float32)
    comm.scatter(parts, out, root=ROOT).wait()
    emit("E17", comm.rank, out)


def e27(comm) -> None:
    xp = array_module()
    parts = _on_device(e27_input(comm.rank, comm.world_size))
    if parts is not None:
        emit_input("E27", comm.rank, parts)
    out = xp.zeros(5, np.float32)
    comm.scatter(parts, out, root=ROOT).wait()
    emit("E27", comm.rank, out)


SECTIONS = [
    Section("E7", 4, e7, "scatter rows from rank 0 (000 §6)"),
    Section("E17", 4, e17, "scatter of [1],[2],[3],[4] (001 §2)"),
    Section("E27", 3, e27, "scatter, 3 ranks (002 §7.7)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
