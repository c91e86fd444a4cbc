"""Pipelined requests: several requests sent at once, their replies read in order.

One round trip instead of ``len(calls)``: what the store's barrier uses for its arrive and the
previous generation's cleanup.  A mixin of :class:`~ncclpy.store.transport.Connection`.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import StoreConnectionError, StoreProtocolError, StoreTimeout
from . import protocol as P
from .liveness import _show
from .protocol import Status

__all__ = ["Pipelining"]

_REQ = P.REQ_HEADER.pack
_REP_FROM = P.REP_HEADER.unpack_from
_TIMED_OUT = (socket.timeout, BlockingIOError)
_INF = float("inf")


class Pipelining:
    """``_pipeline``: see the module docstring."""

    timeout: float
    connect_timeout: float
    max_value_size: int
    _addr: str
    _closed: bool
    _lock: threading.Lock
    _sock: Any
    _rbuf: bytearray

    def _spare(self) -> Any:  # pragma: no cover - provided by Connection
        raise NotImplementedError

    def _unspare(self, c: Any) -> None:  # pragma: no cover - provided by Connection
        raise NotImplementedError

    def _connect(self, budget: float, what: str = "", keys: Any = ()) -> None:  # pragma: no cover
        raise NotImplementedError

    def _drop(self) -> None:  # pragma: no cover - provided by Connection
        raise NotImplementedError

    def _recv_exact(self, sock: socket.socket, n: int, buf: bytearray,
                    deadline: Optional[float], probe: Any = None) -> bytearray:
        raise NotImplementedError  # pragma: no cover - provided by Connection

    def _raise(self, status: int, payload: bytes, what: str, keys: Any, wait: Optional[float],
               start: float) -> None:  # pragma: no cover - provided by Connection
        raise NotImplementedError

    def _pipeline(self, calls: Sequence[Tuple[int, bytes, Optional[float], object, str]]
                  ) -> List[bytes]:
        """Send several requests ``(op, body, wait, keys, what)`` at once and read their
        replies in order: one round trip instead of ``len(calls)``. The server runs them one
        after the other (a parked WAIT holds back the rest), and runs them all even if one
        fails; the first non-OK reply is raised once every reply has been read."""
        if self._closed:
            raise StoreConnectionError(f"{calls[0][4]}: this client of {self._addr} is closed")
        start = time.monotonic()
        bounds = []
        for _, _, wait, _, _ in calls:
            t = self.timeout if wait is None else wait + min(max(1.0, 0.1 * wait), 30.0)
            bounds.append(t)
        frames = b"".join(_REQ(op, len(body)) + body for op, body, _, _, _ in calls)
        replies = []
        lock = self._lock
        if not lock.acquire(False):   # another thread's call is in flight: use a spare
            spare = self._spare()
            try:
                return spare._pipeline(calls)
            finally:
                self._unspare(spare)
        try:
            if self._sock is None:
                self._connect(min(self.connect_timeout, bounds[0]), calls[0][4], calls[0][3])
                if self._closed:
                    self._drop()
                    raise StoreConnectionError(f"{calls[0][4]}: this client of {self._addr} "
                                               f"is closed")
            sock = self._sock
            buf = self._rbuf
            deadline = start
            i = 0
            try:
                sock.sendall(frames)   # bounded by the send side armed at connect
                for i, bound in enumerate(bounds):
                    deadline += bound
                    dl = None if deadline == _INF else deadline
                    status, n = _REP_FROM(self._recv_exact(sock, P.HEADER_SIZE, buf, dl), 0)
                    limit = max(self.max_value_size, 1 << 16) + 16
                    if n > limit:
                        raise StoreProtocolError(f"{calls[i][4]}: the store at {self._addr} "
                                                 f"announced a {n}-byte reply (limit {limit})")
                    replies.append((status, bytes(self._recv_exact(sock, n, buf, dl))))
                    if status not in (Status.OK, Status.TIMEOUT, Status.ERR_REQUEST):
                        self._drop()  # the server closes the connection after these
                        break
            except _TIMED_OUT as e:
                self._drop()
                raise StoreTimeout(f"{calls[i][4]}: no reply from the store at {self._addr} "
                                   f"after {time.monotonic() - start:.2f} s for key(s) "
                                   f"{_show(calls[i][3])}") from e
            except StoreProtocolError:
                self._drop()
                raise
            except OSError as e:
                self._drop()
                raise StoreConnectionError(
                    f"{calls[i][4]}: lost the connection to the store at {self._addr} after "
                    f"{time.monotonic() - start:.2f} s ({type(e).__name__}: {e}); key(s) "
                    f"{_show(calls[i][3])}") from e
        finally:
            lock.release()
        for (status, payload), (_, _, wait, keys, what) in zip(replies, calls):
            if status != Status.OK:
                self._raise(status, payload, what, keys, wait, start)
        return [payload for _, payload in replies]
