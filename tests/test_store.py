"""TCP store: every operation, concurrency, timeouts, auth, barrier, torch compatibility.

Real sockets and threads throughout; robustness against bad input and dying peers is in
``test_store_robustness.py``.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import threading
import time

import pytest

from ncclpy.errors import (ArgumentError, ArgumentTypeError, StoreAuthError,
                           StoreConnectionError, StoreRequestError, StoreTimeout)
from ncclpy.store import StoreServer, TCPStore, barrier
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Op, Status
from store_util import ScriptedServer as _ScriptedServer, run_ranks

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
    def later():
        time.sleep(0.3)
        with TCPStore(*server.address, timeout=5) as other:
            other.set("late", b"v")

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    assert store.get("late", timeout=10) == b"v"
    assert 0.2 < time.monotonic() - t0 < 5
    t.join()


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
    time.sleep(0.2)
    store.add("counter", 7)
    t.join(5)
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
    time.sleep(0.2)
    store.compare_set("cas", "", "won")
    t.join(5)
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


# ---------------------------------------------------------------------------- timeouts
def test_get_timeout_names_key_address_and_seconds(server, store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as ei:
        store.get("never/there", timeout=0.5)
    waited = time.monotonic() - t0
    assert 0.45 <= waited < 2.0
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
        with pytest.raises(StoreTimeout, match="missing"):
            s.get("missing")
        assert time.monotonic() - t0 < 2.0


def test_zero_timeout_does_not_wait(store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.get("nothing", timeout=0)
    assert time.monotonic() - t0 < 1.0


@pytest.fixture(params=["SO_RCVTIMEO", "settimeout"])
def timeout_kind(request, monkeypatch):
    """Run a test with the client's Linux socket bounds and with Python's socket timeout (the
    path taken where SO_RCVTIMEO is not used), both for real."""
    from ncclpy.store import transport
    if request.param == "settimeout":
        monkeypatch.setattr(transport, "_OS_TIMEOUTS", False)
    elif not transport._OS_TIMEOUTS:
        pytest.skip("SO_RCVTIMEO bounds are used on Linux only")
    return request.param


def test_unresponsive_server_times_out_client_side(timeout_kind):
    """A peer that greets but never answers: the socket timeout still bounds the call."""
    fake = _ScriptedServer([None])
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=0.5) as s:
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout, match="no reply"):
                s.set("k", b"v")
            assert time.monotonic() - t0 < 3.0
    finally:
        fake.close()


def test_reply_later_than_the_armed_bound_but_within_the_calls_own_is_received(timeout_kind):
    """A get's bound is its wait plus slack, longer than the store timeout a set arms; the client
    keeps the shorter bound armed (no system call) and, when its first recv times out on it,
    waits on for the rest of the call's own bound: within it the call succeeds, past it the call
    times out, and an unbounded get (timeout=inf) waits as long as it takes."""
    fake = _ScriptedServer([(0.0, b"val", 0), (1.0, b"val", 0), (1.2, b"val", 0), None])
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=0.5) as s:
            s.set("k", b"val")                       # bound 0.5 s
            t0 = time.monotonic()
            assert s.get("k") == b"val"              # bound 1.5 s, answered after 1.0 s
            assert 0.9 < time.monotonic() - t0 < 1.5
            t0 = time.monotonic()
            assert s.get("k", timeout=float("inf")) == b"val"   # unbounded, answered at 1.2 s
            assert 1.1 < time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout, match="no reply"):
                s.get("k")                           # never answered: 1.5 s
            assert 1.4 < time.monotonic() - t0 < 3.0
    finally:
        fake.close()


def test_calls_and_their_timeouts_under_either_kind_of_socket_bound(server, timeout_kind):
    with TCPStore(*server.address, timeout=5) as s:
        s.set("a", b"1")
        assert s.get("a") == b"1" and s.add("n", 2) == 2
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match="waiting for key"):
            s.get("missing", timeout=0.3)             # shorter than the armed bound: re-armed
        assert 0.25 < time.monotonic() - t0 < 2.0
        assert s.get("a", timeout=float("inf")) == b"1"   # unbounded
        s.set("big", b"x" * (1 << 17))                  # large send: its own bound
        assert s.get("big") == b"x" * (1 << 17)         # large reply: read in place
        barrier(s, 0, 1, tag="either")
        assert s.add("n", 1) == 3


def test_trickled_reply_cannot_outlast_the_calls_bound(timeout_kind):
    """A peer sending its reply a byte at a time (each recv returns in time) is still cut off at
    the call's bound: the bound is on the whole reply, not on each recv."""
    fake = _ScriptedServer([(0.0, b"x" * 50, 0.05)])
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=2.0) as s:
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout, match="no reply"):
                s.set("k", b"v")                     # 55 bytes at 0.05 s: 2.75 s
            assert 1.9 < time.monotonic() - t0 < 2.6
    finally:
        fake.close()


