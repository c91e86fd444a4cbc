"""How a pytest run of this suite uses the machine (``tests/conftest.py``'s
``pytest_cmdline_main`` asks): which runs are spread over the cores with pytest-xdist
(:func:`whole_suite_workers`), and the bytecode cache of the run's own processes
(:func:`bytecode_cache_env`)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

__all__ = ["WORKERS_ENV", "whole_suite_workers", "bytecode_cache_env"]

#: ``NCCLPY_TEST_WORKERS=N``: the whole suite's worker processes (0 or 1: one process)
WORKERS_ENV = "NCCLPY_TEST_WORKERS"


def whole_suite_workers(whole: bool, numprocesses: Optional[object], collectonly: bool,
                        markexpr: Optional[str], env: Mapping[str, str], cpus: int) -> int:
    """How many pytest-xdist workers a run gets (0: none, as pytest runs without it).

    Only the whole suite (``python -m pytest -q``: no paths, or just ``tests``) is spread, and
    only when nobody chose (``-n``); a run of some files, a collection, and any run that selects
    GPU tests (which share one GPU under a device-time budget) stay in one process.  The suite
    is CPU-bound in processes it starts, but about a third of a serial run leaves a core idle
    (waits, single-process tests): one worker per core uses it (docs/testing.md)."""
    if not whole or numprocesses is not None or collectonly or "gpu" in (markexpr or ""):
        return 0
    raw = env.get(WORKERS_ENV, "").strip()
    n = int(raw) if raw.isdigit() else min(cpus, 8)
    return n if n >= 2 else 0


def bytecode_cache_env(env: Mapping[str, str], folder: str) -> Dict[str, Optional[str]]:
    """The environment changes (name -> value; None: unset) that give a test run and every
    process it starts a bytecode cache of its own in ``folder``, or {} when nothing is to change.

    Under ``PYTHONDONTWRITEBYTECODE=1`` (set on some machines and CI images) no process ever
    writes bytecode, so in a fresh clone each of the ~2,000 Python processes the suite starts
    (ranks, CLIs, examples) compiles every ncclpy module it imports again: about 0.85 s of CPU
    per rank (measured: 1.2 s against 0.35 s for a rank's imports).  The cache lives in
    ``folder`` (``PYTHONPYCACHEPREFIX``), never beside the sources, so the tree stays as the
    variable asked; a cached file is used only while its source is unchanged (Python checks
    the source's size and modification time), so no test runs other code than its sources.
    Nothing changes where bytecode is written anyway, or where a cache folder is already
    chosen.  The folder stands in for every ``__pycache__``, site-packages' too, so a run
    compiles torch once into it: worth it for the whole suite only, which the caller decides."""
    if not env.get("PYTHONDONTWRITEBYTECODE") or env.get("PYTHONPYCACHEPREFIX"):
        return {}
    return {"PYTHONDONTWRITEBYTECODE": None, "PYTHONPYCACHEPREFIX": folder}
