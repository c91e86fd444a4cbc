"""Running ``ncclpy order --observe``'s jobs and reading their results: Ring/Tree reductions on a
GPU with inputs that reveal their order, NCCL's bits judged against the model, configuration by
configuration (the command line is :mod:`ncclpy.order.observe_cli`).

It spawns one set of rank processes per :class:`~ncclpy.order.matrix.Job` (world size and
pinned channel count; two jobs at a time), each with NCCL's debug log on
(NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,ENV, one NCCL_DEBUG_FILE per rank) and the
placement ncclpy gives ranks sharing a GPU (each rank its own "node" on NCCL < 2.30).  Under a
launcher (``ncclpy run -n N ncclpy order --observe ...``) the ranks are the launcher's and run
the flags' one configuration.  Each result line is PREDICTED, MISMATCH (the first differing
elements, the predicted fold and the folds NCCL's bits fit) or CANNOT_PREDICT (the reason);
:func:`aggregate` makes one row per configuration of a job from its ranks' result lines.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from .matrix import Job
from .verdict import CANNOT_PREDICT, MISMATCH, PREDICTED

__all__ = ["run_jobs", "aggregate", "job_env", "JOB_TIMEOUT_S", "CONCURRENT_JOBS"]
#: one job's bound (its ranks are stopped after it)
JOB_TIMEOUT_S = 200.0
#: jobs run at once (their ranks share the GPU)
CONCURRENT_JOBS = 2


def job_env(job: Job, job_dir: str) -> Dict[str, str]:
    """The variables a job's ranks start with."""
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING,ENV",
           "NCCL_DEBUG_FILE": os.path.join(job_dir, "nccl.%h.%p.log")}
    if job.channels is not None:
        env.update(NCCL_MIN_NCHANNELS=str(job.channels), NCCL_MAX_NCHANNELS=str(job.channels))
    return env


def _worst(kinds: List[str]) -> str:
    for k in (MISMATCH, "RANKS_DIFFER", "ERROR", CANNOT_PREDICT, "NOT_RUN"):
        if k in kinds:
            return k
    return PREDICTED


def aggregate(job: Job, job_dir: str, error: str = "") -> List[Dict[str, Any]]:
    """One record per (communicator, case) of ``job`` from its ranks' JSON lines: the worst
    verdict of the ranks that judged, RANKS_DIFFER when all_reduce outputs differ between
    ranks, NOT_RUN for a case no rank reported (with the job's error)."""
    by_key: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    from .observe_rank import read_records
    for r in range(job.nranks):
        for rec in read_records(os.path.join(job_dir, f"rank{r}.jsonl")):
            by_key.setdefault((rec["algo"], rec["proto"], rec["case"]), []).append(rec)
    out = []
    for g in job.groups:
        for case in g.cases:
            recs = by_key.get((g.algo, g.proto, case.name()), [])
            row: Dict[str, Any] = {"job": job.name(), "ranks": job.nranks,
                                   "channels": job.channels, "algo": g.algo, "proto": g.proto,
                                   "case": case.name()}
            if len(recs) < job.nranks:
                row.update(verdict="NOT_RUN", reason=error or f"{len(recs)} of {job.nranks} "
                           f"ranks reported")
                out.append(row)
                continue
            judged = [x for x in recs if x.get("verdict") != "NO_OUTPUT"]
            kinds = [x["verdict"] for x in judged]
            digests = {x["digest"] for x in recs if x.get("digest")}
            if case.collective == "all_reduce" and len(digests) > 1:
                kinds.append("RANKS_DIFFER")
            row["verdict"] = _worst(kinds)
            bad = [x for x in judged if x["verdict"] == row["verdict"]]
            src = bad[0] if bad else judged[0]
            for k in ("reason", "bound", "differing", "compared", "first", "split", "config"):
                if k in src:
                    row[k] = src[k]
            if row["verdict"] == "RANKS_DIFFER":
                row["reason"] = "the ranks' all_reduce outputs differ"
            out.append(row)
    return out


def run_jobs(jobs: List[Job], out_dir: str, timeout: float = JOB_TIMEOUT_S,
             concurrent: int = CONCURRENT_JOBS, total: Optional[float] = None
             ) -> List[Dict[str, Any]]:
    """Spawn every job (``concurrent`` at a time), then aggregate; the rows in job order.
    ``timeout`` bounds each wave, ``total`` (seconds) all of them: a job not started in time
    has every case NOT_RUN, with the reason."""
    import ncclpy
    from .observe_rank import run_rank
    rows: Dict[int, List[Dict[str, Any]]] = {}
    pending = list(enumerate(jobs))
    end = None if total is None else time.monotonic() + total
    while pending:
        wave, pending = pending[:concurrent], pending[concurrent:]
        left = timeout if end is None else min(timeout, end - time.monotonic())
        if left < 10:
            for i, job in wave + pending:
                rows[i] = aggregate(job, os.path.join(out_dir, f"{i:02d}-{job.name()}"),
                                    f"not started: the {total:.0f} s limit was reached")
            break
        started = []
        for i, job in wave:
            job_dir = os.path.join(out_dir, f"{i:02d}-{job.name()}")
            os.makedirs(job_dir, exist_ok=True)
            try:
                ctx = ncclpy.spawn(run_rank, job.nranks, args=(job, job_dir), join=False,
                                   env=job_env(job, job_dir), ranks_per_gpu=job.nranks,
                                   timeout=left)
                started.append((i, job, job_dir, ctx, ""))
            except Exception as e:  # noqa: BLE001 - a job that cannot start is reported
                started.append((i, job, job_dir, None, f"could not start: {e}"))
        deadline = time.monotonic() + left
        for i, job, job_dir, ctx, err in started:
            if ctx is not None:
                try:
                    if not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                        ctx.stop()
                        err = f"stopped after {left:.0f} s"
                except Exception as e:  # noqa: BLE001 - a rank's failure is the job's error
                    err = " ".join(str(e).split())[:400]
            rows[i] = aggregate(job, job_dir, err)
    return [r for i in sorted(rows) for r in rows[i]]
