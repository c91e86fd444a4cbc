"""Correctness for the sweep's #wrong column: verifiable inputs, the numpy reference, comparison.

Inputs come from :mod:`ncclpy.semantics.numerics` (integer mantissas at a shared exponent, so sums,
products and min/max are exact in every dtype) and depend only on (collective, dtype, op, rank,
world, length, seed), so every rank can rebuild every other rank's input and run the reference
(:mod:`ncclpy.reference`) locally.  Comparison is bitwise (tolerance 0), except AVG on
floats: NCCL multiplies by 1/n rounded to the dtype, so up to 2 ULP are accepted.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ncclpy.semantics.dtypes import DTYPES

from .backends import host_dtype

__all__ = ["rank_input", "expected", "count_wrong", "corrupt", "AVG_ULP"]

#: ULP tolerance for AVG on floating types
AVG_ULP = 2


def rank_input(collective: str, dtype: str, op: str, rank: int, world: int, n: int,
               seed: int) -> np.ndarray:
    """This rank's input: ``n`` elements, host dtype (uint view for bfloat16/float8)."""
    from ncclpy.semantics import numerics
    arr = numerics.verifiable_input(dtype, n, op=None if op == "none" else op,
                                    world_size=world, seed=seed, rank=rank, tag=collective)
    return np.ascontiguousarray(arr).view(host_dtype(dtype)).reshape(-1)


def expected(collective: str, inputs: List[np.ndarray], dtype: str, op: str, root: int,
             world: int, in_place: bool) -> List[Optional[np.ndarray]]:
    """Per-rank outputs from the numpy reference (None where NCCL leaves one undefined)."""
    from ncclpy.semantics import reference
    fn = getattr(reference, collective)
    kw = {"world_size": world, "dtype": dtype, "in_place": in_place}
    if op != "none":
        kw["op"] = op
    if root >= 0:
        kw["root"] = root
    outs = fn(inputs, **kw)
    return [None if o is None else np.ascontiguousarray(o).view(host_dtype(dtype)).reshape(-1)
            for o in outs]


def count_wrong(out: np.ndarray, exp: np.ndarray, dtype: str, op: str) -> int:
    """Elements of ``out`` that differ from ``exp`` (bitwise; AVG floats: > 2 ULP)."""
    out = np.ascontiguousarray(out).reshape(-1)
    exp = np.ascontiguousarray(exp).reshape(-1)
    if out.size != exp.size:
        return max(out.size, exp.size)
    if not out.size:
        return 0
    view = np.dtype(DTYPES[dtype].view)
    ou, eu = out.view(view), exp.view(view)
    if op == "avg" and DTYPES[dtype].kind == "float":
        from ncclpy.semantics import numerics
        dist = numerics.ulp_distance(ou, eu, dtype)
        return int(np.count_nonzero(np.asarray(dist) > AVG_ULP))
    return int(np.count_nonzero(ou != eu))


def corrupt(out: np.ndarray, n: int) -> np.ndarray:
    """Test-only: a copy of ``out`` with the low bit of its first ``n`` elements flipped."""
    out = np.array(out, copy=True).reshape(-1)
    if out.size:
        u = out.view(np.dtype(f"u{out.dtype.itemsize}"))
        u[:n] ^= 1
    return out
