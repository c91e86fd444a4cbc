"""All-to-all: block d of rank r goes to rank d, where it becomes block r.

Seeds: 000 §8 (E11, E12); the uneven split is all_to_all_single with split sizes.

  E11         single buffer, even split   (4,2), row d = 10r+d
                                          -> rank r: rows r, 10+r, 20+r, 30+r
  E12         list form, columns          (5,4), col j = 10r+j
                                          -> rank r: columns r, 10+r, 20+r, 30+r
  E11.uneven  single buffer, uneven split rank r sends d+1 elements of 10r+d to rank d
                                          -> rank r: r+1 copies each of r, 10+r, 20+r, 30+r

dist.all_to_all_single(out, in[, output_split_sizes, input_split_sizes]) is
comm.all_to_all(sendbuf, recvbuf[, send_counts=..., recv_counts=...]) (counts in elements);
dist.all_to_all(out_list, in_list) is comm.all_to_all(send_list, recv_list).
Columns: slices data[:, j:j+1] are strided views, which a raw buffer cannot be: ncclpy refuses
them with a clear error; .contiguous() copies (cupy.ascontiguousarray) are what the seed uses too.

Run:  python examples/07_all_to_all.py           (spawns 4 ranks)
      ncclpy run -n 4 python examples/07_all_to_all.py
      python examples/07_all_to_all.py --cpu     (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/07_all_to_all.py
"""
from __future__ import annotations

import numpy as np

import ncclpy
from _common import Section, array_module, column_views, emit, emit_error, emit_input, main


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e11_input(rank: int, world: int) -> np.ndarray:
    """(world, 2), row d (the block for rank d) = 10*rank + d"""
    x = np.zeros((world, 2), np.float32)
    for d in range(world):
        x[d] = 10 * rank + d
    return x


def e12_input(rank: int, world: int) -> np.ndarray:
    """(5, world), column j (the block for rank j) = 10*rank + j"""
    x = np.zeros((5, world), np.float32)
    for j in range(world):
        x[:, j] = 10 * rank + j
    return x


def uneven_send_counts(rank: int, world: int) -> list:
    """Rank r sends d+1 elements to rank d."""
    return [d + 1 for d in range(world)]


def uneven_recv_counts(rank: int, world: int) -> list:
    """Rank r receives r+1 elements from every rank."""
    return [rank + 1] * world


def uneven_input(rank: int, world: int) -> np.ndarray:
    """Block d (d+1 elements) = 10*rank + d, blocks back to back."""
    return np.concatenate([np.full(d + 1, 10 * rank + d, np.float32) for d in range(world)])


INPUTS = {"E11": e11_input, "E12": e12_input, "E11.uneven": uneven_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def e11(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    send = xp.asarray(e11_input(comm.rank, comm.world_size))
    emit_input("E11", comm.rank, send)
    recv = xp.empty_like(send)                  # even split: world blocks of 2
    comm.all_to_all(send, recv).wait()
    emit("E11", comm.rank, recv)


def e12(comm) -> None:
    xp = array_module()
    n = comm.world_size
    local = xp.asarray(e12_input(comm.rank, n))
    emit_input("E12", comm.rank, local)
    recv = [xp.empty((5, 1), np.float32) for _ in range(n)]
    # Wrong on purpose: column views local[:, j:j+1] are strided, not raw contiguous buffers.
    try:
        comm.all_to_all(column_views(local, 1), recv)
    except ncclpy.NcclpyError as e:
        emit_error("E12", comm.rank, e)
    # Right (as the seed: .contiguous()): contiguous copies of the columns.
    send = [xp.ascontiguousarray(v) for v in column_views(local, 1)]
    comm.all_to_all(send, recv).wait()
    emit("E12", comm.rank, xp.concatenate(recv, axis=1))     # torch.cat(output_list, dim=1)


def e11_uneven(comm) -> None:
    xp = array_module()
    r, n = comm.rank, comm.world_size
    send = xp.asarray(uneven_input(r, n))
    emit_input("E11.uneven", r, send)
    recv_counts = uneven_recv_counts(r, n)
    recv = xp.empty(sum(recv_counts), np.float32)
    comm.all_to_all(send, recv, send_counts=uneven_send_counts(r, n),
                    recv_counts=recv_counts).wait()
    emit("E11.uneven", r, recv)


SECTIONS = [
    Section("E11", 4, e11, "all_to_all_single, even split (000 §8.1)"),
    Section("E12", 4, e12, "all_to_all with lists, columns (000 §8.2)"),
    Section("E11.uneven", 4, e11_uneven, "all_to_all_single with uneven split sizes"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
