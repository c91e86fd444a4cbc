"""Byte-for-byte and ULP comparison of collective outputs (numpy, no torch).

Outputs are compared as their wire bits (:func:`ncclpy.semantics.numerics.as_bits`): equal means the
bytes are identical; where they differ, the largest ULP distance says by how much (integers: the
largest absolute difference).  ``None`` on either side means "nothing to compare" (the reference
leaves that rank's output undefined, or that side produced no output there).

:func:`merge` turns every rank's verdicts on one case into its table record.  The "==" fields
(``torch_ref``, ``ncclpy_ref``, ``ncclpy_torch``) are True only when the bytes are identical on
every rank where both sides are defined; ``max_ulp`` says by how much they differ otherwise.
Status rules, in order:

* ``error`` (counted as a failure): a side raised an exception that is not a known refusal
  (:data:`ncclpy.check.divergences.KNOWN_REFUSALS` for torch; ncclpy's typed
  UnsupportedError/VersionError for ncclpy);
* ``unsupported`` (not counted): a known refusal; on a GPU ncclpy must still match the
  reference, else ``fail``;
* ``reference only`` (``--backend cpu``; counted apart, never as passed): gloo cannot run the
  case, so torch was not called, and ncclpy's CPU backend matched the reference bit for bit on
  every rank (else ``fail``);
* ``torch divergence`` (not counted): torch differs from the reference *and* equals, on every
  rank, the output the documented divergence predicts, and that prediction itself differs from
  the reference wherever torch does; ncclpy must match the reference;
* ``pass``: every comparison is bitwise equal;
* ``within ULP`` (not counted as a failure, reported apart): the case is not claimed exact
  (:func:`ncclpy.check.cases.exact_claim`) and every difference is within the ULP tolerance
  (normal and revealing inputs against rank order: within the order-free bound);
* otherwise ``fail``.

Each side is judged against its own reference (:mod:`ncclpy.check.refs`): NCCL's order, the
model's prediction, is always claimed bit for bit; where ncclpy's side and torch's have
different references and the inputs are not exact in any order, they are not compared with
each other (``ncclpy_torch`` None).  ``ncclpy_ref`` / ``torch_ref`` are each side against its
reference; a failure names it ("ncclpy != NCCL's order on rank(s) [1]: <element, bits, fold>").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from ..semantics import numerics as nm
from ..semantics.dtypes import dtype_name
from . import cases as C
from .refs import NCCL_ORDER, RANK_ORDER, choose, record_fields, side_name

__all__ = ["Comparison", "compare", "flip_one_bit", "corrupt", "judge", "merge", "INJECT_ENV",
           "INJECT_SIDES", "INJECT_KINDS", "with_side", "backend_parts"]

#: the test-only corruption hook, honoured by :mod:`ncclpy.check.runner` (never the library)
INJECT_ENV = "NCCLPY_CHECK_INJECT"
#: what the hook can corrupt: torch's output, ncclpy's output, or the reference the harness
#: compares both with
INJECT_SIDES = ("torch", "ncclpy", "reference")
#: how: one low bit of the first byte, every bit of every byte, or the top bit of the last byte
INJECT_KINDS = ("bit", "invert", "sign")


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing two outputs of one rank."""

    equal: Optional[bool]        #: bytes identical (None: nothing to compare)
    max_ulp: float = 0.0         #: largest ULP distance (inf: NaN vs number, shape mismatch)
    ndiff: int = 0               #: elements whose bytes differ
    first_diff: int = -1         #: index of the first differing element (-1: none)
    note: str = ""
    #: normal and revealing inputs against the rank-order reference: whether the order-free
    #: bound of a sum holds (:func:`ncclpy.check.exact.bound_holds`; None: not checked)
    bound_ok: Optional[bool] = None

    def as_dict(self) -> dict:
        """The fields as a dict (``bound_ok`` only where it was checked)."""
        d = asdict(self)
        if d["bound_ok"] is None:
            del d["bound_ok"]
        return d


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
    if ab.size != bbits.size:  # e.g. complex values against as many floats (half of each)
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
    ``tolerance`` ULPs (or, where the rank checked it, within the order-free bound).  None when
    there was nothing to compare."""
    if cmp.equal is None:
        return None
    if cmp.equal:
        return True
    if cmp.bound_ok is not None:        # normal / revealing inputs: the order-free bound
        return (not exact) and cmp.bound_ok
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


def corrupt(arr: np.ndarray, how: str = "bit") -> np.ndarray:
    """A corrupted copy of ``arr`` (``how`` in :data:`INJECT_KINDS`; empty arrays unchanged)."""
    if how == "bit":
        return flip_one_bit(arr)
    out = np.array(arr, copy=True)
    if out.size == 0:
        return out
    flat = out.reshape(-1).view(np.uint8)
    if how == "invert":
        flat ^= 0xFF
        if out.dtype == np.bool_:        # keep bool bytes 0/1
            flat &= 1
    elif how == "sign":
        flat[-1] ^= 0x01 if out.dtype == np.bool_ else 0x80
    else:
        raise ValueError(f"{INJECT_ENV}: unknown corruption {how!r}; expected one of "
                         f"{', '.join(INJECT_KINDS)}")
    return out


# -- merging at rank 0 ----------------------------------------------------------------------
def _eq(cmps: List[Comparison]) -> Optional[bool]:
    """True: bytes equal on every rank compared; False: some differ; None: nothing compared."""
    vals = [c.equal for c in cmps if c.equal is not None]
    return None if not vals else all(vals)


def _ranks(parts: List[Dict[str, Any]], cmps: List[Comparison]) -> List[int]:
    return [p["rank"] for p, c in zip(parts, cmps) if c.equal is False]


def _far(cmps: List[Comparison]) -> float:
    """The largest ULP distance among the ranks that differ (0.0: none differs)."""
    return max([c.max_ulp for c in cmps if c.equal is False], default=0.0)


def _close(cmps: List[Comparison], exact: bool, tol: float) -> bool:
    """Every compared rank equal, or (not ``exact``) within ``tol`` ULPs."""
    return all(judge(c, exact, tol) is not False for c in cmps)


def with_side(p: Dict[str, Any], side: Dict[str, Any]) -> Dict[str, Any]:
    """A rank's verdicts ``p`` with one torch backend's verdicts ``side`` put in (their
    ``barrier`` times joined with ncclpy's); ``p`` itself is not changed."""
    q = {k: v for k, v in p.items() if k != "by_torch_backend"}
    for k, v in side.items():
        q[k] = {**q.get(k, {}), **v} if k == "barrier" else v
    return q


def backend_parts(parts: List[Dict[str, Any]], name: str) -> List[Dict[str, Any]]:
    """Every rank's verdicts as seen through torch backend ``name`` (a run with
    ``--torch-backend a,b`` keeps each backend's under ``by_torch_backend``; a run with one
    torch side has them in place and comes back unchanged)."""
    return [with_side(p, p["by_torch_backend"][name]) if "by_torch_backend" in p else p
            for p in parts]


def merge(case: C.Case, parts: List[Dict[str, Any]], ctx: Dict[str, Any]) -> Dict[str, Any]:
    """Combine every rank's verdicts into one table record (see the module docstring)."""
    from .divergences import divergence, known_refusal
    n, backend = ctx["n"], ctx["backend"]
    gpu = ctx.get("comm") is not None          # ncclpy ran (on a GPU, or its CPU backend)
    rec: Dict[str, Any] = {"case": {k: getattr(case, k) for k in
                                    ("collective", "dtype", "op", "scalar", "count", "size_label",
                                     "root", "in_place", "variant", "inputs")},
                           "key": case.key, "ncclpy_ran": gpu}
    if case.collective == "barrier":
        return _merge_barrier(rec, parts, gpu)
    exact = C.exact_claim(case, n)
    tol = 0.0 if exact else C.ulp_tolerance(case, n)
    ch = choose(case, parts, ctx)
    if ch is not None:
        parts = ch.parts
        rec.update(record_fields(ch))
    n_kind = ch.ncclpy if ch is not None else RANK_ORDER
    t_kind = ch.torch if ch is not None else RANK_ORDER
    ex_n, ex_t = exact or n_kind == NCCL_ORDER, exact or t_kind == NCCL_ORDER
    rec.update(exact=ex_n and (ex_t or not _called(parts)), tolerance=tol)
    cmp = lambda k: [Comparison(**p[k]) if k in p else Comparison(None) for p in parts]  # noqa
    t_ref, n_ref, n_t, t_pred = cmp("t_ref"), cmp("n_ref"), cmp("n_t"), cmp("t_pred")
    p_ref = cmp("p_ref")
    if not exact and n_kind != t_kind:  # each side against its own reference: not each other
        n_t = [Comparison(None)] * len(parts)
    rec["torch_ref"] = _eq(t_ref)
    if gpu:
        rec["ncclpy_ref"], rec["ncclpy_torch"] = _eq(n_ref), _eq(n_t)
    rec["max_ulp"] = _far(t_ref + (n_ref + n_t if gpu else []))
    rec["ranks"] = parts
    judged = ([n_ref] if gpu and n_kind == NCCL_ORDER else []) + \
        ([t_ref] if t_kind == NCCL_ORDER else [])
    if any(_eq(c) is not None for c in judged):
        rec["exact_nccl_order"] = all(_eq(c) is not False for c in judged)
    diffs = [p[k] for k in ("n_nccl_diff", "t_nccl_diff") for p in parts if p.get(k)]
    if diffs:
        rec["nccl_order_diff"] = diffs[0]
    injected = sorted({p["injected"] for p in parts if p.get("injected")})
    if injected:
        rec["injected"] = ", ".join(injected)
    note = f" (corrupted on purpose by {INJECT_ENV}: {rec['injected']})" if injected else ""
    ncclpy_ok = (not gpu) or _close(n_ref, ex_n, tol)
    n_bad, t_bad = side_name("ncclpy", n_kind), side_name("torch", t_kind)

    # exceptions: known refusals are "unsupported", anything else is an error
    unsupported: List[str] = []
    for p in parts:
        r = p["rank"]
        if "torch_not_called" in p:
            unsupported.append(f"torch rank {r}: {p['torch_not_called']}")
        if "torch_exc" in p:
            why = known_refusal(backend, case, p["torch_exc"]) if backend == "nccl" else None
            if why is None:
                rec.update(status="error", reason=f"torch rank {r}: {p['torch_exc']}{note}")
                return rec
            unsupported.append(f"torch rank {r}: {why} ({p['torch_exc']})")
        if "ncclpy_exc" in p:
            if not p.get("ncclpy_typed"):
                rec.update(status="error", reason=f"ncclpy rank {r}: {p['ncclpy_exc']}{note}")
                return rec
            unsupported.append(f"ncclpy rank {r}: {p['ncclpy_exc']}")
    if unsupported:
        if gpu and not ncclpy_ok:
            rec.update(status="fail", reason=f"{n_bad} on rank(s) {_ranks(parts, n_ref)}"
                                             f"{_diff(rec)}; " + unsupported[0] + note)
        elif _reference_only(backend, parts) and rec.get("ncclpy_ref") is True:
            why = parts[0]["torch_not_called"]
            rec.update(status="reference only", reason=f"ncclpy == "
                       f"{n_bad.split(' != ')[1]}; torch not compared: {why}")
        else:
            rec.update(status="unsupported", reason=unsupported[0])
        return rec

    div = divergence(C.torch_family(backend), case, n)
    # a divergence explains torch's output only where torch equals its prediction and the
    # prediction really differs from NCCL's semantics (never a difference of the harness)
    explained = _eq(t_pred) is True and all(
        pr.equal is False for tr, pr in zip(t_ref, p_ref) if tr.equal is False)
    if rec["torch_ref"] is False and div is not None and explained:
        if ncclpy_ok:
            rec.update(status="torch divergence", reason=div.reason)
        else:
            rec.update(status="fail", reason=f"{n_bad} on rank(s) {_ranks(parts, n_ref)}"
                                             f"{_diff(rec)} (torch: {div.reason}){note}")
        return rec
    bitwise = all(v is not False for v in (rec["torch_ref"], rec.get("ncclpy_ref"),
                                           rec.get("ncclpy_torch")))
    if bitwise:
        rec["status"] = "pass"
        return rec
    torch_ok = _close(t_ref, ex_t, tol)
    both_close = not gpu or _close(n_t, exact, 2 * tol)
    if torch_ok and ncclpy_ok and both_close and not (ex_n and ex_t):
        rec.update(status="within ULP", reason=_within(rec, t_ref, n_ref, n_t, tol, gpu))
        return rec
    bad = []
    for what, cmps in ((t_bad, t_ref), (n_bad, n_ref), ("ncclpy != torch", n_t)):
        rk = _ranks(parts, cmps)
        if rk and (what != t_bad or not torch_ok or ex_t):
            diff = _diff(rec) if " order" in what and rec.get("nccl_order_diff") else ""
            bad.append(f"{what} on rank(s) {rk}{diff}")
    if div is not None and rec["torch_ref"] is False:
        bad.append(f"torch also differs from the documented divergence's prediction "
                   f"({div.model})")
    rec.update(status="fail", reason="; ".join(bad or ["mismatch"]) + note)
    return rec


def _called(parts: List[Dict[str, Any]]) -> bool:
    """Whether torch was called for the case (on some rank)."""
    return not all("torch_not_called" in p for p in parts)


def _diff(rec: Dict[str, Any]) -> str:
    """': <the first element off NCCL's order, its predicted fold, ...>' ('' when none)."""
    d = rec.get("nccl_order_diff")
    return f": {d}" if d else ""


def _within(rec: Dict[str, Any], t_ref: List[Comparison], n_ref: List[Comparison],
            n_t: List[Comparison], tol: float, gpu: bool) -> str:
    """Why a case is ``within ULP``: each side's distance against its own bound (ncclpy vs
    torch may be off by both sides' ULPs); normal and revealing inputs: the order-free bound."""
    bound = any(c.bound_ok is not None for c in t_ref + n_ref)
    if not bound and rec.get("reference", RANK_ORDER) == rec.get("torch_reference", RANK_ORDER):
        why = f"not bitwise: max {_far(t_ref + n_ref):g} ULP from the reference <= {tol:g}"
        if gpu:
            why += f", ncclpy vs torch max {_far(n_t):g} ULP <= {2 * tol:g}"
        return why + " (this case is not claimed exact)"
    out = []
    for side, cmps, kind in (("ncclpy", n_ref, rec.get("reference")),
                             ("torch", t_ref, rec.get("torch_reference"))):
        if _eq(cmps) is None or (side == "ncclpy" and not gpu):
            continue
        if kind == NCCL_ORDER:
            out.append(f"{side} == NCCL's order bit for bit")
        elif _eq(cmps):
            out.append(f"{side} == the rank-order reference bit for bit")
        elif any(c.bound_ok is not None for c in cmps):
            out.append(f"{side} within the order-free bound of the rank-order reference")
        else:
            out.append(f"{side} max {_far(cmps):g} ULP from the rank-order reference <= "
                       f"{tol:g}")
    why = rec.get("torch_reference_reason") or rec.get("reference_reason") or ""
    return "; ".join(out) + f" (not claimed exact: {rec['case'].get('inputs')} inputs" + \
        (f", {why})" if why else ")")


def _reference_only(backend: str, parts: List[Dict[str, Any]]) -> bool:
    """Whether the only thing missing is torch, not called on purpose on every rank (on the
    CPU backend: gloo cannot run the case), and ncclpy ran without an exception."""
    return backend == "cpu" and all("torch_not_called" in p and "torch_exc" not in p and
                                    "ncclpy_exc" not in p for p in parts)


def _merge_barrier(rec: Dict[str, Any], parts: List[Dict[str, Any]], gpu: bool) -> Dict[str, Any]:
    from ..semantics import reference
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
