"""Byte-for-byte and ULP comparison of collective outputs (numpy, no torch).

Outputs are compared as their wire bits (:func:`ncclpy.numerics.as_bits`): equal means the bytes
are identical; where they differ, the largest ULP distance says by how much (integers: the
largest absolute difference).  ``None`` on either side means "nothing to compare" (the reference
leaves that rank's output undefined, or that side produced no output there).

:func:`merge` turns every rank's verdicts on one case into its table record.  Status rules:
``error`` (a side raised where it should not: counted as a failure), ``unsupported`` (torch or
ncclpy refused the combination, e.g. a dtype its NCCL lacks: not counted), ``torch divergence``
(a documented divergence of :data:`ncclpy.check.cases.DIVERGENCES` applies: not counted, as long
as ncclpy matches the reference), ``pass`` (torch == reference, ncclpy == reference, ncclpy ==
torch byte for byte, wherever defined; "==" with the reference is bitwise where the inputs make
the result exact, else within the ULP tolerance), otherwise ``fail``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from .. import numerics as nm
from ..dtypes import dtype_name
from . import cases as C

__all__ = ["Comparison", "compare", "flip_one_bit", "judge", "merge", "INJECT_ENV"]

#: the test-only corruption hook, honoured by :mod:`ncclpy.check.runner` (never the library)
INJECT_ENV = "NCCLPY_CHECK_INJECT"


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing two outputs of one rank."""

    equal: Optional[bool]        #: bytes identical (None: nothing to compare)
    max_ulp: float = 0.0         #: largest ULP distance (inf: NaN vs number, shape mismatch)
    ndiff: int = 0               #: elements whose bytes differ
    first_diff: int = -1         #: index of the first differing element (-1: none)
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _bits(arr: Any, dtype: str) -> np.ndarray:
    return nm.as_bits(np.asarray(arr), dtype).reshape(-1)


def compare(a: Any, b: Any, dtype: Any) -> Comparison:
    """Compare two logical arrays of ``dtype`` (either may be None)."""
    if a is None or b is None:
        return Comparison(None)
    name = dtype_name(dtype)
    aa, bb = np.asarray(a), np.asarray(b)
    if aa.size != bb.size:
        return Comparison(False, float("inf"), max(aa.size, bb.size), 0,
                          f"sizes differ: {aa.size} vs {bb.size} elements")
    ab, bbits = _bits(aa, name), _bits(bb, name)
    if ab.size != bbits.size:  # pragma: no cover - same logical size, same wire size
        return Comparison(False, float("inf"), ab.size, 0, "wire sizes differ")
    diff = ab != bbits
    nd = int(diff.sum())
    if nd == 0:
        return Comparison(True)
    first = int(np.argmax(diff))
    ulp = nm.max_ulp(ab[diff], bbits[diff], name)
    return Comparison(False, ulp, nd, first)


def judge(cmp: Comparison, exact: bool, tolerance: float) -> Optional[bool]:
    """Pass/fail of a comparison against the reference: bitwise when ``exact``, else within
    ``tolerance`` ULPs.  None when there was nothing to compare."""
    if cmp.equal is None:
        return None
    if cmp.equal:
        return True
    return (not exact) and cmp.max_ulp <= tolerance


def flip_one_bit(arr: np.ndarray) -> np.ndarray:
    """A copy of ``arr`` with the lowest bit of its first byte flipped (the test-only corruption
    of ``NCCLPY_CHECK_INJECT``); empty arrays come back unchanged."""
    out = np.array(arr, copy=True)
    if out.size == 0:
        return out
    flat = out.reshape(-1).view(np.uint8)
    flat[0] ^= 1
    return out


# -- merging at rank 0 ----------------------------------------------------------------------
def _all(vals: List[Optional[bool]]) -> Optional[bool]:
    vals = [v for v in vals if v is not None]
    return None if not vals else all(vals)


