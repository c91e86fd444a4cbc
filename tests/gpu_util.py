"""Helpers for GPU tests: skip with a reason where CUDA or NCCL is absent."""
from __future__ import annotations

import functools

import pytest

__all__ = ["cuda_reason", "requires_gpu", "gpu_count"]


@functools.lru_cache(maxsize=1)
def cuda_reason() -> str:
    """Empty string when a CUDA GPU and NCCL are usable, else why not: the reason
    ``ncclpy info`` gives (``ncclpy.info.no_gpu_reason``) where ncclpy has it."""
    try:
        from ncclpy.info import no_gpu_reason
    except ImportError:
        pass
    else:
        try:
            return no_gpu_reason()
        except Exception as e:  # pragma: no cover - a broken install is a reason too
            return f"ncclpy cannot tell ({type(e).__name__}: {e})"
    try:
        import cupy
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"CuPy is not installed ({e}); install ncclpy[cu12] or ncclpy[cu13]"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return "no CUDA device visible"
    try:
        from cupy.cuda import nccl
        if not nccl.available:
            return "CuPy cannot load NCCL"
    except Exception as e:  # pragma: no cover
        return f"NCCL unavailable ({e})"
    return ""


def gpu_count() -> int:
    if cuda_reason():
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def requires_gpu(fn):
    """Mark a test ``gpu`` and skip it, with the reason, where CUDA is absent."""
    fn = pytest.mark.gpu(fn)
    return pytest.mark.skipif(bool(cuda_reason()), reason=cuda_reason() or "CUDA present")(fn)
