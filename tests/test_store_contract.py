"""The store's contract, pinned (issue 40): a wait on several keys, the barrier over ncclpy's
store and over plain key stores (torch's TCPStore and FileStore, and ncclpy's adapter of them),
and what a straggler sees.  The authentication handshake is in ``test_store_auth.py``.

Nothing here waits for a fixed time and expects it to have been enough: a parked request is
seen parked on the server before the test goes on, "still blocked" is read off the socket with
a zero timeout after a round trip that follows the write that could have released it, and every
other bound is a bound on a hang.  Where a call must time out its timeout is short and only
what it reports is asserted.
"""
from __future__ import annotations

import datetime
import select
import socket
import threading
import time
from typing import Callable, List

import pytest

from ncclpy.errors import StoreTimeout
from ncclpy.store import TCPStore, barrier
from ncclpy.store import protocol as P
from ncclpy.store.protocol import Op, Status
from store_util import U32, frame, raw, read_reply, run_threads

pytestmark = pytest.mark.timeout(120)

HANG = 30.0      # seconds: only ever a bound on a hang


def _parked(server, keys: List[str]) -> None:
    """Return once the server holds a parked waiter on every one of ``keys``."""
    want = [k.encode() for k in keys]
    deadline = time.monotonic() + HANG
    while not all(k in server._waiters for k in want):
        assert time.monotonic() < deadline, f"no waiter parked on {keys} after {HANG} s"
        time.sleep(0.002)


def _park_wait(server, keys: List[str], timeout_ms: int) -> socket.socket:
    """A raw connection whose WAIT on ``keys`` is parked on the server."""
    s = raw(server)
    s.sendall(frame(Op.WAIT, U32(timeout_ms) + P.pack_keys([k.encode() for k in keys])))
    _parked(server, keys)
    return s


def _answered(s: socket.socket) -> bool:
    """Whether a reply has arrived on ``s`` (never waits)."""
    return bool(select.select([s], [], [], 0)[0])


# ---------------------------------------------------------------------------- wait on keys
def test_a_parked_wait_returns_only_once_every_key_exists(server, store):
    """Each write that creates one of the keys (set, compare_set, add) leaves the wait parked
    until the last one; the round trip after each write proves the server handled it (it wakes
    waiters right after answering the writer, on its one thread)."""
    s = _park_wait(server, ["w/a", "w/b", "w/c"], 60_000)
    try:
        store.set("w/a", b"1")
        store.ping()
        assert not _answered(s), "the wait returned when only w/a existed"
        store.compare_set("w/b", b"", b"2")       # a missing key matches b"": created
        store.ping()
        assert not _answered(s), "the wait returned when w/c was still missing"
        store.add("w/c", 1)                       # the last key, created by a counter
        assert read_reply(s, HANG) == (Status.OK, b"")
    finally:
        s.close()


def test_a_wait_on_keys_that_all_exist_returns_at_once_and_a_missing_one_keeps_it(store):
    store.set("x/1", b"")
    store.add("x/2", 5)
    store.wait(["x/1", "x/2"], timeout=0)          # 0: do not wait at all; nothing is missing
    store.wait("x/1", datetime.timedelta(seconds=0))   # one key, torch's timedelta form
    with pytest.raises(StoreTimeout) as ei:
        store.wait(["x/1", "x/3", "x/2"], timeout=0)
    msg = str(ei.value)
    assert "'x/3'" in msg and "'x/1'" not in msg and "'x/2'" not in msg


def test_a_timed_out_wait_names_only_the_keys_still_missing(server, store):
    """Parked on three keys, one of them written while it waits: the timeout names the other
    two, through the client's error."""
    got: List[BaseException] = []

    def waiter() -> None:
        with TCPStore(*server.address, timeout=HANG) as c:
            try:
                c.wait(["m/x", "m/y", "m/z"], timeout=3.0)
            except BaseException as e:   # noqa: B902 - inspected below
                got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    _parked(server, ["m/x", "m/y", "m/z"])
    store.set("m/y", b"")
    store.ping()
    assert t.is_alive() or got, "the wait returned although m/x and m/z never existed"
    t.join(HANG)
    assert not t.is_alive()
    assert len(got) == 1 and isinstance(got[0], StoreTimeout), got
    msg = str(got[0])
    assert "'m/x', 'm/z'" in msg, msg
    assert "'m/y'" not in msg, f"m/y was written while the wait was parked: {msg}"
    assert f"{server.host}:{server.port}" in msg


