"""From "who am I" to "every rank holds the same NCCL unique id": the hand-over to the communicator.

:func:`bootstrap` resolves the rendezvous (:func:`ncclpy.rendezvous.resolve`), connects to the
store (rank 0 hosts it, or ``ncclpy run``'s launcher), exchanges the 128-byte ``ncclUniqueId``
(:func:`exchange_uid`; made and checked in :mod:`ncclpy.rendezvous.uid`) and picks the device.
The result, :class:`Bootstrap`, is a plain dataclass the communicator consumes.

The uid lives under ``ncclpy/uid/{name}/{generation}``, so several communicators (different
names) and re-inits (new generations) never read each other's id.  With ``generation=None`` every
rank counts its own generations per name, in one key per rank whatever the number of names
(``ncclpy/gen/{rank}``: ``{"name": generation, ...}``): ranks that create communicators in the
same order get the same generation without talking to each other.

Hand-over: every other rank adds 1 to ``ncclpy/uid-ack/{name}/{generation}`` once it has read
the uid (the last one sets ``.../all``), and rank 0 returns only after that, within
``timeout``; rank 0 may then exit (taking the store with it) without cutting anyone off.
Store failures, ncclpy's or torch's (``DistStoreError``), surface as one
:class:`~ncclpy.errors.RendezvousError` naming the key, the store address and the wait.

``uid_exchange`` (argument, else ``$NCCLPY_UID_EXCHANGE``, else "store") picks how the uid
travels: "store" (ncclpy's TCP store, or torchrun's), "mpi" (``MPI_Bcast`` of the 128 bytes over
mpi4py's ``COMM_WORLD``, as nccl-tests does: no store at all, ``Bootstrap.store`` is None; needs
an MPI launcher and mpi4py), or "auto" ("mpi" where both are there, else "store").  The debug
log says which one was used and why.
"""
from __future__ import annotations

import datetime
import inspect
import json
import logging
import numbers
import os
import sys
import types
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from ncclpy.errors import (ArgumentError, ArgumentTypeError, MissingDependencyError,
                           RendezvousError, StoreError, StoreTimeout)
from ncclpy.rendezvous import RendezvousInfo, resolve

from .uid import (UID_BYTES, UID_EXCHANGES, _as_uid, _check_int, choose_uid_exchange,
                  exchange_uid_mpi, get_unique_id)

__all__ = ["Bootstrap", "bootstrap", "exchange_uid", "get_unique_id", "UID_BYTES",
           "uid_key", "generation_key", "ack_key", "connect_store", "UID_EXCHANGES",
           "choose_uid_exchange"]

log = logging.getLogger(__name__)


