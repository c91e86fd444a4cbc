"""The bench's result rows: :class:`Side` (one placement's time, bandwidths and #wrong) and
:class:`Row` (one size of one case on one series).  Their own module so that the writers
(:mod:`bench.output`) and the plot (:mod:`bench.plot`) both import them from below."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

__all__ = ["Side", "Row"]


@dataclass
class Side:
    """One half of a row: out-of-place or in-place."""

    time_us: float
    algbw: float
    busbw: float
    wrong: Optional[int]  # None: not checked (printed N/A, JSON null)
    #: -I 1: nccl-tests' per-iteration report of this side, keys as its JSON writes them
    #: (util.cu, writePerIterReport: skipped_iterations, min_us ... cv_pct, times_us and, with
    #: several processes, per_process_max_times_us); None without -I
    per_iter: Optional[Dict[str, Any]] = None


@dataclass
class Row:
    """One size of one (type, op, root) case: ``backend`` (ncclpy, cupy, torch) and, with
    ``--algo``/``--proto``, ``combo``: the algorithm/protocol combination its communicator was
    made with (``ring/simple``; "" without them)."""

    backend: str
    size: int
    count: int
    type: str        # nccl-tests type name ("float")
    dtype: str       # ncclpy dtype name ("float32")
    redop: str       # "sum", ..., or "none"
    root: int        # -1 where the collective has none
    oop: Side
    ip: Side
    iters: int = 0
    extra: Dict[str, object] = field(default_factory=dict)
    combo: str = ""

    @property
    def series(self) -> str:
        """What the row belongs to in the table, the ratios and the plot: the backend, and its
        combination when there is one (``ncclpy ring/simple``)."""
        return f"{self.backend} {self.combo}" if self.combo else self.backend
