"""The store server: one daemon thread, one event loop (epoll, or ``selectors`` elsewhere).

Why one thread: a rendezvous of hundreds of ranks is hundreds of mostly idle connections; one
non-blocking loop serves them all without a thread each, and waiting requests (``get`` of a
missing key, ``wait``) are parked per key instead of blocking anything. A slow or half-sent
client only ever holds its own small buffer, and every announced length is checked against its
limit before a byte of the body is buffered.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import selectors
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..errors import ArgumentError, StoreConnectionError
from . import protocol as P
from .ops import Conn, StoreOps, Waiter
from .protocol import Op

__all__ = ["StoreServer", "resolve_token", "TOKEN_ENV"]

log = logging.getLogger(__name__)

TOKEN_ENV = "NCCLPY_STORE_TOKEN"
_RECV_CHUNK = 1 << 16       # not larger: big recv buffers cost an mmap per call
_PAUSE_INPUT = 1 << 20      # stop reading a parked client whose pending input exceeds this
_PAUSE_OUTPUT = 8 << 20     # ... or any client whose unsent replies exceed this
_AUTH_TIMEOUT = 60.0        # a client must authenticate within this many seconds
_READ, _WRITE = 1, 4        # epoll's EPOLLIN / EPOLLOUT (translated for selectors)
_ERRS = 8 | 16              # EPOLLERR | EPOLLHUP: let recv() report them


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


class _Poller:
    """epoll where there is one (Linux), else ``selectors``; events as epoll's bits."""

    def __init__(self) -> None:
        self._ep = select.epoll() if hasattr(select, "epoll") else None
        self._sel = None if self._ep is not None else selectors.DefaultSelector()

    def register(self, fd: int, ev: int) -> None:
        if self._ep is not None:
            self._ep.register(fd, ev)
        else:
            self._sel.register(fd, self._to_sel(ev))

    def modify(self, fd: int, ev: int) -> None:
        if self._ep is not None:
            self._ep.modify(fd, ev)
        else:
            self._sel.modify(fd, self._to_sel(ev))

    def unregister(self, fd: int) -> None:
        if self._ep is not None:
            self._ep.unregister(fd)
        else:
            self._sel.unregister(fd)

    def poll(self, timeout: Optional[float]) -> List[Tuple[int, int]]:
        if self._ep is not None:
            return self._ep.poll(-1 if timeout is None else timeout)
        return [(k.fd, (_READ if m & selectors.EVENT_READ else 0)
                 | (_WRITE if m & selectors.EVENT_WRITE else 0))
                for k, m in self._sel.select(timeout)]

    @staticmethod
    def _to_sel(ev: int) -> int:
        return ((selectors.EVENT_READ if ev & _READ else 0)
                | (selectors.EVENT_WRITE if ev & _WRITE else 0))

    def close(self) -> None:
        (self._ep or self._sel).close()


