"""Liveness of a store connection: a stopped store is found in seconds, a slow one is kept.

Two mechanisms of :class:`~ncclpy.store.transport.Connection` (mixed in):

* **Probe.**  A call bounded by more than ``probe_after + probe_timeout`` seconds (a parked
  ``get``, a long ``wait``) pings the store over a second connection after each ``probe_after``
  seconds without a reply.  A store whose process is stopped (SIGSTOP: its kernel still accepts
  and acknowledges, so TCP keepalive cannot tell) or frozen answers no ping, and the call fails
  within about ``probe_after + probe_timeout`` seconds with a :class:`StoreConnectionError` that
  says so, instead of after its whole timeout.  A store that is merely busy answers the ping and
  the call waits on.  The probe connection lives only while such a call waits.
* **Owed replies.**  A call that times out after its request was sent leaves the connection
  open; the reply is owed, and the next call reads and discards it first (up to
  :data:`MAX_OWED` of them, else the connection is re-dialled).  An overloaded store is thus
  not also hit by a storm of reconnects (TCP connect, greeting, HMAC) from its slowest clients.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, List, Optional

from ..errors import StoreConnectionError, StoreProtocolError, StoreTimeout
from . import protocol as P

__all__ = ["Liveness", "PROBE_AFTER", "PROBE_TIMEOUT", "MAX_OWED"]

#: Seconds without a reply after which a long call probes the store over a second connection,
#: and how long that probe may take: a store whose process is stopped (SIGSTOP) or frozen is
#: found within about PROBE_AFTER + PROBE_TIMEOUT seconds, not after the call's whole timeout.
#: Only calls bounded by more than the sum probe (a parked get, a long wait).
PROBE_AFTER = 5.0
PROBE_TIMEOUT = 5.0
#: Replies a connection may owe (calls that timed out after their request was sent) before it is
#: dropped and re-dialled instead of kept: a slow reply is read and discarded by the next call,
#: so a slow store costs no reconnect storm.
MAX_OWED = 4


class Liveness:
    """The probe and owed-reply machinery (see the module docstring)."""

    _owed: int
    _prober: Any
    probe_after: float
    probe_timeout: float
    _addr: str
    _rbuf: bytearray
    _closed: bool
    _spare_lock: threading.Lock
    _spare_all: List[Any]

    def _new_connection(self) -> Any:  # pragma: no cover - provided by Connection
        raise NotImplementedError

    def _recv_exact(self, sock: socket.socket, n: int, buf: bytearray,
                    deadline: Optional[float], probe: Any = None) -> bytearray:
        raise NotImplementedError  # pragma: no cover - provided by Connection

    def _settle(self, sock: socket.socket, deadline: Optional[float]) -> None:
        """Read and discard the replies this connection owes (see :data:`MAX_OWED`)."""
        buf = self._rbuf
        while self._owed:
            head = self._recv_exact(sock, P.HEADER_SIZE, buf, deadline)
            _, n = P.REP_HEADER.unpack_from(head, 0)
            self._recv_exact(sock, n, buf, deadline)
            self._owed -= 1

    def _probe(self, what: str, keys, start: float) -> None:
        """Ping the store over a second connection (bounded by :attr:`probe_timeout`); raise
        :class:`StoreConnectionError` saying so when it does not answer."""
        p = self._prober
        if p is None:
            p = self._new_connection()
            p.timeout = p.connect_timeout = self.probe_timeout
            p.probe_after = float("inf")
            with self._spare_lock:
                self._spare_all.append(p)
                p._closed = self._closed
            self._prober = p
        try:
            p._call(P.Op.PING, b"", b"", None, [], "probe")
        except (StoreTimeout, StoreConnectionError, StoreProtocolError) as e:
            self._end_probe()
            raise StoreConnectionError(
                f"{what}: the store at {self._addr} answered neither this call (waiting "
                f"{time.monotonic() - start:.1f} s) nor a probe on a second connection within "
                f"{self.probe_timeout:g} s: the process hosting it is stopped (SIGSTOP), frozen "
                f"or unreachable; key(s) {_show(keys)} ({type(e).__name__}: {e})") from None

    def _end_probe(self) -> None:
        p, self._prober = self._prober, None
        if p is not None:
            with self._spare_lock:
                if p in self._spare_all:
                    self._spare_all.remove(p)
            p._closed = True
            p._drop()


def _show(keys: Any) -> str:
    """Keys for an error message: ``'a', 'b' (+3 more)``."""
    if isinstance(keys, bytes):
        keys = [keys]
    shown = [k.decode("utf-8", "replace") for k in keys[:8]]
    more = f" (+{len(keys) - 8} more)" if len(keys) > 8 else ""
    return ", ".join(repr(k) for k in shown) + more
