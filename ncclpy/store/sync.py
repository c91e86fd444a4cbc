"""Synchronisation helpers built only on the duck-typed store methods (add, set, wait).

Works with :class:`ncclpy.store.TCPStore` and with ``torch.distributed.TCPStore`` alike; on
ncclpy's own store each phase of the barrier is one pipelined round trip.
"""
from __future__ import annotations

import datetime
from typing import Optional

from ..errors import ArgumentError, StoreError, StoreTimeout
from .client import TCPStore

__all__ = ["barrier"]


def _wait(store, key: str, timeout: Optional[float]) -> None:
    if timeout is None:
        store.wait([key])
    else:
        store.wait([key], datetime.timedelta(seconds=timeout))


def _delete(store, *keys: str) -> None:
    delete = getattr(store, "delete_key", None)
    if delete is None:  # a store without delete still works, it just keeps old keys
        return
    for k in keys:
        try:
            delete(k)
        except Exception:  # cleanup only
            pass


def barrier(store, rank: int, world_size: int, *, tag: str = "barrier",
            timeout: Optional[float] = None) -> None:
    """Block until ``world_size`` callers reached the barrier ``tag``.

    Reusable any number of times with the same ``tag``: one shared arrival counter, and the
    generation of a call is ``(arrival - 1) // world_size``; the last arrival of a generation
    sets its ``done`` key. Every rank then counts itself out; the rank whose ``store`` hosts the
    server in-process (an ncclpy ``TCPStore(..., is_server=True)``) also waits until every rank
    has left, so it may exit right after the barrier without cutting the others off. The last
    rank out cleans up the generation's keys. All ranks must use the same ``world_size`` for a
    ``tag``. ``timeout`` (seconds) bounds each wait; default: the store's own timeout.
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
    arrived_key = f"{prefix}/arrived"
    hosting = getattr(store, "server", None) is not None   # this process hosts the store
    fast = isinstance(store, TCPStore)   # ours pipelines: one round trip per phase
    n = store.add(arrived_key, 1)
    gen = (n - 1) // world_size
    done = f"{prefix}/done/{gen}"
    left_key = f"{prefix}/left/{gen}"
    gone = f"{prefix}/gone/{gen}"
    depart = world_size > 1 or hosting
    try:
        if fast:
            calls = [store._req_set(done, b"1")] if n % world_size == 0 else []
            calls.append(store._req_wait([done], timeout))
            if depart:
                calls.append(store._req_add(left_key, 1))
            left = int(store._pipeline(calls)[-1]) if depart else 0
        else:
            if n % world_size == 0:
                store.set(done, b"1")
            _wait(store, done, timeout)
            left = store.add(left_key, 1) if depart else 0
    except StoreTimeout as e:
        try:
            here = min(max(store.add(arrived_key, 0) - gen * world_size, 0), world_size)
            seen = f"{here} of {world_size} ranks arrived"
        except StoreError:
            seen = f"arrivals unknown, world_size {world_size}"
        raise StoreTimeout(f"barrier {tag!r} (generation {gen}) timed out on rank {rank}: "
                           f"{seen}; {e}") from e
    if not depart:
        return
    # departure: every rank has read ``done`` once the ``left`` counter is full
    if left == world_size:  # last out: clean up, then signal (last op)
        stale = (done, left_key, f"{prefix}/gone/{gen - 1}")
        if fast:
            store._pipeline([store._req_delete(k) for k in stale] + [store._req_set(gone, b"1")])
        else:
            _delete(store, *stale)
            store.set(gone, b"1")
    if hosting:
        try:
            _wait(store, gone, timeout)
        except StoreTimeout as e:
            raise StoreTimeout(f"barrier {tag!r} (generation {gen}): rank {rank} hosts the store "
                               f"and timed out waiting for every rank to leave; {e}") from e
