"""``python -m bench.cpu_backend``: ncclpy's CPU backend against torch's gloo, the figures of
docs/performance.md ("The CPU backend").

For each world size (``--nproc 2,4``) one run of the sweep (``python -m bench all_reduce
--device cpu --backend ncclpy,torch``; the two backends alternate at each size) at exactly the
sizes given (default: 8 B for latency, 1 MiB for the issue's target, 64 MiB for bandwidth),
float32 sum, nccl-tests' timing (``-n`` calls back to back, per call time averaged over the
ranks, algbw and busbw), every result checked against the reference.  The sweep's own table is
printed as it runs; a summary table per world size follows, and ``-J FILE`` keeps every figure
with the machine it was measured on.

These are CPU figures: ncclpy's CPU backend (``ncclpy.init(device="cpu")``) and torch's gloo on
host memory, no NCCL and no GPU.  They say how fast the engine is for testing, never how fast
NCCL is.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from ncclpy.cli_util import OneLineParser, check_output_path, run_main
from ncclpy.errors import ArgumentError

__all__ = ["main", "build_parser", "machine", "summary_lines", "DEFAULT_SIZES"]

PROG = "python -m bench.cpu_backend"
#: latency, the issue's 1 MiB target, bandwidth
DEFAULT_SIZES = "8,1M,64M"


def build_parser() -> OneLineParser:
    """The parser (a usage error is one line naming the flag, exit status 2)."""
    p = OneLineParser(prog=PROG, description=(
        "all_reduce float32 sum on ncclpy's CPU backend vs torch's gloo, one run of the sweep "
        "per world size: CPU figures, not NCCL figures."))
    p.add_argument("--nproc", default="2,4", metavar="N[,N...]",
                   help="world sizes, one run each (default 2,4)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, metavar="S[,S...]",
                   help=f"message sizes, K/M/G powers of 1024 (default {DEFAULT_SIZES})")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=2,
                   help="warm-up calls per size (default 2)")
    p.add_argument("-J", "--json", default=None, metavar="FILE",
                   help="write every figure and the machine as JSON (each world size's sweep "
                        "keeps its nccl-tests JSON beside it: FILE's stem + .nN.sweep.json; "
                        "without -J those are temporary)")
    return p


def _ints(p: OneLineParser, dest: str, text: str, lo: int) -> List[int]:
    out = []
    for part in text.split(","):
        try:
            v = int(part)
        except ValueError:
            p.error(f"{p.flag(dest)} {text}: {part!r} is not an integer; expected a comma list "
                    f"of integers >= {lo}")
        if v < lo:
            p.error(f"{p.flag(dest)} {text}: {v} < {lo}; expected integers >= {lo}")
        out.append(v)
    return out


def _sizes(p: OneLineParser, text: str) -> List[int]:
    from .cli import parse_size
    out = []
    for part in text.split(","):
        try:
            out.append(parse_size(part, p.flag("sizes")))
        except ArgumentError as e:
            p.error(str(e))
    if sorted(out) != out or not out or out[0] < 4:
        p.error(f"{p.flag('sizes')} {text}: expected increasing sizes of at least one float32 "
                f"(4 B)")
    return out


def machine() -> Dict[str, Any]:
    """What the figures were measured on: cores, CPU model, memory, GPUs, versions."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        from ncclpy.launch.placement import visible_gpu_count
        gpus = visible_gpu_count()
    except Exception:  # noqa: BLE001 - informational
        gpus = 0
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = None
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "cpu": model or platform.processor() or platform.machine(),
            "memory_gib": round(mem / 2 ** 30, 1), "gpus": gpus,
            "python": platform.python_version(), "torch": tv, "platform": platform.platform()}


