"""The rendezvous environment of one rank, shared by ``ncclpy run`` and :func:`ncclpy.spawn`.

Both the ``NCCLPY_*`` names (read first by :func:`ncclpy.rendezvous.resolve`) and torchrun's names
are set, so ``torch.distributed``'s ``env://`` works in the same process.  The two stores must not
share a port: ncclpy's store listens on ``master_port`` (``NCCLPY_MASTER_PORT``) and torch's on
``MASTER_PORT`` = ``torch_master_port``, by default ``master_port + 1``.
"""
from __future__ import annotations

from typing import Mapping, Optional

from ncclpy.errors import ArgumentError

__all__ = ["rank_env", "RENDEZVOUS_VARS"]

#: Every variable :func:`rank_env` may set (besides ``extra``).
RENDEZVOUS_VARS = (
    "NCCLPY_RANK", "NCCLPY_WORLD_SIZE", "NCCLPY_LOCAL_RANK", "NCCLPY_LOCAL_WORLD_SIZE",
    "NCCLPY_MASTER_ADDR", "NCCLPY_MASTER_PORT", "NCCLPY_STORE_TOKEN", "NCCLPY_DEVICE",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def rank_env(rank: int, world_size: int, local_rank: int, local_world_size: int,
             master_addr: str, master_port: int, token: Optional[str],
             device: Optional[int] = None, extra: Optional[Mapping[str, str]] = None, *,
             torch_master_port: Optional[int] = None) -> dict[str, str]:
    """Environment variables (all strings) that make ``ncclpy.init()`` work in one rank.

    ``token`` None leaves ``NCCLPY_STORE_TOKEN`` unset; ``device`` None leaves ``NCCLPY_DEVICE``
    unset.  ``extra`` (e.g. the NCCL variables of :mod:`ncclpy.launch.placement`) is merged last.
    ``MASTER_PORT`` is ``torch_master_port`` or ``master_port + 1`` (never ncclpy's own port).
    """
    _int("rank", rank, 0)
    _int("world_size", world_size, 1)
    _int("local_rank", local_rank, 0)
    _int("local_world_size", local_world_size, 1)
    _int("master_port", master_port, 1)
    if rank >= world_size:
        raise ArgumentError(f"rank: expected < world_size={world_size}, got {rank}")
    if local_rank >= local_world_size:
        raise ArgumentError(
            f"local_rank: expected < local_world_size={local_world_size}, got {local_rank}")
    if not isinstance(master_addr, str) or not master_addr:
        raise ArgumentError(f"master_addr: expected a host name or address, got {master_addr!r}")
    if torch_master_port is None:   # derived: the user only chose master_port
        if master_port > 65534:
            raise ArgumentError(f"master_port: expected a port in 1..65534 (torch's store takes "
                                f"master_port + 1), got {master_port}")
        torch_master_port = master_port + 1
    elif master_port > 65535:
        raise ArgumentError(f"master_port: expected a port in 1..65535, got {master_port}")
    _int("torch_master_port", torch_master_port, 1)
    if torch_master_port == master_port or torch_master_port > 65535:
        raise ArgumentError(f"torch_master_port: expected a port in 1..65535 other than "
                            f"master_port={master_port}, got {torch_master_port}")
    env = {
        "NCCLPY_RANK": str(rank), "NCCLPY_WORLD_SIZE": str(world_size),
        "NCCLPY_LOCAL_RANK": str(local_rank), "NCCLPY_LOCAL_WORLD_SIZE": str(local_world_size),
        "NCCLPY_MASTER_ADDR": master_addr, "NCCLPY_MASTER_PORT": str(master_port),
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(torch_master_port),
    }
    if token is not None:
        env["NCCLPY_STORE_TOKEN"] = str(token)
    if device is not None:
        env["NCCLPY_DEVICE"] = str(_int("device", device, 0))
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env
