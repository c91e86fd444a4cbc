"""3-rank jobs of issue 25 on real NCCL, run by ``ncclpy run -n 3 --keep-going`` (the GPU tests
in test_part2_gpu.py): ``python _gpu_part2_job.py SCENARIO``.

* ``recover``: the recovery recipe.  Every rank reduces once; rank 2 then kills itself with
  SIGKILL; ranks 0 and 1 (``comm.on_failure = "revoke"``) reduce again, the launcher publishes
  the death, the watchdog revokes and the wait raises CommAbortedError naming rank 2; they shrink
  it out, reduce on the 2-rank child, close the child, then the parent (aborted, never
  destroyed).  Where NCCL refuses the shrink on a survivor whose proxy saw the death
  (ncclCommEnsureReady: its async error), every survivor says so instead (``refused``).
* ``grow``: ranks 0 and 1 form a 2-rank communicator; rank 0 makes the grow id and hands it to
  rank 2 through the store; ranks 0 and 1 grow, rank 2 joins (``ncclpy.grow_join``); all three
  reduce on the grown communicator.

Each surviving rank prints one ``RESULT {json}`` line.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time


def recover() -> dict:
    import cupy
    import ncclpy
    comm = ncclpy.init("recover", timeout=60)
    r = comm.rank
    if comm.nccl_version < 22807:
        return {"skip": f"ncclCommRevoke needs NCCL >= 2.28.7; this is {comm.nccl_version}"}
    comm.on_failure = "revoke"
    x = cupy.ones(1024, cupy.float32)
    comm.all_reduce(x).wait()
    if r == 2:
        cupy.cuda.Device().synchronize()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x).wait(timeout=120)
        return {"error": "the all_reduce with a dead rank completed"}
    except ncclpy.CommAbortedError as e:
        err = e
    took = time.monotonic() - t0
    out = {"rank": r, "reason": err.reason, "suspects": list(err.suspects),
           "detect_s": round(took, 2), "message": str(err)}
    try:
        child = comm.shrink(exclude=err.suspects)
    except ncclpy.NcclError as e:   # NCCL refuses a parent whose proxy saw the death
        out["refused"] = str(e)
        comm.close()
        out["parent_state"] = comm.state
        return out
    y = cupy.full(1024, r + 1, cupy.float32)
    child.all_reduce(y).wait(timeout=60)
    out.update({"child": [child.rank, child.world_size], "sum": float(y[0])})
    child.close()
    comm.close()
    out["parent_state"] = comm.state
    return out


def grow() -> dict:
    import cupy
    import ncclpy
    from ncclpy._nccl.lib import get_lib
    from ncclpy.store import TCPStore
    env = os.environ
    r = int(env["RANK"])
    store = TCPStore(env["NCCLPY_MASTER_ADDR"], int(env["NCCLPY_MASTER_PORT"]),
                     token=env.get("NCCLPY_STORE_TOKEN") or None, timeout=120)
    lib = get_lib()
    if lib.version < 22902:
        return {"skip": f"ncclCommGrow needs NCCL >= 2.29.2; this is {lib.version}"}
    dev = int(env.get("NCCLPY_DEVICE", "0"))
    cupy.cuda.Device(dev).use()
    if r == 2:
        g = ncclpy.grow_join(3, 2, store.get("grow/uid"), device=dev)
    else:
        if r == 0:
            store.set("base/uid", lib.get_unique_id())
        comm = ncclpy.Communicator(2, r, store.get("base/uid"), dev)
        if r == 0:
            uid = comm.grow_unique_id()
            store.set("grow/uid", uid)
            g = comm.grow(3, uid)
        else:
            g = comm.grow(3)
    x = cupy.full(256, r + 1, cupy.float32)
    g.all_reduce(x).wait(timeout=60)
    out = {"rank": r, "grown": [g.rank, g.world_size], "sum": float(x[0])}
    g.close()
    if r != 2:
        comm.close()
    return out


if __name__ == "__main__":
    res = {"recover": recover, "grow": grow}[sys.argv[1]]()
    print("RESULT " + json.dumps(res), flush=True)
