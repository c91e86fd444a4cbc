"""A test module's slow commands (``python -m bench`` runs: real rank processes, each importing
numpy or torch) started in the background, a few at once, when the module's first test starts;
each test then waits for the runs it reads (tests' helper, issue 53).

Why: the suite is CPU-bound in the processes it starts, and a bench run spends much of its time
in imports and in ranks waiting on each other; run one after another they leave a core idle,
run together (and beside the module's in-process tests) they do not.  Nothing a test asserts
changes: each test reads the very command it ran before, with the environment the module
started with (a test's ``monkeypatch.setenv`` never reaches a run started in the background).

Only the jobs of the module's selected tests are started (``-k`` selects fewer).  Under
pytest-xdist a module's jobs run ahead only with ``--dist loadgroup`` (the whole suite's, see
tests/conftest.py), which keeps the module's tests on one worker (the modules using this are
marked ``xdist_group``), one job at a time beside the worker's tests where there are as many
workers as cores; with any other ``--dist``, or with ``NCCLPY_TEST_PREFETCH=0``, nothing runs
ahead: each job runs when a test first asks for it, as before.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Set, Union

import pytest

from module_run import ROOT

__all__ = ["Commands", "Job", "Jobs", "PREFETCH_ENV", "start_jobs"]

#: ``NCCLPY_TEST_PREFETCH=N``: at most N jobs at once (0: none ahead of its test)
PREFETCH_ENV = "NCCLPY_TEST_PREFETCH"


class Commands:
    """Runs commands as :func:`module_run.run_module` and :func:`subprocess.run` do (text output
    captured, the child killed at ``timeout``), with the environment of the moment this object
    was made; :meth:`kill_all` ends those still running."""

    def __init__(self) -> None:
        self.env: Dict[str, str] = dict(os.environ)
        self._running: Set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False

    def run(self, argv: Sequence[str], *, cwd: Union[str, Path] = ROOT, timeout: float = 120,
            env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, cwd=cwd, env=env or the snapshot, capture_output=True,
        text=True, timeout=timeout)``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the module's jobs were closed")
            p = subprocess.Popen(list(argv), cwd=cwd, env=dict(env if env is not None
                                                                 else self.env),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._running.add(p)
        try:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise
        finally:
            with self._lock:
                self._running.discard(p)
        return subprocess.CompletedProcess(list(argv), p.returncode, out, err)

    def module_env(self, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """:func:`module_run.run_module`'s environment: the checkout first on ``PYTHONPATH``,
        no ``NCCL_TESTS_MIN_BW``."""
        env = dict(self.env)
        env.update(extra or {})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env.pop("NCCL_TESTS_MIN_BW", None)
        return env

    def module(self, module: str, *args: str, timeout: float = 120,
               env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
        """:func:`module_run.run_module` (``python -m MODULE ARGS`` from the checkout)."""
        return self.run([sys.executable, "-m", module, *args], cwd=ROOT, timeout=timeout,
                        env=self.module_env(env))

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._running)
        for p in running:
            if p.poll() is None:
                p.kill()


@dataclass
class Job:
    """``fn()``'s result, read by the test functions named in ``tests``; with ``when``, None
    where ``when()`` is false (asked when the job starts, not when the module does: a test
    that skips where ``when()`` is false runs nothing)."""

    fn: Callable[[], Any]
    tests: Sequence[str]
    when: Optional[Callable[[], bool]] = None

    def __call__(self) -> Any:
        if self.when is not None and not self.when():
            return None
        return self.fn()


class Jobs:
    """The module's jobs by name; ``jobs[name]`` waits for one (running it here and now if it
    was not started ahead) and returns its result, or raises what it raised."""

    def __init__(self, jobs: Mapping[str, Job], commands: Commands, workers: int,
                 selected: Set[str]) -> None:
        self._jobs = dict(jobs)
        self._commands = commands
        self._done: Dict[str, cf.Future] = {}
        self._lock = threading.Lock()
        self._pool = (cf.ThreadPoolExecutor(workers, thread_name_prefix="bench-job")
                      if workers > 0 else None)
        if self._pool is not None:
            for name, job in self._jobs.items():           # in the module's order
                if set(job.tests) & selected:
                    self._done[name] = self._pool.submit(job)

    def __getitem__(self, name: str) -> Any:
        with self._lock:
            fut = self._done.get(name)
            if fut is None:                         # not started ahead: run it here, once
                job = self._jobs[name]
                fut = self._done[name] = cf.Future()
                mine = True
            else:
                mine = False
        if mine:
            try:
                fut.set_result(job())
            except BaseException as e:              # kept, as a pool's future keeps it
                fut.set_exception(e)
        return fut.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._commands.kill_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _workers(config: pytest.Config) -> int:
    raw = os.environ.get(PREFETCH_ENV, "").strip()
    if raw.isdigit():
        return int(raw)
    cpus = len(os.sched_getaffinity(0))
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return cpus + 1
    if not getattr(config.option, "loadgroup", False):     # xdist's worker: --dist loadgroup?
        return 0                      # no: the module's tests may run on several workers
    return max(1, cpus // max(1, int(workerinput.get("workercount", 1))))


def start_jobs(request: pytest.FixtureRequest,
               make: Callable[[Commands], Mapping[str, Job]]) -> Iterator[Jobs]:
    """For a module-scoped fixture: ``yield from start_jobs(request, make)`` starts ``make``'s
    jobs of the module's selected tests and ends any still running after the module."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items
                if getattr(item, "module", None) is request.module}
    commands = Commands()
    jobs = Jobs(make(commands), commands, _workers(request.config), selected)
    try:
        yield jobs
    finally:
        jobs.close()
