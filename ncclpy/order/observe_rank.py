"""One rank of ``ncclpy order --observe``: for each communicator of its job, pin NCCL_ALGO and
NCCL_PROTO, create it, run every case (revealing inputs twice: NCCL must give the same bits;
random inputs once), read what NCCL logged (every rank's init lines, rank 0's per-call line),
and judge its own output against the model.  Each result is one JSON line in
``<job dir>/rank<r>.jsonl``; the spawning process aggregates them (:mod:`ncclpy.order.observe`).

Needs a GPU, CuPy and NCCL; the job's environment sets NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,ENV and NCCL_DEBUG_FILE=<job dir>/nccl.%h.%p.log.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..semantics import numerics as nm
from ..semantics.dtypes import DTYPES
from .config import OrderConfig
from .logs import CallLine, CommLog, LogError, merge_rings, merge_trees, parse_log
from .matrix import Case, Group, Job
from .model import predict
from .reveal import reveal_plan, revealing_inputs
from .topology import ring_rotation, tree_expr
from .verdict import CANNOT_PREDICT, MISMATCH, judge, order_free_bound
from .versions import CannotPredict

__all__ = ["run_rank", "case_inputs", "read_records", "LOG_WAIT_S"]

#: how long a rank waits for another rank's log lines to appear
LOG_WAIT_S = 30.0
_NCCL_ALGO = {"ring": "Ring", "tree": "Tree"}
_NCCL_PROTO = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}


def case_inputs(case: Case, nranks: int, seed: int = 0) -> List[np.ndarray]:
    """Every rank's input for ``case`` (logical arrays; bf16/fp8 as bit views), the same on
    every rank: revealing inputs, or normals from a seed fixed by the case."""
    n_in = case.count * (nranks if case.collective == "reduce_scatter" else 1)
    if case.inputs == "reveal":
        return revealing_inputs(reveal_plan(case.dtype, nranks), n_in)
    digest = hashlib.sha256(f"{seed}:{case.name()}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    out = []
    for _ in range(nranks):
        vals = rng.standard_normal(n_in)
        if DTYPES[case.dtype].kind != "float":
            vals = np.round(vals * 10)
        out.append(nm.from_bits(nm.encode(vals, case.dtype), case.dtype))
    return out


def _read_blocks(job_dir: str, index: int) -> Dict[int, CommLog]:
    """Each rank's block of the job's ``index``-th communicator (NCCL prints one "Init START"
    per communicator, in the order a process creates them), by rank."""
    out: Dict[int, CommLog] = {}
    for path in glob.glob(os.path.join(job_dir, "nccl.*.log")):
        with open(path, errors="replace") as f:
            blocks = parse_log(f.read())
        if len(blocks) > index and blocks[index].rank is not None:
            out[blocks[index].rank] = blocks[index]
    return out


def _call_lines(job_dir: str, index: int, want: int) -> List[CallLine]:
    """Rank 0's call lines for communicator ``index``, once it has ``want`` (or the wait is
    over)."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        calls = _read_blocks(job_dir, index).get(0, CommLog()).calls
        if len(calls) >= want or time.monotonic() > deadline:
            return calls
        time.sleep(0.02)


def _buffsizes(env: Dict[str, str]) -> Dict[str, int]:
    out = {}
    for proto, name in (("simple", "NCCL_BUFFSIZE"), ("ll", "NCCL_LL_BUFFSIZE"),
                        ("ll128", "NCCL_LL128_BUFFSIZE")):
        if name in env:
            out[proto] = int(env[name])
    return out


