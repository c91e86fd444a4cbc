"""The memory ``ncclpy check``'s cases need, against what the machine has, before any rank
starts: a ``--sizes 1000GiB`` is refused in one line instead of failing in every rank.

The rule is a lower bound, so it never refuses a run that could fit.  Per rank and case, with
``in`` and ``out`` the bytes of the rank's input and output buffers (nccl-tests' per-rank block
convention, :mod:`.cases`):

* host memory: ``2*in + out`` -- the rank's seeded input, torch's copy of it, and the output
  read back (the reference output and the other ranks' blocks come on top and are not
  counted);
* GPU memory (``--backend nccl``): ``max(in, out)`` -- the larger of torch's two buffers.

The ranks run each case together, so a case needs the sum over the ranks on this machine (of
host memory) or on one GPU (of GPU memory); the run needs what its largest case needs.  The
host has its available RAM and free swap (and no more than a cgroup v2 limit leaves); a GPU its
total memory, read in a child process through the CUDA driver (this process never initialises
CUDA), and only where the need could matter.  :func:`shortfall` is the rule itself, with no
GPU and no probe: the machine's numbers are its arguments.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from ..semantics.dtypes import LOGICAL
from . import cases as C

__all__ = ["case_bytes", "Need", "largest_need", "shortfall", "host_memory", "gpu_memory",
           "check_memory", "human_bytes"]

#: below this per GPU the GPU's memory is not probed (every CUDA GPU has more)
GPU_PROBE_FROM = 1 << 30


def human_bytes(n: int) -> str:
    """``1.5 GiB``; bytes below 1 KiB as ``512 B``."""
    if n < 1024:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    k = min(int(math.log(n, 1024)), len(units))
    return f"{n / 1024 ** k:.1f} {units[k - 1]}"


def _elements(case: C.Case, n: int, rank: int) -> Tuple[int, int]:
    """(input, output) elements of ``rank``'s buffers for ``case`` (the torch side's)."""
    coll, c = case.collective, case.count
    if coll == "barrier":
        return 0, 0
    if coll == "all_gather":
        return c, n * c
    if coll == "gather":
        return c, n * c if rank == case.root else 0
    if coll in ("reduce_scatter", "scatter"):
        return n * c, c
    if coll == "all_to_all":
        if case.variant == "uneven":
            counts = C.uneven_counts(c, n)
            return sum(counts[rank]), sum(counts[s][rank] for s in range(n))
        return n * c, n * c
    return c, c                   # all_reduce, reduce, broadcast, send_recv


def case_bytes(case: C.Case, n: int, rank: int) -> Tuple[int, int]:
    """(host, GPU) bytes ``rank`` needs at least for ``case`` (the module's rule)."""
    ein, eout = _elements(case, n, rank)
    item = LOGICAL[case.dtype].itemsize if case.dtype else 1
    return item * (2 * ein + eout), item * max(ein, eout)


@dataclass(frozen=True)
class Need:
    """What the run's largest case needs: ``case``; ``per_rank`` (the most any rank needs);
    ``together`` (the sum over the ranks that share the resource)."""

    case: C.Case
    per_rank: int
    together: int


def largest_need(cases: Sequence[C.Case], n: int, sharing: int, gpu: bool) -> Optional[Need]:
    """The case needing the most host memory (``gpu`` False) or GPU memory (True) when
    ``sharing`` ranks share the host or one GPU (the ``sharing`` ranks needing least count:
    which ranks share is not known); None without cases."""
    best: Optional[Need] = None
    seen = set()
    for case in cases:
        if case.input_key in seen:
            continue
        seen.add(case.input_key)
        per = sorted(case_bytes(case, n, r)[1 if gpu else 0] for r in range(n))
        need = Need(case, per[-1], sum(per[:max(1, min(sharing, n))]))
        if best is None or need.together > best.together:
            best = need
    return best


def _what(need: Need, flag: str, value: str) -> str:
    """``--sizes 1000GiB: all_reduce of float32 at 1000GiB per block (... elements)``."""
    c = need.case
    at = f"{c.count} elements" if c.size_label.isdigit() else \
        f"{c.size_label} ({c.count} elements)"
    return f"{flag} {value}: {c.collective} of {c.dtype} at {at} per block"


def shortfall(cases: Sequence[C.Case], n: int, backend: str, flag: str, value: str, *,
              host_ranks: int, host_bytes: Optional[int], host_what: str = "",
              gpus: int = 0, gpu_bytes: Optional[int] = None) -> str:
    """Why the run cannot fit ('' if it may): the largest case against ``host_bytes`` for the
    ``host_ranks`` ranks on this host and, on the GPU path (backend nccl), against
    ``gpu_bytes`` per GPU with ``gpus`` GPUs for them.  None: not known, not checked.
    ``flag``, ``value``: the sizes' flag and value as typed (``--sizes``, ``1,1000GiB``)."""
    if backend == "nccl" and gpu_bytes is not None and gpus >= 1:
        per_gpu = -(-host_ranks // gpus)
        need = largest_need(cases, n, per_gpu, gpu=True)
        if need is not None and need.together > gpu_bytes:
            shared = (f", {human_bytes(need.together)} for the {per_gpu} ranks sharing a GPU"
                      if per_gpu > 1 else "")
            return (f"{_what(need, flag, value)} needs at least {human_bytes(need.per_rank)} "
                    f"of GPU memory per rank{shared}; the smallest GPU here has "
                    f"{human_bytes(gpu_bytes)}: expected smaller sizes")
    if host_bytes is not None:
        need = largest_need(cases, n, host_ranks, gpu=False)
        if need is not None and need.together > host_bytes:
            total = (f", {human_bytes(need.together)} for the {host_ranks} ranks on this "
                     f"machine" if host_ranks > 1 else "")
            return (f"{_what(need, flag, value)} needs at least {human_bytes(need.per_rank)} "
                    f"of host memory per rank{total}; this machine has "
                    f"{human_bytes(host_bytes)}{host_what}: expected smaller sizes")
    return ""


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory() -> Tuple[Optional[int], str]:
    """(bytes this machine can give a run now, what they are): RAM available plus free swap
    (/proc/meminfo), no more than a cgroup v2 limit leaves; (None, '') when unknown."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                parts = v.split()
                if parts and parts[0].isdigit():
                    info[k] = int(parts[0]) * 1024
    except OSError:
        return None, ""
    if "MemAvailable" not in info:
        return None, ""
    have = info["MemAvailable"] + info.get("SwapFree", 0)
    what = " (RAM available" + (" and free swap)" if info.get("SwapFree") else ")")
    limit = _read_int("/sys/fs/cgroup/memory.max")
    used = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None and limit - used < have:
        have, what = max(0, limit - used), " (left under its cgroup's memory.max)"
    return have, what


_GPU_PROBE = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
n = ctypes.c_int(0)
if cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0:
    sizes = []
    for i in range(n.value):
        dev, b = ctypes.c_int(0), ctypes.c_size_t(0)
        if cu.cuDeviceGet(ctypes.byref(dev), i) == 0 and \\
                cu.cuDeviceTotalMem_v2(ctypes.byref(b), dev) == 0:
            sizes.append(b.value)
    if sizes:
        print(min(sizes))
"""


def gpu_memory(env: Optional[Mapping[str, str]] = None, timeout: float = 60.0) -> Optional[int]:
    """The total memory of the smallest GPU a process started with ``env`` sees, read in a
    child process (this one never initialises CUDA); None when it cannot be read."""
    e = dict(os.environ if env is None else env)
    e.pop("CUDA_MPS_PIPE_DIRECTORY", None)     # the GPU's size, not an MPS server's view
    try:
        cp = subprocess.run([sys.executable, "-c", _GPU_PROBE], env=e, capture_output=True,
                            text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    out = cp.stdout.strip()
    return int(out) if cp.returncode == 0 and out.isdigit() and int(out) > 0 else None


def check_memory(cases: Sequence[C.Case], n: int, backend: str, flag: str, value: str,
                 host_ranks: int) -> str:
    """:func:`shortfall` with this machine's numbers ('' when the run may fit)."""
    host, what = host_memory()
    gpus, gmem = 0, None
    if backend == "nccl":
        from ..launch.placement import visible_gpu_count
        gpus = visible_gpu_count()
        if gpus >= 1:
            need = largest_need(cases, n, -(-host_ranks // gpus), gpu=True)
            if need is not None and need.together > GPU_PROBE_FROM:
                gmem = gpu_memory()
    return shortfall(cases, n, backend, flag, value, host_ranks=host_ranks, host_bytes=host,
                     host_what=what, gpus=gpus, gpu_bytes=gmem)
