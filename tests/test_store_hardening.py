"""Store hardening: limits from arguments and the environment, the buffered-bytes cap, stalled
frames, key-count caps, running out of file descriptors, a seeded fuzz of the wire protocol, and
the client's errors when it reconnects or meets a peer that is not an ncclpy store. Real sockets,
threads and processes throughout."""
from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from ncclpy.errors import (ArgumentError, StoreConnectionError, StoreProtocolError,
                           StoreRequestError, StoreTimeout)
from ncclpy.store import StoreLimits, StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Op, Status
from store_util import (HANG, U32, assert_healthy as _assert_healthy, env as _env,
                        frame as _frame, is_closed as _is_closed, raw as _raw,
                        read_reply as _read_reply, wait_until)

pytestmark = pytest.mark.timeout(180)


def _addr(srv: StoreServer) -> str:
    return f"127.0.0.1:{srv.port}"


# ---------------------------------------------------------------------------- server side
_FUZZ_OPS = [Op.AUTH, Op.SET, Op.GET, Op.ADD, Op.CAS, Op.DELETE, Op.WAIT, Op.NUM_KEYS, Op.CHECK,
             Op.PING, Op.ARRIVE, 0, 12, 0x7F, 0xFF]
_FUZZ_TIMEOUTS = [0, 1, 5, 20, P.MAX_TIMEOUT_MS, P.NO_TIMEOUT, 0x80000000]


def _fuzz_key(rng: random.Random) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 3, 8, 64, 65, 300])))


def _fuzz_body(rng: random.Random, op: int) -> bytes:
    if rng.random() < 0.3:  # pure noise
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
    tmo = U32(rng.choice(_FUZZ_TIMEOUTS))
    key = _fuzz_key(rng)
    if op == Op.SET:
        return U32(max(0, len(key) + rng.choice([0, 0, 1, -1, 1000]))) + key + b"v" * rng.randint(0, 50)
    if op == Op.GET:
        return tmo + key
    if op == Op.ADD:
        return struct.pack("!q", rng.randint(-(1 << 63), (1 << 63) - 1)) + key
    if op == Op.CAS:
        return U32(len(key)) + key + U32(rng.choice([0, 2, 99])) + b"ex" + b"de"
    if op in (Op.WAIT, Op.CHECK):
        keys = b"".join(U32(len(k)) + k for k in (_fuzz_key(rng) for _ in range(rng.randint(0, 5))))
        return (tmo if op == Op.WAIT else b"") + keys[:rng.randint(0, len(keys))]
    if op == Op.ARRIVE:
        return tmo + U32(rng.choice([0, 1, 2, 3, 0xFFFFFFFF])) + key
    if op == Op.AUTH:
        return b"m" * rng.choice([0, 64, 65])
    return b""


def _fuzz_frame(rng: random.Random) -> bytes:
    op = rng.choice(_FUZZ_OPS)
    body = _fuzz_body(rng, op)
    n = len(body)
    r = rng.random()
    if r < 0.1:
        n = rng.choice([0xFFFFFFFF, 1 << 31, (1 << 20) + 100, 2 * (1 << 20) + 64])
    elif r < 0.2:
        n = max(0, n + rng.randint(-3, 3))
    return P.REQ_HEADER.pack(op, n) + body


def test_seeded_fuzz_of_random_frames_never_hurts_the_server(caplog):
    """Random frames from a fixed seed, over many connections; after every batch a well-formed
    client still works, nothing went through the server's error path, and once the fuzzing
    connections are gone no buffered byte is left over."""
    caplog.set_level(logging.ERROR, logger="ncclpy.store")
    rng = random.Random(0x5EED)
    with StoreServer(max_key_size=64, max_value_size=1 << 20, frame_timeout=0.5).start() as srv, \
            TCPStore(*srv.address, timeout=20) as good:
        for batch in range(25):
            socks = []
            for _ in range(6):
                s = _raw(srv)
                socks.append(s)
                payload = b"".join(_fuzz_frame(rng) for _ in range(rng.randint(1, 6)))
                if rng.random() < 0.3:
                    payload = payload[:rng.randint(0, len(payload))]
                try:
                    s.sendall(payload)
                except OSError:
                    pass  # the server may already have hung up
            for s in socks:
                if rng.random() < 0.5:  # some read what they got, some reset the connection
                    _read_reply(s, 0.05)
                else:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            _assert_healthy(srv, good)
            assert good.add(f"fuzz/{batch}", 1) == 1
        deadline = time.monotonic() + 20
        while srv.num_clients > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.num_clients == 1 and srv.running
        assert srv.buffered_bytes == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]


