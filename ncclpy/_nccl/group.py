"""This thread's ncclpy group state: NCCL's group nesting is per thread, so is ncclpy's.

Kept beside the NCCL bindings (below the call path) because the binding layer reads it too:
``_nccl.dispatch`` waits on a nonblocking communicator only outside a group, and
``_nccl.lib.repair_group_depth`` closes levels a failed init left open only when ncclpy has
none open.  :mod:`ncclpy.comm.execute` drives it.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, List, Optional

__all__ = ["GroupState", "group_state", "group_depth", "SimInfoStruct", "SIM_INFO_MAGIC",
           "SIM_INFO_VERSION", "sim_info", "OPEN", "opened", "closed"]

SIM_INFO_MAGIC = 0x74685283        # NCCL_SIM_INFO_INITIALIZER's magic
SIM_INFO_VERSION = 22200           # ncclSimInfo_v22200
UNDEF_FLOAT = -1.0                 # NCCL_UNDEF_FLOAT


class SimInfoStruct(ctypes.Structure):
    """``ncclSimInfo_t`` (NCCL 2.22): what ``ncclGroupSimulateEnd`` fills in."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint),
                ("version", ctypes.c_uint), ("estimatedTime", ctypes.c_float)]


def sim_info() -> SimInfoStruct:
    """A fresh ``ncclSimInfo_t`` as ``NCCL_SIM_INFO_INITIALIZER`` makes it."""
    s = SimInfoStruct()
    s.size = ctypes.sizeof(SimInfoStruct)
    s.magic = SIM_INFO_MAGIC
    s.version = SIM_INFO_VERSION
    s.estimatedTime = UNDEF_FLOAT
    return s

_tls = threading.local()

#: how many threads have a group open now: while 0 (the common case), the call path's fast
#: path knows no group is open without reading its thread-local state
OPEN = [0]
_open_lock = threading.Lock()


def opened() -> None:
    """A thread's outermost group opened."""
    with _open_lock:
        OPEN[0] += 1


def closed() -> None:
    """A thread's outermost group ended."""
    with _open_lock:
        OPEN[0] -= 1


class GroupState:
    """This thread's ncclpy group nesting and what waits for the outermost group end."""

    __slots__ = ("depth", "pending", "comms", "checks", "sim")

    def __init__(self) -> None:
        self.depth = 0
        self.pending: List[Callable[[Optional[BaseException]], None]] = []
        self.comms: dict = {}
        self.checks: List[Any] = []     # checked mode: calls deferred to the outermost end
        self.sim: Any = None            # the open group is simulated (ncclGroupSimulateEnd)


def group_state() -> GroupState:
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = GroupState()
    return st


def group_depth() -> int:
    """This thread's ncclpy group nesting (0: not inside ``group()``)."""
    try:
        return _tls.state.depth
    except AttributeError:        # first look from this thread: make its state once
        return group_state().depth
