"""``python -m ncclpy.selftest OUTDIR``: the one command that proves ncclpy on a GPU.

Stages, most valuable first, each with its own time bound and all within a global budget
(default 540 s, under the device tool's 10-minute limit): ``info`` (versions, ``ncclpy info``),
``gpu2`` (GPU tests at world sizes 1-2), ``check2`` (``ncclpy check -n 2`` with NCCL, bit for bit
against torch), ``worlds34`` (GPU tests at 3-4 ranks), ``check4``, ``bench`` (the sweep at n=2:
ncclpy, cupy, torch, 8 B - 256 MiB), ``overhead``, ``examples``, ``benchtests``.  See
``docs/gpu-runs.md``.

Modules: :mod:`.stages` (what runs, selection, budget arithmetic), :mod:`.runner` (bounded
subprocesses), :mod:`.parse` (junit, check, bench and overhead files), :mod:`.report` (report,
summary, paste block), :mod:`.probe` (GPU present? versions), :mod:`ncclpy.selftest.cli`.
"""
from __future__ import annotations

from .cli import main
from .stages import NAMES, STAGES, decide, select

__all__ = ["main", "NAMES", "STAGES", "select", "decide"]
