"""GPU worker for tests/gpu/test_watchdog_gpu.py: one rank of a job whose communicator the
watchdog must abort.  ``python _gpu_watchdog.py MODE OUTDIR`` with the rendezvous in
NCCLPY_* variables.  Modes: ``kill`` (the last rank SIGKILLs itself in the middle of a long
all_reduce loop), ``skip`` (the last rank skips one all_reduce and then waits), ``checked``
(checked mode: 200 matching all_reduces, each one vote per rank through the store, then the
last rank's count differs).  Every surviving rank writes ``rank<r>.json``: the error it got,
and when (``checked``: also the median checked call and the store's key count)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(mode: str, outdir: str) -> None:
    import cupy
    import ncclpy
    rank, n = int(os.environ["NCCLPY_RANK"]), int(os.environ["NCCLPY_WORLD_SIZE"])
    timeout = float(os.environ.get("NCCLPY_TIMEOUT", "10"))
    comm = ncclpy.init(f"wd-{mode}", timeout=timeout, checked=mode == "checked")
    x = cupy.ones(1 << 22, dtype=cupy.float32)
    out = {"rank": rank, "error": None}
    if mode == "checked":
        checked(comm, x, rank, n, out)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        comm.close()
        os._exit(0)
    last = n - 1
    t_event = None
    try:
        for i in range(1_000_000):
            if mode == "kill" and rank == last and i == 50:
                with open(os.path.join(outdir, "killed.json"), "w") as f:
                    json.dump({"at": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "skip" and rank == last and i == 20:
                t_event = time.time()
                time.sleep(timeout * 3)      # never issues call 20: the others must time out
                break
            if mode == "skip" and i == 20:
                t_event = time.time()
            comm.all_reduce(x).wait()
    except ncclpy.NcclpyError as e:
        out.update(error=type(e).__name__, message=str(e), at=time.time(), t_event=t_event,
                   suspects=getattr(e, "suspects", None), seq=getattr(e, "seq", None),
                   collective=getattr(e, "collective", None))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    try:
        comm.abort()
    except Exception:
        pass
    if rank == 0:
        _outlive_the_others(outdir, n, mode, timeout)
    os._exit(0)


def _outlive_the_others(outdir: str, n: int, mode: str, timeout: float) -> None:
    """Rank 0 hosts the store (as torch's TCPStore master does): it stays until every other
    survivor has written its result, so that no survivor's verdict is judged without the store
    (2026-11-27, H200: rank 0 timed out first, exited, and rank 1 could only say "the store did
    not say in time").  Bounded: three timeouts."""
    others = range(1, n - 1 if mode == "kill" else n)
    deadline = time.monotonic() + 3 * timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(outdir, f"rank{r}.json")) for r in others):
            return
        time.sleep(0.1)


def checked(comm, x, rank: int, n: int, out: dict) -> None:
    """Matching calls pass (timed), a differing count raises on every rank, nothing is left."""
    import statistics
    import ncclpy
    store = comm.bootstrap.store
    comm.barrier()                       # every rank past its init: no bootstrap key changes
    out["keys_before"] = store.num_keys()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        comm.all_reduce(x).wait()
        ts.append(time.perf_counter() - t0)
    out["checked_call_ms"] = 1e3 * statistics.median(ts)
    out["keys_after_200"] = store.num_keys()
    try:
        comm.all_reduce(x[:1000] if rank == n - 1 else x).wait()
    except ncclpy.CallMismatchError as e:
        out.update(error=type(e).__name__, message=str(e))
    comm.barrier()
    out["keys_after_mismatch"] = store.num_keys()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
