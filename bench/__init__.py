"""ncclpy's benchmarks: ``python -m bench`` (nccl-tests-compatible sweeps) and
``python -m bench.overhead`` (host-side cost per call)."""
