"""ncclpy's Communicator on CuPy arrays: what a user of ncclpy writes, timed.

Buffers are CuPy arrays passed as they are; bfloat16 and float8 (which CuPy lacks) travel as
``ncclpy.Buffer(ptr, count, dtype, device)`` over a uint view.  In place uses ncclpy's documented
forms (``recvbuf=None`` / ``sendbuf=None``) where it has them, NCCL's aliasing rules otherwise.
"""
from __future__ import annotations

from ncclpy.dtypes import DTYPES

from bench.backends import Buffers
from bench.backends._cuda import CupyStreamBackend

__all__ = ["NcclpyBackend"]


class NcclpyBackend(CupyStreamBackend):
    name = "ncclpy"
    label = "ncclpy"

    def setup(self, rank, world, device, store, *, master_addr="127.0.0.1", timeout=300.0):
        super().setup(rank, world, device, store, master_addr=master_addr, timeout=timeout)
        self._setup_device(device)
        import ncclpy
        from ncclpy.bootstrap import exchange_uid
        self.ncclpy = ncclpy
        uid, _ = exchange_uid(store, rank, name="bench-ncclpy", timeout=timeout)
        self.comm = ncclpy.Communicator(world, rank, uid, device)

    def teardown(self) -> None:
        comm = getattr(self, "comm", None)
        if comm is not None:
            self.stream.synchronize()
            comm.close()
            self.comm = None

    def nccl_version(self) -> int:
        return int(self.comm.nccl_version)

    def checks_in_place(self, collective: str) -> bool:
        # ncclpy stages in-place all_to_all through scratch, so its result is defined; a send/recv
        # ring shift on one buffer is a race in any library.
        return collective != "send_recv"

    def alloc(self, collective: str, total: int, dtype: str) -> Buffers:
        bufs = super().alloc(collective, total, dtype)
        if DTYPES[dtype].numpy is None:  # bfloat16 / float8: hand ncclpy raw typed buffers
            B = self.ncclpy.Buffer
            wrap = (lambda a: B(a.data.ptr, int(a.size), dtype, self.device))
            bufs.extra["args"] = {k: wrap(getattr(bufs, k)) for k in
                                  ("send", "recv", "whole", "ip_send", "ip_recv")}
        else:
            bufs.extra["args"] = {k: getattr(bufs, k) for k in
                                  ("send", "recv", "whole", "ip_send", "ip_recv")}
        return bufs

    def run(self, collective: str, bufs: Buffers, op: str, root: int, in_place: bool) -> None:
        a = bufs.extra["args"]
        c, st = self.comm, self.stream
        me, n = self.rank, self.world
        if in_place:
            w, s, r = a["whole"], a["ip_send"], a["ip_recv"]
            if collective == "all_reduce":
                c.all_reduce(w, None, op=op, stream=st)
            elif collective == "reduce":
                c.reduce(w, None, root=root, op=op, stream=st)
            elif collective == "broadcast":
                c.broadcast(w, None, root=root, stream=st)
            elif collective == "all_gather":
                c.all_gather(None, w, stream=st)
            elif collective == "reduce_scatter":
                c.reduce_scatter(w, None, op=op, stream=st)
            elif collective == "all_to_all":
                c.all_to_all(w, None, stream=st)
            elif collective == "gather":
                c.gather(s, w if me == root else None, root=root, stream=st)
            elif collective == "scatter":
                c.scatter(w if me == root else None, r, root=root, stream=st)
            elif collective == "send_recv":
                c.send_recv(w, w, (me + 1) % n, (me - 1) % n, stream=st)
            else:  # pragma: no cover
                raise ValueError(f"collective {collective!r} is not benchmarked")
            return
        s, r = a["send"], a["recv"]
        if collective == "all_reduce":
            c.all_reduce(s, r, op=op, stream=st)
        elif collective == "reduce":
            c.reduce(s, r, root=root, op=op, stream=st)
        elif collective == "broadcast":
            c.broadcast(s, r, root=root, stream=st)
        elif collective == "all_gather":
            c.all_gather(s, r, stream=st)
        elif collective == "reduce_scatter":
            c.reduce_scatter(s, r, op=op, stream=st)
        elif collective == "all_to_all":
            c.all_to_all(s, r, stream=st)
        elif collective == "gather":
            c.gather(s, r if me == root else None, root=root, stream=st)
        elif collective == "scatter":
            c.scatter(s if me == root else None, r, root=root, stream=st)
        elif collective == "send_recv":
            c.send_recv(s, r, (me + 1) % n, (me - 1) % n, stream=st)
        else:  # pragma: no cover
            raise ValueError(f"collective {collective!r} is not benchmarked")
