"""Wire format of the ncclpy TCP store: small, length-prefixed, binary, never pickled.

Why a format of our own: the store must be safe to expose on a cluster network, so every length
is checked against a limit *before* anything is buffered, and values are opaque bytes.

Connection set-up (server -> client, 48 bytes, sent as soon as the server accepts)::

    HELLO = magic b"NCPS" | version u8 | flags u8 | max_keys u16
            | max_key_size u32 | max_value_size u32 | nonce 32 bytes

``flags``: bit 0 (``FLAG_AUTH``) a token is required; bit 1 (``FLAG_ARRIVE``) the server
serves ``ARRIVE`` (a client must not send it to a server that does not say so); bit 2
(``FLAG_TABLES``) it serves ``BEAT`` and ``VOTE`` (:mod:`.tablewire`); bit 7 (``FLAG_REFUSED``)
the server is full: an ``ERR_REQUEST`` frame saying why follows, then the server closes.
``max_keys`` is the server's ``max_keys_per_request`` (0: not advertised, e.g. over 65535); the
nonce is all zeros on a server without a token (nothing to prove).

With a token in play the client then sends an ``AUTH`` request whose body is
``HMAC-SHA256(token, nonce) | client_nonce (32 bytes)`` (or an empty body: "I have no token"), and
the server answers ``OK`` with ``HMAC-SHA256(token, b"ncclpy-store-server" + client_nonce)`` so
the client knows it talks to a server holding the same token. The token never crosses the wire.

Every request is ``op u8 | body_len u32 | body`` and every reply ``status u8 | body_len u32 |
body`` (network byte order). Request bodies (``str32`` = ``u32 length | bytes``)::

    AUTH      mac(32) | client_nonce(32)          or empty
    SET       str32 key | value (rest)
    GET       timeout_ms u32 | key (rest)
    ADD       amount i64 | key (rest)
    CAS       str32 key | str32 expected | desired (rest)
    DELETE    key (rest)
    WAIT      timeout_ms u32 | str32 key ...
    NUM_KEYS  (empty)
    CHECK     str32 key ...
    PING      (empty)
    ARRIVE    timeout_ms u32 | group u32 | key (rest)
    BEAT      see :mod:`.tablewire` (a heartbeat table held by the server)
    VOTE      see :mod:`.tablewire` (a compare-and-barrier of hashes held by the server)

``ARRIVE`` adds 1 to the counter ``key`` (as ADD does) and answers once the counter reaches the
next multiple of ``group`` at or above the new value: the arrival's group of ``group``
consecutive arrivals is complete. It is a whole barrier generation in one round trip.

``timeout_ms == 0xFFFFFFFF`` waits forever. Reply bodies on ``OK``: GET/CAS -> value, ADD and
ARRIVE -> the new value (ARRIVE: this arrival's number) as decimal ASCII, DELETE/CHECK -> one
byte 0/1, NUM_KEYS -> u64, others empty. Counters are signed 64-bit (torch's are ``int64_t``):
an ADD or ARRIVE whose sum leaves that range gets ``ERR_REQUEST`` and changes nothing. On
``TIMEOUT`` the body lists the keys still missing (``str32`` each); on ``ERR_*`` it is a UTF-8
message. After ``ERR_PROTOCOL`` and ``ERR_AUTH`` the server closes the connection.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Iterable, List, Optional, Tuple

__all__ = [
    "MAGIC", "VERSION", "HELLO", "HELLO_SIZE", "NONCE_SIZE", "FLAG_AUTH", "FLAG_ARRIVE",
    "FLAG_TABLES", "FLAG_REFUSED",
    "REQ_HEADER", "REP_HEADER", "HEADER_SIZE", "Op", "Status", "OP_NAMES", "STATUS_NAMES",
    "NO_TIMEOUT", "AUTH_BODY_SIZE", "MAX_TIMEOUT_MS", "client_mac", "server_mac", "pack_str32",
    "pack_keys", "unpack_keys", "request", "body_limit", "timeout_ms", "parse_hello",
    "pack_hello", "hello_max_keys", "U32", "U32X2", "I64", "U64", "KeyCountError",
]

MAGIC = b"NCPS"
VERSION = 2
NONCE_SIZE = 32
FLAG_AUTH = 0x01
FLAG_ARRIVE = 0x02
FLAG_TABLES = 0x04
FLAG_REFUSED = 0x80
HELLO = struct.Struct("!4sBBHII")
HELLO_SIZE = HELLO.size + NONCE_SIZE          # 48
REQ_HEADER = struct.Struct("!BI")             # op, body length
REP_HEADER = struct.Struct("!BI")             # status, body length
HEADER_SIZE = REQ_HEADER.size                 # 5
U32 = struct.Struct("!I")
U32X2 = struct.Struct("!II")
I64 = struct.Struct("!q")
U64 = struct.Struct("!Q")
NO_TIMEOUT = 0xFFFFFFFF
MAX_TIMEOUT_MS = NO_TIMEOUT - 1
AUTH_BODY_SIZE = 2 * 32


class Op:
    """Request opcodes."""

    AUTH = 1
    SET = 2
    GET = 3
    ADD = 4
    CAS = 5
    DELETE = 6
    WAIT = 7
    NUM_KEYS = 8
    CHECK = 9
    PING = 10
    ARRIVE = 11
    BEAT = 12
    VOTE = 13


class Status:
    """Reply status codes."""

    OK = 0
    TIMEOUT = 1
    ERR_REQUEST = 2      # well-formed but refused (limits, non-integer counter, ...)
    ERR_AUTH = 3         # authentication failed; connection is closed
    ERR_PROTOCOL = 4     # malformed frame; connection is closed


OP_NAMES = {v: k.lower() for k, v in vars(Op).items() if k.isupper()}
STATUS_NAMES = {v: k for k, v in vars(Status).items() if k.isupper()}


def body_limit(op: int, max_key: int, max_value: int) -> int:
    """Largest body a request ``op`` may announce; -1 for an unknown opcode.

    Checked on the header alone, so nothing oversized is ever buffered. Key lists (WAIT, CHECK)
    are bounded by ``max_value_size`` as a whole (and, when parsed, by the server's
    ``max_keys_per_request`` in count).
    """
    if op == Op.AUTH:
        return AUTH_BODY_SIZE
    if op == Op.SET:
        return 4 + max_key + max_value
    if op == Op.GET:
        return 4 + max_key
    if op in (Op.ADD, Op.ARRIVE):
        return 8 + max_key
    if op == Op.CAS:
        return 8 + max_key + 2 * max_value
    if op == Op.DELETE:
        return max_key
    if op in (Op.WAIT, Op.CHECK):
        return 4 + max(max_value, 4 + max_key)
    if op in (Op.NUM_KEYS, Op.PING):
        return 0
    if op == Op.BEAT:
        return 17 + 2 * (4 + max_key) + max_value
    if op == Op.VOTE:
        return 29 + max_key
    return -1


def client_mac(token: bytes, nonce: bytes) -> bytes:
    """The client's proof: HMAC-SHA256(token, server nonce)."""
    return hmac.new(token, nonce, hashlib.sha256).digest()


