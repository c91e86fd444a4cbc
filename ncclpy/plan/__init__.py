"""Pure planning: user arguments -> the exact NCCL calls (no GPU needed)."""
from .types import (NCCL_FUNCTIONS, PREMUL_OP, Copy, NcclCall, Plan, PlanContext, PremulSpec,
                    Scratch, Step)

__all__ = ["NCCL_FUNCTIONS", "PREMUL_OP", "Copy", "NcclCall", "Plan", "PlanContext",
           "PremulSpec", "Scratch", "Step"]
