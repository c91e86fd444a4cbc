"""The store's authentication contract, every refusal named: what the server answers (and
logs) for each way a client can get the handshake wrong, and what the client says for each way a
server can answer it (the mutation run's targets ``store_auth_server`` and ``store_auth_client``,
docs/testing.md).

Server side: a real :class:`StoreServer` and a raw socket speaking the handshake by hand, so each
malformed or missing proof can be sent exactly; the reply, the log line an operator reads and
that the connection is closed are all asserted. Client side: a real :class:`TCPStore` against a
scripted server on loopback. Where a reply must arrive in a later segment than the bytes before
it, the scripted server sends it only once the client has read those (a spy on the client's
reads tells it), so no test depends on a timing window.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import types
from typing import Callable, List, Optional, Tuple

import pytest

from ncclpy.errors import StoreAuthError, StoreConnectionError, StoreProtocolError
from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store import transport
from ncclpy.store.protocol import Op, Status
from store_util import frame, is_closed, read_reply, recv_exact

pytestmark = pytest.mark.timeout(60)

TOKEN = b"the-shared-token"
NEEDS_TOKEN = "this store requires a token: authenticate first (set token= or $NCCLPY_STORE_TOKEN)"
GAVE_NONE = ("this store requires a token and the client gave none (set token= or "
             "$NCCLPY_STORE_TOKEN)")
WRONG = "wrong token (the client's NCCLPY_STORE_TOKEN does not match the store's)"
HAS_NONE = ("the client has a token but this store was started without one (mismatched "
            "NCCLPY_STORE_TOKEN?)")


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv("NCCLPY_STORE_TOKEN", raising=False)


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    return caplog


def _greeted(srv: StoreServer) -> Tuple[socket.socket, int, bytes, str]:
    """A raw connection to ``srv``: (socket, greeting flags, nonce, the peer name the server
    gives it in its logs)."""
    s = socket.create_connection(srv.address, timeout=10)
    magic, _v, flags, _k, _mv, nonce = P.parse_hello(recv_exact(s, P.HELLO_SIZE))
    assert magic == P.MAGIC
    host, port = s.getsockname()[:2]
    return s, flags, nonce, f"{host}:{port}"


def _addr(srv: StoreServer) -> str:
    return f"127.0.0.1:{srv.port}"


def _warnings(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _unset(srv: StoreServer, key: bytes) -> bool:
    """True when ``key`` is not on ``srv`` (asked over a genuine, authenticated client)."""
    with TCPStore(*srv.address, token=srv._token, timeout=10) as c:
        return not c.check([key])


# ============================================================================ the server side
@pytest.fixture
def server():
    with StoreServer(token=TOKEN).start() as srv:
        yield srv


def test_a_genuine_proof_is_answered_with_the_servers_own_and_requests_are_served(server):
    """OK carries exactly HMAC(token, "ncclpy-store-server" + the client's nonce) (made from
    the 32 bytes after the proof, not any other slice), and the connection then serves
    requests: authentication is remembered."""
    s, flags, nonce, _ = _greeted(server)
    with s:
        assert flags & P.FLAG_AUTH
        cnonce = os.urandom(P.NONCE_SIZE)
        s.sendall(frame(Op.AUTH, P.client_mac(TOKEN, nonce) + cnonce))
        assert read_reply(s) == (Status.OK, P.server_mac(TOKEN, cnonce))
        s.sendall(frame(Op.SET, P.pack_str32(b"k") + b"v"))
        assert read_reply(s) == (Status.OK, b"")
        s.sendall(frame(Op.GET, P.U32.pack(0) + b"k"))
        assert read_reply(s) == (Status.OK, b"v")


def test_a_request_before_authenticating_is_refused_logged_and_never_served(server, logs):
    s, _, _, peer = _greeted(server)
    with s:
        s.sendall(frame(Op.SET, P.pack_str32(b"sneaked") + b"x"))
        assert read_reply(s) == (Status.ERR_AUTH, NEEDS_TOKEN.encode())
        assert is_closed(s)
    # the warning is logged before the reply is sent (the server's single thread)
    assert (f"store server: client {peer} sent set before authenticating (missing token?); "
            f"closing it") in _warnings(logs)
    assert _unset(server, b"sneaked")


def test_a_client_without_a_token_is_refused_logged_and_told_why(server, logs):
    s, _, _, peer = _greeted(server)
    with s:
        s.sendall(frame(Op.AUTH, b"") + frame(Op.SET, P.pack_str32(b"sneaked") + b"x"))
        assert read_reply(s) == (Status.ERR_AUTH, GAVE_NONE.encode())
        assert is_closed(s)
    assert f"store server: client {peer} has no token; rejecting it" in _warnings(logs)
    assert _unset(server, b"sneaked")
    with pytest.raises(StoreAuthError) as ei:
        TCPStore(*server.address, timeout=10)
    assert str(ei.value) == (f"the store at {_addr(server)} requires a token and none was given "
                             f"(pass token= or set $NCCLPY_STORE_TOKEN): {GAVE_NONE}")


def test_a_wrong_token_is_refused_logged_and_told_why(server, logs):
    s, _, nonce, peer = _greeted(server)
    with s:
        s.sendall(frame(Op.AUTH, P.client_mac(b"another-token", nonce) + os.urandom(32))
                  + frame(Op.SET, P.pack_str32(b"sneaked") + b"x"))
        assert read_reply(s) == (Status.ERR_AUTH, WRONG.encode())
        assert is_closed(s)
    assert f"store server: client {peer} presented a wrong token; rejecting it" in _warnings(logs)
    assert _unset(server, b"sneaked")
    with pytest.raises(StoreAuthError) as ei:
        TCPStore(*server.address, token=b"another-token", timeout=10)
    assert str(ei.value) == (f"the store at {_addr(server)} rejected this client's token: "
                             f"{WRONG}")


def test_a_token_sent_to_a_store_without_one_is_refused_logged_and_told_why(logs):
    with StoreServer().start() as srv:
        s, flags, nonce, peer = _greeted(srv)
        with s:
            assert not flags & P.FLAG_AUTH and nonce == bytes(P.NONCE_SIZE)
            s.sendall(frame(Op.AUTH, P.client_mac(TOKEN, nonce) + os.urandom(32)))
            assert read_reply(s) == (Status.ERR_AUTH, HAS_NONE.encode())
            assert is_closed(s)
        assert (f"store server: client {peer} sent a token, but this store has none "
                f"configured; rejecting it") in _warnings(logs)
        with pytest.raises(StoreAuthError) as ei:
            TCPStore(*srv.address, token=TOKEN, timeout=10)
        assert str(ei.value) == (f"this client has a token but the store at {_addr(srv)} was "
                                 f"started without one: {HAS_NONE}")
        with TCPStore(*srv.address, timeout=10) as c:     # and a client without one is served
            c.set("k", b"v")
            assert c.get("k") == b"v"


def test_authenticating_twice_is_a_protocol_error(server, logs):
    s, _, nonce, peer = _greeted(server)
    with s:
        proof = P.client_mac(TOKEN, nonce) + os.urandom(32)
        s.sendall(frame(Op.AUTH, proof))
        assert read_reply(s)[0] == Status.OK
        s.sendall(frame(Op.AUTH, proof) + frame(Op.SET, P.pack_str32(b"after") + b"x"))
        assert read_reply(s) == (Status.ERR_PROTOCOL, b"already authenticated")
        assert is_closed(s)
    assert (f"store server: protocol error from {peer}: already authenticated; closing the "
            f"connection") in _warnings(logs)
    assert _unset(server, b"after")


@pytest.mark.parametrize("nonce_len", [0, 1, 31])
def test_an_auth_body_of_the_wrong_size_is_a_protocol_error_even_with_a_valid_proof(
        server, logs, nonce_len):
    """A valid proof followed by a client nonce shorter than 32 bytes is malformed: refused
    before the proof is even looked at, so no short nonce is ever answered."""
    s, _, nonce, peer = _greeted(server)
    with s:
        body = P.client_mac(TOKEN, nonce) + os.urandom(nonce_len)
        s.sendall(frame(Op.AUTH, body) + frame(Op.SET, P.pack_str32(b"sneaked") + b"x"))
        msg = f"auth body is {len(body)} bytes, expected {P.AUTH_BODY_SIZE}"
        assert read_reply(s) == (Status.ERR_PROTOCOL, msg.encode())
        assert is_closed(s)
    assert (f"store server: protocol error from {peer}: {msg}; closing the connection"
            in _warnings(logs))
    assert _unset(server, b"sneaked")


def test_genuine_clients_with_and_without_a_token():
    """After the handshake the client reads every reply, small or split over many segments
    (a value larger than one read), with a token or without."""
    big = os.urandom(300_000)
    with StoreServer(token=TOKEN).start() as srv, \
            TCPStore(*srv.address, token=TOKEN, timeout=10) as c:
        c.set("a", b"1")
        assert c.get("a") == b"1" and c.add("n", 2) == 2
        c.set("big", big)
        assert c.get("big") == big
    with StoreServer().start() as srv, TCPStore(*srv.address, timeout=10) as c:
        c.set("a", b"1")
        assert c.get("a") == b"1" and c.add("n", 2) == 2
        c.set("big", big)
        assert c.get("big") == big


# ============================================================================ the client side
class Scripted:
    """A loopback server that runs ``script(conn)`` on every client connection it accepts (a
    client retries after a refusal), then records whatever the client sends until it closes. A
    failure inside the script is re-raised by :meth:`close`."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.accepted = 0
        self.after = bytearray()
        self.error: Optional[BaseException] = None
        self.stop = threading.Event()
        self._conns: List[socket.socket] = []
        self._t = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self._t.start()

    def _serve(self, script) -> None:
        while True:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            with conn:
                conn.settimeout(30)
                try:
                    script(conn)
                    while True:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        self.after.extend(chunk)
                except OSError:
                    pass
                except BaseException as e:   # an assertion in the script
                    self.error = e
                    return

    def close(self) -> None:
        """Stop serving; a script still waiting for the client (which gave up) ends at once."""
        self.stop.set()
        for sock in [self.lsock] + self._conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.lsock.close()
        self._t.join(30)
        assert not self._t.is_alive(), "the scripted server never finished"
        if self.error is not None:
            raise self.error


