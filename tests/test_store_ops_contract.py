"""What each store operation does on the server, pinned (the mutation run's target
``store_ops``, docs/testing.md): the limits at their exact edges, the errors that keep a
connection usable, parked requests (who releases them, what they are answered, that a timed-out
or abandoned one leaves nothing behind), and pipelined requests behind a parked one.

Raw sockets speak the wire protocol where the client would check a limit itself or where the
exact reply matters; :class:`TCPStore` elsewhere. Nothing waits for a fixed time: a parked
request is seen parked on the server before the test goes on; every deadline is a bound on a
hang, and a call that must time out has a short timeout and only what it reports is asserted.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import List

import pytest

from ncclpy.errors import StoreRequestError, StoreTimeout
from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store import tablewire as W
from ncclpy.store.protocol import Op, Status
from store_util import U32, frame, raw, read_reply

pytestmark = pytest.mark.timeout(120)

HANG = 30.0      # seconds: only ever a bound on a hang
HANG_MS = int(HANG * 1000)
KEY_MAX, VALUE_MAX = 16, 64


@pytest.fixture
def small():
    """A server with small limits, so the edges are cheap to reach."""
    with StoreServer(max_key_size=KEY_MAX, max_value_size=VALUE_MAX).start() as srv:
        yield srv


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not after {HANG} s"
        time.sleep(0.002)


def _parked_on(server, key: bytes) -> None:
    _until(lambda: key in server._waiters or key in server._gates, f"nothing parked on {key!r}")


def _gone_from_gates(server, key: bytes) -> None:
    """The server drops a counter's gates right after answering the arrivals they held (on
    its own thread): wait for that, bounded, instead of racing it."""
    _until(lambda: key not in server._gates, f"the gates of {key!r} forgotten")


def _cas(key: bytes, expected: bytes, desired: bytes) -> bytes:
    return frame(Op.CAS, P.pack_str32(key) + P.pack_str32(expected) + desired)


def _arrive(key: bytes, group: int, tmo_ms: int) -> bytes:
    return frame(Op.ARRIVE, P.U32X2.pack(tmo_ms, group) + key)


def _replies(s: socket.socket, n: int) -> list:
    """The next ``n`` replies on ``s`` ((status, body) each), however they were split into
    segments (pipelined replies may come in one)."""
    s.settimeout(HANG)
    buf, out = b"", []
    while len(out) < n:
        while len(buf) >= 5 and len(buf) >= 5 + P.REP_HEADER.unpack_from(buf)[1]:
            status, size = P.REP_HEADER.unpack_from(buf)
            out.append((status, buf[5:5 + size]))
            buf = buf[5 + size:]
        if len(out) < n:
            chunk = s.recv(65536)
            assert chunk, f"closed after {len(out)} of {n} replies"
            buf += chunk
    assert not buf and len(out) == n, "more replies than requests"
    return out


def _alive(s: socket.socket) -> None:
    """The connection still serves requests (the error before it kept the stream in step)."""
    s.sendall(frame(Op.PING, b""))
    assert read_reply(s) == (Status.OK, b"")


# ---------------------------------------------------------------------------- limits, at the edge
def test_a_key_of_exactly_max_key_size_is_stored_one_more_byte_is_refused(small):
    s = raw(small)
    with s:
        k = b"k" * KEY_MAX
        s.sendall(frame(Op.SET, P.pack_str32(k) + b"v"))
        assert read_reply(s) == (Status.OK, b"")
        s.sendall(frame(Op.GET, U32(0) + k))
        assert read_reply(s) == (Status.OK, b"v")
        s.sendall(frame(Op.SET, P.pack_str32(k + b"x") + b"v"))
        assert read_reply(s) == (Status.ERR_REQUEST, f"key is {KEY_MAX + 1} bytes; the limit is "
                                 f"max_key_size={KEY_MAX} bytes".encode())
        _alive(s)


def test_a_value_of_exactly_max_value_size_is_stored_one_more_byte_is_refused(small):
    s = raw(small)
    with s:
        v = b"v" * VALUE_MAX
        s.sendall(frame(Op.SET, P.pack_str32(b"k") + v))
        assert read_reply(s) == (Status.OK, b"")
        s.sendall(frame(Op.SET, P.pack_str32(b"k") + v + b"x"))
        assert read_reply(s) == (Status.ERR_REQUEST, f"value is {VALUE_MAX + 1} bytes; the limit "
                                 f"is max_value_size={VALUE_MAX} bytes".encode())
        s.sendall(frame(Op.GET, U32(0) + b"k"))
        assert read_reply(s) == (Status.OK, v)          # the refused SET changed nothing


def test_compare_set_values_of_exactly_max_value_size_pass_and_larger_are_refused(small):
    s = raw(small)
    with s:
        full = b"f" * VALUE_MAX
        s.sendall(_cas(b"c", b"", full))                 # missing key, expected b"": created
        assert read_reply(s) == (Status.OK, full)
        s.sendall(_cas(b"c", full, b"g" * VALUE_MAX))    # expected and desired at the limit
        assert read_reply(s) == (Status.OK, b"g" * VALUE_MAX)
        s.sendall(_cas(b"c", b"g" * VALUE_MAX + b"!", b"x"))
        assert read_reply(s) == (Status.ERR_REQUEST, f"expected value is {VALUE_MAX + 1} bytes; "
                                 f"the limit is max_value_size={VALUE_MAX} bytes".encode())
        s.sendall(_cas(b"c", b"g" * VALUE_MAX, b"h" * (VALUE_MAX + 1)))
        assert read_reply(s) == (Status.ERR_REQUEST, f"desired value is {VALUE_MAX + 1} bytes; "
                                 f"the limit is max_value_size={VALUE_MAX} bytes".encode())
        s.sendall(frame(Op.GET, U32(0) + b"c"))
        assert read_reply(s) == (Status.OK, b"g" * VALUE_MAX)


def test_compare_set_with_an_oversized_key_is_refused_once_and_stores_nothing(small):
    s = raw(small)
    with s:
        k = b"k" * (KEY_MAX + 1)
        s.sendall(_cas(k, b"", b"d"))
        assert read_reply(s) == (Status.ERR_REQUEST, f"key is {KEY_MAX + 1} bytes; the limit is "
                                 f"max_key_size={KEY_MAX} bytes".encode())
        _alive(s)                      # exactly one reply: the next one is the PING's
        s.sendall(frame(Op.NUM_KEYS, b""))
        assert read_reply(s) == (Status.OK, P.U64.pack(0))


@pytest.mark.parametrize("op", [Op.CHECK, Op.WAIT])
def test_an_oversized_key_in_a_key_list_is_refused_naming_its_size(small, op):
    s = raw(small)
    with s:
        keys = P.pack_keys([b"ok", b"k" * (KEY_MAX + 5)])
        s.sendall(frame(op, (U32(0) if op == Op.WAIT else b"") + keys))
        assert read_reply(s) == (Status.ERR_REQUEST, f"key is {KEY_MAX + 5} bytes; the limit is "
                                 f"max_key_size={KEY_MAX} bytes".encode())
        _alive(s)


def test_check_is_true_only_when_every_key_exists(store):
    store.set("a", b"1")
    store.set("b", b"")
    assert store.check(["a"]) and store.check(["a", "b"]) and store.check([])
    assert not store.check(["a", "zz"]) and not store.check(["zz"])


def test_a_counter_that_is_negative_or_long_is_still_a_counter(store):
    store.set("neg", b"-5")
    assert store.add("neg", 1) == -4
    store.set("long", b"%d" % (10 ** 18))       # 19 digits: past the fast path
    assert store.add("long", 1) == 10 ** 18 + 1
    store.set("x", b"twelve")
    with pytest.raises(StoreRequestError, match="not a decimal integer"):
        store.add("x", 1)


# ---------------------------------------------------------------------------- parked requests
def test_a_parked_get_and_wait_are_answered_by_the_write_that_creates_the_key(server, store):
    s = raw(server)
    w = raw(server)
    with s, w:
        s.sendall(frame(Op.GET, U32(HANG_MS) + b"g"))
        w.sendall(frame(Op.WAIT, U32(HANG_MS) + P.pack_keys([b"g"])))
        _until(lambda: len(server._waiters.get(b"g", ())) == 2, "two waiters on g")
        store.add("g", 5)
        assert read_reply(s) == (Status.OK, b"5")
        assert read_reply(w) == (Status.OK, b"")
    assert b"g" not in server._waiters


def test_server_side_timeouts_name_the_missing_keys(server, store):
    """GET, WAIT and ARRIVE time out on the server, which answers TIMEOUT with the keys still
    missing (not the client's socket giving up on a silent server)."""
    s = raw(server)
    with s:
        s.sendall(frame(Op.GET, U32(50) + b"nope"))
        assert read_reply(s, HANG) == (Status.TIMEOUT, P.pack_keys([b"nope"]))
        s.sendall(frame(Op.WAIT, U32(50) + P.pack_keys([b"nope", b"none"])))
        assert read_reply(s, HANG) == (Status.TIMEOUT, P.pack_keys([b"none", b"nope"]))
        s.sendall(_arrive(b"gate", 2, 50))
        assert read_reply(s, HANG) == (Status.TIMEOUT, P.pack_keys([b"gate"]))
        _alive(s)
    with pytest.raises(StoreTimeout, match=r"waiting for key\(s\) 'gate'"):
        store.arrive("gate", 3, timeout=0.05)


def test_a_long_timeout_is_a_deadline_in_the_future(server, store):
    """A parked GET with a timeout is answered by the write, not timed out at once."""
    s = raw(server)
    with s:
        s.sendall(frame(Op.GET, U32(HANG_MS) + b"late"))
        _parked_on(server, b"late")
        store.set("late", b"here")
        assert read_reply(s, HANG) == (Status.OK, b"here")


def test_arrive_with_a_zero_timeout_counts_and_answers_at_once(server, store):
    s = raw(server)
    with s:
        s.sendall(_arrive(b"z", 2, 0))
        assert read_reply(s) == (Status.TIMEOUT, P.pack_keys([b"z"]))
        assert store.get("z") == b"1"                     # the arrival stays counted
        s.sendall(_arrive(b"z", 2, 0))                    # ... and completes the group
        assert read_reply(s) == (Status.OK, b"2")
    assert b"z" not in server._gates


def test_parked_arrivals_are_answered_with_their_own_numbers(server):
    socks = [raw(server) for _ in range(3)]
    try:
        for i, s in enumerate(socks[:2]):
            s.sendall(_arrive(b"a", 3, HANG_MS))
            _until(lambda: sum(len(w) for w in server._gates.get(b"a", {}).values()) == i + 1,
                   f"arrival {i + 1} parked")
        socks[2].sendall(_arrive(b"a", 3, HANG_MS))
        assert sorted(read_reply(s, HANG)[1] for s in socks) == [b"1", b"2", b"3"]
        assert all(read_reply(s, 0.01) == "silent" for s in socks)   # one reply each
    finally:
        for s in socks:
            s.close()
    _gone_from_gates(server, b"a")


def test_reading_a_counter_does_not_lose_the_arrivals_parked_on_it(server, store):
    """An ``add(key, 0)`` (what a timed-out barrier rank does to report the count) while
    arrivals are parked on ``key``: they stay parked, and the arrival completing their group
    releases them."""
    s = raw(server)
    with s:
        s.sendall(_arrive(b"c", 2, HANG_MS))
        _parked_on(server, b"c")
        assert store.add("c", 0) == 1
        assert store.arrive("c", 2, timeout=HANG) == 2
        assert read_reply(s, HANG) == (Status.OK, b"1")
    _gone_from_gates(server, b"c")


@pytest.mark.parametrize("write", ["set", "add", "compare_set"])
def test_any_write_that_moves_a_counter_to_its_target_releases_the_arrivals(server, store,
                                                                             write):
    s = raw(server)
    with s:
        s.sendall(_arrive(b"m", 3, HANG_MS))
        _parked_on(server, b"m")
        {"set": lambda: store.set("m", b"3"), "add": lambda: store.add("m", 2),
         "compare_set": lambda: store.compare_set("m", b"1", b"3")}[write]()
        assert read_reply(s, HANG) == (Status.OK, b"1")
    _gone_from_gates(server, b"m")


def test_a_timed_out_or_abandoned_waiter_leaves_nothing_parked(server, store):
    """Waits that time out, and waiters whose client went away, are forgotten by the server
    (a client looping on short waits for a key that never comes must not grow it)."""
    with pytest.raises(StoreTimeout):
        store.get("never", timeout=0.05)
    with pytest.raises(StoreTimeout):
        store.wait(["never", "nor"], 0.05)
    assert b"never" not in server._waiters and b"nor" not in server._waiters
    s = raw(server)
    s.sendall(frame(Op.WAIT, U32(HANG_MS) + P.pack_keys([b"gone", b"went"])))
    _parked_on(server, b"went")
    s.close()
    _until(lambda: b"gone" not in server._waiters and b"went" not in server._waiters,
           "the closed client's waiter forgotten")
    store.set("gone", b"1")
    store.set("went", b"1")
    store.ping()


def test_a_timed_out_or_abandoned_arrival_leaves_no_gate_and_the_server_serves_on(server,
                                                                                  store):
    with pytest.raises(StoreTimeout):
        store.arrive("t", 2, timeout=0.05)
    assert b"t" not in server._gates
    s = raw(server)
    s.sendall(_arrive(b"t", 4, HANG_MS))                  # arrival 2 of a group of 4
    _parked_on(server, b"t")
    s.close()
    _until(lambda: b"t" not in server._gates, "the closed client's arrival forgotten")
    assert store.get("t") == b"2"                         # both arrivals stay counted
    # arrivals parked on two targets of one counter: the one that leaves takes only its own
    a, b = raw(server), raw(server)
    with b:
        a.sendall(_arrive(b"u", 3, HANG_MS))              # 1 of 3: target 3
        _parked_on(server, b"u")
        b.sendall(_arrive(b"u", 4, HANG_MS))              # 2 of 4: target 4
        _until(lambda: len(server._gates.get(b"u", {})) == 2, "two targets parked on u")
        a.close()
        _until(lambda: list(server._gates.get(b"u", {})) == [4], "a's target forgotten")
        store.add("u", 2)
        assert read_reply(b, HANG) == (Status.OK, b"2")
    assert store.arrive("t", 1, timeout=HANG) == 3
    _until(lambda: not server._gates, "every gate forgotten")


# ---------------------------------------------------------------------------- pipelining
def test_requests_pipelined_behind_a_parked_wait_are_answered_once_it_is_released(server,
                                                                                  store):
    """A client sends a WAIT and more requests behind it in one segment: the server answers
    them, in order, once the WAIT is released, without the client sending anything more."""
    s = raw(server)
    with s:
        s.sendall(frame(Op.WAIT, U32(HANG_MS) + P.pack_keys([b"p"]))
                  + frame(Op.GET, U32(0) + b"p") + frame(Op.ADD, P.I64.pack(3) + b"n")
                  + frame(Op.PING, b""))
        _parked_on(server, b"p")
        store.set("p", b"v")
        assert _replies(s, 4) == [(Status.OK, b""), (Status.OK, b"v"), (Status.OK, b"3"),
                       (Status.OK, b"")]
        s.sendall(_arrive(b"q", 2, HANG_MS) + frame(Op.PING, b""))
        _parked_on(server, b"q")
        store.arrive("q", 2, timeout=HANG)
        assert _replies(s, 2) == [(Status.OK, b"1"), (Status.OK, b"")]


# ---------------------------------------------------------------------------- votes
def test_a_voter_that_disconnects_takes_its_vote_with_it(server):
    """Rank 0 votes and its connection closes while the vote waits: the vote no longer counts
    it, so the vote is not complete when rank 1 votes, and rank 0 may vote again."""
    s = raw(server)
    s.sendall(frame(Op.VOTE, W.pack_vote(b"v", 2, 0, 7, 0, 0, HANG_MS)))
    _until(lambda: b"v" in server._votes, "rank 0's vote held")
    s.close()
    _until(lambda: b"v" not in server._votes, "rank 0's vote dropped with its connection")
    with TCPStore(*server.address, timeout=HANG) as r1:
        r = r1.vote("v", 2, 1, 7, timeout=0)
        assert r.verdict == W.TIMED_OUT and 0 in r.missing, r
    got: List[W.VoteReply] = []
    with TCPStore(*server.address, timeout=HANG) as r0, \
            TCPStore(*server.address, timeout=HANG) as r1:
        t = threading.Thread(target=lambda: got.append(r0.vote("v", 2, 0, 7, timeout=HANG)))
        t.start()
        _until(lambda: b"v" in server._votes, "rank 0's new vote held")
        assert r1.vote("v", 2, 1, 7, timeout=HANG) == W.VoteReply(0, 2, [])
        t.join(HANG)
    assert got == [W.VoteReply(0, 2, [])]


def test_a_parked_client_whose_input_was_paused_is_read_again_once_released(server, store):
    """A client parks a WAIT and keeps sending (well past the 1 MiB the server buffers for a
    parked client before it stops reading it): once the WAIT is released the server reads
    the rest and answers every request, in order."""
    value = b"v" * 60_000
    n = 40                                              # 2.4 MB behind the WAIT
    s = raw(server)
    with s:
        s.sendall(frame(Op.WAIT, U32(HANG_MS) + P.pack_keys([b"go"])))
        _parked_on(server, b"go")
        burst = b"".join(frame(Op.SET, P.pack_str32(b"s%d" % i) + value) for i in range(n))
        sender = threading.Thread(target=s.sendall, args=(burst,))
        sender.start()
        conn = next(c for c in server._conns.values() if c.waiter is not None)
        _until(lambda: len(conn.rbuf) > (1 << 20), "the server buffered over 1 MiB")
        store.set("go", b"")
        assert _replies(s, 1 + n) == [(Status.OK, b"")] * (1 + n)
        sender.join(HANG)
        assert not sender.is_alive()
    assert store.check([f"s{i}" for i in range(n)])
