"""Rank 0's choice of the reference each side of a case is judged against (the ranks'
comparisons with both are :mod:`ncclpy.check.exact`'s).

* NCCL's order (``nccl-order``): every rank had the model's prediction, and on a GPU rank 0's
  log shows the call the model predicted (algorithm, protocol, channel range); ncclpy's side,
  and torch's on a GPU, are then compared with the prediction bit for bit.
* rank order (``rank-order``): today's :mod:`ncclpy.reference`, exact where the inputs
  make every order give the same bits, else within ULP or the order-free bound; with the reason
  (the first rank's).  torch's gloo is always judged against it ("gloo: not NCCL").

:func:`choose` returns the parts with ``n_ref`` / ``t_ref`` holding the comparison with the
chosen reference (the rank-order one kept as ``n_rank_order`` / ``t_rank_order``), so that
:func:`ncclpy.check.compare.merge` judges them as before; :func:`record_fields` says in the
case's record which reference judged which side.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import cases as C
from .nccl_log import call_problem

__all__ = ["RefChoice", "choose", "record_fields", "side_name", "NCCL_ORDER", "RANK_ORDER",
           "GLOO_REASON", "TORCH_GLOO_REASON"]

#: the two references: the model's prediction of NCCL's fold, and
#: ncclpy.reference's rank order
NCCL_ORDER, RANK_ORDER = "nccl-order", "rank-order"
#: why a ``--backend gloo`` run has no exact reference
GLOO_REASON = "gloo: not NCCL (ncclpy does not run)"
#: why torch's side of a ``--backend cpu`` run is judged against rank order
TORCH_GLOO_REASON = "gloo: not NCCL"


@dataclass
class RefChoice:
    """Which reference judged ncclpy's side and torch's, and why not NCCL's order."""

    ncclpy: str
    torch: str
    reason: str = ""
    torch_reason: str = ""
    config: str = ""
    version: Optional[int] = None
    parts: List[Dict[str, Any]] = field(default_factory=list)


def choose(case: C.Case, parts: List[Dict[str, Any]], ctx: Dict[str, Any]
           ) -> Optional[RefChoice]:
    """The references of ``case`` from every rank's parts (None: the barrier, no reference)."""
    if case.collective == "barrier" or not all("ref_kind" in p for p in parts):
        return None
    backend = ctx["backend"]
    reason = next((p.get("ref_reason", "") for p in parts if p["ref_kind"] == RANK_ORDER), "")
    kind = RANK_ORDER if any(p["ref_kind"] == RANK_ORDER for p in parts) else NCCL_ORDER
    if kind == NCCL_ORDER and backend == "nccl":
        p0 = next(p for p in parts if p["rank"] == 0)
        why = call_problem(p0.get("nccl_calls") or [], p0.get("nccl_expect") or [""] * 6)
        if why:
            kind, reason = RANK_ORDER, f"order-free bound: {why}"
    if kind == RANK_ORDER:
        tkind, treason = kind, reason
    elif backend == "nccl":
        # torch's communicator is not the one whose log the model read: its own call lines
        # must show the predicted call (its rings are taken to be ncclpy's: the same
        # process, libnccl, environment and GPUs; not read from its log)
        p0 = next(p for p in parts if p["rank"] == 0)
        why = call_problem(p0.get("torch_nccl_calls") or [],
                           p0.get("nccl_expect") or [""] * 6)
        tkind, treason = ((RANK_ORDER, f"order-free bound: torch's call: {why}") if why
                          else (NCCL_ORDER, ""))
    else:                                   # ncclpy's side has NCCL's order, gloo has not
        tkind, treason = RANK_ORDER, TORCH_GLOO_REASON
    out = RefChoice(kind, tkind, reason, treason)
    if kind == NCCL_ORDER:
        out.config = parts[0].get("ref_config", "")
        out.version = parts[0].get("ref_version")
    for p in parts:
        q = dict(p)
        if kind == NCCL_ORDER and "n_nccl" in q:
            q["n_rank_order"] = q.pop("n_ref", None)
            q["n_ref"] = q.pop("n_nccl")
        if tkind == NCCL_ORDER and "t_nccl" in q:
            q["t_rank_order"] = q.pop("t_ref", None)
            q["t_ref"] = q.pop("t_nccl")
        out.parts.append(q)
    return out


def side_name(side: str, kind: str) -> str:
    """``ncclpy != NCCL's order`` / ``torch != reference``: how a failure names the side and
    its reference."""
    return f"{side} != {'NCCL' + chr(39) + 's order' if kind == NCCL_ORDER else 'reference'}"


def record_fields(ch: RefChoice) -> Dict[str, Any]:
    """What a case's record says about its references (see ``schema.json``): ``reference``
    (ncclpy's side, or torch's where ncclpy does not run) with ``reference_config`` and
    ``basis``, or ``reference_reason``; ``torch_reference`` where torch's differs."""
    from ..order.cli import basis
    from ..order.config import DEFAULT_VERSION
    rec: Dict[str, Any] = {"reference": ch.ncclpy}
    if ch.ncclpy == NCCL_ORDER:
        rec["reference_config"] = ch.config
        rec["basis"] = basis(ch.version or DEFAULT_VERSION)
    else:
        rec["reference_reason"] = ch.reason
    rec["torch_reference"] = ch.torch
    if ch.torch == RANK_ORDER:
        rec["torch_reference_reason"] = ch.torch_reason
    return rec
