"""The store benchmark's floor (bench/store_floor.py) is a real store, however bare: over real
sockets it keeps values and counters, parks a get until its key is set and an arrival until its
group is complete, frames requests however TCP splits or joins them, serves several clients,
survives a client vanishing, and stops when closed."""
from __future__ import annotations

import socket
import struct
import time

import pytest

from bench.store_floor import FloorClient, FloorServer, floor_server
from store_util import run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = FloorServer()
    yield s
    s.close()


def _frame(op: int, key: bytes, value: bytes = b"") -> bytes:
    return struct.pack("!BII", op, len(key), len(value)) + key + value


def _reply(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack_from("!I", data)[0]:
        chunk = sock.recv(4096)
        assert chunk, "server closed the connection"
        data += chunk
    n = struct.unpack_from("!I", data)[0]
    assert len(data) == 4 + n
    return data[4:]


def test_set_get_add(server):
    c = FloorClient(server.host, server.port)
    try:
        c.set("k", b"v" * 100)
        assert c.get("k") == b"v" * 100
        c.set("k", b"w")
        assert c.get("k") == b"w"
        assert [c.add("n", 3), c.add("n", -5), c.add("n", 10)] == [3, -2, 8]
        assert c.get("n") == b"8"
        big = bytes(range(256)) * 1024   # 256 KiB: several recv calls on both sides
        c.set("big", big)
        assert c.get("big") == big
    finally:
        c.close()


def test_get_waits_for_the_key_and_arrive_for_the_group(server):
    got = {}

    def rank(r: int) -> None:
        c = FloorClient(server.host, server.port, timeout=10)
        if r == 0:
            time.sleep(0.3)
            c.set("uid", b"u" * 128)
        else:
            got[r] = c.get("uid")            # parked until rank 0's set
        for _ in range(3):                   # three generations of one barrier key
            got[(r, "arrive")] = got.get((r, "arrive"), []) + [c.arrive("bar", 4)]
        c.close()

    t0 = time.monotonic()
    run_ranks(4, rank, join=30)
    assert time.monotonic() - t0 >= 0.25
    assert [got[r] for r in (1, 2, 3)] == [b"u" * 128] * 3
    # each generation is answered with the count that completed it
    assert {tuple(got[(r, "arrive")]) for r in range(4)} == {(4, 8, 12)}


def test_joined_and_split_frames(server):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(_frame(0, b"a", b"1") + _frame(2, b"a", b"41") + _frame(1, b"a"))
        replies = b""
        while len(replies) < 4 + 4 + 2 + 4 + 2:
            replies += s.recv(4096)
        assert replies == b"\0\0\0\0" + b"\0\0\0\x0242" + b"\0\0\0\x0242"
        for byte in _frame(0, b"split", b"xyz"):
            s.sendall(bytes([byte]))
        assert _reply(s) == b""
        s.sendall(_frame(1, b"split"))
        assert _reply(s) == b"xyz"


def test_clients_share_one_store(server):
    def rank(r: int) -> None:
        c = FloorClient(server.host, server.port)
        for _ in range(50):
            c.add("count", 1)
        c.set(f"rank{r}", b"%d" % r)
        c.close()

    run_ranks(16, rank, join=30)
    c = FloorClient(server.host, server.port)
    assert c.get("count") == b"800"
    assert [c.get(f"rank{r}") for r in range(16)] == [b"%d" % r for r in range(16)]
    c.close()


def test_vanished_client_leaves_server_serving(server):
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.sendall(_frame(0, b"half", b"x")[:5])
    s.close()   # RST with half a request buffered on the server
    c = FloorClient(server.host, server.port)
    c.set("after", b"ok")
    assert c.get("after") == b"ok" and c.add("half", 1) == 1   # the half request never ran
    c.close()


def test_close_stops_the_thread_and_hosting_client_closes_both():
    client, port = floor_server()
    server = client.server
    assert port == server.port and client.add("x", 2) == 2
    client.close()
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    server.close()   # idempotent


def test_client_of_a_silent_server_times_out():
    silent = socket.create_server(("127.0.0.1", 0))   # accepts (backlog), never answers
    try:
        c = FloorClient("127.0.0.1", silent.getsockname()[1], timeout=0.5)
        with pytest.raises(OSError):   # BlockingIOError: SO_RCVTIMEO ran out
            c.set("k", b"v")
        c.close()
    finally:
        silent.close()
