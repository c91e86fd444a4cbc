"""GPU worker for tests/gpu/test_watchdog_gpu.py: one rank of a job whose communicator the
watchdog must abort.  ``python _gpu_watchdog.py MODE OUTDIR`` with the rendezvous in
NCCLPY_* variables.  Modes: ``kill`` (the last rank SIGKILLs itself in the middle of a long
all_reduce loop), ``skip`` (the last rank skips one all_reduce and then waits).  Every
surviving rank writes ``rank<r>.json``: the error it got, and when."""
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
    comm = ncclpy.init(f"wd-{mode}", timeout=timeout)
    x = cupy.ones(1 << 22, dtype=cupy.float32)
    out = {"rank": rank, "error": None}
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
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
