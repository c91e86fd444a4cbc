"""ncclpy's Communicator on CuPy arrays: what a user of ncclpy writes, timed.

Buffers are CuPy arrays passed as they are; bfloat16 and float8 (which CuPy lacks) travel as
``ncclpy.Buffer(ptr, count, dtype, device)`` over a uint view.  In place uses ncclpy's documented
forms (``recvbuf=None`` / ``sendbuf=None``) where it has them, NCCL's aliasing rules otherwise.

Three flavours: :class:`NcclpyBackend` (the sweep's: ``ncclpy.Communicator(...)``, the flight
recorder on, no watchdog), and for ``python -m bench.overhead`` :class:`NcclpyDefaultsBackend`
(``ncclpy``: what ``ncclpy.init`` makes, ``Communicator.from_bootstrap`` with the watchdog on
the rendezvous store and the recorder at its default size) and :class:`NcclpyBareBackend`
(``ncclpy-bare``: both off).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ncclpy.semantics.dtypes import DTYPES

from . import Buffers
from ..combos import environ
from ._cuda import CupyStreamBackend

__all__ = ["NcclpyBackend", "NcclpyDefaultsBackend", "NcclpyBareBackend", "call_args",
           "environ"]

#: the variables that change what a communicator runs with by default (left unset for the
#: ``ncclpy`` flavour of bench.overhead, whatever the caller's environment says)
DEFAULTS_ENV = ("NCCLPY_TRACE_BUFFER", "NCCLPY_NVTX", "NCCLPY_WATCHDOG", "NCCLPY_CHECKED")


class NcclpyBackend(CupyStreamBackend):
    name = "ncclpy"
    label = "ncclpy"

    def __init__(self) -> None:
        super().__init__()
        self.registered_seen = [0, 0]       # -R 1/2: [buffers NCCL registered, asked for]

    def open_comm(self, uid: bytes) -> Any:
        import ncclpy
        self.ncclpy = ncclpy
        return ncclpy.Communicator(self.world, self.rank, uid, self.device, self._config())

    def _config(self) -> Any:
        return None if self.cta_policy is None else self.ncclpy.Config(cta_policy=self.cta_policy)

    def settings(self) -> Dict[str, Any]:
        """Whether the communicator has a watchdog, and its flight recorder's size (0: off)."""
        rec = getattr(self.comm, "_recorder", None)
        return {"watchdog": getattr(self.comm, "_watchdog", None) is not None,
                "flight_recorder_calls": int(getattr(rec, "capacity", 0) or 0)}

    def close_comm(self, comm: Any) -> None:
        comm.close()

    def group(self) -> Any:
        return self.comm.group()

    def nccl_version(self) -> int:
        return int(self.comm.nccl_version)

    def checks_in_place(self, collective: str) -> bool:
        # ncclpy stages in-place all_to_all through scratch, so its result is defined; a send/recv
        # ring shift on one buffer is a race in any library.
        return collective != "send_recv"

    def alloc(self, collective: str, total: int, dtype: str) -> Buffers:
        if self.register == 2:            # -R 2: NCCL memory, each buffer a window
            with self.cp.cuda.using_allocator(self.ncclpy.nccl_allocator(self.device)):
                bufs = super().alloc(collective, total, dtype)
        else:
            bufs = super().alloc(collective, total, dtype)
        regs = []
        if self.register:                 # the same buffers in the same order on every rank
            for k in ("send", "recv", "whole"):
                # the allocation, as nccl-tests registers its buffers before -u moves them
                # (common.cu threadInit): the moved buffer lies inside it
                arr = bufs.base[k]
                if int(arr.size):
                    regs.append(self.comm.register_window(arr) if self.register == 2
                                else self.comm.register(arr))
                    r = regs[-1]            # what NCCL registered (NULL: nothing), reported
                    self.registered_seen[0] += int(bool(r.registered if self.register == 2
                                                        else r.handle))
                    self.registered_seen[1] += 1
        bufs.extra["regs"] = regs
        return self._with_args(bufs)

    def adopt(self, bufs: Buffers) -> Buffers:
        return self._with_args(Buffers(bufs.collective, bufs.dtype, bufs.layout, bufs.send,
                                       bufs.recv, bufs.whole, bufs.ip_send, bufs.ip_recv))

    def _with_args(self, bufs: Buffers) -> Buffers:
        """``bufs.extra["args"]``: what ``run`` hands ncclpy, the CuPy arrays themselves (raw
        typed :class:`ncclpy.Buffer` for bfloat16 / float8, which CuPy lacks)."""
        keys = ("send", "recv", "whole", "ip_send", "ip_recv")
        dtype = bufs.dtype
        if DTYPES[dtype].numpy is None:
            B = self.ncclpy.Buffer
            bufs.extra["args"] = {k: B(getattr(bufs, k).data.ptr, int(getattr(bufs, k).size),
                                       dtype, self.device) for k in keys}
        else:
            bufs.extra["args"] = {k: getattr(bufs, k) for k in keys}
        return bufs

    def free(self, bufs: Buffers) -> None:
        """-R: deregister the buffers' windows / registrations, newest first."""
        self.sync()
        for reg in reversed(bufs.extra.pop("regs", [])):
            if self.register == 2:
                reg.close()
            else:
                self.comm.deregister(reg)

    def mem_stats(self) -> Optional[Dict[str, int]]:
        return self.comm.mem_stats()

    def predict(self, collective: str, bufs: Buffers, op: str, root: int) -> Optional[float]:
        """The out-of-place call inside ``group(simulate=True)``: NCCL's estimate, nothing
        launched."""
        with self.comm.group(simulate=True) as g:
            self.run(collective, bufs, op, root, False)
        return g.estimated_time_us

    def run(self, collective: str, bufs: Buffers, op: str, root: int, in_place: bool) -> None:
        s, r = call_args(collective, bufs.extra["args"], in_place, self.rank, root)
        c, st, me, n = self.comm, self.stream_arg, self.rank, self.world
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
            c.gather(s, r, root=root, stream=st)
        elif collective == "scatter":
            c.scatter(s, r, root=root, stream=st)
        elif collective == "send_recv" and s is r:
            # in place, as nccl-tests times it: a grouped send and recv of one buffer (its
            # result is a race, unchecked); send_recv() itself refuses overlapping buffers
            with c.group():
                c.send(s, (me + 1) % n, stream=st)
                c.recv(r, (me - 1) % n, stream=st)
        elif collective == "send_recv":
            c.send_recv(s, r, (me + 1) % n, (me - 1) % n, stream=st)
        else:  # pragma: no cover - the CLI only passes registry names with data
            raise ValueError(f"collective {collective!r} is not benchmarked")

    def check_comm(self) -> None:
        """ncclpy's own check of ``ncclCommGetAsyncError`` (the communicator's lock and states
        respected; nothing once it is closed)."""
        if self.comm is not None:
            self.comm._raise_async_error()


