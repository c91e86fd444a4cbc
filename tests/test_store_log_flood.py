"""A flood of bad connections costs the store server's log a few lines, not one per connection:
the first few warnings per kind and client host in an interval are logged in full, the rest are
counted and summed up in one line per interval, and the counts are true. Real sockets on
loopback; the flood is bounded in count and time."""
from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest

from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import protocol as P
from ncclpy.store.loglimit import LogLimiter
from store_util import HANG, assert_healthy

pytestmark = pytest.mark.timeout(120)

PER_KIND = 300          # bad connections of each kind
THREADS = 4
KINDS = {
    "protocol error": P.REQ_HEADER.pack(0x7F, 0),                 # unknown opcode
    "oversized request": P.REQ_HEADER.pack(P.Op.SET, 0xFFFFFFFF),  # announces 4 GiB
}
SUMMARY = re.compile(r"(\d+) more warnings in the last")


def _bad_connection(addr, payload: bytes) -> None:
    """Connect, send one bad frame, wait for the server to close (bounded)."""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(payload)
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass


def _flood(addr, deadline: float) -> dict:
    """PER_KIND bad connections of each kind from THREADS threads; the counts actually sent."""
    sent = {k: 0 for k in KINDS}
    lock = threading.Lock()
    errors = []

    def worker(i: int) -> None:
        try:
            for kind, payload in KINDS.items():
                for _ in range(PER_KIND // THREADS):
                    if time.monotonic() > deadline:
                        return
                    _bad_connection(addr, payload)
                    with lock:
                        sent[kind] += 1
        except BaseException as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors[:3]
    return sent


FULL = {"protocol error": "protocol error from", "oversized request": "announces"}


def _counts(records, kind: str):
    """(warnings of ``kind`` logged in full, those summed up in summary lines)."""
    full = summed = 0
    for r in records:
        msg = r.getMessage()
        if SUMMARY.search(msg):
            m = re.search(re.escape(kind) + r": (\d+) from", msg)
            summed += int(m.group(1)) if m else 0
        elif FULL[kind] in msg:
            full += 1
    return full, summed


def _pending(srv: StoreServer) -> int:
    logs = getattr(srv, "_logs", None)
    return 0 if logs is None else logs.suppressed


def test_a_flood_of_bad_frames_logs_a_bounded_number_of_lines_with_true_counts(caplog,
                                                                                 monkeypatch):
    monkeypatch.setattr(StoreServer, "log_interval", 2.0, raising=False)
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    with StoreServer() as srv, TCPStore(*srv.address, timeout=10) as good:
        start = time.monotonic()
        sent = _flood(srv.address, start + 60)
        elapsed = time.monotonic() - start
        assert sum(sent.values()) >= 100, sent        # a real flood, however slow the machine
        # the summary of the last interval comes by itself once it ends: no traffic needed
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            if _pending(srv) == 0 and all(
                    sum(_counts(caplog.records, k)) >= n for k, n in sent.items()):
                break
            time.sleep(0.05)
        records = list(caplog.records)
        assert_healthy(srv, good)
    windows = int(elapsed / 2.0) + 2
    bound = windows * (len(KINDS) * getattr(srv, "log_burst", 5) + 1)
    assert len(records) <= bound, (len(records), bound, sent, elapsed)
    assert len(records) < sum(sent.values()) / 4, (len(records), sent)
    for kind, n in sent.items():
        full, summed = _counts(records, kind)
        assert full >= 1, kind                     # the first ones are logged in full
        assert full + summed == n, (kind, full, summed, n)
    summaries = [r for r in records if SUMMARY.search(r.getMessage())]
    assert summaries and all("127.0.0.1" in r.getMessage() for r in summaries)


def test_closing_the_server_flushes_the_pending_summary(caplog):
    caplog.set_level(logging.WARNING, logger="ncclpy.store")
    srv = StoreServer().start()          # default interval: the summary is still pending
    try:
        for _ in range(12):
            _bad_connection(srv.address, KINDS["protocol error"])
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline and sum(_counts(caplog.records, "protocol error")) + (
                _pending(srv)) < 12:
            time.sleep(0.02)
    finally:
        srv.close()
    full, summed = _counts(caplog.records, "protocol error")
    assert (full, summed) == (5, 7)


def test_the_limiter_counts_per_kind_and_host_and_summarises_each_interval():
    now = [100.0]
    records = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("test.loglimit")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = ListHandler()
    logger.addHandler(handler)
    scheduled = []
    try:
        lim = LogLimiter(logger, burst=2, interval=10.0, schedule=scheduled.append,
                         clock=lambda: now[0])
        for i in range(5):
            lim.warn(None, "bad", f"10.0.0.1:{1000 + i}", "bad from %s", i)
        for i in range(3):
            lim.warn(None, "bad", f"[::1]:{2000 + i}", "bad v6 %s", i)
        lim.warn(None, "other", "10.0.0.1:1", "other")
        assert [r.getMessage().split(" (")[0] for r in records] == [
            "bad from 0", "bad from 1", "bad v6 0", "bad v6 1", "other"]
        assert "are counted and summarised" in records[1].getMessage()
        assert scheduled == [110.0] and lim.suppressed == 4
        now[0] = 105.0
        lim.flush_due()                       # not yet over
        assert len(records) == 5
        now[0] = 110.0
        lim.flush_due()
        assert len(records) == 6
        msg = records[-1].getMessage()
        assert msg.startswith("store server: 4 more warnings in the last 10.0 s"), msg
        assert "bad: 4 from 10.0.0.1, [::1]" in msg, msg
        lim.warn(None, "bad", "10.0.0.1:9", "again")   # a new interval: logged in full
        assert records[-1].getMessage() == "again" and lim.total == 10
        lim.flush()                           # nothing counted: no summary line
        assert len(records) == 7
    finally:
        logger.removeHandler(handler)
