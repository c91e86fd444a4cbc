"""Run ``python -m MODULE ARGS`` from the repository root as a user does (tests' helper)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

__all__ = ["run_module", "ROOT"]

ROOT = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: str, timeout: float = 120,
               env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """The finished process (text output captured); ``env``: variables added to this
    process's; ``NCCL_TESTS_MIN_BW`` is left out so the bench's bandwidth floor never fails a
    test by accident."""
    extra, env = env, dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("NCCL_TESTS_MIN_BW", None)
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