class NcclpyDefaultsBackend(NcclpyBackend):
    """``ncclpy`` in bench.overhead: the communicator ``ncclpy.init`` makes --
    ``Communicator.from_bootstrap`` on the harness's rendezvous store (rank 0 hosts it, as it
    hosts ``ncclpy.init``'s), the watchdog on and the flight recorder at its default size, with
    the ``NCCLPY_*`` variables that change those left unset while it is made."""

    name = "ncclpy"
    label = "ncclpy"
    defaults = ("ncclpy.init's defaults: watchdog on (heartbeats on the rendezvous store), "
                "flight recorder on (NCCLPY_TRACE_BUFFER unset: its default size)")

    def open_comm(self, uid: bytes) -> Any:
        import ncclpy
        from ncclpy.rendezvous.bootstrap import Bootstrap
        self.ncclpy = ncclpy
        bs = Bootstrap(rank=self.rank, world_size=self.world, local_rank=self.rank,
                       device=int(self.device), uid=uid, name=f"bench-{self.name}",
                       generation=self.generation, store=self.store, info=None)
        with environ(**{k: None for k in DEFAULTS_ENV}):
            return ncclpy.Communicator.from_bootstrap(bs, self._config(), checked=False,
                                                      watchdog=True)


class NcclpyBareBackend(NcclpyBackend):
    """``ncclpy-bare`` in bench.overhead: ``ncclpy.Communicator(...)`` made with
    ``NCCLPY_TRACE_BUFFER=0`` (no flight recorder) and no watchdog (the constructor starts none):
    what the defaults cost is ``ncclpy`` minus this."""

    name = "ncclpy-bare"
    label = "ncclpy-bare"
    defaults = "watchdog off, flight recorder off (NCCLPY_TRACE_BUFFER=0)"

    def open_comm(self, uid: bytes) -> Any:
        with environ(NCCLPY_TRACE_BUFFER="0", NCCLPY_NVTX=None):
            return super().open_comm(uid)


def call_args(collective: str, a: Dict[str, Any], in_place: bool, rank: int,
              root: int) -> Tuple[Any, Any]:
    """(sendbuf, recvbuf) for ncclpy's call, from the buffers ``a`` (keys send, recv, whole,
    ip_send, ip_recv).  Out of place: send and recv.  In place: ncclpy's documented forms --
    ``recvbuf=None`` where the result overwrites the input (all_reduce, reduce, broadcast,
    reduce_scatter, all_to_all), ``sendbuf=None`` where the input is a block of the output
    (all_gather) -- and NCCL's aliasing rules for gather/scatter (the root's block of the whole
    buffer is its own send/recv side) and send/recv (one buffer).  gather's receive and
    scatter's send side exist on the root only (None elsewhere)."""
    whole = a["whole"]
    if collective == "all_gather":
        s, r = (None, whole) if in_place else (a["send"], a["recv"])
    elif collective == "gather":
        s, r = (a["ip_send"], whole) if in_place else (a["send"], a["recv"])
        r = r if rank == root else None
    elif collective == "scatter":
        s, r = (whole, a["ip_recv"]) if in_place else (a["send"], a["recv"])
        s = s if rank == root else None
    elif collective == "send_recv":
        s, r = (whole, whole) if in_place else (a["send"], a["recv"])
    else:
        s, r = (whole, None) if in_place else (a["send"], a["recv"])
    return s, r
