"""``ncclpy.init``: bootstrap (rendezvous + uid exchange) and create the communicator; and
``ncclpy.grow_join``, a new rank's way into a grown one.

The caller's own argument mistakes are refused first, then a missing CuPy/NCCL or GPU, all
before the rendezvous, so peers are never kept waiting for a rank that cannot join.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from .._nccl.config import Config
from .._nccl.cuda import cuda
from .._nccl.lib import CudaUnavailableError, get_lib, require_version
from ..debug.watchdog import default_timeout, env_flag
from ..errors import ArgumentError, ArgumentTypeError, UnsupportedError
from .communicator import Communicator

__all__ = ["init", "INIT_KEYWORDS", "grow_join"]


def init(name: str = "default", config: Optional[Config] = None,
         timeout: Optional[float] = None, *, checked: Optional[bool] = None,
         watchdog: Optional[bool] = None, from_torch: Any = None, unique_ids: int = 1,
         **resolve_kwargs: Any) -> Communicator:
    """Bootstrap (rendezvous + uid exchange) and create the communicator; makes its device
    CuPy's current device.

    * ``name``: the communicator's name (its keys in the store; several per job may coexist).
    * ``config``: an :class:`ncclpy.Config` (NCCL's options), None for NCCL's defaults.
    * ``timeout`` (default ``$NCCLPY_TIMEOUT``, else 300 s) bounds the rendezvous,
      ``Work.wait()``, ``barrier()``, checked-mode checks and the watchdog.
    * ``checked`` / ``watchdog``: see :meth:`Communicator.from_bootstrap`.
    * ``unique_ids`` (default 1): more than one makes NCCL's bootstrap scale, with
      ``ncclCommInitRankScalable`` (NCCL >= 2.23) and that many ids made on ranks spread over
      the job, shared through the store (:mod:`ncclpy.rendezvous.scalable`).
    * ``from_torch``: a torch.distributed ProcessGroup (True: the default group): the ranks
      of that group, rank r of it rank r here, the uid through torch's own store, no port
      of ncclpy's (:mod:`ncclpy.rendezvous.torch_group`).  Rank, world size and store then
      come from torch: only ``device`` and ``generation`` may be given besides.
    * ``store``: any object with ncclpy's or torch's store methods (a ``TCPStore`` of either)
      instead of connecting to ncclpy's store at the rendezvous address; ``token``: that
      store's shared secret (default ``$NCCLPY_STORE_TOKEN``); ``uid_exchange``: "store"
      (default), "mpi" (``MPI_Bcast`` under mpirun, no store) or "auto".
    * ``rank``, ``world_size``, ``local_rank``, ``local_world_size``, ``master_addr``,
      ``master_port``, ``env``, ``device``, ``generation``: override what the environment says
      (:func:`ncclpy.resolve`).
    * ``device="cpu"`` (or ``$NCCLPY_DEVICE=cpu``, as ``ncclpy run --cpu`` sets it): the CPU
      backend (:mod:`ncclpy.cpu`): the same API on host buffers, NCCL's semantics without a
      GPU, for the whole process.

    Raises, before any rendezvous: ArgumentError / ArgumentTypeError for its own arguments,
    MissingDependencyError (no CuPy/libnccl), CudaUnavailableError (no GPU); then
    RendezvousError, or the NcclError of ``ncclCommInitRank``."""
    timeout = default_timeout(timeout)
    checked = env_flag("checked", checked, "NCCLPY_CHECKED", False)
    watchdog = env_flag("watchdog", watchdog, "NCCLPY_WATCHDOG", True)
    from ..rendezvous.bootstrap import _check_device_arg, bootstrap
    from ..cpu.backend import install
    _check_init_args(name, config, resolve_kwargs)  # the caller's own mistakes come first
    _check_device_arg(resolve_kwargs.get("device"), cpu_ok=True)
    on_cpu = _on_cpu(resolve_kwargs.get("device"), resolve_kwargs.get("env"))
    if on_cpu:
        resolve_kwargs["device"] = None     # each rank's label: its local rank
    from ..rendezvous.scalable import SCALABLE_FROM, check_unique_ids, exchange_unique_ids
    check_unique_ids(unique_ids)
    if from_torch is not None:
        extra = sorted(set(resolve_kwargs) - {"device", "generation"})
        if extra:
            raise ArgumentError(f"ncclpy.init: from_torch takes rank, world size and store from "
                                f"the torch group; drop {', '.join(extra)}")
        from ..rendezvous.torch_group import torch_group
        torch_group(from_torch)         # not a group, not initialised, not a member: say so now
    if on_cpu:       # after every argument check: a refused call leaves the process as it was
        install()
    lib = get_lib()  # a missing CuPy/NCCL is reported before any rendezvous
    if unique_ids > 1 and lib.version < SCALABLE_FROM:
        require_version("ncclCommInitRankScalable", lib.version, lib.path)
    if not on_cpu:
        _require_gpu(name)  # so is a missing GPU: peers are not kept waiting for a rank that cannot
    if from_torch is not None:
        from ..rendezvous.torch_group import bootstrap_from_torch
        bs = bootstrap_from_torch(from_torch, name, timeout=timeout, **resolve_kwargs)
    else:
        bs = bootstrap(name, timeout=timeout, **resolve_kwargs)
    if on_cpu:
        _one_machine(bs)
    if unique_ids > 1:
        bs.uids = exchange_unique_ids(bs, unique_ids, timeout)
    comm = Communicator.from_bootstrap(bs, config, timeout=timeout, checked=checked,
                                       watchdog=watchdog)
    cuda().use_device(comm.device)
    return comm


#: the keyword arguments init() passes on to bootstrap() and rendezvous.resolve()
INIT_KEYWORDS = ("store", "token", "generation", "uid_exchange", "rank", "world_size",
                 "local_rank", "master_addr", "master_port", "env", "local_world_size", "device")


def _check_init_args(name: Any, config: Any, kwargs: Dict[str, Any]) -> None:
    """init()'s own argument errors, before anything looks for a GPU or a peer."""
    import difflib
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"ncclpy.init: name must be a non-empty str, got {name!r}")
    if config is not None and not isinstance(config, Config):
        raise ArgumentTypeError(f"ncclpy.init: config must be an ncclpy.Config or None, got "
                                f"{config!r} ({type(config).__name__})")
    for key in kwargs:
        if key not in INIT_KEYWORDS:
            near = difflib.get_close_matches(key, INIT_KEYWORDS + (
                "timeout", "checked", "watchdog", "config", "name", "from_torch", "unique_ids"),
                n=1)
            raise ArgumentTypeError(f"ncclpy.init() got an unexpected keyword argument {key!r}"
                                    + (f"; did you mean {near[0]!r}?" if near else "")
                                    + f" (expected one of name, config, timeout, checked, "
                                      f"watchdog, from_torch, unique_ids, "
                                      f"{', '.join(INIT_KEYWORDS)})")
    from ..rendezvous.bootstrap import UID_EXCHANGES
    env = kwargs.get("env")
    env = os.environ if env is None else env
    choice = kwargs.get("uid_exchange")
    src = "uid_exchange"
    if choice is None and env.get("NCCLPY_UID_EXCHANGE", "").strip():
        choice, src = env["NCCLPY_UID_EXCHANGE"].strip(), "NCCLPY_UID_EXCHANGE"
    if choice is not None and (not isinstance(choice, str)
                               or choice.lower() not in UID_EXCHANGES):
        raise ArgumentError(f"ncclpy.init: {src}: expected one of {', '.join(UID_EXCHANGES)}, "
                            f"got {choice!r}")


