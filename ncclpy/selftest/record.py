"""After a GPU run: what each GPU test and timed stage did and which files it executed (the
ledger plugin's and the file tracer's records in the run's ``trace`` folder), added to the GPU
ledger (:mod:`ncclpy.selftest.ledger`) with the run's versions and the content of every tracked
file at the run.  The same data gives the paste block's results and the debt after the run."""
from __future__ import annotations

import glob
import json
import os
import subprocess
from typing import Any, Dict, List, Optional, Tuple

from . import ledger as L
from .filetrace import read_records
from .report import RunRecord, versions
from .stages import TIMED

__all__ = ["TRACE_DIR", "trace_env", "results_of_run", "run_entry", "update_ledger",
           "commit_of"]

#: the run's trace folder, inside its work folder (packed with the stages' files)
TRACE_DIR = "trace"
_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitehook")


def trace_env(work: str, root: str, stage: str, pytest: bool) -> Dict[str, str]:
    """The variables that make a stage's processes record what they execute."""
    folder = os.path.join(work, TRACE_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.pathsep.join(p for p in (_HOOK, root, os.environ.get("PYTHONPATH")) if p)
    return {"NCCLPY_LEDGER_DIR": folder, "NCCLPY_LEDGER_ROOT": root, "PYTHONPATH": path,
            "NCCLPY_LEDGER_CONTEXT": f"{'pytest' if pytest else 'stage'}:{stage}",
            "NCCLPY_SELFTEST_STAGE": stage}


def _plugin_docs(folder: str) -> List[Dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "pytest-*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("tests"), dict):
            out.append(doc)
    return out


def results_of_run(rec: RunRecord, work: str) -> Dict[str, Dict[str, Any]]:
    """item id -> {stage, outcome, seconds, reason, files} for every test a stage reported and
    every timed stage that ran."""
    folder = os.path.join(work, TRACE_DIR)
    records = read_records(folder)
    tests: Dict[str, Dict[str, Any]] = {}
    for doc in _plugin_docs(folder):
        for tid, t in doc["tests"].items():
            tests[tid] = dict(t, stage=doc.get("stage", ""))
    files = L.files_by_test(records, tests)
    out: Dict[str, Dict[str, Any]] = {}
    for tid, t in tests.items():
        out[tid] = {"stage": t["stage"], "outcome": t.get("outcome", "did not finish"),
                    "seconds": t.get("seconds", 0.0), "reason": t.get("reason", ""),
                    "files": sorted(files.get(tid, ()))}
    for s in rec.stages:
        if s.name not in TIMED or s.status in ("not run", "skipped"):
            continue
        ctx = f"stage:{s.name}"
        stage_files = L.files_by_test(records, {ctx: {"contexts": [ctx]}}).get(ctx, set())
        stage_files.discard(ctx)                 # not a file: the id's "path" part
        outcome = {"passed": "passed", "failed": "failed"}.get(s.status, "did not finish")
        out[ctx] = {"stage": s.name, "outcome": outcome, "seconds": s.seconds,
                    "reason": s.reason, "files": sorted(stage_files)}
    return out


def commit_of(root: str) -> str:
    """The checkout's commit (short), with ``+changes`` when its tracked files differ from it;
    "" without git."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=20)
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def run_entry(rec: RunRecord, root: str, commit: str) -> Tuple[str, Dict[str, Any]]:
    """(run id, the ledger's record of the run): date, commit, GPU and versions, the command,
    and the blob hash of every tracked file at the run."""
    v = versions(rec.info)
    date = rec.date or "?"
    if date.endswith(" UTC"):           # "2026-11-26 21:50 UTC" -> "2026-11-26T21:50"
        date = date[:-4]
    rid = date.replace(" ", "T") + " " + v["gpu"].split(" (")[0]
    nccl = v["nccl"].split(" (")[0]
    entry = {"date": rec.date, "commit": commit or "unknown", "gpu": v["gpu"],
             "driver": v["driver"], "nccl": nccl, "cupy": v["cupy"], "torch": v["torch"],
             "python": v["python"], "command": rec.command, "files": L.tree_hashes(root),
             "files_recorded": True}
    return rid, entry


def update_ledger(rec: RunRecord, work: str, root: str, ledger_path: str, commit: str,
                  copy_to: Optional[str] = None) -> Tuple[Dict[str, Any], int]:
    """Add this run to the ledger at ``ledger_path`` (and write a copy into ``copy_to``, the
    folder the device tool returns); (the ledger, how many items it recorded)."""
    results = results_of_run(rec, work)
    try:
        doc = L.load(ledger_path)
    except ValueError:
        doc = L.empty()
    if results:
        rid, entry = run_entry(rec, root, commit)
        while rid in doc["runs"]:
            rid += "'"
        L.update(doc, rid, entry, results)
        for path in [ledger_path] + ([os.path.join(copy_to, "gpu-ledger.json")]
                                     if copy_to else []):
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                L.save(doc, path)
            except OSError:
                pass
    return doc, len(results)