def server_mac(token: bytes, client_nonce: bytes) -> bytes:
    """The server's proof back to the client (distinct message so it cannot be replayed)."""
    return hmac.new(token, b"ncclpy-store-server" + client_nonce, hashlib.sha256).digest()


def pack_str32(b: bytes) -> bytes:
    return U32.pack(len(b)) + b


def pack_keys(keys: Iterable[bytes]) -> bytes:
    return b"".join(U32.pack(len(k)) + k for k in keys)


class KeyCountError(ValueError):
    """A key list longer than allowed (``args[0]``: the limit)."""


def unpack_keys(body: bytes, offset: int, max_key: int,
                max_count: Optional[int] = None) -> List[bytes]:
    """Parse a run of ``str32`` keys; ValueError on truncation, OverflowError (``args[0]``: its
    size) on a key over ``max_key``, :class:`KeyCountError` past ``max_count`` keys (found
    after parsing at most ``max_count + 1`` of them, however long the body)."""
    keys = []
    n = len(body)
    while offset < n:
        if max_count is not None and len(keys) >= max_count:
            raise KeyCountError(max_count)
        if offset + 4 > n:
            raise ValueError("truncated key length")
        (klen,) = U32.unpack_from(body, offset)
        offset += 4
        if klen > max_key:
            raise OverflowError(klen)
        if offset + klen > n:
            raise ValueError("truncated key")
        keys.append(bytes(body[offset:offset + klen]))
        offset += klen
    return keys


def request(op: int, body: bytes = b"") -> bytes:
    """One request frame."""
    return REQ_HEADER.pack(op, len(body)) + body


def timeout_ms(seconds: float | None) -> int:
    """Seconds -> the wire's u32 milliseconds (None or inf -> wait forever)."""
    if seconds is None or seconds == float("inf"):
        return NO_TIMEOUT
    return max(0, min(int(seconds * 1000.0), MAX_TIMEOUT_MS))


def parse_hello(data: bytes) -> Tuple[bytes, int, int, int, int, bytes]:
    """(magic, version, flags, max_key, max_value, nonce) from a HELLO frame."""
    magic, version, flags, _res, max_key, max_value = HELLO.unpack_from(data, 0)
    return magic, version, flags, max_key, max_value, bytes(data[HELLO.size:HELLO_SIZE])


def pack_hello(flags: int, max_key: int, max_value: int, nonce: bytes,
               max_keys: int = 0) -> bytes:
    """The server's greeting (``max_keys`` over 65535 is sent as 0: not advertised)."""
    return (HELLO.pack(MAGIC, VERSION, flags, max_keys if max_keys <= 0xFFFF else 0, max_key,
                       max_value) + nonce)


def hello_max_keys(data: bytes) -> int:
    """The ``max_keys_per_request`` a greeting advertises (0: unknown)."""
    return HELLO.unpack_from(data, 0)[3]