def merge(case: C.Case, parts: List[Dict[str, Any]], ctx: Dict[str, Any]) -> Dict[str, Any]:
    """Combine every rank's verdicts into one table record."""
    n = ctx["n"]
    gpu = ctx.get("comm") is not None
    rec: Dict[str, Any] = {"case": {k: getattr(case, k) for k in
                                    ("collective", "dtype", "op", "scalar", "count", "size_label",
                                     "root", "in_place", "variant")},
                           "key": case.key, "ncclpy_ran": gpu}
    if case.collective == "barrier":
        return _merge_barrier(rec, parts, gpu)
    exact = C.exact_claim(case, n)
    tol = 0.0 if exact else C.ulp_tolerance(case, n)
    rec.update(exact=exact, tolerance=tol)
    cmp = lambda k: [Comparison(**p[k]) if k in p else Comparison(None) for p in parts]  # noqa
    t_ref = cmp("t_ref")
    rec["torch_ref"] = _all([judge(x, exact, tol) for x in t_ref])
    ulps = [x.max_ulp for x in t_ref if x.equal is False]
    if gpu:
        n_ref, n_t = cmp("n_ref"), cmp("n_t")
        rec["ncclpy_ref"] = _all([judge(x, exact, tol) for x in n_ref])
        rec["ncclpy_torch"] = _all([x.equal for x in n_t])
        ulps += [x.max_ulp for x in n_ref if x.equal is False]
    rec["max_ulp"] = max(ulps) if ulps else 0.0
    rec["ranks"] = parts
    errs = [(p["rank"], k, p[k]) for p in parts for k in
            ("torch_error", "ncclpy_error", "torch_unsupported", "ncclpy_unsupported") if k in p]
    hard = [e for e in errs if e[1].endswith("_error")]
    soft = [e for e in errs if e[1].endswith("_unsupported")]
    if any(p.get("injected") for p in parts):
        rec["injected"] = True
    div = C.divergence(ctx["backend"], case, n)
    if hard:
        r, k, msg = hard[0]
        rec.update(status="error", reason=f"{k.split('_')[0]} rank {r}: {msg}")
        return rec
    if soft:
        r, k, msg = soft[0]
        rec.update(status="unsupported", reason=f"{k.split('_')[0]} rank {r}: {msg}")
        if gpu and k.startswith("torch") and rec.get("ncclpy_ref") is False:
            rec.update(status="fail")
        return rec
    ncclpy_ok = (not gpu) or rec.get("ncclpy_ref") is not False
    if div is not None and (div.when == "always" or rec["torch_ref"] is False):
        rec.update(status="torch divergence" if ncclpy_ok else "fail", reason=div.reason)
        return rec
    ok = rec["torch_ref"] is not False and ncclpy_ok and rec.get("ncclpy_torch") is not False
    rec["status"] = "pass" if ok else "fail"
    if not ok:
        bad = [p["rank"] for p, x in zip(parts, t_ref) if judge(x, exact, tol) is False]
        if bad:
            rec["reason"] = f"torch != reference on rank(s) {bad}"
            if rec.get("injected"):
                rec["reason"] += f" (corrupted on purpose by {INJECT_ENV})"
    return rec


def _merge_barrier(rec: Dict[str, Any], parts: List[Dict[str, Any]], gpu: bool) -> Dict[str, Any]:
    from .. import reference
    for side in ("torch", "ncclpy"):
        if side == "ncclpy" and not gpu:
            continue
        times = [p["barrier"].get(side) for p in parts]
        if any(t is None for t in times):
            ok = False
        else:
            earliest = reference.barrier(arrivals=[t[0] for t in times])
            ok = all(t[1] >= e - 1e-4 for t, e in zip(times, earliest))
        rec["torch_ref" if side == "torch" else "ncclpy_ref"] = ok
    errs = [f"{k} rank {p['rank']}: {p[k]}" for p in parts for k in ("torch_error", "ncclpy_error")
            if k in p]
    rec["max_ulp"] = None
    ok = rec.get("torch_ref") and (not gpu or rec.get("ncclpy_ref"))
    rec["status"] = "error" if errs else ("pass" if ok else "fail")
    if errs:
        rec["reason"] = errs[0]
    elif not ok:
        rec["reason"] = "a rank left the barrier before the last one arrived"
    return rec
