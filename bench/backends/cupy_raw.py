"""The thin floor: the same NCCL calls made directly on ``cupy.cuda.nccl.NcclCommunicator``.

Nothing between Python and libnccl but CuPy's Cython wrapper, so ncclpy's own per-call overhead
is the difference to this backend.  CuPy lacks AlltoAll/Gather/Scatter: they are grouped
send/recv here, as nccl-tests builds them (:func:`p2p_ops` lists the sends and receives).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, List, Tuple

from ncclpy.semantics.dtypes import DTYPES
from ncclpy.semantics.ops import NCCL_OPS

from . import Buffers
from ._cuda import CupyStreamBackend

__all__ = ["CupyBackend", "cupy_uid", "p2p_ops", "P2P_COLLECTIVES"]

#: collectives this backend builds from grouped send/recv
P2P_COLLECTIVES = ("all_to_all", "gather", "scatter", "send_recv")


def cupy_uid(uid: bytes, cupy_module) -> Any:
    """The unique id in the form this CuPy's NcclCommunicator takes (bytes >= 14, else a tuple
    of signed chars)."""
    major = int(str(cupy_module.__version__).split(".")[0])
    if major >= 14:
        return bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in bytes(uid))


def p2p_ops(collective: str, rank: int, world: int, root: int) -> List[Tuple[str, int, int]]:
    """The grouped send/recv that make ``collective`` on ``rank``, as nccl-tests issues them:
    ``(kind, block, peer)`` with kind "send" (from block ``block`` of the send buffer) or "recv"
    (into block ``block`` of the receive buffer); a block is the NCCL count of elements."""
    if collective == "all_to_all":
        return [op for p in range(world) for op in (("send", p, p), ("recv", p, p))]
    if collective == "gather":
        recvs = [("recv", p, p) for p in range(world)] if rank == root else []
        return recvs + [("send", 0, root)]
    if collective == "scatter":
        sends = [("send", p, p) for p in range(world)] if rank == root else []
        return sends + [("recv", 0, root)]
    if collective == "send_recv":
        return [("send", 0, (rank + 1) % world), ("recv", 0, (rank - 1) % world)]
    raise ValueError(f"collective {collective!r} is not built from send/recv")


class CupyBackend(CupyStreamBackend):
    name = "cupy"
    label = "cupy"

    def open_comm(self, uid: bytes) -> Any:
        from cupy.cuda import nccl
        self.nccl = nccl
        return nccl.NcclCommunicator(self.world, cupy_uid(uid, self.cp), self.rank)

    def close_comm(self, comm: Any) -> None:
        comm.destroy()

    @contextlib.contextmanager
    def _group(self) -> Iterator[None]:
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def group(self) -> ContextManager[None]:
        return self._group()

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
        elif collective in P2P_COLLECTIVES:
            block = n * DTYPES[bufs.dtype].itemsize
            self.nccl.groupStart()
            try:
                for kind, i, peer in p2p_ops(collective, self.rank, self.world, root):
                    if kind == "send":
                        c.send(s + i * block, n, dt, peer, st)
                    else:
                        c.recv(r + i * block, n, dt, peer, st)
            finally:
                self.nccl.groupEnd()
        else:  # pragma: no cover - the CLI only passes registry names with data
            raise ValueError(f"collective {collective!r} is not benchmarked")
