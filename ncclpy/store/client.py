"""The store client: one persistent connection, every call bounded by a timeout.

Duck-compatible with ``torch.distributed.TCPStore`` for the methods ncclpy relies on (``set``,
``get``, ``add``, ``compare_set``, ``wait``, ``num_keys``, ``check``, ``delete_key``), so either
store can be handed to ncclpy's bootstrap.
"""
from __future__ import annotations

import datetime
import hmac
import os
import socket
import threading
import time
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from ..errors import (ArgumentError, ArgumentTypeError, StoreAuthError, StoreConnectionError,
                      StoreProtocolError, StoreRequestError, StoreTimeout)
from . import protocol as P
from .protocol import Op, Status
from .server import StoreServer, resolve_token

__all__ = ["TCPStore"]

Key = Union[str, bytes]
Value = Union[bytes, bytearray, memoryview, str]
Seconds = Union[float, int, datetime.timedelta, None]
_SMALL = 1 << 16
_INF = float("inf")
_REQ = P.REQ_HEADER.pack
_REP_FROM = P.REP_HEADER.unpack_from
_U32 = P.U32.pack


def _seconds(value: Seconds, name: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name}: expected seconds (float) or timedelta, "
                                f"got {type(value).__name__}")
    if value < 0 or value != value:
        raise ArgumentError(f"{name}: expected >= 0 seconds, got {value}")
    return float(value)


def _key(key: Key) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    raise ArgumentTypeError(f"key: expected str or bytes, got {type(key).__name__}")


def _value(value: Value, name: str = "value") -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise ArgumentTypeError(f"{name}: expected bytes or str, got {type(value).__name__}")


def _show(keys: Union[bytes, Sequence[bytes]]) -> str:
    if isinstance(keys, bytes):
        keys = [keys]
    shown = [k.decode("utf-8", "replace") for k in keys[:8]]
    more = f" (+{len(keys) - 8} more)" if len(keys) > 8 else ""
    return ", ".join(repr(k) for k in shown) + more


