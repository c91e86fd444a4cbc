"""``python -m bench.host_overhead``: the host time of a whole ncclpy call, on a CPU.

Runs on a CPU machine (no GPU, no driver, no libnccl), but needs CuPy (the CUDA extra: ``pip
install -e ".[cu13]"``) for its input, a real ``cupy.ndarray`` (over host memory it never
touches); without CuPy it says so in one line and exits 2.

What is timed, in one process and one run, for an in-place ``all_reduce`` (op sum) of 2
float32 (8 bytes) on rank 0 of 2: the complete ``comm.all_reduce(x, ...)`` of a real
:class:`ncclpy.Communicator` standing on the null boundary (:mod:`bench.null_boundary`: every
CUDA and NCCL call a no-op), against the **floor**: the same loop calling the no-op the way a
raw CuPy user calls ``NcclCommunicator.allReduce(x.data.ptr, x.data.ptr, x.size, dtype, op,
stream)``.  The paths (each a loop of ``--batch`` calls; a sample is its mean per call):

* ``eager``: ``comm.all_reduce(x, stream=h)`` with ncclpy's **defaults**: the flight recorder
  on and the watchdog thread on (heartbeats to a real store this process hosts, as rank 0 does
  under ``ncclpy.init``), its Works released by the watchdog's thread;
* ``eager_none``: the same with ``stream=None`` (CuPy's current stream, looked up per call);
* ``eager_bare``: ``comm.all_reduce(x, stream=h)`` with the watchdog and recorder off (its
  Works released by the process's reaper thread);
* ``prepared``, ``prepared_bare``: ``p()`` of ``comm.prepare("all_reduce", x, stream=h)``,
  with the defaults and without.

Everything the call does is in the figure: the background threads' work (they share the GIL
with the caller), the garbage collector, the pool of events.  Paths interleave round by round
after a warm-up; medians over ``--repeats`` samples; each path's median minus the floor's is
its overhead -- the median of the per-round differences, each path's sample minus the floor's
of the same round (a machine whose speed drifts slows both alike) -- checked against the
targets (eager ≤ 1.0 µs, prepared ≤ 0.4 µs over the floor).

The second figure predicts the GPU: an untimed pass counts the CUDA runtime calls each path
makes on the caller's thread, and each count is priced with the per-call costs measured on a
GPU (``bench/cuda_costs.json``, written by ``python -m bench.cuda_costs --json`` on a GPU
machine); without that file it says so and gives no prediction.  ``--breakdown`` times each
step of the eager call on its own (:mod:`bench.breakdown`).  ``--json PATH`` writes it all.
Exit 0; 1 when a path did not make the expected NCCL call; 2 on a usage error or no CuPy.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as ``python bench/host_overhead.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench  # noqa: F401,E402  (PEP 366: the package its relative imports name)
    __package__ = "bench"

__all__ = ["main", "build_parser", "measure", "stats", "table", "predict", "load_costs",
           "PATHS", "TARGETS", "COSTS_FILE", "COST_KEYS"]

PATHS = ("eager", "eager_none", "eager_bare", "prepared", "prepared_bare")
#: ns over the floor's median
TARGETS = {"eager": 1000.0, "prepared": 400.0}
COUNT = 2
COSTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_costs.json")
#: the boundary's calls (bench.null_boundary.CUDA_CALLS) -> bench.cuda_costs' names
COST_KEYS = {"get_device": "cudaGetDevice", "set_device": "cudaSetDevice",
             "stream_is_capturing": "cudaStreamIsCapturing",
             "capture_status": "cudaStreamIsCapturing",
             "event_create": "cudaEventCreateWithFlags", "event_record": "cudaEventRecord",
             "event_query": "cudaEventQuery", "event_destroy": "cudaEventDestroy",
             "exchange_capture_mode": "cuThreadExchangeStreamCaptureMode",
             "current_stream": "cupy.get_current_stream(dev).ptr"}
_PROG = "python -m bench.host_overhead"
_clock = time.perf_counter_ns


def stats(samples: Sequence[float]) -> Dict[str, float]:
    """min, median, p90 of per-call ns samples."""
    xs = sorted(samples)
    n = len(xs)
    return {"min_ns": xs[0], "median_ns": (xs[(n - 1) // 2] + xs[n // 2]) / 2,
            "p90_ns": xs[min(n - 1, int(0.9 * n))]}


def _array(cupy: Any) -> Any:  # -> (array, the host memory it stands on)
    """A real cupy.ndarray of COUNT float32 over host memory (never dereferenced)."""
    import numpy as np
    host = np.zeros(COUNT, np.float32)
    mem = cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, 0)
    arr = cupy.ndarray((COUNT,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    return arr, host


def _samplers(comms: Dict[str, Any], x: Any, nccl: Any, batch: int,
              stream: int) -> Dict[str, Callable[[], float]]:
    from ncclpy.semantics.dtypes import DTYPES
    dt, op = DTYPES["float32"].nccl, 0
    out: Dict[str, Callable[[], float]] = {}

    def floor() -> float:
        ar = nccl.allReduce
        t0 = _clock()
        for _ in range(batch):
            ar(x.data.ptr, x.data.ptr, x.size, dt, op, stream)
        return (_clock() - t0) / batch
    out["floor"] = floor

    def eager(ar: Any, s: Any) -> Callable[[], float]:
        def sample() -> float:
            t0 = _clock()
            for _ in range(batch):
                ar(x, stream=s)
            return (_clock() - t0) / batch
        return sample

    def prepared(p: Any) -> Callable[[], float]:
        def sample() -> float:
            t0 = _clock()
            for _ in range(batch):
                p()
            return (_clock() - t0) / batch
        return sample
    d, b = comms["defaults"], comms["bare"]
    out["eager"] = eager(d.all_reduce, stream)
    out["eager_none"] = eager(d.all_reduce, None)
    out["eager_bare"] = eager(b.all_reduce, stream)
    out["prepared"] = prepared(d.prepare("all_reduce", x, stream=stream))
    out["prepared_bare"] = prepared(b.prepare("all_reduce", x, stream=stream))
    return out


def _check_call(comm: Any, x: Any, stream: int) -> None:
    """The eager call resolves to exactly ncclAllReduce(x, x, 2, float32, sum) on ``stream``."""
    r = comm._resolver.resolve("all_reduce", stream, x, None, ("sum",))
    ptr = int(x.data.ptr)
    want = (("AllReduce", (ptr, ptr, COUNT, 7, 0)),)
    if r.calls != want or r.stream != stream:
        raise AssertionError(f"all_reduce resolved to {r.calls!r} on {r.stream:#x}, expected "
                             f"{want!r} on {stream:#x}")


def _count(paths: Dict[str, Callable[[], float]], make_cuda: Callable[[], Any],
           batch: int) -> Dict[str, Dict[str, float]]:
    """The CUDA calls per call of each path, on the caller's thread (an untimed pass)."""
    from ncclpy._nccl import cuda as cudamod
    from .null_boundary import counts_per_call
    out = {}
    me = threading.get_ident()
    for name, fn in paths.items():
        time.sleep(0.3)                 # the trackers release what is in flight
        cu = make_cuda()
        counts = cu.counting(lambda: threading.get_ident() == me)
        with cudamod.use(cu):
            fn()                        # one batch after the warm-up: the steady state
        out[name] = counts_per_call(counts, batch)
    return out