def _config(blocks: Dict[int, CommLog], line: CallLine, case: Case, nranks: int
            ) -> OrderConfig:
    """The model's input for one logged call (CannotPredict naming what is missing)."""
    missing = [r for r in range(nranks) if r not in blocks]
    if missing:
        raise CannotPredict(f"missing log lines: no block for this communicator in the logs of "
                            f"rank{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(str(r) for r in missing)}")
    b0 = blocks[0]
    if line.symmetric:
        raise CannotPredict(f"NCCL ran a symmetric kernel ({line.kernel}), whose order the "
                            f"model does not cover")
    if line.algo not in ("ring", "tree"):
        raise CannotPredict(f"NCCL chose {line.algo.upper()}, not Ring or Tree")
    if b0.tuner:
        raise CannotPredict(f"a tuner plugin is loaded ({b0.tuner}): it may change the "
                            f"channels and chunks")
    if b0.version is None or b0.channels is None:
        raise CannotPredict("missing log lines: the version banner or 'coll channels'")
    key = (line.algo, line.proto)
    if key not in b0.max_threads or key not in b0.thresholds:
        raise CannotPredict("missing log lines: rank 0's tuning table ('Max NThreads', "
                            "NCCL_DEBUG_SUBSYS=TUNING) or 'threadThresholds'")
    logs = [blocks[r] for r in range(nranks)]
    try:
        rings = merge_rings(logs, b0.channels)
        trees = merge_trees(logs, b0.channels) if line.algo == "tree" else None
    except LogError as e:
        raise CannotPredict(f"missing log lines: {e}") from None
    return OrderConfig.make(case.collective, nranks, case.count, dtype=case.dtype,
                            algo=line.algo, proto=line.proto, op=case.op, root=case.root,
                            version=b0.version, channels=b0.channels, rings=rings, trees=trees,
                            buffsizes=_buffsizes(b0.env), max_threads=b0.max_threads,
                            thresholds=b0.thresholds)


def _candidates(cfg: OrderConfig) -> List[Tuple[str, Any]]:
    """Folds a MISMATCH is compared with: every channel's ring rotations and trees."""
    out = []
    for ch in range(cfg.comm_channels):
        for s in range(cfg.nranks):
            out.append((f"channel {ch} ring from position {s}", ring_rotation(cfg.rings[ch], s)))
        out.append((f"channel {ch} tree", tree_expr(cfg.trees[ch])))
    return out


def _run_case(comm: Any, case: Case, inputs: List[np.ndarray], rank: int, nranks: int
              ) -> List[np.ndarray]:
    """Run ``case`` once or twice on this rank; its outputs (host arrays, logical)."""
    import cupy
    import ncclpy
    w = DTYPES[case.dtype]
    x = inputs[rank]
    raw = case.dtype in ("bfloat16", "float8_e4m3", "float8_e5m2")
    n_out = case.count
    outs = []
    for _ in range(2 if case.inputs == "reveal" else 1):
        send = cupy.asarray(np.ascontiguousarray(x).view(w.view) if raw else x)
        recv = cupy.zeros(n_out, dtype=send.dtype)
        dev = comm.device if hasattr(comm, "device") else 0
        sb = ncclpy.Buffer(int(send.data.ptr), int(send.size), case.dtype, dev) if raw else send
        rb = ncclpy.Buffer(int(recv.data.ptr), n_out, case.dtype, dev) if raw else recv
        if case.collective == "all_reduce":
            work = comm.all_reduce(sb, rb, op=case.op)
        elif case.collective == "reduce_scatter":
            work = comm.reduce_scatter(sb, rb, op=case.op)
        else:
            work = comm.reduce(sb, rb, root=case.root, op=case.op)
        work.wait()
        cupy.cuda.runtime.deviceSynchronize()
        outs.append(cupy.asnumpy(recv))
    return outs


def _judge_case(job_dir: str, index: int, case: Case, line: Optional[CallLine],
                outs: List[np.ndarray], inputs: List[np.ndarray], rank: int, nranks: int
                ) -> Dict[str, Any]:
    rec: Dict[str, Any] = {"rank": rank, "case": case.name(),
                           "digest": hashlib.sha256(outs[0].tobytes()).hexdigest()[:16]}
    if len(outs) == 2 and outs[0].tobytes() != outs[1].tobytes():
        rec.update(verdict=MISMATCH, reason="two runs of the same call gave different bits")
        return rec
    if case.collective == "reduce" and rank != case.root:
        rec.update(verdict="NO_OUTPUT")
        return rec
    if line is None:
        rec.update(verdict=CANNOT_PREDICT, reason="missing log lines: rank 0's per-call "
                   "'Bytes -> Algo' line (NCCL_DEBUG_SUBSYS must include TUNING)")
        return rec
    nbytes = case.count * DTYPES[case.dtype].itemsize
    if line.func != case.collective or line.nbytes != nbytes:
        rec.update(verdict=CANNOT_PREDICT, reason=f"rank 0's call line says {line.func} of "
                   f"{line.nbytes} bytes, the call was {case.collective} of {nbytes} bytes")
        return rec
    blocks = _read_blocks(job_dir, index)
    try:
        cfg = _config(blocks, line, case, nranks)
        pred = predict(cfg)
        if (pred.split.channel_lo, pred.split.channel_hi) != (line.channel_lo, line.channel_hi):
            raise CannotPredict(f"the model recomputes channels {pred.split.channel_lo}.."
                                f"{pred.split.channel_hi}, NCCL logged {line.channel_lo}.."
                                f"{line.channel_hi}")
    except (CannotPredict, ValueError) as e:
        bound = order_free_bound(inputs, outs[0], case.dtype) if (
            case.op == "sum" and case.collective != "reduce_scatter") else ""
        rec.update(verdict=CANNOT_PREDICT, reason=str(e), bound=bound)
        return rec
    observed: List[Optional[np.ndarray]] = [None] * nranks
    observed[rank] = outs[0]
    plan = reveal_plan(case.dtype, nranks) if case.inputs == "reveal" else None
    v = judge(pred, inputs, observed, reveal=plan, candidates=_candidates(cfg) if plan else ())
    rec.update(v.to_json(case.dtype))
    rec["split"] = pred.split.describe()
    return rec


