"""Synchronisation helpers: a reusable barrier over any store, and key helpers for either store.

On ncclpy's own store the barrier is held on the server (:meth:`TCPStore.arrive`): one round
trip per rank. Any other store with the duck-typed methods (add, set, wait; e.g.
``torch.distributed.TCPStore``) gets the same barrier built from keys.

:func:`wait_key`, :func:`is_timeout` and :func:`delete_key` work on ncclpy's store and torch's
alike; checked mode (:mod:`ncclpy.debug.checked`, :mod:`ncclpy.debug.pairing`) and the ranks'
agreement check (:mod:`ncclpy.debug.agree`) share them from here.
"""
from __future__ import annotations

import datetime
import logging
import time
from typing import Any, Optional, Tuple

from ..errors import ArgumentError, StoreTimeout
from .client import TCPStore

__all__ = ["barrier", "count_out", "wait_counted_out", "delete_key", "wait_key", "is_timeout"]

log = logging.getLogger(__name__)


def _wait(store, key: str, timeout: Optional[float]) -> None:
    if timeout is None:
        store.wait([key])
    else:
        store.wait([key], datetime.timedelta(seconds=timeout))


def delete_key(store: Any, key: str) -> None:
    """Delete ``key`` from ncclpy's store or torch's (``delete_key`` / ``delete``); cleanup
    only: a failure is logged, never raised, and a store without either keeps the key."""
    delete = getattr(store, "delete_key", None) or getattr(store, "delete", None)
    if delete is None:
        return
    try:
        delete(key)
    except Exception:  # cleanup only
        log.debug("deleting %s failed", key, exc_info=True)


def wait_key(store: Any, key: str, timeout: float) -> bytes:
    """``store.get`` bounded by ``timeout`` on ncclpy's store or torch's (whose ``get`` takes
    no timeout: a bounded ``wait`` first)."""
    try:
        return store.get(key, timeout=timeout)
    except TypeError:
        store.wait([key], datetime.timedelta(seconds=timeout))
        return store.get(key)


_TIMEOUTS: Tuple[type, ...] = (StoreTimeout, TimeoutError)


def is_timeout(e: BaseException) -> bool:
    """Whether ``e`` is a store's timeout: ncclpy's StoreTimeout, a TimeoutError, or torch's
    (recognised by its name or message, torch raising plain errors)."""
    return isinstance(e, _TIMEOUTS) or "timeout" in type(e).__name__.lower() or \
        "timed out" in str(e).lower() or "timeout" in str(e).lower()


def _delete(store, *keys: str) -> None:
    for k in keys:
        delete_key(store, k)


_SAME = ("every rank must call it with the same tag and world_size, on the same kind of store "
         "(ncclpy's TCPStore, or another store, for all ranks)")


def barrier(store, rank: int, world_size: int, *, tag: str = "barrier",
            timeout: Optional[float] = None) -> None:
    """Block until ``world_size`` callers reached the barrier ``tag``.

    Reusable any number of times with the same ``tag``; a generation is ``world_size``
    consecutive arrivals. The rank whose ``store`` hosts the server in-process (an ncclpy
    ``TCPStore(..., is_server=True)``) also waits until every rank has counted itself out, i.e.
    has its answer, so it may exit right after the barrier without cutting the others off. All
    ranks of a ``tag`` must use the same ``world_size`` and the same kind of store.
    ``timeout`` (seconds) bounds each wait; default: the store's own timeout. A barrier that
    timed out leaves its ``tag`` miscounted: use a new tag.
    """
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ArgumentError(f"{name}: expected int, got {type(v).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ArgumentError(f"rank/world_size: expected 0 <= rank < world_size, got rank={rank}, "
                            f"world_size={world_size}")
    if timeout is not None and not timeout >= 0:
        raise ArgumentError(f"timeout: expected >= 0 seconds or None, got {timeout!r}")
    prefix = f"ncclpy/barrier/{tag}"
    hosting = getattr(store, "server", None) is not None   # this process hosts the store
    if isinstance(store, TCPStore) and store.supports_arrive:
        _barrier_on_server(store, prefix, tag, rank, world_size, hosting, timeout)
    else:
        _barrier_from_keys(store, prefix, tag, rank, world_size, hosting, timeout)


