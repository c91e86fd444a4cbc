"""Inputs whose sum shows the order it was computed in, and the decoder that reads the order
back from NCCL's output.

Per element, one pair of ranks gets +M and -M and up to ``cap`` other ranks each get a distinct
power of two ``2^(b+j)``; the rest get 0.  The powers add exactly among themselves (``cap`` is
at most the format's precision), and any of them meeting an uncancelled +-M is absorbed
(together they stay below ulp(M)/4, so even -M's finer spacing below |M| does not see them).
Once +M and -M have met, the sum is exactly 0 and later powers survive.  So the output is
``sum of 2^(b+j)`` over the small ranks folded *after* both big ones: the bits say which ranks
came last.  Consecutive elements cycle through the pairs (and the choice of small ranks), so a
chunk of a few dozen elements tells a left fold apart from every other left fold but the one
that swaps its first two ranks (an add cannot tell its operands apart).

:func:`signature` computes the same mask symbolically from a fold expression, with no float
arithmetic: the decoder matches observed masks against candidate folds (every left fold for up
to 8 ranks, plus any expressions given, such as every channel's ring rotations and trees).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..semantics import numerics as nm
from .topology import Expr

__all__ = ["RevealPlan", "reveal_plan", "revealing_inputs", "observed_masks", "signature",
           "consistent_left_folds", "MAX_BRUTE_RANKS"]

#: left folds are enumerated (n! of them) up to this many ranks
MAX_BRUTE_RANKS = 8

_PRECISION = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8,
              "float8_e4m3": 4, "float8_e5m2": 3}
#: exponent of the largest power of two each format holds, and of its smallest normal number
_EMAX = {"float64": 1023, "float32": 127, "float16": 15, "bfloat16": 127,
         "float8_e4m3": 8, "float8_e5m2": 15}
_EMIN = {"float64": -1022, "float32": -126, "float16": -14, "bfloat16": -126,
         "float8_e4m3": -6, "float8_e5m2": -14}


@dataclass(frozen=True)
class RevealPlan:
    """The layout of revealing inputs for ``nranks`` ranks of ``dtype``: ``pairs`` cycle over
    elements, ``cap`` small ranks per element, smalls ``2^(b+j)``, big ``M = 2^m``."""

    dtype: str
    nranks: int
    pairs: Tuple[Tuple[int, int], ...]
    cap: int
    b: int
    m: int

    def layout(self, element: int) -> Tuple[Tuple[int, int], Tuple[int, ...]]:
        """(the big pair, the small ranks in order j = 0, 1, ...) of ``element``."""
        a, c = self.pairs[element % len(self.pairs)]
        others = [r for r in range(self.nranks) if r not in (a, c)]
        if self.cap == 0:                      # two ranks: nobody else
            return (a, c), ()
        shift = (element // len(self.pairs)) % len(others)
        rot = others[shift:] + others[:shift]
        return (a, c), tuple(rot[:self.cap])


def reveal_plan(dtype: str, nranks: int) -> RevealPlan:
    """The plan for ``dtype`` (a float type) on ``nranks`` >= 2 ranks; ValueError otherwise."""
    if dtype not in _PRECISION:
        raise ValueError(f"dtype: revealing inputs need a float type "
                         f"({', '.join(_PRECISION)}), got {dtype!r} (integer sums do not "
                         f"depend on the order)")
    if nranks < 2:
        raise ValueError(f"nranks: revealing inputs need 2 or more ranks, got {nranks}")
    p = _PRECISION[dtype]
    cap = min(nranks - 2, p)
    # need 2^(b+cap) <= ulp(M)/4 = 2^(m-p+1-2): m = b + cap + p + 1; fit b, m in the format
    b = max(_EMIN[dtype], min(0, _EMAX[dtype] - (cap + p + 1) - 1))
    m = b + cap + p + 1
    if m > _EMAX[dtype]:
        raise ValueError(f"{dtype} has no room for revealing inputs with {nranks} ranks")
    pairs = tuple(itertools.combinations(range(nranks), 2))
    return RevealPlan(dtype, nranks, pairs, cap, b, m)


def revealing_inputs(plan: RevealPlan, count: int) -> List[np.ndarray]:
    """One input per rank, ``count`` elements, as the dtype's logical numpy array (bfloat16 and
    float8 as their uint bit views)."""
    per = _period(plan)
    pattern = np.zeros((plan.nranks, min(count, per)), dtype=np.float64)
    M = math.ldexp(1.0, plan.m)
    for e in range(pattern.shape[1]):
        (a, c), smalls = plan.layout(e)
        pattern[a, e], pattern[c, e] = M, -M
        for j, r in enumerate(smalls):
            pattern[r, e] = math.ldexp(1.0, plan.b + j)
    vals = pattern[:, np.arange(count) % per]        # the layout repeats every period
    out = []
    for r in range(plan.nranks):
        bits = nm.encode(vals[r], plan.dtype)        # exact: powers of two in range
        out.append(nm.from_bits(bits, plan.dtype))
    return out


def _period(plan: RevealPlan) -> int:
    return len(plan.pairs) * max(1, plan.nranks - 2)


def _small_table(plan: RevealPlan) -> np.ndarray:
    """small_table[e mod period, j]: the rank holding 2^(b+j) (-1: none)."""
    per = _period(plan)
    t = np.full((per, plan.cap), -1, dtype=np.int64)
    for e in range(per):
        _, smalls = plan.layout(e)
        t[e, :len(smalls)] = smalls
    return t


def observed_masks(plan: RevealPlan, output: np.ndarray) -> np.ndarray:
    """For each element of ``output`` (logical array), the ranks whose small value it holds as
    a bit mask over ranks (bit r = rank r); -1 where the value is not a sum of that element's
    smalls (a result no fold of these inputs gives)."""
    bits = nm.as_bits(np.asarray(output).reshape(-1), plan.dtype)
    vals = nm.decode(bits, plan.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.ldexp(vals, -plan.b)
        ok = np.isfinite(q) & (q >= 0) & (q == np.floor(q)) & (q < 2.0 ** plan.cap)
        k = np.where(ok, q, 0).astype(np.int64)
    table = _small_table(plan)[np.arange(vals.size) % _period(plan)]
    out = np.zeros(vals.size, dtype=np.int64)
    for j in range(plan.cap):
        r = table[:, j]
        hit = ((k >> j) & 1).astype(bool)
        out |= np.where(hit & (r >= 0), np.left_shift(1, np.maximum(r, 0)), 0)
        ok &= ~(hit & (r < 0))
    out[~ok] = -1
    return out


def signature(expr: Expr, pair: Tuple[int, int], smalls: Sequence[int]) -> int:
    """The rank mask a fold ``expr`` leaves for one element's layout (see the module
    docstring), computed symbolically."""
    small = frozenset(smalls)

    def go(e: Expr) -> Tuple[int, FrozenSet[int]]:
        if isinstance(e, int):
            if e in pair:
                return 1, frozenset()
            return 0, (frozenset((e,)) if e in small else frozenset())
        k, m = go(e[0])
        for item in e[1:]:
            k2, m2 = go(item)
            if k + k2 == 1:            # an uncancelled +-M absorbs every small value
                m = frozenset()        # (+M meeting -M: both sides' masks are empty already)
            else:
                m = m | m2
            k += k2
        return k, m
    _, mask = go(expr)
    return sum(1 << r for r in mask)


_PERMS: Dict[int, np.ndarray] = {}


def _positions(n: int) -> np.ndarray:
    """pos[i, r]: the position of rank r in the i-th permutation of range(n)."""
    if n not in _PERMS:
        perms = np.array(list(itertools.permutations(range(n))), dtype=np.int8)
        _PERMS[n] = np.argsort(perms, axis=1).astype(np.int8)
    return _PERMS[n]


def consistent_left_folds(plan: RevealPlan, elements: Sequence[int],
                          masks: Sequence[int]) -> Optional[List[Tuple[int, ...]]]:
    """Every left fold (a permutation of the ranks) consistent with the observed ``masks`` of
    ``elements``, first two ranks in ascending order (an add cannot tell them apart); None when
    there are too many ranks to enumerate (more than MAX_BRUTE_RANKS)."""
    n = plan.nranks
    if n > MAX_BRUTE_RANKS:
        return None
    pos = _positions(n)
    ok = np.ones(pos.shape[0], dtype=bool)
    seen = set()
    for e, mask in zip(elements, masks):
        (a, c), smalls = plan.layout(int(e))
        key = (a, c, smalls, int(mask))
        if key in seen:
            continue
        seen.add(key)
        if mask < 0:
            return []
        after = np.maximum(pos[:, a], pos[:, c])
        for r in smalls:
            ok &= (pos[:, r] > after) == bool(int(mask) >> r & 1)
    folds = []
    for row in np.flatnonzero(ok):
        order = tuple(int(r) for r in np.argsort(pos[row]))
        if order[0] < order[1]:
            folds.append(order)
    return folds