def load_costs(path: str = COSTS_FILE) -> Optional[Dict[str, Any]]:
    """The GPU-measured per-call costs (bench.cuda_costs' JSON), or None without the file."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return None
    if doc.get("schema") != "ncclpy-cuda-costs/1" or not isinstance(doc.get("costs_ns"), dict):
        raise ValueError(f"{path}: not a bench.cuda_costs result (schema "
                         f"{doc.get('schema')!r})")
    return doc


def predict(over_ns: float, counts: Dict[str, float], costs: Dict[str, Any]) -> Dict[str, Any]:
    """``over_ns`` plus each counted CUDA call priced at its GPU-measured cost."""
    add, priced, missing = 0.0, {}, []
    for call, n in counts.items():
        key = COST_KEYS.get(call)
        c = costs["costs_ns"].get(key) if key else None
        if c is None:
            missing.append(call)
            continue
        priced[call] = round(n * float(c), 1)
        add += n * float(c)
    return {"predicted_ns": round(over_ns + add, 1), "cuda_ns": round(add, 1),
            "priced": priced, "unpriced": missing}


def measure(repeats: int = 40, batch: int = 2000, breakdown: bool = False,
            log: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Run the bench (see the module docstring); the results as a dict."""
    import cupy
    from ncclpy._nccl import cuda as cudamod
    from ncclpy.store import TCPStore
    from .null_boundary import NullCuda, NullNccl, STREAM, make_comm, stop
    x, _host = _array(cupy)
    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
    cu = NullCuda()
    with cudamod.use(cu):
        comms = {"defaults": make_comm(True, store), "bare": make_comm(False)}
        try:
            for c in comms.values():
                _check_call(c, x, STREAM)
            paths = _samplers(comms, x, NullNccl(), batch, STREAM)
            for _ in range(5):                       # warm-up: entries, events in flight
                for fn in paths.values():
                    fn()
            time.sleep(0.3)                          # the trackers release the warm-up
            got: Dict[str, List[float]] = {k: [] for k in paths}
            for rnd in range(repeats):
                for k, fn in paths.items():
                    got[k].append(fn())
                if log is not None and (rnd + 1) % max(repeats // 4, 1) == 0:
                    log(f"# {rnd + 1}/{repeats} rounds")
            counted = _count({k: v for k, v in paths.items() if k != "floor"}, NullCuda,
                             batch)
            steps = None
            if breakdown:
                from .breakdown import time_steps
                steps = time_steps(comms["defaults"], x, STREAM, repeats, batch)
        finally:
            for c in comms.values():
                stop(c)
            store.close()
    floor = got.pop("floor")
    fs = stats(floor)
    costs = load_costs()
    results = []
    for path, xs in got.items():
        s = stats(xs)
        # paired by round (the floor's sample and the path's were taken a few ms apart): a
        # machine whose speed drifts slowly slows both alike
        over = stats([x - f for x, f in zip(xs, floor)])["median_ns"]
        row = {"path": path, "median_ns": round(s["median_ns"], 1),
               "over_floor_ns": round(over, 1), "min_ns": round(s["min_ns"], 1),
               "p90_ns": round(s["p90_ns"], 1), "cuda_calls": counted[path]}
        if path in TARGETS:
            row["target_ns"] = TARGETS[path]
            row["target_met"] = over <= TARGETS[path]
        if costs is not None:
            row["gpu"] = predict(over, counted[path], costs)
        results.append(row)
    return {
        "schema": "ncclpy-host-overhead/2",
        "floor_ns": round(fs["median_ns"], 1),
        "floor": {"call": "NcclCommunicator.allReduce(x.data.ptr, x.data.ptr, x.size, dtype, "
                          "op, stream) as a no-op (bench.null_boundary.NullNccl)",
                  "min_ns": round(fs["min_ns"], 1), "p90_ns": round(fs["p90_ns"], 1)},
        "results": results,
        "breakdown": steps,
        "costs": None if costs is None else {"file": os.path.relpath(COSTS_FILE),
                                             "device": costs.get("device"),
                                             "date": costs.get("date")},
        "call": {"collective": "all_reduce", "op": "sum", "in_place": True, "count": COUNT,
                 "dtype": "float32", "rank": 0, "world_size": 2, "input": "cupy.ndarray"},
        "repeats": repeats, "batch": batch,
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count()},
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def table(doc: Dict[str, Any]) -> str:
    """The results as text."""
    f = doc["floor"]
    lines = [f"# ncclpy host overhead (CPU, null boundary): the whole comm.all_reduce of "
             f"{COUNT} float32 in place, rank 0 of 2, vs the floor",
             f"# floor: {f['call']}",
             f"{'path':<14} {'min_ns':>8} {'median_ns':>10} {'p90_ns':>8} {'over_floor':>11}"
             f"  target / CUDA calls per call",
             f"{'floor':<14} {f['min_ns']:>8.0f} {doc['floor_ns']:>10.0f} {f['p90_ns']:>8.0f} "
             f"{0.0:>11.0f}"]
    for r in doc["results"]:
        note = ""
        if "target_ns" in r:
            note = (f"target <= {r['target_ns']:.0f} ns over: "
                    f"{'met' if r['target_met'] else 'NOT met'}; ")
        calls = ", ".join(f"{k} {v:g}" for k, v in r["cuda_calls"].items()) or "none"
        lines.append(f"{r['path']:<14} {r['min_ns']:>8.0f} {r['median_ns']:>10.0f} "
                     f"{r['p90_ns']:>8.0f} {r['over_floor_ns']:>11.0f}  {note}{calls}")
    if doc["costs"] is None:
        lines.append(f"# GPU prediction: none -- no GPU-measured CUDA call costs in the "
                     f"repository yet ({os.path.relpath(COSTS_FILE)}: run python -m "
                     f"bench.cuda_costs --json {os.path.relpath(COSTS_FILE)} on a GPU)")
    else:
        c = doc["costs"]
        lines.append(f"# GPU prediction (CUDA calls priced from {c['file']}, {c['device']}, "
                     f"{c['date']}): over raw CuPy on that GPU")
        for r in doc["results"]:
            g = r["gpu"]
            extra = f"; unpriced: {', '.join(g['unpriced'])}" if g["unpriced"] else ""
            lines.append(f"#   {r['path']:<14} {g['predicted_ns']:>8.0f} ns "
                         f"(+{g['cuda_ns']:.0f} ns of CUDA calls{extra})")
    if doc.get("breakdown"):
        from .breakdown import table as steps_table
        lines.append(steps_table(doc["breakdown"]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from ncclpy.cli_util import OneLineParser
    p = OneLineParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    p.add_argument("--repeats", type=int, default=40, help="samples per path (default 40)")
    p.add_argument("--batch", type=int, default=2000, help="calls per sample (default 2000)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each step of the eager call on its own")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (exit codes in the module docstring); Ctrl-C: 130, a closed pipe: 141."""
    from ncclpy.cli_util import run_main
    return run_main(_PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    for flag, val in (("--repeats", a.repeats), ("--batch", a.batch)):
        if val < 1:
            print(f"{_PROG}: error: {flag}: expected an integer >= 1, got {val}",
                  file=sys.stderr)
            return 2
    if a.json:
        from ncclpy.cli_util import check_output_path
        why = check_output_path(a.json)
        if why:
            print(f"{_PROG}: error: --json: {why}", file=sys.stderr)
            return 2
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - said in one line
        print(f"{_PROG}: needs CuPy (the CUDA extra: pip install 'ncclpy[cu13]' or "
              f"'ncclpy[cu12]'; no GPU needed) for its cupy.ndarray input: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        load_costs()
    except (ValueError, OSError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        doc = measure(a.repeats, a.batch, a.breakdown,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    except AssertionError as e:
        print(f"{_PROG}: a timed path is wrong: {e}", file=sys.stderr)
        return 1
    doc["args"] = [_PROG, *(argv if argv is not None else sys.argv[1:])]
    print(table(doc), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(f"# JSON written to {a.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
