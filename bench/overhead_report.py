"""The pure half of ``python -m bench.overhead``: the statistics, the order the backends take
turns in, the derived figures, the labels and the table; no GPU, no NCCL (tested on the CPU).

Sections of the output: ``per call`` (modes ``eager`` and ``prepared``: what the targets are
stated in, with ncclpy's two flavours minus cupy, minus torch and minus nccl4py), ``graph
replay`` (every backend replays the same kind of graph, one captured call: no difference is
derived) and ``one-off`` (``capture``: what building a graph costs once, never compared with
the eager target).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple, TypeVar

import numpy as np

__all__ = ["MODES", "PER_CALL_MODES", "SECTIONS", "VARIANTS", "OTHERS", "summarize",
           "split_calls", "rotation", "derive", "render", "method_lines", "STREAM_NOTE",
           "BUFFER_NOTE", "GRAPH_NOTE", "CAPTURE_NOTE"]

T = TypeVar("T")

#: every mode, in the order they run
MODES = ("eager", "prepared", "graph", "capture")
#: the modes a per-call overhead target is stated in
PER_CALL_MODES = ("eager", "prepared")
#: mode -> section of the table and the JSON
SECTIONS = {"eager": "per_call", "prepared": "per_call", "graph": "graph_replay",
            "capture": "one_off"}
#: ncclpy's flavours: each gets its own derived figures
VARIANTS = ("ncclpy", "ncclpy-bare")
#: what each flavour is compared with, where it ran
OTHERS = ("cupy", "torch", "nccl4py")

STREAM_NOTE = ("one non-blocking CuPy stream per rank, shared by every backend: ncclpy, "
               "ncclpy-bare, cupy and nccl4py get its raw handle (an int); torch gets it as its "
               "current stream (torch.cuda.ExternalStream over the same handle), since torch's "
               "collectives take no stream")
BUFFER_NOTE = ("one set of CuPy buffers per size, shared by every backend (float32, in place); "
               "torch gets zero-copy tensors over the same memory")
GRAPH_NOTE = ("graph replay: every backend replays the same kind of graph (one captured call; "
              "CuPy's Graph.launch, torch's CUDAGraph.replay), no library code runs in it, so no "
              "ncclpy - cupy figure; the ranks meet at a barrier before each replay (untimed)")
CAPTURE_NOTE = ("one-off: the call while the stream captures a CUDA graph, what building a "
                "graph costs once per captured call; not compared with the eager target")


def summarize(ns: Sequence[int]) -> Dict[str, float]:
    """median / p10 / p90 / mean / min in µs of per-call nanoseconds."""
    a = np.asarray(ns, dtype=np.float64) / 1e3
    if not a.size:
        return {"median_us": 0.0, "p10_us": 0.0, "p90_us": 0.0, "mean_us": 0.0, "min_us": 0.0}
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"median_us": float(p50), "p10_us": float(p10), "p90_us": float(p90),
            "mean_us": float(a.mean()), "min_us": float(a.min())}


def split_calls(calls: int, rounds: int) -> List[int]:
    """``calls`` timed calls over ``rounds`` rounds, as evenly as whole calls allow (the first
    rounds take one more); every round gets at least one call."""
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be >= 1, got {calls}, {rounds}")
    rounds = min(rounds, calls)
    base, extra = divmod(calls, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def rotation(items: Sequence[T], round_no: int) -> List[T]:
    """The order of ``items`` in round ``round_no``: each round starts one further along, so no
    backend always runs first (or right after the same one)."""
    if not items:
        return []
    k = round_no % len(items)
    return list(items[k:]) + list(items[:k])


def derive(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (size, per-call mode, ncclpy flavour): its median and its median minus each other
    backend's (cupy, torch, nccl4py, where they ran), in µs.  Graph replay and capture get
    none (see :data:`GRAPH_NOTE`, :data:`CAPTURE_NOTE`)."""
    med = {(r["backend"], r["size"], r["mode"]): float(r["median_us"]) for r in results
           if r.get("mode") in PER_CALL_MODES}
    out = []
    keys = sorted(med, key=lambda k: (k[1], PER_CALL_MODES.index(k[2]),
                                      VARIANTS.index(k[0]) if k[0] in VARIANTS else 99))
    for bk, size, mode in keys:
        if bk not in VARIANTS:
            continue
        v = med[(bk, size, mode)]
        row: Dict[str, Any] = {"backend": bk, "size": size, "mode": mode, "median_us": v}
        for other in OTHERS:
            if (other, size, mode) in med:
                row[f"minus_{other}_us"] = v - med[(other, size, mode)]
        out.append(row)
    return out


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _grid(head: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [line(head)] + [line(r) for r in rows]


def _backends(results: Sequence[Dict[str, Any]]) -> List[str]:
    seen: List[str] = []
    for r in results:
        if r["backend"] not in seen:
            seen.append(r["backend"])
    return seen


def method_lines(doc: Dict[str, Any]) -> List[str]:
    """The header: what was timed, how, and what each backend ran with."""
    m = doc.get("method", {})
    out = [f"# bench.overhead: {doc.get('collective', 'all_reduce')} float32 in place, "
           f"{doc.get('world_size')} ranks, rank 0's host time per call",
           f"# rounds: {m.get('rounds')} (each round runs every backend in turn, the order "
           f"rotated each round; {m.get('warmup')} untimed calls per backend and mode first); "
           f"medians over every call of every round"]
    if m.get("stream"):
        out.append(f"# stream: {m['stream']}")
    if m.get("buffers"):
        out.append(f"# buffers: {m['buffers']}")
    for b in doc.get("backends", []):
        s = b.get("settings") or {}
        ran = ", ".join(f"{k} {v}" for k, v in s.items())
        out.append(f"# {b['name']}: {b.get('defaults') or '-'}" + (f" [{ran}]" if ran else ""))
    for note in doc.get("notes", []):
        out.append(f"# {note}")
    return out


def render(doc: Dict[str, Any]) -> str:
    """The tables of a run's document: per call with the derived columns, graph replay, and
    the one-off capture section, each only where its modes ran."""
    results = doc.get("results", [])
    names = _backends(results)
    med = {(r["backend"], r["size"], r["mode"]): r["median_us"] for r in results}
    sizes = sorted({r["size"] for r in results})
    out = method_lines(doc)
    per_call = [m for m in PER_CALL_MODES if any(r["mode"] == m for r in results)]
    if per_call:
        dcols: List[Tuple[str, str]] = []
        for d in doc.get("derived", []):
            for other in OTHERS:
                col = (d["backend"], other)
                if f"minus_{other}_us" in d and col not in dcols:
                    dcols.append(col)
        der = {(d["backend"], d["size"], d["mode"]): d for d in doc.get("derived", [])}
        out += ["", "## per call: median us (the targets' section)"]
        head = ["mode", "size"] + names + [f"{v}-{o}" for v, o in dcols]
        rows = []
        for mode in per_call:
            for size in sizes:
                rows.append([mode, str(size)] + [_f(med.get((b, size, mode))) for b in names]
                            + [_f(der.get((v, size, mode), {}).get(f"minus_{o}_us"))
                               for v, o in dcols])
        out += _grid(head, rows)
    for mode, title in (("graph", "## graph replay: median us. " + GRAPH_NOTE),
                        ("capture", "## " + CAPTURE_NOTE + "; median us per captured call")):
        if any(r["mode"] == mode for r in results):
            out += ["", title]
            rows = [[str(s)] + [_f(med.get((b, s, mode))) for b in names] for s in sizes]
            out += _grid(["size"] + names, rows)
    return "\n".join(out)
