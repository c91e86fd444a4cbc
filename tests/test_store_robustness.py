"""TCP store under bad input and failures: malformed frames on raw sockets, peers that die,
late servers, and a server thread that must never keep a program alive."""
from __future__ import annotations

import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ncclpy.errors import (StoreConnectionError, StoreProtocolError, StoreTimeout)
from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store.connio import PAUSE_OUTPUT
from ncclpy.store.protocol import Op, Status
from store_util import (HANG, U32, assert_healthy as _assert_healthy, env as _env,
                        frame as _frame, is_closed as _is_closed, raw as _raw,
                        read_reply as _read_reply, wait_parked, wait_until)

pytestmark = pytest.mark.timeout(120)

FRAME_TIMEOUT = 2.0   # the module server closes a connection stalled mid-frame this fast


@pytest.fixture(scope="module")
def server():
    srv = StoreServer(max_key_size=64, max_value_size=1 << 20,
                      frame_timeout=FRAME_TIMEOUT).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def good(server):
    with TCPStore(*server.address, timeout=10) as s:
        yield s


_rng = random.Random(1234)
MALFORMED = [
    # id, bytes sent, expected: "protocol" (error reply then close), "request" (error reply,
    # connection stays usable), "stalled" (the server waits for the rest without blocking
    # anyone, then closes the connection after frame_timeout), "idle" (between frames: kept)
    ("nothing", b"", "idle"),
    ("truncated-header", b"\x02\x00\x00", "stalled"),
    ("truncated-body", P.REQ_HEADER.pack(Op.SET, 100) + b"\x00" * 10, "stalled"),
    ("oversized-length", P.REQ_HEADER.pack(Op.SET, 0xFFFFFFFF), "protocol"),
    ("oversized-get", P.REQ_HEADER.pack(Op.GET, 10_000) + b"k" * 100, "protocol"),
    ("oversized-num-keys", _frame(Op.NUM_KEYS, b"xxxxx"), "protocol"),
    ("oversized-auth", _frame(Op.AUTH, b"a" * 100), "protocol"),
    ("unknown-opcode", _frame(0xEE, b"abc"), "protocol"),
    ("opcode-zero", _frame(0, b""), "protocol"),
    ("zero-length-set", _frame(Op.SET, b""), "protocol"),
    ("set-key-length-past-end", _frame(Op.SET, U32(50) + b"short"), "protocol"),
    ("get-without-timeout", _frame(Op.GET, b"ab"), "protocol"),
    ("add-too-short", _frame(Op.ADD, b"\x00\x01"), "protocol"),
    ("cas-truncated", _frame(Op.CAS, U32(1) + b"k" + U32(99)), "protocol"),
    ("wait-truncated-keys", _frame(Op.WAIT, U32(100) + U32(10) + b"ab"), "protocol"),
    ("check-truncated-len", _frame(Op.CHECK, b"\x00\x00"), "protocol"),
    ("arrive-too-short", _frame(Op.ARRIVE, U32(10)), "protocol"),
    ("oversized-arrive", P.REQ_HEADER.pack(Op.ARRIVE, 10_000) + b"k" * 100, "protocol"),
    ("auth-on-tokenless-server", _frame(Op.AUTH, b"m" * 64), "auth"),
    ("key-over-limit", _frame(Op.SET, U32(65) + b"k" * 65 + b"v"), "request"),
    ("wait-key-over-limit", _frame(Op.WAIT, U32(0) + U32(100) + b"k" * 100), "request"),
    ("random-bytes", bytes([0xC3]) + bytes(_rng.getrandbits(8) for _ in range(4095)),
     "protocol"),
    ("random-bytes-valid-op", bytes([Op.SET]) + bytes(_rng.getrandbits(8) for _ in range(999)),
     "any"),
]


