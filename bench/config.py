"""What one run of ``python -m bench`` is: :class:`SweepConfig`, built by
:func:`bench.cli.parse_args` and read by the sweep (:mod:`bench.sweep`) and rank 0's report
(:mod:`bench.report`), both of which import it from here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .combos import Combo
from .nccl_tests_flags import NcclTestsFlags

__all__ = ["SweepConfig"]


@dataclass(kw_only=True)
class SweepConfig(NcclTestsFlags):
    """Everything one run needs; picklable for spawn.  nccl-tests' -m, -N, -z, -p, -C, -S are
    the fields of :class:`~bench.nccl_tests_flags.NcclTestsFlags` (their meanings are there)."""

    collectives: List[str]
    sizes: List[int]
    minbytes: int = 32 << 20
    maxbytes: int = 32 << 20
    stepbytes: int = 1 << 20
    stepfactor: int = 1
    iters: int = 20
    warmup_iters: int = 1
    check: int = 1
    ops: List[str] = field(default_factory=lambda: ["sum"])
    dtypes: List[str] = field(default_factory=lambda: ["float32"])
    root: int = 0                       # -1: every root
    cudagraph: int = 0
    average: int = 1
    output_file: Optional[str] = None
    nproc: Optional[int] = None
    backends: List[str] = field(default_factory=lambda: ["torch"])
    device: str = "cpu"
    timer: str = "host"
    csv: Optional[str] = None
    plot: Optional[str] = None
    timeout: float = 300.0
    quiet: bool = False
    #: test-only: rank -> how many of its checked output's elements to corrupt (--test-corrupt)
    test_corrupt: Dict[int, int] = field(default_factory=dict)
    #: --algo x --proto: one communicator per combination (bench/combos.py); [] when not given
    combos: List[Combo] = field(default_factory=list)
    #: --repeat-bits N: the bits column's call made N times (0: once)
    repeat_bits: int = 0
    #: --predict: NCCL's estimate column
    predict: bool = False
    #: -R (0 none, 1 ncclCommRegister, 2 windows), -M, --cta-policy: the ncclpy backend's
    register: int = 0
    memory_report: bool = False
    cta_policy: Optional[str] = None
    #: -T given: the bound on each stream synchronisation (None: unbounded)
    sync_timeout: Optional[float] = None
    argv: List[str] = field(default_factory=list)
    #: where spawned ranks leave their (agreed) exit status, so that a verdict the footer
    #: already explained is not reported as a crashed rank
    result_file: Optional[str] = None

    @property
    def collective(self) -> str:
        return self.collectives[0]

    @property
    def bits(self) -> bool:
        """Whether the table has the bits column (--algo, --proto or --repeat-bits given)."""
        return bool(self.combos) or self.repeat_bits > 0
