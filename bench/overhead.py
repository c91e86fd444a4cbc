"""``python -m bench.overhead``: host-side cost of one collective call for small messages.

What it measures: the wall time the calling thread spends inside one call, i.e. until the call
returns with the work enqueued on the stream, for 8 B ... 4 KiB messages, over many calls (the
queue is drained outside the timed region every ``--batch`` calls so it never fills up), on
ncclpy, raw CuPy (``cupy.cuda.nccl``, the floor) and torch.distributed.  Modes:

* ``eager``: the call itself;
* ``prepared`` (asked for with ``--modes``): ncclpy's prepared call (``comm.prepare(...)`` once,
  then ``p()`` per call, on the same stream and buffers); backends without prepared calls run
  their eager call here, so ``ncclpy_minus_cupy_us`` of this mode is ncclpy prepared minus raw
  CuPy;
* ``capture``: the same call while the stream is capturing a CUDA graph (what building a graph
  costs per call);
* ``graph``: replaying a captured one-call graph (``cudaGraphLaunch``), what a graph-based
  application pays per call instead of ``eager``.

Reported per (backend, size, mode): median, p10, p90, mean and min in µs over ``--calls`` calls,
and the derived numbers the targets are stated in (ncclpy − cupy, ncclpy − torch).  All ranks
make the same calls; rank 0's timings are reported.  Needs a GPU: on a machine without one it
says so and exits 2, unless ``--device cpu`` asks for torch/gloo's synchronous per-call time,
shown for reference only (gloo has no stream to enqueue on).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ncclpy.errors import ArgumentError

from bench import output
from bench.backends import get_backend
from bench.sweep import Coord, _make_store, _pick_device, _rendezvous, launched_world

__all__ = ["OverheadConfig", "parse_args", "main", "summarize", "run_rank", "prepare_args",
           "MODES"]

DEFAULT_SIZES = (8, 64, 512, 4096)
#: every mode; the default leaves out ``prepared`` (ask for it: ``--modes eager,prepared``)
MODES = ("eager", "prepared", "capture", "graph")


@dataclass
class OverheadConfig:
    """One overhead run; built by :func:`parse_args`, picklable for spawn."""

    collective: str = "all_reduce"
    sizes: List[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    calls: int = 2000
    warmup: int = 50
    batch: int = 50
    backends: List[str] = field(default_factory=lambda: ["ncclpy", "cupy", "torch"])
    modes: List[str] = field(default_factory=lambda: ["eager", "capture", "graph"])
    device: str = "cuda"
    nproc: Optional[int] = 2
    json: Optional[str] = None
    timeout: float = 300.0
    argv: List[str] = field(default_factory=list)


def summarize(ns: Sequence[int]) -> Dict[str, float]:
    """median / p10 / p90 / mean / min in µs of per-call nanoseconds."""
    a = np.asarray(ns, dtype=np.float64) / 1e3
    if not a.size:
        return {"median_us": 0.0, "p10_us": 0.0, "p90_us": 0.0, "mean_us": 0.0, "min_us": 0.0}
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"median_us": float(p50), "p10_us": float(p10), "p90_us": float(p90),
            "mean_us": float(a.mean()), "min_us": float(a.min())}


def _gpu_visible() -> bool:
    try:
        from ncclpy.launch.placement import visible_gpu_count
        return visible_gpu_count() > 0
    except Exception:  # pragma: no cover
        return False


def parse_args(argv: Optional[Sequence[str]] = None) -> OverheadConfig:
    """Parse ``python -m bench.overhead``'s command line (ArgumentError if invalid)."""
    from bench.cli import parse_backends, parse_size
    from ncclpy import registry
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    return _config(p, a, argv, parse_backends, parse_size, registry)


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench.overhead``'s parser (one-line usage errors, exit status 2)."""
    from ncclpy.cli_util import OneLineParser
    p = OneLineParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--collective", default="all_reduce", help="default all_reduce")
    p.add_argument("--sizes", default="8,64,512,4K", help="comma-separated sizes (default "
                   "8,64,512,4K; K = 1024)")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per case (default 2000)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls first (default 50)")
    p.add_argument("--batch", type=int, default=50,
                   help="drain the stream every this many calls, outside the timing (default 50)")
    p.add_argument("--backend", default="ncclpy,cupy,torch", help="default ncclpy,cupy,torch")
    p.add_argument("--modes", default="eager,capture,graph",
                   help="of eager, prepared, capture, graph (default eager,capture,graph)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="cpu: torch/gloo synchronous call time, for reference only")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default 2 unless run under a launcher)")
    p.add_argument("-J", "--json", default=None, metavar="FILE", help="write results as JSON")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the other ranks at set-up (default 300)")
    return p


