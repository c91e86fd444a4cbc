"""Helpers the check's merge tests share (tests/test_check_harness.py, test_check_cpu_backend.py):
per-rank result parts and comparisons as the ranks report them."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ncclpy.check import compare as K

__all__ = ["parts", "cmp"]


def parts(n: int, **per_rank: Any) -> List[Dict[str, Any]]:
    """``n`` ranks' parts: a list value is per rank, anything else the same on every rank."""
    return [{"rank": r, **{k: (v[r] if isinstance(v, list) else v) for k, v in per_rank.items()}}
            for r in range(n)]


def cmp(equal: Optional[bool], ulp: float = 0.0) -> Dict[str, Any]:
    """A comparison's dict: equal, or off by ``ulp`` (None: not compared)."""
    return K.Comparison(equal, ulp if not equal else 0.0, 0 if equal else 1,
                        -1 if equal else 0).as_dict()
