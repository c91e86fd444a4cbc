"""The client's transport: connecting, the greeting and auth, and request/reply round trips.

:class:`Connection` is the base of :class:`~ncclpy.store.client.TCPStore`; it owns the socket,
its timeouts and the mapping of replies to named errors. On Linux each blocking ``send``/``recv``
is bounded by ``SO_RCVTIMEO``/``SO_SNDTIMEO`` rather than Python's socket timeout (which polls
before every call: twice the system calls and GIL hand-offs, which is what a rendezvous of
hundreds of ranks in one process pays for). Arming a bound is a system call too, so a call keeps
the receive bound already armed when that one is shorter than its own (but at least ``_KEEP``)
and only a recv that times out on it early re-arms: see :meth:`Connection._arm`.
"""
from __future__ import annotations

import datetime
import functools
import hmac
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, List, Optional, Tuple, Union

from ..errors import (ArgumentTypeError, ArgumentError, StoreAuthError, StoreConnectionError,
                      StoreProtocolError, StoreRequestError, StoreTimeout)
from . import protocol as P
from .keepalive import set_keepalive
from .liveness import MAX_OWED, PROBE_AFTER, PROBE_TIMEOUT, Liveness, _show
from .pipeline import Pipelining
from .protocol import Op, Status

__all__ = ["Connection", "GREETING_TIMEOUT", "PROBE_AFTER", "PROBE_TIMEOUT", "MAX_OWED", "Key",
           "Value", "Seconds"]

#: Seconds a client waits for the server's greeting after connecting. An ncclpy server greets at
#: once; a peer that stays silent (another kind of server on that port, e.g. torch's TCPStore)
#: fails fast with a clear error instead of holding the caller for the whole connect timeout.
GREETING_TIMEOUT = 10.0

Key = Union[str, bytes]
Value = Union[bytes, bytearray, memoryview, str]
Seconds = Union[float, int, datetime.timedelta, None]
_SMALL = 1 << 16
_INF = float("inf")
_REQ = P.REQ_HEADER.pack
_REP_FROM = P.REP_HEADER.unpack_from
_OS_TIMEOUTS = sys.platform.startswith("linux") and hasattr(socket, "SO_RCVTIMEO")
_TIMEVAL = struct.Struct("@ll").pack
_TIMED_OUT = (socket.timeout, BlockingIOError)   # how either kind of timeout surfaces


_KEEP = 1.0   # seconds: a shorter receive bound than a call needs is kept if at least this long


def _keeps(armed: Optional[float], need: Optional[float]) -> bool:
    """Whether a receive bound ``armed`` (None: unbounded, < 0: unknown) may stay for a read
    bounded by ``need`` (None: unbounded): the same, or shorter but at least ``_KEEP``; a recv
    that times out on a kept bound early is retried with the bound re-armed."""
    return armed == need or (armed is not None and armed >= _KEEP
                             and (need is None or armed <= need))


