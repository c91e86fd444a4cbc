"""Which GPU each local rank uses, and what NCCL needs when several ranks share one GPU.

Rules (``plan_placement``):

* no visible GPU -> mode ``"no-gpu"``: device index = local rank, no NCCL variables (CPU-only
  programs and tests still get a consistent ``NCCLPY_DEVICE``).
* ranks fit one per GPU (and ``ranks_per_gpu`` is None or 1) -> ``"one-per-gpu"``: rank r -> GPU r.
* more ranks than GPUs, or ``ranks_per_gpu=R > 1`` -> rank r -> GPU ``r mod G``, where G is the
  number of GPUs used: all visible ones, or with R only ``ceil(nranks / R)`` of them (fewer
  GPUs, each shared by R ranks; more ranks than R x visible GPUs wrap around), and NCCL is told
  that ranks share a GPU:
  - NCCL >= 2.30: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` -> ``"multi-rank-gpu"``;
  - older (or unknown) NCCL: a distinct ``NCCL_HOSTID`` per rank so each rank looks like its own
    host, ``NCCL_NET=Socket``, and on a single node ``NCCL_SOCKET_IFNAME=lo`` ->
    ``"hostid-socket"``.

A variable the user already set in the environment is never overridden; the summary says so.
``ncclpy run`` and :func:`ncclpy.spawn` both state the choice in one line
(:func:`summary_line`) on stderr.
"""
from __future__ import annotations

import ctypes
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..errors import ArgumentError

__all__ = ["Placement", "plan_placement", "summary_line", "visible_gpu_count",
           "loaded_nccl_version", "MULTI_RANK_GPU_MIN_VERSION", "MODES", "SHARED_MODES"]

log = logging.getLogger(__name__)

#: First NCCL version (code) that supports several ranks per GPU natively.
MULTI_RANK_GPU_MIN_VERSION = 23000
MODES = ("one-per-gpu", "multi-rank-gpu", "hostid-socket", "no-gpu")
#: The modes in which several ranks share one GPU.
SHARED_MODES = ("multi-rank-gpu", "hostid-socket")


@dataclass(frozen=True)
class Placement:
    """The result of :func:`plan_placement` for the ranks of one node.

    ``devices[r]`` is local rank r's device index; ``envs[r]`` the extra environment for local
    rank r (NCCL variables only; the user's own settings are left out and listed in ``kept``).
    """

    nranks: int
    ngpus: int
    mode: str
    devices: tuple[int, ...]
    envs: tuple[dict[str, str], ...]
    summary: str
    nccl_version: Optional[int] = None
    kept: tuple[str, ...] = field(default=())

    def device(self, local_rank: int) -> int:
        """Device index of ``local_rank``."""
        return self.devices[local_rank]

    def env(self, local_rank: int) -> dict[str, str]:
        """A copy of the extra environment for ``local_rank``."""
        return dict(self.envs[local_rank])


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


def loaded_nccl_version() -> Optional[int]:
    """The runtime version code of the libnccl CuPy loads (e.g. 23203), None when unavailable."""
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            return None
        return int(nccl.get_version())
    except Exception as e:
        log.debug("NCCL version unavailable: %s", e)
        return None


def _fmt_version(code: int) -> str:
    from ..ops import format_version
    return format_version(code)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def plan_placement(nranks: int, ngpus: int, nccl_version: Optional[int], *,
                   ranks_per_gpu: Optional[int] = None, single_node: bool = True,
                   env: Optional[Mapping[str, str]] = None) -> Placement:
    """Place ``nranks`` local ranks on ``ngpus`` visible GPUs; see the module docstring."""
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ArgumentError(f"nranks: expected a positive int, got {nranks!r}")
    if isinstance(ngpus, bool) or not isinstance(ngpus, int) or ngpus < 0:
        raise ArgumentError(f"ngpus: expected an int >= 0, got {ngpus!r}")
    if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool)
                                      or not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        raise ArgumentError(
            f"ranks_per_gpu: expected None or a positive int, got {ranks_per_gpu!r}")
    env = os.environ if env is None else env
    ranks = _plural(nranks, "rank")

    if ngpus == 0:
        return Placement(nranks, 0, "no-gpu", tuple(range(nranks)),
                         tuple({} for _ in range(nranks)),
                         f"placement: {ranks}, no GPU visible (no-gpu: NCCLPY_DEVICE=local rank, "
                         f"no NCCL variables set)", nccl_version)

    gpus = ngpus
    if ranks_per_gpu and ranks_per_gpu > 1:
        gpus = min(ngpus, -(-nranks // ranks_per_gpu))   # ceil: R ranks on each GPU used
    devices = tuple(r % gpus for r in range(nranks))
    used = len(set(devices))
    per_gpu = max(devices.count(d) for d in set(devices))
    where = f"{ranks} on {_plural(used, 'GPU')}"
    if used < ngpus:
        where += f" of {ngpus}"

    if per_gpu == 1:
        return Placement(nranks, ngpus, "one-per-gpu", devices, tuple({} for _ in range(nranks)),
                         f"placement: {where} (one-per-gpu: rank r -> GPU r)", nccl_version)

    over = ""
    if ranks_per_gpu and ranks_per_gpu > 1 and per_gpu > ranks_per_gpu:
        over = f"; {nranks} ranks exceed {ranks_per_gpu} per GPU x {ngpus} GPUs, so GPUs wrap"
    kept: list[str] = []

    def want(name: str, value: str, out: dict[str, str]) -> None:
        if name in env:
            if name not in kept:
                kept.append(name)
        else:
            out[name] = value

    if nccl_version is not None and nccl_version >= MULTI_RANK_GPU_MIN_VERSION:
        envs = []
        for _ in range(nranks):
            e: dict[str, str] = {}
            want("NCCL_MULTI_RANK_GPU_ENABLE", "1", e)
            envs.append(e)
        mode = "multi-rank-gpu"
        detail = (f"multi-rank-gpu: NCCL {_fmt_version(nccl_version)} >= 2.30, "
                  f"NCCL_MULTI_RANK_GPU_ENABLE=1")
    else:
        tag = uuid.uuid4().hex[:12]
        envs = []
        for r in range(nranks):
            e = {}
            want("NCCL_HOSTID", f"ncclpy-{tag}-{r}", e)
            want("NCCL_NET", "Socket", e)
            if single_node:
                want("NCCL_SOCKET_IFNAME", "lo", e)
            envs.append(e)
        mode = "hostid-socket"
        ver = ("NCCL version unknown" if nccl_version is None
               else f"NCCL {_fmt_version(nccl_version)} < 2.30")
        detail = f"hostid-socket: {ver}, distinct NCCL_HOSTID per rank, NCCL_NET=Socket"
        if single_node:
            detail += ", NCCL_SOCKET_IFNAME=lo"
    if kept:
        detail += "; kept the user's " + ", ".join(f"{k}={env[k]}" for k in kept)
    rule = f", rank r -> GPU r mod {used}" if used > 1 else ""
    summary = f"placement: {where}{rule} ({detail}{over})"
    return Placement(nranks, ngpus, mode, devices, tuple(envs), summary, nccl_version, tuple(kept))


def summary_line(who: str, placement: Placement, where: str = "") -> str:
    """The one line ``ncclpy run`` and :func:`ncclpy.spawn` print about the placement mode:
    ``"{who}: {where}{placement.summary}"``."""
    return f"{who}: {where}{placement.summary}"