@dataclass
class Bootstrap:
    """Everything a communicator needs: rank, world size, device, the shared uid and the store.

    ``store`` stays open for the life of the process (rank 0 hosts the server in a daemon
    thread); the communicator may use it for host-side barriers and later exchanges.  It is
    None when the uid came over MPI (``uid_exchange == "mpi"``): then there is no store.
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
    #: how the uid was shared: "store" or "mpi"
    uid_exchange: str = "store"


def uid_key(name: str, generation: int) -> str:
    """Store key of the uid of communicator ``name``, generation ``generation``."""
    return f"ncclpy/uid/{name}/{generation}"


def generation_key(name: str, rank: int) -> str:
    """Store key of rank ``rank``'s generation counters (one key per rank for every ``name``:
    a JSON object name -> generation)."""
    return f"ncclpy/gen/{rank}"


_GENS_LOCK = threading.Lock()   # threads of one process never lose each other's update


def _next_generation(store: Any, name: str, rank: int) -> int:
    """Bump and return ``rank``'s generation of ``name`` in the rank's one key (so a process
    that restarts against the same store continues the count)."""
    key = generation_key(name, rank)
    with _GENS_LOCK:
        try:
            gens = dict(json.loads(store.get(key))) if store.check([key]) else {}
        except (ValueError, TypeError):
            gens = {}
        gens[name] = int(gens.get(name, 0)) + 1
        store.set(key, json.dumps(gens, separators=(",", ":")))
        return gens[name]


def ack_key(name: str, generation: int) -> str:
    """Store counter of the ranks that have read the uid of ``name``, ``generation``; the last
    reader sets ``ack_key(...) + "/all"``, which rank 0 waits for."""
    return f"ncclpy/uid-ack/{name}/{generation}"


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


def _failure_kind(e: BaseException) -> Optional[str]:
    """"timeout" or "error" when ``e`` is a store failure (ncclpy's, torch's or a socket's),
    None for anything else (which then propagates unchanged)."""
    names = {c.__name__ for c in type(e).__mro__}
    if isinstance(e, (StoreTimeout, TimeoutError)) or (
            "DistStoreError" in names and "timeout" in str(e).lower()):
        return "timeout"
    if isinstance(e, (StoreError, OSError)) or "DistError" in names:
        return "error"
    return None


def _store_call(store: Any, rank: int, doing: str, key: str, fn: Any, *args: Any,
                wait: Optional[float] = None, hint: str = "") -> Any:
    """``fn(*args)``; a store failure (ncclpy's StoreError, torch's DistStoreError/DistNetworkError,
    a socket error) becomes one :class:`RendezvousError` naming the key, address and wait."""
    try:
        return fn(*args)
    except Exception as e:
        kind = _failure_kind(e)
        if kind is None:
            raise
        where = _describe(store)
        if kind == "timeout" and wait is not None:
            msg = f"rank {rank} waited {wait:g} s to {doing} (key {key!r}) on {where}"
        elif kind == "timeout":
            msg = f"rank {rank} timed out trying to {doing} (key {key!r}) on {where}"
        else:
            msg = f"rank {rank} could not {doing} (key {key!r}) on {where}"
        raise RendezvousError(f"{msg}: {type(e).__name__}: {e}{hint}") from e


def exchange_uid(store: Any, rank: int, *, name: str = "default",
                 generation: Optional[int] = None, timeout: float = 300.0,
                 world_size: Optional[int] = None) -> tuple[bytes, int]:
    """Share one NCCL unique id among the ranks of communicator ``name``; returns (uid, generation).

    Rank 0 calls ``ncclGetUniqueId`` and publishes it; the others wait up to ``timeout`` seconds.
    With ``world_size``, every other rank acknowledges (:func:`ack_key`) once it has read the id
    and rank 0 returns only when all ``world_size - 1`` have, so a rank 0 that hosts the store
    may exit right after without cutting a slower rank off.  Store failures (also torch's) raise
    :class:`RendezvousError`.
    """
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"name: expected a non-empty str, got {name!r}")
    _check_int("rank", rank, 0)
    _check_int("generation", generation, 0, allow_none=True)
    _check_int("world_size", world_size, 1, allow_none=True)
    if world_size is not None and rank >= world_size:
        raise ArgumentError(f"rank: expected < world_size={world_size}, got {rank}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ArgumentError(f"timeout: expected seconds > 0, got {timeout!r}")
    timeout = float(timeout)
    counted = generation is None   # every rank bumps its generation key: who came is known
    if generation is None:
        gkey = generation_key(name, rank)
        generation = int(_store_call(store, rank, "count the generation of communicator "
                                     f"{name!r}", gkey, _next_generation, store, name, rank))
    key = uid_key(name, generation)
    what = f"the NCCL unique id of communicator {name!r} generation {generation}"
    if rank == 0:
        uid = get_unique_id()
        _store_call(store, rank, f"publish {what}", key, store.set, key, uid)
        log.debug("bootstrap: rank 0 published the uid of %r generation %d under %s",
                  name, generation, key)
        if world_size is not None and world_size > 1:
            _await_acks(store, name, generation, world_size, timeout, counted)
        return uid, generation
    raw = _store_call(
        store, rank, f"read {what}", key, _store_get, store, key, timeout, wait=timeout,
        hint=". Is rank 0 running, and do all ranks create their communicators with the same "
             "names in the same order?")
    uid = _as_uid(raw, f"uid read from the store under {key!r}")
    log.debug("bootstrap: rank %d got the uid of %r generation %d", rank, name, generation)
    if world_size is not None:
        akey = ack_key(name, generation)
        n = int(_store_call(store, rank, f"acknowledge {what}", akey, store.add, akey, 1))
        if n == world_size - 1:   # the last reader tells rank 0 that everyone has the uid
            _store_call(store, rank, f"acknowledge {what}", akey + "/all", store.set,
                        akey + "/all", b"1")
    return uid, generation


def _never_came(store: Any, name: str, world_size: int) -> str:
    """" Ranks 2, 3 never reached the store ..." from the generation keys every rank sets."""
    def came(r: int) -> bool:
        key = generation_key(name, r)
        return bool(store.check([key])) and name in json.loads(store.get(key))
    try:
        absent = [r for r in range(1, world_size) if not came(r)]
    except Exception:   # a courtesy, as the count
        return ""
    if not absent:
        return ""
    shown = ", ".join(map(str, absent[:16])) + (", ..." if len(absent) > 16 else "")
    return (f" Rank{'s' if len(absent) > 1 else ''} {shown} never reached the store (not "
            f"started, or a wrong NCCLPY_STORE_TOKEN, address or port where "
            f"{'they run' if len(absent) > 1 else 'it runs'}?).")


def _await_acks(store: Any, name: str, generation: int, world_size: int,
                timeout: float, counted: bool = False) -> None:
    """Rank 0: wait until the other ranks have read the uid, then drop the exchange's keys."""
    akey = ack_key(name, generation)
    try:
        _store_call(store, 0, f"collect the {world_size - 1} acknowledgements of the NCCL "
                    f"unique id of communicator {name!r} generation {generation}",
                    akey + "/all", _store_get, store, akey + "/all", timeout, wait=timeout)
    except RendezvousError as e:
        try:
            read = int(store.add(akey, 0))
        except Exception:  # the count is a courtesy; the error below says what matters
            read = None
        if read is not None and read >= world_size - 1:
            # every rank has the id; only the last reader's "/all" came late: the hand-over is
            # complete, so this is no failure (the count is the truth, the flag a wake-up call)
            log.warning("bootstrap: all %d other ranks read the uid of %r generation %d, but "
                        "the last one's notice (%s/all) did not arrive within %g s",
                        world_size - 1, name, generation, akey, timeout)
        else:
            seen = (f"Not all {world_size - 1}" if read is None else
                    f"Only {read} of {world_size - 1}")
            who = _never_came(store, name, world_size) if counted else ""
            raise RendezvousError(f"{e}. {seen} other ranks read the id;{who} are all "
                                  f"{world_size} ranks running, with the same communicator "
                                  f"names in the same order?") from e.__cause__
    from ncclpy.store.sync import delete_key
    for k in (uid_key(name, generation), akey, akey + "/all"):   # every rank has the uid:
        delete_key(store, k)                                      # the keys are garbage now
    log.debug("bootstrap: all %d ranks read the uid of %r generation %d",
              world_size, name, generation)


# one store per (address, port, rank) and process: several communicators and re-inits share it
_STORES: dict[tuple[str, int, int], Any] = {}
_STORE_LOCKS: dict[tuple[str, int, int], threading.Lock] = {}
_STORES_LOCK = threading.Lock()


def connect_store(info: RendezvousInfo, token: Optional[str] = None,
                  timeout: float = 300.0) -> Any:
    """The store of the resolved rendezvous ``info``, one per (address, port, rank) per process.

    ``store_kind`` "ncclpy": ncclpy's TCP store, hosted by rank 0 or the launcher (``token``, else
    ``$NCCLPY_STORE_TOKEN``).  "torchrun": torchrun's agent store, joined as a client through
    torch's TCPStore, with keys under ``ncclpy/attempt-{TORCHELASTIC_RESTART_COUNT}/`` so a
    restarted job never reads the previous attempt's ids.
    """
    if token is None:
        token = os.environ.get("NCCLPY_STORE_TOKEN") or None
    return _default_store(info, token, timeout)


def _torchrun_store(info: RendezvousInfo, timeout: float) -> Any:
    try:
        import torch.distributed as dist
    except ImportError as e:  # torchrun without torch.distributed cannot happen; be precise
        raise MissingDependencyError(f"under torchrun ncclpy joins torchrun's store through "
                                     f"torch.distributed, which cannot be imported: {e}") from None
    try:
        client = dist.TCPStore(info.master_addr, info.master_port, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:  # DistNetworkError / DistStoreError / RuntimeError
        raise RendezvousError(f"cannot join torchrun's store at {info.master_addr}:"
                              f"{info.master_port} within {timeout:g} s ({type(e).__name__}: "
                              f"{e}); set NCCLPY_MASTER_PORT to use ncclpy's own store "
                              f"instead") from e
    from ncclpy.rendezvous.torch_store import TorchStoreAdapter
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return TorchStoreAdapter(dist.PrefixStore(f"ncclpy/attempt-{attempt}", client),
                             f"{info.master_addr}:{info.master_port} (torchrun)", timeout)


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
        if getattr(info, "store_kind", "ncclpy") == "torchrun":
            log.debug("bootstrap: joining torchrun's agent store on %s:%d", *key[:2])
            store = _torchrun_store(info, timeout)
            _STORES[key] = store
            return store
        if info.rank == 0:
            log.debug("bootstrap: rank 0 hosts the store on %s:%d", *key[:2])
        store = _open_ncclpy_store(TCPStore, info, token, timeout)
        _STORES[key] = store
        return store


def _open_ncclpy_store(store_type: Any, info: RendezvousInfo, token: Optional[str],
                       timeout: float) -> Any:
    """ncclpy's store for ``info`` (rank 0 hosts it unless ``NCCLPY_STORE_HOSTED_BY=launcher``:
    ``ncclpy run``'s launcher does, sized for the world); a failure to host or reach it is a
    :class:`RendezvousError` naming the address and how long this rank tried."""
    addr = f"{info.master_addr}:{info.master_port}"
    host = info.rank == 0 and os.environ.get("NCCLPY_STORE_HOSTED_BY", "") != "launcher"
    kw: dict = {}
    if host:
        from ncclpy.store.limits import StoreLimits
        kw["limits"] = StoreLimits.for_world(info.world_size)
    try:
        return store_type(info.master_addr, info.master_port, token=token, timeout=timeout,
                          is_server=host, **kw)
    except StoreError as e:
        if host:
            raise RendezvousError(f"rank 0 could not host the store at {addr}: "
                                  f"{type(e).__name__}: {e}") from e
        raise RendezvousError(
            f"rank {info.rank} could not reach the store at {addr} (hosted by "
            f"{'rank 0' if not os.environ.get('NCCLPY_STORE_HOSTED_BY') else 'the launcher'}) "
            f"within "
            f"{timeout:g} s: {type(e).__name__}: {e}. Is rank 0 running, and are "
            f"NCCLPY_MASTER_ADDR/NCCLPY_MASTER_PORT the same on every rank?") from e
    except OSError as e:   # rank 0: the port is taken, or the address is not this machine's
        raise RendezvousError(f"rank {info.rank} could not host the store at {addr}: "
                              f"{type(e).__name__}: {e}") from e


def _gpu_count() -> int:
    from .._nccl.devices import visible_gpu_count
    from .._nccl.lib import cpu_backend
    if cpu_backend():       # the CPU backend: a rank's device label is its local rank
        return 0
    return visible_gpu_count()


def _check_device_arg(device: Any, cpu_ok: bool = False) -> None:
    """An explicit ``device=`` must be a GPU index (or, for ``ncclpy.init``, ``"cpu"``: the
    CPU backend): fail before any rendezvous, precisely."""
    if device is None or (cpu_ok and isinstance(device, str)
                          and device.strip().lower() == "cpu"):
        return
    want = "None or an int GPU index >= 0" + (" (or 'cpu': the CPU backend)" if cpu_ok else "")
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise ArgumentTypeError(f"device: expected {want}, got {type(device).__name__} "
                                f"{device!r}")
    if device < 0:
        raise ArgumentError(f"device: expected {want}, got {device}")


def _pick_device(info: RendezvousInfo, explicit: bool) -> int:
    """The rank's device: the explicit/launcher one (checked against the visible GPUs when there
    are any), else local rank mod GPU count. Runs before the store is touched."""
    n = _gpu_count()
    if info.device is not None:
        if 0 < n <= info.device:
            src = "argument device" if explicit else "NCCLPY_DEVICE"
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ArgumentError(
                f"device: {info.device} (from {src}) is out of range: this process sees {n} "
                f"GPU{'s' if n != 1 else ''}"
                + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else "")
                + f"; rank {info.rank} did not join the rendezvous")
        return info.device
    return info.local_rank % n if n > 0 else info.local_rank


def bootstrap(name: str = "default", *, store: Any = None, timeout: float = 300.0,
              token: Optional[str] = None, generation: Optional[int] = None,
              uid_exchange: Optional[str] = None, **resolve_kwargs: Any) -> Bootstrap:
    """Resolve the rendezvous, connect to the store and share a uid; see the module docstring.

    ``store``: any object with ncclpy's or torch's store methods; None connects to (rank 0:
    hosts) ncclpy's TCP store at the resolved address with ``token`` or ``NCCLPY_STORE_TOKEN``.
    ``resolve_kwargs`` go to :func:`ncclpy.rendezvous.resolve`.  The device is chosen and
    checked (against the visible GPU count, when GPUs are visible) before the store is
    contacted, so a bad device fails at once instead of after waiting for the peers.
    ``uid_exchange``: "store", "mpi" or "auto" (see the module docstring).
    """
    _check_device_arg(resolve_kwargs.get("device"))
    info = resolve(**resolve_kwargs)
    device = _pick_device(info, explicit=resolve_kwargs.get("device") is not None)
    env = resolve_kwargs.get("env")
    how, why = choose_uid_exchange(uid_exchange, info, env, store_given=store is not None)
    log.debug("bootstrap: uid exchange of %r: %s (%s)", name, how, why)
    if how == "mpi":
        if (os.environ if env is None else env).get("NCCLPY_CHECKED", "").strip().lower() in (
                "1", "true", "yes", "on"):
            raise ArgumentError(f"uid_exchange: {why.split(';')[0]}, but NCCLPY_CHECKED is on "
                                f"and checked mode needs the rendezvous store, which the MPI "
                                f"exchange does not open; use uid_exchange='store' or "
                                f"NCCLPY_CHECKED=0")
        uid, gen = exchange_uid_mpi(info, name=name, generation=generation, timeout=timeout)
        log.debug("bootstrap: %r generation %d: rank %d/%d local rank %d device %d (rendezvous "
                  "from %s, uid over MPI_Bcast, no store)", name, gen, info.rank,
                  info.world_size, info.local_rank, device, info.source)
        return Bootstrap(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                         device=device, uid=uid, name=name, generation=gen, store=None,
                         info=info, uid_exchange="mpi")
    if store is None:
        if token is None:
            token = (os.environ if env is None else env).get("NCCLPY_STORE_TOKEN") or None
        store = _default_store(info, token, timeout)
    uid, gen = exchange_uid(store, info.rank, name=name, generation=generation, timeout=timeout,
                            world_size=info.world_size)
    log.debug("bootstrap: %r generation %d: rank %d/%d local rank %d device %d (rendezvous from "
              "%s, store %s:%d)", name, gen, info.rank, info.world_size, info.local_rank, device,
              info.source, info.master_addr, info.master_port)
    return Bootstrap(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                     device=device, uid=uid, name=name, generation=gen, store=store, info=info)


class _CallableModule(types.ModuleType):
    """``ncclpy.bootstrap`` is this module (``ncclpy.__getattr__`` hands out the module, as
    ``import ncclpy.bootstrap`` does), so ``ncclpy.bootstrap.bootstrap`` and every other name
    here are reachable from ``import ncclpy``; calling the module calls :func:`bootstrap`, so
    ``ncclpy.bootstrap(...)`` works too."""

    def __call__(self, *args: Any, **kwargs: Any) -> Bootstrap:
        return bootstrap(*args, **kwargs)


#: what ``inspect.signature(ncclpy.bootstrap)`` (the called module) shows: the function's
__signature__ = inspect.signature(bootstrap)
sys.modules[__name__].__class__ = _CallableModule
