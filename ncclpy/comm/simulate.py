"""``group(simulate=True)``: NCCL's predicted time for a group, without launching it.

Inside ``with comm.group(simulate=True) as g:`` calls are planned and handed to NCCL as usual;
the block ends with ``ncclGroupSimulateEnd`` (NCCL 2.22) instead of ``ncclGroupEnd``, so NCCL
runs its tuning model and fills ``ncclSimInfo_t.estimatedTime`` but launches nothing.  Each
call's Work then fails with :class:`~ncclpy.errors.NotLaunchedError` (nothing ran: no result to
wait for), copies out of scratch are skipped, and ``g.estimated_time`` holds NCCL's estimate.
Only an outermost group can be simulated (NCCL ends its group only at the outermost end).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

from .._nccl.group import SimInfoStruct, UNDEF_FLOAT, sim_info
from ..errors import ArgumentTypeError, NotLaunchedError
from .execute import group_scope

__all__ = ["SimulatedGroup", "simulate_end", "simulated_group", "check_simulate",
           "SIMULATE_FROM"]

SIMULATE_FROM = 22200            # ncclGroupSimulateEnd / ncclSimInfo_t


class SimulatedGroup:
    """What ``with group(simulate=True) as g`` gives: NCCL's estimate once the block ended.

    ``estimated_time_us``: NCCL's ``estimatedTime`` (microseconds, its tuning model's unit),
    ``estimated_time``: the same in seconds; both None until the block ended, and None when
    NCCL estimated nothing (e.g. the group held no collective NCCL times)."""

    __slots__ = ("info", "ended", "calls")

    def __init__(self) -> None:
        self.info: SimInfoStruct = sim_info()
        self.ended = False
        self.calls = 0

    @property
    def estimated_time_us(self) -> Optional[float]:
        t = float(self.info.estimatedTime)
        return None if not self.ended or t == UNDEF_FLOAT or t < 0 else t

    @property
    def estimated_time(self) -> Optional[float]:
        t = self.estimated_time_us
        return None if t is None else t * 1e-6

    def not_launched(self) -> NotLaunchedError:
        return NotLaunchedError("this call was made inside group(simulate=True): NCCL only "
                                "estimated the group's time (ncclGroupSimulateEnd) and never "
                                "launched it; run it outside the simulated group for a result")

    def __repr__(self) -> str:
        t = self.estimated_time_us
        what = "pending" if not self.ended else "no estimate" if t is None else f"{t:.2f} us"
        return f"<SimulatedGroup {what}>"


def simulate_end(lib: Any, sim: SimulatedGroup) -> Callable[[], int]:
    """The group end of a simulated group: ``ncclGroupSimulateEnd(&sim.info)`` (0 or
    ncclInProgress, else NCCL's error)."""
    f = lib.fn("ncclGroupSimulateEnd")
    ptr = ctypes.byref(sim.info)

    def end() -> int:
        code = lib.check(f(ptr), "ncclGroupSimulateEnd", None, in_progress_ok=True)
        sim.ended = True
        return code
    return end


def check_simulate(simulate: Any) -> bool:
    """``simulate`` as given: True or False only."""
    if simulate is True or simulate is False:
        return simulate
    raise ArgumentTypeError(f"group(simulate=...): expected True or False, got "
                            f"{type(simulate).__name__} {simulate!r}")


def simulated_group(lib: Any, start: Callable[[], int], comm: Any = None) -> Any:
    """The ``group_scope`` of ``group(simulate=True)``: VersionError below NCCL 2.22,
    before the group opens."""
    sim = SimulatedGroup()
    end = simulate_end(lib, sim)          # lib.fn: VersionError when NCCL is too old
    return group_scope(start, end, comm, sim)
