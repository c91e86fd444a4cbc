"""Which runs of the suite are spread over the cores with pytest-xdist (``tests/conftest.py``'s
``pytest_cmdline_main`` asks :func:`whole_suite_workers`)."""
from __future__ import annotations

from typing import Mapping, Optional

__all__ = ["WORKERS_ENV", "whole_suite_workers"]

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
