"""Which GPU each local rank uses, and what NCCL needs when several ranks share one GPU.

Rules (``plan_placement``):

* the CPU backend (``ncclpy run --cpu``, ``spawn(device="cpu")``, or ``NCCLPY_DEVICE=cpu`` in
  the launcher's environment) -> mode ``"cpu"`` (:func:`plan_cpu`): every rank gets
  ``NCCLPY_DEVICE=cpu``; no GPU is looked for, no NCCL variable set, no MPS; one machine only
  (its ranks meet through shared memory).
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
* CTA limit (both shared modes).  NCCL's docs for ``NCCL_MULTI_RANK_GPU_ENABLE`` (env.rst, 2.30):
  "Each rank sharing a GPU allocates its own set of channels ... It is the user's responsibility
  to ensure that there are enough resources (SM, memory, etc) on the device to accommodate the
  need of all the ranks. Failing to do so will result in a hang in NCCL. With the default
  configuration, NCCL should be able to run up to 2 ranks per GPU. We also encourage the users to
  use NCCL_MAX_CTAS to limit the number of channels per rank".  NCCL launches one CTA per
  channel and clamps its channels to ``NCCL_MAX_CTAS``; a CTA runs on one SM.  So with R ranks on
  a GPU (the most on any GPU used): R <= 2 -> nothing is set (NCCL's defaults); R > 2 ->
  ``NCCL_MAX_CTAS = clamp(S // R, 1, cap)`` so that the R ranks' CTAs fit on the S SMs together
  (S = the smallest SM count of the visible GPUs, :data:`ASSUMED_SM_COUNT` when unknown; cap =
  NCCL's limit, 64 from 2.25, 32 before).  NCCL < 2.17 has no ``NCCL_MAX_CTAS``: the deprecated
  ``NCCL_MAX_NCHANNELS`` is set instead (both when the version is unknown).  The same limit is
  applied in ``"hostid-socket"`` mode: its ranks' kernels share the GPU's SMs in the same way.
  A user's ``NCCL_MAX_CTAS`` is kept.  A user's ``NCCL_MIN_CTAS`` (or ``NCCL_MIN_NCHANNELS``)
  above the limit raises the limit to it: NCCL 2.17 rejects min > max (ncclInvalidArgument) and
  later versions lower the min to the max, overriding the user; the summary says the limit was
  raised and may hang.

A variable the user already set in the environment is never overridden; the summary says so.
``ncclpy run`` and :func:`ncclpy.spawn` both state the choice in one line
(:func:`summary_line`) on stderr, with what :mod:`ncclpy.launch.mps` did about CUDA MPS.
Everything here but :func:`place` and the ``*_count`` / ``*_version`` probes is pure.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .._nccl.devices import visible_gpu_count
from ..errors import ArgumentError

__all__ = ["Placement", "plan_placement", "summary_line", "visible_gpu_count", "gpu_sm_count",
           "loaded_nccl_version", "place", "cta_limit", "with_mps", "MULTI_RANK_GPU_MIN_VERSION",
           "MAX_CTAS_MIN_VERSION", "SAFE_DEFAULT_RANKS_PER_GPU", "ASSUMED_SM_COUNT", "MODES",
           "SHARED_MODES", "plan_cpu", "cpu_requested", "CPU_DEVICE"]

log = logging.getLogger(__name__)

#: First NCCL version (code) that supports several ranks per GPU natively.
MULTI_RANK_GPU_MIN_VERSION = 23000
#: First NCCL version with ``NCCL_MAX_CTAS`` / ``NCCL_MIN_CTAS`` (before: ``*_NCHANNELS``).
MAX_CTAS_MIN_VERSION = 21700
#: First NCCL version whose CTA limit is 64 (32 before, per NCCL's env docs).
CTA_CAP_64_VERSION = 22500
#: Ranks per GPU that NCCL's defaults handle ("up to 2 ranks per GPU", NCCL's env docs).
SAFE_DEFAULT_RANKS_PER_GPU = 2
#: SM count assumed when it cannot be read (small on purpose: an NVIDIA A2 has 10 SMs).
ASSUMED_SM_COUNT = 8
MODES = ("one-per-gpu", "multi-rank-gpu", "hostid-socket", "no-gpu", "cpu")
#: ``NCCLPY_DEVICE``'s value for the CPU backend (:mod:`ncclpy.cpu`)
CPU_DEVICE = "cpu"
#: The modes in which several ranks share one GPU.
SHARED_MODES = ("multi-rank-gpu", "hostid-socket")
_SM_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Placement:
    """The result of :func:`plan_placement` for the ranks of one node.

    ``devices[r]`` is local rank r's device index; ``envs[r]`` the extra environment for local
    rank r (NCCL variables, and the MPS ones after :func:`with_mps`; the user's own settings are
    left out and listed in ``kept``).  ``ranks_per_gpu`` is the most ranks on any GPU used;
    ``max_ctas`` the CTA limit ncclpy set (None: none set); ``mps`` what was done about CUDA MPS
    (None until :func:`with_mps`); ``unset`` variables the ranks must not inherit.
    """

    nranks: int
    ngpus: int
    mode: str
    devices: tuple[int, ...]
    envs: tuple[dict[str, str], ...]
    summary: str
    nccl_version: Optional[int] = None
    kept: tuple[str, ...] = field(default=())
    ranks_per_gpu: int = 1
    max_ctas: Optional[int] = None
    mps: Optional[str] = None
    unset: tuple[str, ...] = field(default=())

    @property
    def cpu(self) -> bool:
        """True on the CPU backend: ``NCCLPY_DEVICE=cpu`` in ``envs``, no GPU index to set."""
        return self.mode == "cpu"

    @property
    def shared(self) -> bool:
        """True when several ranks share a GPU."""
        return self.mode in SHARED_MODES

    def device(self, local_rank: int) -> int:
        """Device index of ``local_rank``."""
        return self.devices[local_rank]

    def env(self, local_rank: int) -> dict[str, str]:
        """A copy of the extra environment for ``local_rank``."""
        return dict(self.envs[local_rank])


# Run in a child process so that this process never initialises CUDA (a forked rank could not
# use it then): the driver API through ctypes; attribute 16 is
# CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT.
_SM_PROBE = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
n = ctypes.c_int(0)
if cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0:
    counts = []
    for i in range(n.value):
        dev, v = ctypes.c_int(0), ctypes.c_int(0)
        if cu.cuDeviceGet(ctypes.byref(dev), i) == 0 and \\
                cu.cuDeviceGetAttribute(ctypes.byref(v), 16, dev) == 0:
            counts.append(v.value)
    if counts:
        print(min(counts))
"""


def gpu_sm_count(env: Optional[Mapping[str, str]] = None,
                 timeout: float = _SM_PROBE_TIMEOUT_S) -> Optional[int]:
    """The smallest SM (multiprocessor) count of the GPUs a process started with ``env`` sees,
    read in a short-lived child process (this process never initialises CUDA); None when it
    cannot be read (no driver, no GPU, timeout).  Never raises."""
    env = dict(os.environ if env is None else env)
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)    # ask the GPU, not an MPS server
    try:
        cp = subprocess.run([sys.executable, "-c", _SM_PROBE], env=env, capture_output=True,
                            text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        out = cp.stdout.strip()
        if cp.returncode == 0 and out.isdigit() and int(out) > 0:
            return int(out)
        log.debug("SM count probe: rc %s, stdout %r, stderr %r", cp.returncode, out,
                  cp.stderr[-300:])
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("SM count probe failed: %s", e)
    return None


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
    from ..semantics.ops import format_version
    return format_version(code)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def cta_limit(ranks_per_gpu: int, sm_count: Optional[int],
              nccl_version: Optional[int]) -> Optional[int]:
    """The ``NCCL_MAX_CTAS`` that lets ``ranks_per_gpu`` ranks' CTAs fit on one GPU together
    (see the module docstring); None when NCCL's defaults suffice (<= 2 ranks per GPU)."""
    if ranks_per_gpu <= SAFE_DEFAULT_RANKS_PER_GPU:
        return None
    sms = sm_count if sm_count and sm_count > 0 else ASSUMED_SM_COUNT
    cap = 64 if nccl_version is not None and nccl_version >= CTA_CAP_64_VERSION else 32
    return max(1, min(cap, sms // ranks_per_gpu))


def _cta_names(nccl_version: Optional[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(max variables, min variables) that this NCCL version reads."""
    if nccl_version is None:
        return ("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS"), ("NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS")
    if nccl_version >= MAX_CTAS_MIN_VERSION:   # *_NCHANNELS still honoured (deprecated)
        return ("NCCL_MAX_CTAS",), ("NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS")
    return ("NCCL_MAX_NCHANNELS",), ("NCCL_MIN_NCHANNELS",)


def _user_int(env: Mapping[str, str], name: str) -> Optional[int]:
    try:
        return int(str(env[name]).strip(), 0)
    except (KeyError, ValueError):
        return None


def _plan_ctas(per_gpu: int, sm_count: Optional[int], nccl_version: Optional[int],
               env: Mapping[str, str]) -> tuple[dict[str, str], Optional[int], list[str], str]:
    """The CTA variables to set, the limit set, the user's variables kept, the summary text."""
    limit = cta_limit(per_gpu, sm_count, nccl_version)
    if limit is None:
        return {}, None, [], ""
    max_names, min_names = _cta_names(nccl_version)
    sms = (f"{sm_count} SMs" if sm_count else
           f"SM count unknown, {ASSUMED_SM_COUNT} assumed")
    why = f"{per_gpu} ranks per GPU, {sms}"
    if per_gpu > (sm_count or ASSUMED_SM_COUNT):
        why += ": even 1 CTA per rank may not fit"
    user_max = [n for n in max_names if n in env]
    if user_max:   # any max the user set wins over ours (NCCL takes the lower of the two)
        kept = ", ".join(f"{n}={env[n]}" for n in user_max)
        return {}, None, user_max, f"kept the user's {kept} (ncclpy's limit: {limit}, {why})"
    mins = [(v, n) for n in min_names if (v := _user_int(env, n)) is not None]
    value, text = limit, f"={limit} ({why})"
    if mins and max(mins)[0] > limit:
        value, name = max(mins)
        text = (f"={value} (raised to the user's {name}={env[name]}: NCCL refuses or lowers a "
                f"min above the max; {why} call for <= {limit}, so ranks may hang)")
    label = max_names[0] if len(max_names) == 1 else "/".join(max_names)
    return {n: str(value) for n in max_names}, value, [], label + text


def plan_placement(nranks: int, ngpus: int, nccl_version: Optional[int], *,
                   ranks_per_gpu: Optional[int] = None, single_node: bool = True,
                   env: Optional[Mapping[str, str]] = None,
                   sm_count: Optional[int] = None) -> Placement:
    """Place ``nranks`` local ranks on ``ngpus`` visible GPUs; see the module docstring.

    ``sm_count`` is the smallest SM count of the GPUs (:func:`gpu_sm_count`), used for the CTA
    limit when more than 2 ranks share a GPU; None assumes :data:`ASSUMED_SM_COUNT`."""
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ArgumentError(f"nranks: expected a positive int, got {nranks!r}")
    if isinstance(ngpus, bool) or not isinstance(ngpus, int) or ngpus < 0:
        raise ArgumentError(f"ngpus: expected an int >= 0, got {ngpus!r}")
    if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool)
                                      or not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        raise ArgumentError(
            f"ranks_per_gpu: expected None or a positive int, got {ranks_per_gpu!r}")
    if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int)
                                 or sm_count < 1):
        raise ArgumentError(f"sm_count: expected None or a positive int, got {sm_count!r}")
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

    cta_env, max_ctas, cta_kept, cta_text = _plan_ctas(per_gpu, sm_count, nccl_version, env)
    if nccl_version is not None and nccl_version >= MULTI_RANK_GPU_MIN_VERSION:
        envs = []
        for _ in range(nranks):
            e: dict[str, str] = {}
            want("NCCL_MULTI_RANK_GPU_ENABLE", "1", e)
            envs.append({**e, **cta_env})
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
            envs.append({**e, **cta_env})
        mode = "hostid-socket"
        ver = ("NCCL version unknown" if nccl_version is None
               else f"NCCL {_fmt_version(nccl_version)} < 2.30")
        detail = f"hostid-socket: {ver}, distinct NCCL_HOSTID per rank, NCCL_NET=Socket"
        if single_node:
            detail += ", NCCL_SOCKET_IFNAME=lo"
    # NCCL's guard against NVLS with several ranks on a GPU (init.cc: hasMultiRankNvml) is set
    # by assignment inside a loop over rank pairs, so only the last pair counts; with
    # r mod G placement and G >= 2 that pair is on two GPUs and NVLS setup goes on (NCCL's
    # default on NVSwitch H100/H200).  So ncclpy turns NVLS off wherever ranks share a GPU.
    nvls_user = env.get("NCCL_NVLS_ENABLE")
    if nvls_user is None:
        for e in envs:
            e["NCCL_NVLS_ENABLE"] = "0"
    if cta_text and not cta_kept:
        detail += ", " + cta_text
    if nvls_user is None:
        detail += ", NCCL_NVLS_ENABLE=0"
    if kept:
        detail += "; kept the user's " + ", ".join(f"{k}={env[k]}" for k in kept)
    if cta_kept:
        detail += "; " + cta_text
    if nvls_user is not None:
        detail += f"; kept the user's NCCL_NVLS_ENABLE={nvls_user}"
        if mode == "multi-rank-gpu" and str(nvls_user).strip() == "1":
            detail += " (it makes NCCL fail init with several ranks per GPU; 0 is safe)"
        elif str(nvls_user).strip() != "0":
            detail += (" (NCCL's guard against NVLS with several ranks per GPU counts only "
                       "its last pair of ranks: NVLS may be set up on shared GPUs; 0 is safe)")
    rule = f", rank r -> GPU r mod {used}" if used > 1 else ""
    summary = f"placement: {where}{rule} ({detail}{over})"
    return Placement(nranks, ngpus, mode, devices, tuple(envs), summary, nccl_version,
                     tuple(kept + cta_kept), per_gpu, max_ctas)


def with_mps(placement: Placement, status: str, env: Optional[Mapping[str, str]] = None,
             unset: tuple[str, ...] = ()) -> Placement:
    """``placement`` with what was done about CUDA MPS: ``status`` (e.g. ``"started (...)"``)
    goes into the summary as ``"; MPS: {status}"``, ``env`` into every rank's environment, and
    the names in ``unset`` are removed from the ranks' inherited environment."""
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    return dataclasses.replace(
        placement, envs=tuple({**e, **extra} for e in placement.envs),
        summary=f"{placement.summary}; MPS: {status}", mps=status,
        unset=tuple(dict.fromkeys((*placement.unset, *unset))))


def place(nranks: int, *, ranks_per_gpu: Optional[int] = None, single_node: bool = True,
          env: Optional[Mapping[str, str]] = None) -> Placement:
    """:func:`plan_placement` with the facts read from this machine: the visible GPUs, the
    NCCL version (only when ranks share a GPU) and the SM count (only when more than 2 do)."""
    env = os.environ if env is None else env
    ngpus = visible_gpu_count(env)
    shares = ngpus > 0 and (nranks > ngpus or (ranks_per_gpu or 1) > 1)
    version = loaded_nccl_version() if shares else None
    plan = plan_placement(nranks, ngpus, version, ranks_per_gpu=ranks_per_gpu,
                          single_node=single_node, env=env)
    if plan.ranks_per_gpu > SAFE_DEFAULT_RANKS_PER_GPU:
        sms = gpu_sm_count(env)
        if sms is not None:
            plan = plan_placement(nranks, ngpus, version, ranks_per_gpu=ranks_per_gpu,
                                  single_node=single_node, env=env, sm_count=sms)
    return plan


def cpu_requested(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``env`` (default os.environ) already says ``NCCLPY_DEVICE=cpu``."""
    env = os.environ if env is None else env
    return str(env.get("NCCLPY_DEVICE", "")).strip().lower() == CPU_DEVICE


def _said(name: str, value: Any) -> str:
    """``name`` set to ``value`` as the user wrote it: ``--mps on``, ``NCCLPY_MPS=on``,
    ``mps='on'``."""
    if name.startswith("-"):
        return f"{name} {value}"
    return f"{name}={value}" if name.isupper() else f"{name}={value!r}"


def plan_cpu(nranks: int, *, why: str, from_env: bool = False, nnodes: int = 1,
             ranks_per_gpu: Optional[int] = None, mps: Optional[str] = None,
             names: Optional[Mapping[str, str]] = None) -> Placement:
    """Place ``nranks`` local ranks on the CPU backend: ``NCCLPY_DEVICE=cpu`` for each.

    ``why`` names who asked (``"--cpu"``, ``"device='cpu'"``, ``"NCCLPY_DEVICE=cpu"``;
    ``from_env``: it was the environment, which the summary says).  What cannot go with it is
    refused in one line (ArgumentError) naming the option as the caller spells it (``names``
    for ``nnodes``, ``ranks_per_gpu``, ``mps``): several machines (the ranks meet through shared
    memory on one), ranks per GPU, or MPS required (``mps``: the resolved mode).  Pure."""
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ArgumentError(f"nranks: expected a positive int, got {nranks!r}")
    nm = {"nnodes": "nnodes", "ranks_per_gpu": "ranks_per_gpu", "mps": "mps", **(names or {})}
    if nnodes != 1:
        raise ArgumentError(
            f"{nm['nnodes']}: the CPU backend ({why}) runs every rank on this machine (its "
            f"ranks meet through shared memory), so expected {_said(nm['nnodes'], 1)}, got "
            f"{_said(nm['nnodes'], nnodes)}")
    if ranks_per_gpu is not None:
        raise ArgumentError(
            f"{nm['ranks_per_gpu']}: the CPU backend ({why}) uses no GPU, so there is none to "
            f"share; leave {nm['ranks_per_gpu']} out (got "
            f"{_said(nm['ranks_per_gpu'], ranks_per_gpu)})")
    if mps == "on":
        raise ArgumentError(
            f"{nm['mps']}: the CPU backend ({why}) uses no GPU, so CUDA MPS has nothing to "
            f"serve; leave {nm['mps']} out or set {_said(nm['mps'], 'off')} (got "
            f"{_said(nm['mps'], 'on')})")
    src = ", from the environment" if from_env else ""
    return Placement(nranks, 0, "cpu", tuple(range(nranks)),
                     tuple({"NCCLPY_DEVICE": CPU_DEVICE} for _ in range(nranks)),
                     f"placement: {_plural(nranks, 'rank')} on the CPU backend (NCCLPY_DEVICE="
                     f"{CPU_DEVICE}{src}; no GPU used, not NCCL)")


def summary_line(who: str, placement: Placement, where: str = "") -> str:
    """The one line ``ncclpy run`` and :func:`ncclpy.spawn` print about the placement mode:
    ``"{who}: {where}{placement.summary}"``."""
    return f"{who}: {where}{placement.summary}"
