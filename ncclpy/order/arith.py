"""The arithmetic of a predicted fold: each add (or multiply, min, max) is one correctly rounded
operation in the element's type, done by :func:`ncclpy.reference.reduce_arrays` (the exact
result in float64, rounded once, float8 saturating), so the model and the reference share one
definition of an NCCL add.

Why one rounding per step is NCCL's arithmetic (src/device/reduce_kernel.h at v2.28.9-1):
float/double add with ``a+b`` (315-318); half with ``__hadd`` (401-405) and bfloat16 with
``__hadd`` on sm_80+ (424-426), both correctly rounded; bfloat16 below sm_80 and half on sm_61
add in float and round back (434, 410), which gives the same bits because float has more
than twice their precision plus two bits (a double rounding is then innocuous); float8 on sm_90+
converts to half (exact), adds with ``__hadd`` and converts back with ``__NV_SATFINITE``
(442-450): half has 11 bits, more than 2x4+2, so this too equals one saturating rounding.
PreMulSum and AVG on floats multiply each rank's input once, as it is loaded
(``applyPreOp``, 655-760; PreOpSrcs = the user input only, prims_simple.h:267-268,
prims_ll.h:256), by ``1/n`` rounded as enqueue.cc:2285-2322 rounds it; integer AVG sums and
divides once at the end (FuncSumPostDiv, reduce_kernel.h:774-816).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..semantics.dtypes import DTYPES
from ..semantics.ops import RedOp, premul_sum
from ..semantics.reference import reduce_arrays
from .topology import Expr

__all__ = ["Arith", "BLOCK", "native_fold"]

#: elements evaluated at once (bounds the memory of a 64 MiB prediction)
BLOCK = 1 << 21
#: types whose sum and product numpy computes as NCCL does, one correctly rounded IEEE
#: operation per step (float: reduce_kernel.h:315-318 ``a+b``, ``a*b``)
_NATIVE = {"float32": np.float32, "float64": np.float64}


def native_fold(items: Sequence[np.ndarray], op: str, t: type) -> Optional[np.ndarray]:
    """The left fold of ``items`` in numpy's own float32/float64 arithmetic: the bits
    :func:`~ncclpy.reference.reduce_arrays` gives (it adds exactly in float64 and rounds
    once per step; for float32 a double rounding through float64 is innocuous for + and x, as
    53 >= 2*24 + 2), or None where a NaN appears (its payload is then the reference's, on the
    same arrays).  The CPU's flush-to-zero mode (``torch.set_flush_denormal(True)``) would
    change subnormal results: NCCL's kernels keep them."""
    f = np.add if op == "sum" else np.multiply
    with np.errstate(all="ignore"):
        acc = np.array(items[0], dtype=t, copy=True)
        for v in items[1:]:
            f(acc, np.asarray(v, dtype=t), out=acc)   # each operand in the type, as NCCL's
    if np.isnan(acc).any():
        return None
    return acc


class Arith:
    """How one config's values combine: ``leaf`` (a rank's input as NCCL first uses it),
    ``fold`` (a left fold of sub-results), ``finish`` (NCCL's postOp)."""

    def __init__(self, dtype: str, op: str, nranks: int, scalar: Optional[float] = None):
        self.dtype = dtype
        self.n = nranks
        self.is_float = DTYPES[dtype].kind == "float"
        self.op: RedOp = premul_sum(scalar) if op == "premul_sum" else RedOp(op)
        self.fold_op = RedOp("sum") if op in ("avg", "premul_sum") else RedOp(op)
        self.pre = op == "premul_sum" or (op == "avg" and self.is_float)
        self.post = op == "avg" and not self.is_float
        self.native = _NATIVE.get(dtype) if self.fold_op.name in ("sum", "prod") else None

    def leaf(self, x: np.ndarray) -> np.ndarray:
        """The input as NCCL folds it: pre-multiplied for premul_sum and float AVG."""
        if self.pre:
            return reduce_arrays([x], self.op, self.dtype, world_size=self.n)
        return x

    def fold(self, items: Sequence[np.ndarray]) -> np.ndarray:
        """``((items[0] op items[1]) op items[2]) ...``, one rounding per step."""
        if len(items) == 1:
            return items[0]
        if self.native is not None:
            res = native_fold(items, self.fold_op.name, self.native)
            if res is not None:
                return res
        return reduce_arrays(list(items), self.fold_op, self.dtype, world_size=self.n)

    def finish(self, acc: np.ndarray) -> np.ndarray:
        """NCCL's postOp: integer AVG divides the wrapped sum by n, truncating."""
        if self.post:
            return reduce_arrays([acc], self.op, self.dtype, world_size=self.n)
        return acc

    def evaluate(self, expr: Expr, leaves: Sequence[np.ndarray]) -> np.ndarray:
        """The value of ``expr`` over already-prepared leaves (one array per rank, same
        length), before ``finish``."""
        if isinstance(expr, int):
            return leaves[expr]
        return self.fold([self.evaluate(item, leaves) for item in expr])

    def fold_gather(self, table: np.ndarray, group: np.ndarray,
                    leaves: List[np.ndarray]) -> np.ndarray:
        """Flat folds, one per element: element e folds ranks ``table[group[e], 0..n-1]``.
        One vectorized fold over all elements (operand k of element e gathered from its rank)."""
        stacked = np.stack(leaves)
        cols = np.arange(group.size)
        ranks = table[group]
        operands = [stacked[ranks[:, k], cols] for k in range(table.shape[1])]
        return self.fold(operands)
