"""The floor of the store benchmark: the least a pure-Python TCP key-value store can do.

Why: ncclpy's store is pure Python and ``torch.distributed.TCPStore`` is C++. To tell how much of
a gap between them is ncclpy's own code and how much is Python making the same system calls,
the benchmark also times this store, which does nothing but the system calls and a dict: an
epoll loop on one thread, a blocking client, one round trip per operation, the whole request in
one ``send``. Its operations are the least a rendezvous needs: ``set``, ``get`` (waits for a
missing key), ``add`` and ``arrive`` (a barrier held on the server: answered when the key's count
reaches a multiple of the group). It has nothing else of a store (no greeting, limits, auth,
server-side timeouts, error replies, or order among a connection's pipelined requests once one
waits), so it is a lower bound on what any Python store of this design costs per request on the
machine at hand, not a store to use.

Wire format: request ``!BII`` (op, key length, value length) + key + value; reply ``!I``
(length) + payload.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
from typing import Dict, List, Tuple

__all__ = ["FloorServer", "FloorClient", "floor_server"]

_REQ = struct.Struct("!BII")
_REP = struct.Struct("!I")
_SET, _GET, _ADD, _ARRIVE = 0, 1, 2, 3
_CHUNK = 1 << 16


def _answer(socks: List[socket.socket], payload: bytes) -> None:
    """Send the parked requests of ``socks`` their reply (a vanished client is skipped)."""
    frame = _REP.pack(len(payload)) + payload
    for sock in socks:
        try:
            sock.sendall(frame)
        except OSError:
            pass


class FloorServer:
    """The floor's server: a daemon thread with one epoll loop over every connection."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lsock = socket.create_server((host, port), backlog=1024)
        self.host = host
        self.port: int = self._lsock.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._data: Dict[bytes, bytes] = {}
        self._thread = threading.Thread(target=self._run, name="store-floor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ep = select.epoll()
        lfd, wfd = self._lsock.fileno(), self._wake_r.fileno()
        ep.register(lfd, select.EPOLLIN)
        ep.register(wfd, select.EPOLLIN)
        conns: Dict[int, Tuple[socket.socket, bytearray]] = {}
        data = self._data
        parked: Dict[bytes, List[socket.socket]] = {}   # gets of a missing key, arrivals
        poll = ep.poll
        try:
            while True:
                for fd, _ in poll():
                    if fd == lfd:
                        sock, _ = self._lsock.accept()
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        conns[sock.fileno()] = (sock, bytearray())
                        ep.register(sock.fileno(), select.EPOLLIN)
                        continue
                    if fd == wfd:
                        return
                    sock, buf = conns[fd]
                    try:
                        chunk = sock.recv(_CHUNK)
                    except OSError:   # a reset peer: as good as closed
                        chunk = b""
                    if not chunk:
                        ep.unregister(fd)
                        del conns[fd]
                        sock.close()
                        continue
                    buf += chunk
                    out = b""
                    while len(buf) >= 9:
                        op, nk, nv = _REQ.unpack_from(buf)
                        end = 9 + nk + nv
                        if len(buf) < end:
                            break
                        key = bytes(buf[9:9 + nk])
                        reply = None
                        if op == _SET:
                            data[key] = value = bytes(buf[9 + nk:end])
                            reply = b""
                            if key in parked:
                                _answer(parked.pop(key), value)
                        elif op == _GET:
                            reply = data.get(key)
                            if reply is None:
                                parked.setdefault(key, []).append(sock)
                        elif op == _ADD:
                            reply = b"%d" % (int(data.get(key, b"0")) + int(buf[9 + nk:end]))
                            data[key] = reply
                        else:
                            count = int(data.get(key, b"0")) + 1
                            data[key] = b"%d" % count
                            parked.setdefault(key, []).append(sock)
                            if count % int(buf[9 + nk:end]) == 0:
                                _answer(parked.pop(key), data[key])
                        del buf[:end]
                        if reply is not None:
                            out += _REP.pack(len(reply)) + reply
                    if out:
                        sock.sendall(out)
        finally:
            for sock, _ in conns.values():
                sock.close()
            ep.close()

    def close(self) -> None:
        """Stop the loop and close every socket (idempotent)."""
        if self._thread.is_alive():
            self._wake_w.send(b"x")
            self._thread.join(10)
        for s in (self._lsock, self._wake_r, self._wake_w):
            s.close()


class FloorClient:
    """The floor's client: ``set``, ``get``, ``add`` and ``arrive``, one round trip each."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)  # blocking: no poll() before every call ...
        if hasattr(socket, "SO_RCVTIMEO"):  # ... yet bounded, as ncclpy's client is
            tv = struct.pack("@ll", int(timeout), int((timeout % 1) * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    def _call(self, op: int, key: bytes, value: bytes) -> bytes:
        sock = self._sock
        sock.sendall(_REQ.pack(op, len(key), len(value)) + key + value)
        data = sock.recv(_CHUNK)
        while len(data) < 4 or len(data) < 4 + _REP.unpack_from(data)[0]:
            more = sock.recv(_CHUNK)
            if not more:
                raise ConnectionResetError("the floor server closed the connection")
            data += more
        return data[4:]

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key.encode(), value)

    def get(self, key: str) -> bytes:
        return self._call(_GET, key.encode(), b"")

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, key.encode(), b"%d" % amount))

    def arrive(self, key: str, group: int) -> int:
        """Count this caller on ``key``; answered once the count reaches a multiple of
        ``group`` (a barrier of ``group`` callers per generation)."""
        return int(self._call(_ARRIVE, key.encode(), b"%d" % group))

    def close(self) -> None:
        self._sock.close()


class _HostingClient(FloorClient):
    """A client that owns the server it talks to (rank 0's view), closing both together."""

    def __init__(self, server: FloorServer) -> None:
        super().__init__(server.host, server.port)
        self.server = server

    def close(self) -> None:
        super().close()
        self.server.close()


def floor_server(host: str = "127.0.0.1") -> Tuple[FloorClient, int]:
    """A new floor server in this process and a client of it that closes both; and its port."""
    client = _HostingClient(FloorServer(host))
    return client, client.server.port
