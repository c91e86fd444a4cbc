"""``ncclpy order``: the order in which NCCL folds the ranks' contributions, without a GPU.

``ncclpy order all_reduce --ranks 4 --count 1M --dtype bf16 --algo ring --proto ll --channels 2``
prints the split over channels and, per run of elements sharing a fold, that fold (``(2 + 3) +
0`` is one rounded add of ranks 2 and 3, then rank 0's input added); ``--element E`` prints the
fold of element E; ``--json`` prints one JSON object (``verdict``; when predicted ``orders``, one
fold per output element, a list being a left fold of its items).  ``--observe`` runs the calls on
a GPU with inputs that reveal the order and judges NCCL's bits (:mod:`ncclpy.order.observe`).

Exit status: 0 predicted (or, with --observe, every configuration PREDICTED), 1 CANNOT_PREDICT
or a MISMATCH, 2 a usage error (one line naming the flag), 130 Ctrl-C, 141 closed pipe.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..cli_util import run_main
from .args import PROG, build_parser, config_from_args
from .split import COLLECTIVES
from .config import OrderConfig
from .model import Prediction, predict
from .topology import expr_to_json, format_expr
from .verdict import CANNOT_PREDICT, PREDICTED
from .versions import CannotPredict, format_version

__all__ = ["main", "build_parser", "basis", "GPU_CHECKED"]

#: NCCL versions whose predictions a GPU run has confirmed (version code -> the run, as
#: docs/gpu-runs.md names it); empty until the ``order`` stage of the GPU proof has passed
GPU_CHECKED: Dict[int, str] = {}
#: runs listed before the rest is summarized
SHOWN_RUNS = 32


def basis(version: int) -> str:
    """What a prediction for ``version`` rests on, in the words every output uses."""
    run = GPU_CHECKED.get(version)
    if run:
        return f"from NCCL's source, checked on a GPU ({run})"
    return "from NCCL's source, not yet checked on a GPU"


def _orders_json(pred: Prediction, rank: int) -> Iterator[str]:
    """The ``orders`` list, streamed: one serialized fold per element."""
    m = pred.order_map(rank)
    texts = [json.dumps(expr_to_json(e), separators=(",", ":")) for e in m.exprs]
    yield "["
    step = 1 << 16
    for lo in range(0, m.group.size, step):
        chunk = ",".join(texts[g] for g in m.group[lo:lo + step].tolist())
        yield ("," if lo else "") + chunk
    yield "]"


def _print_json(pred: Optional[Prediction], cfg: OrderConfig, rank: int,
                elements: Optional[List[int]], reason: str = "") -> None:
    head: Dict[str, Any] = {"verdict": PREDICTED if pred else CANNOT_PREDICT,
                            "config": _config_json(cfg), "basis": basis(cfg.version)}
    if pred is None:
        head["reason"] = reason
        head["bound"] = ("order-free: |s' - s| <= (n-1) u sum|x_i| for a sum of n ranks "
                         "(u = 2^-p of the type), whatever the order")
        print(json.dumps(head))
        return
    head["port"] = pred.port
    head["rank"] = rank
    s = pred.split
    head["split"] = {"channel_lo": s.channel_lo, "channel_hi": s.channel_hi,
                     "task_channels": s.task_channels,
                     "parts": [{"channel": q.channel, "offset": q.offset, "count": q.count,
                                "chunk": q.chunk} for q in s.parts]}
    if elements:
        m = pred.order_map(rank)
        head["elements"] = [{"element": e, "order": expr_to_json(m.expr(e))} for e in elements]
    text = json.dumps(head)
    sys.stdout.write(text[:-1] + ', "orders": ')
    for piece in _orders_json(pred, rank):
        sys.stdout.write(piece)
    sys.stdout.write("}\n")


def _config_json(cfg: OrderConfig) -> Dict[str, Any]:
    return {"collective": cfg.collective, "ranks": cfg.nranks, "count": cfg.count,
            "dtype": cfg.dtype, "op": cfg.op, "scalar": cfg.scalar, "root": cfg.root,
            "algo": cfg.algo, "proto": cfg.proto, "channels": cfg.comm_channels,
            "nccl_version": format_version(cfg.version),
            "rings": [list(r) for r in cfg.rings[:cfg.comm_channels]],
            "buffsizes": dict(cfg.buffsizes)}


def _print_text(pred: Prediction, rank: int, elements: Optional[List[int]]) -> None:
    cfg = pred.config
    m = pred.order_map(rank)
    print(f"{PROG}: {cfg.describe()}")
    print(f"{basis(cfg.version)} (port {pred.port})")
    print(f"split: {pred.split.describe()} (chunk: NCCL's chunkCount, elements)")
    if pred.split.task_channels < cfg.comm_channels:
        print(f"tuning: this size may use {pred.split.task_channels} of the "
              f"{cfg.comm_channels} channels (enqueue.cc: fewer while nBytes < channels x "
              f"{cfg.nthreads} threads x {cfg.threshold}; NCCL's thread count is its 'Max "
              f"NThreads' line: --nthreads)")
    whose = "the output" if cfg.collective == "all_reduce" else f"rank {rank}'s output"
    step = {"prod": "one rounded multiply", "min": "their min", "max": "their max"}.get(
        cfg.op, "one rounded add")
    from ..dtypes import DTYPES
    if cfg.op in ("min", "max") or DTYPES[cfg.dtype].kind != "float":
        print(f"the order does not change the bits of {cfg.op} on {cfg.dtype} (shown anyway)")
    print(f"folds of {whose} (a + b: {step} of those ranks' inputs):")
    part_of = {q.channel: q for q in pred.split.parts}
    if elements:
        for e in elements:
            ch = next(c for c, q in part_of.items() if q.offset <= e < q.offset + q.count)
            print(f"  element {e:<10} channel {ch}  {format_expr(m.expr(e))}")
        return
    runs = m.runs()
    for first, last, g in runs[:SHOWN_RUNS]:
        ch = next(c for c, q in part_of.items() if q.offset <= first < q.offset + q.count)
        span = f"{first}-{last}" if last > first else f"{first}"
        print(f"  elements {span:<20} channel {ch}  {format_expr(m.exprs[g])}")
    if len(runs) > SHOWN_RUNS:
        print(f"  ... {len(runs) - SHOWN_RUNS} more runs (--element E or --json for any "
              f"element)")
    print("elements sharing a fold:")
    sizes = np.bincount(m.group, minlength=len(m.exprs))
    nruns = np.bincount(np.array([g for _, _, g in runs], dtype=np.int64),
                        minlength=len(m.exprs))
    for g, e in enumerate(m.exprs):
        print(f"  {format_expr(e):<40} {int(sizes[g])} element{'s' if sizes[g] != 1 else ''}"
              f" in {int(nruns[g])} run{'s' if nruns[g] != 1 else ''}")


def _main(argv: List[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.observe:
        from .observe_cli import observe_main
        return observe_main(p, ns)
    for f in ("matrix", "out", "timeout"):
        if getattr(ns, f) is not None:
            p.error(f"{p.flag(f)}: only with --observe")
    if ns.collective is None:
        p.error(f"collective: required: one of {', '.join(COLLECTIVES)}")
    cfg = config_from_args(p, ns)
    rank = ns.rank
    if rank is None:
        rank = cfg.root if cfg.collective == "reduce" else 0
    elif rank >= cfg.nranks:
        p.error(f"{p.flag('rank')}: expected a rank 0..{cfg.nranks - 1}, got {rank}")
    elif cfg.collective == "reduce" and rank != cfg.root:
        p.error(f"{p.flag('rank')}: only reduce's root ({cfg.root}) gets a reduction, got "
                f"rank {rank}")
    for e in ns.element or []:
        if e >= cfg.count:
            p.error(f"{p.flag('element')}: expected an element 0..{cfg.count - 1} of the "
                    f"{cfg.count}-element output, got {e}")
    try:
        pred = predict(cfg)
    except CannotPredict as e:
        if ns.json:
            _print_json(None, cfg, rank, None, str(e))
        else:
            print(f"{PROG}: {cfg.describe()}")
            print(f"{CANNOT_PREDICT}: {e}")
            print("  (every order obeys |s' - s| <= (n-1) u sum|x_i| for a sum of n ranks: "
                  "the order-free bound, not a prediction)")
        return 1
    if ns.json:
        _print_json(pred, cfg, rank, ns.element)
    else:
        _print_text(pred, rank, ns.element)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ncclpy order``; the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_main(PROG, lambda: _main(args))

