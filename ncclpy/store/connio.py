"""The server's per-connection I/O (a mixin of :class:`~ncclpy.store.server.StoreServer`).

Non-blocking reads and writes, framing, back-pressure and the accounting behind the server's
buffered-bytes cap. Replies to pipelined requests are *corked*: held back while a batch of
frames is handled and sent as one buffer, so a client that pipelines (the barrier does) costs
one ``send`` per batch instead of one per request.
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Dict

from . import protocol as P
from .ops import Conn, StoreOps
from .poller import READ as _READ, WRITE as _WRITE
from .protocol import Op

__all__ = ["ConnIO", "PAUSE_INPUT", "PAUSE_OUTPUT", "NONBLOCKING_FLAGS", "SEND_FLAGS",
           "RECV_FLAGS"]

# Where the OS has MSG_DONTWAIT every send/recv is made non-blocking by its flags, so accepted
# sockets need no setblocking() call (an ioctl that also hands the GIL away: costly with hundreds
# of rank threads in the process); MSG_NOSIGNAL: a vanished peer is an error, never SIGPIPE
NONBLOCKING_FLAGS = getattr(socket, "MSG_DONTWAIT", 0)
SEND_FLAGS = NONBLOCKING_FLAGS | getattr(socket, "MSG_NOSIGNAL", 0)
RECV_FLAGS = NONBLOCKING_FLAGS

_RECV_CHUNK = 1 << 16       # not larger: big recv buffers cost an mmap per call
PAUSE_INPUT = 1 << 20       # stop reading a parked client whose pending input exceeds this
PAUSE_OUTPUT = 1 << 20      # ... or any client whose unsent replies exceed this
_CORK_MAX = 1 << 16         # held-back replies are sent once they reach this many bytes


class ConnIO(StoreOps):
    """Reading, framing and writing for the loop; the loop supplies the attributes below."""

    _conns: Dict[int, Conn]
    _inbytes: int
    _outbytes: int
    _buffer_cap: int
    _limits: Dict[int, int]

    # provided by the loop
    def _shed(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _arm_frame_timer(self, conn: Conn) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

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
        self._inbytes -= len(conn.rbuf)
        self._outbytes -= conn.wowned
        conn.rbuf = bytearray()
        conn.wq.clear()
        conn.wbytes = conn.wowned = 0
        conn.cork = None

    def _update_events(self, conn: Conn) -> None:
        if conn.closed:
            return
        ev = _WRITE if conn.wbytes else 0
        if not conn.closing and conn.wbytes < PAUSE_OUTPUT and not (
                conn.waiter is not None and len(conn.rbuf) > PAUSE_INPUT):
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

    def _send(self, conn: Conn, data, shared: bool = False) -> None:
        """Send ``data`` or queue what the socket does not take now. ``shared``: ``data`` is a
        stored value (not a copy), so queueing it costs no memory of its own."""
        if conn.closed:
            return
        if conn.cork is not None:
            conn.cork.append((data, shared))
            conn.cork_bytes += len(data)
            if conn.cork_bytes >= _CORK_MAX:
                self._uncork(conn, keep=True)
            return
        if not conn.wq:
            try:
                n = conn.sock.send(data, SEND_FLAGS)
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
        else:
            data = memoryview(data)
        conn.wq.append((data, not shared))
        conn.wbytes += len(data)
        if not shared:
            conn.wowned += len(data)
            self._outbytes += len(data)
        self._update_events(conn)

    def _uncork(self, conn: Conn, keep: bool = False) -> None:
        """Send the replies held back while corked, small ones joined into one buffer."""
        items = conn.cork
        conn.cork = None
        conn.cork_bytes = 0
        if not items or conn.closed:
            return
        if len(items) == 1:
            self._send(conn, *items[0])
        elif sum(len(d) for d, _ in items) <= _CORK_MAX:
            self._send(conn, b"".join(d for d, _ in items))
        else:
            for d, shared in items:
                self._send(conn, d, shared)
        if keep and not conn.closed:
            conn.cork = []

    def _flush(self, conn: Conn) -> None:
        wq = conn.wq
        while wq:
            buf, owned = wq[0]
            try:
                n = conn.sock.send(buf, SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close_conn(conn)
                return
            conn.wbytes -= n
            if owned:
                conn.wowned -= n
                self._outbytes -= n
            if n == len(buf):
                wq.pop(0)
            else:
                wq[0] = (buf[n:], owned)
                break
        if not wq and conn.closing:
            self._close_conn(conn)
            return
        self._update_events(conn)
        if not conn.wbytes and conn.rbuf and conn.waiter is None:
            self._process(conn)

    def _read(self, conn: Conn) -> None:
        try:
            chunk = conn.sock.recv(_RECV_CHUNK, RECV_FLAGS)
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
            conn.rx_at = time.monotonic()
            self._inbytes += len(chunk)
            if len(conn.rbuf) > PAUSE_INPUT:
                self._update_events(conn)
            if self._inbytes + self._outbytes > self._buffer_cap:
                self._shed()
            return
        if not conn.rbuf and conn.authed and not conn.closing and len(chunk) >= 5:
            # fast path: exactly one whole, well-sized request and nothing buffered
            op, n = P.REQ_HEADER.unpack_from(chunk, 0)
            if len(chunk) == 5 + n and 0 <= n <= self._limits.get(op, -1):
                self.served += 1
                try:
                    self._handlers[op](conn, chunk[5:])
                except (ValueError, IndexError, OverflowError, struct.error) as e:
                    self._protocol_error(conn, f"malformed {P.OP_NAMES[op]} body: {e}")
                return
        conn.rbuf += chunk
        conn.rx_at = time.monotonic()
        self._inbytes += len(chunk)
        self._process(conn)
        if self._inbytes + self._outbytes > self._buffer_cap:
            self._shed()

    def _process(self, conn: Conn) -> None:
        """Handle every complete frame in the input buffer, in order."""
        buf = conn.rbuf
        pos = 0
        end = len(buf)
        hs = P.HEADER_SIZE
        if conn.cork is None:
            conn.cork = []   # pipelined requests: their replies leave in one send
            conn.cork_bytes = 0
        try:
            while (not conn.closed and not conn.closing and conn.waiter is None
                   and conn.wbytes < PAUSE_OUTPUT and end - pos >= hs):
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
                self.served += 1
                try:
                    self._handlers[op](conn, body)
                except (ValueError, IndexError, OverflowError, struct.error) as e:
                    self._protocol_error(conn, f"malformed {P.OP_NAMES[op]} body: {e}")
                    return
        finally:
            if not conn.closed and pos:
                del buf[:pos]
                self._inbytes -= pos
            self._uncork(conn)
        if not conn.closed:
            self._update_events(conn)
            if buf:
                self._arm_frame_timer(conn)
