"""The store server: one daemon thread, one event loop (epoll, or ``selectors`` elsewhere).

Why one thread: a rendezvous of hundreds of ranks is hundreds of mostly idle connections; one
non-blocking loop serves them all without a thread each, and waiting requests (``get`` of a
missing key, ``wait``) are parked per key instead of blocking anything. Every announced length is
checked against its limit before a byte of the body is buffered; input buffered over all
connections is capped (the biggest holders are closed past it), and a connection whose
half-received request stalls is closed after ``frame_timeout``. Limits: :mod:`.limits`.

The loop never dies from a request: an error while serving one connection is logged and that
connection closed; running out of file descriptors pauses accepting for a moment instead of
spinning.
"""
from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Dict, Optional, Tuple, Union

from ..errors import ArgumentError, StoreConnectionError
from . import protocol as P
from .limits import StoreLimits
from .loglimit import LogLimiter
from .connio import NONBLOCKING_FLAGS, PAUSE_OUTPUT, ConnIO
from .ops import Conn
from .keepalive import set_keepalive
from .tables import Tables
from .poller import ERRS as _ERRS, READ as _READ, WRITE as _WRITE, Poller, raise_nofile_limit

__all__ = ["StoreServer", "resolve_token", "TOKEN_ENV"]

log = logging.getLogger(__name__)

TOKEN_ENV = "NCCLPY_STORE_TOKEN"
_ACCEPT_BACKOFF = 0.1       # seconds the listener rests after accept() ran out of descriptors
_MAX_LOOP_ERRORS = 100      # consecutive loop-level failures before the server gives up
# timer kinds (the heap holds (deadline, seq, kind, obj))
_T_WAITER, _T_AUTH, _T_FRAME, _T_ACCEPT, _T_LOG = range(5)


