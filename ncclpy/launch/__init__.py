"""Starting ranks: ``ncclpy run`` (launcher), :func:`ncclpy.spawn` (in-script), rank environment
(:mod:`.env`) and GPU placement (:mod:`.placement`).

Submodules are imported on use; importing this package loads nothing heavy.
"""
from __future__ import annotations

__all__: list[str] = []
