"""What the header of a ``ncclpy check`` run says about its references (the JSON's
``header.reference`` and the lines printed under the first): which cases are judged against
NCCL's order (:mod:`ncclpy.check.exact`), in which configuration, on what basis, and what
torch's side is judged against."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from . import cases as C

__all__ = ["describe", "header_lines", "WHICH"]

#: the cases an exact reference can judge
WHICH = ("all_reduce, reduce and reduce_scatter on float types (complex ones as their float "
         "pairs), where the model predicts the call")


def _config(ctx: Dict[str, Any]) -> Dict[str, Tuple[str, str]]:
    """Per reduction, (the configuration the prediction is made for in a few words, and why:
    what decided it), or ("no prediction", why not)."""
    from ..order.pins import PinError, Pins
    out: Dict[str, Tuple[str, str]] = {}
    if ctx["backend"] == "cpu":
        from .exact import cpu_choice
        for coll in C.FLOAT_REDUCTIONS:
            try:
                ch = cpu_choice(ctx.get("comm"), coll, "float32", "sum", ctx.get("n"))
            except (PinError, ValueError) as e:
                out[coll] = ("no prediction", str(e))
                continue
            out[coll] = (f"{ch.algo}/{ch.proto} on {ch.channels} channel"
                         f"{'s' if ch.channels != 1 else ''}",
                         f"the CPU backend's configuration: {ch.why}")
        return out
    pins = Pins.from_env(None, nranks=ctx.get("n"))
    log = ctx.get("nccl_init")
    for coll in C.FLOAT_REDUCTIONS:
        algo, proto, why = pins.pinned(coll)
        if why:
            out[coll] = ("no prediction", why)
        elif log is None or log.problem:
            out[coll] = ("no prediction", log.problem if log is not None else
                         "NCCL's log was not read")
        else:
            out[coll] = (f"{algo}/{proto} on {log.channels} channel"
                         f"{'s' if log.channels != 1 else ''}",
                         f"NCCL_ALGO/NCCL_PROTO pin it; {log.describe()}")
    return out


def describe(ctx: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON's ``header.reference``."""
    from ..order.cli import basis
    backend = ctx["backend"]
    if backend == "gloo":
        return {"exact": "none: gloo is not NCCL and ncclpy does not run",
                "torch": "rank-order (ncclpy.reference)"}
    version = None
    log = ctx.get("nccl_init")
    if log is not None and log.version:
        version = log.version
    from ..order.config import DEFAULT_VERSION
    conf = _config(ctx)
    if backend == "cpu" and ctx.get("comm") is not None:
        version = int(getattr(ctx["comm"], "nccl_version", 0) or 0) or None
    return {"exact": f"nccl-order (the model's prediction, bit for bit) for {WHICH}; "
                     f"rank-order (ncclpy.reference) for the rest, with the reason",
            "basis": basis(version or DEFAULT_VERSION),
            "config": {k: f"{a} ({b})" for k, (a, b) in conf.items()},
            "short": {k: a for k, (a, _) in conf.items()},
            "torch": ("nccl-order where ncclpy's side is, else rank-order" if backend == "nccl"
                      else "rank-order (ncclpy.reference): gloo is not NCCL")}


def header_lines(h: Dict[str, Any]) -> List[str]:
    """The header's lines about the references (unwrapped)."""
    ref = h.get("reference") or {}
    if not ref:
        return []
    if "basis" not in ref:
        return [f"  reference: rank order (ncclpy.reference); no exact reference: "
                f"{ref['exact'].split(': ', 1)[-1]}"]
    out = [f"  reference: NCCL's order, the model's prediction bit for bit ({ref['basis']}), "
           f"for {WHICH}; the rest: rank order (ncclpy.reference), with the reason"]
    short = ref.get("short") or {}
    texts = set(short.values())
    if len(texts) == 1:
        out.append(f"  NCCL's order for {', '.join(short)}: {texts.pop()} (why: the JSON's "
                   f"header.reference)")
    else:
        out.append("  NCCL's order for " + "; ".join(f"{c}: {t}" for c, t in short.items()))
    out.append(f"  torch is judged against {ref['torch']}")
    return out
