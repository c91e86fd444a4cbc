"""GPU worker: ncclpy inside a torch job (``ncclpy.init(from_torch=...)``) beside torch's own
NCCL process group, on the same tensors, and the object collectives.  ``torch_interop(rank,
outdir)`` runs under ``ncclpy.spawn``; each check is one JSON record (``_gpu_common.Recorder``)."""
from __future__ import annotations

import datetime
import os
from typing import Any

from _gpu_common import Recorder


def torch_interop(rank: int, outdir: str) -> None:
    import torch
    import torch.distributed as dist
    import ncclpy
    rec = Recorder(outdir, rank)
    dev = int(os.environ.get("NCCLPY_DEVICE", "0"))
    torch.cuda.set_device(dev)
    n = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", dev))
    state: dict = {}

    def make() -> None:
        comm = ncclpy.init("interop", from_torch=True, timeout=120)
        state["comm"] = comm
        assert (comm.rank, comm.world_size) == (dist.get_rank(), n), (comm.rank, n)
        assert comm.device == dev and comm.bootstrap.uid_exchange == "store"
        assert comm.bootstrap.info.source.startswith("torch.distributed group ")

    def same_tensor() -> None:
        comm = state["comm"]
        t = torch.full((4099,), float(rank + 1), device="cuda")
        comm.all_reduce(t).wait()                     # ncclpy: sum of 1..n
        dist.all_reduce(t)                            # torch's NCCL on the same tensor: x n
        torch.cuda.synchronize()
        want = float(n * (n + 1) // 2 * n)
        assert bool((t == want).all()), (t[:4].tolist(), want)

    def all_gather_bitwise() -> None:
        comm = state["comm"]
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        x = torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16)
        a = torch.empty(n * 1000, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        comm.all_gather(x, a).wait()
        dist.all_gather_into_tensor(b, x)
        torch.cuda.synchronize()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))

    def objects() -> None:
        comm = state["comm"]
        mine: Any = {"rank": rank, "pid": os.getpid()}
        got = comm.all_gather_object(mine)
        theirs: list = [None] * n
        dist.all_gather_object(theirs, mine)
        assert got == theirs, (got, theirs)
        assert comm.broadcast_object(("cfg", rank) if rank == n - 1 else None,
                                     root=n - 1) == ("cfg", n - 1)

    for name, fn in (("from_torch_init", make), ("from_torch_same_tensor", same_tensor),
                     ("from_torch_all_gather_bitwise", all_gather_bitwise),
                     ("object_collectives", objects)):
        if not rec.run(name, fn) and "comm" not in state:
            break
    comm = state.get("comm")
    if comm is not None:
        comm.close()
    dist.barrier()
    dist.destroy_process_group()
    rec.close()
