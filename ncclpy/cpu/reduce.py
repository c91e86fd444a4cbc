"""The CPU engine's rank-order reductions: :func:`ncclpy.reference.reduce_arrays`'s
results, bit for bit, with a native fast path where that is provably the same computation.  The
engine folds in NCCL's order where the order can change the bits (:mod:`ncclpy.cpu.folds`); it comes
here where it cannot (integers, min/max, two ranks) and for each rank's PreMulSum/AVG leaf.

For float32 and float64 sum and prod the reference folds left in float64 and rounds once to
the wire type per step; for float32 that is float32 arithmetic (double rounding through
float64 is innocuous for +, * when 53 >= 2*24 + 2 bits), for float64 it is float64's own.
NaN payloads are where native arithmetic and the reference may differ (the reference's own
payload can depend on an element's position in numpy's loops), so a result with any NaN is
computed again by the reference, on the whole arrays, exactly as it would be called.
Everything else (integers, half types, fp8, min/max, avg, premul_sum) goes to the reference as
it is.
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from ..semantics import reference as R

__all__ = ["reduce"]

_NATIVE = {"float32": np.float32, "float64": np.float64}


def reduce(ins: List[np.ndarray], op: Any, wire: str, n: int,
           scalar_bits: Optional[int] = None) -> np.ndarray:
    """``op`` over the logical arrays ``ins`` (rank order) of ``wire`` dtype, as the
    reference computes it; ``n`` is AVG's world size."""
    t = _NATIVE.get(wire)
    if t is None or op not in ("sum", "prod") or scalar_bits is not None or not ins:
        return R.reduce_arrays(ins, op, wire, n, scalar_bits=scalar_bits)
    with np.errstate(all="ignore"):
        acc = np.array(ins[0], dtype=t, copy=True)
        for v in ins[1:]:
            if op == "sum":
                np.add(acc, v, out=acc)
            else:
                np.multiply(acc, v, out=acc)
        if np.isnan(acc).any():     # NaN payloads: the reference's own, on the whole arrays
            return R.reduce_arrays(ins, op, wire, n)
    return acc