def _arrivals(store, key: str, world_size: int) -> str:
    """'k of n ranks arrived' for the newest generation of counter ``key`` (best effort)."""
    try:
        c = int(store.add(key, 0))
    except Exception:   # best effort: ncclpy's StoreError, or whatever another store raises
        return f"arrivals unknown, world_size {world_size}"
    gen = max(c - 1, 0) // world_size
    return f"{min(max(c - gen * world_size, 0), world_size)} of {world_size} ranks arrived"


def _barrier_on_server(store: TCPStore, prefix: str, tag: str, rank: int, world_size: int,
                       hosting: bool, timeout: Optional[float]) -> None:
    """Held by the server: counters ``count`` (arrivals) and ``out`` (answers received)."""
    count, out = f"{prefix}/count", f"{prefix}/out"
    try:
        if hosting:
            store.arrive(count, world_size, timeout)
        elif world_size > 1:   # arrive, then count out: both in one round trip
            store._pipeline([store._req_arrive(count, world_size, timeout),
                             store._req_add(out, 1)])
        else:
            store.arrive(count, 1, timeout)
    except StoreTimeout as e:
        raise StoreTimeout(f"barrier {tag!r} timed out on rank {rank}: "
                           f"{_arrivals(store, count, world_size)}; {_SAME}; {e}") from e
    if hosting and world_size > 1:  # requests run in order: each "out" follows its answer
        try:
            store.arrive(out, world_size, timeout)
        except StoreTimeout as e:
            raise StoreTimeout(f"barrier {tag!r}: rank {rank} hosts the store and timed out "
                               f"waiting for every rank to leave; {e}") from e


def _barrier_from_keys(store, prefix: str, tag: str, rank: int, world_size: int,
                       hosting: bool, timeout: Optional[float]) -> None:
    """Built on add/set/wait only. The generation of a call is ``(arrival - 1) //
    world_size``; its last arrival sets its ``done`` key; every rank then counts itself out
    and the last out cleans up the generation's keys and sets ``gone``, which the hosting rank
    waits for."""
    arrived_key = f"{prefix}/arrived"
    n = store.add(arrived_key, 1)
    if world_size == 1 and not hosting:   # its own arrival completes it; nothing to clean up
        return                            # (a done key here would be left behind every call)
    gen = (n - 1) // world_size
    done = f"{prefix}/done/{gen}"
    left_key = f"{prefix}/left/{gen}"
    gone = f"{prefix}/gone/{gen}"
    try:
        if n % world_size == 0:
            store.set(done, b"1")
        _wait(store, done, timeout)
        left = store.add(left_key, 1)
    except Exception as e:   # torch's stores time out with their own errors
        if not is_timeout(e):
            raise
        raise StoreTimeout(f"barrier {tag!r} (generation {gen}) timed out on rank {rank}: "
                           f"{_arrivals(store, arrived_key, world_size)}; {_SAME}; {e}") from e
    if left == world_size:  # last out: clean up, then signal (last op)
        _delete(store, done, left_key, f"{prefix}/gone/{gen - 1}")
        store.set(gone, b"1")
    if hosting:
        try:
            _wait(store, gone, timeout)
        except Exception as e:
            if not is_timeout(e):
                raise
            raise StoreTimeout(f"barrier {tag!r} (generation {gen}): rank {rank} hosts the store "
                               f"and timed out waiting for every rank to leave; {e}") from e


def count_out(store, key: str) -> None:
    """A reader's half of a hand-over: one ``add`` on ``key`` (its reply is sent before the
    count can be seen, so the writer never leaves while this call is unanswered)."""
    store.add(key, 1)


def wait_counted_out(store, key: str, want: int, timeout: float, what: str) -> None:
    """The writer's half: poll ``key`` until ``want`` readers have counted themselves out
    (:func:`count_out`), within ``timeout`` seconds.  Unlike a barrier, no reply to a reader
    is still in flight when this returns, so a writer that hosts the store may then exit.
    Polls start 1 ms apart and back off, doubling, to 50 ms: a hand-over that is already
    done costs one round trip, a slow one at most 20 polls a second."""
    deadline, pause = time.monotonic() + timeout, 0.001
    while int(store.add(key, 0)) < want:
        if time.monotonic() >= deadline:
            raise StoreTimeout(f"{what}: {key!r}: {want - int(store.add(key, 0))} of {want} "
                               f"readers had not finished after {timeout:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