def _on_cpu(device: Any, env: Optional[Mapping[str, str]]) -> bool:
    """Whether this ``init`` runs on the CPU backend: asked for (``device="cpu"``,
    ``NCCLPY_DEVICE=cpu``), or the process already runs there and nothing names a GPU.  A GPU
    named in a process on the CPU backend is refused in one line: a process runs on one of them
    (:func:`ncclpy.cpu.install` refuses the reverse)."""
    from ..cpu.backend import installed, wants_cpu
    if wants_cpu(device, env):
        return True
    if not installed():
        return False
    named, src = device, "device"
    if named is None:
        named = (os.environ if env is None else env).get("NCCLPY_DEVICE", "").strip() or None
        src = "NCCLPY_DEVICE"
    if named is None:
        return True
    raise ArgumentError(f"ncclpy.init: {src}={named!r}: this process runs on the CPU backend (an "
                        f"earlier ncclpy.init(device='cpu')), and a process runs either on the "
                        f"GPU or on the CPU backend, not both; give device='cpu' (or None), or "
                        f"run the GPU communicator in another process")


def _one_machine(bs: Any) -> None:
    """The CPU backend's ranks meet through shared memory: all must be on this machine (every
    rank sees the same local world size, so all refuse alike)."""
    info = bs.info
    if info.local_world_size != info.world_size:
        raise UnsupportedError(
            f"ncclpy.init(device='cpu'): the CPU backend runs on one machine (its ranks meet "
            f"through shared memory), but this job has {info.world_size} ranks and "
            f"{info.local_world_size} on this node; run every rank on one machine")


def _require_gpu(name: str) -> None:
    """Raise CudaUnavailableError, before the rendezvous, when this process sees no device
    (the reason in the words of ``ncclpy info``)."""
    try:
        n = cuda().device_count()
        why = "" if n > 0 else "the CUDA runtime reports 0 devices"
    except Exception as e:  # CUDARuntimeError: no driver, insufficient driver, ...
        why = f"{type(e).__name__}: {e}"
    if why:                 # say it as ncclpy info does ("no CUDA driver", not "insufficient")
        from ..info import gpu_device_reason
        try:
            why = gpu_device_reason() or why
        except Exception:  # noqa: BLE001 - keep the CUDA error
            pass
    if why:
        raise CudaUnavailableError(
            f"ncclpy.init({name!r}): no usable CUDA device ({why}); NCCL communicators need an "
            f"NVIDIA GPU with a working driver, so this rank did not join the rendezvous "
            f"(without a GPU: ncclpy.init(device='cpu') or ncclpy run --cpu, NCCL's semantics on "
            f"the CPU backend)")


def grow_join(world_size: int, rank: int, uid: bytes, *, device: Optional[int] = None,
              config: Optional[Config] = None, timeout: Optional[float] = None,
              name: str = "grown") -> Communicator:
    """``ncclCommGrow`` on a NEW rank (NCCL >= 2.29): join the communicator of
    ``world_size`` ranks that the existing ranks create with ``comm.grow`` as ``rank`` (one
    of the new ranks' numbers, after the existing ones), with the ``uid`` one existing rank
    made with ``comm.grow_unique_id()``.  ``device``: the CUDA device (default: the current
    one)."""
    # the work is membership's (Communicator._grow_join); it is defined here, where
    # Communicator is known, so that membership.py need not import communicator.py (issue 37)
    return Communicator._grow_join(world_size, rank, uid, device=device, config=config,
                                   timeout=timeout, name=name)
