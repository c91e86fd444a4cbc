"""Python objects between a communicator's ranks, through its store: ``broadcast_object`` and
``all_gather_object``, as torch users know them from ``torch.distributed``.

Objects travel pickled through the rendezvous store (never through NCCL: no GPU memory, no
stream, no device synchronisation), bounded in size: one object at most ``max_bytes`` pickled
(default :data:`MAX_OBJECT_BYTES`), and all_gather's whole result at most the store's largest
value (64 MiB by default).  Like torch's, these are collectives: every rank calls them in the
same order; a rank that never comes makes the others fail after the communicator's timeout,
naming the key, and an object a rank cannot send (unpicklable, over ``max_bytes``, a result the
store refuses) makes every rank raise at once, naming that rank.  Pickle runs arbitrary code on load: use them between ranks of your own job.

Both end with a hand-over: every reader counts itself out with one ``add``, and the writer (the
root; rank 0 for all_gather) returns only once all have, so a writer that hosts the store may
exit at once (:func:`ncclpy.store.sync.wait_counted_out`).  Store traffic per call (N ranks, s
bytes per pickled object, k the writer's polls of the count, a handful): broadcast: the root
1 set, k reads of the count and 2 deletes, every other rank 1 get and 1 add: 2N + k + 1
requests, N·s bytes.  all_gather: every rank 1 set; rank 0 N - 1 gets, 1 set of the joined
result, k polls and N + 1 deletes; every other rank 1 get of it and 1 add: about 4N + k
requests; the result is N·s bytes per rank, N²·s in all (what any all-gather delivers).
"""
from __future__ import annotations

import pickle
import struct
from typing import Any, List, Optional, Tuple

from ..errors import (ArgumentError, StoreConnectionError, StoreError, StoreTimeout,
                      UnsupportedError, as_int)
from ..store.sync import count_out, wait_counted_out

__all__ = ["ObjectExchange", "MAX_OBJECT_BYTES"]

#: the default bound on one pickled object (bytes)
MAX_OBJECT_BYTES = 16 << 20
_LEN = struct.Struct("<Q")


