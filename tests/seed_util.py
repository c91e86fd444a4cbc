"""Where the tests find the seed tutorials (``shared/seeds``: README.md and the tutorial texts).

Order: ``$NCCLPY_SEEDS``; the workspace copy beside the checkout (``<repo>/../shared/seeds``);
the snapshot committed in ``tests/seeds`` (so a clone anywhere, CI included, still checks every
example against the tutorials).  ``test_seed_snapshot_matches_the_workspace`` keeps the snapshot
byte-identical to the workspace copy wherever both exist.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["ROOT", "SNAPSHOT", "workspace_seeds", "seeds_dir"]

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "seeds"


def workspace_seeds() -> Optional[Path]:
    """The workspace's own seeds directory (``$NCCLPY_SEEDS`` or ``../shared/seeds``), if any."""
    env = os.environ.get("NCCLPY_SEEDS")
    d = Path(env) if env else ROOT.parent / "shared" / "seeds"
    return d if (d / "README.md").is_file() else None


def seeds_dir() -> Path:
    """The workspace seeds when present, else the committed snapshot (asserted complete)."""
    d = workspace_seeds()
    if d is not None:
        return d
    env = os.environ.get("NCCLPY_SEEDS")
    assert not env, f"NCCLPY_SEEDS={env!r} has no README.md"
    assert (SNAPSHOT / "README.md").is_file(), f"the seed snapshot {SNAPSHOT} is missing"
    return SNAPSHOT
