"""The store's data and request handlers (a mixin of :class:`~ncclpy.store.server.StoreServer`).

Kept apart from the event loop so each stays readable: this part knows keys, values, parked
waiters and the operations' semantics; the loop knows sockets. Everything here runs on the
server's single thread, so no locking is needed.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from typing import Dict, List, Optional, Set, Tuple

from . import protocol as P
from .loglimit import LogLimiter
from .protocol import Op, Status

__all__ = ["StoreOps", "Conn", "Waiter"]

log = logging.getLogger(__name__)

_OK_EMPTY = P.REP_HEADER.pack(Status.OK, 0)
_OK_TRUE = P.REP_HEADER.pack(Status.OK, 1) + b"\x01"
_OK_FALSE = P.REP_HEADER.pack(Status.OK, 1) + b"\x00"
_REP = P.REP_HEADER.pack
_U32_FROM = P.U32.unpack_from
_U32X2_FROM = P.U32X2.unpack_from
_I64_FROM = P.I64.unpack_from
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1   # a counter's range, as in torch's store


class Conn:
    """One client connection's state."""

    __slots__ = ("sock", "fd", "peer", "rbuf", "wq", "wbytes", "wowned", "authed", "nonce",
                 "waiter", "closing", "closed", "events", "rx_at", "frame_timer", "cork",
                 "cork_bytes")

    def __init__(self, sock, peer: str, authed: bool, nonce: bytes) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.rbuf = bytearray()        # unprocessed input
        self.wq: list = []             # unsent output: (memoryview, owned), oldest first
        self.wbytes = 0                # bytes in wq
        self.wowned = 0                # ... of which copies (not views of stored values)
        self.rx_at = 0.0               # monotonic time input last arrived (slow path only)
        self.frame_timer = False       # a stalled-frame check is scheduled
        self.cork: Optional[list] = None  # replies held back to leave in one send
        self.cork_bytes = 0
        self.authed = authed
        self.nonce = nonce
        self.waiter: Optional[Waiter] = None
        self.closing = False           # close once the output queue drains
        self.closed = False
        self.events = 0


class Waiter:
    """A parked GET or WAIT (replies when all its keys exist) or ARRIVE (replies when its
    counter reaches ``target``, with ``reply``), or its deadline passes."""

    __slots__ = ("conn", "op", "keys", "pending", "done", "target", "reply")

    def __init__(self, conn: Conn, op: int, keys: List[bytes], pending: Set[bytes]) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.pending = pending
        self.done = False
        self.target = 0
        self.reply = b""