@pytest.mark.parametrize("payload, expect", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_frames(server, good, payload, expect):
    before = good.num_keys()
    s = _raw(server)
    try:
        s.sendall(payload)
        if expect == "idle":
            assert _read_reply(s, FRAME_TIMEOUT + 1.0) == "silent"  # idle is fine: kept open
            _assert_healthy(server, good)
            s.sendall(_frame(Op.PING, b""))
            assert _read_reply(s) == (Status.OK, b"")
        elif expect == "stalled":
            assert _read_reply(s, 0.2) == "silent"
            _assert_healthy(server, good)  # a half-sent client blocks nobody ...
            assert _is_closed(s, FRAME_TIMEOUT + 30)  # ... and is closed once it stalls
        elif expect in ("protocol", "auth"):
            rep = _read_reply(s)
            assert rep is not None and rep != "silent", rep
            want = Status.ERR_PROTOCOL if expect == "protocol" else Status.ERR_AUTH
            assert rep[0] == want, rep
            assert rep[1]  # a message saying why
            assert _is_closed(s)
        elif expect == "request":
            rep = _read_reply(s)
            assert rep[0] == Status.ERR_REQUEST and b"max_key_size=64" in rep[1], rep
            s.sendall(_frame(Op.PING, b""))  # same connection, still in step
            assert _read_reply(s) == (Status.OK, b"")
        else:  # anything but a hang of the server
            rep = _read_reply(s, 0.5)
            assert rep is None or rep == "silent" or rep[0] != Status.OK
    finally:
        s.close()
    _assert_healthy(server, good)
    assert good.num_keys() <= max(before, 1)  # no malformed request stored anything
    deadline = time.monotonic() + 5
    while server.num_clients > 1 and time.monotonic() < deadline:  # only `good` remains
        time.sleep(0.01)
    assert server.num_clients == 1


def test_arrive_refuses_group_zero_and_non_counters(server, good):
    """Refused with a reason; the connection stays usable and nothing was counted."""
    good.set("text", b"abc")
    s = _raw(server)
    try:
        s.sendall(_frame(Op.ARRIVE, U32(1000) + U32(0) + b"g"))
        rep = _read_reply(s)
        assert rep[0] == Status.ERR_REQUEST and b"group must be at least 1, got 0" in rep[1], rep
        s.sendall(_frame(Op.ARRIVE, U32(1000) + U32(2) + b"text"))
        rep = _read_reply(s)
        assert rep[0] == Status.ERR_REQUEST and b"not a decimal integer" in rep[1], rep
        s.sendall(_frame(Op.ARRIVE, U32(1000) + U32(1) + b"g"))  # still in step
        assert _read_reply(s) == (Status.OK, b"1")
    finally:
        s.close()
    assert good.get("text") == b"abc"
    _assert_healthy(server, good)


def test_oversized_length_is_not_buffered(server, good):
    """Announce 1 GiB and start sending: refused at the header, connection closed."""
    s = _raw(server)
    try:
        s.sendall(P.REQ_HEADER.pack(Op.SET, 1 << 30))
        try:
            s.sendall(b"\0" * (4 << 20))
        except OSError:
            pass  # the server hung up on us, as it should
        rep = _read_reply(s)
        assert rep is None or rep[0] == Status.ERR_PROTOCOL
    finally:
        s.close()
    _assert_healthy(server, good)


def test_pipelined_frames_are_answered_in_order(server, good):
    s = _raw(server)
    try:
        s.sendall(_frame(Op.SET, U32(2) + b"pk" + b"v1") + _frame(Op.PING, b"")
                  + _frame(Op.GET, U32(1000) + b"pk") + _frame(Op.DELETE, b"pk"))
        want = (P.REP_HEADER.pack(Status.OK, 0) * 2 + P.REP_HEADER.pack(Status.OK, 2) + b"v1"
                + P.REP_HEADER.pack(Status.OK, 1) + b"\x01")
        got = b""
        s.settimeout(5)
        while len(got) < len(want):
            chunk = s.recv(4096)
            assert chunk
            got += chunk
        assert got == want
    finally:
        s.close()


def test_client_that_never_reads_is_throttled_not_buffered(server, good):
    """Pipelined GETs of a large value, replies never read: the server queues a bounded
    amount for that client, stops reading from it, and keeps serving everyone else."""
    value = b"z" * (512 << 10)
    good.set("bulk", value)
    s = _raw(server)
    try:
        s.setblocking(False)
        req = _frame(Op.GET, U32(1000) + b"bulk")
        sent = 0
        for _ in range(200):  # up to 100 MiB of replies requested
            try:
                sent += s.send(req * 10)
            except BlockingIOError:
                break
        time.sleep(0.5)
        _assert_healthy(server, good)
        queued = max(c.wbytes for c in list(server._conns.values()))
        assert queued <= PAUSE_OUTPUT + len(value) + 64, queued
        # the replies are views of the stored value, not copies: almost nothing is buffered
        assert server.buffered_bytes < (1 << 20), server.buffered_bytes
    finally:
        s.close()
    good.delete("bulk")


def test_request_before_auth_is_refused_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer(token="tok").start() as srv:
        s = _raw(srv)
        try:
            s.sendall(_frame(Op.GET, U32(0) + b"k"))
            rep = _read_reply(s)
            assert rep[0] == Status.ERR_AUTH
            assert _is_closed(s)
        finally:
            s.close()
        assert "before authenticating" in caplog.text
        with TCPStore(*srv.address, token="tok", timeout=5) as c:
            c.ping()


def test_not_a_store_server_is_a_protocol_error():
    lsock = socket.create_server(("127.0.0.1", 0))

    def fake():
        conn, _ = lsock.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 40)
            time.sleep(1)

    threading.Thread(target=fake, daemon=True).start()
    try:
        with pytest.raises(StoreProtocolError, match="not an ncclpy store"):
            TCPStore("127.0.0.1", lsock.getsockname()[1], timeout=5)
    finally:
        lsock.close()