class StoreServer(StoreOps):
    """Key-value store server running as a daemon thread (never keeps a program alive).

    ``port=0`` picks a free port (see :attr:`port` after :meth:`start`). ``token`` (or
    ``$NCCLPY_STORE_TOKEN``) makes every client prove it holds the same token before any
    operation. Binds 127.0.0.1 unless told otherwise; pass the node's address (or "0.0.0.0") for
    multi-node runs. ``max_clients`` caps concurrent connections (extra ones are closed).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token=None,
                 max_key_size: int = 4096, max_value_size: int = 64 << 20,
                 max_clients: int = 4096) -> None:
        for name, v in (("port", port), ("max_key_size", max_key_size),
                        ("max_value_size", max_value_size), ("max_clients", max_clients)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ArgumentError(f"{name}: expected a non-negative int, got {v!r}")
        if port > 65535:
            raise ArgumentError(f"port: expected 0..65535, got {port}")
        if max_key_size > 1 << 30 or max_value_size > 1 << 30:
            raise ArgumentError(f"max_key_size/max_value_size: at most 1 GiB each (got "
                                f"{max_key_size}, {max_value_size})")
        if max_clients < 1:
            raise ArgumentError(f"max_clients: expected >= 1, got {max_clients}")
        if not isinstance(host, str):
            raise ArgumentError(f"host: expected str, got {type(host).__name__}")
        self._host = host
        self._port = port
        self._token = resolve_token(token)
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self.max_clients = max_clients
        self._limits = {op: P.body_limit(op, max_key_size, max_value_size)
                        for op in P.OP_NAMES}
        self._init_ops()
        self._seq = itertools.count()
        self._compact_at = 4096
        self._conns: Dict[int, Conn] = {}
        self._poller: Optional[_Poller] = None
        self._lsock: Optional[socket.socket] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False

    # ------------------------------------------------------------------ public
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> Tuple[str, int]:
        return (self._host, self._port)

    @property
    def running(self) -> bool:
        """True while the serving thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_clients(self) -> int:
        """Connections currently open."""
        return len(self._conns)

    def start(self) -> "StoreServer":
        """Bind, listen and start serving in a daemon thread; returns self."""
        if self._thread is not None:
            return self
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
        self._poller = _Poller()
        self._poller.register(lsock.fileno(), _READ)
        self._poller.register(self._wake_r.fileno(), _READ)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"ncclpy-store-{self._port}")
        self._thread.start()
        log.debug("store server listening on %s:%d (token %s)", self._host, self._port,
                  "required" if self._token else "off")
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
        poll = self._poller.poll
        conns = self._conns
        lfd = self._lsock.fileno()
        wfd = self._wake_r.fileno()
        try:
            while not self._stop:
                try:
                    events = poll(self._next_timeout() if self._timers else None)
                except InterruptedError:  # pragma: no cover
                    continue
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
                        log.exception("store server: error on connection %s",
                                      getattr(conn, "peer", "?"))
                        if conn is not None:
                            self._close_conn(conn)
                if self._timers:
                    self._expire_timers()
                while self._ready:
                    ready, self._ready = self._ready, []
                    for conn in ready:
                        if not conn.closed and conn.waiter is None:
                            try:
                                self._process(conn)
                            except Exception:
                                log.exception("store server: error on connection %s", conn.peer)
                                self._close_conn(conn)
        except Exception:  # pragma: no cover - last resort, keep a record
            log.exception("store server loop on port %d crashed", self._port)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._close_conn(conn)
        for s in (self._lsock, self._wake_r, self._wake_w, self._poller):
            try:
                s.close()
            except Exception:
                pass
        self._waiters.clear()
        self._timers.clear()
        self._data.clear()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _push_timer(self, deadline: float, obj: object) -> None:
        timers = self._timers
        if len(timers) >= self._compact_at:  # drop finished entries (amortised O(1))
            timers[:] = [t for t in timers if not self._stale(t[2])]
            heapq.heapify(timers)
            self._compact_at = max(4096, 2 * len(timers))
        heapq.heappush(timers, (deadline, next(self._seq), obj))

    @staticmethod
    def _stale(obj: object) -> bool:
        if isinstance(obj, Waiter):
            return obj.done
        return obj.closed or obj.authed

    def _next_timeout(self) -> Optional[float]:
        timers = self._timers
        while timers and self._stale(timers[0][2]):
            heapq.heappop(timers)
        if not timers:
            return None
        return max(0.0, timers[0][0] - time.monotonic())

    def _expire_timers(self) -> None:
        timers = self._timers
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, obj = heapq.heappop(timers)
            if self._stale(obj):
                continue
            if isinstance(obj, Waiter):
                self._finish_waiter(obj, timed_out=True)
            else:
                log.warning("store server: closing client %s: it did not authenticate within "
                            "%.0f s", obj.peer, _AUTH_TIMEOUT)
                self._close_conn(obj)

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        for _ in range(1024):
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. EMFILE: log and keep serving the others
                log.warning("store server: accept failed: %s", e)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self._conns) >= self.max_clients:
                log.warning("store server: refusing client %s: max_clients=%d reached", peer,
                            self.max_clients)
                sock.close()
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            nonce = os.urandom(P.NONCE_SIZE)
            conn = Conn(sock, peer, authed=self._token is None, nonce=nonce)
            self._conns[conn.fd] = conn
            if self._token is not None:
                self._push_timer(time.monotonic() + _AUTH_TIMEOUT, conn)
            flags = P.FLAG_AUTH if self._token is not None else 0
            self._send(conn, P.pack_hello(flags, self.max_key_size, self.max_value_size, nonce))

    def _close_conn(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.waiter is not None:
            self._cancel_waiter(conn.waiter)
        if conn.events:
            try:
                self._poller.unregister(conn.fd)
            except (KeyError, ValueError, OSError):
                pass
            conn.events = 0
        self._conns.pop(conn.fd, None)
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.rbuf = bytearray()
        conn.wq.clear()
        conn.wbytes = 0

    def _update_events(self, conn: Conn) -> None:
        if conn.closed:
            return
        ev = _WRITE if conn.wbytes else 0
        if not conn.closing and conn.wbytes < _PAUSE_OUTPUT and not (
                conn.waiter is not None and len(conn.rbuf) > _PAUSE_INPUT):
            ev |= _READ
        if ev == conn.events:
            return
        if conn.events == 0:
            self._poller.register(conn.fd, ev)
        elif ev == 0:
            self._poller.unregister(conn.fd)
        else:
            self._poller.modify(conn.fd, ev)
        conn.events = ev

    def _send(self, conn: Conn, data) -> None:
        if conn.closed:
            return
        if not conn.wq:
            try:
                n = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._close_conn(conn)
                return
            if n == len(data):
                if conn.closing:
                    self._close_conn(conn)
                elif conn.events != _READ:
                    self._update_events(conn)
                return
            data = memoryview(data)[n:]
        conn.wq.append(memoryview(data))
        conn.wbytes += len(data)
        self._update_events(conn)

    def _flush(self, conn: Conn) -> None:
        wq = conn.wq
        while wq:
            buf = wq[0]
            try:
                n = conn.sock.send(buf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close_conn(conn)
                return
            conn.wbytes -= n
            if n == len(buf):
                wq.pop(0)
            else:
                wq[0] = buf[n:]
                break
        if not wq and conn.closing:
            self._close_conn(conn)
            return
        self._update_events(conn)
        if not conn.wbytes and conn.rbuf and conn.waiter is None:
            self._process(conn)

    def _read(self, conn: Conn) -> None:
        try:
            chunk = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        if not chunk:
            self._close_conn(conn)
            return
        if conn.waiter is not None:
            conn.rbuf += chunk
            if len(conn.rbuf) > _PAUSE_INPUT:
                self._update_events(conn)
            return
        if not conn.rbuf and conn.authed and not conn.closing and len(chunk) >= 5:
            # fast path: exactly one whole, well-sized request and nothing buffered
            op, n = P.REQ_HEADER.unpack_from(chunk, 0)
            if len(chunk) == 5 + n and 0 <= n <= self._limits.get(op, -1):
                try:
                    self._handlers[op](conn, chunk[5:])
                except (ValueError, IndexError, OverflowError, struct.error) as e:
                    self._protocol_error(conn, f"malformed {P.OP_NAMES[op]} body: {e}")
                return
        conn.rbuf += chunk
        self._process(conn)

    def _process(self, conn: Conn) -> None:
        """Handle every complete frame in the input buffer, in order."""
        buf = conn.rbuf
        pos = 0
        end = len(buf)
        hs = P.HEADER_SIZE
        try:
            while (not conn.closed and not conn.closing and conn.waiter is None
                   and conn.wbytes < _PAUSE_OUTPUT and end - pos >= hs):
                op, n = P.REQ_HEADER.unpack_from(buf, pos)
                limit = self._limits.get(op, -1)
                if limit < 0:
                    self._protocol_error(conn, f"unknown opcode {op}")
                    return
                if not conn.authed and op != Op.AUTH:
                    self._unauthenticated(conn, op)
                    return
                if n > limit:
                    self._oversized(conn, op, n, limit)
                    return
                if end - pos - hs < n:
                    break
                body = bytes(buf[pos + hs:pos + hs + n])
                pos += hs + n
                try:
                    self._handlers[op](conn, body)
                except (ValueError, IndexError, OverflowError, struct.error) as e:
                    self._protocol_error(conn, f"malformed {P.OP_NAMES[op]} body: {e}")
                    return
        finally:
            if not conn.closed and pos:
                del buf[:pos]
        if not conn.closed:
            self._update_events(conn)
