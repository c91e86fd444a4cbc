"""From "who am I" to "every rank holds the same NCCL unique id": the hand-over to the communicator.

:func:`bootstrap` resolves the rendezvous (:func:`ncclpy.rendezvous.resolve`), connects to the store
(rank 0 hosts it), exchanges the 128-byte ``ncclUniqueId`` (:func:`exchange_uid`) and picks the
device.  The result, :class:`Bootstrap`, is a plain dataclass the communicator consumes.

The uid lives under ``ncclpy/uid/{name}/{generation}``, so several communicators (different
names) and re-inits (new generations) never read each other's id.  With ``generation=None`` every
rank bumps its own counter ``ncclpy/gen/{name}/{rank}``: ranks that create communicators in the
same order get the same generation without talking to each other.
"""
from __future__ import annotations

import datetime
import logging
import numbers
import os
import sys
import types
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from ncclpy.errors import (ArgumentError, MissingDependencyError, RendezvousError, StoreError,
                           StoreTimeout)
from ncclpy.rendezvous import RendezvousInfo, resolve

__all__ = ["Bootstrap", "bootstrap", "exchange_uid", "get_unique_id", "UID_BYTES",
           "uid_key", "generation_key"]

log = logging.getLogger(__name__)

#: sizeof(ncclUniqueId)
UID_BYTES = 128

_INSTALL_HINT = ("install CuPy with NCCL: pip install 'ncclpy[cu12]' (CUDA 12) or "
                 "pip install 'ncclpy[cu13]' (CUDA 13)")


@dataclass
class Bootstrap:
    """Everything a communicator needs: rank, world size, device, the shared uid and the store.

    ``store`` stays open for the life of the process (rank 0 hosts the server in a daemon
    thread); the communicator may use it for host-side barriers and later exchanges.
    """

    rank: int
    world_size: int
    local_rank: int
    device: int
    uid: bytes
    name: str
    generation: int
    store: Any = field(repr=False)
    info: RendezvousInfo


def uid_key(name: str, generation: int) -> str:
    """Store key of the uid of communicator ``name``, generation ``generation``."""
    return f"ncclpy/uid/{name}/{generation}"


def generation_key(name: str, rank: int) -> str:
    """Store key of rank ``rank``'s generation counter for communicator ``name``."""
    return f"ncclpy/gen/{name}/{rank}"


def _as_uid(raw: Any, what: str) -> bytes:
    """Normalise a uid to 128 bytes: bytes (CuPy >= 14) or signed ints (CuPy <= 13)."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        out = bytes(raw)
    elif isinstance(raw, str):
        raise RendezvousError(f"{what}: expected {UID_BYTES} bytes, got a str")
    else:
        try:
            vals = list(raw)
        except TypeError as e:
            raise RendezvousError(f"{what}: expected {UID_BYTES} bytes or ints, got "
                                  f"{type(raw).__name__}") from e
        if not all(isinstance(v, numbers.Integral) and -128 <= v <= 255 for v in vals):
            raise RendezvousError(f"{what}: expected {UID_BYTES} ints in -128..255 (signed or "
                                  f"unsigned chars)")
        out = bytes(int(v) & 0xFF for v in vals)
    if len(out) != UID_BYTES:
        raise RendezvousError(f"{what}: expected {UID_BYTES} bytes, got {len(out)}")
    return out


def get_unique_id() -> bytes:
    """``ncclGetUniqueId`` through CuPy, as 128 bytes. Needs no GPU."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise MissingDependencyError(f"CuPy is not installed ({e}); {_INSTALL_HINT}") from e
    if not getattr(nccl, "available", True) or not hasattr(nccl, "get_unique_id"):
        raise MissingDependencyError(f"CuPy cannot load libnccl; {_INSTALL_HINT}")
    return _as_uid(nccl.get_unique_id(), "ncclGetUniqueId")


def _ncclpy_store_type():
    try:
        from ncclpy.store import TCPStore
        return TCPStore
    except ImportError:  # pragma: no cover - store always ships with ncclpy
        return None


def _store_get(store: Any, key: str, timeout: float) -> bytes:
    """``get`` that waits up to ``timeout``: ncclpy's ``get(key, timeout=)`` or torch's wait+get."""
    ours = _ncclpy_store_type()
    if ours is not None and isinstance(store, ours):
        return store.get(key, timeout=timeout)
    try:
        return store.get(key, timeout=timeout)
    except TypeError:  # torch.distributed.Store: get(key) only; wait(keys, timedelta)
        store.wait([key], datetime.timedelta(seconds=timeout))
        return store.get(key)


def _describe(store: Any) -> str:
    addr = getattr(store, "address", None)
    if addr is None and hasattr(store, "host") and hasattr(store, "port"):
        addr = (store.host, store.port)
    return f"{type(store).__name__} at {addr[0]}:{addr[1]}" if addr else type(store).__name__


