"""``python -m bench.cuda_costs``: the host cost of each CUDA call ncclpy's call path may make.

Times, per call, in nanoseconds on the calling thread, the CUDA runtime calls that ncclpy's
eager call path can make through CuPy's runtime bindings (``cupy.cuda.runtime``, the ones
``ncclpy/_nccl/cuda.py`` wraps), plus two that are not runtime calls, labelled as such:

* ``cudaEventRecord``: a pooled (reused) event, disableTiming, on a non-capturing stream;
* ``cudaGetDevice``; ``cudaSetDevice`` of the device already current;
* ``cudaStreamIsCapturing`` of a non-capturing stream;
* ``cudaEventQuery`` of a completed event;
* ``cudaEventCreateWithFlags(disableTiming)`` and ``cudaEventDestroy``, timed separately;
* ``cupy.cuda.get_current_stream(dev).ptr``: not a CUDA call, CuPy's thread-local;
* ``cuThreadExchangeStreamCaptureMode``: the driver API, through ctypes on ``libcuda.so.1``,
  giving the thread its own mode back.

Each figure is the median over ``--repeats`` blocks of ``--batch`` back-to-back calls (block
time / calls), after warm-up blocks; a block includes the Python loop and call, whose floor (a
loop calling the C builtin ``len``) is reported beside them as ``floor_ns``.  ``--json PATH``
writes ``{"schema": "ncclpy-cuda-costs/1", "device", "cuda_runtime", "cupy", "costs_ns": {name:
median}, "date", ...}``.  Needs a GPU: without one it says so in one line and exits 2; a bad
command line exits 2 too, a failure 1.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["SCHEMA", "CALLS", "build_parser", "main", "measure", "table", "cuda_version",
           "no_gpu_reason", "block_stats"]

SCHEMA = "ncclpy-cuda-costs/1"
#: (name, what exactly is timed), in the order of the table
CALLS: Tuple[Tuple[str, str], ...] = (
    ("cudaEventRecord", "a pooled event (disableTiming) on a non-capturing stream"),
    ("cudaGetDevice", "runtime"),
    ("cudaSetDevice", "the device already current"),
    ("cudaStreamIsCapturing", "a non-capturing stream"),
    ("cudaEventQuery", "a completed event"),
    ("cudaEventCreateWithFlags", "disableTiming, alone"),
    ("cudaEventDestroy", "an idle event, alone"),
    ("cupy.get_current_stream(dev).ptr", "not a CUDA call: CuPy's thread-local current stream"),
    ("cuThreadExchangeStreamCaptureMode", "driver API via ctypes on libcuda.so.1, the "
                                          "thread's own mode back"),
)
_PROG = "python -m bench.cuda_costs"
_CLOCK = time.perf_counter_ns


def build_parser() -> argparse.ArgumentParser:
    """The parser (one-line usage errors, exit status 2)."""
    from ncclpy.cli_util import OneLineParser, int_at_least
    p = OneLineParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    p.add_argument("--repeats", type=int_at_least(1, "an integer >= 1"), default=500,
                   help="timed blocks per call (default 500)")
    p.add_argument("--batch", type=int_at_least(1, "an integer >= 1"), default=100,
                   help="calls per block (default 100)")
    p.add_argument("--warmup", type=int_at_least(0, "an integer >= 0"), default=20,
                   help="untimed blocks first (default 20)")
    p.add_argument("--device", type=int_at_least(0, "a device ordinal >= 0"), default=0,
                   help="CUDA device (default 0)")
    return p


def no_gpu_reason(device: int = 0) -> str:
    """'' when CuPy sees CUDA device ``device``, else why not."""
    try:
        import cupy
    except Exception as e:
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if n <= device:
        return f"{n} CUDA device(s) visible, device {device} asked for"
    return ""


def cuda_version(code: int) -> str:
    """CUDA's version code as major.minor (13000 -> 13.0, 12080 -> 12.8)."""
    return f"{code // 1000}.{(code % 1000) // 10}"


