"""The exact reference of ``ncclpy check``: where the reduction-order model predicts a call, a
case's reference is the model's prediction, bit for bit, for any input (this module works on
one rank; rank 0's choice between the references is :mod:`ncclpy.check.refs`).

Which cases: all_reduce, reduce and reduce_scatter on float types (complex ones on their float
pairs, as NCCL reduces them), any op, one or more elements.  Which configuration:

* ``--backend cpu``: what ncclpy's CPU backend runs for the call
  (:func:`ncclpy.cpu.order_choice`: NCCL_ALGO, NCCL_PROTO, NCCL_MIN/MAX_NCHANNELS and the
  buffer sizes as its init read them; Ring on one channel by default);
* ``--backend nccl``: the pinned environment (:meth:`ncclpy.order.pins.Pins.pinned`, the
  channel count NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS pins) and NCCL's debug log for what
  pins cannot say (:mod:`.nccl_log`: the version, each channel's ring, rank 0's tuning table);
  rank 0 also keeps the call's logged ``Bytes -> Algo`` line, which must confirm the predicted
  algorithm, protocol and channel range;
* torch's gloo is not NCCL: its output is judged against the rank-order reference
  (:mod:`ncclpy.reference`), as before.

Where the model cannot predict (NCCL_ALGO or NCCL_PROTO not pinned, an algorithm it does not
cover, a missing log line, ...) the case keeps the rank-order reference and says why
("order-free bound: <reason>"): verifiable inputs are then exact in any order, normal and
revealing inputs are judged by the order-free bound of a sum, |s' - s| <= (n-1) u sum|x|
(:func:`ncclpy.order.verdict.order_free_bound`'s formula, :func:`bound_holds`).

Compared against the prediction, the bits of a NaN and, for min and max, the sign of a zero
where +0 and -0 meet are not claimed (as :func:`ncclpy.order.verdict.judge` compares).  A
disagreement names the first differing element, the fold the model predicts for it
(:func:`ncclpy.order.topology.format_expr`) and, for revealing inputs, the folds the output's
bits fit (:func:`ncclpy.order.verdict.judge` with the reveal plan).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..semantics import numerics as nm
from ..semantics.dtypes import C_NAMES, DTYPES, LOGICAL
from . import cases as C
from .compare import Comparison, compare
from .inputs import from_wire, to_wire, wire_name
from .refs import GLOO_REASON, NCCL_ORDER, RANK_ORDER, TORCH_GLOO_REASON

__all__ = ["NCCL_ORDER", "RANK_ORDER", "Exact", "static_reason", "for_case", "compare_claimed",
           "disagreement", "bound_holds", "cpu_choice", "GLOO_REASON", "TORCH_GLOO_REASON",
           "expected", "judge_rank"]

_CACHE = 16


@dataclass(frozen=True)
class Exact:
    """One case's reference on this rank: ``kind`` NCCL_ORDER (``pred``, ``config`` in words,
    and on a GPU ``expect``: the call line rank 0's log must show) or RANK_ORDER (``reason``)."""

    kind: str
    reason: str = ""
    pred: Any = None
    config: str = ""
    expect: Tuple[Any, ...] = ()


def static_reason(case: C.Case) -> str:
    """Why ``case`` has no exact reference whatever the configuration ('' when it may)."""
    if case.op is None or case.dtype is None:
        return "data movement: no arithmetic"
    if case.collective not in C.FLOAT_REDUCTIONS:
        return f"{case.collective}: no fold"
    if case.dtype == "bool" or LOGICAL[case.dtype].wire.kind != "float":
        return "integer arithmetic: every order gives the same bits"
    if case.count == 0:
        return "no element to fold"
    return ""


def cpu_choice(comm: Any, collective: str, wire: str, op: str = "sum",
               nranks: Optional[int] = None) -> Any:
    """What the CPU backend runs for ``collective`` of NCCL type ``wire`` and ``op`` on
    ``comm`` (:func:`ncclpy.cpu.order_choice`; without a communicator, what a new one of
    ``nranks`` ranks would run from this process's environment as NCCL reads it).  PinError
    where NCCL refuses the call."""
    if comm is not None:
        from ..cpu import order_choice
        return order_choice(comm, collective, wire, op or "sum")
    from ..order.pins import Pins
    premul = op == "premul_sum" or (op == "avg" and DTYPES[wire].kind == "float")
    return Pins.from_env(None, nranks=nranks).cpu_choice(collective, C_NAMES[wire],
                                                         premul=premul)


