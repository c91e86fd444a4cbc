"""``python -m bench.overhead``: host-side cost of one collective call for small messages.

What it measures: the wall time the calling thread spends inside one call, until the call
returns with the work enqueued on the stream, for 8 B ... 4 KiB all_reduce (float32, in place),
2 ranks (on one GPU where there is one), rank 0's figures.  The stream is drained every
``--batch`` calls outside the timed region, so the launch queue never fills.

Backends (``--backends``, default all but nccl4py, which joins them when it is installed):

* ``ncclpy``: ncclpy with its defaults, as ``ncclpy.init`` runs it: the watchdog on (heartbeats
  on the rendezvous store, which rank 0 hosts) and the flight recorder on;
* ``ncclpy-bare``: ncclpy with both off (no watchdog, ``NCCLPY_TRACE_BUFFER=0``);
* ``cupy``: the same NCCL call on ``cupy.cuda.nccl`` directly, the floor;
* ``torch``: torch.distributed (ProcessGroupNCCL);
* ``nccl4py``: NVIDIA's own binding (optional: ``pip install nccl4py==0.6.0``, or offline
  ``bash bench/install_wheels.sh``); all_reduce only.

Same stream and same memory for all: one non-blocking CuPy stream per rank whose raw handle
(an int) ncclpy, ncclpy-bare, cupy and nccl4py are given, and which torch gets as its current
stream (``torch.cuda.ExternalStream``: torch takes no stream argument); one set of CuPy buffers
per size (torch: zero-copy tensors over them).  The backends take turns: ``--calls`` timed calls
per case are split over ``--repeats`` rounds, each round runs every backend in turn (the order
rotated each round), after ``--warmup`` untimed calls per backend; medians are over every call
of every round.

Modes (``--modes``):

* ``eager``: the call itself;
* ``prepared``: ncclpy's prepared call (``comm.prepare(...)`` once, ``p()`` per call) for both
  ncclpy flavours; the other backends have none and run their eager call;
* ``graph``: replaying a captured one-call graph, a barrier among the ranks (untimed) before
  each replay; every backend replays the same kind of graph, so no ncclpy − cupy is derived;
* ``capture``: the call while the stream captures a graph: a one-off cost of building a
  graph, shown in its own section and not compared with the eager target.

Derived (per call modes only): each ncclpy flavour's median minus cupy's, torch's and
nccl4py's.  Needs a GPU: without one it says so and exits 2, unless ``--device cpu`` asks for
torch/gloo's synchronous per-call time, for reference only (gloo has no stream to enqueue on).
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ncclpy.errors import ArgumentError

from . import output
from .backends import OVERHEAD_BACKEND_MODULES, get_backend
from .overhead_report import (BUFFER_NOTE, MODES, SECTIONS, STREAM_NOTE, VARIANTS, derive,
                                   render, rotation, split_calls, summarize)
from .sweep import Coord, _make_store, _pick_device, _rendezvous, launched_world

__all__ = ["OverheadConfig", "parse_args", "main", "summarize", "run_rank", "prepare_args",
           "MODES", "BACKENDS", "DEFAULT_BACKENDS", "parse_backends", "derive", "build_parser"]

DEFAULT_SIZES = (8, 64, 512, 4096)
#: every backend, in the order they run
BACKENDS = tuple(OVERHEAD_BACKEND_MODULES)
#: the default backends (nccl4py joins them where it is installed)
DEFAULT_BACKENDS = ("ncclpy", "ncclpy-bare", "cupy", "torch")
_ALIASES = {"cupy_raw": "cupy", "torch_dist": "torch", "ncclpy_bare": "ncclpy-bare"}


@dataclass
class OverheadConfig:
    """One overhead run; built by :func:`parse_args`, picklable for spawn."""

    collective: str = "all_reduce"
    sizes: List[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    calls: int = 2000
    graph_calls: int = 200
    repeats: int = 5
    warmup: int = 100
    batch: int = 50
    backends: List[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    modes: List[str] = field(default_factory=lambda: list(MODES))
    device: str = "cuda"
    nproc: Optional[int] = 2
    json: Optional[str] = None
    timeout: float = 300.0
    argv: List[str] = field(default_factory=list)
    #: what the run says about itself (e.g. nccl4py left out because it is not installed)
    notes: List[str] = field(default_factory=list)
    #: also time each step of ncclpy's eager call (bench.breakdown), on the first size
    breakdown: bool = False


def _gpu_visible() -> bool:
    try:
        from ncclpy.launch.placement import visible_gpu_count
        return visible_gpu_count() > 0
    except Exception:  # pragma: no cover
        return False


def parse_args(argv: Optional[Sequence[str]] = None) -> OverheadConfig:
    """Parse ``python -m bench.overhead``'s command line (ArgumentError if invalid)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    return _config(p, a, argv)


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench.overhead``'s parser (one-line usage errors, exit status 2)."""
    from ncclpy.cli_util import OneLineParser
    p = OneLineParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--collective", default="all_reduce", help="default all_reduce")
    p.add_argument("--sizes", default="8,64,512,4K", help="comma-separated sizes (default "
                   "8,64,512,4K; K = 1024)")
    p.add_argument("--calls", type=int, default=2000,
                   help="timed calls per backend, size and per-call mode (default 2000)")
    p.add_argument("--graph-calls", type=int, default=200,
                   help="timed calls per backend and size in the graph and capture modes "
                        "(default 200)")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds the calls are split over, each running every backend in turn "
                        "(default 5)")
    p.add_argument("--warmup", type=int, default=100,
                   help="untimed calls per backend, size and mode first (default 100)")
    p.add_argument("--batch", type=int, default=50,
                   help="drain the stream every this many calls, outside the timing (default 50)")
    p.add_argument("--backends", "--backend", dest="backends", default=None,
                   help=f"comma-separated, of {', '.join(BACKENDS)} (default "
                        f"{','.join(DEFAULT_BACKENDS)}, and nccl4py where it is installed)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"of {', '.join(MODES)} (default all)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="cpu: torch/gloo synchronous call time, for reference only")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default 2 unless run under a launcher)")
    p.add_argument("-J", "--json", default=None, metavar="FILE", help="write results as JSON")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each step of ncclpy's eager all_reduce (resolve, lock and "
                        "marker, recorder, NCCL call, event record, Work): bench.breakdown")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the other ranks at set-up (default 300)")
    return p