def _figures(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """(backend, size) rows of one sweep's JSON (every backend's: ``ncclpy.results``):
    out-of-place and in-place time, algbw, busbw, #wrong."""
    labels = {b["name"]: b["label"] for b in doc["ncclpy"]["backends"]}
    order = list(labels)
    out = []
    for r in doc["ncclpy"]["results"]:
        row = {"backend": labels.get(r["backend"], r["backend"]),
               "size": r["size"]}
        for side in ("out_of_place", "in_place"):
            s = r[side]
            row[side] = {"time_us": s["time"], "algbw_GBps": s["alg_bw"],
                         "busbw_GBps": s["bus_bw"], "wrong": s["nwrong"]}
        out.append(row)
    names = [labels[n] for n in order]
    return sorted(out, key=lambda r: (r["size"], names.index(r["backend"])
                                      if r["backend"] in names else len(names)))


def summary_lines(world: int, rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The summary table of one world size: out of place and in place (torch's out-of-place
    all_reduce is a copy and the in-place call: compare in place library to library)."""
    head = "# %10s  %-19s %10s %7s %7s %10s %7s %7s %6s"
    out = [f"# {world} processes: all_reduce float32 sum, time per call averaged over the "
           f"ranks (algbw, busbw in GB/s)",
           (head % ("", "", "out-of-place", "", "", "in-place", "", "", "")).rstrip(),
           head % ("size (B)", "backend", "time (us)", "algbw", "busbw", "time (us)", "algbw",
                   "busbw", "#wrong")]
    for r in rows:
        o, i = r["out_of_place"], r["in_place"]
        bad = [s["wrong"] for s in (o, i) if s["wrong"] is not None]
        wrong = "N/A" if not bad else f"{sum(bad):g}"
        out.append("  %10d  %-19s %10.1f %7.3f %7.3f %10.1f %7.3f %7.3f %6s" % (
            r["size"], r["backend"], o["time_us"], o["algbw_GBps"], o["busbw_GBps"],
            i["time_us"], i["algbw_GBps"], i["busbw_GBps"], wrong))
    return out


def _one_world(n: int, sizes: List[int], iters: int, warmup: int, path: str) -> tuple:
    """(exit status, the sweep's JSON document or None) of one run on ``n`` ranks, its
    nccl-tests JSON written to ``path``."""
    from .cli import _spawn_ranks, parse_args
    cfg = parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy,torch", "--nproc",
                      str(n), "-b", str(sizes[0]), "-e", str(sizes[-1]), "-n", str(iters), "-w",
                      str(warmup), "-J", path, "-q"], prog=PROG)
    cfg = dataclasses.replace(cfg, sizes=list(sizes))
    rc = _spawn_ranks(cfg, PROG)
    sys.stdout.flush()
    try:
        with open(path) as f:
            return rc, json.load(f)
    except (OSError, ValueError):
        return rc or 1, None


def _sweep_path(json_path: Optional[str], tmp: str, n: int) -> str:
    """Where the sweep of ``n`` ranks writes its nccl-tests JSON: beside ``-J FILE``
    (``FILE``'s stem + ``.n<N>.sweep.json``, kept), else a temporary file (removed)."""
    if not json_path:
        return os.path.join(tmp, f"n{n}.json")
    stem, k = os.path.splitext(json_path)[0], 0
    path = f"{stem}.n{n}.sweep.json"
    while os.path.exists(path):          # never over another run's file (nor read it back)
        k += 1
        path = f"{stem}.n{n}.sweep.{k}.json"
    return path


def _main(argv: List[str]) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    worlds = _ints(p, "nproc", a.nproc, 1)
    sizes = _sizes(p, a.sizes)
    for dest in ("iters", "warmup_iters"):
        if getattr(a, dest) < (1 if dest == "iters" else 0):
            p.error(f"{p.flag(dest)}: expected an integer >= "
                    f"{1 if dest == 'iters' else 0}, got {getattr(a, dest)}")
    if a.json:
        why = check_output_path(a.json)
        if why:
            p.error(f"{p.flag('json')}: {why}")
    m = machine()
    print(f"# {PROG}: ncclpy's CPU backend vs torch's gloo; CPU figures, not NCCL figures (no "
          f"NCCL, no GPU ran)")
    print(f"# machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
          f"{m['gpus']} GPU(s); Python {m['python']}, torch {m['torch']}")
    runs: Dict[str, Any] = {}
    rc = 0
    with tempfile.TemporaryDirectory(prefix="ncclpy-cpu-bench-") as tmp:
        for n in worlds:
            code, doc = _one_world(n, sizes, a.iters, a.warmup_iters, _sweep_path(a.json, tmp, n))
            rc = max(rc, code)
            if doc is None:
                print(f"{PROG}: the run on {n} ranks wrote no results", file=sys.stderr)
                continue
            rows = _figures(doc)
            runs[str(n)] = {"rows": rows, "cpu_backend": doc["ncclpy"].get("cpu_backend"),
                            "notes": doc["ncclpy"].get("notes"), "args": doc["args"]}
            print()
            for line in summary_lines(n, rows):
                print(line)
            print()
    if a.json:
        out = {"tool": PROG, "what": "all_reduce float32 sum, ncclpy CPU backend vs torch gloo",
               "figures": "CPU figures: ncclpy's CPU backend and torch's gloo; not NCCL, no GPU",
               "machine": m, "iters": a.iters, "warmup_iters": a.warmup_iters,
               "sizes": sizes, "runs": runs}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"# Writing JSON output to {a.json}")
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: :func:`_main` with Ctrl-C and a closed stdout handled."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_main(PROG, lambda: _main(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