class StoreOps:
    """Key-value state and one handler per opcode; replies through the loop's ``_send``."""

    max_key_size: int
    max_value_size: int
    max_keys_per_request: int
    _token: Optional[bytes]
    _logs: LogLimiter   # rate-limited warnings about bad clients (made by the server)

    def _init_ops(self) -> None:
        self._data: Dict[bytes, bytes] = {}
        self._waiters: Dict[bytes, Set[Waiter]] = {}
        # parked ARRIVEs: counter key -> the count that releases them -> waiters
        self._gates: Dict[bytes, Dict[int, Set[Waiter]]] = {}
        self._timers: List[Tuple[float, int, object]] = []
        self._ready: List[Conn] = []      # connections to resume once their waiter finished
        self._handlers = {
            Op.AUTH: self._op_auth, Op.SET: self._op_set, Op.GET: self._op_get,
            Op.ADD: self._op_add, Op.CAS: self._op_cas, Op.DELETE: self._op_delete,
            Op.WAIT: self._op_wait, Op.NUM_KEYS: self._op_num_keys, Op.CHECK: self._op_check,
            Op.PING: self._op_ping, Op.ARRIVE: self._op_arrive,
        }

    # provided by the loop
    def _send(self, conn: Conn, data, shared: bool = False) -> None:  # pragma: no cover
        raise NotImplementedError

    def _update_events(self, conn: Conn) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _push_timer(self, deadline: float, obj: object) -> None:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------ replies
    def _reply(self, conn: Conn, status: int, body: bytes = b"", close: bool = False,
               shared: bool = False) -> None:
        """``shared``: ``body`` is a stored value, so a large one is queued without a copy."""
        if close:
            conn.closing = True
        if len(body) < 65536:
            self._send(conn, _REP(status, len(body)) + body)
        else:  # large value: header and body queued back to back, no copy
            self._send(conn, _REP(status, len(body)))
            self._send(conn, body, shared)

    def _error(self, conn: Conn, status: int, msg: str) -> None:
        self._reply(conn, status, msg.encode("utf-8", "replace"),
                    close=status in (Status.ERR_AUTH, Status.ERR_PROTOCOL))

    def _protocol_error(self, conn: Conn, msg: str) -> None:
        self._logs.warn(log, "protocol error", conn.peer, "store server: protocol error from "
                        "%s: %s; closing the connection", conn.peer, msg)
        self._error(conn, Status.ERR_PROTOCOL, msg)

    def _oversized(self, conn: Conn, op: int, n: int, limit: int) -> None:
        self._logs.warn(log, "oversized request", conn.peer, "store server: %s request from "
                        "%s announces %d bytes, limit %d; closing", P.OP_NAMES[op], conn.peer,
                        n, limit)
        self._error(conn, Status.ERR_PROTOCOL,
                    f"{P.OP_NAMES[op]} request of {n} bytes exceeds the limit of {limit} bytes "
                    f"(max_key_size={self.max_key_size}, max_value_size={self.max_value_size})")

    def _unauthenticated(self, conn: Conn, op: int) -> None:
        self._logs.warn(log, "unauthenticated request", conn.peer, "store server: client %s "
                        "sent %s before authenticating (missing token?); closing it", conn.peer,
                        P.OP_NAMES[op])
        self._error(conn, Status.ERR_AUTH, "this store requires a token: authenticate first "
                    "(set token= or $NCCLPY_STORE_TOKEN)")

    # ------------------------------------------------------------------ checks
    def _key_ok(self, conn: Conn, key: bytes) -> bool:
        if len(key) > self.max_key_size:
            self._error(conn, Status.ERR_REQUEST, f"key is {len(key)} bytes; the limit is "
                        f"max_key_size={self.max_key_size} bytes")
            return False
        return True

    def _value_ok(self, conn: Conn, value: bytes, what: str = "value") -> bool:
        if len(value) > self.max_value_size:
            self._error(conn, Status.ERR_REQUEST, f"{what} is {len(value)} bytes; the limit is "
                        f"max_value_size={self.max_value_size} bytes")
            return False
        return True

    @staticmethod
    def _split_str32(body: bytes, offset: int) -> Tuple[bytes, int]:
        if offset + 4 > len(body):
            raise ValueError("truncated length field")
        (n,) = _U32_FROM(body, offset)
        offset += 4
        if offset + n > len(body):
            raise ValueError("length field runs past the end of the body")
        return body[offset:offset + n], offset + n

    def _parse_keys(self, conn: Conn, op: int, body: bytes,
                    offset: int) -> Optional[List[bytes]]:
        try:
            return P.unpack_keys(body, offset, self.max_key_size, self.max_keys_per_request)
        except OverflowError as e:
            self._error(conn, Status.ERR_REQUEST, f"key is {e.args[0]} bytes; the limit is "
                        f"max_key_size={self.max_key_size} bytes")
        except P.KeyCountError:
            self._logs.warn(log, "too many keys", conn.peer, "store server: %s request from %s "
                            "lists more than %d keys; refused", P.OP_NAMES[op], conn.peer,
                            self.max_keys_per_request)
            self._error(conn, Status.ERR_REQUEST, f"{P.OP_NAMES[op]} lists more than "
                        f"max_keys_per_request={self.max_keys_per_request} keys")
        return None

    # ------------------------------------------------------------------ waiters
    def _wake(self, key: bytes) -> None:
        """Answer the waiters ``key`` completes. Called *after* the writer got its reply: a
        process that exits as soon as its wait returns (the rank hosting the store) must not
        take a writer's acknowledgement down with it."""
        ws = self._waiters.pop(key, None)
        if ws:
            for w in ws:
                if not w.done:
                    w.pending.discard(key)
                    if not w.pending:
                        self._finish_waiter(w, timed_out=False)
        gates = self._gates.get(key)
        if gates:
            try:
                count = int(self._data.get(key, b"0"))
            except ValueError:  # no longer a counter: they wait on (and time out)
                return
            for target in [t for t in gates if t <= count]:
                for w in gates.pop(target):
                    if not w.done:
                        self._finish_waiter(w, timed_out=False)
            if not gates:
                del self._gates[key]

    def _finish_waiter(self, w: Waiter, timed_out: bool) -> None:
        w.done = True
        conn = w.conn
        if conn.waiter is w:
            conn.waiter = None
        if conn.rbuf and not conn.closing and not conn.closed and conn.cork is None:
            conn.cork = []   # requests wait behind this reply: answer them in one send
            conn.cork_bytes = 0
        if timed_out and w.op == Op.VOTE:      # answered with the ranks that never voted
            self._reply(conn, Status.OK, self._vote_timed_out(w))  # type: ignore[attr-defined]
        elif timed_out:
            self._unlink(w)
            self._reply(conn, Status.TIMEOUT, P.pack_keys(sorted(w.pending)))
        elif w.op == Op.GET:
            self._reply(conn, Status.OK, self._data.get(w.keys[0], b""), shared=True)
        elif w.op == Op.ARRIVE or w.op == Op.VOTE:
            self._reply(conn, Status.OK, w.reply)
        else:
            self._send(conn, _OK_EMPTY)
        if not conn.closed:
            self._update_events(conn)
            if conn.cork is not None:
                self._ready.append(conn)   # handled by the loop, not recursively

    def _unlink(self, w: Waiter) -> None:
        if w.op == Op.VOTE:
            self._vote_leave(w)                  # type: ignore[attr-defined]
            return
        if w.op == Op.ARRIVE:
            gates = self._gates.get(w.keys[0])
            if gates is not None:
                s = gates.get(w.target)
                if s is not None:
                    s.discard(w)
                    if not s:
                        del gates[w.target]
                if not gates:
                    del self._gates[w.keys[0]]
            return
        for k in w.pending:
            s = self._waiters.get(k)
            if s is not None:
                s.discard(w)
                if not s:
                    del self._waiters[k]

    def _cancel_waiter(self, w: Waiter) -> None:
        w.done = True
        self._unlink(w)
        w.conn.waiter = None

    def _park(self, conn: Conn, op: int, keys: List[bytes], pending: Set[bytes],
              tmo_ms: int) -> None:
        w = Waiter(conn, op, keys, pending)
        conn.waiter = w
        for k in pending:
            s = self._waiters.get(k)
            if s is None:
                self._waiters[k] = {w}
            else:
                s.add(w)
        if tmo_ms != P.NO_TIMEOUT:
            self._push_timer(time.monotonic() + tmo_ms / 1000.0, w)

    # ------------------------------------------------------------------ handlers
    def _op_auth(self, conn: Conn, body: bytes) -> None:
        if self._token is None:
            self._logs.warn(log, "auth failure", conn.peer, "store server: client %s sent a "
                            "token, but this store has none configured; rejecting it", conn.peer)
            self._error(conn, Status.ERR_AUTH, "the client has a token but this store was "
                        "started without one (mismatched NCCLPY_STORE_TOKEN?)")
            return
        if conn.authed:
            self._protocol_error(conn, "already authenticated")
            return
        if not body:
            self._logs.warn(log, "auth failure", conn.peer, "store server: client %s has no "
                            "token; rejecting it", conn.peer)
            self._error(conn, Status.ERR_AUTH, "this store requires a token and the client "
                        "gave none (set token= or $NCCLPY_STORE_TOKEN)")
            return
        if len(body) != P.AUTH_BODY_SIZE:
            self._protocol_error(conn, f"auth body is {len(body)} bytes, expected "
                                 f"{P.AUTH_BODY_SIZE}")
            return
        mac, cnonce = body[:32], body[32:]
        expected = hmac.new(self._token, conn.nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            self._logs.warn(log, "auth failure", conn.peer, "store server: client %s presented "
                            "a wrong token; rejecting it", conn.peer)
            self._error(conn, Status.ERR_AUTH, "wrong token (the client's NCCLPY_STORE_TOKEN "
                        "does not match the store's)")
            return
        conn.authed = True
        self._reply(conn, Status.OK, P.server_mac(self._token, cnonce))

    def _op_set(self, conn: Conn, body: bytes) -> None:
        key, off = self._split_str32(body, 0)
        value = body[off:]
        if len(key) <= self.max_key_size and len(value) <= self.max_value_size:
            self._data[key] = value
            self._send(conn, _OK_EMPTY)
            self._wake(key)
        elif self._key_ok(conn, key):
            self._value_ok(conn, value)

    def _op_get(self, conn: Conn, body: bytes) -> None:
        if len(body) < 4:
            raise ValueError("missing timeout field")
        key = body[4:]
        value = self._data.get(key)
        if value is not None:
            self._reply(conn, Status.OK, value, shared=True)
            return
        if not self._key_ok(conn, key):
            return
        (tmo,) = _U32_FROM(body, 0)
        if tmo == 0:
            self._reply(conn, Status.TIMEOUT, P.pack_keys([key]))
        else:
            self._park(conn, Op.GET, [key], {key}, tmo)

    def _counter(self, conn: Conn, op: str, key: bytes, amount: int) -> Optional[int]:
        """The counter ``key`` (missing: 0) plus ``amount``; None after an
        error reply: the value is not a 64-bit integer, or the sum would leave int64.

        Counters are signed 64-bit, as torch's TCPStore has them (its ``add`` sums two
        ``int64_t``: an overflow there is undefined behaviour, not a documented wrap), so a sum
        past the range is refused with the key, the current value and the increment, and the
        stored value stays as it was."""
        old = self._data.get(key)
        if old is None:
            cur = 0
        elif old.isdigit() and len(old) < 19:   # the common case, without the checks below
            cur = int(old)
        else:
            try:
                cur = int(old)
            except ValueError:
                cur = None
            if cur is None or not _I64_MIN <= cur <= _I64_MAX:
                what = ("not a decimal integer" if cur is None else
                        "a decimal integer outside the 64-bit signed range of a counter")
                self._error(conn, Status.ERR_REQUEST, f"{op}: the value of key {key[:64]!r} is "
                            f"{what} ({old[:32]!r}{'...' if len(old) > 32 else ''})")
                return None
        new = cur + amount
        if not _I64_MIN <= new <= _I64_MAX:
            self._error(conn, Status.ERR_REQUEST, f"{op}: the counter {key[:64]!r} would "
                        f"overflow a 64-bit signed integer: current value {cur} + increment "
                        f"{amount} = {new} is outside [{_I64_MIN}, {_I64_MAX}]; the value is "
                        f"unchanged")
            return None
        return new

    def _op_add(self, conn: Conn, body: bytes) -> None:
        if len(body) < 8:
            raise ValueError("missing amount field")
        (amount,) = _I64_FROM(body, 0)
        key = body[8:]
        if not self._key_ok(conn, key):
            return
        n = self._counter(conn, "add", key, amount)
        if n is None:
            return
        new = b"%d" % n
        self._data[key] = new
        self._reply(conn, Status.OK, new)
        self._wake(key)

    def _op_arrive(self, conn: Conn, body: bytes) -> None:
        """Count in on ``key``; answer when the arrival's group of ``group`` is complete."""
        if len(body) < 8:
            raise ValueError("missing timeout or group field")
        tmo, group = _U32X2_FROM(body, 0)
        key = body[8:]
        if not self._key_ok(conn, key):
            return
        if group == 0:
            self._error(conn, Status.ERR_REQUEST, "arrive: group must be at least 1, got 0")
            return
        n = self._counter(conn, "arrive", key, 1)
        if n is None:
            return
        new = b"%d" % n
        self._data[key] = new
        target = -(-n // group) * group   # the next multiple of group at or above n
        if n >= target:
            self._reply(conn, Status.OK, new)   # completes its group, then releases it
        elif tmo == 0:
            self._reply(conn, Status.TIMEOUT, P.pack_keys([key]))
        else:
            w = Waiter(conn, Op.ARRIVE, [key], {key})
            w.target = target
            w.reply = new
            conn.waiter = w
            gates = self._gates.setdefault(key, {})
            s = gates.get(target)
            if s is None:
                gates[target] = {w}
            else:
                s.add(w)
            if tmo != P.NO_TIMEOUT:
                self._push_timer(time.monotonic() + tmo / 1000.0, w)
        self._wake(key)

    def _op_cas(self, conn: Conn, body: bytes) -> None:
        key, off = self._split_str32(body, 0)
        expected, off = self._split_str32(body, off)
        desired = body[off:]
        if not (self._key_ok(conn, key) and self._value_ok(conn, expected, "expected value")
                and self._value_ok(conn, desired, "desired value")):
            return
        cur = self._data.get(key)
        if cur is None:
            # torch's semantics: a missing key matches only b""; otherwise the reply is the
            # *expected* value (what torch.distributed.TCPStore returns, too)
            if expected == b"":
                self._data[key] = desired
                self._reply(conn, Status.OK, desired, shared=True)
                self._wake(key)
            else:
                self._reply(conn, Status.OK, expected)
            return
        if cur == expected:
            self._data[key] = desired
            self._reply(conn, Status.OK, desired, shared=True)
            self._wake(key)
        else:
            self._reply(conn, Status.OK, cur, shared=True)

    def _op_delete(self, conn: Conn, body: bytes) -> None:
        if self._key_ok(conn, body):
            existed = self._data.pop(body, None) is not None
            self._send(conn, _OK_TRUE if existed else _OK_FALSE)

    def _op_wait(self, conn: Conn, body: bytes) -> None:
        if len(body) < 4:
            raise ValueError("missing timeout field")
        (tmo,) = _U32_FROM(body, 0)
        keys = self._parse_keys(conn, Op.WAIT, body, 4)
        if keys is None:
            return
        pending = {k for k in keys if k not in self._data}
        if not pending:
            self._send(conn, _OK_EMPTY)
        elif tmo == 0:
            self._reply(conn, Status.TIMEOUT, P.pack_keys(sorted(pending)))
        else:
            self._park(conn, Op.WAIT, keys, pending, tmo)

    def _op_num_keys(self, conn: Conn, body: bytes) -> None:
        self._reply(conn, Status.OK, P.U64.pack(len(self._data)))

    def _op_check(self, conn: Conn, body: bytes) -> None:
        keys = self._parse_keys(conn, Op.CHECK, body, 0)
        if keys is not None:
            data = self._data
            self._send(conn, _OK_TRUE if all(k in data for k in keys) else _OK_FALSE)

    def _op_ping(self, conn: Conn, body: bytes) -> None:
        self._send(conn, _OK_EMPTY)
