"""``ncclpy order --observe``: run Ring/Tree reductions on a GPU with inputs that reveal their
order, and judge NCCL's bits against the model, configuration by configuration.

It spawns one set of rank processes per :class:`~ncclpy.order.matrix.Job` (world size and
pinned channel count; two jobs at a time), each with NCCL's debug log on
(NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,ENV, one NCCL_DEBUG_FILE per rank) and the
placement ncclpy gives ranks sharing a GPU (each rank its own "node" on NCCL < 2.30).  Under a
launcher (``ncclpy run -n N ncclpy order --observe ...``) the ranks are the launcher's and run
the flags' one configuration.  Each result line is PREDICTED, MISMATCH (the first differing
elements, the predicted fold and the folds NCCL's bits fit) or CANNOT_PREDICT (the reason);
a JSON report goes to ``--out``.  Exit status 0 only when every configuration was PREDICTED.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from .matrix import Job, proof_matrix, single_job
from .verdict import CANNOT_PREDICT, MISMATCH, PREDICTED

__all__ = ["observe_main", "run_jobs", "aggregate", "job_env", "JOB_TIMEOUT_S"]

PROG = "ncclpy order --observe"
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
    for r in range(job.nranks):
        path = os.path.join(job_dir, f"rank{r}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for ln in f:
                try:
                    rec = json.loads(ln)
                except ValueError:
                    continue
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


def _line(row: Dict[str, Any]) -> str:
    head = (f"{row['verdict']:<15} n={row['ranks']} ch={row['channels']} "
            f"{row['algo']}/{row['proto']} {row['case']}")
    if row["verdict"] == PREDICTED:
        return head
    tail = row.get("reason") or (f"{row.get('differing')} of {row.get('compared')} elements "
                                 f"differ" if row["verdict"] == MISMATCH else "")
    return f"{head}: {tail}"


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


def _wait_for_ranks(job: Job, job_dir: str, timeout: float = JOB_TIMEOUT_S) -> None:
    """Rank 0 under a launcher: wait until every rank wrote a line per case (or timeout;
    a missing line is then NOT_RUN in the report)."""
    want = sum(len(g.cases) for g in job.groups)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        have = []
        for r in range(job.nranks):
            path = os.path.join(job_dir, f"rank{r}.jsonl")
            with open(path) if os.path.exists(path) else open(os.devnull) as f:
                have.append(sum(1 for _ in f))
        if all(h >= want for h in have):
            return
        time.sleep(0.2)


def _launched_rank() -> Optional[Tuple[int, int]]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def observe_main(p: Any, ns: argparse.Namespace) -> int:
    """``ncclpy order --observe``: usage errors name the flag (exit 2); 0 iff every row is
    PREDICTED, else 1."""
    from ..info import no_gpu_reason
    if ns.json or ns.element or ns.rank is not None:
        bad = "json" if ns.json else ("element" if ns.element else "rank")
        p.error(f"{p.flag(bad)}: not with --observe (the report goes to --out as JSON)")
    if ns.matrix not in (None, "proof"):
        p.error(f"{p.flag('matrix')}: expected 'proof' (the GPU proof's configurations), got "
                f"{ns.matrix!r}")
    launched = _launched_rank()
    jobs: List[Job]
    if ns.matrix == "proof":
        if launched:
            p.error(f"{p.flag('matrix')}: the proof matrix spawns its own ranks (3 and 4, one "
                    f"set per channel count): run it without a launcher")
        if ns.collective is not None:
            p.error(f"collective: {ns.collective}: --matrix proof runs its own configurations")
        jobs = proof_matrix()
    else:
        from .args import config_from_args
        if ns.collective is None:
            p.error("collective: required (or --matrix proof)")
        if ns.ranks is None and launched:
            ns.ranks = launched[1]
        cfg = config_from_args(p, ns)
        jobs = [single_job(cfg.nranks, ns.channels, cfg.algo, cfg.proto, cfg.collective,
                           cfg.dtype, cfg.count, cfg.op, cfg.root)]
    if launched and not ns.out:
        p.error("--out: required under a launcher: every rank writes its NCCL log and results "
                "there, and reads the others' (a directory all ranks see)")
    if ns.out and not os.path.isdir(ns.out):
        p.error(f"{p.flag('out')}: {ns.out!r} is not a directory")
    reason = no_gpu_reason()
    if reason:
        print(f"{PROG}: needs a GPU: {reason} (ncclpy order without --observe predicts "
              f"without one)", file=sys.stderr)
        return 2
    out_dir = ns.out or tempfile.mkdtemp(prefix="ncclpy-order-")
    if launched:
        from .observe_rank import run_rank
        job = jobs[0]
        if launched[1] != job.nranks:
            p.error(f"{p.flag('ranks')}: {job.nranks}, but the launcher started "
                    f"{launched[1]} ranks")
        job_dir = os.path.join(out_dir, job.name())
        os.makedirs(job_dir, exist_ok=True)
        os.environ.update(job_env(job, job_dir))    # before this process's first NCCL call
        run_rank(launched[0], job, job_dir)
        if launched[0] != 0:
            return 0
        _wait_for_ranks(job, job_dir)
        rows = aggregate(job, job_dir)
    else:
        rows = run_jobs(jobs, out_dir, total=ns.timeout)
    for row in rows:
        print(_line(row))
    counts: Dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    report = os.path.join(out_dir, "order-report.json")
    with open(report, "w") as f:
        json.dump({"rows": rows, "counts": counts}, f, indent=1)
    print(f"{PROG}: {len(rows)} configurations: "
          f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}; report {report}")
    return 0 if counts and set(counts) == {PREDICTED} else 1
