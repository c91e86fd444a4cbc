"""Run the stages: each command as a subprocess in its own process group, its output in the
stage's log, bounded by the stage's timeout and by the run's global deadline.

A command that reaches its bound gets SIGINT (pytest then still writes its junit file with what
finished), ``grace_s`` seconds later SIGKILL for whatever is left of its process group; the
stage is "did not finish" and the next stage runs.  Ctrl-C (KeyboardInterrupt) stops the running
command the same way and ends the run: the stage is "interrupted", the rest "not run".  Every
child dies with this process (``PR_SET_PDEATHSIG``), so none outlives a killed selftest.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import tarfile
import time
from typing import Any, Callable, Dict, IO, List, Optional, Sequence, Tuple

from . import parse as P
from .report import StageResult, stage_line
from .stages import RESERVE_S, Cmd, Ctx, Stage, commands, decide, prefix

__all__ = ["run_stages", "run_command", "analyse", "pack", "child_env", "GRACE_S"]

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


def _stop(proc: "subprocess.Popen[bytes]", grace_s: float) -> None:
    """SIGINT to the command's process group, then SIGKILL to what is left of it."""
    _killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:      # a second Ctrl-C: no more grace
        pass
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_command(cmd: Cmd, log_file: IO[bytes], timeout_s: float, cwd: str,
                env: Dict[str, str], record: Dict[str, Any],
                grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
    """Run ``cmd`` with its output appended to ``log_file``; fill ``record`` (rc, seconds,
    timed_out).  KeyboardInterrupt stops the command, is recorded, and is raised again."""
    record.update(argv=list(cmd.argv), shell=cmd.shell(), rc=None, seconds=0.0,
                  timed_out=False)
    log_file.write(f"$ {cmd.shell()}\n# bound {timeout_s:.0f} s\n".encode())
    log_file.flush()
    t0 = clock()
    try:
        proc = subprocess.Popen(list(cmd.argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=_child_setup)
    except OSError as e:
        record.update(rc=127, error=f"{type(e).__name__}: {e}")
        log_file.write(f"# could not start: {e}\n".encode())
        return
    try:
        try:
            record["rc"] = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            record["timed_out"] = True
            _stop(proc, grace_s)
            record["rc"] = proc.returncode
        _killpg(proc.pid, signal.SIGKILL)     # ranks or helpers it left behind
    except KeyboardInterrupt:
        _stop(proc, grace_s)
        record.update(rc=proc.returncode, interrupted=True)
        raise
    finally:
        record["seconds"] = round(clock() - t0, 2)
        how = ("stopped at its bound" if record["timed_out"] else
               "interrupted" if record.get("interrupted") else "exited")
        log_file.write(f"\n# {how}: exit status {record['rc']} after "
                       f"{record['seconds']:.1f} s\n\n".encode())
        log_file.flush()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
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
        res.counts = (P.junit_counts(os.path.join(work, f"{p}.xml"))
                      or P.pytest_log_counts(_read(os.path.join(work, f"{p}.log"))))
        for n in stage.checks:
            c = P.check_summary(os.path.join(work, f"check-n{n}.json"))
            if c is not None:
                res.figures[f"check_n{n}"] = c
        c = res.counts or {}
        if not c and "No module named pytest" in _read(os.path.join(work, f"{p}.log")):
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
    if res.status != "passed" and not (res.counts or {}).get("failures"):
        res.log_tail = _tail(_read(os.path.join(work, f"{p}.log")))


def pack(work: str, outdir: str, name: str = "stages.tar.gz") -> str:
    """Every file in ``work`` into ``outdir/name`` (as ``stages/<file>``), atomically."""
    dest = os.path.join(outdir, name)
    tmp = dest + ".part"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(os.listdir(work)):
            path = os.path.join(work, f)
            if os.path.isfile(path):
                tar.add(path, arcname=f"stages/{f}")
    os.replace(tmp, dest)
    return dest


def run_stages(stages: Sequence[Stage], ctx: Ctx, root: str, budget_s: float, *,
               say: Callable[[str], None] = print,
               after_stage: Optional[Callable[[List[StageResult]], None]] = None,
               grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic,
               ) -> Tuple[List[StageResult], bool]:
    """Run ``stages`` in order within ``budget_s``; (one result per stage, interrupted?)."""
    deadline = clock() + budget_s
    results = [StageResult(s.name, s.title) for s in stages]
    interrupted = False
    for s, res in zip(stages, results):
        if interrupted:
            res.reason = "the run was interrupted first"
            continue
        run, timeout, why = decide(s, deadline - clock() - RESERVE_S)
        if not run:
            res.reason = why
            say(f"[selftest] {s.name}: not run: {why}")
            continue
        res.timeout_s = timeout
        say(f"[selftest] {s.name}: {s.title} (bound {timeout:.0f} s)")
        t0 = clock()
        try:
            with open(os.path.join(ctx.work, f"{prefix(s)}.log"), "ab") as lf:
                for cmd in commands(s, ctx):
                    left = t0 + timeout - clock()
                    rec: Dict[str, Any] = {}
                    res.commands.append(rec)
                    if left <= 1:
                        rec.update(argv=list(cmd.argv), shell=cmd.shell(), rc=None,
                                   seconds=0.0, timed_out=True)
                        break
                    run_command(cmd, lf, left, root, child_env(root, cmd.env), rec,
                                grace_s=grace_s, clock=clock)
                    if rec.get("timed_out"):
                        break
        except KeyboardInterrupt:
            interrupted = True
        res.seconds = round(clock() - t0, 2)
        try:
            analyse(s, res, ctx)
            if interrupted:
                res.status = "interrupted"
            say(f"[selftest] {stage_line(res)}")
            if after_stage is not None:
                after_stage(results)
        except KeyboardInterrupt:
            interrupted = True
            res.status = "interrupted"
    return results, interrupted
