"""A communicator over the ranks of an existing torch.distributed process group, no extra port.

``ncclpy.init(from_torch=group)`` (``group``: a ProcessGroup, or True / None for the default
group) makes rank r of ``group`` rank r of the communicator.  The NCCL unique id goes through the
store torch's default group was created with (under a prefix of its own per group, so several
groups and several ncclpy communicators never share a key), exactly as ``init()`` would through
ncclpy's store; that store then also carries checked mode and the watchdog's heartbeats.  Where
torch offers no way to reach that store, the id goes by ``broadcast_object_list`` within the
group instead, and the communicator has no store (checked mode is then refused, as with
``uid_exchange="mpi"``).

torch's NCCL and ncclpy may share a GPU, and the same tensors: they are separate NCCL
communicators (each its own channels and memory), ordered by the CUDA streams they run on
(``docs/reference/concepts/torch.rst``).  Everything up to the NCCL init runs on a CPU with gloo.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Tuple

from ..errors import ArgumentError, ArgumentTypeError, MissingDependencyError, RendezvousError
from .environment import RendezvousInfo

__all__ = ["bootstrap_from_torch", "torch_group", "GROUP_PREFIX"]

#: keys of a group's ncclpy communicators live under this prefix in torch's store
GROUP_PREFIX = "ncclpy/torch-group"

log = logging.getLogger(__name__)


def torch_group(group: Any) -> Tuple[Any, Any, int, int, str]:
    """(torch.distributed, the group, this process's rank in it, its size, a name for it);
    precise errors for an uninitialised torch.distributed, a non-group, a non-member."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise MissingDependencyError(f"from_torch: needs torch.distributed ({e})") from None
    if not dist.is_available() or not dist.is_initialized():
        raise RendezvousError("from_torch: torch.distributed is not initialised in this process; "
                              "call torch.distributed.init_process_group(...) first, or use "
                              "ncclpy.init() without from_torch")
    if group is None or group is True:
        group = dist.group.WORLD
    if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()) or (
            isinstance(group, int) and group == -100):   # what new_group gives a non-member
        raise ArgumentError(f"from_torch: this process (global rank {dist.get_rank()}) is not a "
                            f"member of the group (torch.distributed.new_group returned "
                            f"GroupMember.NON_GROUP_MEMBER here); only its members may make a "
                            f"communicator over it")
    if not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(f"from_torch: expected a torch.distributed ProcessGroup (or True "
                                f"for the default group), got {type(group).__name__} {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ArgumentError(f"from_torch: this process (global rank {dist.get_rank()}) is not a "
                            f"member of the group (ranks {dist.get_process_group_ranks(group)}); "
                            f"only its members may make a communicator over it")
    size = dist.get_world_size(group)
    name = str(getattr(group, "group_name", "") or "")
    if not name:
        name = "ranks-" + "-".join(map(str, dist.get_process_group_ranks(group)))
    return dist, group, rank, size, name


def _group_store(dist: Any, gname: str, timeout: float) -> Any:
    """torch's default store under this group's prefix, with ncclpy's store methods; None
    where this torch has no way to reach it (the uid then goes by broadcast)."""
    from torch.distributed import distributed_c10d as c10d
    get = getattr(c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        base = get()
    except Exception as e:  # noqa: BLE001 - a torch without it, or a group without a store
        log.debug("from_torch: no default store (%s: %s); the uid goes by broadcast",
                  type(e).__name__, e)
        return None
    from .torch_store import TorchStoreAdapter
    return TorchStoreAdapter(dist.PrefixStore(f"{GROUP_PREFIX}/{gname}/", base),
                             f"torch.distributed's store (group {gname})", timeout)


def _device(info: RendezvousInfo, device: Optional[int]) -> int:
    if device is not None:
        return int(device)
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())   # the device torch's ranks work on
    except Exception:  # noqa: BLE001 - no CUDA build: the local rank decides below
        pass
    from .bootstrap import _pick_device
    return _pick_device(info, explicit=False)


def bootstrap_from_torch(group: Any = None, name: str = "default", *, timeout: float = 300.0,
                         generation: Optional[int] = None, device: Optional[int] = None) -> Any:
    """A :class:`~ncclpy.bootstrap.Bootstrap` for the ranks of torch ``group`` (see the
    module docstring): the uid shared through the group's prefix of torch's store (or a broadcast in
    the group), the device torch's CUDA current device (else the local rank's)."""
    from .bootstrap import Bootstrap, exchange_uid
    dist, g, rank, size, gname = torch_group(group)
    local = int(os.environ.get("LOCAL_RANK", rank))
    info = RendezvousInfo(rank=rank, world_size=size, local_rank=local,
                          local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", size)),
                          master_addr=os.environ.get("MASTER_ADDR", "?"),
                          master_port=int(os.environ.get("MASTER_PORT", "0") or 0),
                          source=f"torch.distributed group {gname}", device=device,
                          store_kind="torch-group", store_from="torch.distributed's store")
    dev = _device(info, device)
    store = _group_store(dist, gname, timeout)
    if store is not None:
        uid, gen = exchange_uid(store, rank, name=name, generation=generation, timeout=timeout,
                                world_size=size)
        how = "store"
    else:
        uid, gen = _broadcast_uid(dist, g, gname, rank, name, generation)
        how = "torch-broadcast"
    log.debug("from_torch: %r generation %d: rank %d/%d of torch group %s, device %d, uid by %s",
              name, gen, rank, size, gname, dev, how)
    return Bootstrap(rank=rank, world_size=size, local_rank=local, device=dev, uid=uid,
                     name=name, generation=gen, store=store, info=info, uid_exchange=how)


_BCAST_GENERATIONS: dict = {}


def _broadcast_uid(dist: Any, g: Any, gname: str, rank: int, name: str,
                   generation: Optional[int]) -> Tuple[bytes, int]:
    """The uid from the group's rank 0 by ``broadcast_object_list`` (no store); every rank
    counts the communicators it made over the group, and rank 0 sends its count along."""
    key = (gname, name)
    gen = _BCAST_GENERATIONS.get(key, 0) + 1 if generation is None else int(generation)
    _BCAST_GENERATIONS[key] = gen
    box: list = [None]
    if rank == 0:
        from .bootstrap import get_unique_id
        box[0] = (get_unique_id(), gen)
    dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0), group=g)
    uid, root_gen = box[0]
    if root_gen != gen:
        raise RendezvousError(f"from_torch: communicator {name!r}: this rank is at generation "
                              f"{gen} but the group's rank 0 at {root_gen}; every rank must "
                              f"create the group's communicators in the same order")
    return uid, gen
