"""The store side of the control plane at scale (issue 26), on CPU with real servers and sockets:
the heartbeat table and the vote held by the server, a clock that a stopped server does not
run, a refused client told why, a stopped store host found by the probe, a slow reply that
keeps its connection, TCP keepalive, and a job's connection limit sized from its world size.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ncclpy.errors import StoreConnectionError, StoreRequestError, StoreTimeout
from ncclpy.store import StoreLimits, StoreServer, TCPStore
from ncclpy.store import tablewire as W
from store_util import HANG, env as _env, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0).start()
    yield srv
    srv.close()


class _Process:
    """A store server in a process of its own, so that it can be stopped (SIGSTOP)."""

    def __init__(self) -> None:
        code = ("import time\nfrom ncclpy.store import StoreServer\n"
                "s = StoreServer('127.0.0.1', 0).start()\nprint(s.port, flush=True)\n"
                "time.sleep(600)\n")
        self.p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  text=True, env=_env())
        self.port = int(self.p.stdout.readline())

    def stop(self) -> None:
        """SIGSTOP, returning once the process is stopped (the signal is delivered
        asynchronously: on a busy machine the server could still answer a request)."""
        self.p.send_signal(signal.SIGSTOP)
        wait_until(self._stopped, "the store's process stopped (SIGSTOP)")

    def _stopped(self) -> bool:
        with open(f"/proc/{self.p.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    def cont(self) -> None:
        self.p.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.p.send_signal(signal.SIGCONT)
        self.p.kill()
        self.p.wait()


@pytest.fixture
def proc():
    p = _Process()
    yield p
    p.close()


# -- the heartbeat table ---------------------------------------------------------------------------
def test_one_beat_answers_stale_and_never_seen_ranks_and_the_death_epoch(server):
    a = TCPStore("127.0.0.1", server.port, timeout=5)
    b = TCPStore("127.0.0.1", server.port, timeout=5)
    r = a.beat("g", 0, 4, 0.3, b"1:0", watch="ep")
    assert (r.epoch, r.never, r.nstale, r.stale, r.never_listed) == (0, 3, 0, [], [1, 2, 3])
    b.beat("g", 1, 4, 0.3, b"1:7")
    time.sleep(0.5)
    a.add("ep", 2)
    r = a.beat("g", 0, 4, 0.3, b"2:0", watch="ep")
    assert r.epoch == 2 and r.nstale == 1 and [x for x, _ in r.stale] == [1]
    assert 0.3 < r.stale[0][1] < 60 and r.never_listed == [2, 3]   # 60: a hang's deadline
    full = a.beat("g", 0, 4, 0.3, flags=W.BEAT_PEEK | W.BEAT_FULL).full
    assert [v for _, _, v in full] == [b"2:0", b"1:7", b"", b""]
    assert full[2][0] is None and full[0][0] < full[1][0] and not any(c for _, c, _ in full)
    b.beat("g", 1, 4, 0.3, b"closed", flags=W.BEAT_CLOSE)        # a closed rank is never stale
    time.sleep(0.5)
    r = a.beat("g", 0, 4, 0.3, b"3:0")
    assert (r.nstale, r.closed) == (0, 1)
    with pytest.raises(StoreRequestError, match="beat: 'g' has 4 ranks; rank 0 "
                                          "says 5"):
        a.beat("g", 0, 5, 0.3)
    with pytest.raises(StoreRequestError, match="beat: rank 9 of 4 ranks"):
        a.beat("g", 9, 4, 0.3)
    for rank in (0, 2, 3):                                       # all closed: table dropped
        a.beat("g", rank, 4, 0.3, flags=W.BEAT_CLOSE)
    t = server._tables.get(b"g")
    assert t is None, (sorted(t.closed), sorted(t.never), dict(t.last), t.values)
    assert server.num_keys == 1                                  # just "ep"


def test_an_abort_is_final_and_its_verdict_outlives_the_ranks(server):
    """BEAT_ABORT: the rank leaves (never stale), every later reply names the first rank that
    aborted and its verdict, a late beat of an aborted rank never re-opens it, and a table
    whose ranks all left after an abort stays for ncclpy status (one per communicator)."""
    a = TCPStore("127.0.0.1", server.port, timeout=5)
    for r in range(3):
        a.beat("t", r, 3, 0.2, f"1:{r}".encode(), count=5)
    r = a.beat("t", 2, 3, 0.2, b"1:2\nwhy two", flags=W.BEAT_CLOSE | W.BEAT_ABORT, count=6)
    assert (r.aborted, r.first_aborted, r.closed) == (1, (2, b"1:2\nwhy two"), 1)
    r = a.beat("t", 1, 3, 0.2, b"1:1\nwhy one", flags=W.BEAT_CLOSE | W.BEAT_ABORT, count=5)
    assert (r.aborted, r.first_aborted) == (2, (2, b"1:2\nwhy two"))      # the first stays
    a.beat("t", 2, 3, 0.2, b"late")                             # a late beat: ignored
    time.sleep(0.4)
    r = a.beat("t", 0, 3, 0.2, b"2:0", count=7)
    assert (r.nstale, r.closed, r.aborted) == (0, 2, 2)
    full = a.beat("t", 0, 3, 0.2, flags=W.BEAT_PEEK | W.BEAT_FULL).full
    assert [(st, v) for _, st, v in full] == [
        (0, b"2:0"), (W.STATE_CLOSED | W.STATE_ABORTED, b"1:1\nwhy one"),
        (W.STATE_CLOSED | W.STATE_ABORTED, b"1:2\nwhy two")]
    rep = a.beat("t", 0, 3, 0.2, flags=W.BEAT_PEEK | W.BEAT_BEHIND, count=6)
    assert sorted(rep.behind) == [(1, 5), (2, 6)] and rep.nbehind == 2   # its count at abort
    a.beat("t", 0, 3, 0.2, b"bye", flags=W.BEAT_CLOSE)
    assert server._tables.get(b"t") is not None                  # kept: it holds verdicts


def test_the_stale_list_is_capped_but_counted_and_the_scan_stops_at_the_first_fresh(server):
    c = TCPStore("127.0.0.1", server.port, timeout=5)
    for r in range(100):
        c.beat("big", r, 100, 0.2, b"x")
    time.sleep(0.4)
    r = c.beat("big", 0, 100, 0.2, b"x")
    assert r.nstale == 99 and len(r.stale) == W.MAX_LISTED
    assert [x for x, _ in r.stale] == list(range(1, 1 + W.MAX_LISTED))   # oldest first
    assert r.never == 0 and r.never_listed == []


def test_a_stopped_store_ages_nobody(proc):
    """Stale read != dead peer, server side: the table's clock does not run while the server
    is stopped, so two ranks that beat before a 3 s stop are fresh after it."""
    a = TCPStore("127.0.0.1", proc.port, timeout=10)
    b = TCPStore("127.0.0.1", proc.port, timeout=10)
    for c, rank in ((a, 0), (b, 1)):
        c.beat("s", rank, 2, 1.5, b"x")
    proc.stop()
    time.sleep(3.0)
    proc.cont()
    r = a.beat("s", 0, 2, 1.5, b"x")
    assert r.nstale == 0, r                       # rank 1 beat 3 s ago in wall time
    time.sleep(1.8)                               # ... but now it is silent for real
    r = a.beat("s", 0, 2, 1.5, b"x")
    assert [x for x, _ in r.stale] == [1], r


# -- the vote --------------------------------------------------------------------------------------
def _vote_all(port: int, key: str, votes, timeout: float = 5.0):
    out = {}

    def one(rank, h, s, bad):
        out[rank] = TCPStore("127.0.0.1", port, timeout=10).vote(key, len(votes), rank, h, s,
                                                                  bad, timeout=timeout)
    ts = [threading.Thread(target=one, args=(r, *v)) for r, v in enumerate(votes)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return [out[r] for r in range(len(votes))]


def test_a_vote_agrees_or_says_what_differs_and_leaves_nothing(server):
    M = 1 << 64
    assert {r.verdict for r in _vote_all(server.port, "v1", [(7, 5, False), (7, M - 5, False),
                                                               (7, 0, False)])} == {0}
    assert {r.verdict for r in _vote_all(server.port, "v2", [(7, 0, False), (8, 0, False)])} \
        == {W.HASH_DIFFERS}
    assert {r.verdict for r in _vote_all(server.port, "v3", [(7, 1, False), (7, 0, False)])} \
        == {W.SUM_NONZERO}
    assert {r.verdict for r in _vote_all(server.port, "v4", [(7, 0, True), (7, 0, False)])} \
        == {W.SOMEONE_BAD}
    assert server.num_keys == 0 and not server._votes


def test_a_vote_that_times_out_names_who_never_voted_to_every_voter(server):
    out = {}

    def one(rank):
        out[rank] = TCPStore("127.0.0.1", server.port, timeout=10).vote("t", 4, rank, 1,
                                                                        timeout=0.5)
    ts = [threading.Thread(target=one, args=(r,)) for r in (0, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    for r in (0, 2):
        assert out[r].verdict == W.TIMED_OUT and out[r].missing == [1, 3], out
    assert not server._votes


def test_a_voter_whose_connection_closes_leaves_the_vote_and_a_double_vote_is_refused(server):
    c = TCPStore("127.0.0.1", server.port, timeout=10)
    gone = TCPStore("127.0.0.1", server.port, timeout=10)
    t = threading.Thread(target=lambda: pytest.raises(Exception, gone.vote, "d", 3, 1, 1))
    t.start()
    wait_until(lambda: b"d" in server._votes, "rank 1's vote parked")
    gone.close()                                  # its parked vote is withdrawn
    t.join(HANG)
    wait_until(lambda: b"d" not in server._votes, "the closed voter's vote withdrawn")
    r = c.vote("d", 3, 0, 1, timeout=0.3)
    assert r.verdict == W.TIMED_OUT and r.missing == [1, 2]
    other = TCPStore("127.0.0.1", server.port, timeout=10)
    th = threading.Thread(target=lambda: other.vote("e", 2, 0, 1, timeout=2))
    th.start()
    wait_until(lambda: b"e" in server._votes, "rank 0's vote parked")
    with pytest.raises(StoreRequestError, match="rank 0 already voted"):
        c.vote("e", 2, 0, 1, timeout=2)
    c.vote("e", 2, 1, 1, timeout=2)
    th.join(5)


# -- connections -----------------------------------------------------------------------------------
def test_a_refused_client_is_told_why():
    with StoreServer("127.0.0.1", 0, max_clients=1) as srv:
        first = TCPStore("127.0.0.1", srv.port, timeout=5)
        with pytest.raises(StoreConnectionError) as ei:
            TCPStore("127.0.0.1", srv.port, timeout=5, connect_timeout=0.5)
        msg = str(ei.value)
        assert "refused this client: the store is full: max_clients=1 connections are open; " \
               "raise NCCLPY_STORE_MAX_CLIENTS" in msg, msg
        first.set("k", b"v")                      # the admitted client is untouched


def test_a_jobs_store_is_sized_from_its_world_size(monkeypatch):
    monkeypatch.delenv("NCCLPY_STORE_MAX_CLIENTS", raising=False)
    assert StoreLimits.for_world(8).max_clients == 4096
    assert StoreLimits.for_world(8192).max_clients == 4 * 8192 + 64
    monkeypatch.setenv("NCCLPY_STORE_MAX_CLIENTS", "100")
    assert StoreLimits.for_world(8192).max_clients == 100   # the user's word wins


def test_store_sockets_have_tcp_keepalive(server):
    c = TCPStore("127.0.0.1", server.port, timeout=5)
    s = c._sock
    assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


def test_a_sigstopped_store_host_is_found_by_the_probe_not_by_the_gets_timeout(proc):
    """A get in flight on a store whose process is then stopped: the probe finds it (TCP
    keepalive cannot: the kernel still answers) -- a StoreConnectionError saying so, not the
    get's StoreTimeout after 300 s -- once the store had probe_after + probe_timeout seconds
    to answer the get or the probe (a busy store would have), never sooner."""
    c = TCPStore("127.0.0.1", proc.port, timeout=300)
    c.set("up", b"1")
    got = []

    def wait() -> None:
        t0 = time.monotonic()
        try:
            c.get("never-set", timeout=300)
        except Exception as e:   # noqa: B902 - the result is asserted below
            got.append((e, time.monotonic() - t0))
    t = threading.Thread(target=wait)
    t.start()
    # the get is in flight (parked, or its request still in the stopped server's socket
    # buffer: the kernel holds it either way, and it is never answered)
    wait_until(c._lock.locked, "the get in flight")
    proc.stop()
    t.join(HANG)
    assert got, f"the get did not end within {HANG} s (its timeout: 300 s)"
    e, took = got[0]
    assert isinstance(e, StoreConnectionError), (e, took)
    assert took >= c.probe_after + c.probe_timeout - 0.1, (e, took)
    assert "answered neither this call" in str(e) and "stopped (SIGSTOP), frozen" in str(e)
    assert "'never-set'" in str(e)


def test_a_busy_store_answers_the_probe_and_the_call_waits_on(server):
    """A get parked longer than probe_after is probed; the store answers every probe, so the
    get waits on: it ends with the server's own timeout reply after its 2.5 s (not a probe's
    verdict, not sooner), and a set made after a probe still wakes a parked get."""
    c = TCPStore("127.0.0.1", server.port, timeout=30)
    c.probe_after, c.probe_timeout = 0.3, 1.0
    probes = []                                   # probes the store answered
    real_probe = c._probe

    def probe(*a):
        real_probe(*a)                            # raises if the store did not answer
        probes.append(time.monotonic())
    c._probe = probe
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="timed out after"):
        c.get("never-set", timeout=2.5)
    assert 2.4 <= time.monotonic() - t0 < HANG    # waited its time out, no hang
    assert c._prober is None                      # the probe connection lived only meanwhile
    assert probes and server.served == 1 + len(probes)   # the get and its probes (PINGs)
    n = len(probes)

    def late() -> None:
        wait_until(lambda: len(probes) > n, "a probe of the parked get")
        TCPStore("127.0.0.1", server.port).set("late", b"1")
    th = threading.Thread(target=late)
    th.start()
    assert c.get("late", timeout=HANG) == b"1"    # a set after a probe still wakes it
    th.join(HANG)


def test_a_slow_reply_keeps_the_connection(proc):
    """A call that timed out after its request was sent leaves the reply owed: the next call
    skips it, on the same connection (no reconnect storm on an overloaded store)."""
    c = TCPStore("127.0.0.1", proc.port, timeout=0.5)
    c.set("k", b"old")
    sock = c._sock
    proc.stop()
    with pytest.raises(StoreTimeout, match="no reply from the store"):
        c.set("k", b"new")
    assert c._sock is sock and c._owed == 1
    proc.cont()
    assert c.get("k", timeout=5) == b"new"        # not the owed reply of the set
    assert c._sock is sock and c._owed == 0
    c.add("n", 1)
    assert c.add("n", 1) == 2


def test_a_beat_with_its_own_timeout_never_changes_the_shared_clients_timeout(server):
    """The watchdog's short beats share the process's client with the main thread: a beat's
    bound is its own, the client's ``timeout`` (what every other thread's call uses) stays."""
    c = TCPStore("127.0.0.1", server.port, timeout=5)
    seen = []
    real = c._call

    def spy(*a, **k):
        seen.append(c.timeout)
        return real(*a, **k)
    c._call = spy
    c.beat("t", 0, 1, 1.0, b"x", timeout=0.2)
    assert seen == [5.0] and c.timeout == 5.0