def parse_backends(text: Optional[str], flag: str = "--backends",
                   collective: str = "all_reduce") -> Tuple[List[str], List[str]]:
    """(backends, notes) from ``--backends`` (None: the default list, with nccl4py where it is
    installed and times ``collective``).  An unknown name, or nccl4py asked for where it is not
    installed or cannot time ``collective``, raises a one-line ArgumentError."""
    from .backends import nccl4py
    notes: List[str] = []
    if text is None:
        out = list(DEFAULT_BACKENDS)
        why = nccl4py.missing()
        if why is None and collective in nccl4py.COLLECTIVES:
            out.append("nccl4py")
        elif why is not None:
            notes.append(f"nccl4py: not installed here ({why}), left out; "
                         f"{nccl4py.INSTALL_HINT}")
        return out, notes
    out = []
    for part in text.split(","):
        key = _ALIASES.get(part.strip().lower(), part.strip().lower())
        if key not in BACKENDS:
            raise ArgumentError(f"{flag}: expected a comma-separated list of "
                                f"{', '.join(BACKENDS)}; got {part.strip()!r}")
        if key not in out:
            out.append(key)
    if "nccl4py" in out:
        why = nccl4py.missing()
        if why is not None:
            raise ArgumentError(f"{flag}: nccl4py is not installed here ({why}); "
                                f"{nccl4py.INSTALL_HINT}")
        if collective not in nccl4py.COLLECTIVES:
            raise ArgumentError(f"{flag}: nccl4py times {', '.join(nccl4py.COLLECTIVES)} only; "
                                f"got --collective {collective}")
    return out, notes