def _call(case: C.Case) -> Dict[str, Any]:
    lg = LOGICAL[case.dtype]
    return {"dtype": lg.wire.name, "op": case.op,
            "scalar": case.scalar if case.op == "premul_sum" else None,
            "root": case.root if case.collective == "reduce" else 0}


def _cpu_config(ctx: Dict[str, Any], case: C.Case) -> Tuple[Any, str]:
    wire = wire_name(case.dtype)
    choice = cpu_choice(ctx.get("comm"), case.collective, wire, case.op or "sum", ctx["n"])
    cfg = choice.config(case.collective, ctx["n"], case.count * LOGICAL[case.dtype].factor,
                        **_call(case))
    return cfg, f"the CPU backend's configuration: {choice.why}"


def _gpu_config(ctx: Dict[str, Any], case: C.Case) -> Tuple[Any, str]:
    from ..order.config import OrderConfig
    from ..order.pins import Pins
    from ..order.versions import CannotPredict
    log = ctx.get("nccl_init")
    pins = Pins.from_env(None, nranks=ctx["n"],
                         **({"version": log.version} if log is not None and log.version else {}))
    algo, proto, why = pins.pinned(case.collective)
    if why:
        raise CannotPredict(why)
    if log is None:
        raise CannotPredict("missing log lines: NCCL's log of ncclpy's communicator was not "
                            "read")
    if log.problem:
        raise CannotPredict(log.problem)
    if log.tuner:
        raise CannotPredict(f"a tuner plugin is loaded ({log.tuner}): it may change the "
                            f"channels and chunks")
    k = pins.pinned_channels()
    if k is not None and k != log.channels:
        raise CannotPredict(f"NCCL_MIN/MAX_NCHANNELS pin {k} channels, NCCL logged "
                            f"{log.channels}")
    if (algo, proto) not in log.max_threads or (algo, proto) not in log.thresholds:
        raise CannotPredict("missing log lines: rank 0's tuning table ('Max NThreads', "
                            "NCCL_DEBUG_SUBSYS=TUNING) or 'threadThresholds'")
    if algo == "tree" and log.tree_problem:
        raise CannotPredict(log.tree_problem)
    cfg = OrderConfig.make(case.collective, ctx["n"], case.count * LOGICAL[case.dtype].factor,
                           algo=algo, proto=proto, version=log.version, channels=log.channels,
                           rings=log.rings, trees=log.trees if algo == "tree" else None,
                           buffsizes=dict(pins.buffsizes), max_threads=log.max_threads,
                           thresholds=log.thresholds, **_call(case))
    return cfg, (f"pinned: NCCL_ALGO={os.environ.get('NCCL_ALGO')} "
                 f"NCCL_PROTO={os.environ.get('NCCL_PROTO')}; {log.describe()}")


def for_case(ctx: Dict[str, Any], case: C.Case) -> Exact:
    """This rank's reference for ``case`` (the last few are kept: the in-place and out-of-place
    variants of a cell share theirs)."""
    why = static_reason(case)
    if why:
        return Exact(RANK_ORDER, why)
    if ctx["backend"] == "gloo":
        return Exact(RANK_ORDER, GLOO_REASON)
    key = (case.collective, case.dtype, case.op, case.scalar, case.count, case.root)
    cache = ctx.setdefault("_exact", {})
    got = cache.get(key)
    if got is not None:
        return got
    from ..order.model import predict
    from ..order.pins import PinError
    from ..order.versions import CannotPredict
    try:
        cfg, how = (_cpu_config if ctx["backend"] == "cpu" else _gpu_config)(ctx, case)
        pred = predict(cfg)
    except (CannotPredict, PinError, ValueError) as e:
        got = Exact(RANK_ORDER, f"order-free bound: {e}")
    else:
        s = pred.split
        nbytes = cfg.count * LOGICAL[cfg.dtype].itemsize
        got = Exact(NCCL_ORDER, pred=pred, config=f"{cfg.describe()} ({how})",
                    expect=(case.collective, nbytes, cfg.algo, cfg.proto, s.channel_lo,
                            s.channel_hi))
    if len(cache) >= _CACHE:
        cache.pop(next(iter(cache)))
    cache[key] = got
    return got


