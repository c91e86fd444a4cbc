"""Run tests/forensics_job.py under ``ncclpy run`` and read what came out (shared by the CPU
forensics tests, on ncclpy's CPU backend, and tests/gpu, on real NCCL)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = os.path.join(HERE, "forensics_job.py")

__all__ = ["run_job", "start_job", "trace", "line_of", "JOB", "ROOT", "cli"]


def line_of(marker: str) -> int:
    """The line of tests/forensics_job.py that ends with ``# CALL <marker>``."""
    with open(JOB) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# CALL {marker}"):
                return i
    raise AssertionError(f"no '# CALL {marker}' line in {JOB}")


def _env(trace_dir: str, extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, NCCLPY_TRACE_DIR=trace_dir)
    for k in ("NCCLPY_STORE_TOKEN", "NCCLPY_MASTER_PORT", "MASTER_PORT", "NCCLPY_CHECKED"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def start_job(scenario: str, trace_dir: str, extra: Optional[Dict[str, str]] = None,
              real: bool = False, run_args: Tuple[str, ...] = ()) -> subprocess.Popen:
    """``ncclpy run -n 3 forensics_job.py SCENARIO`` in the background (stderr piped)."""
    cmd = [sys.executable, "-m", "ncclpy", "run", "-n", "3", "--grace", "2", *run_args, JOB,
           scenario] + (["--real"] if real else [])
    return subprocess.Popen(cmd, env=_env(trace_dir, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def run_job(scenario: str, trace_dir: str, extra: Optional[Dict[str, str]] = None,
            real: bool = False, timeout: float = 120.0,
            run_args: Tuple[str, ...] = ()) -> Tuple[int, str, str]:
    """Run the job to its end: (exit code, stdout, stderr)."""
    p = start_job(scenario, trace_dir, extra, real, run_args)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{scenario}: ncclpy run did not end within {timeout} s:\n{err}")
    return p.returncode, out, err


def cli(*args: str, env: Optional[Dict[str, str]] = None,
        timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m ncclpy ARGS`` as a user runs it."""
    from module_run import run_module
    return run_module("ncclpy", *args, timeout=timeout, env=env)


def trace(trace_dir: str) -> Tuple[int, Dict[str, Any], str]:
    """``ncclpy trace DIR --json`` and the text form: (exit code, JSON, text)."""
    j = cli("trace", trace_dir, "--json")
    t = cli("trace", trace_dir)
    assert j.returncode == t.returncode, (j.stderr, t.stderr)
    return j.returncode, json.loads(j.stdout), t.stdout


def findings(doc: Dict[str, Any], comm: str = "job") -> List[Dict[str, Any]]:
    c = [c for c in doc["communicators"] if c["comm"] == comm]
    assert len(c) == 1, doc
    return c[0]["findings"]


def dumps_named(stderr: str) -> List[str]:
    """The dump files the ranks' errors name."""
    return re.findall(r"flight-recorder dump: (\S+\.jsonl)", stderr)
