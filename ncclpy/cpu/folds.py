"""The CPU engine's reductions in NCCL's order: all_reduce, reduce_scatter and reduce fold each
output element in the order NCCL's Ring or Tree kernel folds it for the configuration the
communicator runs (:mod:`ncclpy.cpu.algo`: what NCCL_ALGO, NCCL_PROTO, NCCL_MIN/MAX_NCHANNELS
and the buffer sizes pin at init, Ring on one channel by default), as
:func:`ncclpy.order.predict` models it from NCCL's source (src/device/all_reduce.h,
reduce_scatter.h, reduce.h at v2.28.9-1).

Only where the order can change the bits: a float type (float16, float32, float64, bfloat16,
float8) with sum, prod, avg or premul_sum on 3 ranks or more.  Two operands are one IEEE add or
multiply, which commutes; integer sums and products wrap (order-free), min and max are
order-free: those keep the rank-order fold of :mod:`ncclpy.cpu.reduce` (the reference's bits).

AVG on floats and PreMulSum multiply each rank's input once, as it is loaded, by the scalar
(``1/n`` rounded as src/enqueue.cc:2285-2322 rounds it for AVG; each rank's own scalar for
PreMulSum, "pre-multiplies input values by a given scalar locally", src/nccl.h.in:330), then sum
(src/device/reduce_kernel.h:655-760 applyPreOp; prims_simple.h:267-268): the engine makes those
leaves with the reference and folds "sum" in NCCL's order.  A NaN payload is the reference's,
as before (:func:`ncclpy.order.arith.native_fold`).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..semantics.dtypes import DTYPES
from ..errors import CannotPredict
from ..order.model import Prediction, predict
from ..order.pins import Choice
from ..order.topology import Expr
from .reduce import reduce as rank_order

__all__ = ["reduce_outputs", "ordered", "plan", "Plan", "COLLECTIVES"]

log = logging.getLogger(__name__)

#: NCCL's function name -> the model's collective name
COLLECTIVES = {"AllReduce": "all_reduce", "ReduceScatter": "reduce_scatter", "Reduce": "reduce"}
#: the ops whose fold order can change a float result
_ORDERED_OPS = ("sum", "prod", "avg", "premul_sum")
#: why the model could not predict a call (said once each)
_WARNED: set = set()
#: types whose add and multiply numpy computes as NCCL does (ncclpy.order.arith)
_NATIVE = {"float32": np.float32, "float64": np.float64}


def ordered(wire: str, op: str, n: int) -> bool:
    """Whether NCCL's order can change the bits of ``op`` over ``n`` ranks of ``wire``."""
    return n >= 3 and op in _ORDERED_OPS and DTYPES[wire].kind == "float"


class Plan:
    """One call's prediction and each rank's runs ``(start, stop, fold)`` (made on first use:
    a call's configuration repeats, and so do its runs)."""

    def __init__(self, pred: Prediction) -> None:
        self.pred = pred
        self._spans: Dict[int, List[Tuple[int, int, Expr]]] = {}

    def spans(self, rank: int) -> List[Tuple[int, int, Expr]]:
        got = self._spans.get(rank)
        if got is None:
            got = self._spans[rank] = self.pred.spans(rank) or []
        return got


@functools.lru_cache(maxsize=512)
def plan(choice: Choice, collective: str, nranks: int, count: int, dtype: str, op: str,
         root: int, version: int) -> Union[Plan, str]:
    """The model's prediction of one call made with ``choice`` (cached), or why the model
    cannot predict it (a version it was not checked against, a buffer size NCCL would not
    run)."""
    try:
        return Plan(predict(choice.config(collective, nranks, count, dtype=dtype, op=op,
                                          root=root, version=version)))
    except (CannotPredict, ValueError) as e:
        return str(e)