def exchange_uid(store: Any, rank: int, *, name: str = "default",
                 generation: Optional[int] = None, timeout: float = 300.0) -> tuple[bytes, int]:
    """Share one NCCL unique id among the ranks of communicator ``name``; returns (uid, generation).

    Rank 0 calls ``ncclGetUniqueId`` and publishes it; the others wait up to ``timeout`` seconds.
    """
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"name: expected a non-empty str, got {name!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ArgumentError(f"rank: expected an int >= 0, got {rank!r}")
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)
                                   or generation < 0):
        raise ArgumentError(f"generation: expected None or an int >= 0, got {generation!r}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ArgumentError(f"timeout: expected seconds > 0, got {timeout!r}")
    if generation is None:
        generation = int(store.add(generation_key(name, rank), 1))
    key = uid_key(name, generation)
    if rank == 0:
        uid = get_unique_id()
        store.set(key, uid)
        log.debug("bootstrap: rank 0 published the uid of %r generation %d under %s",
                  name, generation, key)
        return uid, generation
    try:
        raw = _store_get(store, key, float(timeout))
    except (StoreTimeout, TimeoutError) as e:
        raise RendezvousError(
            f"rank {rank} waited {timeout:g} s for the NCCL unique id of communicator {name!r} "
            f"generation {generation} (key {key!r}) on {_describe(store)}: rank 0 never published "
            f"it. Is rank 0 running, and do all ranks create their communicators with the same "
            f"names in the same order?") from e
    except StoreError as e:
        raise RendezvousError(f"rank {rank} could not read the NCCL unique id of communicator "
                              f"{name!r} (key {key!r}) from {_describe(store)}: {e}") from e
    uid = _as_uid(raw, f"uid read from the store under {key!r}")
    log.debug("bootstrap: rank %d got the uid of %r generation %d", rank, name, generation)
    return uid, generation


# one store per (address, port, rank) and process: several communicators and re-inits share it
_STORES: dict[tuple[str, int, int], Any] = {}
_STORE_LOCKS: dict[tuple[str, int, int], threading.Lock] = {}
_STORES_LOCK = threading.Lock()


def _default_store(info: RendezvousInfo, token: Optional[str], timeout: float) -> Any:
    from ncclpy.store import TCPStore

    key = (info.master_addr, info.master_port, info.rank)
    with _STORES_LOCK:
        lock = _STORE_LOCKS.setdefault(key, threading.Lock())
    with lock:  # per key: a rank still connecting never blocks another rank of this process
        store = _STORES.get(key)
        if store is not None and not (getattr(store, "closed", False)
                                      or getattr(store, "_closed", False)):
            return store
        if info.rank == 0:
            log.debug("bootstrap: rank 0 hosts the store on %s:%d", *key[:2])
        store = TCPStore(info.master_addr, info.master_port, token=token, timeout=timeout,
                         is_server=info.rank == 0)
        _STORES[key] = store
        return store


def _pick_device(info: RendezvousInfo) -> int:
    if info.device is not None:
        return info.device
    try:
        from ncclpy.launch.placement import visible_gpu_count
        n = visible_gpu_count()
    except ImportError:  # pragma: no cover - placement ships with ncclpy
        n = 0
    return info.local_rank % n if n > 0 else info.local_rank


def bootstrap(name: str = "default", *, store: Any = None, timeout: float = 300.0,
              token: Optional[str] = None, generation: Optional[int] = None,
              **resolve_kwargs: Any) -> Bootstrap:
    """Resolve the rendezvous, connect to the store and share a uid; see the module docstring.

    ``store``: any object with ncclpy's or torch's store methods; None connects to (rank 0:
    hosts) ncclpy's TCP store at the resolved address with ``token`` or ``NCCLPY_STORE_TOKEN``.
    ``resolve_kwargs`` go to :func:`ncclpy.rendezvous.resolve`.
    """
    info = resolve(**resolve_kwargs)
    if store is None:
        if token is None:
            env = resolve_kwargs.get("env")
            token = (os.environ if env is None else env).get("NCCLPY_STORE_TOKEN") or None
        store = _default_store(info, token, timeout)
    uid, gen = exchange_uid(store, info.rank, name=name, generation=generation, timeout=timeout)
    device = _pick_device(info)
    log.debug("bootstrap: %r generation %d: rank %d/%d local rank %d device %d (rendezvous from "
              "%s, store %s:%d)", name, gen, info.rank, info.world_size, info.local_rank, device,
              info.source, info.master_addr, info.master_port)
    return Bootstrap(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                     device=device, uid=uid, name=name, generation=gen, store=store, info=info)


class _CallableModule(types.ModuleType):
    """``import ncclpy.bootstrap`` makes ``ncclpy.bootstrap`` this module, shadowing the lazily
    exported function of the same name; calling the module calls the function, so
    ``ncclpy.bootstrap(...)`` works either way."""

    def __call__(self, *args: Any, **kwargs: Any) -> Bootstrap:
        return bootstrap(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
