"""Verdicts: does what NCCL gave equal what the model predicts, bit for bit?

``PREDICTED``: every rank's output has the predicted bits (NaNs compared as a class: which NaN
payload an add returns is not claimed; for min and max, nor is the sign of a zero result where
+0 and -0 meet).  ``MISMATCH``: the first differing elements, with the
predicted fold and, for revealing inputs, the folds the observed bits are consistent with.
``CANNOT_PREDICT``: the model does not cover the configuration (the reason); the observation
is then checked only against the order-free error bound of a sum, |s' - s| <= (n-1) u sum|x|,
labelled as such.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..semantics import numerics as nm
from ..semantics.dtypes import DTYPES
from .model import Prediction
from .reveal import RevealPlan, consistent_left_folds, observed_masks, signature
from .topology import Expr, expr_to_json, format_expr

__all__ = ["PREDICTED", "MISMATCH", "CANNOT_PREDICT", "Verdict", "Difference", "judge",
           "cannot_predict", "order_free_bound"]

PREDICTED, MISMATCH, CANNOT_PREDICT = "PREDICTED", "MISMATCH", "CANNOT_PREDICT"
#: differing elements a MISMATCH lists
SHOWN = 8


@dataclass(frozen=True)
class Difference:
    """One differing element: where, the bits both ways, the predicted fold, and (revealing
    inputs) every candidate fold the observed bits are consistent with."""

    rank: int
    element: int
    predicted: int
    observed: int
    predicted_fold: Expr
    observed_folds: Tuple[str, ...] = ()

    def text(self, dtype: str) -> str:
        w = DTYPES[dtype].itemsize * 2
        seen = (f"; observed bits fit {', '.join(self.observed_folds)}"
                if self.observed_folds else "")
        return (f"rank {self.rank} element {self.element}: predicted 0x{self.predicted:0{w}x} "
                f"from {format_expr(self.predicted_fold)}, NCCL gave 0x{self.observed:0{w}x}"
                f"{seen}")


@dataclass(frozen=True)
class Verdict:
    """The verdict on one call: ``kind`` is PREDICTED, MISMATCH or CANNOT_PREDICT."""

    kind: str
    config: str
    reason: str = ""
    differing: int = 0
    compared: int = 0
    first: Tuple[Difference, ...] = ()
    bound: str = ""

    def line(self) -> str:
        """One line: ``PREDICTED  all_reduce ring/ll, ... (4096 elements x 4 ranks)``."""
        if self.kind == PREDICTED:
            return f"{PREDICTED}  {self.config} ({self.compared} elements equal)"
        if self.kind == MISMATCH:
            return (f"{MISMATCH}  {self.config}: {self.differing} of {self.compared} elements "
                    f"differ")
        tail = f"; {self.bound}" if self.bound else ""
        return f"{CANNOT_PREDICT}  {self.config}: {self.reason}{tail}"

    def to_json(self, dtype: str) -> Dict[str, Any]:
        d: Dict[str, Any] = {"verdict": self.kind, "config": self.config}
        if self.reason:
            d["reason"] = self.reason
        if self.bound:
            d["bound"] = self.bound
        d["compared"] = self.compared
        if self.kind == MISMATCH:
            d["differing"] = self.differing
            d["first"] = [{"rank": x.rank, "element": x.element,
                           "predicted_bits": x.predicted, "observed_bits": x.observed,
                           "predicted_order": expr_to_json(x.predicted_fold),
                           "observed_orders": list(x.observed_folds)} for x in self.first]
        return d


def _bits(a: Any, dtype: str) -> np.ndarray:
    return nm.as_bits(np.asarray(a).reshape(-1), dtype).astype(np.uint64)


def judge(pred: Prediction, inputs: Sequence[np.ndarray],
          observed: Sequence[Optional[np.ndarray]], *, reveal: Optional[RevealPlan] = None,
          candidates: Sequence[Tuple[str, Expr]] = ()) -> Verdict:
    """Compare ``observed`` (each rank's output; None where not observed) with the prediction
    for ``inputs``.  ``reveal``: the inputs are :func:`ncclpy.order.reveal.revealing_inputs`,
    so a MISMATCH also says which folds the observed bits fit: every left fold (up to 8 ranks)
    and the named ``candidates``."""
    cfg = pred.config
    want = pred.outputs(inputs, ranks=[r for r, o in enumerate(observed) if o is not None])
    diffs: List[Difference] = []
    total = compared = 0
    is_float = DTYPES[cfg.dtype].kind == "float"
    for r, (p, o) in enumerate(zip(want, observed)):
        if p is None or o is None:
            continue
        pb, ob = _bits(p, cfg.dtype), _bits(o, cfg.dtype)
        if pb.size != ob.size:
            raise ValueError(f"observed[{r}]: expected {pb.size} elements, got {ob.size}")
        diff = pb != ob
        if is_float:
            both_nan = nm.is_nan_bits(pb, cfg.dtype) & nm.is_nan_bits(ob, cfg.dtype)
            diff &= ~both_nan
            if cfg.op in ("min", "max"):
                # the sign of a zero where +0 and -0 meet is not claimed: __hmin/__hmax order
                # -0 below +0, fminf/fmaxf need not (reduce_kernel.h:385-416)
                pv, ov = nm.decode(pb, cfg.dtype), nm.decode(ob, cfg.dtype)
                diff &= ~((pv == 0) & (ov == 0))
        compared += pb.size
        bad = np.flatnonzero(diff)
        total += bad.size
        m = pred.order_map(r)
        masks = observed_masks(reveal, o) if (reveal is not None and bad.size) else None
        for e in bad[:max(0, SHOWN - len(diffs))]:
            seen: Tuple[str, ...] = ()
            if masks is not None:
                seen = _fits(reveal, m, int(e), masks, candidates)
            diffs.append(Difference(r, int(e), int(pb[e]), int(ob[e]), m.expr(int(e)), seen))
    if not total:
        return Verdict(PREDICTED, cfg.describe(), compared=compared)
    return Verdict(MISMATCH, cfg.describe(), differing=total, compared=compared,
                   first=tuple(diffs))


def _fits(plan: RevealPlan, m: Any, e: int, masks: np.ndarray,
          candidates: Sequence[Tuple[str, Expr]]) -> Tuple[str, ...]:
    """The folds the observed masks of ``e``'s run (the elements predicted to share its fold)
    are consistent with."""
    first, last = e, e
    g = m.group
    while first > 0 and g[first - 1] == g[e]:
        first -= 1
    while last + 1 < g.size and g[last + 1] == g[e]:
        last += 1
    els = list(range(first, last + 1))
    obs = [int(masks[i]) for i in els]
    names = []
    for name, expr in candidates:
        if all(signature(expr, *plan.layout(i)) == ob for i, ob in zip(els, obs)):
            names.append(name)
    folds = consistent_left_folds(plan, els, obs)
    if folds is not None:
        if len(folds) <= 4:
            names += [f"left fold {format_expr(f)}" for f in folds]
        else:
            names.append(f"{len(folds)} left folds")
    return tuple(names) if names else ("no candidate fold",)


def order_free_bound(inputs: Sequence[np.ndarray], observed: np.ndarray, dtype: str) -> str:
    """Check a sum against the bound every order obeys: |s' - s| <= (n-1) u sum|x_i| (u: the
    unit roundoff); one line saying whether it holds, labelled as the order-free bound."""
    if DTYPES[dtype].kind != "float":
        return "integer sums do not depend on the order"
    n = len(inputs)
    xs = np.stack([nm.decode(_bits(x, dtype), dtype) for x in inputs]).astype(np.longdouble)
    exact = xs.sum(axis=0)
    mag = np.abs(xs).sum(axis=0)
    got = nm.decode(_bits(observed, dtype), dtype).astype(np.longdouble)
    u = np.longdouble(2.0) ** -nm.mantissa_bits(dtype)
    fin = np.isfinite(got) & np.isfinite(exact)
    gamma = (n - 1) * u / (1 - (n - 1) * u)       # gamma_{n-1}: the first-order (n-1)u, exactly
    ok = np.abs(got - exact)[fin] <= gamma * mag[fin]
    bad = int(ok.size - np.count_nonzero(ok))
    held = "holds" if bad == 0 else f"fails for {bad} elements"
    return (f"order-free bound |s'-s| <= (n-1)u*sum|x| {held} (not a prediction: any order "
            f"passes it)")


def cannot_predict(config: str, reason: str, bound: str = "") -> Verdict:
    """The CANNOT_PREDICT verdict with its reason (and the order-free bound when checked)."""
    return Verdict(CANNOT_PREDICT, config, reason=reason, bound=bound)
