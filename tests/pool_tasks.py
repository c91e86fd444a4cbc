"""Tasks the CPU tests of the rank pool (tests/test_rank_pool.py) run on its ranks.

Each is ``fn(rank, outdir, ...)`` and leaves ``outdir/rank<r>.json`` (what the test reads);
the ones that go wrong on purpose do so on one rank and block the others, as a rank stuck in a
collective with a dead peer would be."""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _write(outdir: str, rank: int, doc: dict) -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(doc, f)


def report(rank: int, outdir: str) -> None:
    """What this rank is: its process, its rendezvous, a leftover of an earlier task."""
    env = os.environ
    _write(outdir, rank, {"pid": os.getpid(), "cwd": os.getcwd(),
                          "store_port": env.get("NCCLPY_MASTER_PORT"),
                          "torch_port": env.get("MASTER_PORT"),
                          "token": env.get("NCCLPY_STORE_TOKEN"),
                          "rank_env": env.get("NCCLPY_RANK"), "leak": env.get("POOL_LEAK"),
                          "task_var": env.get("POOL_TASK_VAR")})


def gloo_sum(rank: int, outdir: str) -> None:
    """torch.distributed over gloo on the task's rendezvous (env://): a real all_reduce."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    _write(outdir, rank, {"pid": os.getpid(), "sum": float(t.item()),
                          "world": dist.get_world_size()})
    dist.destroy_process_group()


def cpu_all_reduce(rank: int, outdir: str) -> None:
    """ncclpy.init on the task's store, on ncclpy's CPU backend: ncclpy's real call path
    (store, uid exchange, communicator, Work, the data through shared memory) in a pooled
    process."""
    import numpy as np

    import ncclpy
    from ncclpy.store import StoreServer, TCPStore
    env = os.environ
    addr, port, token = (env["NCCLPY_MASTER_ADDR"], int(env["NCCLPY_MASTER_PORT"]),
                         env.get("NCCLPY_STORE_TOKEN") or None)
    # rank 0 hosts the store as a launcher would, and stops it once every rank is out: a
    # pooled process outlives its task, so the task's store must not
    srv = StoreServer(addr, port, token=token).start() if rank == 0 else None
    env["NCCLPY_STORE_HOSTED_BY"] = "launcher"        # the pool restores it after the task
    store = TCPStore(addr, port, token=token, timeout=30.0)
    comm = ncclpy.init("pooled", device="cpu", watchdog=False)
    x = np.full(8, rank + 1, np.float32)
    comm.all_reduce(x).wait(timeout=30)
    _write(outdir, rank, {"pid": os.getpid(), "rank": comm.rank, "n": comm.world_size,
                          "sum": float(x[0])})
    comm.close()
    n = int(env["NCCLPY_WORLD_SIZE"])
    store.set(f"pooled-out/{rank}", b"1")         # rank 0 stops the store once all are out
    if srv is not None:
        store.wait([f"pooled-out/{r}" for r in range(n)])
    store.close()
    if srv is not None:
        srv.close()


def die(rank: int, outdir: str) -> None:
    """Rank 1 dies (exit code 7); the others block."""
    if rank == 1:
        os._exit(7)
    time.sleep(120)


def raise_one(rank: int, outdir: str) -> None:
    """Rank 0 raises; the others block."""
    if rank == 0:
        raise ValueError("boom on rank 0")
    time.sleep(120)


def sleep(rank: int, outdir: str, seconds: float) -> None:
    time.sleep(seconds)


def leave_a_mess(rank: int, outdir: str) -> None:
    """Change what the next task must not inherit: a variable, the working directory, and a
    torch process group left initialised."""
    import torch.distributed as dist
    os.environ["POOL_LEAK"] = "1"
    os.chdir(outdir)
    dist.init_process_group("gloo")
    _write(outdir, rank, {"pid": os.getpid()})


def leave_a_thread(rank: int, outdir: str) -> None:
    """Pass, but leave a thread named as a communicator's watchdog running (a communicator the
    task did not close)."""
    import threading
    threading.Thread(target=time.sleep, args=(120,), name="ncclpy-watchdog-left",
                     daemon=True).start()
