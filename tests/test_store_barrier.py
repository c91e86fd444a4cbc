"""TCP store: the barrier (server-held and key-based, a hosting rank that exits right after it)
and the server's ARRIVE it is built on.  Real sockets, threads and processes; the operations,
timeouts and auth are in ``test_store.py`` and ``test_store_timeouts.py``."""
from __future__ import annotations

import os
import re
import socket
import threading
import time

import pytest

from ncclpy.errors import ArgumentError, ArgumentTypeError, StoreRequestError, StoreTimeout
from ncclpy.store import TCPStore, barrier
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Op, Status
from store_util import HANG, run_ranks, wait_gated, wait_until

pytestmark = pytest.mark.timeout(120)


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
    t = threading.Thread(target=lambda: done.append(store.arrive("late", 3, HANG)))
    t.start()
    wait_gated(server, "late")             # 1 of 3: parked
    with TCPStore(*server.address, timeout=10) as other:
        assert other.add("late", 1) == 2   # any counter write counts (still 2 of 3)
        other.ping()                       # requests run in order: past the add's wake-ups
        assert b"late" in server._gates and not done   # and still parked
        assert other.arrive("late", 3) == 3
    t.join(HANG)
    assert done == [1]
    wait_until(lambda: not server._gates,   # the server tidies up just after replying
               "nothing left parked")


def test_arrive_timeout_names_the_key_and_keeps_the_arrival(store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as ei:
        store.arrive("lonely/count", 2, timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < HANG   # its 0.3 s (less a timer's tick), no hang
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
    wait_gated(server, "gone")                 # parked
    c.close()
    t.join(HANG)
    wait_until(lambda: not server._gates, "unlinked when its connection closed")
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
