"""The order of a run's stages: most GPU debt first (what is unproven goes first when the
budget is short), then the longest expected first (so that the side-by-side stages end
together), ``info`` always first.  With ``--stage`` the fixed order is kept."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import debt as D
from . import ledger as L
from .stages import Stage

__all__ = ["order_stages", "expected_seconds"]


def expected_seconds(doc: Mapping[str, Any], stage: Stage) -> float:
    """What ``stage`` took on its last GPU runs (its items' seconds, over its shards), or half
    its bound when the ledger does not tell."""
    total = sum(float(e.get("last", {}).get("seconds") or 0.0)
                for e in doc.get("items", {}).values() if e.get("stage") == stage.name)
    return total / max(1, stage.shards) if total > 0 else stage.timeout_s / 2


def order_stages(stages: Sequence[Stage], root: str, ledger_path: str, by_debt: bool = True
                 ) -> Tuple[List[Stage], Optional[List[Dict[str, Any]]], str]:
    """(the stages in run order, the GPU tests of the tree or None, a line saying why)."""
    try:
        doc = L.load(ledger_path)
    except ValueError as e:
        return list(stages), None, f"stages in the fixed order: {e}"
    try:
        tests = D.collect_tests(root)
    except D.CollectError as e:
        return list(stages), None, f"stages in the fixed order: {e}"
    d = D.compute(doc, root, tests)
    counts = D.stage_counts(d)
    head = f"GPU debt before the run: {len(d.debt)} of {len(d.items)} items"
    if counts:
        head += " (" + ", ".join(f"{k or 'no stage'} {v}" for k, v in counts.items()) + ")"
    if not by_debt:
        return list(stages), tests, head + "; stages in the fixed order (--stage)"
    index = {s.name: i for i, s in enumerate(stages)}
    ordered = sorted(stages, key=lambda s: (s.kind != "info", -counts.get(s.name, 0),
                                            -expected_seconds(doc, s), index[s.name]))
    return ordered, tests, head + "; stages by debt: " + ", ".join(s.name for s in ordered)
