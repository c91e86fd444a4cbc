"""ncclpy's benchmarks: ``python -m bench`` (nccl-tests-compatible sweeps) and
``python -m bench.overhead`` (host-side cost per call)."""
from typing import List

__all__: List[str] = []  # a namespace of submodules: bench.cli, bench.sweep, bench.overhead, ...
