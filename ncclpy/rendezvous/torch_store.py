"""ncclpy's store interface over a torch.distributed store (e.g. torchrun's agent store).

Under torchrun, ncclpy joins the TCPStore torchrun already serves at MASTER_PORT instead of
opening a second port: nothing to collide with, and it works for every torchrun rendezvous
backend.  :class:`TorchStoreAdapter` gives that store the methods ncclpy's own client has
(``get`` with a timeout, ``delete``, ``wait`` in seconds, ``close``) and turns torch's errors
(``DistStoreError``, ``DistNetworkError``, ...) into ncclpy's :class:`StoreTimeout` /
:class:`StoreError`, naming the key, the address and the wait.  torch is imported only by
whoever built the torch store; this module itself imports nothing heavy.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Iterable, Optional, Union

from ..errors import StoreError, StoreTimeout

__all__ = ["TorchStoreAdapter"]

Key = Union[str, bytes]


def _key(key: Key) -> str:
    return key.decode() if isinstance(key, (bytes, bytearray)) else str(key)


def _seconds(timeout: Union[float, int, datetime.timedelta, None], default: float) -> float:
    """A timeout in seconds, given as ncclpy's store takes it: seconds or a timedelta (None:
    ``default``)."""
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _looks_like_timeout(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "timeout" in text or "timed out" in text


class TorchStoreAdapter:
    """A torch.distributed store with ncclpy's store methods (see module docstring)."""

    def __init__(self, store: Any, address: str = "?", timeout: float = 300.0) -> None:
        self._store = store
        self.address = address
        self.timeout = float(timeout)
        self.closed = False

    @property
    def torch_store(self) -> Any:
        """The wrapped torch store (e.g. to hand to ``torch.distributed.init_process_group``)."""
        return self._store

    def _call(self, op: str, key: str, waited: Optional[float], fn, *args: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args)
        except Exception as e:
            spent = time.monotonic() - t0
            limit = f" (limit {waited:g} s)" if waited is not None else ""
            if _looks_like_timeout(e):
                raise StoreTimeout(f"{op} {key!r} on torch store {self.address}: no answer after "
                                   f"{spent:.1f} s{limit} ({type(e).__name__}: {e})") from e
            raise StoreError(f"{op} {key!r} on torch store {self.address} failed after "
                             f"{spent:.1f} s ({type(e).__name__}: {e})") from e

    def set(self, key: Key, value: Union[bytes, str]) -> None:
        k = _key(key)
        self._call("set", k, None, self._store.set, k, value)

    def get(self, key: Key, timeout: Union[float, datetime.timedelta, None] = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` (seconds or a timedelta; default:
        the store's)."""
        k = _key(key)
        t = _seconds(timeout, self.timeout)
        self._call("get", k, t, self._store.wait, [k], datetime.timedelta(seconds=t))
        return bytes(self._call("get", k, t, self._store.get, k))

    def add(self, key: Key, amount: int = 1) -> int:
        k = _key(key)
        return int(self._call("add", k, None, self._store.add, k, int(amount)))

    def compare_set(self, key: Key, expected: Union[bytes, str],
                    desired: Union[bytes, str]) -> bytes:
        k = _key(key)
        return bytes(self._call("compare_set", k, None, self._store.compare_set, k, expected,
                                desired))

    def delete(self, key: Key) -> bool:
        k = _key(key)
        return bool(self._call("delete", k, None, self._store.delete_key, k))

    def wait(self, keys: Union[Key, Iterable[Key]],
             timeout: Union[float, datetime.timedelta, None] = None) -> None:
        """Block until every key exists, up to ``timeout`` (seconds or a timedelta, as
        ncclpy's store and torch's take it; default: the store's)."""
        ks = [_key(keys)] if isinstance(keys, (str, bytes, bytearray)) else [_key(k) for k in keys]
        t = _seconds(timeout, self.timeout)
        self._call("wait", ",".join(ks), t, self._store.wait, ks, datetime.timedelta(seconds=t))

    def check(self, keys: Union[Key, Iterable[Key]]) -> bool:
        """True if every key exists (does not wait)."""
        ks = [_key(keys)] if isinstance(keys, (str, bytes, bytearray)) else [_key(k) for k in keys]
        return bool(self._call("check", ",".join(ks), None, self._store.check, ks))

    def num_keys(self) -> int:
        return int(self._call("num_keys", "", None, self._store.num_keys))

    def close(self) -> None:
        """Drop the reference (torch closes the connection when the store object goes)."""
        self.closed = True

    def __enter__(self) -> "TorchStoreAdapter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ncclpy.TorchStoreAdapter {self.address}>"
