"""Which libnccl a loaded library really calls: torch's is found by resolving ``ncclGetVersion``
through torch's CUDA library handle and asking the dynamic loader which file defines it
(``dladdr``).  ``ncclpy info`` reports it and ``ncclpy check`` compares it with ncclpy's own
(:mod:`ncclpy.check.fairness`), so it lives here, below both.
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import List, Optional, Tuple

__all__ = ["mapped_paths", "symbol_library", "torch_libnccl"]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def mapped_paths(pattern: str) -> List[str]:
    """Files mapped into this process whose basename matches ``pattern`` (load order)."""
    out: List[str] = []
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    rx = re.compile(pattern)
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and rx.search(os.path.basename(parts[5])):
            if parts[5] not in out:
                out.append(parts[5])
    return out


def symbol_library(lib_path: str, symbol: str = "ncclGetVersion") -> Optional[str]:
    """Real path of the file that defines ``symbol`` as the already loaded ``lib_path`` resolves
    it (its own definitions, then its dependencies'); None if it cannot."""
    try:
        h = ctypes.CDLL(lib_path, mode=os.RTLD_NOW | getattr(os, "RTLD_NOLOAD", 0))
        fn = getattr(h, symbol)
        libc = ctypes.CDLL(None)
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        libc.dladdr.restype = ctypes.c_int
        info = _DlInfo()
        if not libc.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) or \
                not info.dli_fname:
            return None
        return os.path.realpath(os.fsdecode(info.dli_fname))
    except (OSError, AttributeError):
        return None


def torch_libnccl() -> Tuple[Optional[str], str]:
    """(real path of the libnccl torch's NCCL backend calls, how it was found)."""
    for lib in mapped_paths(r"^libtorch_cuda.*\.so") + mapped_paths(r"^libtorch\.so"):
        path = symbol_library(lib)
        if path:
            return path, f"dladdr(ncclGetVersion) resolved through {os.path.basename(lib)}"
    return None, "no loaded torch CUDA library resolves ncclGetVersion"