@pytest.fixture
def reads(monkeypatch) -> "queue.Queue[int]":
    """The sizes of the client's reads as each completes (so a scripted server can send the
    next bytes only once the client has consumed the ones before: a reply split across
    segments, deterministically)."""
    q: "queue.Queue[int]" = queue.Queue()
    real = transport.Connection._recv_exact

    def spy(self, sock, n, buf, deadline, probe=None):
        out = real(self, sock, n, buf, deadline, probe)
        q.put(n)
        return out

    monkeypatch.setattr(transport.Connection, "_recv_exact", spy)
    return q


def _read_auth(conn: socket.socket) -> bytes:
    op, n = P.REQ_HEADER.unpack(recv_exact(conn, P.HEADER_SIZE))
    assert op == Op.AUTH, op
    return recv_exact(conn, n)


def _await_read(reads: "queue.Queue[int]", n: int, fake: "Scripted") -> None:
    """Return once the client has completed a read of ``n`` bytes; raise (ending the script)
    once the test closed ``fake`` or after a hang bound."""
    deadline = time.monotonic() + 30
    while not fake.stop.is_set() and time.monotonic() < deadline:
        try:
            if reads.get(timeout=0.05) == n:
                return
        except queue.Empty:
            pass
    raise OSError("the client never made that read")


