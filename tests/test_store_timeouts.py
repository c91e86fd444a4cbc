"""TCP store: timeouts and socket bounds, with real sockets, a real server and a scripted one.

What is pinned is the contract, never a duration expected of a loaded machine: a call times out
with the error that says why (the server's "waiting for key" or the client's "no reply"), never
before its timeout (a lower bound is part of the contract), and a call that must not time out
returns its value.  Upper bounds are :data:`store_util.HANG`, a bound on a hang only; where a
wrong timeout would differ only in length, the error's own "(timeout N s)" names the one used.
"""
from __future__ import annotations

import threading
import time

import pytest

from ncclpy.errors import StoreTimeout
from ncclpy.store import StoreServer, TCPStore, barrier
from ncclpy.store import protocol as P
from ncclpy.store import transport
from store_util import HANG, ScriptedServer as _ScriptedServer

pytestmark = pytest.mark.timeout(120)

#: seconds a timer may fire before its nominal time (a kernel timer's tick); a call that
#: gives up earlier than its bound by more than this gave up early
TICK = 0.05


def _addr(srv: StoreServer) -> str:
    return f"127.0.0.1:{srv.port}"


def test_get_timeout_names_key_address_and_seconds(server, store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as ei:
        store.get("never/there", timeout=0.5)
    waited = time.monotonic() - t0
    assert 0.5 - TICK <= waited < HANG          # never before its timeout
    msg = str(ei.value)
    assert "never/there" in msg and _addr(server) in msg and "0.5" in msg
    assert isinstance(ei.value, TimeoutError)
    store.set("after", b"ok")  # the connection is still in step
    assert store.get("after") == b"ok"


def test_wait_timeout_lists_only_missing_keys(server, store):
    store.set("here", b"")
    with pytest.raises(StoreTimeout) as ei:
        store.wait(["here", "gone1", "gone2"], timeout=0.3)
    msg = str(ei.value)
    assert "gone1" in msg and "gone2" in msg and "'here'" not in msg and _addr(server) in msg


def test_default_timeout_comes_from_the_constructor(server):
    with TCPStore(*server.address, timeout=0.4) as s:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match="missing") as ei:
            s.get("missing")
        assert 0.4 - TICK <= time.monotonic() - t0 < HANG
    # the server's answer, after the constructor's 0.4 s (not some other default)
    assert "waiting for key" in str(ei.value) and "(timeout 0.40 s)" in str(ei.value)


def test_zero_timeout_does_not_wait(store):
    """timeout=0: the server answers at once that the key is missing (its TIMEOUT reply), with
    timeout 0 -- not "no timeout" (the client's socket bound would end it: "no reply") and not
    the store's default 10 s."""
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as ei:
        store.get("nothing", timeout=0)
    assert time.monotonic() - t0 < HANG
    msg = str(ei.value)
    assert "waiting for key" in msg and "(timeout 0.00 s)" in msg, msg


@pytest.fixture(params=["SO_RCVTIMEO", "settimeout"])
def timeout_kind(request, monkeypatch):
    """Run a test with the client's Linux socket bounds and with Python's socket timeout (the
    path taken where SO_RCVTIMEO is not used), both for real."""
    if request.param == "settimeout":
        monkeypatch.setattr(transport, "_OS_TIMEOUTS", False)
    elif not transport._OS_TIMEOUTS:
        pytest.skip("SO_RCVTIMEO bounds are used on Linux only")
    return request.param


def _set_gets_no_reply(script: list, timeout: float) -> None:
    """A set against a server playing ``script`` ends in "no reply" at the client's ``timeout``
    (not before, and not hanging)."""
    fake = _ScriptedServer(script)
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=timeout) as s:
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout, match="no reply"):
                s.set("k", b"v")
            assert timeout - TICK <= time.monotonic() - t0 < HANG
    finally:
        fake.close()


def test_unresponsive_server_times_out_client_side(timeout_kind):
    """A peer that greets but never answers: the socket timeout still bounds the call."""
    _set_gets_no_reply([None], 0.5)


