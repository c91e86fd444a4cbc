"""Real runs (``ncclpy check`` and friends, in subprocesses) that a test module starts together
and its tests share: tests/test_check_gloo.py, test_check_cpu_backend.py, test_check_exact.py,
test_check_report.py, test_check_launched.py, test_check_memory.py,
test_check_torch_backends.py and test_check_args.py.

Each such run starts fresh Python processes that import torch (2.5-4 s of CPU each on a 2-core
machine), and one after another they left a core idle a good part of the time.  A module names
its runs in one table (run name -> a callable that runs it and returns its result, usually a
:class:`subprocess.CompletedProcess`) and which runs each test reads; :class:`Runs` then

* starts every run the module's selected tests need as soon as the module's fixture is set up,
  ``PARALLEL`` at a time in the tests' order, while the tests before them assert (in a plain,
  serial pytest run; a pytest-xdist worker, which does not know which of the module's tests it
  will get, starts a run when a test first asks for it, so no run is started for nothing);
* runs each run once, however many tests read it (the same arguments, the same output);
* gives a test its run's result, or raises what the run raised (a timeout, say) in that test.

What each test asserts is unchanged: it reads the same process's output it used to start itself.
The runs' environments are computed when the table is built (in the main thread, before any
test changes ``os.environ``), never in a background thread.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytest

__all__ = ["ROOT", "PARALLEL", "Runs", "proc", "check_cmd", "module_runs"]

ROOT = Path(__file__).resolve().parents[1]
#: runs at once: each is itself several processes (a parent and its ranks), so two already
#: keep two cores busy; NCCLPY_TEST_CHECK_PARALLEL changes it (1: one after another)
PARALLEL = max(1, int(os.environ.get("NCCLPY_TEST_CHECK_PARALLEL", "2") or 2))

Runner = Callable[[], Any]


def check_cmd(*args: str) -> List[str]:
    """``python -m ncclpy check ARGS``."""
    return [sys.executable, "-m", "ncclpy", "check", *args]


def proc(cmd: Sequence[str], env: Mapping[str, str], timeout: float, **kw: Any) -> Runner:
    """A run of ``cmd`` in the repository root with ``env`` (computed now, by the caller),
    its output captured as text: ``subprocess.run``'s result, when called."""
    return partial(subprocess.run, list(cmd), cwd=kw.pop("cwd", ROOT), env=dict(env),
                   capture_output=True, text=True, timeout=timeout, **kw)


class Runs:
    """A module's named runs, each run once in a small thread pool (see the module docstring)."""

    def __init__(self, table: Mapping[str, Runner], where: Optional[Path] = None,
                 parallel: int = PARALLEL) -> None:
        self._table = dict(table)
        #: the runs' folder, where a run named NAME writes NAME.json (:meth:`json`)
        self.where = where
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="check-run")
        self._futures: Dict[str, Future] = {}

    def start(self, *names: str) -> None:
        """Queue ``names`` (those not queued yet), in this order."""
        for name in names:
            if name not in self._futures:
                self._futures[name] = self._pool.submit(self._table[name])

    def __getitem__(self, name: str) -> Any:
        """The run's result (queued now if it was not), or what it raised."""
        self.start(name)
        return self._futures[name].result()

    def json(self, name: str) -> Any:
        """The JSON the run ``name`` wrote to ``where/NAME.json`` (after it ended)."""
        self[name]
        assert self.where is not None
        return json.loads((self.where / f"{name}.json").read_text())

    def results(self, *names: str) -> Tuple[Any, ...]:
        """Several runs' results: all queued first, so that they run at once."""
        self.start(*names)
        return tuple(self[n] for n in names)

    def close(self) -> None:
        """Drop the runs not started yet; wait for those running (each has its timeout)."""
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)


def _in_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def module_runs(request: pytest.FixtureRequest, table: Mapping[str, Runner],
                needs: Mapping[str, Sequence[str]], where: Optional[Path] = None
                ) -> Iterator[Runs]:
    """The body of a module-scoped fixture: ``table``'s runs, those that the module's selected
    tests need (``needs``: a test's name, parametrized ``test_x[2]`` or plain ``test_x``, ->
    the runs it reads) started at once in the tests' order (not in a pytest-xdist worker);
    ``where``: the runs' folder (:attr:`Runs.where`)."""
    runs = Runs(table, where)
    if not _in_xdist_worker(request.config):
        wanted: List[str] = []
        for item in request.session.items:
            if getattr(item, "module", None) is not request.module:
                continue
            names = needs.get(item.name, needs.get(getattr(item, "originalname", ""), ()))
            wanted += [n for n in names if n not in wanted]
        runs.start(*wanted)
    try:
        yield runs
    finally:
        runs.close()