def block_stats(per_call_ns: Sequence[float]) -> Dict[str, float]:
    """median / p10 / p90 / min (ns per call) over blocks."""
    a = np.asarray(per_call_ns, dtype=np.float64)
    if not a.size:
        return {"median_ns": 0.0, "p10_ns": 0.0, "p90_ns": 0.0, "min_ns": 0.0}
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"median_ns": float(p50), "p10_ns": float(p10), "p90_ns": float(p90),
            "min_ns": float(a.min())}


def _loop0(f: Callable[[], Any], k: int) -> int:
    r = range(k)
    t0 = _CLOCK()
    for _ in r:
        f()
    return _CLOCK() - t0


def _loop1(f: Callable[[Any], Any], a: Any, k: int) -> int:
    r = range(k)
    t0 = _CLOCK()
    for _ in r:
        f(a)
    return _CLOCK() - t0


def _loop2(f: Callable[[Any, Any], Any], a: Any, b: Any, k: int) -> int:
    r = range(k)
    t0 = _CLOCK()
    for _ in r:
        f(a, b)
    return _CLOCK() - t0


def _loop_ptr(get: Callable[[Any], Any], dev: int, k: int) -> int:
    r = range(k)
    t0 = _CLOCK()
    for _ in r:
        get(dev).ptr
    return _CLOCK() - t0


def measure(rt: Any, stream: int, get_current_stream: Callable[[int], Any],
            exchange: Optional[Any], device: int, repeats: int, batch: int, warmup: int,
            drain: Callable[[], None]) -> Tuple[Dict[str, Dict[str, float]], Dict[str, float]]:
    """(per call of :data:`CALLS`: statistics in ns per call over ``repeats`` blocks of
    ``batch`` calls after ``warmup`` blocks, the loop floor's statistics).

    ``rt``: CuPy's ``cupy.cuda.runtime`` (or a stand-in with the same functions); ``stream``:
    the raw handle of a non-capturing stream, which ``drain`` waits for (between blocks,
    untimed); ``exchange``: ``cuThreadExchangeStreamCaptureMode`` with its ``argtypes`` set
    (None: not reachable here, left out)."""
    flag = rt.eventDisableTiming
    ev = rt.eventCreateWithFlags(flag)
    done = rt.eventCreateWithFlags(flag)
    rt.eventRecord(done, stream)
    drain()
    out: Dict[str, Dict[str, float]] = {}
    try:
        def blocks(one: Callable[[], int], before: Optional[Callable[[], None]] = None
                   ) -> Dict[str, float]:
            per: List[float] = []
            for i in range(warmup + repeats):
                if before is not None:
                    before()
                ns = one()
                if i >= warmup:
                    per.append(ns / batch)
            return block_stats(per)

        out["cudaEventRecord"] = blocks(lambda: _loop2(rt.eventRecord, ev, stream, batch),
                                        before=drain)
        drain()
        out["cudaGetDevice"] = blocks(lambda: _loop0(rt.getDevice, batch))
        out["cudaSetDevice"] = blocks(lambda: _loop1(rt.setDevice, device, batch))
        out["cudaStreamIsCapturing"] = blocks(
            lambda: _loop1(rt.streamIsCapturing, stream, batch))
        out["cudaEventQuery"] = blocks(lambda: _loop1(rt.eventQuery, done, batch))
        made: List[int] = []

        def create() -> int:
            f, r = rt.eventCreateWithFlags, range(batch)
            t0 = _CLOCK()
            for _ in r:
                made.append(f(flag))
            return _CLOCK() - t0

        def destroy() -> int:
            f, hs = rt.eventDestroy, list(made)
            made.clear()
            t0 = _CLOCK()
            for h in hs:
                f(h)
            return _CLOCK() - t0

        def make() -> None:                            # the events a destroy block destroys
            _destroy(rt, made)
            made.extend(rt.eventCreateWithFlags(flag) for _ in range(batch))
        try:
            out["cudaEventCreateWithFlags"] = blocks(create, before=lambda: _destroy(rt, made))
            out["cudaEventDestroy"] = blocks(destroy, before=make)
        finally:
            _destroy(rt, made)
        out["cupy.get_current_stream(dev).ptr"] = blocks(
            lambda: _loop_ptr(get_current_stream, device, batch))
        if exchange is not None:
            probe = ctypes.c_int(0)
            exchange(ctypes.byref(probe))             # global meanwhile; probe: the thread's
            mode = ctypes.c_int(probe.value)
            exchange(ctypes.byref(ctypes.c_int(mode.value)))       # its own mode back
            out["cuThreadExchangeStreamCaptureMode"] = blocks(     # mode in, the same mode out
                lambda: _loop_byref(exchange, mode, batch))
        floor = blocks(lambda: _loop1(len, (), batch))
    finally:
        rt.eventDestroy(ev)
        rt.eventDestroy(done)
    return out, floor


