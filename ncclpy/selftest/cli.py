"""``python -m ncclpy.selftest OUTDIR``: the one command that proves ncclpy on a GPU.

Runs the stages (``--list`` shows them) most valuable first, each bounded, all within
``--budget`` seconds; writes ``OUTDIR/report.md``, ``OUTDIR/summary.json`` and every stage's
files packed in ``OUTDIR/stages.tar.gz`` (the device tool returns at most 8 files); prints the
block to paste into ``docs/gpu-runs.md``.  Exit status: 0 every stage passed, 1 otherwise, 2
usage or no GPU here, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, List, Optional, Sequence

from ..cli_util import OneLineParser, exit_status
from .report import (PROGRAM, RunRecord, StageResult, exit_code, paste_block, verdict_line,
                     write_outputs)
from .runner import GRACE_S, pack, run_stages
from .stages import DEFAULT_BUDGET_S, NAMES, RESERVE_S, Ctx, Stage, commands, select

__all__ = ["main", "build_parser", "execute", "plan_text", "say"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
        epilog=f"Stages, in order: {', '.join(NAMES)} (info always runs first).  On a GPU "
               f"machine: PYTHONPATH=. python3 -m {PROGRAM} OUTDIR, then, if stages were "
               f"left, a second call with --stage NAME for each.  Exit status 0 only when "
               f"every stage passed.")
    p.add_argument("outdir", nargs="?", metavar="OUTDIR",
                   help="folder for report.md, summary.json and stages.tar.gz (created)")
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
    return p


def plan_text(stages: Sequence[Stage], budget_s: float) -> str:
    """What ``--list`` prints: the stages in order with bounds, then their commands."""
    ctx = Ctx(python="python", work="WORK", tmp="TMP")
    lines = [f"{'stage':<11}{'bound':>7}{'min':>6}  what"]
    for s in stages:
        lines.append(f"{s.name:<11}{s.timeout_s:>5.0f} s{s.min_s:>4.0f} s  {s.title}")
    lines.append(f"budget {budget_s:.0f} s (--budget; {RESERVE_S:.0f} s kept for the report): a "
                 f"stage starts only with at least its min left, and is stopped at its bound "
                 f"or at the deadline, whichever comes first")
    lines.append("commands (WORK: the stages' files, packed into OUTDIR/stages.tar.gz):")
    for s in stages:
        for c in commands(s, ctx):
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
            out: Callable[[str], None] = say, grace_s: float = GRACE_S) -> int:
    """Run ``stages``, write the report into ``outdir``, print the paste block; exit status."""
    os.makedirs(outdir, exist_ok=True)
    work = os.path.join(outdir, "stages") if loose else tempfile.mkdtemp(prefix="ncclpy-st-")
    os.makedirs(work, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="ncclpy-st-tmp-")
    ctx = Ctx(python=python, work=work, tmp=tmp)
    t0 = time.monotonic()
    rec = RunRecord(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), command=command,
                    budget_s=budget_s, stages=[StageResult(s.name, s.title) for s in stages],
                    outdir=os.path.abspath(outdir))

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
                                          after_stage=save, grace_s=grace_s)
        rec.interrupted = interrupted
        save(results)
    except KeyboardInterrupt:       # between stages or while saving: keep what there is
        rec.interrupted = interrupted = True
        save(rec.stages)
    finally:
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
    out(f"[selftest] wrote {files} in {rec.outdir}")
    out("----- paste into docs/gpu-runs.md, under \"Runs\" -----")
    out(paste_block(rec).rstrip())
    out("----- end -----")
    out(verdict_line(rec))
    return exit_code(rec)


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
    try:
        stages = select(ns.stage)
    except ValueError as e:
        parser.error(f"--stage: {e}")
    if ns.list:
        say(plan_text(stages, ns.budget))
        return 0
    if not ns.outdir:
        parser.error("OUTDIR is required (the folder for the report), unless --list")
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
    old = signal.signal(signal.SIGTERM, _on_term)
    try:
        rc = execute(stages, ns.outdir, ns.budget, command=_display_command(args),
                     loose=ns.loose)
    except _Terminated:  # pragma: no cover - SIGTERM after the report was written
        rc = 130
    finally:
        signal.signal(signal.SIGTERM, old)
    return _term_status if rc == 130 and _term_status else rc