def test_an_auth_reply_whose_body_comes_in_a_later_segment_is_read(reads):
    """A busy server's proof may arrive after its header: the client reads on within its
    connect budget and is authenticated (not a reconnect loop, not an error)."""
    def script(conn):
        cnonce = _read_auth(conn)[32:]
        proof = P.server_mac(TOKEN, cnonce)
        conn.sendall(P.REP_HEADER.pack(Status.OK, len(proof)))
        _await_read(reads, P.HEADER_SIZE, fake)
        conn.sendall(proof)

    def greet_then(conn):
        conn.sendall(P.pack_hello(P.FLAG_AUTH, 4096, 1 << 20, os.urandom(32)))
        script(conn)

    fake = Scripted(greet_then)
    try:
        TCPStore("127.0.0.1", fake.port, token=TOKEN, timeout=20, connect_timeout=5).close()
    finally:
        fake.close()


def test_a_refusal_whose_reason_comes_in_later_segments_is_read_whole(reads):
    """A full server's refusal (FLAG_REFUSED, then an ERR_REQUEST frame saying why): the
    client reports the server's reason even when the header and the reason arrive after the
    greeting, each in a segment of its own."""
    why = b"the store is full: max_clients=1 connections are open"

    def script(conn):
        conn.sendall(P.pack_hello(P.FLAG_REFUSED, 4096, 1 << 20, bytes(32)))
        _await_read(reads, P.HELLO_SIZE, fake)
        conn.sendall(P.REP_HEADER.pack(Status.ERR_REQUEST, len(why)))
        _await_read(reads, P.HEADER_SIZE, fake)
        conn.sendall(why)

    fake = Scripted(script)
    try:
        with pytest.raises(StoreConnectionError) as ei:   # refused on every retry
            TCPStore("127.0.0.1", fake.port, timeout=20, connect_timeout=3)
    finally:
        fake.close()
    assert str(ei.value).startswith(f"could not connect to the store at {fake.addr}")
    assert f"the store at {fake.addr} refused this client: {why.decode()}" in str(ei.value)


