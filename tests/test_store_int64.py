"""Store counters are signed 64-bit, as torch's TCPStore has them: ``add`` and ``arrive`` refuse a
sum past the range (naming the key, the current value and the increment) and leave the value as
it was; they never wrap and never return a number torch could not hold. Real sockets: the raw
wire protocol (the server's side) and :class:`TCPStore` (the client's side)."""
from __future__ import annotations

import struct

import pytest

from ncclpy.errors import ArgumentError, StoreRequestError
from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Op, Status
from store_util import U32, ScriptedServer, assert_healthy, frame, raw, read_reply

pytestmark = pytest.mark.timeout(60)

MAX = (1 << 63) - 1
MIN = -(1 << 63)
I64 = struct.Struct("!q").pack


@pytest.fixture
def server():
    with StoreServer() as srv:
        yield srv


@pytest.fixture
def store(server):
    with TCPStore(*server.address, timeout=10) as s:
        yield s


# ---------------------------------------------------------------------------- server side
@pytest.mark.parametrize("start,amount", [(MAX, MAX), (MAX, 1), (MIN, -1), (MIN, MIN),
                                          (-5, MIN)])
def test_server_refuses_an_add_past_int64_and_keeps_the_value(server, store, start, amount):
    store.set("c", b"%d" % start)
    s = raw(server)
    try:
        s.sendall(frame(Op.ADD, I64(amount) + b"c"))
        status, body = read_reply(s)
        assert status == Status.ERR_REQUEST, body
        msg = body.decode()
        assert "'c'" in msg or "b'c'" in msg
        assert f"current value {start}" in msg and f"increment {amount}" in msg, msg
        assert "overflow a 64-bit signed integer" in msg and "unchanged" in msg, msg
        s.sendall(frame(Op.ADD, I64(0) + b"c"))          # the connection stays in step
        assert read_reply(s) == (Status.OK, b"%d" % start)
    finally:
        s.close()
    assert store.get("c") == b"%d" % start
    assert_healthy(server, store)


@pytest.mark.parametrize("start,amount", [(MAX - 1, 1), (MIN + 1, -1), (MAX, MIN), (0, MIN)])
def test_server_adds_up_to_the_edges_of_int64(server, store, start, amount):
    store.set("c", b"%d" % start)
    s = raw(server)
    try:
        s.sendall(frame(Op.ADD, I64(amount) + b"c"))
        assert read_reply(s) == (Status.OK, b"%d" % (start + amount))
    finally:
        s.close()


def test_server_refuses_a_stored_value_past_int64(server, store):
    store.set("big", b"%d" % (MAX + 1))
    s = raw(server)
    try:
        s.sendall(frame(Op.ADD, I64(-1) + b"big"))
        status, body = read_reply(s)
        assert status == Status.ERR_REQUEST and b"outside the 64-bit signed range" in body, body
    finally:
        s.close()
    assert store.get("big") == b"%d" % (MAX + 1)


def test_server_arrive_refuses_to_count_past_int64(server, store):
    store.set("gate", b"%d" % MAX)
    s = raw(server)
    try:
        s.sendall(frame(Op.ARRIVE, U32(1000) + U32(1) + b"gate"))
        status, body = read_reply(s)
        assert status == Status.ERR_REQUEST, body
        assert b"arrive" in body and (b"current value %d" % MAX) in body, body
        assert b"increment 1" in body, body
    finally:
        s.close()
    assert store.get("gate") == b"%d" % MAX


# ---------------------------------------------------------------------------- client side
def test_client_add_past_int64_raises_a_precise_request_error(store):
    assert store.add("n", MAX) == MAX
    with pytest.raises(StoreRequestError) as info:
        store.add("n", MAX)                      # was 18446744073709551614
    msg = str(info.value)
    assert "add:" in msg and "'n'" in msg and f"current value {MAX}" in msg, msg
    assert f"increment {MAX}" in msg and "unchanged" in msg, msg
    assert store.get("n") == b"%d" % MAX
    assert store.add("n", -MAX) == 0             # and the client goes on working


def test_client_add_below_int64_is_refused(store):
    assert store.add("m", MIN) == MIN
    with pytest.raises(StoreRequestError, match=f"current value {MIN} \\+ increment -1"):
        store.add("m", -1)
    assert store.add("m", 0) == MIN


def test_client_arrive_past_int64_is_refused(store):
    store.set("g", b"%d" % MAX)
    with pytest.raises(StoreRequestError, match=f"'g'.*current value {MAX} \\+ increment 1"):
        store.arrive("g", 1, timeout=5)
    assert store.get("g") == b"%d" % MAX


def test_client_refuses_an_amount_past_int64_before_sending(store):
    with pytest.raises(ArgumentError, match="64-bit"):
        store.add("n", MAX + 1)
    with pytest.raises(ArgumentError, match="64-bit"):
        store._req_add("n", MIN - 1)
    assert not store.check(["n"])


def test_client_refuses_a_counter_past_int64_from_a_server_without_the_check():
    """An older server that wraps or overflows silently: the client does not hand the caller a
    number no 64-bit counter (torch's included) can hold."""
    fake = ScriptedServer([(0.0, b"18446744073709551614", 0)])
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=5) as s:
            with pytest.raises(StoreRequestError, match="18446744073709551614.*'n'.*64-bit"):
                s.add("n", MAX)
    finally:
        fake.close()


def test_barrier_counters_share_the_check(server, store):
    """``arrive`` is what the store's barrier counts with: one code path on the server."""
    assert P.FLAG_ARRIVE & store.server_flags
    store.set("b", b"%d" % (MAX - 1))
    assert store.arrive("b", 1, timeout=5) == MAX
    with pytest.raises(StoreRequestError, match="overflow"):
        store.arrive("b", 1, timeout=5)