def test_barrier_round_trip_waits_out_its_own_bound(timeout_kind):
    """The barrier's pipelined round trip (arrive, count out) keeps the shorter armed bound too
    and still receives an answer that comes after it, within its own."""
    fake = _ScriptedServer([(1.0, b"2", 0), (0.0, b"1", 0)], flags=P.FLAG_ARRIVE)
    try:
        with TCPStore("127.0.0.1", fake.port, timeout=0.5) as s:
            assert s.supports_arrive
            t0 = time.monotonic()
            barrier(s, 1, 2, tag="late")             # arrive's bound: 0.5 s + 1 s slack
            assert 0.9 < time.monotonic() - t0 < 1.5
    finally:
        fake.close()


def test_set_get_alternation_arms_no_socket_timeout_per_call(server, monkeypatch):
    """Only a longer-than-armed bound costs a setsockopt: connecting arms two (connect's send
    bound, the greeting's receive bound) and the send bound for good; after that the default
    get's bound (timeout + slack), add's and the barrier's round trips arm nothing (beyond the
    probe slice of a long call, once), and a get with a shorter timeout of its own does."""
    from ncclpy.store import transport
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


# ---------------------------------------------------------------------------- barrier
def test_barrier_is_reusable_with_the_same_tag(server):
    world, rounds = 6, 5
    arrived = [0] * rounds
    lock = threading.Lock()

    def rank_fn(rank: int) -> None:
        with TCPStore(*server.address, timeout=20) as s:
            for r in range(rounds):
                with lock:
                    arrived[r] += 1
                if rank == r % world:
                    time.sleep(0.05)  # a different straggler every round
                barrier(s, rank, world, timeout=20)
                with lock:
                    assert arrived[r] == world, (r, arrived[r])

    run_ranks(world, rank_fn)
    with TCPStore(*server.address, timeout=5) as s:  # old generations are cleaned up
        assert s.num_keys() <= 3


_HOST_CHILD = """
import sys, time
from ncclpy.store import TCPStore, barrier


class KeysView:  # duck-typed: takes barrier's key-based path, still hosting the server
    def __init__(self, store):
        self.store, self.server = store, store.server

    def __getattr__(self, name):
        return getattr(self.store, name)


store = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
print(store.port, flush=True)
barrier(KeysView(store) if sys.argv[2] == "keys" else store, 0, int(sys.argv[1]), timeout=30)
print("left", flush=True)            # and exit at once, without close()
"""


def _start_host(world: int, path: str):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    host = subprocess.Popen([sys.executable, "-c", _HOST_CHILD, str(world), path], env=env,
                            stdout=subprocess.PIPE, text=True)
    return host, int(host.stdout.readline())


class _SlowReader:
    """A duck-typed store whose ``wait`` starts late: a rank slow to look at the barrier."""

    def __init__(self, store, delay):
        self.store, self.delay = store, delay

    def add(self, key, amount):
        return self.store.add(key, amount)

    def set(self, key, value):
        self.store.set(key, value)

    def delete_key(self, key):
        return self.store.delete_key(key)

    def wait(self, keys, timeout=None):
        time.sleep(self.delay)
        self.store.wait(keys, timeout)


