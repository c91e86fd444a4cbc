"""The thin floor: the same NCCL calls made directly on ``cupy.cuda.nccl.NcclCommunicator``.

Nothing between Python and libnccl but CuPy's Cython wrapper, so ncclpy's own per-call overhead
is the difference to this backend.  CuPy lacks AlltoAll/Gather/Scatter: they are grouped
send/recv here, as nccl-tests builds them.
"""
from __future__ import annotations

from typing import Any

from ncclpy.dtypes import DTYPES
from ncclpy.ops import NCCL_OPS

from bench.backends import Buffers
from bench.backends._cuda import CupyStreamBackend

__all__ = ["CupyBackend", "cupy_uid"]


def cupy_uid(uid: bytes, cupy_module) -> Any:
    """The unique id in the form this CuPy's NcclCommunicator takes (bytes >= 14, else a tuple
    of signed chars)."""
    major = int(str(cupy_module.__version__).split(".")[0])
    if major >= 14:
        return bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in bytes(uid))


class CupyBackend(CupyStreamBackend):
    name = "cupy"
    label = "cupy"

    def setup(self, rank, world, device, store, *, master_addr="127.0.0.1", timeout=300.0):
        super().setup(rank, world, device, store, master_addr=master_addr, timeout=timeout)
        self._setup_device(device)
        from cupy.cuda import nccl
        from ncclpy.bootstrap import exchange_uid
        self.nccl = nccl
        uid, _ = exchange_uid(store, rank, name="bench-cupy", timeout=timeout)
        self.comm = nccl.NcclCommunicator(world, cupy_uid(uid, self.cp), rank)

    def teardown(self) -> None:
        comm = getattr(self, "comm", None)
        if comm is not None:
            self.stream.synchronize()
            comm.destroy()
            self.comm = None

    def nccl_version(self) -> int:
        return int(self.nccl.get_version())

    def checks_in_place(self, collective: str) -> bool:
        # NCCL has no in-place AlltoAll; grouped send/recv on one buffer races (nccl-tests does
        # not check it either), and a send/recv ring shift in place is the same race.
        return collective not in ("all_to_all", "send_recv")

    def run(self, collective: str, bufs: Buffers, op: str, root: int, in_place: bool) -> None:
        send, recv = bufs.pair(in_place)
        s, r = send.data.ptr, recv.data.ptr
        dt = DTYPES[bufs.dtype].nccl
        item = DTYPES[bufs.dtype].itemsize
        n = bufs.layout.count
        st = self.stream.ptr
        c = self.comm
        nop = NCCL_OPS.get(op, 0)
        if collective == "all_reduce":
            c.allReduce(s, r, n, dt, nop, st)
        elif collective == "reduce":
            c.reduce(s, r, n, dt, nop, root, st)
        elif collective == "broadcast":
            c.broadcast(s, r, n, dt, root, st)
        elif collective == "all_gather":
            c.allGather(s, r, n, dt, st)
        elif collective == "reduce_scatter":
            c.reduceScatter(s, r, n, dt, nop, st)
        elif collective == "all_to_all":
            self.nccl.groupStart()
            for p in range(self.world):
                c.send(s + p * n * item, n, dt, p, st)
                c.recv(r + p * n * item, n, dt, p, st)
            self.nccl.groupEnd()
        elif collective == "gather":
            self.nccl.groupStart()
            if self.rank == root:
                for p in range(self.world):
                    c.recv(r + p * n * item, n, dt, p, st)
            c.send(s, n, dt, root, st)
            self.nccl.groupEnd()
        elif collective == "scatter":
            self.nccl.groupStart()
            if self.rank == root:
                for p in range(self.world):
                    c.send(s + p * n * item, n, dt, p, st)
            c.recv(r, n, dt, root, st)
            self.nccl.groupEnd()
        elif collective == "send_recv":
            self.nccl.groupStart()
            c.send(s, n, dt, (self.rank + 1) % self.world, st)
            c.recv(r, n, dt, (self.rank - 1) % self.world, st)
            self.nccl.groupEnd()
        else:  # pragma: no cover - the CLI only passes registry names with data
            raise ValueError(f"collective {collective!r} is not benchmarked")