def expected(ex: Exact, case: C.Case, ins: Sequence[np.ndarray], rank: int,
             fallback: Any) -> Any:
    """This rank's predicted output (logical array), or ``fallback`` where NCCL writes no
    reduction there (reduce's non-roots: their buffer is left as it was)."""
    if not ex.pred.defined(rank):
        return fallback
    out = ex.pred.outputs([to_wire(a, case.dtype) for a in ins], ranks=[rank])[rank]
    return from_wire(out, case.dtype)


def compare_claimed(out: Any, want: Any, case: C.Case) -> Comparison:
    """:func:`ncclpy.check.compare.compare`, except where the prediction claims no bits: both
    NaN, and for min and max two zeros (see the module docstring)."""
    c = compare(out, want, case.dtype)
    if c.equal is not False or c.note:
        return c
    w = wire_name(case.dtype)
    a = nm.as_bits(to_wire(out, case.dtype), w)
    b = nm.as_bits(to_wire(want, case.dtype), w)
    free = nm.is_nan_bits(a, w) & nm.is_nan_bits(b, w)
    if case.op in ("min", "max"):
        free |= (nm.decode(a, w) == 0) & (nm.decode(b, w) == 0)
    diff = (a != b) & ~free
    if not diff.any():
        return Comparison(True, note=f"{int((a != b).sum())} element(s) differ only in bits "
                                     f"the model does not claim (a NaN's payload, the sign of "
                                     f"a zero min/max)")
    first = int(np.argmax(diff)) // LOGICAL[case.dtype].factor
    return Comparison(False, c.max_ulp, int(diff.sum()), first)


def disagreement(ex: Exact, case: C.Case, ins: Sequence[np.ndarray], out: Any, rank: int,
                 who: str) -> str:
    """The first element where ``who``'s output (``out``, this rank's) differs from the
    prediction: the element, both bits, the predicted fold and, for revealing inputs, the
    folds the output's bits fit ('' when it does not differ: e.g. a corrupted reference)."""
    from ..order.reveal import reveal_plan
    from ..order.topology import format_expr, ring_rotation, tree_expr
    from ..order.verdict import MISMATCH, judge
    cfg = ex.pred.config
    observed: List[Optional[np.ndarray]] = [None] * cfg.nranks
    observed[rank] = to_wire(out, case.dtype)
    plan = reveal_plan(cfg.dtype, cfg.nranks) if case.inputs == "reveal" else None
    cands = []
    if plan is not None:
        for ch in range(cfg.comm_channels):
            cands += [(f"channel {ch} ring from position {s}", ring_rotation(cfg.rings[ch], s))
                      for s in range(cfg.nranks)]
            if cfg.algo == "tree":
                cands.append((f"channel {ch} tree", tree_expr(cfg.trees[ch])))
    v = judge(ex.pred, [to_wire(a, case.dtype) for a in ins], observed, reveal=plan,
              candidates=cands)
    if v.kind != MISMATCH or not v.first:
        return ""
    d = v.first[0]
    w = LOGICAL[cfg.dtype].wire.itemsize * 2
    where = f"element {d.element}"
    if LOGICAL[case.dtype].factor > 1:
        where = (f"element {d.element // 2} ({'real' if d.element % 2 == 0 else 'imaginary'} "
                 f"part)")
    text = (f"rank {rank} {where}: predicted 0x{d.predicted:0{w}x} from "
            f"{format_expr(d.predicted_fold)}, {who} gave 0x{d.observed:0{w}x}")
    if d.observed_folds:
        text += f"; its bits fit {', '.join(d.observed_folds)}"
    return text + f" ({v.differing} of {v.compared} values differ)"