class TCPStore:
    """Client of a :class:`StoreServer` (``is_server=True``: start one in-process first).

    ``timeout`` bounds every call (seconds or timedelta; ``get``/``wait`` take their own);
    ``connect_timeout`` (default: ``timeout``) bounds connection set-up, retried with exponential
    backoff so ranks may start before the server. ``token`` (or ``$NCCLPY_STORE_TOKEN``) is proven
    by challenge-response, never sent. One object may be shared by threads: calls serialise.
    """

    def __init__(self, host: str, port: int, *, token=None, timeout: Seconds = 300.0,
                 connect_timeout: Seconds = None, is_server: bool = False) -> None:
        if not isinstance(host, str) or not host:
            raise ArgumentError(f"host: expected a host name or address, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ArgumentError(f"port: expected an int in 0..65535, got {port!r}")
        self.timeout = _seconds(timeout, "timeout")
        if self.timeout is None:
            self.timeout = float("inf")
        ct = _seconds(connect_timeout, "connect_timeout")
        self.connect_timeout = self.timeout if ct is None else ct
        self._token = resolve_token(token)
        self.server: Optional[StoreServer] = None
        if is_server:
            self.server = StoreServer(host, port, token=self._token).start()
            port = self.server.port
        elif port == 0:
            raise ArgumentError("port: 0 (pick a free port) only makes sense with is_server=True")
        self.host = host
        self.port = port
        self._addr = f"{host}:{port}"
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._sock_timeout: Optional[float] = -1.0
        self._rbuf = bytearray()
        self._closed = False
        self.max_key_size = 0
        self.max_value_size = 0
        try:
            with self._lock:
                self._connect(self.connect_timeout)
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise

    # ------------------------------------------------------------------ connection
    @property
    def address(self) -> Tuple[str, int]:
        return (self.host, self.port)

    def _connect(self, budget: float) -> None:
        deadline = time.monotonic() + budget
        delay = 0.01
        attempts = 0
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            sock = None
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=min(max(remaining, 0.05), 30.0))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._handshake(sock, deadline)
                self._sock = sock
                self._sock_timeout = -1.0
                self._rbuf = bytearray()
                return
            except (StoreAuthError, StoreProtocolError):
                if sock is not None:
                    sock.close()
                raise
            except (OSError, StoreConnectionError) as e:
                if sock is not None:
                    sock.close()
                last = e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreConnectionError(
                    f"could not connect to the store at {self._addr} within {budget:.1f} s "
                    f"({attempts} attempt{'s' if attempts != 1 else ''}; last error: "
                    f"{type(last).__name__}: {last})") from last
            time.sleep(min(delay, remaining))
            delay = min(delay * 2.0, 1.0)

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        sock.settimeout(max(deadline - time.monotonic(), 0.05))
        hello = self._recv_exact(sock, P.HELLO_SIZE, bytearray())
        magic, version, flags, max_key, max_value, nonce = P.parse_hello(hello)
        if magic != P.MAGIC:
            raise StoreProtocolError(f"{self._addr} is not an ncclpy store (greeting "
                                     f"{bytes(hello[:4])!r}, expected {P.MAGIC!r})")
        if version != P.VERSION:
            raise StoreProtocolError(f"the store at {self._addr} speaks protocol version "
                                     f"{version}; this client speaks {P.VERSION}")
        self.max_key_size, self.max_value_size = max_key, max_value
        need_auth = bool(flags & P.FLAG_AUTH)
        if not need_auth and self._token is None:
            return
        cnonce = os.urandom(P.NONCE_SIZE)
        body = b"" if self._token is None else P.client_mac(self._token, nonce) + cnonce
        sock.sendall(P.request(Op.AUTH, body))
        buf = bytearray()
        status, n = P.REP_HEADER.unpack(self._recv_exact(sock, P.HEADER_SIZE, buf))
        if n > 4096:
            raise StoreProtocolError(f"the store at {self._addr} sent a {n}-byte auth reply")
        payload = self._recv_exact(sock, n, buf)
        if status == Status.ERR_AUTH or (status == Status.OK and self._token is None):
            msg = bytes(payload).decode("utf-8", "replace")
            if self._token is None:
                raise StoreAuthError(f"the store at {self._addr} requires a token and none was "
                                     f"given (pass token= or set $NCCLPY_STORE_TOKEN): {msg}")
            if not need_auth:
                raise StoreAuthError(f"this client has a token but the store at {self._addr} "
                                     f"was started without one: {msg}")
            raise StoreAuthError(f"the store at {self._addr} rejected this client's token: {msg}")
        if status != Status.OK:
            raise StoreProtocolError(f"unexpected auth reply from {self._addr}: status "
                                     f"{status} {bytes(payload)[:200]!r}")
        if not hmac.compare_digest(bytes(payload), P.server_mac(self._token, cnonce)):
            raise StoreAuthError(f"the store at {self._addr} could not prove it holds the same "
                                 "token; refusing to use it")

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> bytearray:
        """Read until ``n`` bytes are available; return them and keep any surplus in ``buf``."""
        if len(buf) < n and n - len(buf) > _SMALL:  # large value: read straight into place
            out = bytearray(n)
            have = len(buf)
            out[:have] = buf
            buf.clear()
            view = memoryview(out)
            while have < n:
                got = sock.recv_into(view[have:])
                if not got:
                    raise ConnectionResetError("the store closed the connection")
                have += got
            return out
        while len(buf) < n:
            chunk = sock.recv(_SMALL)
            if not chunk:
                raise ConnectionResetError("the store closed the connection")
            buf += chunk
        out = buf[:n]
        del buf[:n]
        return out

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._rbuf = bytearray()

    # ------------------------------------------------------------------ requests
    def _call(self, op: int, head: bytes, tail: bytes, wait: Optional[float],
              keys: Union[bytes, List[bytes]], what: str) -> bytes:
        """Send one request (body ``head + tail``), return the OK body.

        ``wait``: how long the server may park it (GET, WAIT); the socket then allows some slack
        beyond that for the server's TIMEOUT reply to arrive.
        """
        if self._closed:
            raise StoreConnectionError(f"{what}: this client of {self._addr} is closed")
        start = time.monotonic()
        if wait is None:
            sock_timeout = self.timeout
        else:
            sock_timeout = wait + min(max(1.0, 0.1 * wait), 30.0)
        if sock_timeout == _INF:
            sock_timeout = None
        size = len(head) + len(tail)
        with self._lock:
            if self._sock is None:
                budget = self.connect_timeout if sock_timeout is None else min(
                    self.connect_timeout, sock_timeout)
                self._connect(budget)
            sock = self._sock
            if sock_timeout != self._sock_timeout:
                sock.settimeout(sock_timeout)
                self._sock_timeout = sock_timeout
            try:
                if size < _SMALL:
                    sock.sendall(_REQ(op, size) + head + tail)
                else:  # large value: no concatenated copy
                    sock.sendall(_REQ(op, size) + head)
                    sock.sendall(tail)
                buf = self._rbuf
                if not buf:  # fast path: the whole reply in one recv
                    data = sock.recv(_SMALL)
                    if len(data) >= 5:
                        status, n = _REP_FROM(data, 0)
                        if len(data) == 5 + n:
                            if status == Status.OK:
                                return data[5:]
                    elif not data:
                        raise ConnectionResetError("the store closed the connection")
                    buf += data
                status, n = _REP_FROM(self._recv_exact(sock, P.HEADER_SIZE, buf), 0)
                limit = max(self.max_value_size, 1 << 16) + 16
                if n > limit:
                    raise StoreProtocolError(f"{what}: the store at {self._addr} announced a "
                                             f"{n}-byte reply (limit {limit})")
                payload = bytes(self._recv_exact(sock, n, buf))
            except socket.timeout as e:
                self._drop()
                raise StoreTimeout(f"{what}: no reply from the store at {self._addr} after "
                                   f"{time.monotonic() - start:.2f} s (timeout "
                                   f"{sock_timeout:.2f} s) for key(s) {_show(keys)}") from e
            except StoreProtocolError:
                self._drop()
                raise
            except OSError as e:
                self._drop()
                raise StoreConnectionError(
                    f"{what}: lost the connection to the store at {self._addr} after "
                    f"{time.monotonic() - start:.2f} s ({type(e).__name__}: {e}); key(s) "
                    f"{_show(keys)}") from e
            if status == Status.OK:
                return payload
            if status not in (Status.TIMEOUT, Status.ERR_REQUEST):
                self._drop()  # the server closes the connection after these
        msg = payload.decode("utf-8", "replace")
        if status == Status.TIMEOUT:
            try:
                missing = P.unpack_keys(payload, 0, 1 << 30) or keys
            except ValueError:
                missing = keys
            raise StoreTimeout(f"{what}: timed out after {time.monotonic() - start:.2f} s "
                               f"(timeout {wait:.2f} s) waiting for key(s) {_show(missing)} on "
                               f"the store at {self._addr}")
        if status == Status.ERR_REQUEST:
            raise StoreRequestError(f"{what}: the store at {self._addr} refused key(s) "
                                    f"{_show(keys)}: {msg}")
        if status == Status.ERR_AUTH:
            raise StoreAuthError(f"{what}: the store at {self._addr} rejected this client: {msg}")
        if status == Status.ERR_PROTOCOL:
            raise StoreProtocolError(f"{what}: the store at {self._addr} reported a protocol "
                                     f"error: {msg}")
        raise StoreProtocolError(f"{what}: unknown reply status {status} from {self._addr}")

    def _check_key(self, k: bytes, what: str) -> None:
        if self.max_key_size and len(k) > self.max_key_size:
            raise StoreRequestError(f"{what}: key {_show([k])} is {len(k)} bytes; the store at "
                                    f"{self._addr} allows at most max_key_size="
                                    f"{self.max_key_size} bytes")

    def _check_value(self, v: bytes, what: str, k: bytes) -> None:
        if self.max_value_size and len(v) > self.max_value_size:
            raise StoreRequestError(f"{what}: the value for key {_show([k])} is {len(v)} bytes; "
                                    f"the store at {self._addr} allows at most max_value_size="
                                    f"{self.max_value_size} bytes")

    # ------------------------------------------------------------------ operations
    def set(self, key: Key, value: Value) -> None:
        """Store ``value`` (bytes, or str as UTF-8) under ``key``; wakes its waiters."""
        k = key.encode("utf-8") if type(key) is str else _key(key)
        v = value if type(value) is bytes else _value(value)
        if len(k) > self.max_key_size or len(v) > self.max_value_size:
            self._check_key(k, "set")
            self._check_value(v, "set", k)
        self._call(Op.SET, _U32(len(k)) + k, v, None, k, "set")

    def get(self, key: Key, timeout: Seconds = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` (default: the store's) for it."""
        k = key.encode("utf-8") if type(key) is str else _key(key)
        self._check_key(k, "get")
        t = self.timeout if timeout is None else _seconds(timeout, "timeout")
        return self._call(Op.GET, _U32(P.timeout_ms(t)), k, t, k, "get")

    def add(self, key: Key, amount: int = 1) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing counts as 0); new value."""
        k = key.encode("utf-8") if type(key) is str else _key(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise ArgumentTypeError(f"amount: expected int, got {type(amount).__name__}")
        if not -(1 << 63) <= amount < (1 << 63):
            raise ArgumentError(f"amount: expected a 64-bit signed int, got {amount}")
        self._check_key(k, "add")
        return int(self._call(Op.ADD, P.I64.pack(amount), k, None, k, "add"))

    def compare_set(self, key: Key, expected: Value, desired: Value) -> bytes:
        """torch's semantics: set ``desired`` if the value equals ``expected`` (a missing key
        matches only ``b""``); returns the value after the call (``expected`` if missing)."""
        k, e, d = _key(key), _value(expected, "expected"), _value(desired, "desired")
        self._check_key(k, "compare_set")
        self._check_value(e, "compare_set", k)
        self._check_value(d, "compare_set", k)
        return self._call(Op.CAS, _U32(len(k)) + k + _U32(len(e)) + e, d, None, k,
                          "compare_set")

    def delete(self, key: Key) -> bool:
        """Remove ``key``; True if it existed."""
        k = _key(key)
        self._check_key(k, "delete")
        return self._call(Op.DELETE, k, b"", None, k, "delete") == b"\x01"

    delete_key = delete

    def _keys(self, keys: Union[Key, Iterable[Key]], what: str) -> List[bytes]:
        if isinstance(keys, (str, bytes, bytearray)):
            keys = [keys]
        ks = [_key(k) for k in keys]
        for k in ks:
            self._check_key(k, what)
        return ks

    def wait(self, keys: Union[Key, Iterable[Key]], timeout: Seconds = None) -> None:
        """Block until every key exists, up to ``timeout`` (seconds or timedelta)."""
        ks = self._keys(keys, "wait")
        t = self.timeout if timeout is None else _seconds(timeout, "timeout")
        self._call(Op.WAIT, _U32(P.timeout_ms(t)), P.pack_keys(ks), t, ks, "wait")

    def check(self, keys: Union[Key, Iterable[Key]]) -> bool:
        """True if every key exists (does not wait)."""
        ks = self._keys(keys, "check")
        return self._call(Op.CHECK, P.pack_keys(ks), b"", None, ks, "check") == b"\x01"

    def num_keys(self) -> int:
        """Number of keys in the store."""
        return P.U64.unpack(self._call(Op.NUM_KEYS, b"", b"", None, [], "num_keys"))[0]

    def ping(self) -> None:
        """One round trip (raises if the server is gone)."""
        self._call(Op.PING, b"", b"", None, [], "ping")

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Close the connection (and the in-process server, if this client started it)."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:  # wakes a thread blocked in this client's get/wait
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> "TCPStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TCPStore({self._addr}, server={'in-process' if self.server else 'remote'}, "
                f"closed={self._closed})")