def test_buffered_bytes_are_capped_across_connections(caplog):
    """Eight half-sent 1.5 MiB compare_set frames against a 4 MiB cap: the server never holds
    more than the cap, closes the biggest holders, and keeps serving."""
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    cap = 4 << 20
    with StoreServer(max_value_size=1 << 20, max_buffered_bytes=cap).start() as srv, \
            TCPStore(*srv.address, timeout=20) as good:
        socks, peak = [], 0
        try:
            body_len = 8 + 1 + 2 * (1 << 20)
            for i in range(8):
                s = _raw(srv)
                socks.append(s)
                head = P.REQ_HEADER.pack(Op.CAS, body_len) + U32(1) + b"k" + U32(1 << 20)
                try:
                    s.sendall(head + b"x" * (3 << 19))  # 1.5 MiB of the 2 MiB announced
                except OSError:
                    pass
                time.sleep(0.05)
                peak = max(peak, srv.buffered_bytes)
            survivors = cap // (3 << 19)  # 1.5 MiB holders that fit under the cap: 2
            deadline = time.monotonic() + 20
            while srv.num_clients > 1 + survivors and time.monotonic() < deadline:
                time.sleep(0.02)
                peak = max(peak, srv.buffered_bytes)
            # sampled from another thread: at most one read (64 KiB) before the shedding
            assert peak <= cap + (1 << 16), peak
            assert srv.buffered_bytes <= cap
            closed = sum(_is_closed(s, 0.5) for s in socks)
            assert closed >= 8 - survivors, closed
            _assert_healthy(srv, good)
        finally:
            for s in socks:
                s.close()
    assert "max_buffered_bytes" in caplog.text


def test_frame_timeout_counts_from_the_last_byte_not_the_first():
    """A slow but live sender is kept; one that stops mid-frame is closed."""
    with StoreServer(frame_timeout=3.0).start() as srv, TCPStore(*srv.address, timeout=10) as good:
        slow = _raw(srv)
        try:
            frame = _frame(Op.SET, U32(4) + b"drip" + b"v" * 40)
            for i in range(12):  # a byte every 0.3 s: 3.6 s for the frame, never 3 s silent
                slow.sendall(frame[i:i + 1])
                time.sleep(0.3)
            assert _read_reply(slow, 0.05) == "silent"
            slow.sendall(frame[12:])
            assert _read_reply(slow) == (Status.OK, b"")
            assert good.get("drip") == b"v" * 40
            slow.sendall(frame[:3])  # and now a real stall
            assert _is_closed(slow, 60)
        finally:
            slow.close()


def test_wait_and_check_key_counts_are_capped(caplog):
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer(max_keys_per_request=100).start() as srv, \
            TCPStore(*srv.address, timeout=10) as good:
        s = _raw(srv)
        try:
            many = b"".join(U32(3) + b"%03d" % (i % 1000) for i in range(200_000))  # 1.4 MB
            s.sendall(_frame(Op.WAIT, U32(10_000) + many))
            rep = _read_reply(s, 30)
            assert rep[0] == Status.ERR_REQUEST and b"max_keys_per_request=100" in rep[1], rep
            s.sendall(_frame(Op.CHECK, many[:7 * 101]))
            rep = _read_reply(s, 30)
            assert rep[0] == Status.ERR_REQUEST and b"max_keys_per_request=100" in rep[1], rep
            s.sendall(_frame(Op.CHECK, many[:7 * 100]))  # exactly at the limit: answered
            assert _read_reply(s) == (Status.OK, b"\x00")
        finally:
            s.close()
        # the client knows the limit from the greeting and refuses before sending
        assert good.max_keys_per_request == 100
        with pytest.raises(StoreRequestError, match="max_keys_per_request=100"):
            good.wait([f"k{i}" for i in range(101)], timeout=1)
        with pytest.raises(StoreRequestError, match="max_keys_per_request=100"):
            good.check([f"k{i}" for i in range(101)])
        good.set("k0", b"")
        assert not good.check([f"k{i}" for i in range(100)])
        _assert_healthy(srv, good)
    assert "more than 100 keys" in caplog.text


def test_key_count_limit_above_what_the_greeting_can_carry_is_enforced_by_the_server():
    with StoreServer(max_keys_per_request=70_000, max_key_size=8).start() as srv, \
            TCPStore(*srv.address, timeout=10) as c:
        assert c.max_keys_per_request == 0  # not advertised: u16 field
        with pytest.raises(StoreRequestError, match="max_keys_per_request=70000"):
            c.check([b"%d" % i for i in range(70_001)])
        c.ping()


