"""The NCCL unique id: made (:func:`get_unique_id`: CuPy's ``ncclGetUniqueId``, or the CPU
backend's), checked (128 bytes, whatever form CuPy returns) and, where the ranks are MPI's own,
handed over by ``MPI_Bcast`` (:func:`choose_uid_exchange`, :func:`exchange_uid_mpi`).  The store's
hand-over and :func:`ncclpy.bootstrap.bootstrap` are in :mod:`ncclpy.rendezvous.bootstrap`, which
hands on these names.
"""
from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from typing import Any, Optional

from ..errors import ArgumentError, MissingDependencyError, RendezvousError
from .environment import RendezvousInfo

__all__ = ["UID_BYTES", "UID_EXCHANGES", "get_unique_id", "choose_uid_exchange",
           "exchange_uid_mpi"]

log = logging.getLogger(__name__)


#: sizeof(ncclUniqueId)
UID_BYTES = 128


_INSTALL_HINT = ("install CuPy with NCCL: pip install 'ncclpy[cu12]' (CUDA 12) or "
                 "pip install 'ncclpy[cu13]' (CUDA 13)")


#: the values of ``uid_exchange`` / ``$NCCLPY_UID_EXCHANGE``
UID_EXCHANGES = ("store", "mpi", "auto")


_MPI_SOURCES = ("openmpi", "mpich")


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
    """``ncclGetUniqueId`` through CuPy, as 128 bytes. Needs no GPU.  On the CPU backend, its
    own ``ncclGetUniqueId`` (no CuPy needed there)."""
    from .._nccl.lib import cpu_backend, get_lib
    if cpu_backend():
        return _as_uid(get_lib().get_unique_id(), "ncclGetUniqueId")
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise MissingDependencyError(f"CuPy is not installed ({e}); {_INSTALL_HINT}") from e
    if not getattr(nccl, "available", True) or not hasattr(nccl, "get_unique_id"):
        raise MissingDependencyError(f"CuPy cannot load libnccl; {_INSTALL_HINT}")
    return _as_uid(nccl.get_unique_id(), "ncclGetUniqueId")


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"{'None or ' if allow_none else ''}an int >= {minimum}"
        raise ArgumentError(f"{name}: expected {expected}, got {value!r}")


def _mpi_launched(info: RendezvousInfo, env: Any) -> Optional[str]:
    """The MPI launcher this process was started by (rank from its variables), else None."""
    if info.source in _MPI_SOURCES:
        return info.source
    return None


def _import_mpi() -> Any:
    """mpi4py's MPI module (initialises MPI), or None when mpi4py is not importable."""
    try:
        from mpi4py import MPI
    except Exception as e:   # ImportError; RuntimeError when the wheel finds no libmpi
        log.debug("bootstrap: mpi4py is not importable: %s: %s", type(e).__name__, e)
        return None
    return MPI


def choose_uid_exchange(choice: Optional[str], info: RendezvousInfo,
                        env: Any = None, *, store_given: bool = False) -> tuple[str, str]:
    """("store" | "mpi", why): the uid exchange for ``choice`` (None: ``$NCCLPY_UID_EXCHANGE``,
    else "store").  "mpi" that cannot work raises :class:`ArgumentError` naming what is missing."""
    env = os.environ if env is None else env
    src = "argument uid_exchange"
    if choice is None:
        raw = env.get("NCCLPY_UID_EXCHANGE", "").strip()
        choice, src = (raw.lower(), "NCCLPY_UID_EXCHANGE") if raw else ("store", "default")
    if not isinstance(choice, str) or choice.lower() not in UID_EXCHANGES:
        what = f"{src}={choice!r}" if src != "default" else repr(choice)
        raise ArgumentError(f"uid_exchange: expected one of {', '.join(UID_EXCHANGES)}, got "
                            f"{what}")
    choice = choice.lower()
    if choice == "store":
        return "store", f"{src} says store"
    launcher = _mpi_launched(info, env)
    problem = None
    if store_given:
        problem = "a store= was passed, which the MPI exchange would not use"
    elif launcher is None:
        problem = (f"this process was not started by an MPI launcher (its rank came from "
                   f"{info.source})")
    elif _import_mpi() is None:
        problem = "mpi4py is not importable (pip install mpi4py; it needs an MPI library)"
    if problem is None:
        return "mpi", f"{src} says {choice}; started by {launcher}, mpi4py importable"
    if choice == "auto":
        return "store", f"{src} says auto and {problem}"
    raise ArgumentError(f"uid_exchange: {src}='mpi' cannot be used: {problem}; use "
                        f"uid_exchange='store' (the default) or 'auto'")


_MPI_GENERATIONS: dict[str, int] = {}


_MPI_LOCK = threading.Lock()


def exchange_uid_mpi(info: RendezvousInfo, *, name: str = "default",
                     generation: Optional[int] = None, timeout: float = 300.0,
                     mpi: Any = None) -> tuple[bytes, int]:
    """Share the uid by ``MPI_Bcast`` from rank 0 over ``COMM_WORLD`` (nonblocking, polled, so
    a rank that never joins is a :class:`RendezvousError` after ``timeout``, not a hang)."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ArgumentError(f"timeout: expected seconds > 0, got {timeout!r}")
    _check_int("generation", generation, 0, allow_none=True)
    MPI = mpi if mpi is not None else _import_mpi()
    if MPI is None:
        raise MissingDependencyError("uid_exchange='mpi' needs mpi4py: pip install mpi4py")
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (info.rank, info.world_size):
        raise RendezvousError(
            f"uid_exchange='mpi': MPI_COMM_WORLD says rank {world.Get_rank()} of "
            f"{world.Get_size()}, the rendezvous says rank {info.rank} of {info.world_size} "
            f"(from {info.source}); the MPI exchange needs the ranks to be MPI's own")
    with _MPI_LOCK:
        if generation is None:
            generation = _MPI_GENERATIONS.get(name, 0) + 1
        _MPI_GENERATIONS[name] = max(generation, _MPI_GENERATIONS.get(name, 0))
    buf = bytearray(get_unique_id() if info.rank == 0 else bytes(UID_BYTES))
    req = world.Ibcast([buf, MPI.BYTE], root=0)
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not req.Test():
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {info.rank} waited {timeout:g} s for the MPI_Bcast of the NCCL unique id "
                f"of communicator {name!r} generation {generation} (uid_exchange='mpi'); are all "
                f"{info.world_size} ranks running, with the same communicator names in the same "
                f"order?")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    uid = _as_uid(buf, f"uid received by MPI_Bcast (communicator {name!r})")
    log.debug("bootstrap: rank %d %s the uid of %r generation %d over MPI_Bcast", info.rank,
              "sent" if info.rank == 0 else "got", name, generation)
    return uid, generation