def test_reply_later_than_the_armed_bound_but_within_the_calls_own_is_received(timeout_kind):
    """A call keeps a shorter receive bound already armed (at least ``_KEEP`` s: no system call
    per call); when its first recv times out on it, it waits on for the rest of its own bound.
    So a reply that comes after the armed bound but within the call's own is received; a call
    never answered times out at its own bound, never at the armed one; and an unbounded get
    (timeout=inf) is answered whenever the reply comes."""
    armed = transport._KEEP                    # the client's timeout: what a set arms
    late = 2 * armed                           # after the armed bound, well within 5 s + slack
    fake = _ScriptedServer([(0.0, b"val", 0),      # set
                            (late, b"val", 0),     # get(timeout=5)
                            (0.5, b"val", 0),      # get(timeout=inf)
                            (0.0, b"val", 0),      # set: arms `armed` again
                            None])                 # get: never answered
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=armed) as s:
            s.set("k", b"val")
            assert s._sock_timeout == armed        # the scenario: a shorter bound is armed
            t0 = time.monotonic()
            assert s.get("k", timeout=5) == b"val"     # own bound 6 s: answered at `late`
            assert time.monotonic() - t0 >= late - TICK  # (it was: after the armed bound)
            assert s.get("k", timeout=float("inf")) == b"val"
            s.set("k", b"val")
            assert s._sock_timeout == armed
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout, match="no reply"):
                s.get("k")                         # own bound: armed + 1 s slack
            assert armed + 1.0 - TICK <= time.monotonic() - t0 < HANG
    finally:
        fake.close()


def test_calls_and_their_timeouts_under_either_kind_of_socket_bound(server, timeout_kind):
    with TCPStore(*server.address, timeout=5) as s:
        s.set("a", b"1")
        assert s.get("a") == b"1" and s.add("n", 2) == 2
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match="waiting for key"):
            s.get("missing", timeout=0.3)             # shorter than the armed bound: re-armed
        assert 0.3 - TICK <= time.monotonic() - t0 < HANG
        assert s.get("a", timeout=float("inf")) == b"1"   # unbounded
        s.set("big", b"x" * (1 << 17))                  # large send: its own bound
        assert s.get("big") == b"x" * (1 << 17)         # large reply: read in place
        barrier(s, 0, 1, tag="either")
        assert s.add("n", 1) == 3


def test_trickled_reply_cannot_outlast_the_calls_bound(timeout_kind):
    """A peer sending its reply a byte at a time (each recv returns in time) is still cut off at
    the call's bound: the bound is on the whole reply, not on each recv (which would receive
    the whole reply, 55 bytes at >= 0.05 s each: >= 2.75 s, and succeed)."""
    _set_gets_no_reply([(0.0, b"x" * 50, 0.05)], 2.0)


def test_barrier_round_trip_waits_out_its_own_bound(timeout_kind):
    """The barrier's pipelined round trip (arrive, count out) keeps the shorter armed bound too
    and still receives an answer that comes after it, within its own."""
    armed = transport._KEEP
    late = 2 * armed                           # after the armed bound; arrive's own: 3 s + 1 s
    fake = _ScriptedServer([(0.0, b"", 0), (late, b"2", 0), (0.0, b"1", 0)],
                           flags=P.FLAG_ARRIVE)
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=armed) as s:
            assert s.supports_arrive
            s.set("k", b"")
            assert s._sock_timeout == armed        # the scenario: a shorter bound is armed
            t0 = time.monotonic()
            barrier(s, 1, 2, tag="late", timeout=3.0)
            assert time.monotonic() - t0 >= late - TICK   # (it was: after the armed bound)
    finally:
        fake.close()


def test_set_get_alternation_arms_no_socket_timeout_per_call(server, monkeypatch):
    """Only a longer-than-armed bound costs a setsockopt: connecting arms two (connect's send
    bound, the greeting's receive bound) and the send bound for good; after that the default
    get's bound (timeout + slack), add's and the barrier's round trips arm nothing (beyond the
    probe slice of a long call, once), and a get with a shorter timeout of its own does."""
    calls = []
    real = transport._set_timeout
    monkeypatch.setattr(transport, "_set_timeout",
                        lambda *a, **k: (calls.append(a[1]), real(*a, **k)))
    store = TCPStore(*server.address, timeout=10)
    peer = TCPStore(*server.address, timeout=10)
    assert len(calls) == 6, calls   # 3 per connection
    calls.clear()
    for i in range(10):
        store.set(f"k{i}", b"v")
        assert store.get(f"k{i}") == b"v"
        store.add("n", 1)
        t = threading.Thread(target=barrier, args=(peer, 0, 2), kwargs={"tag": f"b{i}"})
        t.start()
        barrier(store, 1, 2, tag=f"b{i}")   # two clients: the pipelined round trip
        t.join(10)
    # the first get (bound 11 s: long enough to be probed) arms the probe slice once; every
    # later call keeps it
    assert calls in ([], [transport.PROBE_AFTER]), calls
    calls.clear()
    assert store.get("k0", timeout=0.25) == b"v"
    assert calls and calls[0] < store.timeout
    store.close()
    peer.close()