def _config(p: Any, a: argparse.Namespace, argv: List[str]) -> OverheadConfig:
    from .cli import parse_size
    from ncclpy.semantics import registry
    coll = registry.get(a.collective)
    if not coll.data:
        raise ArgumentError(f"--collective: {coll.name} moves no data")
    sizes = [parse_size(s, "--sizes") for s in a.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ArgumentError(f"--modes: expected a comma-separated list of {', '.join(MODES)}; "
                            f"got {a.modes!r}")
    modes = [m for m in MODES if m in modes]
    for dest, v, lo in (("calls", a.calls, 1), ("graph_calls", a.graph_calls, 1),
                        ("repeats", a.repeats, 1), ("batch", a.batch, 1), ("warmup", a.warmup, 0)):
        if v < lo:
            raise ArgumentError(f"{p.flag(dest)}: expected >= {lo}, got {v}")
    if a.json:
        from ncclpy.cli_util import check_output_path
        why = check_output_path(a.json)
        if why:
            raise ArgumentError(f"{p.flag('json')}: {why}")
    device = a.device
    if device == "auto":
        device = "cuda" if _gpu_visible() else "none"
    if device == "cpu":
        backends, modes, notes = ["torch"], ["eager"], []
    else:
        backends, notes = parse_backends(a.backends, p.flag("backends"), coll.name)
    if a.breakdown and (device != "cuda" or coll.name != "all_reduce" or
                        not any(b.startswith("ncclpy") for b in backends)):
        raise ArgumentError(f"{p.flag('breakdown')}: times the steps of ncclpy's eager "
                            f"all_reduce on a GPU: needs --collective all_reduce, a GPU "
                            f"(--device cuda) and an ncclpy backend; got --collective "
                            f"{coll.name}, --device {device}, --backends {','.join(backends)}")
    nproc = a.nproc if a.nproc is not None else (None if launched_world() else 2)
    return OverheadConfig(collective=coll.name, sizes=sizes, calls=a.calls,
                          graph_calls=a.graph_calls, repeats=a.repeats, warmup=a.warmup,
                          batch=a.batch, backends=backends, modes=modes, device=device,
                          nproc=nproc, json=a.json, timeout=a.timeout,
                          argv=["python -m bench.overhead", *argv], notes=notes,
                          breakdown=bool(a.breakdown))


def _time_calls(b: Any, fn: Callable[[], Any], calls: int, batch: int,
                before: Optional[Callable[[], None]] = None) -> List[int]:
    """``calls`` timed calls of ``fn`` (ns each), the stream drained every ``batch`` outside
    the timing; ``before`` (untimed) runs before each call."""
    out: List[int] = []
    clock = time.perf_counter_ns
    while len(out) < calls:
        b.sync()
        for _ in range(min(batch, calls - len(out))):
            if before is not None:
                before()
            t0 = clock()
            fn()
            out.append(clock() - t0)
    b.sync()
    return out


def _shared(device: Optional[int]) -> Any:
    """The stream and buffer maker every backend shares (None on the CPU)."""
    if device is None:
        return None
    from .backends._cuda import SharedCuda
    return SharedCuda(device)


def _row(b: Any, cfg: OverheadConfig, size: int, mode: str, ns: List[int],
         rounds: List[List[int]]) -> Dict[str, Any]:
    return {"backend": b.name, "label": b.label, "collective": cfg.collective, "size": size,
            "mode": mode, "section": SECTIONS[mode], "calls": len(ns), "rounds": len(rounds),
            "round_medians_us": [summarize(r)["median_us"] for r in rounds], **summarize(ns)}


def _turns(cfg: OverheadConfig, coord: Any, backends: List[Any], mode: str, size: int,
           bufs: Dict[str, Any], calls: Dict[str, Callable[[], None]],
           say: Callable[[str], None]) -> List[Dict[str, Any]]:
    """One per-call or graph mode at one size: every backend, round robin."""
    fns: Dict[str, Callable[[], Any]] = {}
    graphs: List[Tuple[Any, Any]] = []
    try:
        for b in backends:
            if mode == "graph":
                graphs.append((b, b.capture(calls[b.name])))
                fns[b.name] = functools.partial(b.replay, graphs[-1][1])
            elif mode == "prepared":
                fns[b.name] = _prepared(b, cfg.collective, bufs[b.name], 0) or calls[b.name]
            else:
                fns[b.name] = calls[b.name]      # warmed up with the size already
                continue
            for _ in range(cfg.warmup):
                fns[b.name]()
            b.sync()
        before = coord.barrier if mode == "graph" else None
        n = cfg.graph_calls if mode == "graph" else cfg.calls
        rounds: Dict[str, List[List[int]]] = {b.name: [] for b in backends}
        for r, k in enumerate(split_calls(n, cfg.repeats)):
            for b in rotation(backends, r):
                coord.barrier()
                rounds[b.name].append(_time_calls(b, fns[b.name], k, cfg.batch, before))
    finally:
        fns.clear()
        for b, g in graphs:
            b.release(g)
        graphs.clear()               # a live graph makes NCCL's comm destroy wait forever
    rows = []
    for b in backends:
        ns = [t for part in rounds[b.name] for t in part]
        rows.append(_row(b, cfg, size, mode, ns, rounds[b.name]))
        s = rows[-1]
        say(f"{b.label:>12s} {mode:>8s} {size:>8d} B  median {s['median_us']:8.2f} us  "
            f"p10 {s['p10_us']:8.2f}  p90 {s['p90_us']:8.2f}")
    return rows


def _capture(cfg: OverheadConfig, coord: Any, b: Any, size: int, call: Callable[[], None],
             say: Callable[[str], None]) -> Dict[str, Any]:
    """The one-off section: ``--graph-calls`` calls timed while the stream captures, in
    graphs of ``--batch`` calls each replayed once (every rank's NCCL sequence matched) and
    released at once."""
    coord.barrier()
    ns: List[int] = []
    while len(ns) < cfg.graph_calls:
        k = min(cfg.batch, cfg.graph_calls - len(ns))
        clock, got = time.perf_counter_ns, []

        def timed(got: List[int] = got, k: int = k) -> None:
            for _ in range(k):
                t0 = clock()
                call()
                got.append(clock() - t0)
        g = b.capture(timed)
        b.replay(g)
        b.sync()
        b.release(g)
        del g                        # (as above: NCCL waits for its graphs at teardown)
        ns += got
    row = _row(b, cfg, size, "capture", ns, [ns])
    say(f"{b.label:>12s}  capture {size:>8d} B  median {row['median_us']:8.2f} us (one-off)")
    return row


def run_rank(cfg: OverheadConfig) -> Dict[str, object]:
    """Measure on this rank; returns the JSON document (meaningful on rank 0)."""
    rank, world, local_rank, ldev, info = _rendezvous()
    store = _make_store(info, cfg.timeout)
    coord = Coord(store, rank, world, cfg.timeout)
    device = _pick_device(cfg.device, local_rank, ldev)
    say: Callable[[str], None] = (lambda m: print(m, flush=True)) if rank == 0 else \
        (lambda m: None)
    results: List[Dict[str, Any]] = []
    backends: List[Any] = []
    steps: Dict[str, Any] = {}
    try:
        shared = _shared(device)
        for name in cfg.backends:
            b = get_backend(name, OVERHEAD_BACKEND_MODULES)
            b.setup(rank, world, device, store,
                    master_addr=info.master_addr if info is not None else "127.0.0.1",
                    timeout=cfg.timeout)
            backends.append(b)
            if shared is not None:
                b.use_stream(shared.stream)
        for size in cfg.sizes:
            total = max(size // 4, 1)                    # float32 elements
            if shared is not None:
                base = shared.alloc(cfg.collective, total, "float32", world, rank)
                bufs = {b.name: b.adopt(base) for b in backends}
            else:
                bufs = {b.name: b.alloc(cfg.collective, total, "float32") for b in backends}
            calls = {b.name: functools.partial(b.run, cfg.collective, bufs[b.name], "sum", 0,
                                               True) for b in backends}
            for b in backends:              # every mode starts from a warm eager call (and NCCL
                for _ in range(max(cfg.warmup, 1)):      # has connected before any capture)
                    calls[b.name]()
                b.sync()
            for mode in cfg.modes:
                if mode == "capture":
                    results += [_capture(cfg, coord, b, size, calls[b.name], say)
                                for b in backends]
                else:
                    results += _turns(cfg, coord, backends, mode, size, bufs, calls, say)
            if cfg.breakdown and size == cfg.sizes[0]:
                steps.update(_breakdown(cfg, coord, backends, bufs, rank))
            del bufs, calls
        doc = _document(cfg, world, backends, results)
        if steps:
            doc["breakdown"] = {"size": cfg.sizes[0], "by_backend": steps}
            if rank == 0:
                from .breakdown import table as steps_table
                for name, bd in steps.items():
                    print(f"# {name} ({cfg.sizes[0]} B)\n" + steps_table(bd), flush=True)
        coord.barrier()
        if rank == 0:
            print(render(doc), flush=True)
        return doc
    finally:
        for b in reversed(backends):
            try:
                b.teardown()
            except Exception as e:  # pragma: no cover
                print(f"[bench.overhead] {b.label} teardown: {e}", file=sys.stderr)
        store.close()


def _breakdown(cfg: OverheadConfig, coord: Any, backends: List[Any], bufs: Dict[str, Any],
               rank: int) -> Dict[str, Any]:
    """``--breakdown``: each ncclpy backend's eager all_reduce timed step by step
    (bench.breakdown), on every rank alike (its steps make matching NCCL calls)."""
    from .backends.ncclpy import call_args
    from .breakdown import time_steps
    out = {}
    for b in backends:
        if not b.name.startswith("ncclpy"):
            continue
        b.sync()
        coord.barrier()
        x = call_args("all_reduce", bufs[b.name].extra["args"], True, rank, 0)[0]
        out[b.name] = time_steps(b.comm, x, b.stream_arg, max(cfg.repeats * 4, 10), cfg.batch)
        b.sync()
        coord.barrier()
    return out


def _document(cfg: OverheadConfig, world: int, backends: List[Any],
              results: List[Dict[str, Any]]) -> Dict[str, Any]:
    cuda = cfg.device == "cuda"
    return {"schema": "ncclpy-overhead/2", "start_time": output.now(), "args": cfg.argv,
            "collective": cfg.collective, "world_size": world, "device": cfg.device,
            "device_info": backends[0].device_info() if backends else {},
            "versions": _versions(backends), "calls": cfg.calls, "graph_calls": cfg.graph_calls,
            "batch": cfg.batch,
            "method": {"rounds": cfg.repeats, "warmup": cfg.warmup,
                       "order": "each round runs every backend in turn, rotated each round",
                       "stream": STREAM_NOTE if cuda else "none (gloo runs on the CPU)",
                       "buffers": BUFFER_NOTE if cuda else "torch's own CPU tensors"},
            "backends": [{"name": b.name, "label": b.label, "defaults": b.defaults,
                          "stream_form": b.stream_form if cuda else "none",
                          "settings": b.settings()} for b in backends],
            "notes": list(cfg.notes), "results": results, "derived": derive(results)}


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
    """An ncclpy flavour's call prepared once (in place, on its stream); None for a backend
    without prepared calls."""
    if b.name not in VARIANTS:
        return None
    from .backends.ncclpy import call_args
    s, r = call_args(collective, bufs.extra["args"], True, b.rank, root)
    args, kwargs = prepare_args(collective, s, r, root, b.rank, b.world)
    return b.comm.prepare(collective, *args, stream=b.stream_arg, **kwargs)


def _versions(backends: List[Any]) -> Dict[str, object]:
    v: Dict[str, object] = {"python": platform.python_version()}
    for mod in ("ncclpy", "cupy", "torch", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    if any(b.name == "nccl4py" for b in backends):
        from .backends.nccl4py import version_info
        v["nccl4py"] = version_info()
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
    for note in cfg.notes:
        print(f"# {note}", flush=True)
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