def test_a_refusal_reason_is_cut_at_4_kib():
    why = b"r" * 5000

    def script(conn):
        conn.sendall(P.pack_hello(P.FLAG_REFUSED, 4096, 1 << 20, bytes(32))
                     + P.REP_HEADER.pack(Status.ERR_REQUEST, len(why)) + why)

    fake = Scripted(script)
    try:
        with pytest.raises(StoreConnectionError) as ei:
            TCPStore("127.0.0.1", fake.port, timeout=5, connect_timeout=0.5)
    finally:
        fake.close()
    assert f"refused this client: {'r' * 4096}" in str(ei.value)
    assert "r" * 4097 not in str(ei.value)


def test_a_real_full_store_refusal_names_its_reason():
    with StoreServer(max_clients=1).start() as srv, TCPStore(*srv.address, timeout=10) as first:
        first.ping()
        with pytest.raises(StoreConnectionError) as ei:
            TCPStore(*srv.address, timeout=10, connect_timeout=0.3)
        assert (f"the store at {_addr(srv)} refused this client: the store is full: "
                f"max_clients=1 connections are open") in str(ei.value)


@pytest.mark.parametrize("n, ok", [(4096, True), (4097, False)])
def test_an_auth_reply_is_read_up_to_4_kib_and_refused_past_it(n, ok):
    """The client reads an auth reply of up to 4096 bytes (here a long ERR_AUTH message, which
    it reports); a longer one is not an ncclpy store's: a protocol error, nothing read."""
    msg = b"m" * n

    def script(conn):
        conn.sendall(P.pack_hello(P.FLAG_AUTH, 4096, 1 << 20, os.urandom(32)))
        _read_auth(conn)
        conn.sendall(P.REP_HEADER.pack(Status.ERR_AUTH, n) + msg)

    fake = Scripted(script)
    try:
        with pytest.raises(StoreAuthError if ok else StoreProtocolError) as ei:
            TCPStore("127.0.0.1", fake.port, token=TOKEN, timeout=10, connect_timeout=10)
    finally:
        fake.close()
    if ok:
        assert str(ei.value) == (f"the store at {fake.addr} rejected this client's token: "
                                 f"{msg.decode()}")
    else:
        assert str(ei.value) == f"the store at {fake.addr} sent a {n}-byte auth reply"


@pytest.mark.parametrize("status", [Status.OK, Status.ERR_AUTH, Status.ERR_PROTOCOL,
                                    Status.TIMEOUT])
def test_a_client_without_a_token_is_never_authenticated_by_the_server_saying_ok(status):
    """A server that asks for a token and then answers a client without one: OK (or ERR_AUTH)
    is the client's StoreAuthError naming the missing token; any other status is a protocol
    error naming it. Either way the client sends nothing more."""
    def script(conn):
        conn.sendall(P.pack_hello(P.FLAG_AUTH, 4096, 1 << 20, os.urandom(32)))
        assert _read_auth(conn) == b""        # "I have no token"
        conn.sendall(P.REP_HEADER.pack(status, 5) + b"said.")

    fake = Scripted(script)
    try:
        err = StoreAuthError if status in (Status.OK, Status.ERR_AUTH) else StoreProtocolError
        with pytest.raises(err) as ei:
            TCPStore("127.0.0.1", fake.port, timeout=10, connect_timeout=10)
    finally:
        fake.close()
    if err is StoreAuthError:
        assert str(ei.value) == (f"the store at {fake.addr} requires a token and none was given "
                                 f"(pass token= or set $NCCLPY_STORE_TOKEN): said.")
    else:
        assert str(ei.value) == (f"unexpected auth reply from {fake.addr}: status {status} "
                                 f"b'said.'")
    assert bytes(fake.after) == b""


