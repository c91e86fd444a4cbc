"""ncclpy without a GPU: NCCL's semantics on host memory (``ncclpy.init(device="cpu")``).

The engine (:mod:`ncclpy.cpu.engine`) plays libnccl and the CUDA runtime at ncclpy's native
boundary; everything above it is ncclpy's own code, as on a GPU.  It is for learning, testing
code written against ncclpy and debugging it; it is not NCCL and makes no performance claim.
"""
