"""Cheaper process starts for tests that start many Python processes (issue 53), without
changing what those processes do.

* :func:`pytest_env` / :func:`pytest_environ`: the environment for a ``python -m pytest``
  subprocess with its bytecode cached.  Under ``PYTHONDONTWRITEBYTECODE=1`` pytest rewrites the
  asserts of every plugin package it loads (hypothesis, pytest-benchmark, xdist) and of every
  test module again in each process, ~1.3 s of CPU per start; with a bytecode cache of this
  process's own (``PYTHONPYCACHEPREFIX``, removed at exit: nothing is written beside the
  sources) a pytest after the first starts in about half that.  Bytecode caching is
  transparent: a cached file is used only while its source is unchanged.  Where the run has
  its own cache already (tests/conftest.py gives the whole suite's processes one), that one
  is kept and shared.
* :func:`run_together`: independent commands started together, each waited for with its own
  bound (instead of one after another).
* :func:`forked_jobs`: multi-rank jobs whose ranks are real processes forked from one
  interpreter that imported the heavy modules (torch) once, instead of one fresh interpreter
  per rank; each rank's stdout and stderr go to files of its own, as a subprocess's would.

Run as a script (``python tests/proc_speed.py SPEC``), this file is that forking interpreter.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
#: how many commands :func:`run_together` runs at once (more only queue for the cores)
MAX_AT_ONCE = 6

_CACHE: Dict[str, Any] = {"dir": None, "warm": False}
_LOCK = threading.Lock()


def pycache_dir() -> str:
    """This process's bytecode cache folder for its pytest subprocesses (removed at exit)."""
    with _LOCK:
        if _CACHE["dir"] is None:
            d = tempfile.mkdtemp(prefix="ncclpy-test-pyc-")
            atexit.register(shutil.rmtree, d, True)
            _CACHE["dir"] = d
        return _CACHE["dir"]


def pytest_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) for a pytest subprocess, bytecode cached (see the
    module docstring)."""
    out = dict(os.environ if env is None else env)
    if out.get("PYTHONPYCACHEPREFIX") and not out.get("PYTHONDONTWRITEBYTECODE"):
        return out                  # the run's own cache (tests/conftest.py): shared already
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    out["PYTHONPYCACHEPREFIX"] = pycache_dir()
    return out


@contextlib.contextmanager
def pytest_environ() -> Iterator[None]:
    """This process's environment as :func:`pytest_env` makes it, for the duration: for code
    under test that starts pytest with ``os.environ`` (``debt.collect_tests``)."""
    saved = {k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env = pytest_env()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = env["PYTHONPYCACHEPREFIX"]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_together(cmds: Sequence[Tuple[Sequence[str], Mapping[str, str]]], *, cwd: str,
                 timeout: float, warm_first: bool = False) -> List[subprocess.CompletedProcess]:
    """Run every ``(argv, env)`` of ``cmds`` (text output captured), up to
    :data:`MAX_AT_ONCE` at a time, each bounded by ``timeout``; their results in order.
    ``warm_first``: while this process's bytecode cache is still empty, run the first command
    alone first (so the others find the cache filled instead of each compiling everything)."""
    def one(cmd: Tuple[Sequence[str], Mapping[str, str]]) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd[0]), cwd=cwd, env=dict(cmd[1]), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    cmds = list(cmds)
    first: List[subprocess.CompletedProcess] = []
    if warm_first and cmds and not _CACHE["warm"]:
        first = [one(cmds[0])]
        cmds = cmds[1:]
        _CACHE["warm"] = True
    if not cmds:
        return first
    with ThreadPoolExecutor(max_workers=min(MAX_AT_ONCE, len(cmds))) as pool:
        return first + list(pool.map(one, cmds))


# -- ranks forked from one interpreter --------------------------------------------------------
@dataclass
class RankRun:
    """One forked rank: its exit code (negative: the signal that ended it), its output."""

    returncode: int
    stdout: str
    stderr: str


@dataclass
class JobRun:
    """One job: its ranks in order, and the seconds from the first fork to the last exit."""

    ranks: List[RankRun]
    seconds: float


def forked_jobs(target: str, jobs: Sequence[Sequence[Sequence[Any]]], folder: str, *,
                preload: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
                timeout: float = 240.0) -> List[JobRun]:
    """Run ``jobs`` one after another; a job is one argument list per rank, and its ranks run
    ``target(*args)`` (``module:function``, importable with ``env``'s PYTHONPATH) at once,
    each in a process forked from one interpreter that imported ``preload`` first.  A rank
    that outlives ``timeout`` (counted from its job's start) is killed (SIGKILL).  Files go to
    ``folder``."""
    os.makedirs(folder, exist_ok=True)
    spec = os.path.join(folder, "forked-jobs.json")
    with open(spec, "w") as f:
        json.dump({"target": target, "jobs": [[list(a) for a in job] for job in jobs],
                   "preload": list(preload), "folder": folder, "timeout": timeout}, f)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), spec], env=dict(
        env if env is not None else os.environ), capture_output=True, text=True,
        timeout=timeout * (len(jobs) + 1), stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"forked_jobs: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    out = []
    for j, job in enumerate(doc):
        ranks = []
        for r, code in enumerate(job["codes"]):
            base = os.path.join(folder, f"j{j}-r{r}")
            with open(base + ".out", errors="replace") as fo, \
                    open(base + ".err", errors="replace") as fe:
                ranks.append(RankRun(code, fo.read(), fe.read()))
        out.append(JobRun(ranks, job["seconds"]))
    return out


def _child(fn: Any, args: Sequence[Any], base: str) -> None:
    """In a forked rank: stdout and stderr to files, run, exit (never return to the loop)."""
    code = 1
    try:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            f = os.open(base + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        fn(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: B902 - reported through stderr and the exit code
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _zygote(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    for name in spec["preload"]:
        importlib.import_module(name)
    mod, _, qual = spec["target"].partition(":")
    fn: Any = importlib.import_module(mod)
    for part in qual.split("."):
        fn = getattr(fn, part)
    results = []
    for j, job in enumerate(spec["jobs"]):
        t0 = time.monotonic()
        pids = []
        for r, args in enumerate(job):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(fn, args, os.path.join(spec["folder"], f"j{j}-r{r}"))
            pids.append(pid)
        codes: Dict[int, int] = {}
        deadline = t0 + spec["timeout"]
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if len(codes) < len(pids):
                if time.monotonic() > deadline:
                    for pid in pids:
                        if pid not in codes:
                            os.kill(pid, signal.SIGKILL)
                            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                time.sleep(0.005)
        results.append({"codes": [codes[p] for p in pids],
                        "seconds": round(time.monotonic() - t0, 3)})
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    _zygote(sys.argv[1])
