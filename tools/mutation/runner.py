"""Run mutants: a copy of the checkout per worker, one mutant planted at a time, the target's
tests run against it (``pytest -x``); a failing test or a crash (a signal) kills it, a hang past
the time bound kills it (``timeout``), a green run means it survived; pytest's own errors
(internal, usage, no tests) are ``error``, never counted as killed."""
from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from .sites import Mutant, apply, find_mutants
from .targets import Target

__all__ = ["Outcome", "Workspace", "select", "run_target"]

_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


@dataclass
class Outcome:
    """What one mutant did: ``outcome`` is killed, timeout, survived, equivalent or error."""
    mutant: Mutant
    outcome: str
    by: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        m = self.mutant
        return {"id": m.id, "line": m.line, "func": m.func, "op": m.op, "before": m.before,
                "after": m.after, "outcome": self.outcome, "by": self.by,
                "seconds": round(self.seconds, 2)}


class Workspace:
    """A private copy of the checkout (tracked and untracked, not ignored files), so planted
    bugs never touch the real tree and subprocesses of the tests import the copy."""

    def __init__(self, root: str, where: str) -> None:
        self.root = os.path.abspath(root)
        self.dir = os.path.abspath(where)
        if os.path.exists(self.dir):
            shutil.rmtree(self.dir)
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                               cwd=self.root, check=True, capture_output=True).stdout
        for rel in filter(None, files.decode().split("\0")):
            src = os.path.join(self.root, rel)
            if not os.path.isfile(src):
                continue                                # deleted but not yet committed
            dst = os.path.join(self.dir, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
        self._tick = 0

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = self.dir + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("PYTEST_ADDOPTS", None)
        return env

    def write(self, rel: str, data: bytes) -> None:
        """Replace ``rel``; a fresh mtime each time, so no stale .pyc hides the change."""
        path = os.path.join(self.dir, rel)
        with open(path, "wb") as f:
            f.write(data)
        self._tick += 1
        t = time.time() + self._tick
        os.utime(path, (t, t))

    def pytest(self, tests: Sequence[str], timeout: float) -> tuple:
        """(return code or None on timeout, output, seconds) of the tests in the copy."""
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "--basetemp", os.path.join(self.dir, ".bt"), *tests]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=self.dir, env=self.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            rc: Optional[int] = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, _ = p.communicate()
            rc = None
        return rc, out.decode(errors="replace"), time.monotonic() - t0


def select(t: Target, source: bytes, seed: int, sample: Optional[int]) -> List[Mutant]:
    """The target's mutants, a seeded sample of ``sample`` (default: the target's) if more."""
    ms = find_mutants(source, t.funcs)
    n = t.sample if sample is None else sample
    if n and len(ms) > n:
        ms = sorted(random.Random(seed).sample(ms, n), key=lambda m: (m.line, m.start))
    return ms


def run_target(ws: Workspace, t: Target, mutants: Sequence[Mutant], equivalent: Dict[str, str],
               budget: float, note: Callable[[str], None]) -> dict:
    """Baseline, then each mutant; stops cleanly when ``budget`` seconds are spent."""
    tests = [x for x in t.tests if os.path.exists(os.path.join(ws.dir, x.split("::")[0]))]
    missing = sorted(set(t.tests) - set(tests))
    if not tests:
        raise SystemExit(f"mutation: no tests of {t.path} exist: {list(t.tests)}")
    orig = open(os.path.join(ws.dir, t.path), "rb").read()
    rc, out, base = ws.pytest(tests, timeout=900)
    if rc != 0:
        raise SystemExit(f"mutation: the tests of {t.path} fail without a mutant "
                         f"(exit {rc}):\n{out[-3000:]}")
    bound = max(3 * base, base + 30)
    note(f"{t.path}: baseline {base:.1f} s, {len(mutants)} mutants, bound {bound:.0f} s each")
    results: List[Outcome] = []
    start = time.monotonic()
    try:
        for i, m in enumerate(mutants):
            if m.id in equivalent:
                results.append(Outcome(m, "equivalent", equivalent[m.id]))
                continue
            if time.monotonic() - start > budget:
                note(f"budget spent after {i} mutants")
                break
            ws.write(t.path, apply(orig, m))
            rc, out, secs = ws.pytest(tests, timeout=bound)
            if rc is None:
                o = Outcome(m, "timeout", f"no end within {bound:.0f} s", secs)
            elif rc == 0:
                o = Outcome(m, "survived", "", secs)
            elif rc < 0:                        # the test process crashed: caught too
                o = Outcome(m, "killed", f"pytest killed by signal {-rc}", secs)
            elif rc in (1, 2):
                hit = _FAILED.search(out)
                o = Outcome(m, "killed", hit.group(1) if hit else f"exit {rc}", secs)
            else:
                o = Outcome(m, "error", f"pytest exit {rc}: {out[-300:]}", secs)
            results.append(o)
            note(f"[{i + 1}/{len(mutants)}] {o.outcome:9s} {m.line:4d} {m.func} "
                 f"{m.before[:40]!r} -> {m.after[:40]!r} {secs:.1f}s {o.by}")
    finally:
        ws.write(t.path, orig)
    return {"path": t.path, "tests": tests, "missing_tests": missing, "baseline_s": round(base, 1),
            "results": [r.as_dict() for r in results]}
