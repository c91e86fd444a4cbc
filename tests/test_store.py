"""TCP store: every operation, concurrency, auth, torch compatibility.

Real sockets and threads throughout; timeouts and socket bounds are in
``test_store_timeouts.py``, the barrier and ARRIVE in ``test_store_barrier.py``, robustness
against bad input and dying peers in ``test_store_robustness.py``.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import pytest

from ncclpy.errors import (ArgumentError, StoreAuthError, StoreConnectionError,
                           StoreRequestError)
from ncclpy.store import StoreServer, TCPStore, barrier
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Status
from store_util import HANG, ScriptedServer as _ScriptedServer, run_ranks, wait_parked, \
    wait_until

pytestmark = pytest.mark.timeout(120)


def _addr(srv: StoreServer) -> str:
    return f"127.0.0.1:{srv.port}"


# ---------------------------------------------------------------------------- operations
def test_server_binds_loopback_and_ephemeral_port(server):
    assert server.host == "127.0.0.1" and 0 < server.port < 65536
    assert server.address == ("127.0.0.1", server.port) and server.running


def test_set_get_bytes_str_and_binary(store):
    store.set("a", b"x")
    store.set("s", "héllo")
    blob = bytes(range(256)) * 3
    store.set(b"bin\x00key", blob)
    store.set("empty", b"")
    store.set("ba", bytearray(b"ba"))
    assert store.get("a") == b"x"
    assert store.get("s") == "héllo".encode()
    assert store.get(b"bin\x00key") == blob
    assert store.get("empty") == b""
    assert store.get("ba") == b"ba"
    store.set("a", b"y")  # overwrite
    assert store.get("a") == b"y"


def test_large_value_round_trip(store):
    big = os.urandom(1 << 20) * 6
    store.set("big", big)
    assert store.get("big") == big


def test_get_waits_for_a_later_set(server, store):
    """The set comes once the get is parked on the server; the get returns its value, woken by
    the set, long before its own timeout (60 s: a get that was not woken would end there)."""
    def later():
        wait_parked(server, "late")
        with TCPStore(*server.address, timeout=5) as other:
            other.set("late", b"v")

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    assert store.get("late", timeout=2 * HANG) == b"v"
    assert time.monotonic() - t0 < HANG
    t.join(HANG)


def test_add_counts_and_stores_decimal_ascii(store):
    assert store.add("n", 1) == 1
    assert store.add("n", 41) == 42
    assert store.add("n", -50) == -8
    assert store.get("n") == b"-8"
    assert store.add("n", 0) == -8
    store.set("m", b"100")
    assert store.add("m", 5) == 105
    assert store.add("fresh", 0) == 0 and store.get("fresh") == b"0"


def test_add_on_non_integer_value_is_refused_and_connection_survives(store):
    store.set("text", b"abc")
    with pytest.raises(StoreRequestError, match="not a decimal integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"
    with pytest.raises(TypeError):
        store.add("n", 1.5)


def test_add_wakes_a_waiting_get(server, store):
    out = {}

    def waiter():
        with TCPStore(*server.address, timeout=5) as other:
            out["v"] = other.get("counter", timeout=5)

    t = threading.Thread(target=waiter)
    t.start()
    wait_parked(server, "counter")
    store.add("counter", 7)
    t.join(HANG)
    assert out["v"] == b"7"


@pytest.mark.parametrize("initial, expected, desired, result, after", [
    (None, b"", b"new", b"new", b"new"),         # missing and expected "" -> set
    (None, b"x", b"new", b"x", None),            # missing, expected not "": torch returns it
    (b"cur", b"cur", b"next", b"next", b"next"),  # match -> set
    (b"cur", b"nope", b"next", b"cur", b"cur"),   # mismatch -> current value
    (b"", b"", b"filled", b"filled", b"filled"),  # empty value matches ""
])
def test_compare_set_follows_torch(store, initial, expected, desired, result, after):
    if initial is not None:
        store.set("k", initial)
    assert store.compare_set("k", expected, desired) == result
    if after is None:
        assert not store.check(["k"])
    else:
        assert store.get("k") == after


def test_compare_set_wakes_waiters(server, store):
    out = {}

    def waiter():
        with TCPStore(*server.address, timeout=5) as other:
            out["v"] = other.get("cas", timeout=5)

    t = threading.Thread(target=waiter)
    t.start()
    wait_parked(server, "cas")
    store.compare_set("cas", "", "won")
    t.join(HANG)
    assert out["v"] == b"won"


def test_delete_and_alias(store):
    store.set("d", b"1")
    assert store.delete("d") is True
    assert store.delete("d") is False
    store.set("d", b"2")
    assert store.delete_key("d") is True
    assert not store.check("d")


def test_num_keys_and_check(store):
    assert store.num_keys() == 0
    store.set("a", b"1")
    store.add("b", 1)
    assert store.num_keys() == 2
    assert store.check(["a", "b"]) and store.check("a")
    assert not store.check(["a", "zz"])
    assert store.check([])
    store.delete("a")
    assert store.num_keys() == 1


# a wait on several keys: tests/test_store_contract.py


# ---------------------------------------------------------------------------- limits and args
def test_key_and_value_limits_are_reported_with_sizes():
    with StoreServer(max_key_size=16, max_value_size=1000).start() as srv, \
            TCPStore(*srv.address, timeout=5) as s:
        with pytest.raises(StoreRequestError) as ei:
            s.set("k" * 17, b"v")
        assert "17 bytes" in str(ei.value) and "max_key_size=16" in str(ei.value)
        with pytest.raises(StoreRequestError) as ei:
            s.set("k", b"v" * 1001)
        assert "1001 bytes" in str(ei.value) and "max_value_size=1000" in str(ei.value)
        s.set("k" * 16, b"v" * 1000)  # exactly at the limits
        assert s.get("k" * 16) == b"v" * 1000


def test_bad_arguments():
    with pytest.raises(ArgumentError):
        StoreServer(port=70000)
    with pytest.raises(ArgumentError):
        TCPStore("127.0.0.1", 0)  # port 0 needs is_server
    with pytest.raises(ArgumentError):
        TCPStore("127.0.0.1", 1, timeout=-1)


# ---------------------------------------------------------------------------- client objects
def test_is_server_starts_a_server_in_process():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5) as rank0:
        assert rank0.port > 0 and rank0.server is not None and rank0.server.running
        with TCPStore("127.0.0.1", rank0.port, timeout=5) as rank1:
            rank0.set("uid", b"u" * 128)
            assert rank1.get("uid") == b"u" * 128
        srv = rank0.server
    assert not srv.running  # closing rank 0's client closes its server


def test_closed_client_raises(server):
    s = TCPStore(*server.address, timeout=5)
    s.close()
    with pytest.raises(StoreConnectionError, match="closed"):
        s.get("x")
    s.close()  # idempotent


def test_one_client_shared_by_threads(store):
    def work():
        for _ in range(200):
            store.add("shared", 1)
            store.set("t", b"x")
            assert store.get("t") == b"x"

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("shared") == b"1600"


def test_512_concurrent_clients():
    n = 512
    with StoreServer().start() as srv:
        gate = threading.Barrier(n)
        peak = []

        def rank_fn(rank: int) -> None:
            with TCPStore(*srv.address, timeout=60) as s:
                gate.wait(60)
                peak.append(srv.num_clients)
                s.set(f"val/{rank}", str(rank))
                nxt = (rank + 1) % n
                assert s.get(f"val/{nxt}", timeout=60) == str(nxt).encode()
                s.add("count", 1)
                barrier(s, rank, n, tag="c512", timeout=60)
                assert s.get("count") == str(n).encode()

        run_ranks(n, rank_fn, join=90)
        assert max(peak) == n  # all 512 connections were open at once
        assert srv.running


# ---------------------------------------------------------------------------- auth
def test_auth_accepted(caplog):
    with StoreServer(token="s3cret").start() as srv:
        with TCPStore(*srv.address, token="s3cret", timeout=5) as s:
            s.set("a", b"1")
            assert s.get("a") == b"1"


def test_auth_wrong_token_rejected_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer(token="right").start() as srv:
        with pytest.raises(StoreAuthError) as ei:
            TCPStore(*srv.address, token="wrong", timeout=5)
        assert "token" in str(ei.value) and _addr(srv) in str(ei.value)
        wait_until(lambda: "wrong token" in caplog.text, "the server's log line")
        with TCPStore(*srv.address, token="right", timeout=5) as s:
            s.ping()  # the server is fine


def test_auth_missing_token_rejected_and_logged(caplog, monkeypatch):
    monkeypatch.delenv("NCCLPY_STORE_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer(token="right").start() as srv:
        with pytest.raises(StoreAuthError, match="NCCLPY_STORE_TOKEN"):
            TCPStore(*srv.address, timeout=5)
        wait_until(lambda: "no token" in caplog.text, "the server's log line")


def test_client_token_against_tokenless_server_fails_clearly(monkeypatch):
    monkeypatch.delenv("NCCLPY_STORE_TOKEN", raising=False)
    with StoreServer().start() as srv:
        with pytest.raises(StoreAuthError, match="without one"):
            TCPStore(*srv.address, token="t", timeout=5)


def test_token_from_environment(monkeypatch):
    monkeypatch.setenv("NCCLPY_STORE_TOKEN", "from-env")
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5) as rank0:
        with TCPStore("127.0.0.1", rank0.port, timeout=5) as rank1:
            rank0.set("k", b"v")
            assert rank1.get("k") == b"v"
        with pytest.raises(StoreAuthError):
            TCPStore("127.0.0.1", rank0.port, token="other", timeout=5)


def test_token_never_crosses_the_wire():
    """A fake server asking for auth records what the client sends: proof, not token."""
    token = "very-secret-token-value"
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    got = bytearray()
    nonce = os.urandom(32)

    def fake():
        conn, _ = lsock.accept()
        with conn:
            conn.sendall(P.pack_hello(P.FLAG_AUTH, 4096, 1 << 20, nonce))
            conn.settimeout(5)
            while len(got) < P.HEADER_SIZE + P.AUTH_BODY_SIZE:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                got.extend(chunk)
            conn.sendall(P.REP_HEADER.pack(P.Status.ERR_AUTH, 4) + b"nope")

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    try:
        with pytest.raises(StoreAuthError):
            TCPStore("127.0.0.1", port, token=token, timeout=5)
    finally:
        t.join(5)
        lsock.close()
    assert token.encode() not in got
    assert got[0] == P.Op.AUTH
    assert got[5:37] == P.client_mac(token.encode(), nonce)


@pytest.mark.parametrize("token", [None, "some-token"])
def test_auth_reply_in_the_same_segment_as_the_greeting_is_read(token, monkeypatch):
    """A server may send its auth reply right behind the greeting, in one send(): the client
    parses those bytes instead of dropping them and waiting out its connect timeout (which
    ends in a timeout, not in the server's words)."""
    monkeypatch.delenv("NCCLPY_STORE_TOKEN", raising=False)
    msg = b"this store requires a token" if token is None else b"wrong token"
    fake = _ScriptedServer([None], flags=P.FLAG_AUTH,
                           extra=P.REP_HEADER.pack(Status.ERR_AUTH, len(msg)) + msg)
    try:
        with pytest.raises(StoreAuthError, match=msg.decode()):
            TCPStore("127.0.0.1", fake.port, token=token, timeout=10, connect_timeout=10)
        assert fake.accepted == 1
    finally:
        fake.close()


# ---------------------------------------------------------------------------- torch
def _torch_pair():
    dist = pytest.importorskip("torch.distributed")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    return dist, master


# the barrier over torch's stores: tests/test_store_contract.py


def test_same_answers_as_torch_store(server, store):
    _, torch_store = _torch_pair()
    script = [
        ("set", ("a", b"1")), ("get", ("a",)), ("add", ("n", 5)), ("add", ("n", -2)),
        ("get", ("n",)), ("compare_set", ("c", b"x", b"y")), ("compare_set", ("c", b"", b"y")),
        ("compare_set", ("c", b"y", b"z")), ("compare_set", ("c", b"q", b"w")),
        ("check", (["a", "n"],)), ("check", (["a", "zz"],)), ("num_keys", ()),
        ("delete_key", ("a",)), ("delete_key", ("a",)), ("num_keys", ()),
        ("add", ("fresh", 0)), ("get", ("fresh",)),
    ]
    for name, args in script:
        ours = getattr(store, name)(*args)
        theirs = getattr(torch_store, name)(*args)
        assert ours == theirs, (name, args, ours, theirs)
