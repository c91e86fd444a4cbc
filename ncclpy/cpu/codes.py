"""What every part of the CPU engine shares and nothing else: NCCL's result codes, the NCCL
datatypes by their ``ncclDataType_t`` value and the builtin reduction ops by their
``ncclRedOp_t`` value.  It imports nothing of ncclpy.cpu, so every module of the engine can
import it (the engine's modules import downwards only)."""
from __future__ import annotations

from typing import Dict

from ..semantics.dtypes import DTYPES, DType

__all__ = ["SUCCESS", "UNHANDLED_CUDA", "SYSTEM", "INTERNAL", "INVALID_ARG", "INVALID_USAGE",
           "REMOTE", "IN_PROGRESS", "BY_ENUM", "OPS", "_BY_ENUM", "_OPS"]

#: ncclResult_t (src/nccl.h.in, 2.28.9): ncclSuccess ... ncclInProgress
SUCCESS, UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARG, INVALID_USAGE, REMOTE, IN_PROGRESS = \
    range(8)
#: ncclDataType_t value -> the NCCL type
BY_ENUM: Dict[int, DType] = {d.nccl: d for d in DTYPES.values()}
#: ncclRedOp_t value -> the builtin op's name (ncclSum ... ncclAvg)
OPS: Dict[int, str] = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
# the names the engine's modules (and tests/nccl_standin.py) have always used
_BY_ENUM = BY_ENUM
_OPS = OPS
