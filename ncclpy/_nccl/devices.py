"""How many GPUs a process sees, asked without initialising CUDA in it (a forked rank could
not use CUDA then).  A fact of the machine that the rendezvous (a rank's device label), the
placement of ranks on GPUs (:mod:`ncclpy.launch.placement`) and the checks all need, so it lives
here, below all of them.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping, Optional

__all__ = ["visible_gpu_count"]

log = logging.getLogger(__name__)


def _count_cuda_visible(value: str) -> int:
    """Number of devices CUDA exposes for a CUDA_VISIBLE_DEVICES value.

    CUDA stops at the first invalid entry: ``""`` and ``"-1"`` mean none, ``"0,-1,1"`` means one.
    """
    n = 0
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        n += 1
    return n


def _nvml_device_count() -> Optional[int]:
    """GPU count from NVML (does not initialise CUDA, so it is fork-safe); None if unavailable."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
        get_count = getattr(lib, "nvmlDeviceGetCount_v2", None) or lib.nvmlDeviceGetCount
        if init() != 0:
            return None
        try:
            count = ctypes.c_uint(0)
            if get_count(ctypes.byref(count)) != 0:
                return None
            return int(count.value)
        finally:
            lib.nvmlShutdown()
    except Exception as e:  # pragma: no cover - depends on the driver
        log.debug("NVML device count failed: %s", e)
        return None


def _cuda_device_count() -> int:
    """GPU count from the CUDA runtime through CuPy; 0 without CuPy, driver or device."""
    try:
        from cupy.cuda import runtime
    except Exception as e:
        log.debug("CuPy unavailable for the device count: %s", e)
        return 0
    try:
        return int(runtime.getDeviceCount())
    except Exception as e:  # cudaErrorNoDevice, cudaErrorInsufficientDriver, ...
        log.debug("cudaGetDeviceCount failed: %s", e)
        return 0


def visible_gpu_count(env: Optional[Mapping[str, str]] = None) -> int:
    """How many GPUs a process started with ``env`` (default os.environ) sees; never raises.

    ``CUDA_VISIBLE_DEVICES`` is honoured when set (entries are counted, without touching CUDA);
    otherwise NVML is asked (no CUDA initialisation), then the CUDA runtime through CuPy.
    """
    env = os.environ if env is None else env
    try:
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        if cvd is not None:
            return _count_cuda_visible(cvd)
        n = _nvml_device_count()
        if n is not None:
            return n
        return _cuda_device_count()
    except Exception as e:  # pragma: no cover - defensive: never raise
        log.debug("visible_gpu_count failed: %s", e)
        return 0
