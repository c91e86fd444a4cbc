"""Rank bodies for tests/test_cpu_nccl_order_procs.py: each runs in its own process under
``ncclpy.spawn`` on the CPU backend (``ncclpy.init(device="cpu")``), with the environment the
test gave it, and writes what it got (outputs as hex bytes, refusals as text) to
``out/<rank>.json``; the test judges them against the model."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

import ncclpy

from cpu_backend_jobs import report

__all__ = ["order_job", "RANDOM", "inputs", "EXAMPLE"]

#: the issue's example: rank 0 holds 2^30, rank 1 -2^30, rank 2 1 (further ranks 0.5)
EXAMPLE = (2.0 ** 30, -(2.0 ** 30), 1.0)
#: (name, collective, op, count per output): the random-normal calls every job makes
RANDOM: Tuple[Tuple[str, str, str, int], ...] = (
    ("all_reduce sum", "all_reduce", "sum", 20000),
    ("all_reduce avg", "all_reduce", "avg", 777),
    ("reduce_scatter sum", "reduce_scatter", "sum", 18000),
    ("reduce sum", "reduce", "sum", 20001),
)


def inputs(n: int, total: int, seed: int) -> List[np.ndarray]:
    """Every rank's float32 input of one call (spread over magnitudes: order shows)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(total) * 10.0 ** rng.integers(-3, 4, total)).astype(np.float32)
            for _ in range(n)]


def _said(call: Any) -> str:
    try:
        call().wait()
        return "ok"
    except Exception as e:  # noqa: BLE001 - what the rank saw, for the test to judge
        return f"{type(e).__name__}: {e}"


def order_job(rank: int, out: str) -> None:
    """The example, the random calls (:data:`RANDOM`; reduce to root 1), what
    ``ncclpy.cpu.order_choice`` says, and a reduce_scatter and a broadcast (refused where the
    environment leaves them no algorithm)."""
    try:
        comm = ncclpy.init(device="cpu")
    except Exception as e:  # noqa: BLE001 - an init NCCL refuses
        report(out, rank, {"init": f"{type(e).__name__}: {e}"})
        return
    n = comm.world_size
    got: Dict[str, Any] = {"init": "ok"}
    c = ncclpy.cpu.order_choice(comm, "all_reduce")
    got["choice"] = [c.algo, c.proto, c.channels]
    x = np.full(12, (EXAMPLE + (0.5,) * n)[rank], np.float32)
    comm.all_reduce(x).wait()
    got["example"] = x.tolist()
    for k, (name, kind, op, count) in enumerate(RANDOM):
        ins = inputs(n, count * (n if kind == "reduce_scatter" else 1), seed=k)
        y = np.full(count, -1, np.float32)
        if kind == "all_reduce":
            comm.all_reduce(ins[rank], y, op=op).wait()
        elif kind == "reduce_scatter":
            got[name + " refused"] = _said(lambda: comm.reduce_scatter(ins[rank], y, op=op))
        else:
            got[name + " refused"] = _said(lambda: comm.reduce(ins[rank], y, root=1, op=op))
        got[name] = y.tobytes().hex()
    got["broadcast"] = _said(lambda: comm.broadcast(x, root=0))
    got["send_recv"] = _said(lambda: comm.send_recv(x, np.zeros_like(x), (rank + 1) % n,
                                                    (rank - 1) % n))
    comm.close()
    report(out, rank, got)