def run_rank(rank: int, job: Job, job_dir: str) -> None:
    """The body of rank ``rank`` (the rendezvous environment is set by the launcher)."""
    import ncclpy
    results = open(os.path.join(job_dir, f"rank{rank}.jsonl"), "a")
    try:
        for gi, group in enumerate(job.groups):
            os.environ["NCCL_ALGO"] = _NCCL_ALGO[group.algo]
            os.environ["NCCL_PROTO"] = _NCCL_PROTO[group.proto]
            comm = None
            try:
                comm = ncclpy.init(name=f"order-{gi}-{group.algo}-{group.proto}")
                _run_group(comm, group, gi, job, job_dir, rank, results)
            except ncclpy.NcclpyError as e:
                # NCCL refusing a configuration (say, a protocol it cannot run here) refuses
                # it on every rank alike: the group's cases not yet judged are ERROR, the
                # next communicator still runs
                _record_error(results, group, job, rank, e)
                if comm is not None:
                    comm.abort()
            finally:
                if comm is not None:
                    comm.close()
    finally:
        results.close()


def read_records(path: str) -> Iterator[Dict[str, Any]]:
    """The result lines of one rank's file (a line cut short by a killed rank is skipped)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        for ln in f:
            try:
                yield json.loads(ln)
            except ValueError:
                continue


def _record_error(results: Any, group: Group, job: Job, rank: int, err: Exception) -> None:
    results.flush()
    done = {rec.get("case") for rec in read_records(results.name)
            if rec.get("algo") == group.algo and rec.get("proto") == group.proto}
    why = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    for case in group.cases:
        if case.name() not in done:
            results.write(json.dumps({"rank": rank, "case": case.name(), "digest": "",
                                      "verdict": "ERROR", "reason": why, "job": job.name(),
                                      "algo": group.algo, "proto": group.proto}) + "\n")
    results.flush()


def _run_group(comm: Any, group: Group, gi: int, job: Job, job_dir: str, rank: int,
               results: Any) -> None:
    n = job.nranks
    comm.barrier().wait()          # every rank's init lines are written; one call line
    base_file = os.path.join(job_dir, f"base.{gi}")
    if rank == 0:
        base = len(_call_lines(job_dir, gi, 1))
        with open(base_file + ".tmp", "w") as f:
            f.write(str(base))
        os.replace(base_file + ".tmp", base_file)
    deadline = time.monotonic() + LOG_WAIT_S
    while not os.path.exists(base_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    base = int(open(base_file).read()) if os.path.exists(base_file) else -1
    done = 0
    for case in group.cases:
        inputs = case_inputs(case, n)
        outs = _run_case(comm, case, inputs, rank, n)
        runs = len(outs)
        line = None
        if base >= 0:
            lines = _call_lines(job_dir, gi, base + done + runs)
            if len(lines) >= base + done + runs:
                line = lines[base + done]
        done += runs
        rec = _judge_case(job_dir, gi, case, line, outs, inputs, rank, n)
        rec.update(job=job.name(), algo=group.algo, proto=group.proto)
        results.write(json.dumps(rec) + "\n")
        results.flush()
    comm.barrier().wait()          # nobody starts the next communicator while others judge
