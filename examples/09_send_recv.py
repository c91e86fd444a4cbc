"""Point to point: rank 0 sends one value, rank 1 receives it (2 ranks).

Seed: 001 §1 (E14 blocking, E15 async).

  E14  blocking send/recv    rank 0 sends [1]   -> rank 1 holds 1
  E15  async, then wait()    as E14             -> as E14

NCCL never blocks the host: every call is queued on a CUDA stream and returns a Work.
  - "blocking" (dist.send / dist.recv):   comm.send(buf, peer).wait()  -- wait right away;
  - "async"    (dist.isend / dist.irecv): work = comm.send(buf, peer); ...other host work...;
                                          work.wait() before touching the buffer.
Work.wait() blocks the host until the transfer is done; Work.is_completed() polls.

Run:  python examples/09_send_recv.py            (spawns 2 ranks)
      ncclpy run -n 2 python examples/09_send_recv.py
      python examples/09_send_recv.py --cpu      (no GPU: the CPU backend)
      ncclpy run --cpu -n 2 python examples/09_send_recv.py
"""
from __future__ import annotations

import numpy as np

from _common import Section, array_module, emit, emit_input, main


# ----------------------------------------------------------------- inputs (pure numpy, no GPU)

def e14_input(rank: int, world: int) -> np.ndarray:
    """tensor = torch.zeros(1); rank 0 adds 1 before sending"""
    x = np.zeros(1, np.float32)
    if rank == 0:
        x += 1
    return x


e15_input = e14_input

INPUTS = {"E14": e14_input, "E15": e15_input}


# ------------------------------------- the examples (GPU, or the CPU backend: --cpu)

def e14(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    x = xp.asarray(e14_input(comm.rank, comm.world_size))
    emit_input("E14", comm.rank, x)
    if comm.rank == 0:
        comm.send(x, peer=1).wait()             # dist.send(tensor, dst=1)
    elif comm.rank == 1:
        comm.recv(x, peer=0).wait()             # dist.recv(tensor, src=0)
    emit("E14", comm.rank, x)                   # "Rank r has data 1.0" on ranks 0 and 1


def e15(comm) -> None:
    xp = array_module()
    x = xp.asarray(e15_input(comm.rank, comm.world_size))
    work = None
    if comm.rank == 0:
        work = comm.send(x, peer=1)             # req = dist.isend(tensor, dst=1)
    elif comm.rank == 1:
        work = comm.recv(x, peer=0)             # req = dist.irecv(tensor, src=0)
    # ... the host is free here: the transfer runs on the GPU stream ...
    if work is not None:
        work.wait()                             # req.wait(): now x may be read
    emit("E15", comm.rank, x)


SECTIONS = [
    Section("E14", 2, e14, "blocking send/recv (001 §1)"),
    Section("E15", 2, e15, "async send/recv + Work.wait() (001 §1)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