def reduce_outputs(fn: str, ins: List[np.ndarray], op: Any, scalars: Sequence[Optional[int]],
                   wire: str, count: int, root: int, choice: Optional[Choice], version: int,
                   ranks: Sequence[int]) -> Dict[int, np.ndarray]:
    """Each rank of ``ranks``'s output of the reduction ``fn`` (AllReduce, ReduceScatter,
    Reduce) over the logical arrays ``ins`` (rank order: ``count`` elements each, ReduceScatter
    ``nranks*count``) of ``wire`` type: ``op`` a builtin's name or the PreMulSum RedOp,
    ``scalars`` each rank's PreMulSum scalar bits (None for a builtin op), ``choice`` what the
    communicator runs (None: rank order).  Each output is a new array."""
    n = len(ins)
    if not ranks:                       # a reduce's non-root: nothing written
        return {}
    name = getattr(op, "name", op)
    got: Union[Plan, str, None] = None
    if choice is not None and ordered(wire, name, n):
        fold = "prod" if name == "prod" else "sum"
        got = plan(choice, COLLECTIVES[fn], n, count, wire, fold, root, version)
        if isinstance(got, str):
            if got not in _WARNED:          # once per reason, not once per call
                _WARNED.add(got)
                log.warning("CPU backend: %s folds in rank order, not NCCL's: %s", fn, got)
            got = None
    if got is None:
        res = _rank_order(ins, op, scalars, wire, n)
        if fn == "ReduceScatter":
            return {r: res[r * count:(r + 1) * count] for r in ranks}
        return {r: res for r in ranks}
    if name == "premul_sum":            # each rank's own scalar on its own input
        ins = [rank_order([x], op, wire, 1, scalar_bits=s) for x, s in zip(ins, scalars)]
    elif name == "avg":                 # x * (1/n), rounded, as the kernel loads it
        ins = [rank_order([x], "avg", wire, n) for x in ins]
    t = _NATIVE.get(wire)
    out: Dict[int, np.ndarray] = {}
    shared: Optional[np.ndarray] = None
    for r in ranks:
        if fn == "AllReduce" and shared is not None:
            out[r] = shared             # every rank's folds are the same
            continue
        off = r * count if fn == "ReduceScatter" else 0
        blocks = [x[off:off + count] for x in ins]
        res = None if t is None else _native(got.spans(r), blocks, t, fold == "sum")
        if res is None:                 # not numpy's own arithmetic, or a NaN: the model's
            res = got.pred.outputs(ins, ranks=[r])[r]
        out[r] = shared = res
    return out


def _native(spans: List[Tuple[int, int, Expr]], blocks: List[np.ndarray], t: type,
            add: bool) -> Optional[np.ndarray]:
    """The folds ``spans`` over ``blocks`` in numpy's own float32/float64 arithmetic, each
    run folded straight into the output (what :meth:`Prediction.outputs` computes, without
    its copies); None where a NaN appears (its payload is then the model's, which is the
    reference's: :func:`ncclpy.order.arith.native_fold`)."""
    f = np.add if add else np.multiply
    blocks = [np.asarray(b, dtype=t) for b in blocks]     # each operand in the type, as NCCL's
    res = np.empty(blocks[0].size, dtype=t)
    with np.errstate(all="ignore"):
        for lo, hi, expr in spans:
            _fold(f, expr, [b[lo:hi] for b in blocks], res[lo:hi])
    if np.isnan(res).any():
        return None
    return res


def _fold(f: Any, expr: Expr, leaves: List[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``expr`` (a rank, or a left fold of sub-expressions) over ``leaves``, into ``out``."""
    if isinstance(expr, int):
        np.copyto(out, leaves[expr])
        return out
    if len(expr) == 1:
        return _fold(f, expr[0], leaves, out)
    first, second = (x if isinstance(x, int) else _fold(f, x, leaves, np.empty_like(out))
                     for x in expr[:2])
    f(leaves[first] if isinstance(first, int) else first,
      leaves[second] if isinstance(second, int) else second, out=out)
    for x in expr[2:]:
        f(out, leaves[x] if isinstance(x, int) else _fold(f, x, leaves, np.empty_like(out)),
          out=out)
    return out


def _rank_order(ins: List[np.ndarray], op: Any, scalars: Sequence[Optional[int]], wire: str,
                n: int) -> np.ndarray:
    """The reference's rank-order fold (the engine's before NCCL's order; still its result
    where the order cannot matter)."""
    if len(set(scalars)) > 1:          # PreMulSum: each rank's scalar on its own input
        ins = [rank_order([x], op, wire, 1, scalar_bits=s) for x, s in zip(ins, scalars)]
        return rank_order(ins, "sum", wire, n)
    return rank_order(ins, op, wire, n, scalar_bits=scalars[0] if scalars else None)
