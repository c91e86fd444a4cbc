"""Bandwidth of all_reduce, the way seed 003 measures it -- and the figure to compare instead.

Seed: 003 (E33): randn data, warm-up, synchronize, barrier, time one all_reduce, then
    bandwidth = size * 2 * (world_size - 1) / (world_size * duration)   [printed in GiB/s]

For serious measurements use the benchmark suite, which speaks nccl-tests' language:
    python -m bench all_reduce -b 8 -e 256M -f 2 --nproc 4
(see bench/ and its README: sweeps, every collective, algbw/busbw, JSON, other backends).

Why bus bandwidth, not 003's formula, is the comparable figure:
  * nccl-tests reports algbw = S / t and busbw = algbw * 2(n-1)/n for all_reduce: the bytes each
    rank must move over its busiest link per second, which is what you compare with the hardware
    link speed, across rank counts and across collectives (each has its own factor).
  * 003's "divide by world_size * duration" treats the ranks as if they took turns; they run at
    the same time.  For all_reduce the algebra happens to land on the busbw expression, but the
    reasoning gives wrong numbers for other collectives, and 003 reports GiB/s (2^30) while
    busbw is in GB/s (1e9) -- 7% apart.
  * 003 times ONE call with time.time() around synchronize + a host barrier, per rank, so the
    figure carries launch and barrier latency and the noise of a single sample; nccl-tests
    averages many back-to-back iterations between two synchronisations.
This script prints both, from the same run, so you can see the difference.

Run:  python examples/11_bandwidth.py            (spawns 4 ranks)
      ncclpy run -n 4 python examples/11_bandwidth.py
      python examples/11_bandwidth.py --cpu      (no GPU: the CPU backend)
      ncclpy run --cpu -n 4 python examples/11_bandwidth.py
On the CPU backend the same steps run on 4 MiB: the lesson, not a measurement.
"""
from __future__ import annotations

import time

import numpy as np

from _common import Section, array_module, emit, main, sync

ELEMENTS = 1 << 24      # float32 elements: 64 MiB per rank (003 leaves num_elements open)
CPU_ELEMENTS = 1 << 20  # on the CPU backend (--cpu): 4 MiB; its figures say nothing about a GPU
ITERS = 10              # timed back-to-back iterations for the nccl-tests-style figure


def seed003_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """Seed 003's figure, in GiB/s: nbytes * 2(n-1) / (n * seconds) / 2**30."""
    return nbytes * 2 * (world - 1) / (world * seconds) / 1024 ** 3


def bus_bandwidth(nbytes: int, seconds: float, world: int):
    """(algbw, busbw) in GB/s as nccl-tests defines them for all_reduce (from the registry)."""
    from ncclpy import registry
    return registry.get("all_reduce").bandwidths(nbytes, seconds, world)


INPUTS: dict = {}          # no data inputs to check against the reference


def e33(comm) -> None:
    xp = array_module()                         # CuPy on a GPU, numpy on the CPU backend
    n = comm.world_size
    if xp is np:    # the CPU backend: numpy's generator takes the dtype
        data = np.random.default_rng().standard_normal(CPU_ELEMENTS, dtype=np.float32)
    else:
        data = xp.random.standard_normal(ELEMENTS, dtype=np.float32)   # torch.randn(num_elements)
    nbytes = data.nbytes

    # warm-up, as the seed: one call, synchronize, barrier
    comm.all_reduce(data).wait()
    sync()
    comm.barrier()

    # seed 003: time a single call (with the synchronize and the barrier inside the window)
    start = time.time()
    comm.all_reduce(data).wait()
    sync()
    comm.barrier()
    one_call = time.time() - start

    # nccl-tests style: ITERS calls queued back to back, one synchronisation at the end
    comm.barrier()
    start = time.perf_counter()
    for _ in range(ITERS):
        comm.all_reduce(data)
    sync()
    per_iter = (time.perf_counter() - start) / ITERS

    algbw, busbw = bus_bandwidth(nbytes, per_iter, n)
    emit("E33", comm.rank, {
        "bytes": nbytes,
        "one_call_s": _sig(one_call),
        "seed003_GiBps": _sig(seed003_bandwidth(nbytes, one_call, n)),
        "iters": ITERS,
        "time_per_iter_s": _sig(per_iter),
        "algbw_GBps": _sig(algbw),
        "busbw_GBps": _sig(busbw),
    })


def _sig(x: float) -> float:
    """x to 6 significant digits (short lines, never rounded to 0)."""
    return float(f"{x:.6g}")


SECTIONS = [
    Section("E33", 4, e33, "all_reduce bandwidth: seed 003's figure and nccl-tests' busbw (003)"),
]

if __name__ == "__main__":
    main(SECTIONS, __file__, __doc__)