@pytest.mark.parametrize("status", [Status.ERR_PROTOCOL, Status.TIMEOUT, Status.ERR_REQUEST])
def test_a_token_holder_reports_an_unexpected_auth_status_as_a_protocol_error(status):
    def script(conn):
        conn.sendall(P.pack_hello(P.FLAG_AUTH, 4096, 1 << 20, os.urandom(32)))
        assert len(_read_auth(conn)) == P.AUTH_BODY_SIZE
        conn.sendall(P.REP_HEADER.pack(status, 3) + b"eh?")

    fake = Scripted(script)
    try:
        with pytest.raises(StoreProtocolError) as ei:
            TCPStore("127.0.0.1", fake.port, token=TOKEN, timeout=10, connect_timeout=10)
    finally:
        fake.close()
    assert str(ei.value) == f"unexpected auth reply from {fake.addr}: status {status} b'eh?'"
    assert bytes(fake.after) == b""


def test_a_greeting_of_another_magic_or_version_is_refused():
    for hello, want in [
        (b"XXXX" + P.pack_hello(0, 4096, 1 << 20, bytes(32))[4:], "is not an ncclpy store"),
        (P.HELLO.pack(P.MAGIC, P.VERSION + 1, 0, 0, 4096, 1 << 20) + bytes(32),
         f"speaks protocol version {P.VERSION + 1}; this client speaks {P.VERSION}"),
    ]:
        fake = Scripted(lambda conn, h=hello: conn.sendall(h))
        try:
            with pytest.raises(StoreProtocolError, match=want):
                TCPStore("127.0.0.1", fake.port, timeout=10, connect_timeout=10)
        finally:
            fake.close()


def test_the_greetings_limits_are_what_the_client_then_enforces():
    def script(conn):   # a greeting, then nothing: a client without a token needs no more
        conn.sendall(P.pack_hello(P.FLAG_ARRIVE, 77, 1234, bytes(32), max_keys=9))

    fake = Scripted(script)
    try:
        c = TCPStore("127.0.0.1", fake.port, timeout=10, connect_timeout=10)
        assert (c.max_key_size, c.max_value_size, c.max_keys_per_request) == (77, 1234, 9)
        assert c.server_flags == P.FLAG_ARRIVE
        c.close()
    finally:
        fake.close()


# ---------------------------------------------------------------------------- the greeting's wait
class _Clock:
    """A monotonic clock that stands still until a read is made, then jumps past every
    deadline (so the connect loop gives up at once instead of retrying)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("budget, greet, err", [
    (0.0, 0.05, StoreConnectionError),      # budget spent: still a short chance to greet
    (3.0, 3.0, StoreConnectionError),       # the budget bounds the wait: maybe just slow
    (60.0, 10.0, StoreProtocolError),       # GREETING_TIMEOUT bounds it: not an ncclpy store
])
def test_the_greeting_is_awaited_for_the_budget_left_within_greeting_timeout(
        monkeypatch, budget, greet, err):
    """How long a client waits for a silent peer's greeting: what is left of its connect budget
    (at least 50 ms), at most GREETING_TIMEOUT (10 s); only a peer silent for all of
    GREETING_TIMEOUT is declared not an ncclpy store (a protocol error, no retry)."""
    clock = _Clock()
    seen: List[float] = []

    def spy(self, sock, n, buf, deadline, probe=None):
        seen.append(deadline - clock.now)
        clock.now += 1e6
        raise socket.timeout("timed out")

    monkeypatch.setattr(transport, "time", types.SimpleNamespace(
        monotonic=clock.monotonic, sleep=lambda s: None))
    monkeypatch.setattr(transport.Connection, "_recv_exact", spy)
    lsock = socket.create_server(("127.0.0.1", 0))    # accepts (backlog), never greets
    try:
        with pytest.raises(err) as ei:
            TCPStore("127.0.0.1", lsock.getsockname()[1], timeout=60, connect_timeout=budget)
    finally:
        lsock.close()
    assert seen == [pytest.approx(greet, abs=1e-6)]
    assert "did not send the ncclpy greeting" in str(ei.value)


def test_a_silent_peer_is_named_after_greeting_timeout_without_retrying(monkeypatch):
    monkeypatch.setattr(transport, "GREETING_TIMEOUT", 0.3)
    lsock = socket.create_server(("127.0.0.1", 0))
    held: List[socket.socket] = []
    stop = threading.Event()

    def accept():
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    port = lsock.getsockname()[1]
    try:
        with pytest.raises(StoreProtocolError) as ei:
            TCPStore("127.0.0.1", port, timeout=30, connect_timeout=30)
    finally:
        stop.set()
        t.join(10)
        lsock.close()
        for c in held:
            c.close()
    assert str(ei.value).startswith(
        f"the server at 127.0.0.1:{port} accepted the connection but did not send the ncclpy "
        f"greeting within 0.3 s: it is not an ncclpy store")
    assert len(held) == 1
