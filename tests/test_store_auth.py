"""The store's authentication handshake, both ways (issue 40; the wire is in
ncclpy/store/protocol.py): the server challenges every connection with a fresh nonce and the
client proves the token with HMAC(token, nonce); the client challenges back with its own nonce
and refuses a server that cannot prove the token in return.

On one side a real server and a raw socket that speaks the handshake by hand (so a proof from
one connection can be replayed on another); on the other a real client and an impostor server
on loopback that greets like ncclpy's and answers the client's proof without a valid one of its
own.  The simpler cases (right token, wrong token, no token, the token never on the wire) are in
test_store.py.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import List, Optional, Tuple

import pytest

from ncclpy.errors import StoreAuthError
from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Op, Status
from store_util import frame, is_closed, read_reply, recv_exact

pytestmark = pytest.mark.timeout(60)

TOKEN = b"the-shared-token"


def _greeted(srv: StoreServer) -> Tuple[socket.socket, bytes]:
    """A raw connection to ``srv`` and the nonce its greeting challenges it with."""
    s = socket.create_connection(srv.address, timeout=10)
    magic, _v, flags, _k, _v2, nonce = P.parse_hello(recv_exact(s, P.HELLO_SIZE))
    assert magic == P.MAGIC and flags & P.FLAG_AUTH
    return s, nonce


@pytest.fixture
def authed_server():
    with StoreServer(token=TOKEN).start() as srv:
        yield srv


# ---------------------------------------------------------------------------- the server side
def test_every_connection_gets_a_fresh_challenge(authed_server):
    socks, nonces = [], []
    try:
        for _ in range(4):
            s, nonce = _greeted(authed_server)
            socks.append(s)
            nonces.append(nonce)
    finally:
        for s in socks:
            s.close()
    assert all(len(n) == P.NONCE_SIZE for n in nonces)
    assert len(set(nonces)) == 4, "two connections were given the same challenge"
    assert b"\0" * P.NONCE_SIZE not in nonces


def test_a_proof_replayed_on_another_connection_is_refused(authed_server):
    """Connection 1 authenticates; its proof, sent again on connection 2 (someone who saw the
    first handshake), answers a different challenge: refused, and connection 2 is closed
    without serving a request."""
    s1, n1 = _greeted(authed_server)
    s2, n2 = _greeted(authed_server)
    try:
        proof = P.client_mac(TOKEN, n1) + os.urandom(P.NONCE_SIZE)
        s1.sendall(frame(Op.AUTH, proof))
        status, _ = read_reply(s1)
        assert status == Status.OK                       # the genuine handshake works
        s2.sendall(frame(Op.AUTH, proof) + frame(Op.SET, P.pack_str32(b"replayed") + b"x"))
        status, body = read_reply(s2)
        assert status == Status.ERR_AUTH and b"wrong token" in body
        assert is_closed(s2)
        # connection 1 is authenticated and serves requests; the replayed SET never ran
        s1.sendall(frame(Op.CHECK, P.pack_keys([b"replayed"])))
        assert read_reply(s1) == (Status.OK, b"\x00")
    finally:
        s1.close()
        s2.close()


# ---------------------------------------------------------------------------- the client side
class Impostor:
    """A loopback server that greets like ncclpy's (``flags``), reads the client's AUTH and
    answers ``status`` with ``answer(auth_body)``; records every byte the client sends after
    that (a client that refused it sends none, and closes)."""

    def __init__(self, flags: int, answer, status: int = Status.OK) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.accepted = 0
        self.auth: Optional[bytes] = None
        self.after = bytearray()
        self.closed_by_client = threading.Event()
        self._t = threading.Thread(target=self._serve, args=(flags, answer, status), daemon=True)
        self._t.start()

    def _serve(self, flags: int, answer, status: int) -> None:
        conn, _ = self.lsock.accept()
        self.accepted += 1
        with conn:
            conn.settimeout(20)
            conn.sendall(P.pack_hello(flags, 4096, 1 << 20, os.urandom(P.NONCE_SIZE)))
            op, n = P.REQ_HEADER.unpack(recv_exact(conn, P.HEADER_SIZE))
            assert op == Op.AUTH, op
            self.auth = recv_exact(conn, n)
            reply = answer(self.auth)
            conn.sendall(P.REP_HEADER.pack(status, len(reply)) + reply)
            try:
                while True:
                    chunk = conn.recv(4096)
                    if not chunk:
                        self.closed_by_client.set()
                        return
                    self.after.extend(chunk)
            except OSError:
                self.closed_by_client.set()

    def close(self) -> None:
        self.lsock.close()
        self._t.join(20)


def _recorded_server_proof() -> bytes:
    """The proof a server holding the token gave a real client in an earlier, genuine
    handshake (as an eavesdropper would record it)."""
    sent: List[bytes] = []

    def prove(auth: bytes) -> bytes:
        sent.append(P.server_mac(TOKEN, auth[32:]))
        return sent[-1]

    imp = Impostor(P.FLAG_AUTH, prove)
    try:
        TCPStore("127.0.0.1", imp.port, token=TOKEN, timeout=20, connect_timeout=20).close()
    finally:
        imp.close()
    assert len(sent) == 1
    return sent[0]


ANSWERS = {
    "no proof": lambda auth: b"",
    "random bytes": lambda auth: os.urandom(32),
    "the client's own proof reflected": lambda auth: auth[:32],
    "the client's nonce": lambda auth: auth[32:],
    "the proof a real client accepted on an earlier connection": None,   # recorded below
}


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("flags", [P.FLAG_AUTH, 0], ids=["asks-for-a-token", "says-no-token"])
def test_the_client_refuses_a_server_that_cannot_prove_the_token(answer, flags):
    """The impostor accepts whatever proof the client sends and answers OK, but what it sends
    back is not HMAC(token, "ncclpy-store-server" + the client's nonce).  Greeting as a server
    without a token changes nothing: a client holding one still demands the proof.  The client
    fails with StoreAuthError naming the store, and sends nothing more."""
    fn = ANSWERS[answer]
    if fn is None:
        recorded = _recorded_server_proof()
        fn = lambda auth: recorded   # noqa: E731
    imp = Impostor(flags, fn)
    try:
        with pytest.raises(StoreAuthError) as ei:
            TCPStore("127.0.0.1", imp.port, token=TOKEN, timeout=20, connect_timeout=20)
        assert str(ei.value) == (f"the store at 127.0.0.1:{imp.port} could not prove it holds "
                                 f"the same token; refusing to use it")
        assert imp.closed_by_client.wait(20), "the client kept the connection open"
    finally:
        imp.close()
    assert imp.accepted == 1
    assert imp.auth is not None and len(imp.auth) == P.AUTH_BODY_SIZE
    assert bytes(imp.after) == b"", "the client sent requests to an unproven server"


def test_the_client_accepts_the_proof_made_for_its_own_challenge():
    """The control: an impostor that does hold the token and answers the client's challenge
    correctly is accepted (so the refusals above are about the proof, not the impostor)."""
    got: List[bytes] = []

    def prove(auth: bytes) -> bytes:
        got.append(auth)
        return P.server_mac(TOKEN, auth[32:])

    imp = Impostor(P.FLAG_AUTH, prove)
    try:
        c = TCPStore("127.0.0.1", imp.port, token=TOKEN, timeout=20, connect_timeout=20)
        c.close()
        assert imp.closed_by_client.wait(20)
    finally:
        imp.close()
    assert len(got) == 1