def test_hosting_rank_may_exit_right_after_barrier_key_path():
    """Key-based barrier (any duck-typed store): the rank whose process hosts the server leaves
    only once every rank read the barrier, so it can exit straight after it without cutting
    slower ranks off."""
    world = 4
    host, port = _start_host(world, "keys")
    try:
        clients = [TCPStore("127.0.0.1", port, timeout=30) for _ in range(world - 1)]
        errors = []

        def rank_fn(rank, s):
            try:
                barrier(_SlowReader(s, 0.3 * rank), rank, world, timeout=30)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=rank_fn, args=(r + 1, c))
                   for r, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert host.wait(30) == 0
        assert host.stdout.readline().strip() == "left"
        assert not errors, errors
        for c in clients:
            c.close()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_hosting_rank_may_exit_right_after_barrier_server_path():
    """Server-held barrier: ranks send [arrive, count out] as one pipelined burst and read
    their answers only after the hosting process has exited: every answer is there."""
    world = 3
    host, port = _start_host(world, "server")
    count, out = b"ncclpy/barrier/barrier/count", b"ncclpy/barrier/barrier/out"
    socks = []
    try:
        for _ in range(world - 1):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            hello = b""
            while len(hello) < P.HELLO_SIZE:
                hello += s.recv(P.HELLO_SIZE - len(hello))
            assert P.parse_hello(hello)[2] & P.FLAG_ARRIVE
            s.sendall(P.request(Op.ARRIVE, P.U32X2.pack(30_000, world) + count)
                      + P.request(Op.ADD, P.I64.pack(1) + out))
            socks.append(s)
        assert host.wait(30) == 0              # the host passed the barrier and exited ...
        assert host.stdout.readline().strip() == "left"
        arrivals, outs = [], []
        for s in socks:                        # ... before anyone read an answer
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            replies = []
            while data:
                status, n = P.REP_HEADER.unpack_from(data, 0)
                replies.append((status, data[5:5 + n]))
                data = data[5 + n:]
            assert [st for st, _ in replies] == [Status.OK, Status.OK], replies
            arrivals.append(int(replies[0][1]))
            outs.append(int(replies[1][1]))
        assert set(arrivals) < {1, 2, 3} and len(set(arrivals)) == world - 1
        assert sorted(outs) == [1, 2]
    finally:
        for s in socks:
            s.close()
        if host.poll() is None:
            host.kill()
            host.wait()


def test_barrier_timeout_says_how_many_arrived(server, store):
    with pytest.raises(StoreTimeout) as ei:
        barrier(store, 0, 3, tag="lonely", timeout=0.3)
    assert "1 of 3" in str(ei.value) and "lonely" in str(ei.value)


def test_barrier_argument_checks(store):
    with pytest.raises(ArgumentError):
        barrier(store, 3, 3)
    with pytest.raises(ArgumentError):
        barrier(store, 0, 0)


# ---------------------------------------------------------------------------- arrive
def _arrive_all(server, key, group, n, timeout=10):
    """``n`` clients arrive on ``key`` at once; their answers (arrival numbers)."""
    got = []
    lock = threading.Lock()

    def fn(rank: int) -> None:
        with TCPStore(*server.address, timeout=20) as s:
            v = s.arrive(key, group, timeout)
            with lock:
                got.append(v)

    run_ranks(n, fn, join=30)
    return sorted(got)


def test_arrive_answers_each_group_when_complete(server, store):
    assert store.supports_arrive
    assert _arrive_all(server, "g", 4, 4) == [1, 2, 3, 4]
    assert _arrive_all(server, "g", 4, 8) == list(range(5, 13))   # two more generations
    assert store.get("g") == b"12"
    assert store.arrive("solo", 1) == 1 and store.arrive("solo", 1) == 2


def test_arrive_waits_for_the_rest_of_its_group(server, store):
    done = []
    t = threading.Thread(target=lambda: done.append(store.arrive("late", 3, 10)))
    t.start()
    time.sleep(0.3)
    assert not done                        # 1 of 3: parked
    with TCPStore(*server.address, timeout=10) as other:
        assert other.add("late", 1) == 2   # any counter write counts (still 2 of 3)
        time.sleep(0.2)
        assert not done
        assert other.arrive("late", 3) == 3
    t.join(10)
    assert done == [1]
    deadline = time.monotonic() + 5            # the server tidies up just after replying
    while server._gates and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server._gates                   # nothing left parked