def _set_timeout(sock: socket.socket, seconds: Optional[float], send: bool = True,
                 recv: bool = True) -> None:
    """Bound each blocking recv and/or send on ``sock`` by ``seconds`` (None: unbounded).

    Where only Python's socket timeout exists, it bounds both whatever is asked. A request under
    64 KiB never waits for send-buffer space (one request is in flight at a time), so the send
    bound armed at connect time is only a safety net; large sends re-arm it."""
    if not _OS_TIMEOUTS:
        sock.settimeout(seconds)
        return
    if seconds is None:
        tv = _TIMEVAL(0, 0)
    else:  # 0 would mean "no timeout" to the kernel
        s = min(max(seconds, 0.001), 1e9)
        tv = _TIMEVAL(int(s), int((s - int(s)) * 1e6))
    if recv:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    if send:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _numeric(host: str) -> Optional[int]:
    """The address family of an IP literal, None for a name (resolved on every attempt)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return family
        except (OSError, ValueError):
            pass
    return None


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


class Connection(Liveness, Pipelining):
    """One persistent connection to a store server; the request machinery of ``TCPStore``."""

    host: str
    port: int
    timeout: float
    connect_timeout: float
    _token: Optional[bytes]

    def _init_connection(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._addr = f"{host}:{port}"
        self._family = _numeric(host)
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        # the receive bound armed on the socket in use or being set up: None unbounded, -1.0
        # unknown. Kept so that a call re-arms (a system call) only when it must; see _arm.
        self._sock_timeout: Optional[float] = -1.0
        self._rbuf = bytearray()
        self._owed = 0          # replies of timed-out calls still to be read and discarded
        self._prober: Optional["Connection"] = None
        self.probe_after, self.probe_timeout = PROBE_AFTER, PROBE_TIMEOUT
        self._closed = False
        self.max_key_size = 0
        self.max_value_size = 0
        self.max_keys_per_request = 0
        self.server_flags = 0   # the greeting's feature bits (protocol.FLAG_*)
        # spare connections for calls made while another thread holds this one (a parked get
        # must not hold back another thread's set): see _spare
        self._spare_lock = threading.Lock()
        self._spares: List["Connection"] = []       # idle, ready for reuse
        self._spare_all: List["Connection"] = []    # every one made, closed with this one

    def _new_connection(self) -> "Connection":
        """A fresh, unconnected Connection to the same server with this one's token."""
        c = Connection.__new__(Connection)
        c.timeout, c.connect_timeout, c._token = self.timeout, self.connect_timeout, self._token
        c._init_connection(self.host, self.port)
        return c

    def _spare(self) -> "Connection":
        """An idle spare connection to the same server (made on first need, connected lazily
        by its first call); give it back with :meth:`_unspare`. Used only while another thread
        holds the main connection, so a single-threaded caller never pays for one."""
        with self._spare_lock:
            if self._spares:
                return self._spares.pop()
        c = self._new_connection()
        with self._spare_lock:
            self._spare_all.append(c)
            c._closed = self._closed
        return c

    def _unspare(self, c: "Connection") -> None:
        with self._spare_lock:
            if not c._closed:
                self._spares.append(c)

    def _close_spares(self) -> None:
        """Close every spare connection (waking a thread blocked in one)."""
        with self._spare_lock:
            spares, self._spare_all, self._spares = self._spare_all, [], []
            for c in spares:
                c._closed = True
        for c in spares:
            sock = c._sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _arm(self, sock: socket.socket, seconds: Optional[float], recv: bool = True,
             send: bool = False) -> None:
        """Arm the receive and/or send bound and remember the receive one.

        Why the bookkeeping: a call whose reply comes at once never meets its bound, so the
        calls keep an armed bound that :func:`_keeps` allows and re-arm only when the kept one
        runs out first. A get (bound: timeout + slack) after a set (bound: timeout) then costs
        no system call."""
        _set_timeout(sock, seconds, send=send, recv=recv)
        if recv or not _OS_TIMEOUTS:   # Python's socket timeout bounds both sides
            self._sock_timeout = seconds

    @property
    def address(self) -> Tuple[str, int]:
        """``(host, port)`` of the server this client talks to."""
        return (self.host, self.port)

    def _open(self, remaining: float) -> socket.socket:
        """A connected TCP socket (one attempt), armed with a connect timeout."""
        if self._family is not None:
            targets = [(self._family, (self.host, self.port))]
        else:
            targets = [(ai[0], ai[4]) for ai in socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM)]
        err: Optional[OSError] = None
        for family, sockaddr in targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock_timeout = None   # a new socket's receives are unbounded
            try:
                # connect() is bounded by the send side
                self._arm(sock, min(max(remaining, 0.05), 30.0), recv=False, send=True)
                sock.connect(sockaddr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                set_keepalive(sock)   # a store host that froze resets the connection
                return sock
            except OSError as e:
                sock.close()
                if isinstance(e, _TIMED_OUT):
                    e = TimeoutError(f"connect timed out after {remaining:.2f} s")
                err = e
        raise err if err is not None else OSError(f"no address for {self.host!r}")

    def _connect(self, budget: float, what: str = "", keys=()) -> None:
        """Connect and greet, retrying with backoff for up to ``budget`` seconds. ``what`` and
        ``keys``: the call this reconnect serves, named in the error."""
        deadline = time.monotonic() + budget
        delay = 0.01
        attempts = 0
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            sock = None
            try:
                sock = self._open(remaining)
                rest = self._handshake(sock, deadline)
                bound = None if self.timeout == _INF else self.timeout
                # the send side for good; the handshake's receive bound stays until a call
                self._arm(sock, bound, recv=False, send=True)   # needs another
                self._sock = sock
                self._rbuf = rest
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
                tried = (f"{attempts} attempt{'s' if attempts != 1 else ''}; last error: "
                         f"{type(last).__name__}: {last}")
                if what:
                    raise StoreConnectionError(
                        f"{what}: could not reconnect to the store at {self._addr} within "
                        f"{budget:.1f} s ({tried}); key(s) {_show(keys)}") from last
                raise StoreConnectionError(
                    f"could not connect to the store at {self._addr} within {budget:.1f} s "
                    f"({tried})") from last
            time.sleep(min(delay, remaining))
            delay = min(delay * 2.0, 1.0)

    def _handshake(self, sock: socket.socket, deadline: float) -> bytearray:
        """Read the greeting and authenticate; the bytes received past them (kept: a reply
        may arrive in the same segment as the greeting, e.g. the auth reply right behind it)."""
        now = time.monotonic()
        remaining = max(deadline - now, 0.05)
        greet = min(remaining, GREETING_TIMEOUT)
        buf = bytearray()   # one buffer for the whole handshake: nothing received is dropped
        try:
            hello = self._recv_exact(sock, P.HELLO_SIZE, buf, now + greet)
        except _TIMED_OUT:
            msg = (f"the server at {self._addr} accepted the connection but did not send the "
                   f"ncclpy greeting within {greet:.1f} s: it is not an ncclpy store (torch's "
                   f"TCPStore, for one, never greets), or it is too busy to accept clients")
            if greet < GREETING_TIMEOUT:   # out of connect budget: maybe just slow
                raise StoreConnectionError(msg) from None
            raise StoreProtocolError(msg) from None
        except ConnectionResetError as e:
            raise ConnectionResetError(f"{e} before its greeting") from None
        magic, version, flags, max_key, max_value, nonce = P.parse_hello(hello)
        if magic != P.MAGIC:
            raise StoreProtocolError(f"{self._addr} is not an ncclpy store (greeting "
                                     f"{bytes(hello[:4])!r}, expected {P.MAGIC!r})")
        if version != P.VERSION:
            raise StoreProtocolError(f"the store at {self._addr} speaks protocol version "
                                     f"{version}; this client speaks {P.VERSION}")
        if flags & P.FLAG_REFUSED:   # the server is full: it says why, then closes
            try:
                _, n = P.REP_HEADER.unpack(self._recv_exact(sock, P.HEADER_SIZE, buf,
                                                            now + remaining))
                why = bytes(self._recv_exact(sock, min(n, 4096), buf, now + remaining))
            except (OSError, struct.error):
                why = b"(no reason received)"
            raise StoreConnectionError(f"the store at {self._addr} refused this client: "
                                       f"{why.decode('utf-8', 'replace')}")
        self.max_key_size, self.max_value_size = max_key, max_value
        self.max_keys_per_request = P.hello_max_keys(hello)
        self.server_flags = flags
        need_auth = bool(flags & P.FLAG_AUTH)
        if not need_auth and self._token is None:
            return buf
        cnonce = os.urandom(P.NONCE_SIZE)
        body = b"" if self._token is None else P.client_mac(self._token, nonce) + cnonce
        sock.sendall(P.request(Op.AUTH, body))
        status, n = P.REP_HEADER.unpack(self._recv_exact(sock, P.HEADER_SIZE, buf,
                                                         now + remaining))
        if n > 4096:
            raise StoreProtocolError(f"the store at {self._addr} sent a {n}-byte auth reply")
        payload = self._recv_exact(sock, n, buf, now + remaining)
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
        return buf

    def _recv_exact(self, sock: socket.socket, n: int, buf: bytearray,
                    deadline: Optional[float], probe: Any = None) -> bytearray:
        """Read until ``n`` bytes are available; return them and keep any surplus in ``buf``.

        ``deadline`` (monotonic; None: none) bounds the whole read, not just each ``recv``: a
        peer that trickles bytes cannot stretch a call past its timeout. The armed receive
        bound stays where :func:`_keeps` allows; a recv that times out on it early is retried.
        ``probe``: called after each :attr:`probe_after` seconds without data (it raises when
        the store does not answer a probe either).
        """
        def recv(fn, arg):
            while True:
                need = None
                if deadline is not None:
                    need = deadline - time.monotonic()
                    if need <= 0:
                        raise socket.timeout("timed out")
                if probe is not None and (need is None or need > self.probe_after):
                    need = self.probe_after
                if not _keeps(self._sock_timeout, need):
                    self._arm(sock, need)
                try:
                    return fn(arg)
                except _TIMED_OUT:
                    self._sock_timeout = -1.0   # a long wait: re-arm for all that is left
                    if probe is not None and (deadline is None or deadline > time.monotonic()):
                        probe()

        if len(buf) < n and n - len(buf) > _SMALL:  # large value: read straight into place
            out = bytearray(n)
            have = len(buf)
            out[:have] = buf
            buf.clear()
            view = memoryview(out)
            while have < n:
                got = recv(sock.recv_into, view[have:])
                if not got:
                    raise ConnectionResetError("the store closed the connection")
                have += got
            return out
        while len(buf) < n:
            chunk = recv(sock.recv, _SMALL)
            if not chunk:
                raise ConnectionResetError("the store closed the connection")
            buf += chunk
        out = buf[:n]
        del buf[:n]
        return out

    def _drop(self) -> None:
        self._owed = 0
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._rbuf = bytearray()

    # ------------------------------------------------------------------ requests
    def _call(self, op: int, head: bytes, tail: bytes, wait: Optional[float],
              keys: Union[bytes, List[bytes]], what: str,
              bound: Optional[float] = None) -> bytes:
        """Send one request (body ``head + tail``), return the OK body.

        ``wait``: how long the server may park it (GET, WAIT); the socket then allows some slack
        beyond that for the server's TIMEOUT reply to arrive.  ``bound``: this call's bound when
        not parked (default: the client's ``timeout``).
        """
        if self._closed:
            raise StoreConnectionError(f"{what}: this client of {self._addr} is closed")
        start = time.monotonic()
        if wait is None:
            sock_timeout = self.timeout if bound is None else bound
        else:
            sock_timeout = wait + min(max(1.0, 0.1 * wait), 30.0)
        if sock_timeout == _INF:
            sock_timeout = None
        size = len(head) + len(tail)
        lock = self._lock
        if not lock.acquire(False):   # another thread's call is in flight (maybe a long get)
            spare = self._spare()
            try:
                return spare._call(op, head, tail, wait, keys, what, bound)
            finally:
                self._unspare(spare)
        probe = None
        if sock_timeout is None or sock_timeout > self.probe_after + self.probe_timeout:
            probe = functools.partial(self._probe, what, keys, start)
        sent = False
        try:
            if self._sock is None:
                budget = self.connect_timeout if sock_timeout is None else min(
                    self.connect_timeout, sock_timeout)
                self._connect(budget, what, keys)
                if self._closed:   # closed while connecting: close() may not have seen it
                    self._drop()
                    raise StoreConnectionError(f"{what}: this client of {self._addr} is closed")
            sock = self._sock
            # a kept shorter bound (see _keeps): if the first recv times out on it, the slow
            # path goes on for the rest of this call's own bound
            first = sock_timeout if probe is None else self.probe_after
            if not _keeps(self._sock_timeout, first):
                self._arm(sock, first)
            short = self._sock_timeout != sock_timeout
            deadline = None if sock_timeout is None else start + sock_timeout
            try:
                if self._owed:          # replies of earlier calls that timed out: skip them
                    self._settle(sock, deadline)
                if size < _SMALL:
                    sock.sendall(_REQ(op, size) + head + tail)
                else:  # large value: no concatenated copy, and a send bound of its own
                    self._arm(sock, sock_timeout, send=True)
                    short = False
                    sock.sendall(_REQ(op, size) + head)
                    sock.sendall(tail)
                sent = True
                buf = self._rbuf
                if not buf:  # fast path: the whole reply in one recv
                    try:
                        data: Optional[bytes] = sock.recv(_SMALL)
                    except _TIMED_OUT:
                        if not short:
                            raise
                        self._sock_timeout = -1.0   # on to the slow path, re-armed for the rest
                        data = None
                        if probe is not None:
                            probe()
                    if data is not None:
                        if len(data) >= 5:
                            status, n = _REP_FROM(data, 0)
                            if len(data) == 5 + n:
                                if status == Status.OK:
                                    return data[5:]
                        elif not data:
                            raise ConnectionResetError("the store closed the connection")
                        buf += data
                status, n = _REP_FROM(self._recv_exact(sock, P.HEADER_SIZE, buf, deadline,
                                                       probe), 0)
                limit = max(self.max_value_size, 1 << 16) + 16
                if n > limit:
                    raise StoreProtocolError(f"{what}: the store at {self._addr} announced a "
                                             f"{n}-byte reply (limit {limit})")
                payload = bytes(self._recv_exact(sock, n, buf, deadline, probe))
            except _TIMED_OUT as e:
                if sent and size < _SMALL and self._owed < MAX_OWED:
                    self._owed += 1     # keep the connection: the next call skips the reply
                else:
                    self._drop()
                raise StoreTimeout(f"{what}: no reply from the store at {self._addr} after "
                                   f"{time.monotonic() - start:.2f} s (timeout "
                                   f"{sock_timeout:.2f} s) for key(s) {_show(keys)}") from e
            except (StoreProtocolError, StoreConnectionError):   # the probe's verdict, too
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
        finally:
            lock.release()
            if probe is not None and self._prober is not None:
                self._end_probe()
        self._raise(status, payload, what, keys, wait, start)

    def _raise(self, status: int, payload: bytes, what: str, keys, wait: Optional[float],
               start: float) -> None:
        """Turn a non-OK reply into the named error."""
        msg = payload.decode("utf-8", "replace")
        if status == Status.TIMEOUT:
            try:
                missing = P.unpack_keys(payload, 0, 1 << 30) or keys
            except ValueError:
                missing = keys
            raise StoreTimeout(f"{what}: timed out after {time.monotonic() - start:.2f} s "
                               f"(timeout {wait or 0:.2f} s) waiting for key(s) "
                               f"{_show(missing)} on the store at {self._addr}")
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