# ---------------------------------------------------------------------------- dying peers
_SERVER_CHILD = """
import sys, time
from ncclpy.store import StoreServer
s = StoreServer().start()
print(s.port, flush=True)
time.sleep(600)
"""


def test_killed_server_gives_connection_error_within_timeout():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_CHILD], stdout=subprocess.PIPE,
                            env=_env(), text=True)
    try:
        port = int(proc.stdout.readline())
        waiting = TCPStore("127.0.0.1", port, timeout=20)
        later = TCPStore("127.0.0.1", port, timeout=2, connect_timeout=2)
        waiting.set("k", b"v")
        result = {}

        def blocked_get():
            t0 = time.monotonic()
            try:
                waiting.get("never", timeout=20)
            except BaseException as e:
                result["err"] = e
            result["t"] = time.monotonic() - t0

        t = threading.Thread(target=blocked_get)
        t.start()
        wait_until(waiting._lock.locked, "the get in flight")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t.join(25)
        err = result.get("err")
        assert isinstance(err, StoreConnectionError), result
        # noticed at once: the closed connection itself, not the probe after 5 s ("answered
        # neither this call nor a probe") nor the get's 20 s timeout (a StoreTimeout)
        assert "lost the connection" in str(err) and "ConnectionResetError" in str(err), err
        assert f"127.0.0.1:{port}" in str(err)
        # a client that had not noticed yet: fails, and again within its own (2 s) connect
        # timeout, the reconnect being refused
        with pytest.raises(StoreConnectionError):
            later.get("k")
        with pytest.raises(StoreConnectionError, match=r"could not reconnect .* within 2\.0 s"):
            later.get("k")
        waiting.close()
        later.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_HALF_FRAME_CHILD = """
import socket, struct, sys, time
port = int(sys.argv[1]); mode = sys.argv[2]
s = socket.create_connection(("127.0.0.1", port))
hello = b""
while len(hello) < 48:
    hello += s.recv(48 - len(hello))
if mode == "half":   # SET announcing 512 KiB, of which 100 KiB arrive
    s.sendall(struct.pack("!BI", 2, 512 * 1024) + struct.pack("!I", 4) + b"dead" + b"x" * 100000)
else:                # a GET parked on a key nobody sets yet
    s.sendall(struct.pack("!BI", 3, 4 + 6) + struct.pack("!I", 60000) + b"parked")
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["half", "parked"])
def test_client_killed_mid_request_leaves_server_unaffected(mode):
    with StoreServer().start() as srv, TCPStore(*srv.address, timeout=10) as good:
        proc = subprocess.Popen([sys.executable, "-c", _HALF_FRAME_CHILD, str(srv.port), mode],
                                stdout=subprocess.PIPE, env=_env(), text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            wait_until(lambda: srv.num_clients == 2, "the child's connection")
            if mode == "parked":
                wait_parked(srv, "parked")
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wait_until(lambda: srv.num_clients == 1, "the killed client's connection closed")
        assert srv.running
        assert not good.check("dead")
        good.set("parked", b"now set")  # the dead client's waiter must not trip the server
        assert good.get("parked") == b"now set"
        assert good.num_keys() == 1


def test_server_thread_does_not_keep_a_program_alive():
    code = ("from ncclpy.store import TCPStore\n"
            "import threading\n"
            "s = TCPStore('127.0.0.1', 0, is_server=True, timeout=30)\n"
            "c = TCPStore('127.0.0.1', s.port, timeout=30)\n"
            "t = threading.Thread(target=lambda: c.get('never'), daemon=True); t.start()\n"
            "s.set('a', b'b'); print('done', flush=True)\n")  # no close(): exit must not hang
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=HANG)     # a hang: the exit waited for the thread
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


# ---------------------------------------------------------------------------- connecting
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_retries_until_a_late_server_starts():
    port = _free_port()
    result = {}

    def client():
        t0 = time.monotonic()
        try:
            with TCPStore("127.0.0.1", port, timeout=10, connect_timeout=10) as s:
                result["v"] = s.get("hello", timeout=10)
        except BaseException as e:
            result["err"] = e
        result["t"] = time.monotonic() - t0

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.6)  # rank 0 starts last
    with StoreServer(port=port).start() as srv:
        with TCPStore(*srv.address, timeout=5) as rank0:
            rank0.set("hello", b"world")
            t.join(15)
    assert result.get("v") == b"world", result
    assert result["t"] >= 0.5


def test_connect_gives_up_after_connect_timeout():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreConnectionError) as ei:
        TCPStore("127.0.0.1", port, timeout=30, connect_timeout=0.6)
    waited = time.monotonic() - t0
    assert 0.5 <= waited < HANG                 # not before its 0.6 s (less a timer's tick)
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "0.6" in msg and "attempt" in msg


def test_max_clients_refuses_extra_connections():
    with StoreServer(max_clients=2).start() as srv:
        a = TCPStore(*srv.address, timeout=5)
        b = TCPStore(*srv.address, timeout=5)
        with pytest.raises(StoreConnectionError):
            TCPStore(*srv.address, timeout=5, connect_timeout=0.5)
        a.close()
        wait_until(lambda: srv.num_clients == 1, "a's connection closed")
        with TCPStore(*srv.address, timeout=5) as c:  # a slot is free again
            c.ping()
        b.ping()
        b.close()


def test_client_reconnects_after_a_client_side_timeout():
    """After a reply failed to arrive in time the stream is out of step; the next call starts
    a fresh connection instead of reading the stale reply that arrives later."""
    with StoreServer().start() as srv, TCPStore(*srv.address, timeout=5) as s:
        s.set("x", b"1")
        real_set = srv._handlers[Op.SET]

        def slow_set(conn, body):  # the server thread stalls on this key, then replies
            if b"slow" in body:
                time.sleep(0.5)
            real_set(conn, body)

        srv._handlers[Op.SET] = slow_set
        s.timeout = 0.1
        with pytest.raises(StoreTimeout, match="slow"):
            s.set("slow", b"late")
        s.timeout = 5.0
        assert s.get("x") == b"1"          # not the stale OK of the slow set
        s.set("y", b"2")
        assert s.get("y") == b"2"
        assert s.get("slow") == b"late"    # the server did finish the slow set


def test_client_that_never_authenticates_is_dropped(caplog):
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer(token="tok", auth_timeout=0.3).start() as srv:
        s = _raw(srv)
        try:
            t0 = time.monotonic()
            assert _is_closed(s, HANG)          # its 0.3 s, not the default 60 s
            assert time.monotonic() - t0 >= 0.25  # and not before (less a timer's tick)
        finally:
            s.close()
        assert "did not authenticate" in caplog.text
        with TCPStore(*srv.address, token="tok", timeout=5) as c:
            c.ping()


def test_port_in_use_is_a_clear_error():
    with StoreServer().start() as srv:
        with pytest.raises(StoreConnectionError, match=f"could not listen on 127.0.0.1:{srv.port}"):
            StoreServer(port=srv.port).start()
        with pytest.raises(StoreConnectionError):
            TCPStore("127.0.0.1", srv.port, is_server=True, timeout=5)


def test_finished_waits_do_not_pile_up_in_the_timer_heap():
    """Every parked get has a deadline in the timer heap; resolved ones must not accumulate."""
    with StoreServer().start() as srv, TCPStore(*srv.address, timeout=60) as setter:
        raw = _raw(srv)
        try:
            for i in range(5000):
                key = b"k%d" % i
                raw.sendall(_frame(Op.GET, U32(600_000) + key))
                deadline = time.monotonic() + 5
                while key not in srv._waiters and time.monotonic() < deadline:
                    time.sleep(0)
                setter.set(key, b"v")
                assert _read_reply(raw) == (Status.OK, b"v")
        finally:
            raw.close()
        assert len(srv._timers) <= 4096 + 1


# ---------------------------------------------------------------------------- audit fixes
def test_huge_wait_timeouts_do_not_crash_the_server(server, good):
    """A GET/WAIT parked for ~49 days once made epoll.poll() overflow and killed the loop."""
    raw_get, raw_wait = _raw(server), _raw(server)
    try:
        raw_get.sendall(_frame(Op.GET, U32(P.MAX_TIMEOUT_MS) + b"far/get"))
        raw_wait.sendall(_frame(Op.WAIT, U32(P.MAX_TIMEOUT_MS) + U32(8) + b"far/wait"))
        wait_parked(server, "far/get")
        wait_parked(server, "far/wait")   # the loop computes its next poll timeout from them
        _assert_healthy(server, good)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "v", good_get(server, "far/api", 40 * 86400.0)))
        t.start()
        wait_parked(server, "far/api")
        with TCPStore(*server.address, timeout=10) as setter:
            setter.set("far/get", b"g")
            setter.set("far/wait", b"w")
            setter.set("far/api", b"a")
        assert _read_reply(raw_get) == (Status.OK, b"g")
        assert _read_reply(raw_wait) == (Status.OK, b"")
        t.join(10)
        assert out.get("v") == b"a"
        assert server.running
    finally:
        raw_get.close()
        raw_wait.close()
    for k in ("far/get", "far/wait", "far/api"):
        good.delete(k)


def good_get(srv: StoreServer, key: str, timeout: float) -> bytes:
    with TCPStore(*srv.address, timeout=10) as c:
        return c.get(key, timeout=timeout)


def test_an_exception_in_a_handler_drops_only_that_connection(caplog):
    caplog.set_level(logging.ERROR, logger="ncclpy.store")
    with StoreServer().start() as srv, TCPStore(*srv.address, timeout=10) as good:
        def boom(conn, body):
            raise RuntimeError("injected fault")

        srv._handlers[Op.NUM_KEYS] = boom
        s = _raw(srv)
        try:
            s.sendall(_frame(Op.NUM_KEYS, b""))
            assert _is_closed(s)
        finally:
            s.close()
        assert srv.running
        good.set("still", b"here")
        assert good.get("still") == b"here"
        assert "injected fault" in caplog.text and "closing that connection" in caplog.text