_EMFILE_CHILD = """
import logging, os, resource, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from ncclpy.store import StoreServer
srv = StoreServer().start()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
print(srv.port, flush=True)
sys.stdin.readline()                                   # the parent says: more descriptors
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("raised", flush=True)
time.sleep(600)
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_out_of_descriptors_pauses_accepting_instead_of_spinning(tmp_path):
    errfile = open(tmp_path / "stderr.txt", "w+")  # a file: a full pipe would stall the child
    proc = subprocess.Popen([sys.executable, "-c", _EMFILE_CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=errfile, env=_env(), text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(12):  # more than it can accept: the rest wait in the backlog
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(2.0)
        cpu = _cpu_seconds(proc.pid) - cpu0
        wall = time.monotonic() - t0
        assert cpu < 0.3 * wall, f"server burnt {cpu:.2f} s of CPU in {wall:.2f} s"
        proc.stdin.write("raise\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "raised"
        for s in socks:  # every waiting client is served once descriptors are available
            s.settimeout(30)
            hello = b""
            while len(hello) < P.HELLO_SIZE:
                chunk = s.recv(P.HELLO_SIZE - len(hello))
                assert chunk, "closed instead of greeted"
                hello += chunk
            assert hello[:4] == P.MAGIC
        with TCPStore("127.0.0.1", port, timeout=10) as c:
            c.set("after", b"emfile")
            assert c.get("after") == b"emfile"
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.communicate(timeout=30)
        errfile.seek(0)
        err = errfile.read()
        errfile.close()
    assert err.count("accept failed") == 1, err[-3000:]  # logged once, not once per spin


_MANY_CLIENTS_CHILD = """
import resource, sys, threading
from ncclpy.store import StoreServer, TCPStore, barrier
n = int(sys.argv[1])
srv = StoreServer().start()
print("soft limit after start:", resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
errors = []
def rank(r):
    try:
        with TCPStore(*srv.address, timeout=60) as s:
            barrier(s, r, n, tag="ulimit", timeout=60)
    except BaseException as e:
        errors.append(repr(e))
ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
[t.start() for t in ts]
[t.join(120) for t in ts]
print("errors:", errors[:3], flush=True)
print("ok" if not errors else "failed", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX rlimits")
def test_512_clients_do_not_depend_on_the_default_open_files_limit():
    """Soft limit 1024 (a common default) is too few for 512 clients plus the server's 512
    sockets in one process; the server raises it to the hard limit when it starts."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"hard open-files limit {hard} is below what 512 clients need")

    def low_soft_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    out = subprocess.run([sys.executable, "-c", _MANY_CLIENTS_CHILD, "512"], env=_env(),
                         capture_output=True, text=True, timeout=180, preexec_fn=low_soft_limit)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "ok", out.stdout
    assert int(lines[0].split(":")[1]) > 1024, lines[0]


# ---------------------------------------------------------------------------- client side
def test_reconnect_failure_names_the_operation_and_key():
    srv = StoreServer().start()
    c = TCPStore(*srv.address, timeout=5, connect_timeout=0.5)
    try:
        c.set("before", b"1")
        srv.close()
        wait_until(lambda: not srv.running, "the server closed")
        with pytest.raises(StoreConnectionError):  # notices the loss (or fails to reconnect)
            c.get("before")
        with pytest.raises(StoreConnectionError) as ei:
            c.set("my/key", b"v")
        msg = str(ei.value)
        assert msg.startswith("set:") and "my/key" in msg and _addr(srv) in msg, msg
        assert "reconnect" in msg and "attempt" in msg, msg
        assert "within 0.5 s" in msg, msg          # its own connect timeout, no other
    finally:
        c.close()


def _silent_server():
    """A TCP server that accepts and never says a word (not an ncclpy store)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept_forever():
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept_forever, daemon=True).start()
    return lsock, held


def test_a_silent_peer_fails_fast_naming_the_missing_greeting(monkeypatch):
    from ncclpy.store import transport
    monkeypatch.setattr(transport, "GREETING_TIMEOUT", 0.5)
    lsock, held = _silent_server()
    port = lsock.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreProtocolError) as ei:
            TCPStore("127.0.0.1", port, timeout=60)
        assert time.monotonic() - t0 < HANG  # not the 60 s connect timeout
        msg = str(ei.value)
        assert f"127.0.0.1:{port}" in msg and "did not send the ncclpy greeting" in msg, msg
        assert len(held) == 1  # no retries: it is the wrong kind of server
    finally:
        lsock.close()
        for c in held:
            c.close()


def test_a_short_connect_budget_still_names_the_missing_greeting():
    lsock, held = _silent_server()
    port = lsock.getsockname()[1]
    try:
        with pytest.raises(StoreConnectionError, match="did not send the ncclpy greeting"):
            TCPStore("127.0.0.1", port, timeout=60, connect_timeout=0.5)
    finally:
        lsock.close()
        for c in held:
            c.close()


