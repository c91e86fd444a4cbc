"""``python -m ncclpy.selftest OUTDIR``: the one command that proves ncclpy on a GPU.

Runs the stages (``--list`` shows them), the ones that time nothing side by side on the GPU
(``--jobs``), most GPU debt first, each bounded, all within ``--budget`` seconds; writes
``OUTDIR/report.md``, ``OUTDIR/summary.json``, every stage's files packed in
``OUTDIR/stages.tar.gz`` and the updated GPU ledger ``OUTDIR/gpu-ledger.json`` (also into
``docs/gpu-ledger.json`` of the tree it ran from); prints the block to paste into
``docs/gpu-runs.md``.  Exit status: 0 every stage passed, 1 otherwise, 2 usage or no GPU here,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM).

``python -m ncclpy.selftest --debt [--json]`` (no GPU needed): the GPU debt of the tree against
the ledger (:mod:`ncclpy.selftest.debt`); exit status 0 when it is zero, 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..cli_util import OneLineParser, exit_status
from ..errors import NcclpyError
from . import gpuenv
from .order import order_stages
from .report import (PROGRAM, RunRecord, StageResult, exit_code, paste_block, verdict_line,
                     write_outputs)
from .record import commit_of, trace_env, update_ledger
from .runner import GRACE_S, pack
from .schedule import run_stages
from .stages import (DEFAULT_BUDGET_S, NAMES, ON_REQUEST, RESERVE_S, Ctx, Stage, by_name,
                     commands, select)

__all__ = ["main", "build_parser", "execute", "plan_text", "say"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEDGER_DEFAULT = "docs/gpu-ledger.json"
_stdout_closed = False
_term_status = 0


def say(text: str) -> None:
    """Print a line to stdout; a closed stdout (``| head``) silences the rest, no traceback."""
    global _stdout_closed
    if _stdout_closed:
        return
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_closed = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # pragma: no cover - stdout has no descriptor
            pass


def _jobs(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of commands at once, got "
                                         f"{text!r}") from None
    if not 1 <= v <= 64:
        raise argparse.ArgumentTypeError(f"expected 1..64 commands at once, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = OneLineParser(
        prog=f"python -m {PROGRAM}",
        description="Prove ncclpy on a GPU: versions, the GPU tests, ncclpy check against "
                    "torch, the bench sweep and overhead, the examples; one bounded stage "
                    "after another, most valuable first.  Run it from the repository root "
                    "(PYTHONPATH=.).",
        epilog=f"Stages: {', '.join(NAMES)}.  info runs first; then the rest side by side, "
               f"most GPU debt first (the fixed order with --stage); bench and overhead alone, "
               f"last.  On a GPU machine: PYTHONPATH=. python3 -m {PROGRAM} OUTDIR (every "
               f"stage, within 480 s), then, after fixing what failed, a second call with "
               f"--stage NAME for each.  Only with --stage: {', '.join(ON_REQUEST)} (its own "
               f"call).  Exit status 0 only when every stage passed.  Without "
               f"a GPU: python -m {PROGRAM} --debt.")
    p.add_argument("outdir", nargs="?", metavar="OUTDIR",
                   help="folder for report.md, summary.json, stages.tar.gz and "
                        "gpu-ledger.json (created)")
    p.add_argument("--stage", action="append", metavar="NAME", default=[],
                   help="run only this stage (repeatable; info is always added)")
    p.add_argument("--budget", type=_seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help=f"global deadline in seconds (default {DEFAULT_BUDGET_S:.0f}); a stage "
                        f"that cannot fit is not run")
    p.add_argument("--list", action="store_true",
                   help="show the stages that would run, their bounds and commands, and exit")
    p.add_argument("--loose", action="store_true",
                   help="keep the stages' files loose in OUTDIR/stages instead of packing them "
                        "into OUTDIR/stages.tar.gz")
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                   help=f"stage commands at once on the one GPU (default "
                        f"{gpuenv.default_jobs()} here: half the cores, at most 8; 1: one "
                        f"stage after another); bench and overhead always run alone")
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="one CUDA MPS daemon for the whole run: auto (where "
                        "nvidia-cuda-mps-control is on PATH; default), on (required), off "
                        "(none, and none per job either)")
    p.add_argument("--commit", default=None, metavar="TEXT",
                   help="the code's commit, for the ledger (default: git's, when there is one)")
    p.add_argument("--debt", action="store_true",
                   help="print the GPU debt of this tree against the ledger and exit (no GPU "
                        "needed; exit 0 when it is zero)")
    p.add_argument("--json", action="store_true", help="with --debt: the debt as JSON on stdout")
    p.add_argument("--ledger", default=None, metavar="PATH",
                   help=f"the GPU ledger (default {LEDGER_DEFAULT} in the repository)")
    return p


def plan_text(stages: Sequence[Stage], budget_s: float) -> str:
    """What ``--list`` prints: the stages with bounds, ranks, shards, then their commands."""
    ctx = Ctx(python="python", work="WORK", tmp="TMP")
    lines = [f"{'stage':<11}{'bound':>7}{'min':>6}{'ranks':>6}{'shards':>7}  {'runs':<7} what"]
    for s in stages:
        runs = "alone" if s.exclusive or s.kind == "info" else "shared"
        lines.append(f"{s.name:<11}{s.timeout_s:>5.0f} s{s.min_s:>4.0f} s{s.ranks:>6}"
                     f"{s.shards:>7}  {runs:<7} {s.title}")
    lines.append(f"budget {budget_s:.0f} s (--budget; {RESERVE_S:.0f} s kept for the report): a "
                 f"stage starts only with at least its min left, and is stopped at its bound "
                 f"or at the deadline, whichever comes first.  info runs first; then the shared "
                 f"stages side by side (--jobs commands at once, their ranks within the "
                 f"machine's share), most GPU debt first; then the ones that time something, "
                 f"alone")
    rest = [n for n in ON_REQUEST if n not in {s.name for s in stages}]
    if rest:
        lines.append("only with --stage NAME (not in the default run): " + "; ".join(
            f"{n} ({by_name(n).timeout_s:.0f} s: {by_name(n).title})" for n in rest))
    lines.append("commands (WORK: the stages' files, packed into OUTDIR/stages.tar.gz):")
    for s in stages:
        for c in commands(s, ctx, max(0.0, budget_s - RESERVE_S)):
            lines.append(f"  {s.name}: {c.shell()}")
    return "\n".join(lines)


def _display_command(argv: Sequence[str]) -> str:
    out_env = os.environ.get("OUT")
    shown = []
    for a in argv:
        if out_env and os.path.abspath(a) == os.path.abspath(out_env):
            shown.append("$OUT")
        else:
            shown.append(shlex.quote(a))
    return f"PYTHONPATH=. python3 -m {PROGRAM} " + " ".join(shown)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _on_term(signum: int, frame: Any) -> None:
    global _term_status
    _term_status = 128 + int(signum)
    raise _Terminated()


def execute(stages: Sequence[Stage], outdir: str, budget_s: float, *, command: str,
            root: str = _ROOT, python: str = sys.executable, loose: bool = False,
            out: Callable[[str], None] = say, grace_s: float = GRACE_S, jobs: int = 1,
            run_env: Optional[gpuenv.RunEnv] = None, ledger: Optional[str] = None,
            commit: str = "", tests: Optional[List[Dict[str, Any]]] = None) -> int:
    """Run ``stages`` (in this order), write the report into ``outdir``, print the paste block;
    exit status.  ``jobs``/``run_env``: how many commands at once and what they share;
    ``ledger``: the GPU ledger to add the run to (None: none), ``tests`` the GPU tests of the
    tree, for the debt after the run."""
    os.makedirs(outdir, exist_ok=True)
    work = os.path.join(outdir, "stages") if loose else tempfile.mkdtemp(prefix="ncclpy-st-")
    os.makedirs(work, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="ncclpy-st-tmp-")
    ctx = Ctx(python=python, work=work, tmp=tmp)
    t0 = time.monotonic()
    renv = run_env or gpuenv.RunEnv(jobs, 0)
    rec = RunRecord(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), command=command,
                    budget_s=budget_s, stages=[StageResult(s.name, s.title) for s in stages],
                    outdir=os.path.abspath(outdir), setup=dict(renv.notes))

    def env_for(stage: Stage) -> Dict[str, str]:
        env = renv.env_for(stage.exclusive, stage.kills_ranks)
        if ledger is not None:
            env.update(trace_env(work, root, stage.name, stage.kind == "pytest"))
        return env

    def save(results: List[StageResult]) -> None:
        rec.stages = list(results)
        for r in results:
            info = r.figures.pop("info", None)
            if info:
                rec.info = info
                rec.date = str(info.get("date_utc") or rec.date)
        rec.elapsed_s = round(time.monotonic() - t0, 1)
        if not loose:
            pack(work, outdir)
        write_outputs(rec, outdir)

    interrupted = False
    try:
        results, interrupted = run_stages(stages, ctx, root, budget_s, say=out,
                                          after_stage=save, grace_s=grace_s, jobs=renv.jobs,
                                          capacity=renv.capacity, env_for=env_for)
        rec.interrupted = interrupted
        if ledger is not None:
            _record_ledger(rec, work, root, ledger, outdir, commit, tests, out)
        save(results)
    except KeyboardInterrupt:       # between stages or while saving: keep what there is
        rec.interrupted = interrupted = True
        save(rec.stages)
    finally:
        renv.close(failed=any(s.status == "failed" for s in rec.stages))
        shutil.rmtree(tmp, ignore_errors=True)
        if not loose:
            shutil.rmtree(work, ignore_errors=True)
    for s in rec.stages:
        for f in (s.counts or {}).get("failures", [])[:10]:
            first = next((ln for ln in f["message"].splitlines() if ln.strip()), "")
            out(f"[selftest] {s.name}: {f['kind']} {f['id']}: {first[:200]}")
        if s.log_tail and s.status in ("failed", "did not finish"):
            out(f"[selftest] {s.name}: end of its log:")
            for line in s.log_tail.splitlines()[-8:]:
                out(f"    {line[:300]}")
    files = "report.md, summary.json" + ("" if loose else ", stages.tar.gz")
    if rec.debt.get("recorded"):
        files += ", gpu-ledger.json"
    out(f"[selftest] wrote {files} in {rec.outdir}")
    out("----- paste into docs/gpu-runs.md, under \"Runs\" -----")
    out(paste_block(rec).rstrip())
    out("----- end -----")
    out(verdict_line(rec))
    return exit_code(rec)


def _record_ledger(rec: RunRecord, work: str, root: str, ledger: str, outdir: str,
                   commit: str, tests: Optional[List[Dict[str, Any]]],
                   out: Callable[[str], None]) -> None:
    """Add the run to the ledger; the debt after it into ``rec.debt`` (for the paste block)."""
    from . import debt as D
    try:
        doc, n = update_ledger(rec, work, root, ledger, commit or commit_of(root), outdir)
    except Exception as e:  # noqa: BLE001 - the report still comes; the ledger says why not
        out(f"[selftest] the GPU ledger was not updated: {type(e).__name__}: {e}")
        rec.debt = {"error": f"ledger not updated: {e}"}
        return
    rec.debt = {"recorded": n, "ledger": _shown(ledger)}
    if tests is None:
        return
    d = D.compute(doc, root, tests)
    rec.debt.update(items=len(d.items), proven=d.count("proven"),
                    version_skipped=d.count("version-skipped"), debt=len(d.debt),
                    by_stage=D.stage_counts(d),
                    open=[f"{i.id} ({i.detail[:160]})" for i in d.debt[:40]])


def _shown(path: str) -> str:
    """A path as the reports show it: relative inside the repository, else as it is."""
    rel = os.path.relpath(path, _ROOT)
    return path if rel.startswith(os.pardir) else rel


def _debt(ns: argparse.Namespace, ledger: str) -> int:
    """``--debt``: print (or ``--json``) the debt; 0 when it is zero, 1 when not, 2 when the
    ledger or the tests cannot be read."""
    from . import debt as D
    from . import ledger as L
    try:
        doc = L.load(ledger)
        tests = D.collect_tests(_ROOT)
    except (ValueError, D.CollectError) as e:
        sys.stderr.write(f"{PROGRAM} --debt: {e}\n")
        return 2
    d = D.compute(doc, _ROOT, tests)
    shown = _shown(ledger)
    if ns.json:
        say(json.dumps(dict(d.as_json(), ledger=shown), indent=1))
    else:
        for line in D.format_text(d, shown):
            say(line)
    return 0 if not d.debt else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ncclpy.selftest``; the exit status (Ctrl-C: 130, without a traceback)."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        return _term_status or 130
    except SystemExit as e:       # a usage error (status 2, one line) or --help (0)
        return exit_status(e)


def _main(args: List[str]) -> int:
    parser = build_parser()
    ns = parser.parse_args(args)
    ledger = os.path.abspath(ns.ledger) if ns.ledger else os.path.join(_ROOT, LEDGER_DEFAULT)
    if ns.json and not ns.debt:
        parser.error("--json: only with --debt (a run writes summary.json into OUTDIR)")
    if ns.debt:
        if ns.outdir or ns.stage or ns.list:
            parser.error("--debt: takes no OUTDIR, --stage or --list (it runs nothing)")
        return _debt(ns, ledger)
    try:
        stages = select(ns.stage)
    except ValueError as e:
        parser.error(f"--stage: {e}")
    if ns.list:
        say(plan_text(stages, ns.budget))
        return 0
    if not ns.outdir:
        parser.error("OUTDIR is required (the folder for the report), unless --list or --debt")
    missing = [d for d in ("tests/gpu", "bench") if not os.path.isdir(os.path.join(_ROOT, d))]
    if missing:
        sys.stderr.write(f"{PROGRAM}: {', '.join(missing)} not found under {_ROOT}; run it "
                         f"from a checkout of the ncclpy repository (PYTHONPATH=.)\n")
        return 2
    from .probe import cuda_reason
    why = cuda_reason()
    if why:
        sys.stderr.write(f"{PROGRAM}: no CUDA GPU here ({why}); nothing was run: it needs a "
                         f"machine with an NVIDIA GPU\n")
        return 2
    if ns.loose and os.path.isdir(os.path.join(ns.outdir, "stages")) and \
            os.listdir(os.path.join(ns.outdir, "stages")):
        parser.error(f"--loose: {os.path.join(ns.outdir, 'stages')} holds files of an earlier "
                     f"run; give an empty OUTDIR")
    try:
        os.makedirs(ns.outdir, exist_ok=True)
    except OSError as e:
        sys.stderr.write(f"{PROGRAM}: cannot create OUTDIR {ns.outdir}: {e.strerror or e}\n")
        return 2
    stages, tests, note = order_stages(stages, _ROOT, ledger, by_debt=not ns.stage)
    say(f"[selftest] {note}")
    jobs = ns.jobs or gpuenv.default_jobs()
    try:
        renv = gpuenv.prepare(jobs, gpuenv.default_capacity(), mps_mode=ns.mps,
                              biggest=max(s.ranks * s.shards for s in stages))
    except NcclpyError as e:        # --mps on without MPS
        sys.stderr.write(f"{PROGRAM}: {e}\n")
        return 2
    say(f"[selftest] {_setup_line(renv.notes)}")
    old = signal.signal(signal.SIGTERM, _on_term)
    try:
        rc = execute(stages, ns.outdir, ns.budget, command=_display_command(args),
                     loose=ns.loose, jobs=jobs, run_env=renv, ledger=ledger,
                     commit=ns.commit or "", tests=tests)
    except _Terminated:  # pragma: no cover - SIGTERM after the report was written
        rc = 130
    finally:
        signal.signal(signal.SIGTERM, old)
    return _term_status if rc == 130 and _term_status else rc


def _setup_line(notes: Dict[str, Any]) -> str:
    """The run's sharing of the GPU, in one line."""
    return (f"{notes.get('jobs', 1)} commands at once, at most {notes.get('capacity', 0)} "
            f"ranks; NCCL_MAX_CTAS for the shared stages: {notes.get('max_ctas', 'not set')}; "
            f"MPS: {notes.get('mps', 'none')}")