def _config(p: argparse.ArgumentParser, a: argparse.Namespace, argv: List[str],
            parse_backends: Any, parse_size: Any, registry: Any) -> OverheadConfig:
    coll = registry.get(a.collective)
    if not coll.data:
        raise ArgumentError(f"--collective: {coll.name} moves no data")
    sizes = [parse_size(s, "--sizes") for s in a.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ArgumentError(f"--modes: expected {', '.join(MODES)}; got {', '.join(bad)}")
    for name, v in (("--calls", a.calls), ("--batch", a.batch)):
        if v < 1:
            raise ArgumentError(f"{name}: expected >= 1, got {v}")
    device = a.device
    if device == "auto":
        device = "cuda" if _gpu_visible() else "none"
    backends = parse_backends(a.backend)
    if device == "cpu":
        backends, modes = ["torch"], ["eager"]
    nproc = a.nproc if a.nproc is not None else (None if launched_world() else 2)
    return OverheadConfig(collective=coll.name, sizes=sizes, calls=a.calls, warmup=a.warmup,
                          batch=a.batch, backends=backends, modes=modes, device=device,
                          nproc=nproc, json=a.json, timeout=a.timeout,
                          argv=["python -m bench.overhead", *argv])


def _time_calls(b, fn, calls: int, batch: int) -> List[int]:
    out: List[int] = []
    clock = time.perf_counter_ns
    while len(out) < calls:
        b.sync()
        for _ in range(min(batch, calls - len(out))):
            t0 = clock()
            fn()
            out.append(clock() - t0)
    b.sync()
    return out


def run_rank(cfg: OverheadConfig) -> Dict[str, object]:
    """Measure on this rank; returns the JSON document (meaningful on rank 0)."""
    from ncclpy.dtypes import DTYPES
    rank, world, local_rank, ldev, info = _rendezvous()
    store = _make_store(info, cfg.timeout)
    coord = Coord(store, rank, world, cfg.timeout)
    device = _pick_device(cfg.device, local_rank, ldev)
    results: List[Dict[str, object]] = []
    backends = []
    try:
        for name in cfg.backends:
            b = get_backend(name)
            b.setup(rank, world, device, store,
                    master_addr=info.master_addr if info is not None else "127.0.0.1",
                    timeout=cfg.timeout)
            backends.append(b)
        item = DTYPES["float32"].itemsize
        for size in cfg.sizes:
            for b in backends:
                bufs = b.alloc(cfg.collective, max(size // item, 1), "float32")
                root = 0

                def call(b=b, bufs=bufs) -> None:
                    b.run(cfg.collective, bufs, "sum", root, True)
                for _ in range(cfg.warmup):
                    call()
                b.sync()
                for mode in cfg.modes:
                    coord.barrier()
                    if mode == "eager":
                        ns = _time_calls(b, call, cfg.calls, cfg.batch)
                    elif mode == "prepared":
                        p = _prepared(b, cfg.collective, bufs, root) or call
                        for _ in range(cfg.warmup):
                            p()
                        ns = _time_calls(b, p, cfg.calls, cfg.batch)
                    elif mode == "capture":
                        ns = []
                        while len(ns) < cfg.calls:
                            k = min(cfg.batch, cfg.calls - len(ns))
                            clock, got = time.perf_counter_ns, []

                            def timed(got=got, k=k, clock=clock) -> None:
                                for _ in range(k):
                                    t0 = clock()
                                    call()
                                    got.append(clock() - t0)
                            g = b.capture(timed)
                            b.replay(g)  # keep every rank's NCCL sequence matched
                            b.sync()
                            b.release(g)
                            del g        # a live graph makes NCCL's comm destroy wait forever
                            ns += got
                    else:
                        g = b.capture(call)
                        for _ in range(cfg.warmup):
                            b.replay(g)
                        ns = _time_calls(b, lambda g=g, b=b: b.replay(g), cfg.calls, cfg.batch)
                        b.release(g)
                        del g            # (as above: NCCL waits for its graphs at teardown)
                    s = summarize(ns)
                    results.append({"backend": b.name, "label": b.label,
                                    "collective": cfg.collective, "size": size, "mode": mode,
                                    "calls": len(ns), **s})
                    if rank == 0:
                        print(f"{b.label:>12s} {mode:>8s} {size:>8d} B  median "
                              f"{s['median_us']:8.2f} us  p10 {s['p10_us']:8.2f}  p90 "
                              f"{s['p90_us']:8.2f}", flush=True)
                del bufs
        doc = {"start_time": output.now(), "args": cfg.argv, "world_size": world,
               "device": cfg.device,
               "device_info": backends[0].device_info() if backends else {},
               "versions": _versions(backends), "calls": cfg.calls, "batch": cfg.batch,
               "results": results, "derived": derive(results)}
        coord.barrier()
        return doc
    finally:
        for b in reversed(backends):
            try:
                b.teardown()
            except Exception as e:  # pragma: no cover
                print(f"[bench.overhead] {b.label} teardown: {e}", file=sys.stderr)
        store.close()


def prepare_args(collective: str, s: Any, r: Any, root: int, rank: int, world: int,
                 op: str = "sum") -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``comm.prepare(collective, *args, **kwargs)``'s arguments for the call the ncclpy
    backend makes eagerly (``NcclpyBackend.run``) on send/recv sides ``s``, ``r``."""
    if collective in ("all_reduce", "reduce_scatter"):
        return (s, r), {"op": op}
    if collective == "reduce":
        return (s, r), {"root": root, "op": op}
    if collective in ("broadcast", "gather", "scatter"):
        return (s, r), {"root": root}
    if collective in ("all_gather", "all_to_all"):
        return (s, r), {}
    if collective == "send_recv":
        return (s, r, (rank + 1) % world, (rank - 1) % world), {}
    raise ValueError(f"collective {collective!r} is not benchmarked")


def _prepared(b: Any, collective: str, bufs: Any, root: int) -> Optional[Callable[[], Any]]:
    """The ncclpy backend's call prepared once (in place, on its stream); None for a backend
    without prepared calls."""
    if b.name != "ncclpy":
        return None
    from bench.backends.ncclpy import call_args
    s, r = call_args(collective, bufs.extra["args"], True, b.rank, root)
    args, kwargs = prepare_args(collective, s, r, root, b.rank, b.world)
    return b.comm.prepare(collective, *args, stream=b.stream, **kwargs)


def derive(results: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per (size, mode): ncclpy's median minus cupy's and minus torch's (µs)."""
    med = {(r["backend"], r["size"], r["mode"]): r["median_us"] for r in results}
    out = []
    for (bk, size, mode), v in sorted(med.items(), key=lambda x: (x[0][1], x[0][2])):
        if bk != "ncclpy":
            continue
        row = {"size": size, "mode": mode, "ncclpy_median_us": v}
        for other in ("cupy", "torch"):
            if (other, size, mode) in med:
                row[f"ncclpy_minus_{other}_us"] = v - med[(other, size, mode)]
        out.append(row)
    return out


def _versions(backends) -> Dict[str, object]:
    v: Dict[str, object] = {"python": platform.python_version()}
    for mod in ("ncclpy", "cupy", "torch", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    v["nccl"] = {b.name: b.nccl_version() for b in backends}
    return v


def _spawned(rank: int, cfg: OverheadConfig) -> None:
    doc = run_rank(cfg)
    if rank == 0 and cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"# Writing JSON output to {cfg.json}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: 0 on success, 2 on a bad command line or without a GPU, 1 on failure;
    Ctrl-C 130, a closed output pipe 141."""
    from ncclpy.cli_util import run_main
    return run_main("python -m bench.overhead", lambda: _main(argv))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
    except ArgumentError as e:
        print(f"python -m bench.overhead: error: {e} (see 'python -m bench.overhead -h')",
              file=sys.stderr)
        return 2
    if cfg.device == "none":
        print("python -m bench.overhead: needs a CUDA GPU: it measures the host-side cost of "
              "enqueuing NCCL calls on a stream, and no GPU is visible here. Nothing was "
              "measured. (--device cpu shows torch/gloo's synchronous per-call time, for "
              "reference only.)", file=sys.stderr)
        return 2
    if cfg.device == "cpu":
        print("# torch/gloo on cpu: synchronous per-call time (the whole collective), for "
              "reference only; not comparable with GPU enqueue overheads", flush=True)
    try:
        if cfg.nproc and cfg.nproc > 1 and not launched_world():
            from ncclpy.launch.spawn import spawn
            spawn(_spawned, cfg.nproc, args=(cfg,))
        else:
            _spawned(0 if not launched_world() else _rank_env(), cfg)
    except Exception as e:
        print(f"python -m bench.overhead: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _rank_env() -> int:
    from ncclpy.rendezvous import resolve
    return resolve().rank


if __name__ == "__main__":
    sys.exit(main())
