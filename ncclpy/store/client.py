"""The store client: one persistent connection (plus spares for concurrent threads), every call
bounded by a timeout.

Duck-compatible with ``torch.distributed.TCPStore`` for the methods ncclpy relies on (``set``,
``get``, ``add``, ``compare_set``, ``wait``, ``num_keys``, ``check``, ``delete_key``), so either
store can be handed to ncclpy's bootstrap. The transport (connect, greeting, auth, timeouts,
pipelining) is in :mod:`.transport`.
"""
from __future__ import annotations

import socket
from typing import Iterable, List, Optional, Union

from ..errors import ArgumentError, ArgumentTypeError, StoreRequestError
from . import protocol as P
from . import tablewire as TW
from .limits import StoreLimits
from .protocol import Op
from .server import StoreServer, resolve_token
from .transport import (_INF, Connection, Key, Seconds, Value, _key, _seconds,
                        _show, _value)

__all__ = ["TCPStore"]

_U32 = P.U32.pack
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _check_amount(amount: int) -> None:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ArgumentTypeError(f"amount: expected int, got {type(amount).__name__}")
    if not _I64_MIN <= amount <= _I64_MAX:
        raise ArgumentError(f"amount: expected a 64-bit signed int, got {amount}")


class TCPStore(Connection):
    """Client of a :class:`StoreServer` (``is_server=True``: start one in-process first).

    ``timeout`` bounds every call (seconds or timedelta; ``get``/``wait`` take their own);
    ``connect_timeout`` (default: ``timeout``) bounds connection set-up, retried with exponential
    backoff so ranks may start before the server. ``token`` (or ``$NCCLPY_STORE_TOKEN``) is proven
    by challenge-response, never sent. ``limits`` (a :class:`StoreLimits` or a dict of its
    fields; default: ``$NCCLPY_STORE_*``, see :mod:`ncclpy.store.limits`) configures the server
    that ``is_server=True`` starts. One object may be shared by threads: a call made while
    another thread's call is in flight (a parked ``get``, say) goes over a spare connection of
    its own, so threads never wait behind each other; spares are made on first need and reused.
    """

    def __init__(self, host: str, port: int, world_size: Optional[int] = None,
                 is_master: bool = False, *, token=None, timeout: Seconds = 300.0,
                 connect_timeout: Seconds = None, is_server: bool = False,
                 limits: Union[StoreLimits, dict, None] = None) -> None:
        # torch's positional form TCPStore(host, port, world_size, is_master) works too:
        # is_master is is_server, and world_size sizes the server's connection limit
        if not isinstance(is_master, bool) or not isinstance(is_server, bool):
            raise ArgumentTypeError(f"is_master / is_server: expected True or False, got "
                                    f"{is_master!r} / {is_server!r}")
        if world_size is not None and (isinstance(world_size, bool)
                                       or not isinstance(world_size, int) or world_size < 1):
            raise ArgumentError(f"world_size: expected None or an int >= 1, got {world_size!r}")
        is_server = is_server or is_master
        if is_server and limits is None and world_size is not None:
            limits = StoreLimits.for_world(world_size)  # type: ignore[attr-defined]
        if not isinstance(host, str) or not host:
            raise ArgumentError(f"host: expected a host name or address, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ArgumentError(f"port: expected an int in 0..65535, got {port!r}")
        self.timeout = _seconds(timeout, "timeout")
        if self.timeout is None:
            self.timeout = _INF
        ct = _seconds(connect_timeout, "connect_timeout")
        self.connect_timeout = self.timeout if ct is None else ct
        self._token = resolve_token(token)
        if limits is not None and not is_server:
            raise ArgumentError("limits: only meaningful with is_server=True (they configure the "
                                "server this client starts)")
        self.server: Optional[StoreServer] = None
        if is_server:
            self.server = StoreServer(host, port, token=self._token, limits=limits).start()
            port = self.server.port
        elif port == 0:
            raise ArgumentError("port: 0 (pick a free port) only makes sense with is_server=True")
        self._init_connection(host, port)
        try:
            with self._lock:
                self._connect(self.connect_timeout)
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise

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
        """Atomically add ``amount`` to the counter ``key`` (missing counts as 0); new value.

        Counters are signed 64-bit integers, as in torch's TCPStore: a sum outside
        [-2**63, 2**63 - 1] is refused (:class:`StoreRequestError` naming the key, the current
        value and the increment) and the counter keeps its value; it never wraps."""
        k = key.encode("utf-8") if type(key) is str else _key(key)
        _check_amount(amount)
        self._check_key(k, "add")
        return self._counter_reply(self._call(Op.ADD, P.I64.pack(amount), k, None, k, "add"),
                                   k, amount)

    def _counter_reply(self, reply: bytes, k: bytes, amount: int) -> int:
        """The new value an ADD reply carries, refused past int64 (an older server that does
        not check the range itself has already stored it)."""
        n = int(reply)
        if not _I64_MIN <= n <= _I64_MAX:
            raise StoreRequestError(f"add: the store at {self._addr} returned {n} for the "
                                    f"counter {_show([k])} after adding {amount}: outside the "
                                    f"64-bit signed range of a counter (a server without the "
                                    f"overflow check?)")
        return n

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

    @property
    def supports_arrive(self) -> bool:
        """True if the server serves :meth:`arrive` (every ncclpy server this version or newer)."""
        return bool(self.server_flags & P.FLAG_ARRIVE)

    def arrive(self, key: Key, group: int, timeout: Seconds = None) -> int:
        """Count in on the counter ``key`` (+1, atomically) and block until this arrival's group
        of ``group`` consecutive arrivals is complete, i.e. the counter reaches the next
        multiple of ``group``; returns this arrival's number. One round trip: a reusable
        barrier of ``group`` callers on one key, held on the server. ``timeout``: seconds or
        timedelta (default: the store's); the arrival stays counted when it times out."""
        return int(self._call(*self._arrive_call(key, group, timeout)))

    def _arrive_call(self, key: Key, group: int, timeout: Seconds) -> tuple:
        k = _key(key)
        if isinstance(group, bool) or not isinstance(group, int):
            raise ArgumentTypeError(f"group: expected int, got {type(group).__name__}")
        if not 1 <= group <= 0xFFFFFFFF:
            raise ArgumentError(f"group: expected 1 .. 2**32-1 arrivals, got {group}")
        self._check_key(k, "arrive")
        if not self.supports_arrive:
            raise StoreRequestError(f"arrive: the store at {self._addr} does not serve arrive "
                                    f"(an older ncclpy server); key {_show([k])}")
        t = self.timeout if timeout is None else _seconds(timeout, "timeout")
        return (Op.ARRIVE, P.U32X2.pack(P.timeout_ms(t), group), k, t, k,
                f"arrive (group of {group})")

    @property
    def supports_tables(self) -> bool:
        """True if the server serves :meth:`beat` and :meth:`vote` (heartbeat and vote tables)."""
        return bool(self.server_flags & P.FLAG_TABLES)

    def _need_tables(self, what: str) -> None:
        if not self.supports_tables:
            raise StoreRequestError(f"{what}: the store at {self._addr} does not serve it (an "
                                    f"older ncclpy server)")

    def beat(self, group: Key, rank: int, world: int, stale: float, value: Value = b"", *,
             watch: Key = b"", flags: int = 0, timeout: Seconds = None,
             count: int = 0) -> TW.BeatReply:
        """Record ``rank``'s heartbeat in the server-held table ``group`` of ``world`` ranks and
        read it back in one round trip: the ranks whose last beat is older than ``stale``
        seconds, those that never beat, the first rank that aborted, and the integer value of
        the counter ``watch`` (:mod:`ncclpy.store.tablewire`; ``flags`` its BEAT_* bits;
        ``count`` the rank's progress counter, or with BEAT_BEHIND the threshold).
        ``timeout``: seconds."""
        self._need_tables("beat")
        g, wk, v = _key(group), _key(watch), _value(value)
        self._check_key(g, "beat")
        t = self.timeout if timeout is None else _seconds(timeout, "timeout")
        body = TW.pack_beat(g, rank, world, stale, v, wk, flags, count)
        raw = self._call(Op.BEAT, body, b"", None, g, "beat", t)
        return TW.parse_beat(raw, world, bool(flags & TW.BEAT_FULL),
                             bool(flags & TW.BEAT_BEHIND))

    def vote(self, key: Key, group: int, rank: int, hash_: int, sum_: int = 0,
             bad: bool = False, timeout: Seconds = None) -> TW.VoteReply:
        """Vote on ``key`` with ``group`` voters (one round trip, held on the server until all
        voted or ``timeout``): every voter's ``hash_`` must be equal and their ``sum_`` add up
        to 0 mod 2**64; ``bad``: this voter found a problem of its own.  The server forgets the
        vote once answered.  Returns the verdict (:class:`~ncclpy.store.tablewire.VoteReply`)."""
        self._need_tables("vote")
        k = _key(key)
        self._check_key(k, "vote")
        t = self.timeout if timeout is None else _seconds(timeout, "timeout")
        body = TW.pack_vote(k, group, rank, hash_, sum_, TW.VOTE_BAD if bad else 0,
                            P.timeout_ms(t))
        return TW.parse_vote(self._call(Op.VOTE, body, b"", t, k, f"vote (group of {group})"))

    def _keys(self, keys: Union[Key, Iterable[Key]], what: str) -> List[bytes]:
        if isinstance(keys, (str, bytes, bytearray)):
            keys = [keys]
        elif not isinstance(keys, Iterable):
            raise ArgumentTypeError(f"{what}: keys must be a key or a list of keys (str or "
                                    f"bytes), got {keys!r} ({type(keys).__name__}); the "
                                    f"timeout is the second argument: {what}(keys, timeout)")
        ks = []
        for i, k in enumerate(keys):
            if not isinstance(k, (str, bytes, bytearray)):
                raise ArgumentTypeError(f"{what}: keys[{i}] must be str or bytes, got {k!r} "
                                        f"({type(k).__name__})")
            ks.append(_key(k))
        for k in ks:
            self._check_key(k, what)
        if self.max_keys_per_request and len(ks) > self.max_keys_per_request:
            raise StoreRequestError(f"{what}: {len(ks)} keys ({_show(ks)}); the store at "
                                    f"{self._addr} allows at most max_keys_per_request="
                                    f"{self.max_keys_per_request} keys per request")
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

    # request builders for _pipeline: (op, body, wait, keys, what)
    def _req_set(self, key: Key, value: Value) -> tuple:
        k, v = _key(key), _value(value)
        self._check_key(k, "set")
        self._check_value(v, "set", k)
        return (Op.SET, _U32(len(k)) + k + v, None, k, "set")

    def _req_add(self, key: Key, amount: int) -> tuple:
        k = _key(key)
        _check_amount(amount)
        self._check_key(k, "add")
        return (Op.ADD, P.I64.pack(amount) + k, None, k, "add")

    def _req_arrive(self, key: Key, group: int, timeout: Seconds = None) -> tuple:
        op, head, tail, t, k, what = self._arrive_call(key, group, timeout)
        return (op, head + tail, t, k, what)

    def _req_delete(self, key: Key) -> tuple:
        k = _key(key)
        self._check_key(k, "delete")
        return (Op.DELETE, k, None, k, "delete")

    def _req_wait(self, keys: Union[Key, Iterable[Key]], timeout: Seconds = None) -> tuple:
        ks = self._keys(keys, "wait")
        t = self.timeout if timeout is None else _seconds(timeout, "timeout")
        return (Op.WAIT, _U32(P.timeout_ms(t)) + P.pack_keys(ks), t, ks, "wait")

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
        self._close_spares()
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> "TCPStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TCPStore({self._addr}, server={'in-process' if self.server else 'remote'}, "
                f"closed={self._closed})")
