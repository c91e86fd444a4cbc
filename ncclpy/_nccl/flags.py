"""NCCL's flag and enum values for windows, shrink, revoke, suspend and memory statistics.

Proven against ``nccl.h`` by the binding gate (:data:`ncclpy._nccl.abi.CONSTANTS`); each flag
with the first NCCL version whose ``nccl.h`` defines it (``WIN_FLAG_VERSIONS``), so that a
flag the loaded NCCL does not know is refused before NCCL sees it.
"""
from __future__ import annotations

from typing import Dict

from .functions import nccl_version_code as _V

__all__ = ["WIN_DEFAULT", "WIN_COLL_SYMMETRIC", "WIN_STRICT_ORDERING", "WIN_GIN_ONLY",
           "WIN_REQUIRED_ALIGNMENT", "WIN_FLAG_VERSIONS", "SHRINK_DEFAULT", "SHRINK_ABORT",
           "REVOKE_DEFAULT", "SUSPEND_MEM", "MEM_STATS"]

WIN_DEFAULT = 0x00
WIN_COLL_SYMMETRIC = 0x01
WIN_STRICT_ORDERING = 0x02
WIN_GIN_ONLY = 0x04
#: a window's address must sit at a multiple of this many bytes in its cuMem allocation
WIN_REQUIRED_ALIGNMENT = 4096
#: window flag -> (its keyword in Communicator.register_window, first NCCL version)
WIN_FLAG_VERSIONS: Dict[int, tuple] = {
    WIN_COLL_SYMMETRIC: ("symmetric", _V(2, 27, 3)),
    WIN_STRICT_ORDERING: ("strict_ordering", _V(2, 29, 7)),
    WIN_GIN_ONLY: ("gin_only", _V(2, 32, 0)),
}

SHRINK_DEFAULT = 0x00
SHRINK_ABORT = 0x01
REVOKE_DEFAULT = 0x00
SUSPEND_MEM = 0x01

#: ncclCommMemStat_t: the key Communicator.mem_stats() reports -> the enum value
MEM_STATS: Dict[str, int] = {"suspendable_bytes": 0, "suspended": 1, "persistent_bytes": 2,
                             "total_bytes": 3}