def test_arrive_timeout_names_the_key_and_keeps_the_arrival(store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as ei:
        store.arrive("lonely/count", 2, timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert "arrive (group of 2)" in msg and "lonely/count" in msg and _addr_of(store) in msg
    assert store.add("lonely/count", 0) == 1   # counted, as documented
    store.ping()                               # the connection is still in step


def _addr_of(store: TCPStore) -> str:
    return f"{store.host}:{store.port}"


@pytest.mark.parametrize("group, err, text", [
    (0, ArgumentError, "group: expected 1 .. 2**32-1 arrivals, got 0"),
    (-3, ArgumentError, "got -3"),
    (1 << 32, ArgumentError, f"got {1 << 32}"),
    (2.0, ArgumentTypeError, "group: expected int, got float"),
    (True, ArgumentTypeError, "group: expected int, got bool"),
])
def test_arrive_argument_errors(store, group, err, text):
    with pytest.raises(err, match=re.escape(text)):
        store.arrive("k", group)
    assert not store.check(["k"])              # nothing was sent


def test_arrive_on_a_non_counter_is_refused(store):
    store.set("txt", b"hello")
    with pytest.raises(StoreRequestError, match="not a decimal integer"):
        store.arrive("txt", 2)
    assert store.get("txt") == b"hello"


def test_parked_arrive_of_a_vanished_client_is_dropped(server, store):
    c = TCPStore(*server.address, timeout=10)
    t = threading.Thread(target=lambda: pytest.raises(Exception, c.arrive, "gone", 2, 30))
    t.start()
    deadline = time.monotonic() + 5
    while not server._gates and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server._gates                       # parked
    c.close()
    t.join(10)
    deadline = time.monotonic() + 5
    while server._gates and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server._gates                   # unlinked when its connection closed
    assert store.arrive("gone", 2, 5) == 2     # the counted arrival stays; group completes


def test_arrive_needs_a_server_that_serves_it(store):
    store.server_flags &= ~P.FLAG_ARRIVE       # as greeted by an older ncclpy server
    assert not store.supports_arrive
    with pytest.raises(StoreRequestError, match="does not serve arrive"):
        store.arrive("k", 2)


def test_barrier_without_arrive_falls_back_to_keys(server):
    """Against a server that does not serve ARRIVE the barrier is built from keys."""
    world = 3

    def fn(rank: int) -> None:
        with TCPStore(*server.address, timeout=20) as s:
            s.server_flags &= ~P.FLAG_ARRIVE
            for _ in range(3):
                barrier(s, rank, world, tag="old", timeout=20)

    run_ranks(world, fn)
    with TCPStore(*server.address, timeout=5) as s:
        assert s.get("ncclpy/barrier/old/arrived") == b"9"
        assert not s.check(["ncclpy/barrier/old/count"])


def test_barrier_on_ncclpy_store_is_held_by_the_server(server):
    """Two counters per tag, whatever the number of generations; no per-generation keys."""
    world, rounds = 4, 6

    def fn(rank: int) -> None:
        with TCPStore(*server.address, timeout=20) as s:
            for _ in range(rounds):
                barrier(s, rank, world, tag="held", timeout=20)

    run_ranks(world, fn)
    with TCPStore(*server.address, timeout=5) as s:
        assert s.num_keys() == 2
        assert s.get("ncclpy/barrier/held/count") == str(world * rounds).encode()
        assert s.get("ncclpy/barrier/held/out") == str(world * rounds).encode()


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
        deadline = time.monotonic() + 2
        while "wrong token" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "wrong token" in caplog.text
        with TCPStore(*srv.address, token="right", timeout=5) as s:
            s.ping()  # the server is fine


def test_auth_missing_token_rejected_and_logged(caplog, monkeypatch):
    monkeypatch.delenv("NCCLPY_STORE_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer(token="right").start() as srv:
        with pytest.raises(StoreAuthError, match="NCCLPY_STORE_TOKEN"):
            TCPStore(*srv.address, timeout=5)
        deadline = time.monotonic() + 2
        while "no token" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "no token" in caplog.text


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
    parses those bytes instead of dropping them and waiting out its connect timeout."""
    monkeypatch.delenv("NCCLPY_STORE_TOKEN", raising=False)
    msg = b"this store requires a token" if token is None else b"wrong token"
    fake = _ScriptedServer([None], flags=P.FLAG_AUTH,
                           extra=P.REP_HEADER.pack(Status.ERR_AUTH, len(msg)) + msg)
    try:
        start = time.monotonic()
        with pytest.raises(StoreAuthError, match=msg.decode()):
            TCPStore("127.0.0.1", fake.port, token=token, timeout=10, connect_timeout=10)
        assert time.monotonic() - start < 3.0
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