def test_a_torch_store_port_is_recognised_as_not_ours(monkeypatch):
    from ncclpy.store import transport
    dist = pytest.importorskip("torch.distributed")
    monkeypatch.setattr(transport, "GREETING_TIMEOUT", 1.0)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    with pytest.raises(StoreProtocolError, match="did not send the ncclpy greeting"):
        TCPStore("127.0.0.1", master.port, timeout=60)
    master.set("still", "fine")
    assert master.get("still") == b"fine"


def test_limits_from_the_constructors():
    with StoreServer(max_value_size=1000, max_keys_per_request=7).start() as srv, \
            TCPStore(*srv.address, timeout=5) as c:
        assert srv.limits.max_value_size == 1000 and srv.limits.max_keys_per_request == 7
        assert c.max_value_size == 1000 and c.max_keys_per_request == 7
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5,
                  limits=StoreLimits(max_value_size=100, frame_timeout=2.5)) as rank0:
        assert rank0.server.limits.frame_timeout == 2.5
        with pytest.raises(StoreRequestError, match="max_value_size=100"):
            rank0.set("k", b"v" * 101)
        rank0.set("k", b"v" * 100)
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5,
                  limits={"max_key_size": 10}) as rank0:
        with pytest.raises(StoreRequestError, match="max_key_size=10"):
            rank0.set("k" * 11, b"")
    with pytest.raises(ArgumentError, match="is_server"):
        TCPStore("127.0.0.1", 1, limits={"max_key_size": 10})
    with pytest.raises(ArgumentError, match="unknown store limit"):
        StoreLimits.resolve(max_keys=3)
    with pytest.raises(ArgumentError, match="max_clients"):
        StoreServer(max_clients=0)


def test_limits_from_the_environment(monkeypatch):
    from ncclpy.store.limits import ENV_VARS
    assert "NCCLPY_STORE_MAX_VALUE_SIZE" in ENV_VARS and "NCCLPY_STORE_FRAME_TIMEOUT" in ENV_VARS
    monkeypatch.setenv("NCCLPY_STORE_MAX_VALUE_SIZE", "2K")
    monkeypatch.setenv("NCCLPY_STORE_MAX_KEYS_PER_REQUEST", "5")
    monkeypatch.setenv("NCCLPY_STORE_MAX_BUFFERED_BYTES", "64MiB")
    monkeypatch.setenv("NCCLPY_STORE_FRAME_TIMEOUT", "7.5")
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5) as rank0:
        lim = rank0.server.limits
        assert (lim.max_value_size, lim.max_keys_per_request) == (2048, 5)
        assert (lim.max_buffered_bytes, lim.frame_timeout) == (64 << 20, 7.5)
        assert rank0.max_value_size == 2048
        with pytest.raises(StoreRequestError, match="max_value_size=2048"):
            rank0.set("k", b"v" * 2049)
    with StoreServer(max_value_size=4096).start() as srv:  # an argument beats the environment
        assert srv.limits.max_value_size == 4096 and srv.limits.max_keys_per_request == 5
    assert StoreLimits.resolve(StoreLimits()).max_value_size == 64 << 20  # explicit record wins
    monkeypatch.setenv("NCCLPY_STORE_MAX_CLIENTS", "lots")
    with pytest.raises(ArgumentError, match="NCCLPY_STORE_MAX_CLIENTS"):
        StoreServer()
    monkeypatch.setenv("NCCLPY_STORE_MAX_CLIENTS", "0")
    with pytest.raises(ArgumentError, match="NCCLPY_STORE_MAX_CLIENTS"):
        StoreServer()


def test_pipelined_requests_are_answered_in_order_and_errors_keep_the_stream_in_step(store):
    r = store._pipeline([store._req_set("p/a", b"1"), store._req_add("p/n", 5),
                         store._req_wait(["p/a"], 1.0), store._req_add("p/n", 1)])
    assert r == [b"", b"5", b"", b"6"]
    with pytest.raises(StoreTimeout, match="p/missing") as ei:
        store._pipeline([store._req_wait(["p/missing"], 0.3), store._req_add("p/n", 1)])
    assert "(timeout 0.30 s)" in str(ei.value)     # the wait's own, not the store's 10 s
    assert store.get("p/n") == b"7"  # the request behind the timed-out wait still ran
    store.set("p/text", b"abc")
    with pytest.raises(StoreRequestError, match="not a decimal integer"):
        store._pipeline([store._req_add("p/text", 1), store._req_delete("p/text")])
    assert not store.check(["p/text"])
    assert store.get("p/a") == b"1"  # and the connection is still in step