def resolve_token(token) -> Optional[bytes]:
    """``token`` argument, else ``$NCCLPY_STORE_TOKEN``; "" or unset means no token."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None or token == "" or token == b"":
        return None
    if isinstance(token, str):
        return token.encode("utf-8")
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    raise ArgumentError(f"token: expected str or bytes, got {type(token).__name__}")


class StoreServer(ConnIO, Tables):
    """Key-value store server running as a daemon thread (never keeps a program alive).

    ``port=0`` picks a free port (see :attr:`port` after :meth:`start`). ``token`` (or
    ``$NCCLPY_STORE_TOKEN``) makes every client prove it holds the same token before any
    operation. Binds 127.0.0.1 unless told otherwise; pass the node's address (or "0.0.0.0") for
    multi-node runs. Limits (:class:`~ncclpy.store.limits.StoreLimits`): ``limits`` and/or the
    keyword arguments named after its fields, else ``$NCCLPY_STORE_<FIELD>``, else the defaults;
    e.g. ``max_clients`` caps concurrent connections (extra ones are closed).

    Warnings about bad clients are rate-limited (:mod:`.loglimit`): the first
    :attr:`log_burst` of each kind per client host in each :attr:`log_interval` seconds are
    logged, the rest summed up in one line per interval.
    """

    #: warnings of one kind per client host logged in full per :attr:`log_interval`
    log_burst = 5
    #: seconds over which bad-client warnings are rate-limited (one summary line per interval)
    log_interval = 10.0

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token=None,
                 limits: Union[StoreLimits, dict, None] = None,
                 max_key_size: Optional[int] = None, max_value_size: Optional[int] = None,
                 max_clients: Optional[int] = None, max_keys_per_request: Optional[int] = None,
                 max_buffered_bytes: Optional[int] = None, frame_timeout: Optional[float] = None,
                 auth_timeout: Optional[float] = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ArgumentError(f"port: expected an int in 0..65535, got {port!r}")
        if not isinstance(host, str):
            raise ArgumentError(f"host: expected str, got {type(host).__name__}")
        self.limits = StoreLimits.resolve(
            limits, max_key_size=max_key_size, max_value_size=max_value_size,
            max_clients=max_clients, max_keys_per_request=max_keys_per_request,
            max_buffered_bytes=max_buffered_bytes, frame_timeout=frame_timeout,
            auth_timeout=auth_timeout)
        lim = self.limits
        self._host = host
        self._port = port
        self._token = resolve_token(token)
        self.max_key_size = lim.max_key_size
        self.max_value_size = lim.max_value_size
        self.max_clients = lim.max_clients
        self.max_keys_per_request = lim.max_keys_per_request
        self._limits = {op: P.body_limit(op, lim.max_key_size, lim.max_value_size)
                        for op in P.OP_NAMES}
        # one request of the largest size (and the next read) always fits, whatever
        # max_buffered_bytes says
        self._buffer_cap = max(lim.max_buffered_bytes, max(self._limits.values()) + (1 << 17))
        self._inbytes = 0           # bytes in every connection's input buffer
        self._outbytes = 0          # copied (not shared) bytes in every output queue
        self._init_ops()
        self._init_tables()
        #: requests handled since the start (a figure for benchmarks and status lines)
        self.served = 0
        self._handlers[P.Op.BEAT] = self._op_beat
        self._handlers[P.Op.VOTE] = self._op_vote
        self._logs = LogLimiter(log, self.log_burst, self.log_interval,
                                schedule=lambda t: self._push_timer(t, None, _T_LOG))
        self._seq = itertools.count()
        self._compact_at = 4096
        self._conns: Dict[int, Conn] = {}
        self._poller: Optional[Poller] = None
        self._lsock: Optional[socket.socket] = None
        self._listening = False
        self._fd_warned = False
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        flags = P.FLAG_ARRIVE | P.FLAG_TABLES | (P.FLAG_AUTH if self._token is not None else 0)
        self._hello_head = P.pack_hello(flags, lim.max_key_size, lim.max_value_size, b"",
                                        lim.max_keys_per_request)
        self._hello_plain = self._hello_head + bytes(P.NONCE_SIZE)

    # ------------------------------------------------------------------ public
    @property
    def host(self) -> str:
        """The address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port it listens on (the real one when 0 was asked)."""
        return self._port

    @property
    def address(self) -> Tuple[str, int]:
        """What clients connect to, as ``(host, port)``."""
        return (self._host, self._port)

    @property
    def running(self) -> bool:
        """True while the serving thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_clients(self) -> int:
        """Connections currently open."""
        return len(self._conns)

    @property
    def num_keys(self) -> int:
        """Keys stored now."""
        return len(self._data)

    @property
    def buffered_bytes(self) -> int:
        """Bytes the server holds for its connections (unparsed input, copied output)."""
        return self._inbytes + self._outbytes

    def start(self) -> "StoreServer":
        """Bind, listen and start serving in a daemon thread; returns self."""
        if self._thread is not None:
            return self
        raise_nofile_limit()
        try:
            family = socket.getaddrinfo(self._host or None, self._port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
            lsock = socket.create_server((self._host, self._port), family=family,
                                         backlog=min(max(self.max_clients, 128), 65535))
        except OSError as e:
            raise StoreConnectionError(
                f"store server could not listen on {self._host}:{self._port}: {e}") from e
        lsock.setblocking(False)
        self._lsock = lsock
        self._port = lsock.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = Poller()
        self._poller.register(lsock.fileno(), _READ)
        self._listening = True
        self._poller.register(self._wake_r.fileno(), _READ)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"ncclpy-store-{self._port}")
        self._thread.start()
        log.debug("store server listening on %s:%d (token %s, %s)", self._host, self._port,
                  "required" if self._token else "off", self.limits)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection (clients then see a closed connection)."""
        if self._thread is None or self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> "StoreServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StoreServer({self._host}:{self._port}, running={self.running}, "
                f"token={'yes' if self._token else 'no'})")

    # ------------------------------------------------------------------ loop
    def _serve(self) -> None:
        failures = 0
        try:
            while not self._stop:
                try:
                    self._serve_once()
                    failures = 0
                except Exception:  # not tied to one connection: log, breathe, go on
                    failures += 1
                    log.exception("store server on port %d: error in the event loop (%d in a "
                                  "row)", self._port, failures)
                    if failures >= _MAX_LOOP_ERRORS:
                        log.critical("store server on port %d: giving up after %d consecutive "
                                     "event-loop errors", self._port, failures)
                        return
                    time.sleep(0.01)
        finally:
            self._shutdown()

    def _serve_once(self) -> None:
        """One poll and everything it made ready."""
        conns = self._conns
        lfd = self._lsock.fileno()
        wfd = self._wake_r.fileno()
        asked = self._table_poll(self._next_timeout() if self._timers else None)
        try:
            events = self._poller.poll(asked)
        except InterruptedError:  # pragma: no cover
            return
        self._tick_clock(asked)
        for fd, ev in events:
            conn = conns.get(fd)
            try:
                if conn is None:
                    if fd == lfd:
                        self._accept()
                    elif fd == wfd:
                        self._drain_wake()
                    continue
                if ev & _WRITE:
                    self._flush(conn)
                if ev & (_READ | _ERRS) and not conn.closed:
                    self._read(conn)
            except Exception:  # never let one connection take the server down
                self._conn_failed(conn)
        if self._timers:
            self._expire_timers()
        while self._ready:
            ready, self._ready = self._ready, []
            for conn in ready:
                try:
                    if not conn.closed and conn.waiter is None:
                        self._process(conn)
                    else:
                        self._uncork(conn)
                except Exception:
                    self._conn_failed(conn)
        if self._inbytes + self._outbytes > self._buffer_cap:
            self._shed()

    def _conn_failed(self, conn: Optional[Conn]) -> None:
        peer = conn.peer if conn is not None else "the listener"
        self._logs.warn(log, "handler error", peer, "store server: error serving %s; closing "
                        "that connection", peer, exc_info=True, level=logging.ERROR)
        if conn is not None:
            self._close_conn(conn)

    def _shutdown(self) -> None:
        self._logs.flush()
        for conn in list(self._conns.values()):
            self._close_conn(conn)
        for s in (self._lsock, self._wake_r, self._wake_w, self._poller):
            try:
                s.close()
            except Exception:
                pass
        self._waiters.clear()
        self._gates.clear()
        self._timers.clear()
        self._data.clear()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    # ------------------------------------------------------------------ timers
    def _push_timer(self, deadline: float, obj: object, kind: int = _T_WAITER) -> None:
        timers = self._timers
        if len(timers) >= self._compact_at:  # drop finished entries (amortised O(1))
            timers[:] = [t for t in timers if not self._stale(t[2], t[3])]
            heapq.heapify(timers)
            self._compact_at = max(4096, 2 * len(timers))
        heapq.heappush(timers, (deadline, next(self._seq), kind, obj))

    @staticmethod
    def _stale(kind: int, obj) -> bool:
        if kind == _T_WAITER:
            return obj.done
        if kind == _T_AUTH:
            return obj.closed or obj.authed
        if kind == _T_FRAME:
            return obj.closed
        return False

    def _next_timeout(self) -> Optional[float]:
        timers = self._timers
        while timers and self._stale(timers[0][2], timers[0][3]):
            heapq.heappop(timers)
        if not timers:
            return None
        return max(0.0, timers[0][0] - time.monotonic())  # the poller clamps far deadlines

    def _expire_timers(self) -> None:
        timers = self._timers
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, kind, obj = heapq.heappop(timers)
            if self._stale(kind, obj):
                continue
            try:
                if kind == _T_WAITER:
                    self._finish_waiter(obj, timed_out=True)
                elif kind == _T_AUTH:
                    self._logs.warn(log, "auth timeout", obj.peer, "store server: closing "
                                    "client %s: it did not authenticate within %.0f s",
                                    obj.peer, self.limits.auth_timeout)
                    self._close_conn(obj)
                elif kind == _T_FRAME:
                    self._check_frame(obj, now)
                elif kind == _T_LOG:
                    self._logs.flush_due()
                else:
                    self._listen(True)
            except Exception:
                self._conn_failed(obj.conn if kind == _T_WAITER else
                                  obj if isinstance(obj, Conn) else None)

    # ------------------------------------------------------------------ stalled input
    def _mid_frame(self, conn: Conn) -> bool:
        """True if ``conn`` holds the start of a request that the loop is waiting to complete."""
        return (bool(conn.rbuf) and conn.waiter is None and not conn.closing
                and not conn.closed and conn.wbytes < PAUSE_OUTPUT)

    def _arm_frame_timer(self, conn: Conn) -> None:
        if not conn.frame_timer and self._mid_frame(conn):
            conn.frame_timer = True
            self._push_timer(conn.rx_at + self.limits.frame_timeout, conn, _T_FRAME)

    def _check_frame(self, conn: Conn, now: float) -> None:
        conn.frame_timer = False
        if not self._mid_frame(conn):
            return
        stalled = now - conn.rx_at
        if stalled >= self.limits.frame_timeout:
            self._logs.warn(log, "stalled frame", conn.peer, "store server: closing client %s: "
                            "its request stalled mid-frame for %.1f s (%d bytes buffered; "
                            "frame_timeout=%g s)", conn.peer, stalled, len(conn.rbuf),
                            self.limits.frame_timeout)
            self._close_conn(conn)
        else:
            self._arm_frame_timer(conn)

    def _shed(self) -> None:
        """Over the buffered-bytes cap: close the biggest holders until back under it."""
        cap = self._buffer_cap
        hogs = sorted(self._conns.values(), key=lambda c: len(c.rbuf) + c.wowned, reverse=True)
        for conn in hogs:
            if self._inbytes + self._outbytes <= cap:
                break
            held = len(conn.rbuf) + conn.wowned
            if not held:
                break
            self._logs.warn(log, "buffer cap", conn.peer, "store server: closing client %s: it "
                            "holds %d of the %d bytes buffered for all clients, over the cap "
                            "max_buffered_bytes=%d", conn.peer, held,
                            self._inbytes + self._outbytes, cap)
            self._close_conn(conn)

    def _refuse(self, sock) -> None:
        """Tell a client over the limit why (a greeting flagged FLAG_REFUSED, then the reason),
        then close: it fails with that reason instead of a bare closed connection."""
        msg = (f"the store is full: max_clients={self.max_clients} connections are open; raise "
               f"NCCLPY_STORE_MAX_CLIENTS (or StoreLimits.max_clients) on the process that "
               f"hosts the store, or use fewer connections per rank").encode()
        frame = (P.pack_hello(P.FLAG_REFUSED, self.max_key_size, self.max_value_size,
                              bytes(P.NONCE_SIZE)) + P.REP_HEADER.pack(P.Status.ERR_REQUEST,
                                                                       len(msg)) + msg)
        try:
            sock.setblocking(False)
            sock.send(frame)
        except OSError:
            pass
        sock.close()

    # ------------------------------------------------------------------ connections
    def _listen(self, on: bool) -> None:
        if on != self._listening and not self._stop:
            if on:
                self._poller.register(self._lsock.fileno(), _READ)
            else:
                self._poller.unregister(self._lsock.fileno())
            self._listening = on

    def _accept(self) -> None:
        for _ in range(1024):
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that one peer's problem
                # out of descriptors (EMFILE...): the listener stays readable, so rest it a
                # moment instead of spinning; the backlog keeps the waiting clients
                if not self._fd_warned:
                    self._fd_warned = True
                    log.warning("store server on port %d: accept failed (%s) with %d clients "
                                "connected; pausing new connections for %.0f ms at a time "
                                "(raise the open-files limit, ulimit -n, for more clients)",
                                self._port, e, len(self._conns), _ACCEPT_BACKOFF * 1000)
                else:
                    log.debug("store server: accept failed again: %s", e)
                self._listen(False)
                self._push_timer(time.monotonic() + _ACCEPT_BACKOFF, None, _T_ACCEPT)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self._conns) >= self.max_clients:
                self._logs.warn(log, "max_clients", peer, "store server: refusing client %s: "
                                "max_clients=%d reached", peer, self.max_clients)
                self._refuse(sock)
                continue
            if not NONBLOCKING_FLAGS:
                sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            set_keepalive(sock)     # a client host that froze is dropped in seconds
            if self._token is None:
                conn = Conn(sock, peer, authed=True, nonce=b"")
                self._conns[conn.fd] = conn
                self._send(conn, self._hello_plain)
            else:
                nonce = os.urandom(P.NONCE_SIZE)
                conn = Conn(sock, peer, authed=False, nonce=nonce)
                self._conns[conn.fd] = conn
                self._push_timer(time.monotonic() + self.limits.auth_timeout, conn, _T_AUTH)
                self._send(conn, self._hello_head + nonce)
