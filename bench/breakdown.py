"""``--breakdown``: where the time of one eager ncclpy call goes, step by step.

Each step of the fast path (ncclpy/comm/hot.py) is timed on its own, with the objects the
call itself uses (its entry, the API lock, the event pool, the flight recorder, the tracker),
on whatever boundary is in place -- the real GPU under ``python -m bench.overhead
--breakdown``, the null boundary under ``python -m bench.host_overhead --breakdown``:

* ``nccl_call``: the NCCL call as ncclpy makes it (CuPy's bound method, or the ctypes one);
* ``record``: a pooled event taken, recorded on the stream, given back (cudaEventRecord);
* ``lock_marker``: the API lock and the in-call marker around the call;
* ``recorder``: the flight recorder's entry (its ring slot, the call site, the time);
* ``work_tracker``: the Work made and handed to its tracker;
* ``lookup_glue``: the rest -- the method's frame, the entry's lookup (object identities, the
  buffer's key read again, the stream) and the glue between the steps: the whole call's
  median minus the other steps' medians.

The whole call and the steps run interleaved, ``repeats`` samples of ``batch`` calls each;
medians in ns.  A step timed alone runs without the others around it (caches stay warmer),
so the sum is an estimate; the whole call's figure is the measured one.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List

__all__ = ["time_steps", "table", "STEPS"]

STEPS = ("nccl_call", "record", "lock_marker", "recorder", "work_tracker", "lookup_glue")
_clock = __import__("time").perf_counter_ns


def _median(xs: List[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[(n - 1) // 2] + xs[n // 2]) / 2


def _entry(comm: Any, x: Any, stream: int) -> Any:
    """The fast path's entry of ``comm.all_reduce(x, stream=stream)`` (made by one call)."""
    comm.all_reduce(x, stream=stream)
    for e in comm._resolver.hot.values():
        if e.plan.collective == "all_reduce" and e.s == stream:
            return e
    raise RuntimeError("the eager all_reduce made no fast-path entry (a general-path call: "
                       "nonblocking, checked, or in a group)")


def _samplers(comm: Any, x: Any, stream: int, batch: int) -> Dict[str, Callable[[], float]]:
    from ncclpy._nccl import cuda as cudamod
    from ncclpy.comm.work import event_pool, new_work
    e = _entry(comm, x, stream)
    life, api = comm._life, comm._life.api
    pool = event_pool(comm._device)
    rec = comm._recorder
    watch = comm._watch
    frame = sys._getframe()
    out: Dict[str, Callable[[], float]] = {}

    def whole() -> float:
        ar = comm.all_reduce
        t0 = _clock()
        for _ in range(batch):
            ar(x, stream=stream)
        return (_clock() - t0) / batch

    def nccl_call() -> float:
        m, fn, args, s = e.method, e.fn, e.args, e.s
        t0 = _clock()
        if m is not None:
            for _ in range(batch):
                m(*args, s)
        else:
            for _ in range(batch):
                fn(*args, stream=s)
        return (_clock() - t0) / batch

    def record() -> float:
        cu, free = cudamod.cuda(), pool.free
        ev = pool.take(cu)
        free.append(ev)
        rec_fn = cu.event_record
        t0 = _clock()
        for _ in range(batch):
            ev = free.pop()
            rec_fn(ev, stream)
            free.append(ev)
        return (_clock() - t0) / batch

    def lock_marker() -> float:
        t0 = _clock()
        for _ in range(batch):
            api.acquire()
            life.hot = e
            life.hot_n += 1
            life.hot = None
            api.release()
        return (_clock() - t0) / batch

    def recorder() -> float:
        if rec is None:
            return 0.0
        t0 = _clock()
        for _ in range(batch):
            rec.open_at(e.r, frame)
        return (_clock() - t0) / batch

    def work_tracker() -> float:
        keep = (x, None)
        t0 = _clock()
        for _ in range(batch):
            w = new_work(comm, 0, stream, e.plan, keep, 0)
            w._done = True               # nothing to release: its tracker lets it go
            watch.append(w)
        return (_clock() - t0) / batch
    out.update(whole=whole, nccl_call=nccl_call, record=record, lock_marker=lock_marker,
               recorder=recorder, work_tracker=work_tracker)
    return out


def time_steps(comm: Any, x: Any, stream: int, repeats: int, batch: int) -> Dict[str, Any]:
    """Median ns per call of the whole eager call and of each step (see the module
    docstring)."""
    fns = _samplers(comm, x, stream, batch)
    for fn in fns.values():
        fn()
    got: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            got[k].append(fn())
    med = {k: round(_median(v), 1) for k, v in got.items()}
    whole = med.pop("whole")
    med["lookup_glue"] = round(whole - sum(med.values()), 1)
    return {"whole_ns": whole, "steps_ns": {k: med[k] for k in STEPS},
            "recorder": comm._recorder is not None, "watchdog": comm._watchdog is not None}


def table(b: Dict[str, Any]) -> str:
    """The breakdown as text lines."""
    lines = [f"# breakdown of one eager all_reduce ({b['whole_ns']:.0f} ns in all; recorder "
             f"{'on' if b['recorder'] else 'off'}, watchdog "
             f"{'on' if b['watchdog'] else 'off'}):"]
    for k in STEPS:
        lines.append(f"#   {k:<13} {b['steps_ns'][k]:>8.0f} ns")
    return "\n".join(lines)
