"""``ncclpy order --observe``: the command line of the GPU check (:mod:`ncclpy.order.observe`
runs the jobs).  One line per configuration, PREDICTED / MISMATCH / CANNOT_PREDICT / ERROR /
NOT_RUN with the reason; a JSON report in ``--out``; exit status 0 only when every configuration
was PREDICTED, 1 otherwise, 2 for a usage error or no GPU."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from .matrix import Job, proof_matrix, single_job
from .observe import aggregate, job_env, run_jobs, JOB_TIMEOUT_S
from .verdict import MISMATCH, PREDICTED

__all__ = ["observe_main"]

PROG = "ncclpy order --observe"


def _line(row: Dict[str, Any]) -> str:
    head = (f"{row['verdict']:<15} n={row['ranks']} ch={row['channels']} "
            f"{row['algo']}/{row['proto']} {row['case']}")
    if row["verdict"] == PREDICTED:
        return head
    tail = row.get("reason") or (f"{row.get('differing')} of {row.get('compared')} elements "
                                 f"differ" if row["verdict"] == MISMATCH else "")
    return f"{head}: {tail}"


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
