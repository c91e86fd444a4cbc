"""``ncclpy order``: the order in which NCCL folds the ranks' contributions, without a GPU.

``ncclpy order all_reduce --ranks 4 --count 1M --dtype bf16 --algo ring --proto ll --channels 2``
prints the split over channels and, per run of elements sharing a fold, that fold (``(2 + 3) +
0`` is one rounded add of ranks 2 and 3, then rank 0's input added); ``--element E`` prints the
fold of element E; ``--json`` prints one JSON object (``verdict``; when predicted ``orders``, one
fold per output element, a list being a left fold of its items).  ``--observe`` runs the calls on
a GPU with inputs that reveal the order and judges NCCL's bits (:mod:`ncclpy.order.observe`).
``--sweep 1K..1G`` instead of ``--count`` answers "why did my result change with the size?": one
row per run of sizes whose channels, chunking and folds stay the same, what changes between
rows (the exact count where the channel count or the chunking changes, by bisection), the fold
of ``--element E``, and how to pin the configuration (:mod:`ncclpy.order.sweep`).

Exit status: 0 predicted (or, with --observe, every configuration PREDICTED), 1 CANNOT_PREDICT
or a MISMATCH, 2 a usage error (one line naming the flag), 130 Ctrl-C, 141 closed pipe.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..cli_util import OneLineParser, run_main
from .args import PROG, build_parser, config_from_args
from .split import COLLECTIVES, DEFAULT_BUFFSIZES
from .sweep import (MAX_BOUNDARIES, Point, Sweep, SweepError, count_for, format_bytes,
                    parse_sizes, sweep)
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


def _print_cannot(cfg: OrderConfig, rank: int, reason: str, as_json: bool, prog: str) -> None:
    """CANNOT_PREDICT with the reason and the order-free bound (text or JSON)."""
    if as_json:
        _print_json(None, cfg, rank, None, reason)
        return
    print(f"{prog}: {cfg.describe()}")
    print(f"{CANNOT_PREDICT}: {reason}")
    print("  (every order obeys |s' - s| <= (n-1) u sum|x_i| for a sum of n ranks: "
          "the order-free bound, not a prediction)")


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
    from ..semantics.dtypes import DTYPES
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


# -- --sweep --------------------------------------------------------------------------------
_NCCL_NAMES = {"ring": "Ring", "tree": "Tree", "ll": "LL", "ll128": "LL128", "simple": "Simple"}
_BUFF_VARS = {"simple": "NCCL_BUFFSIZE", "ll": "NCCL_LL_BUFFSIZE", "ll128": "NCCL_LL128_BUFFSIZE"}


def _pin(cfg: OrderConfig) -> Dict[str, str]:
    """The environment that pins what the sweep assumes (pins.py reads it back)."""
    env = {"NCCL_ALGO": _NCCL_NAMES[cfg.algo], "NCCL_PROTO": _NCCL_NAMES[cfg.proto],
           "NCCL_MIN_NCHANNELS": str(cfg.comm_channels),
           "NCCL_MAX_NCHANNELS": str(cfg.comm_channels)}
    if cfg.buffsize != DEFAULT_BUFFSIZES[cfg.proto]:
        env[_BUFF_VARS[cfg.proto]] = str(cfg.buffsize)
    return env


def _pin_line(sw: Sweep) -> str:
    cfg = sw.base
    env = " ".join(f"{k}={v}" for k, v in _pin(cfg).items())
    ll128 = " (LL128 only where the platform allows it)" if cfg.proto == "ll128" else ""
    tuned = ("; NCCL still tunes the channels down for small sizes (the 'tuned' column)"
             if cfg.comm_channels > 1 else "")
    return (f"to pin this configuration: {env}{ll128}, the same NCCL and {cfg.algo}s: each "
            f"size then folds as shown on every run{tuned}; the sizes of one row fold the "
            f"elements they share alike (checked at the sizes shown, not between them)")


def _sweep_header(sw: Sweep) -> List[str]:
    cfg = sw.base
    p0 = sw.points[0].pred
    op = f"premul_sum({cfg.scalar:g})" if cfg.op == "premul_sum" else cfg.op
    whose = "the output" if cfg.collective == "all_reduce" else f"rank {sw.rank}'s output"
    per = (f"each rank's input of {cfg.nranks} x count" if cfg.collective == "reduce_scatter"
           else "count")
    lines = [f"{PROG} --sweep: {cfg.collective} {cfg.algo}/{cfg.proto}, {cfg.nranks} ranks, "
             f"{cfg.dtype}, {op}, {cfg.comm_channels} channel"
             f"{'s' if cfg.comm_channels != 1 else ''}, NCCL {format_version(cfg.version)}; "
             f"folds of {whose}",
             f"{basis(cfg.version)} (port {p0.port})",
             f"sizes: bytes per rank as nccl-tests counts them ({per} x {cfg.elem_size}-byte "
             f"{cfg.dtype})",
             f"{cfg.algo}/{cfg.proto} is fixed by the flags: NCCL's default picks the algorithm "
             f"and protocol per size from a bandwidth model of the machine that ncclpy does not "
             f"port, so only the channels and the chunking vary here",
             f"tuned: NCCL uses fewer than {cfg.comm_channels} channels while bytes < "
             f"channels x {cfg.nthreads} threads x {cfg.threshold} (enqueue.cc:1864-1890; "
             f"--nthreads: NCCL's 'Max NThreads'); used: the channels the split gives "
             f"(enqueue.cc:519-686)" if cfg.comm_channels > 1 else
             "tuned, used: one channel (--channels 1)"]
    if sw.points[0].loops is not None:
        lines.append(f"loops: a channel's part runs in loops of {cfg.nranks} chunks of "
                     f"{sw.chunk} elements (chunkCount); the last, shorter loop's chunk is "
                     f"alignUp(divUp(rest, {cfg.nranks}), 16 bytes) (all_reduce.h:36): it "
                     f"moves with every size, and with it the folds")
    else:
        lines.append(f"chunk: {sw.chunk} elements; a {cfg.algo} {cfg.collective} folds every "
                     f"element of a channel the same way, so only the channels decide folds")
    from ..semantics.dtypes import DTYPES
    if cfg.op in ("min", "max") or DTYPES[cfg.dtype].kind != "float":
        lines.append(f"the order does not change the bits of {cfg.op} on {cfg.dtype} (shown "
                     f"anyway)")
    elif cfg.nranks <= 2:
        lines.append("at 2 ranks every fold gives the same bits (a + b = b + a; shown anyway)")
    return lines


def _sizes_text(points: Sequence[Point]) -> Tuple[str, str]:
    a, b = points[0], points[-1]
    mark = "" if a.given else "* "
    if len(points) == 1:
        return mark + format_bytes(a.nbytes), str(a.count)
    return (f"{mark}{format_bytes(a.nbytes)}..{format_bytes(b.nbytes)} ({len(points)})",
            f"{a.count}..{b.count}")


def _print_sweep(sw: Sweep) -> None:
    for line in _sweep_header(sw):
        print(line)
    e = sw.element
    head = (f"{'size':<28} {'elements':<22} {'tuned':>5} {'used':>5} {'loops':>6} "
            f"{'last chunk':>10} {'folds':>6}")
    print(head + (f"  fold of element {e}" if e is not None else ""))
    for row in sw.rows:
        if row.changes:
            print(f"  changes: {'; '.join(row.changes)}")
        size, elems = _sizes_text(row.points)
        p = row.points[-1]
        loops = "-" if p.loops is None else str(p.loops)
        last = "-" if p.last_chunk is None else str(p.last_chunk)
        line = (f"{size:<28} {elems:<22} {p.task_channels:>5} {p.used:>5} {loops:>6} "
                f"{last:>10} {p.folds:>6}")
        if e is not None:
            line += "  " + ("- (beyond the output)" if p.element is None else
                            format_expr(p.element))
        print(line)
    for lo, hi in sw.truncated:
        print(f"(more than {MAX_BOUNDARIES} changes between {format_bytes(lo)} and "
              f"{format_bytes(hi)}: the rest not searched)")
    if any(not p.given for p in sw.points):
        print("* found by bisection: the first count with the tuned channels or the loops shown "
              "(one element less has the row before's)")
    print(_pin_line(sw))


def _point_json(p: Point) -> Dict[str, Any]:
    s = p.pred.split
    return {"bytes": p.nbytes, "count": p.count, "given": p.given,
            "task_channels": s.task_channels, "channel_lo": s.channel_lo,
            "channel_hi": s.channel_hi, "counts": [q.count for q in s.parts],
            "loops": p.loops, "last_chunk": p.last_chunk, "folds": p.folds,
            "element_order": None if p.element is None else expr_to_json(p.element),
            "differ": p.differ, "shared": p.shared}


def _sweep_json(sw: Sweep) -> Dict[str, Any]:
    conf = _config_json(sw.base)
    del conf["count"]
    index = {id(p): i for i, p in enumerate(sw.points)}
    return {"mode": "sweep", "verdict": PREDICTED, "config": conf,
            "basis": basis(sw.base.version), "port": sw.points[0].pred.port, "rank": sw.rank,
            "element": sw.element, "chunk": sw.chunk,
            "sizes_are": "bytes per rank (nccl-tests' size column)",
            "algorithm": "fixed by the flags (NCCL's own choice is not modelled)",
            "points": [_point_json(p) for p in sw.points],
            "rows": [{"points": [index[id(p)] for p in r.points], "changes": list(r.changes)}
                     for r in sw.rows],
            "truncated": [list(t) for t in sw.truncated], "pin": _pin(sw.base)}


def _sweep_main(p: OneLineParser, ns: argparse.Namespace) -> int:
    """``--sweep``: checks the flags, runs :func:`ncclpy.order.sweep.sweep`, prints it."""
    if ns.count is not None:
        p.error(f"{p.flag('count')}: not with --sweep (the sizes give the counts)")
    if ns.collective is None:
        p.error(f"collective: required: one of {', '.join(COLLECTIVES)}")
    try:
        sizes = parse_sizes(ns.sweep)
    except SweepError as e:
        p.error(f"{p.flag('sweep')}: {e}")
    ns.count = 1
    base = config_from_args(p, ns)
    rank = _check_rank(p, ns, base)
    try:
        counts = [count_for(base.collective, base.nranks, b, base.elem_size, base.dtype)
                  for b in sizes]
    except SweepError as e:
        p.error(f"{p.flag('sweep')}: {e}")
    element = None
    if ns.element:
        if len(ns.element) > 1:
            p.error(f"{p.flag('element')}: --sweep follows one element, got "
                    f"{len(ns.element)} ({' '.join(map(str, ns.element))})")
        element = ns.element[0]
        if element >= counts[-1]:
            p.error(f"{p.flag('element')}: expected an element 0..{counts[-1] - 1} of the "
                    f"largest size's {counts[-1]}-element output, got {element}")
    try:
        sw = sweep(base, sizes, rank, element)
    except CannotPredict as e:
        _print_cannot(base.with_(count=counts[0]), rank, str(e), ns.json, f"{PROG} --sweep")
        return 1
    if ns.json:
        print(json.dumps(_sweep_json(sw)))
    else:
        _print_sweep(sw)
    return 0


def _check_rank(p: OneLineParser, ns: argparse.Namespace, cfg: OrderConfig) -> int:
    """The rank whose output to show (default: 0, reduce's root); usage error if it has none."""
    rank = ns.rank
    if rank is None:
        return cfg.root if cfg.collective == "reduce" else 0
    if rank >= cfg.nranks:
        p.error(f"{p.flag('rank')}: expected a rank 0..{cfg.nranks - 1}, got {rank}")
    if cfg.collective == "reduce" and rank != cfg.root:
        p.error(f"{p.flag('rank')}: only reduce's root ({cfg.root}) gets a reduction, got "
                f"rank {rank}")
    return rank


def _main(argv: List[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.sweep is not None:
        if ns.observe:
            p.error(f"{p.flag('sweep')}: not with --observe (the sweep predicts without a GPU; "
                    f"--observe runs one size)")
        return _sweep_main(p, ns)
    if ns.observe:
        from .observe_cli import observe_main
        return observe_main(p, ns)
    for f in ("matrix", "out", "timeout"):
        if getattr(ns, f) is not None:
            p.error(f"{p.flag(f)}: only with --observe")
    if ns.collective is None:
        p.error(f"collective: required: one of {', '.join(COLLECTIVES)}")
    cfg = config_from_args(p, ns)
    rank = _check_rank(p, ns, cfg)
    for e in ns.element or []:
        if e >= cfg.count:
            p.error(f"{p.flag('element')}: expected an element 0..{cfg.count - 1} of the "
                    f"{cfg.count}-element output, got {e}")
    try:
        pred = predict(cfg)
    except CannotPredict as e:
        _print_cannot(cfg, rank, str(e), ns.json, PROG)
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

