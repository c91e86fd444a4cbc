"""NVIDIA's own Python binding of NCCL, nccl4py (``import nccl.core``), as a bench.overhead backend.

Optional: not a dependency of ncclpy.  ``pip install nccl4py==0.6.0`` (it needs ``cuda-core``
1.x and ``cuda-pathfinder``); on a machine without network, ``bash bench/install_wheels.sh``
installs the wheels kept in ``wheels/``.  The API used (nccl4py 0.6.0, read in its wheel's
``nccl/core/``): ``UniqueId.from_bytes`` (``utils.py``), ``Communicator.init(nranks, rank,
unique_id)`` and ``Communicator.destroy()`` (``communicator.py``: ``ncclCommInitRankScalable``
with one id on the current device), ``Communicator.allreduce(sendbuf, recvbuf, op, stream=)``
(``communicator.py``: buffers resolved by ``NcclBuffer``, count and dtype from ``sendbuf``, in
place when both resolve to one address; ``buffer.py``), and ``stream`` as a raw ``int``
handle, which ``get_stream_ptr`` passes through unchanged (``cuda.py``).

The communicator comes from unique-id bytes shared through the harness's store exactly as the
other backends' do; the buffers are the other backends' CuPy arrays; the stream is their
stream's raw handle.  Only all_reduce is timed (nccl4py has no prepared call: the ``prepared``
mode runs this eager call).
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

from ncclpy.errors import ArgumentError, MissingDependencyError

from . import Buffers
from ._cuda import CupyStreamBackend

__all__ = ["Nccl4pyBackend", "missing", "INSTALL_HINT", "COLLECTIVES", "version_info"]

#: how to get nccl4py, said wherever it is missing
INSTALL_HINT = ("install it with: pip install nccl4py==0.6.0 (it needs cuda-core 1.x); offline, "
                "from the wheels in wheels/: bash bench/install_wheels.sh")
#: what this backend times
COLLECTIVES = ("all_reduce",)


def missing() -> Optional[str]:
    """Why ``import nccl.core`` fails here (None: nccl4py is usable)."""
    try:
        importlib.import_module("nccl.core")
    except Exception as e:  # ImportError, or an install whose own imports fail
        return f"{type(e).__name__}: {e}"
    return None


def version_info() -> Dict[str, Any]:
    """nccl4py's version and the libnccl it loaded (path, version), for the JSON."""
    try:
        import nccl.core as nc
        v = nc.get_version()
    except Exception as e:  # informational only
        return {"error": f"{type(e).__name__}: {e}"}
    lib = v.libnccl
    return {"nccl4py": str(v.nccl4py), "bindings": str(v.nccl_bindings),
            "libnccl": None if lib is None else str(lib.version),
            "libnccl_path": None if lib is None or lib.path is None else str(lib.path)}


class Nccl4pyBackend(CupyStreamBackend):
    """nccl4py's ``Communicator`` on the shared CuPy buffers and stream handle."""

    name = "nccl4py"
    label = "nccl4py"
    defaults = "nccl4py's defaults (Communicator.init, no config)"
    stream_form = "the raw handle (int) of the stream"

    def open_comm(self, uid: bytes) -> Any:
        try:
            import nccl.core as nc
        except Exception as e:
            raise MissingDependencyError(f"the nccl4py backend needs nccl4py ({type(e).__name__}: "
                                         f"{e}); {INSTALL_HINT}") from None
        self.nc = nc
        self._ops = {"sum": nc.SUM, "prod": nc.PROD, "max": nc.MAX, "min": nc.MIN,
                     "avg": nc.AVG}
        with self.cp.cuda.Device(self.device):       # NCCL makes it on the current device
            return nc.Communicator.init(self.world, self.rank, nc.UniqueId.from_bytes(bytes(uid)))

    def close_comm(self, comm: Any) -> None:
        comm.destroy()

    def nccl_version(self) -> int:
        from nccl.bindings import nccl as bindings
        return int(bindings.get_version())

    def unsupported(self, collective: str, dtype: str, op: str) -> Optional[str]:
        if collective not in COLLECTIVES:
            return f"the nccl4py backend times {', '.join(COLLECTIVES)} only"
        return super().unsupported(collective, dtype, op)

    def settings(self) -> Dict[str, Any]:
        return version_info()

    def run(self, collective: str, bufs: Buffers, op: str, root: int, in_place: bool) -> None:
        if collective != "all_reduce":
            raise ArgumentError(f"backend nccl4py: times {', '.join(COLLECTIVES)} only, not "
                                f"{collective}")
        send, recv = bufs.pair(in_place)
        self.comm.allreduce(send, recv, self._ops[op], stream=self.stream_arg)