def _loop_byref(f: Callable[[Any], Any], mode: Any, k: int) -> int:
    r, byref = range(k), ctypes.byref
    t0 = _CLOCK()
    for _ in r:
        f(byref(mode))
    return _CLOCK() - t0


def _destroy(rt: Any, events: List[int]) -> None:
    while events:
        rt.eventDestroy(events.pop())


def _driver_exchange() -> Optional[Any]:
    try:
        drv = ctypes.CDLL("libcuda.so.1")
        f = drv.cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.POINTER(ctypes.c_int)]
    f.restype = ctypes.c_int
    return f


def table(doc: Dict[str, Any]) -> str:
    """The report: a header naming the device and versions, one line per call."""
    labels = dict(CALLS)
    lines = [f"# {_PROG} on {doc['device']} (device {doc['device_index']}), CUDA runtime "
             f"{doc['cuda_runtime']}, driver {doc['cuda_driver']}, CuPy {doc['cupy']}",
             f"# host ns per call: median (p10, p90) over {doc['repeats']} blocks of "
             f"{doc['batch']} calls after {doc['warmup']} untimed blocks; each includes the "
             f"Python loop and call (floor: {doc['floor_ns']:.1f} ns, a loop calling len())",
             f"{'call':<36s}{'median':>9s}{'p10':>9s}{'p90':>9s}  what"]
    for name, st in doc["detail"].items():
        lines.append(f"{name:<36s}{st['median_ns']:9.1f}{st['p10_ns']:9.1f}"
                     f"{st['p90_ns']:9.1f}  {labels.get(name, '')}")
    for name in doc.get("not_measured", []):
        lines.append(f"{name:<36s}{'-':>9s}{'-':>9s}{'-':>9s}  not reachable here")
    return "\n".join(lines)


def _run(a: argparse.Namespace, argv: List[str]) -> Dict[str, Any]:
    import cupy
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device(a.device)
    dev.use()
    stream = cupy.cuda.Stream(non_blocking=True)
    props = rt.getDeviceProperties(a.device)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    exchange = _driver_exchange()
    detail, floor = measure(rt, int(stream.ptr), cupy.cuda.get_current_stream, exchange,
                            a.device, a.repeats, a.batch, a.warmup, stream.synchronize)
    return {"schema": SCHEMA, "device": name, "device_index": a.device,
            "cuda_runtime": cuda_version(int(rt.runtimeGetVersion())),
            "cuda_driver": cuda_version(int(rt.driverGetVersion())),
            "cupy": str(cupy.__version__), "python": platform.python_version(),
            "costs_ns": {k: v["median_ns"] for k, v in detail.items()},
            "labels": {k: v for k, v in CALLS if k in detail},
            "detail": detail, "floor_ns": floor["median_ns"],
            "not_measured": [k for k, _ in CALLS if k not in detail],
            "repeats": a.repeats, "batch": a.batch, "warmup": a.warmup,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "args": [_PROG, *argv]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: 0 measured, 2 a bad command line or no GPU, 1 a failure; Ctrl-C 130."""
    from ncclpy.cli_util import run_main
    return run_main(_PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.json:
        from ncclpy.cli_util import check_output_path
        why = check_output_path(a.json)
        if why:
            print(f"{_PROG}: error: --json: {why} (see '{_PROG} -h')", file=sys.stderr)
            return 2
    why = no_gpu_reason(a.device)
    if why:
        print(f"{_PROG}: needs a CUDA GPU: it times CUDA runtime calls, and none is usable here "
              f"({why}). Nothing was measured.", file=sys.stderr)
        return 2
    try:
        doc = _run(a, argv)
    except Exception as e:
        print(f"{_PROG}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(table(doc), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(f"# JSON written to {a.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