# ---------------------------------------------------------------------------- the barrier
class _Kind:
    """One kind of store the barrier runs over: ``open(rank)`` a store for a rank (each rank
    its own client, as separate processes would have), ``count_key(tag)`` the key that counts
    arrivals on that kind's path, ``close()``."""

    def __init__(self, name: str, tmp_path, server) -> None:
        self.name, self.opened = name, []
        self.count_key = lambda tag: f"ncclpy/barrier/{tag}/arrived"
        if name.startswith("ncclpy"):
            self.address = server.address
            if name == "ncclpy":
                self.count_key = lambda tag: f"ncclpy/barrier/{tag}/count"
            return
        dist = pytest.importorskip("torch.distributed")
        self.dist = dist
        if name == "torch-file":
            self.path = str(tmp_path / "filestore")
        else:
            self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=HANG))

    def open(self, rank: int):
        if self.name.startswith("ncclpy"):
            s = TCPStore(*self.address, timeout=HANG)
            if self.name == "ncclpy-keys":       # a server without ARRIVE: built from keys
                s.server_flags &= ~P.FLAG_ARRIVE
            self.opened.append(s)
            return s
        if self.name == "torch-file":
            return self.dist.FileStore(self.path, -1)
        s = self.dist.TCPStore("127.0.0.1", self.master.port, is_master=False,
                               timeout=datetime.timedelta(seconds=HANG))
        if self.name == "adapter":
            from ncclpy.rendezvous.torch_store import TorchStoreAdapter
            return TorchStoreAdapter(s, f"127.0.0.1:{self.master.port}", timeout=HANG)
        return s

    def close(self) -> None:
        for s in self.opened:
            s.close()


KINDS = ["ncclpy", "ncclpy-keys", "torch-tcp", "torch-file", "adapter"]


@pytest.fixture(params=KINDS)
def kind(request, tmp_path, server):
    k = _Kind(request.param, tmp_path, server)
    yield k
    k.close()


def _wait_count(store, key: str, want: int) -> None:
    """Return once the counter ``key`` reached ``want`` (the ranks counted themselves in)."""
    deadline = time.monotonic() + HANG
    while int(store.add(key, 0)) < want:
        assert time.monotonic() < deadline, f"{key} stayed below {want}"
        time.sleep(0.005)


def test_no_rank_leaves_the_barrier_while_one_is_missing(kind):
    """Two of three ranks arrive, the third never does: neither returns; each times out with
    a StoreTimeout that names the tag, its rank and how many arrived."""
    world = 3

    def early(rank: int) -> Callable[[], None]:
        s = kind.open(rank)
        return lambda: barrier(s, rank, world, tag="short", timeout=1.0)

    errors = run_threads([early(0), early(1)])
    assert len(errors) == 2, f"a rank left a barrier that one rank never reached: {errors}"
    for e in errors:
        assert isinstance(e, StoreTimeout), repr(e)
        msg = str(e)
        assert "barrier 'short'" in msg and "2 of 3 ranks arrived" in msg, msg
    assert {"rank 0" in str(e) for e in errors} == {True, False}   # each names its own rank


def test_a_late_rank_releases_the_others_every_generation(kind):
    """Three generations on one tag, each with another rank late: the late rank arrives only
    after the other two have counted themselves in, and none of them leaves before it arrived;
    then all three leave."""
    world, rounds = 3, 3
    stores = [kind.open(r) for r in range(world)]
    watcher = kind.open(0)
    for g in range(rounds):
        late = g % world
        arrived = threading.Event()
        early_left: List[bool] = []

        def run(rank: int) -> None:
            if rank == late:
                _wait_count(watcher, kind.count_key("late"), g * world + world - 1)
                arrived.set()
            barrier(stores[rank], rank, world, tag="late", timeout=HANG)
            if rank != late:
                early_left.append(arrived.is_set())

        errors = run_threads([lambda r=r: run(r) for r in range(world)])
        assert not errors, errors
        assert early_left == [True, True], f"generation {g}: a rank left before rank {late} " \
                                           f"arrived"


def test_a_straggler_after_the_others_timed_out(kind):
    """What a straggler sees: ranks 0 and 1 gave up (StoreTimeout); rank 2 arrives after.
    Arrivals stay counted when a wait times out, so its arrival completes the generation the
    others abandoned and it returns without an error -- the documented reason a timed-out tag
    must not be reused.  On a new tag the three meet again."""
    world = 3
    stores = [kind.open(r) for r in range(world)]
    errors = run_threads([lambda r=r: barrier(stores[r], r, world, tag="gone", timeout=0.5)
                       for r in (0, 1)])
    assert len(errors) == 2 and all(isinstance(e, StoreTimeout) for e in errors), errors
    assert int(stores[2].add(kind.count_key("gone"), 0)) == 2    # both arrivals still count
    barrier(stores[2], 2, world, tag="gone", timeout=HANG)         # completes generation 0
    assert int(stores[2].add(kind.count_key("gone"), 0)) == 3
    assert not run_threads([lambda r=r: barrier(stores[r], r, world, tag="again", timeout=HANG)
                         for r in range(world)])
