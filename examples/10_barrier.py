"""Barrier: no rank leaves before every rank has arrived (3 ranks).

Seed: 002 §7.9 (E29).

  E29  rank r sleeps r seconds, then enters the barrier -> every rank leaves after about 2 s
       (the slowest rank's sleep), so the printed times are all ~2.0 and nearly equal.

dist.barrier() is comm.barrier(): it blocks the host until every rank has called it.
A first barrier lines the ranks up (process start-up times differ), then each rank starts its
clock, sleeps, and waits.  Printed result: seconds from the start to leaving the barrier.

Run:  python examples/10_barrier.py              (spawns 3 ranks)
      ncclpy run -n 3 python examples/10_barrier.py
      python examples/10_barrier.py --cpu        (no GPU: the CPU backend)
      ncclpy run --cpu -n 3 python examples/10_barrier.py
"""
from __future__ import annotations

import time

from _common import Section, comment, emit, main


def sleep_seconds(rank: int, world: int) -> float:
    """Rank r simulates r seconds of work."""
    return float(rank)


INPUTS: dict = {}          # no data inputs to check against the reference


def e29(comm) -> None:
    comm.barrier()                              # line up first: start-up times differ
    t_start = time.time()
    comment(f"rank {comm.rank} sleeps {sleep_seconds(comm.rank, comm.world_size):g} s")
    time.sleep(sleep_seconds(comm.rank, comm.world_size))
    comm.barrier()
    emit("E29", comm.rank, round(time.time() - t_start, 4))


SECTIONS = [
    Section("E29", 3, e29, "barrier: rank r sleeps r s, all leave after ~2 s (002 §7.9)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
