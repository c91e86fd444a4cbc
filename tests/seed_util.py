"""Where the tests find the seed tutorials (README.md and the tutorial texts).

Order: ``$NCCLPY_SEEDS`` (a directory holding README.md; a path without one fails the seed tests,
naming it); the workspace copy beside the checkout (``<repo>/../shared/seeds``); the snapshot
committed in ``tests/seeds`` (so a clone anywhere, CI included, still checks every example
against the tutorials).  ``NCCLPY_SEEDS=none`` means "no workspace copy": the snapshot alone is
used and ``test_seed_snapshot_matches_the_workspace`` skips, saying so.  That test keeps the
snapshot byte-identical to the workspace copy wherever both exist.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["ROOT", "SNAPSHOT", "NONE", "workspace_seeds", "seeds_dir"]

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "seeds"
#: the ``NCCLPY_SEEDS`` value that turns the workspace copy off
NONE = "none"


def _env() -> str:
    return os.environ.get("NCCLPY_SEEDS", "").strip()


def workspace_seeds() -> Optional[Path]:
    """The workspace's own seeds directory (``$NCCLPY_SEEDS`` or ``../shared/seeds``), if any;
    None with ``NCCLPY_SEEDS=none``."""
    env = _env()
    if env.lower() == NONE:
        return None
    d = Path(env) if env else ROOT.parent / "shared" / "seeds"
    return d if (d / "README.md").is_file() else None


def seeds_dir() -> Path:
    """The workspace seeds when present, else the committed snapshot (asserted complete).

    ``NCCLPY_SEEDS`` set to a directory without README.md is a mistake, reported (naming the
    path) rather than quietly replaced by the snapshot."""
    d = workspace_seeds()
    if d is not None:
        return d
    env = _env()
    assert not env or env.lower() == NONE, (
        f"NCCLPY_SEEDS={env!r}: no README.md there; expected the seeds directory, or "
        f"NCCLPY_SEEDS={NONE} for the snapshot {SNAPSHOT}")
    assert (SNAPSHOT / "README.md").is_file(), f"the seed snapshot {SNAPSHOT} is missing"
    return SNAPSHOT
