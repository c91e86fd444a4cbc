"""One rank of the jobs of tests/test_cpu_backend_failures.py, started by hand (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; rank 0 hosts the store, as under mpirun) on
the CPU backend.  ``python cpu_failure_job.py OUTDIR MODE VICTIM WATCHDOG``:

* ``kill``: every rank makes a 1 MiB all_reduce (each rank's payload area grows past its first
  64 KiB), writes ``<rank>.ready``; the victim then sleeps (the test SIGKILLs it) while the
  others write ``<rank>.inside`` and wait in a second all_reduce;
* ``raise``: the same, but the victim raises once the others are inside (an uncaught
  exception: its process exits without closing its communicator), writing ``<rank>.raising``;
* ``stop``: every rank writes ``<rank>.ready`` and waits for the test's ``go`` file before the
  second all_reduce (the test SIGSTOPs the victim first, SIGCONTs it seconds later).

Each rank that ends writes ``<rank>.json``: the error its wait raised (type, text, suspects,
when) or none; it then closes its communicator, or aborts it after an error.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import ncclpy

__all__ = ["main"]


def _write(outdir: str, name: str, data: dict) -> None:
    tmp = os.path.join(outdir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(outdir, name))


def main(outdir: str, mode: str, victim: int, watchdog: bool) -> None:
    rank = int(os.environ["RANK"])
    comm = ncclpy.init(device="cpu", timeout=60, watchdog=watchdog)
    x = np.ones(1 << 18, np.float32)
    comm.all_reduce(x).wait()
    comm.barrier()
    from ncclpy.cpu.backend import get_engine
    prefixes = sorted({ch.prefix.lstrip("/") for ch in get_engine().channels.values()})
    _write(outdir, f"{rank}.ready", {"pid": os.getpid(), "prefixes": prefixes})
    if mode == "kill" and rank == victim:
        time.sleep(600)
        return
    if mode == "raise" and rank == victim:
        while not all(os.path.exists(os.path.join(outdir, f"{r}.inside"))
                      for r in range(comm.world_size) if r != rank):
            time.sleep(0.01)
        time.sleep(0.5)
        _write(outdir, f"{rank}.raising", {"at": time.time()})
        raise RuntimeError("rank body failed")
    if mode == "stop":
        while not os.path.exists(os.path.join(outdir, "go")):
            time.sleep(0.01)
    _write(outdir, f"{rank}.inside", {"at": time.time()})
    out = {"error": None}
    try:
        comm.all_reduce(x).wait()
        out["sum"] = float(x[0])
    except Exception as e:  # noqa: BLE001 - what the test judges
        out = {"error": str(e), "type": type(e).__name__, "at": time.time(),
               "suspects": sorted(getattr(e, "suspects", None) or [])}
    _write(outdir, f"{rank}.json", out)
    if out["error"] is None:
        comm.close()
    else:               # a peer died: NCCL's remedy is ncclCommAbort (a finalize would fail)
        comm.abort()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
