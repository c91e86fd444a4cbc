"""Helpers of the part-2 CPU tests (tests/test_nccl_part2.py, tests/test_nccl_rma.py):
thread-rank communicators on the STAND-IN for libnccl, and host access to its "device"
memory."""
from __future__ import annotations

import ctypes
from typing import Any, Optional

import numpy as np

from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator

__all__ = ["UID", "NEW", "comm", "fill", "read", "calls"]

UID = bytes(range(128))
NEW = 23203                      # the stand-in's NCCL version: every part-2 call exists


def comm(n: int, r: int, config: Optional[Config] = None, **kw: Any) -> Communicator:
    """Rank ``r`` of ``n`` (device ``r``), blocking unless ``config`` says otherwise."""
    return Communicator(n, r, UID, r, config or Config(blocking=True), **kw)


def fill(buf: Any, values: Any) -> None:
    """Write host ``values`` into a stand-in device Buffer (its memory is host memory)."""
    a = np.ascontiguousarray(values)
    ctypes.memmove(buf.ptr, a.ctypes.data, a.nbytes)


def read(buf: Any, count: int, dtype: Any = np.float32) -> np.ndarray:
    """``count`` elements of a stand-in device Buffer."""
    return np.frombuffer(ctypes.string_at(buf.ptr, count * np.dtype(dtype).itemsize),
                         dtype=dtype).copy()


def calls(eng: Any, name: str) -> list:
    """The stand-in's records of NCCL function ``name``."""
    return [c for c in eng.calls if c[0] == name]