def bound_holds(case: C.Case, ins: Sequence[np.ndarray], out: Any, rank: int) -> Optional[bool]:
    """Whether this rank's sum ``out`` obeys the bound every order obeys, |s' - s| <= gamma_{n-1}
    sum|x_i| with u = 2^-mantissa bits (:func:`ncclpy.order.verdict.order_free_bound`'s
    formula), with the same elements non-finite; None where it does not apply (verifiable
    inputs, another op, no output)."""
    if out is None or case.inputs == "verifiable" or case.op != "sum" or not ins:
        return None
    if case.collective == "reduce" and rank != case.root:
        return None
    w = wire_name(case.dtype)
    xs = [to_wire(a, case.dtype) for a in ins]
    if case.collective == "reduce_scatter":
        k = case.count * LOGICAL[case.dtype].factor
        xs = [x[rank * k:(rank + 1) * k] for x in xs]
    vals = np.stack([nm.decode(nm.as_bits(x, w), w) for x in xs]).astype(np.longdouble)
    got = nm.decode(nm.as_bits(to_wire(out, case.dtype), w), w).astype(np.longdouble)
    if got.size != vals.shape[1]:
        return False
    exact, mag = vals.sum(axis=0), np.abs(vals).sum(axis=0)
    n = len(xs)
    u = np.longdouble(2.0) ** -nm.mantissa_bits(w)
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    fin = np.isfinite(got) & np.isfinite(exact)
    if not np.array_equal(fin, np.isfinite(exact)):
        return False
    return bool(np.all(np.abs(got - exact)[fin] <= gamma * mag[fin]))


def judge_rank(ctx: Dict[str, Any], case: C.Case, ex: Exact, ins: Sequence[np.ndarray],
               ref: Any, torch_ref: Any, n_out: Any, sides: List[List[Any]],
               res: Dict[str, Any], ref_how: Optional[str] = None) -> None:
    """Put this rank's verdicts against the exact reference into ``res`` (ncclpy's) and each
    torch side's part (``sides``: ``[output, part]``): ``ref_kind`` with ``ref_reason`` or
    ``ref_config``; ``n_nccl`` / ``t_nccl`` (torch only on a GPU: gloo is not NCCL) with a
    ``*_diff`` line where they differ; for normal and revealing inputs, whether the rank-order
    comparisons (``n_ref``, ``t_ref``) are within the order-free bound.  ``ref_how``: the
    reference was corrupted on purpose (``NCCLPY_CHECK_INJECT``), the prediction is too."""
    from .compare import corrupt
    rank = ctx["rank"]
    res["ref_kind"] = ex.kind
    if ex.kind == RANK_ORDER:
        res["ref_reason"] = ex.reason
    else:
        res["ref_config"] = ex.config
        res["ref_version"] = ex.pred.config.version
        want = expected(ex, case, ins, rank, ref)
        if ref_how and want is not ref and want is not None and np.asarray(want).size:
            want = corrupt(want, ref_how)
        if ctx.get("comm") is not None:
            c = compare_claimed(n_out, want, case)
            res["n_nccl"] = c.as_dict()
            if c.equal is False:
                res["n_nccl_diff"] = disagreement(ex, case, ins, n_out, rank, "ncclpy")
        if ctx["backend"] == "nccl":
            want_t = want if ex.pred.defined(rank) else torch_ref
            for t_out, part in sides:
                c = compare_claimed(t_out, want_t, case)
                part["t_nccl"] = c.as_dict()
                if c.equal is False:
                    part["t_nccl_diff"] = disagreement(ex, case, ins, t_out, rank, "torch")
            if rank == 0:
                res["nccl_expect"] = list(ex.expect)
    if case.inputs == "verifiable":
        return
    if "n_ref" in res and res["n_ref"]["equal"] is False:
        res["n_ref"]["bound_ok"] = bound_holds(case, ins, n_out, rank)
    for t_out, part in sides:
        if part.get("t_ref", {}).get("equal") is False:
            part["t_ref"]["bound_ok"] = bound_holds(case, ins, t_out, rank)
