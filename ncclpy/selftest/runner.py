"""What the stages' commands run in and what they leave: each command's environment (the
repository first on ``PYTHONPATH``, no inherited rank variables), its own process group, dying
with this process (``PR_SET_PDEATHSIG``, so none outlives a killed selftest); reading a stage's
files into its result (:func:`analyse`); packing them (:func:`pack`).  Running them, side by
side and bounded, is :mod:`ncclpy.selftest.schedule`.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import signal
import tarfile
from typing import Callable, Dict, Optional, Sequence, Tuple

from . import parse as P
from .report import StageResult
from .stages import CUDA_COSTS_SUFFIX, SIDE_JSON, Ctx, Stage, prefix, shard_prefix

__all__ = ["analyse", "pack", "child_env", "GRACE_S", "DEVICE_FAULTS", "device_fault"]

log = logging.getLogger(__name__)

#: seconds between SIGINT and SIGKILL when a command is stopped
GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1
_CLEAR = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "GROUP_RANK", "TORCHELASTIC_RUN_ID")

try:
    _prctl: Optional[Callable[..., int]] = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _child_setup() -> None:  # pragma: no cover - runs in the forked child
    os.setpgrp()
    # a stage is stopped at its bound by SIGINT (pytest then writes what finished): give it
    # the default disposition even when the selftest itself was started with SIGINT ignored
    # (nohup, a background job without job control), which exec would otherwise hand on
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def child_env(root: str, extra: Sequence[Tuple[str, str]] = ()) -> Dict[str, str]:
    """The environment of a stage command: ours, the repository root first on PYTHONPATH,
    unbuffered output, no inherited rank variables, plus ``extra``."""
    env = dict(os.environ)
    try:
        from ..rendezvous import ENV_VARS
        clear = set(ENV_VARS) | set(_CLEAR)
    except Exception:  # pragma: no cover - rendezvous unimportable: the common ones
        clear = set(_CLEAR)
    for k in clear:
        if k not in ("CUDA_VISIBLE_DEVICES", "NCCLPY_STORE_TOKEN"):
            env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(dict(extra))
    return env


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _logs(work: str, p: str) -> str:
    """A stage's log, its shards' logs one after another."""
    paths = sorted(glob.glob(os.path.join(glob.escape(work), f"{glob.escape(p)}.log")) +
                   glob.glob(os.path.join(glob.escape(work), f"{glob.escape(p)}.s*.log")))
    return "".join(_read(path) for path in paths)


#: CUDA errors that one process's fault spreads to every process on the GPU under MPS (a rank
#: killed with a kernel in flight did it on 2026-11-26): a stage showing one may fail for
#: another stage's cause
DEVICE_FAULTS = ("an illegal memory access was encountered", "cudaErrorIllegalAddress",
                 "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA-capable device(s) is/are busy or unavailable",
                 "cudaErrorDevicesUnavailable", "unspecified launch failure")


def device_fault(text: str) -> str:
    """The first line of ``text`` naming a device-wide CUDA fault (:data:`DEVICE_FAULTS`), or
    ''."""
    for line in text.splitlines():
        if any(f in line for f in DEVICE_FAULTS):
            return line.strip()[:200]
    return ""


def _tail(text: str, lines: int = 25, chars: int = 3000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def analyse(stage: Stage, res: StageResult, ctx: Ctx) -> None:
    """Fill ``res`` from the stage's files: counts, figures, status and reason."""
    p = prefix(stage)
    work = ctx.work
    try:
        res.files = sorted(f for f in os.listdir(work) if f.startswith(p) or any(
            f.startswith(f"check-n{n}.") for n in stage.checks))
    except OSError:
        res.files = []
    rcs = [c.get("rc") for c in res.commands]
    timed_out = any(c.get("timed_out") for c in res.commands)
    interrupted = any(c.get("interrupted") for c in res.commands)
    reason = ""
    ok = bool(rcs) and all(rc == 0 for rc in rcs)
    if stage.kind == "pytest":
        shards = [shard_prefix(stage, k) for k in range(1, max(1, stage.shards) + 1)]
        res.counts = P.merge_counts([P.junit_counts(os.path.join(work, f"{sp}.xml"))
                                     or P.pytest_log_counts(_read(os.path.join(work,
                                                                                f"{sp}.log")))
                                     for sp in shards])
        for n in stage.checks:
            c = P.check_summary(os.path.join(work, f"check-n{n}.json"))
            if c is not None:
                res.figures[f"check_n{n}"] = c
        c = res.counts or {}
        if not c and "No module named pytest" in _logs(work, p):
            ok, reason = False, "pytest is not installed here (pip install pytest pytest-timeout)"
        elif ok and c.get("passed", 0) == 0:
            ok = False
            reason = "every test skipped" if c.get("skipped") else "no test ran"
        elif rcs and rcs[-1] == 5:
            reason = "no test collected"
        elif not ok and rcs and rcs[-1] not in (0, 1):
            reason = f"pytest exit status {rcs[-1]}"
        if reason == "every test skipped" and not timed_out and not interrupted:
            res.status = "skipped"
            res.reason = reason
            return
    elif stage.kind == "info":
        doc = P.load_json(os.path.join(work, f"{p}.json"))
        if isinstance(doc, dict):
            res.figures["info"] = doc
            missing = doc.get("missing_tools") or []
            if doc.get("cuda_reason"):
                ok, reason = False, f"the probe found no usable GPU: {doc['cuda_reason']}"
            elif missing:
                ok, reason = False, (f"missing {', '.join(missing)} (pip install "
                                     f"{' '.join(missing)}): the pytest stages cannot run")
        else:
            ok, reason = False, "the probe wrote no JSON"
    elif stage.kind in ("bench", "overhead"):
        fig = (P.bench_figures if stage.kind == "bench" else P.overhead_figures)(
            os.path.join(work, f"{p}.json"))
        if fig is None:
            bad = [rc for rc in rcs if rc != 0]
            ok = False
            reason = (f"exit status {bad[0]}, " if bad else "") + "no JSON written"
        else:
            res.figures[stage.kind] = fig
            if fig.get("out_of_bounds"):
                ok, reason = False, f"{fig['out_of_bounds']} results with wrong elements"
        if stage.kind == "overhead":
            costs = P.cuda_costs_figures(os.path.join(work, f"{p}.{CUDA_COSTS_SUFFIX}"))
            if costs is not None:
                res.figures["cuda_costs"] = costs
            elif ok:
                ok, reason = False, "bench.cuda_costs wrote no JSON"
    elif stage.kind == "nccl-tests":
        side = P.nccl_tests_figures(os.path.join(work, p, SIDE_JSON))
        if side is None:
            bad = [rc for rc in rcs if rc != 0]
            ok = False
            reason = (f"exit status {bad[0]}, " if bad else "") + "no JSON written"
        else:
            res.figures["nccl_tests"] = side
            sums = [s for s in side["summary"].values() if s]
            wrong = sum(s.get("wrong") or 0 for s in sums)
            oob = sum(s.get("out_of_bounds") or 0 for s in sums)
            if side["status"] == "not run" and not timed_out and not interrupted:
                # a missing prerequisite only (bench.nccl_tests_side): never "passed"
                res.status, res.reason = "not run", side["reason"]
                res.log_tail = _tail(_logs(work, p))
                return
            if wrong or oob:        # the figures of a run that found them are kept: it fails
                ok, reason = False, f"{wrong:.0f} wrong elements" + (
                    f" ({oob} results out of bounds)" if oob else "")
            elif side["status"] == "failed":
                ok, reason = False, side["reason"]
            elif side["status"] != "complete":
                ok, reason = False, f"{side['status']}: {side['reason']}"
            elif not side["comparable"]:
                ok, reason = False, f"not comparable: {'; '.join(side['flags'])}"
    if interrupted:
        res.status = "interrupted"
    elif timed_out:
        res.status = "did not finish"
    else:
        res.status = "passed" if ok else "failed"
        if not ok and not reason:
            bad = [rc for rc in rcs if rc != 0]
            reason = f"exit status {bad[0]}" if bad and stage.kind != "pytest" else ""
    res.reason = reason if res.status == "failed" else ""
    if res.status != "passed":
        text = _logs(work, p)
        fault = device_fault(text)
        if fault:
            res.figures["device_fault"] = fault
        if not (res.counts or {}).get("failures"):
            res.log_tail = _tail(text)


def pack(work: str, outdir: str, name: str = "stages.tar.gz") -> str:
    """Every file in ``work``, its folders' too (the ledger's ``trace/``), into ``outdir/name``
    (as ``stages/<path>``), atomically."""
    dest = os.path.join(outdir, name)
    tmp = dest + ".part"
    with tarfile.open(tmp, "w:gz") as tar:
        for dirpath, dirnames, files in os.walk(work):
            dirnames.sort()
            for f in sorted(files):
                path = os.path.join(dirpath, f)
                if os.path.isfile(path) and not f.endswith(".part"):
                    rel = os.path.relpath(path, work).replace(os.sep, "/")
                    tar.add(path, arcname=f"stages/{rel}")
    os.replace(tmp, dest)
    return dest
