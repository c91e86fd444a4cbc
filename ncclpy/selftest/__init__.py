"""``python -m ncclpy.selftest OUTDIR``: the one command that proves ncclpy on a GPU, in one
device call (default budget 480 s: every stage, leaving time in a 15-minute lease for a rerun).

Stages: ``info`` (versions), ``gpu2`` / ``worlds34`` (the GPU tests at 1-2 and 3-4 ranks),
``check2`` / ``check4`` (``ncclpy check --backend nccl`` bit for bit against torch), ``part2``,
``examples``, ``benchtests``, ``forensics``, and the timed ones, ``bench`` and ``overhead``.
``info`` runs first; the stages that time nothing then run side by side on the one GPU (``--jobs``
commands at once, their ranks within the machine's cores; one CUDA MPS daemon and a CTA limit
for all, :mod:`.gpuenv`), most GPU debt first; ``bench`` and ``overhead`` run alone at the end.
The GPU tests share a pool of rank processes per world size (``tests/rank_pool.py``).

After the run the GPU ledger (``docs/gpu-ledger.json``, :mod:`.ledger`) gets every test's
outcome, duration and the files it executed (:mod:`.filetrace`, :mod:`.ledger_plugin`), and
``python -m ncclpy.selftest --debt`` (no GPU, seconds, :mod:`.debt`) says what the current tree
has not proven on a GPU.  See ``docs/gpu-runs.md``.

Modules: :mod:`.stages` (what runs; pure), :mod:`.order` (the order), :mod:`.schedule` (side by
side, bounded), :mod:`.runner` (environment, reading a stage's files, packing), :mod:`.parse`,
:mod:`.report` (report, summary, paste block), :mod:`.record` (the run into the ledger),
:mod:`.probe` (GPU present? versions), :mod:`ncclpy.selftest.cli`.
"""
from __future__ import annotations

from .cli import main
from .stages import NAMES, STAGES, decide, select

__all__ = ["main", "NAMES", "STAGES", "select", "decide"]
