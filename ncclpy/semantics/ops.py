"""Reduction operators: parsing, NCCL enum values and per-dtype validity.

``premul_sum(scalar)`` describes NCCL's ``ncclRedOpCreatePreMulSum``; the communicator creates
the NCCL op at execution time with the scalar converted to the buffer's dtype and destroys it
after use.  NCCL has no bitwise reductions: BAND/BOR/BXOR get a precise error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .dtypes import Logical, format_version, logical
from ..errors import ArgumentError, ArgumentTypeError, UnsupportedError

__all__ = ["RedOp", "SUM", "PROD", "MAX", "MIN", "AVG", "premul_sum", "parse_op", "NCCL_OPS",
           "effective_op", "OP_NAMES", "op_min_version", "format_version"]

NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
OP_NAMES = ("sum", "prod", "max", "min", "avg", "premul_sum")
_MIN_VERSION = {"avg": 21000, "premul_sum": 21100}
_ALIASES = {"product": "prod", "mul": "prod", "maximum": "max", "minimum": "min",
            "average": "avg", "mean": "avg", "premulsum": "premul_sum"}
_BITWISE = {"band", "bor", "bxor", "and", "or", "xor"}


@dataclass(frozen=True)
class RedOp:
    """A reduction: ``name`` in OP_NAMES, ``scalar`` only for premul_sum."""

    name: str
    scalar: Optional[float] = None

    def __repr__(self) -> str:
        return f"premul_sum({self.scalar!r})" if self.name == "premul_sum" else self.name.upper()


SUM, PROD, MAX, MIN, AVG = (RedOp(n) for n in ("sum", "prod", "max", "min", "avg"))


def premul_sum(scalar: Any) -> RedOp:
    """``sum(scalar * x_r)``: NCCL's PreMulSum.  ``scalar`` is a finite real number (or a 0-d
    array); one rule everywhere (here, ``ncclpy check --premul-scalar``, the planners): finite,
    and, on the call's dtype, neither overflowing nor rounding a non-zero value to zero."""
    if isinstance(scalar, bool) or not _is_number(scalar):
        raise ArgumentTypeError(
            f"premul_sum scalar: expected a real number, got {scalar!r} "
            f"({type(scalar).__name__})")
    if complex(scalar).imag != 0:
        raise UnsupportedError(f"premul_sum scalar: NCCL pre-multiplies by a real scalar; got "
                               f"the complex {scalar!r}")
    value = float(complex(scalar).real)
    if not math.isfinite(value):
        raise ArgumentError(f"premul_sum scalar: expected a finite real number, got {scalar!r} "
                            f"(NCCL would multiply every element by it: inf/NaN results)")
    return RedOp("premul_sum", value)


def _is_number(x: Any) -> bool:
    try:
        complex(x)
    except (TypeError, ValueError):
        return False
    return not isinstance(x, (str, bytes))


def parse_op(op: Any) -> RedOp:
    """Accept a RedOp, a string ("sum", "prod", "min", "max", "avg", ...), an NCCL enum value
    (0-4) or a torch.distributed ReduceOp (by name)."""
    if isinstance(op, RedOp):
        return op
    if isinstance(op, bool):
        raise ArgumentTypeError(f"op: expected a reduction, got {op!r}")
    if isinstance(op, int):
        for name, val in NCCL_OPS.items():
            if val == op:
                return RedOp(name)
        raise ArgumentError(f"op: NCCL enum value {op} is not a built-in reduction; expected "
                            f"0..4 ({', '.join(f'{k}={v}' for k, v in NCCL_OPS.items())})")
    if isinstance(op, str):
        name = op
    else:  # torch.distributed.ReduceOp / RedOpType or an enum
        name = getattr(op, "name", None) or str(op)
        if not isinstance(name, str):
            raise ArgumentTypeError(f"op: expected a reduction name or RedOp, got {op!r}")
    key = name.strip().lower().split(".")[-1]
    key = _ALIASES.get(key, key)
    if key in _BITWISE:
        raise UnsupportedError(
            f"op {name!r}: NCCL has no bitwise reductions (BAND/BOR/BXOR exist only in "
            f"torch's gloo/MPI backends); NCCL offers sum, prod, max, min, avg, premul_sum")
    if key == "premul_sum":
        raise ArgumentError("op 'premul_sum' needs its scalar: use ncclpy.premul_sum(scalar)")
    if key in NCCL_OPS:
        return RedOp(key)
    raise ArgumentError(f"op: unknown reduction {name!r}; expected one of "
                        f"'sum', 'prod', 'max', 'min', 'avg' or ncclpy.premul_sum(x)")


def op_min_version(op: RedOp) -> int:
    """NCCL version code needed for ``op`` (0 if any)."""
    return _MIN_VERSION.get(op.name, 0)


#: NCCL's one-rank path (``ncclLaunchOneRank``) runs avg and premul_sum as a PreMulSum kernel
#: chosen by a host-side switch whose float8 cases are compiled only where ``__CUDA_ARCH__ >=
#: 900``, i.e. never on the host: a 1-rank communicator returns ncclInvalidArgument for them
#: (measured: NCCL 2.28.9 on an H100, 2026-11-25).  With 2 or more ranks they run.
_ONE_RANK_NO_FP8 = frozenset({"avg", "premul_sum"})
_FP8_WIRES = frozenset({"float8_e4m3", "float8_e5m2"})


def effective_op(op: Any, dtype: Any, nccl_version: int = 0, world_size: int = 0,
                 version_note: str = "the loaded NCCL is {}") -> RedOp:
    """The op NCCL actually runs for ``op`` on logical ``dtype`` (torch's bool and complex
    rules), or a precise UnsupportedError.  ``world_size`` (0: unknown) adds what NCCL refuses
    on a communicator of that size (float8 avg/premul_sum on one rank); ``version_note`` says
    in an error what ``nccl_version`` is (``{}``: its number)."""
    o = parse_op(op)
    lg: Logical = logical(dtype)
    if lg.ops is not None and o.name not in lg.ops:
        raise UnsupportedError(
            f"op {o.name} is not supported for dtype {lg.name}: allowed are "
            f"{', '.join(sorted(lg.ops))} (torch.distributed rules)")
    if lg.op_map and o.name in lg.op_map:
        o = RedOp(lg.op_map[o.name])
    need = op_min_version(o)
    if nccl_version and need > nccl_version:
        raise UnsupportedError(f"op {o.name} needs NCCL >= {format_version(need)}; "
                               f"{version_note.format(format_version(nccl_version))}")
    if world_size == 1 and o.name in _ONE_RANK_NO_FP8 and lg.wire.name in _FP8_WIRES:
        raise UnsupportedError(
            f"op {o.name} on {lg.name} with a 1-rank communicator: NCCL's one-rank path "
            f"(ncclLaunchOneRank) has no float8 kernel for it and returns ncclInvalidArgument "
            f"(measured with NCCL 2.28.9); sum, prod, max and min work on one rank, and "
            f"{o.name} works with 2 or more ranks")
    return o
