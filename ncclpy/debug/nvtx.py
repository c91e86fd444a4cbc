"""NVTX ranges around ncclpy's calls (``NCCLPY_NVTX=1``), so Nsight Systems shows them.

Each call becomes a range named ``ncclpy <collective> #<seq> <dtype> <bytes>B`` around its
host-side issue (the NCCL kernels NCCL itself annotates).  Off by default, and free when off:
the call path then never reaches this module.  The ranges go through CuPy's NVTX binding
(``cupy.cuda.nvtx``: NVTX 3, a no-op until a profiler attaches).
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import UnsupportedError

__all__ = ["enabled", "Ranges", "ranges"]


def enabled() -> bool:
    """``NCCLPY_NVTX`` checked: 1/0, true/false, yes/no, on/off (default off)."""
    from .watchdog import env_flag
    return env_flag("NCCLPY_NVTX", None, "NCCLPY_NVTX", False)


class Ranges:
    """``push(plan, seq)`` / ``pop()`` around one call."""

    __slots__ = ("_push", "_pop")

    def __init__(self, push: Callable[[str], Any], pop: Callable[[], Any]) -> None:
        self._push, self._pop = push, pop

    @staticmethod
    def name(plan: Any, seq: int) -> str:
        dtype = plan.meta.get("dtype")
        return (f"ncclpy {plan.collective} #{seq}" + (f" {dtype}" if dtype else "")
                + f" {plan.nbytes}B")

    def push(self, plan: Any, seq: int) -> None:
        self._push(self.name(plan, seq))

    def pop(self) -> None:
        self._pop()


def ranges() -> Ranges:
    """The NVTX ranges of this process (UnsupportedError when CuPy's NVTX is missing)."""
    try:
        from cupy.cuda import nvtx
        if not getattr(nvtx, "available", True):
            raise ImportError("cupy.cuda.nvtx.available is False")
    except Exception as e:  # noqa: BLE001 - said in one line below
        raise UnsupportedError(f"NCCLPY_NVTX=1: NVTX ranges need CuPy's NVTX binding "
                               f"(cupy.cuda.nvtx), which is not usable here: "
                               f"{type(e).__name__}: {e}") from e
    return Ranges(nvtx.RangePush, nvtx.RangePop)