class ObjectExchange:
    """The object collectives of one communicator over ``store`` (keys under ``prefix``)."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str,
                 timeout: float) -> None:
        self.store = store
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.prefix = prefix
        self.timeout = float(timeout)
        self.seq = 0

    def _need_store(self, what: str) -> None:
        if self.store is None and self.world_size > 1:
            raise UnsupportedError(f"{what}: this communicator has no rendezvous store (its uid "
                                   f"came by MPI_Bcast or a torch broadcast), and objects travel "
                                   f"through that store; create it with uid_exchange='store'")

    def _dump(self, what: str, obj: Any, max_bytes: Optional[int]) -> bytes:
        bound = MAX_OBJECT_BYTES if max_bytes is None else as_int(f"{what}: max_bytes",
                                                                   max_bytes, 1)
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - PicklingError, TypeError, AttributeError
            raise ArgumentError(f"{what}: the object cannot be pickled ({type(e).__name__}: "
                                f"{e})") from None
        if len(data) > bound:
            raise ArgumentError(f"{what}: the object pickles to {len(data)} bytes; expected at "
                                f"most max_bytes={bound} (pass a larger max_bytes, up to the "
                                f"store's value limit, or send less)")
        return data

    def broadcast(self, obj: Any, root: int, max_bytes: Optional[int] = None) -> Any:
        """``obj`` of rank ``root`` on every rank (a copy: unpickled, on the root too).  An
        object the root cannot send (unpicklable, too large) raises on every rank, at once."""
        what = "broadcast_object"
        root = as_int(f"{what}: root", root, 0)
        if root >= self.world_size:
            raise ArgumentError(f"{what}: root {root} is not a rank; expected 0..."
                                f"{self.world_size - 1}")
        self._need_store(what)
        key = f"{self.prefix}/{self.seq}/b"
        self.seq += 1                     # first: every rank's count moves, whatever happens
        if self.rank == root:
            value, err = self._encode(what, obj, max_bytes)
            if self.world_size > 1:
                value = self._publish(key, value, what)
                # the root leaves (and may take a store it hosts) once every reader has read
                wait_counted_out(self.store, f"{key}/n", self.world_size - 1, self.timeout, what)
                self._delete(key, f"{key}/n")
            if err is not None:
                raise err
            return _decode(value, what, root)
        value = self.store.get(key, timeout=self.timeout)
        count_out(self.store, f"{key}/n")
        return _decode(value, what, root)

    def all_gather(self, obj: Any, max_bytes: Optional[int] = None) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank.  An object some rank cannot
        send raises on every rank, naming that rank."""
        what = "all_gather_object"
        n = self.world_size
        if n > 1:
            self._need_store(what)
        base = f"{self.prefix}/{self.seq}/g"
        self.seq += 1                     # first: every rank's count moves, whatever happens
        value, err = self._encode(what, obj, max_bytes)
        if n == 1:
            if err is not None:
                raise err
            return [_decode(value, what, 0)]
        if self.rank != 0:
            self.store.set(f"{base}/{self.rank}", value)
            joined = self.store.get(f"{base}/all", timeout=self.timeout)
            count_out(self.store, f"{base}/n")
            if err is not None:
                raise err
            return _split(joined, n, what)
        parts = [value] + [self.store.get(f"{base}/{r}", timeout=self.timeout)
                           for r in range(1, n)]
        joined = self._publish(f"{base}/all", b"".join(_LEN.pack(len(p)) + p for p in parts),
                               what)
        wait_counted_out(self.store, f"{base}/n", n - 1, self.timeout, what)
        self._delete(f"{base}/all", f"{base}/n", *(f"{base}/{r}" for r in range(1, n)))
        if err is not None:
            raise err
        return _split(joined, n, what)

    def _encode(self, what: str, obj: Any,
                max_bytes: Optional[int]) -> Tuple[bytes, Optional[Exception]]:
        """(the value to publish, the error to raise here afterwards): a failure is published
        too (``E`` + why), so the other ranks raise at once instead of waiting it out."""
        try:
            return _OK + self._dump(what, obj, max_bytes), None
        except ArgumentError as e:
            return _ERR + str(e).encode("utf-8", "replace"), e

    def _publish(self, key: str, value: bytes, what: str) -> bytes:
        """``set`` the value; one the store refuses (larger than its values may be) is
        replaced by an error, which every rank then raises.  Returns what was published."""
        try:
            self.store.set(key, value)
            return value
        except StoreError as e:
            if isinstance(e, (StoreTimeout, StoreConnectionError)):
                raise
            value = _ERR + f"{what}: the store refused {len(value)} bytes: {e}".encode()
            self.store.set(key, value)
            return value

    def _delete(self, *keys: str) -> None:
        delete = getattr(self.store, "delete", None) or getattr(self.store, "delete_key", None)
        for k in keys:
            try:
                delete(k)
            except Exception:  # noqa: BLE001 - cleanup only: a leftover key harms nothing
                pass


_OK, _ERR = b"O", b"E"


def _decode(value: bytes, what: str, rank: int) -> Any:
    """The object in a published value, or the sender's error raised here."""
    if value[:1] == _ERR:
        raise ArgumentError(f"{what}: rank {rank} could not send its object: "
                            f"{value[1:].decode('utf-8', 'replace')}")
    return pickle.loads(value[1:])


def _split(joined: bytes, n: int, what: str) -> List[Any]:
    if joined[:1] == _ERR:                    # the joined result itself was refused
        raise ArgumentError(joined[1:].decode("utf-8", "replace"))
    parts, at = [], 0
    for _ in range(n):
        (size,) = _LEN.unpack_from(joined, at)
        at += _LEN.size
        parts.append(joined[at:at + size])
        at += size
    return [_decode(p, what, r) for r, p in enumerate(parts)]
