"""Helpers shared by the store's robustness tests: raw sockets speaking (or abusing) the wire
protocol, and a health check of a server."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Callable, List

from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Status
from wait_util import HANG, wait_until   # the store tests' waits (re-exported)

__all__ = ["run_threads", "recv_exact", "ROOT", "U32", "env", "frame", "raw", "read_reply", "is_closed", "assert_healthy",
           "run_ranks", "ScriptedServer"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U32 = struct.Struct("!I").pack


def env() -> dict:
    """This environment for a child process: ncclpy importable, no store token."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in out.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    out.pop("NCCLPY_STORE_TOKEN", None)
    return out


def frame(op: int, body: bytes) -> bytes:
    """One request frame, its length field telling the truth."""
    return P.REQ_HEADER.pack(op, len(body)) + body


def raw(srv: StoreServer) -> socket.socket:
    """A raw connection past the greeting."""
    s = socket.create_connection(srv.address, timeout=5)
    hello = b""
    while len(hello) < P.HELLO_SIZE:
        chunk = s.recv(P.HELLO_SIZE - len(hello))
        assert chunk, "server closed before greeting"
        hello += chunk
    assert hello[:4] == P.MAGIC
    return s


def read_reply(s: socket.socket, timeout: float = 5.0):
    """(status, body), or None when the server closed the connection, or "silent"."""
    s.settimeout(timeout)
    buf = b""
    try:
        while len(buf) < 5:
            chunk = s.recv(4096)
            if not chunk:
                return None
            buf += chunk
        status, n = P.REP_HEADER.unpack_from(buf, 0)
        while len(buf) < 5 + n:
            chunk = s.recv(65536)
            if not chunk:
                return None
            buf += chunk
        return status, buf[5:5 + n]
    except socket.timeout:
        return "silent"
    except ConnectionResetError:
        return None


def is_closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True once the peer closed ``s`` (any unread replies are skipped), False on a timeout."""
    s.settimeout(timeout)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def assert_healthy(srv: StoreServer, good: TCPStore) -> None:
    """The server thread runs, an existing client works and a new one can connect."""
    assert srv.running
    good.set("health", b"ok")
    assert good.get("health") == b"ok"
    with TCPStore(*srv.address, timeout=5) as fresh:  # and it still accepts new clients
        assert fresh.get("health") == b"ok"


def run_ranks(n: int, fn, join: float = 60.0) -> None:
    """Run ``fn(rank)`` for ``n`` ranks in threads at once; fail with what any of them raised."""
    errors = []

    def guarded(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    assert not any(t.is_alive() for t in threads), f"ranks still running after {join} s"
    assert not errors, errors[:3]


class ScriptedServer:
    """A fake ncclpy server: greets (with ``flags``), then answers request i as ``script[i]``
    says: ``(delay, payload, gap)`` sends an OK reply of ``payload`` after ``delay`` seconds,
    one byte every ``gap`` seconds if ``gap``; None never answers. ``extra``: bytes sent right
    behind the greeting in the same ``send()`` (e.g. an auth reply)."""

    def __init__(self, script, flags: int = 0, extra: bytes = b"") -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.held = []
        self.accepted = 0
        threading.Thread(target=self._serve, args=(list(script), flags, extra),
                         daemon=True).start()

    def _serve(self, script, flags: int, extra: bytes = b"") -> None:
        conn, _ = self.lsock.accept()
        self.accepted += 1
        self.held.append(conn)
        conn.sendall(P.pack_hello(flags, 4096, 1 << 20, b"\0" * 32) + extra)
        buf = b""
        for step in script:
            while len(buf) < P.HEADER_SIZE or len(buf) < P.HEADER_SIZE + P.REQ_HEADER.unpack_from(
                    buf)[1]:
                try:
                    chunk = conn.recv(4096)
                except OSError:     # closed under it (close(): the test is over)
                    return
                if not chunk:
                    return
                buf += chunk
            buf = buf[P.HEADER_SIZE + P.REQ_HEADER.unpack_from(buf)[1]:]
            if step is None:
                return
            delay, payload, gap = step
            time.sleep(delay)
            reply = P.REP_HEADER.pack(Status.OK, len(payload)) + payload
            try:
                if not gap:
                    conn.sendall(reply)
                for i in range(len(reply) if gap else 0):
                    conn.sendall(reply[i:i + 1])
                    time.sleep(gap)
            except OSError:   # the client gave up
                return

    def close(self) -> None:
        self.lsock.close()
        for c in self.held:
            c.close()


def wait_parked(srv: StoreServer, key, bound: float = HANG) -> None:
    """Return once a get or wait for ``key`` is parked on ``srv`` (the server's waiter table:
    the request was received and is waiting for the key), so that a test's set comes after it
    for certain."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    wait_until(lambda: k in srv._waiters, f"a get of {k!r} parked on the server", bound)


def wait_gated(srv: StoreServer, key, bound: float = HANG) -> None:
    """Return once an arrive on ``key`` is parked on ``srv`` (waiting for its group)."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    wait_until(lambda: k in srv._gates, f"an arrive on {k!r} parked on the server", bound)


def run_threads(fns: List[Callable[[], None]]) -> List[BaseException]:
    """Run every fn in its own thread (ranks at a barrier); what they raised.  Fails if one is
    still inside after the hang bound."""
    errors: List[BaseException] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:   # noqa: B902 - reported by the caller
            errors.append(e)

    ts = [threading.Thread(target=guarded, args=(fn,)) for fn in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(HANG * 2)
    assert not any(t.is_alive() for t in ts), "a rank is still inside the barrier"
    return errors


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s``; fails if the peer closes first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"peer closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf
