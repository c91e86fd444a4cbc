"""The contract of ncclpy/store/sync.py, pinned (the mutation run's target ``store_sync``,
docs/testing.md): which barrier a store gets, what each barrier leaves on the store, who waits
for whom, what a timeout says, and the helpers the debug tools share (``delete_key``,
``wait_key``, ``is_timeout``, the hand-over of ``count_out`` / ``wait_counted_out``).

Multi-rank cases run each rank in a thread with a client of its own (what separate processes
would have); every deadline is a bound on a hang. The barrier's behaviour when a rank is missing
or late, over every kind of store, is in test_store_contract.py.
"""
from __future__ import annotations

import datetime
import threading
import types
from typing import List

import pytest

from ncclpy.errors import ArgumentError, StoreTimeout
from ncclpy.store import TCPStore, barrier
from ncclpy.store import protocol as P
from ncclpy.store import sync
from ncclpy.store.sync import count_out, delete_key, is_timeout, wait_counted_out, wait_key
from store_util import HANG, run_threads

pytestmark = pytest.mark.timeout(120)


class KeysView:
    """A duck-typed store (not a TCPStore): the barrier takes its key-based path. ``server``
    is that of the wrapped client (set: this rank hosts the store)."""

    def __init__(self, store) -> None:
        self.store, self.server = store, getattr(store, "server", None)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _keys(store: TCPStore, candidates: List[str]) -> List[str]:
    return [k for k in candidates if store.check([k])]


# ---------------------------------------------------------------------------- delete_key
class _OnlyDeleteKey:
    def __init__(self) -> None:
        self.deleted: List[str] = []

    def delete_key(self, key):
        self.deleted.append(key)


class _OnlyDelete:
    def __init__(self) -> None:
        self.deleted: List[str] = []

    def delete(self, key):
        self.deleted.append(key)


class _FailingDelete:
    def delete_key(self, key):
        raise RuntimeError("the store went away")


def test_delete_key_uses_whichever_delete_the_store_has(store):
    store.set("k", b"v")
    delete_key(store, "k")
    assert not store.check(["k"])
    for s in (_OnlyDeleteKey(), _OnlyDelete()):
        delete_key(s, "x")
        assert s.deleted == ["x"], type(s).__name__
    delete_key(object(), "x")            # a store without either keeps the key: no error
    delete_key(_FailingDelete(), "x")    # cleanup only: a failure is not raised


# ---------------------------------------------------------------------------- wait_key
class _TorchLike:
    """Like torch's stores: ``get`` takes no timeout (and would block for the store's own);
    ``wait`` takes a timedelta. Records the bounds it was given."""

    def __init__(self, data) -> None:
        self.data, self.waits = dict(data), []

    def get(self, key):
        if key not in self.data:
            raise AssertionError("get() before a bounded wait: would block for the store's "
                                 "own timeout")
        return self.data[key]

    def wait(self, keys, timeout):
        self.waits.append((list(keys), timeout))
        if not all(k in self.data for k in keys):
            raise RuntimeError("Wait timeout")


def test_wait_key_returns_the_value_on_ncclpys_store(server, store):
    store.set("here", b"v1")
    assert wait_key(store, "here", HANG) == b"v1"
    with TCPStore(*server.address, timeout=HANG) as writer:
        t = threading.Timer(0.05, writer.set, args=("later", b"v2"))
        t.start()
        try:
            assert wait_key(store, "later", HANG) == b"v2"
        finally:
            t.join(HANG)
    with pytest.raises(StoreTimeout):
        wait_key(store, "never", 0.1)


def test_wait_key_bounds_a_torch_style_store_by_its_own_timeout():
    s = _TorchLike({"k": b"v"})
    assert wait_key(s, "k", 2.5) == b"v"
    assert s.waits == [(["k"], datetime.timedelta(seconds=2.5))]
    with pytest.raises(RuntimeError, match="Wait timeout") as ei:
        wait_key(s, "missing", 0.5)
    assert is_timeout(ei.value)
    assert s.waits[-1] == (["missing"], datetime.timedelta(seconds=0.5))


# ---------------------------------------------------------------------------- is_timeout
class _Late(StoreTimeout):
    pass


class _DeadlineTimeoutThing(Exception):
    pass


@pytest.mark.parametrize("err, want", [
    (_Late("x"), True),                                  # by its class only
    (TimeoutError(), True),
    (_DeadlineTimeoutThing("x"), True),                  # by its class's name only
    (RuntimeError("Socket Timed Out"), True),            # "timed out" in the message only
    (RuntimeError("Timeout waiting for key"), True),     # "timeout" in the message only
    (RuntimeError("connection reset by peer"), False),
    (ValueError("bad value"), False),
])
def test_is_timeout_recognises_each_sign_of_a_timeout_on_its_own(err, want):
    assert is_timeout(err) is want


# ---------------------------------------------------------------------------- barrier arguments
@pytest.mark.parametrize("rank, world, msg", [
    ("0", 2, "rank: expected int, got str"),
    (True, 2, "rank: expected int, got bool"),
    (0.0, 2, "rank: expected int, got float"),
    (0, "2", "world_size: expected int, got str"),
    (0, False, "world_size: expected int, got bool"),
    (0, 0, "rank/world_size: expected 0 <= rank < world_size, got rank=0, world_size=0"),
    (-1, 2, "rank/world_size: expected 0 <= rank < world_size, got rank=-1, world_size=2"),
    (2, 2, "rank/world_size: expected 0 <= rank < world_size, got rank=2, world_size=2"),
    (0, -3, "rank/world_size: expected 0 <= rank < world_size, got rank=0, world_size=-3"),
])
def test_barrier_refuses_bad_ranks_and_world_sizes_before_touching_the_store(rank, world, msg):
    s = _TorchLike({})        # any call on it would fail the test differently
    with pytest.raises(ArgumentError) as ei:
        barrier(s, rank, world)
    assert str(ei.value) == msg
    assert s.waits == []


@pytest.mark.parametrize("timeout", [-1, -0.001, float("nan")])
def test_barrier_refuses_a_negative_or_nan_timeout(store, timeout):
    with pytest.raises(ArgumentError) as ei:
        barrier(store, 0, 1, timeout=timeout)
    assert str(ei.value) == f"timeout: expected >= 0 seconds or None, got {timeout!r}"
    assert store.num_keys() == 0


def test_the_smallest_valid_arguments_pass(store):
    """A world of one, rank 0, a zero timeout: its own arrival completes it, nothing to wait
    for (the last rank of a larger world passes in every multi-rank test below)."""
    barrier(store, 0, 1, timeout=0)
    barrier(store, 0, 1, timeout=0.0)
    barrier(KeysView(store), 0, 1, timeout=0)


# ---------------------------------------------------------------------------- which barrier
def test_the_barrier_is_held_by_the_server_when_it_serves_arrive_else_built_from_keys(server):
    """ncclpy's store with ARRIVE: the server-held barrier (counter ``count``); the same store
    without it, or any other store: the barrier from keys (counter ``arrived``)."""
    candidates = ["ncclpy/barrier/{}/count", "ncclpy/barrier/{}/arrived"]
    with TCPStore(*server.address, timeout=HANG) as s:
        assert s.supports_arrive
        barrier(s, 0, 1, tag="held")
        assert _keys(s, [c.format("held") for c in candidates]) == ["ncclpy/barrier/held/count"]
        barrier(KeysView(s), 0, 1, tag="duck")
        assert _keys(s, [c.format("duck") for c in candidates]) == [
            "ncclpy/barrier/duck/arrived"]
    with TCPStore(*server.address, timeout=HANG) as s:
        s.server_flags &= ~P.FLAG_ARRIVE        # a server that does not serve ARRIVE
        assert not s.supports_arrive
        barrier(s, 0, 1, tag="old")
        assert _keys(s, [c.format("old") for c in candidates]) == ["ncclpy/barrier/old/arrived"]


# ---------------------------------------------------------------------------- what stays behind
def test_a_world_of_one_counts_each_arrival_and_leaves_nothing_else(server):
    """Each call of a one-rank barrier is counted (the count a timed-out rank would report)
    and nothing else is left on the store, on either path: no key per call accumulates."""
    with TCPStore(*server.address, timeout=HANG) as s:
        for _ in range(4):
            barrier(s, 0, 1, tag="one")
            barrier(KeysView(s), 0, 1, tag="onek")
        assert s.get("ncclpy/barrier/one/count") == b"4"
        assert s.get("ncclpy/barrier/onek/arrived") == b"4"
        assert s.num_keys() == 2


def test_a_hosting_world_of_one_leaves_only_its_counters():
    """The rank hosting the store, alone: on the server path only the arrival count (it has
    nobody to wait out); on the key path the count and the last generation's ``gone``."""
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=HANG) as host:
        for _ in range(3):
            barrier(host, 0, 1, tag="h")
        assert host.num_keys() == 1 and host.get("ncclpy/barrier/h/count") == b"3"
        for _ in range(3):
            barrier(KeysView(host), 0, 1, tag="hk")
        assert host.num_keys() == 3
        assert host.get("ncclpy/barrier/hk/arrived") == b"3"
        assert host.check(["ncclpy/barrier/hk/gone/2"])


@pytest.mark.parametrize("path", ["server", "keys"])
def test_rounds_of_a_world_leave_only_the_counters_behind(server, path):
    """After every generation the store holds the arrival counter and, on the server path,
    the count-out counter (each rank counted once per generation); on the key path the last
    generation's ``gone`` key: every ``done``, ``left`` and older ``gone`` is cleaned up."""
    world, rounds = 3, 3
    stores = [TCPStore(*server.address, timeout=HANG) for _ in range(world)]
    try:
        views = stores if path == "server" else [KeysView(s) for s in stores]

        def rank_fn(rank: int) -> None:
            for _ in range(rounds):
                barrier(views[rank], rank, world, tag="r", timeout=HANG)

        assert not run_threads([lambda r=r: rank_fn(r) for r in range(world)])
        s = stores[0]
        if path == "server":
            assert s.get("ncclpy/barrier/r/count") == b"9"
            assert s.get("ncclpy/barrier/r/out") == b"9"
            assert s.num_keys() == 2
        else:
            assert s.get("ncclpy/barrier/r/arrived") == b"9"
            assert s.check(["ncclpy/barrier/r/gone/2"])
            assert s.num_keys() == 2
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize("path", ["server", "keys"])
def test_the_hosting_rank_passes_with_the_others_every_generation(path):
    """Rank 0 hosts the store: every rank passes every generation, and the hosting rank's
    bookkeeping agrees (each generation every rank arrived once and counted out once)."""
    world, rounds = 3, 3
    host = TCPStore("127.0.0.1", 0, is_server=True, timeout=HANG)
    others = [TCPStore("127.0.0.1", host.port, timeout=HANG) for _ in range(world - 1)]
    try:
        stores = [host] + others
        views = stores if path == "server" else [KeysView(s) for s in stores]

        def rank_fn(rank: int) -> None:
            for _ in range(rounds):
                barrier(views[rank], rank, world, tag="hp", timeout=10)

        assert not run_threads([lambda r=r: rank_fn(r) for r in range(world)])
        if path == "server":
            assert host.get("ncclpy/barrier/hp/count") == b"9"
            assert host.get("ncclpy/barrier/hp/out") == b"9"
        else:
            assert host.get("ncclpy/barrier/hp/arrived") == b"9"
        assert host.num_keys() == 2
    finally:
        for s in others:
            s.close()
        host.close()


# ---------------------------------------------------------------------------- timeouts
def test_a_timed_out_rank_counts_the_arrivals_of_its_own_generation(server):
    """After one full generation of two, a lone rank of the next times out: "1 of 2 ranks
    arrived" (its generation's, not the tag's total), on either path."""
    for view, tag in ((lambda s: s, "g"), (KeysView, "gk")):
        a = TCPStore(*server.address, timeout=HANG)
        b = TCPStore(*server.address, timeout=HANG)
        try:
            assert not run_threads([lambda: barrier(view(a), 0, 2, tag=tag, timeout=HANG),
                                 lambda: barrier(view(b), 1, 2, tag=tag, timeout=HANG)])
            with pytest.raises(StoreTimeout) as ei:
                barrier(view(a), 0, 2, tag=tag, timeout=0.2)
            msg = str(ei.value)
            assert msg.startswith(f"barrier {tag!r}") and "timed out on rank 0: 1 of 2 ranks "\
                "arrived; every rank must call it with the same tag and world_size" in msg, msg
        finally:
            a.close()
            b.close()


class _Broken:
    """A duck store whose wait fails with ``err``; ``add(key, 0)`` (the arrivals count a
    timeout message reports) fails too."""

    def __init__(self, err: BaseException) -> None:
        self.err = err

    def add(self, key, amount):
        if amount == 0:
            raise RuntimeError("the store went away")
        return 1

    def set(self, key, value):
        pass

    def wait(self, keys, timeout=None):
        raise self.err


def test_a_store_timeout_becomes_the_barriers_timeout_and_other_errors_pass_through():
    with pytest.raises(StoreTimeout) as ei:
        barrier(_Broken(RuntimeError("Wait timeout after 1s")), 0, 2, tag="t", timeout=1)
    assert str(ei.value).startswith(
        "barrier 't' (generation 0) timed out on rank 0: arrivals unknown, world_size 2; "
        "every rank must call it with the same tag and world_size")
    assert str(ei.value).endswith("; Wait timeout after 1s")
    err = ConnectionResetError("connection reset by peer")
    with pytest.raises(ConnectionResetError) as ei2:
        barrier(_Broken(err), 0, 2, tag="t", timeout=1)
    assert ei2.value is err


# ---------------------------------------------------------------------------- the hand-over
def test_the_writer_waits_until_every_reader_counted_out(server, store):
    """wait_counted_out returns only once ``want`` readers counted out: they count out here
    only after the writer has looked (and found them missing) at least once."""
    polls = threading.Event()
    real_add = store.add

    class Spy:
        def add(self, key, amount):
            v = real_add(key, amount)
            polls.set()
            return v

    def readers():
        assert polls.wait(HANG)
        with TCPStore(*server.address, timeout=HANG) as r:
            count_out(r, "out")
            count_out(r, "out")

    t = threading.Thread(target=readers)
    t.start()
    try:
        wait_counted_out(Spy(), "out", 2, HANG, "the hand-over")
        assert store.get("out") == b"2"
    finally:
        t.join(HANG)


def test_exactly_want_readers_is_enough(store):
    count_out(store, "o")
    count_out(store, "o")
    wait_counted_out(store, "o", 2, 5.0, "the hand-over")   # 5 s: a bound on a hang
    wait_counted_out(store, "o", 1, 5.0, "the hand-over")


def test_readers_that_never_count_out_time_the_writer_out_naming_how_many(store):
    count_out(store, "few")
    with pytest.raises(StoreTimeout) as ei:
        wait_counted_out(store, "few", 3, 0.2, "the settings comparison")
    assert str(ei.value) == ("the settings comparison: 'few': 2 of 3 readers had not finished "
                             "after 0.2 s")


class _Clock:
    def __init__(self) -> None:
        self.now = 500.0
        self.pauses: List[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.now += s


class _CountsLate:
    """``add(key, 0)`` reads 0 for the first ``late`` polls, then ``want``."""

    def __init__(self, late: int, want: int) -> None:
        self.late, self.want, self.polls = late, want, 0

    def add(self, key, amount):
        self.polls += 1
        return 0 if self.polls <= self.late else self.want


def test_the_writer_polls_from_1_ms_doubling_to_50_ms(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sync, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                            sleep=clock.sleep))
    s = _CountsLate(10, 2)
    wait_counted_out(s, "k", 2, 60.0, "w")
    assert clock.pauses == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05,
                                          0.05, 0.05, 0.05])
    assert s.polls == 11


def test_the_writers_deadline_counts_from_its_start(monkeypatch):
    """The deadline is ``timeout`` after the call: the polls go on until then (the last pause
    crossing it), then the writer gives up."""
    clock = _Clock()
    monkeypatch.setattr(sync, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                            sleep=clock.sleep))
    with pytest.raises(StoreTimeout, match=r"^w: 'k': 2 of 2 readers had not finished after "
                                           r"0\.1 s$"):
        wait_counted_out(_CountsLate(10 ** 6, 2), "k", 2, 0.1, "w")
    assert sum(clock.pauses[:-1]) < 0.1 <= sum(clock.pauses)


class _HostLeftAlone:
    """A duck store of the hosting rank (``server`` set) in a world of two: the other rank
    arrived (so ``done`` is reached), but it never counts out: the wait for ``gone`` fails
    with ``err``."""

    server = object()

    def __init__(self, err: BaseException) -> None:
        self.err, self.waited = err, []

    def add(self, key, amount):
        return 2 if key.endswith("/arrived") else 1

    def set(self, key, value):
        pass

    def wait(self, keys, timeout=None):
        self.waited.extend(keys)
        if keys[0].startswith("ncclpy/barrier/t/gone/"):
            raise self.err


def test_the_hosting_rank_names_the_ranks_that_never_left_on_a_timeout_only():
    s = _HostLeftAlone(RuntimeError("Wait timeout after 1s"))
    with pytest.raises(StoreTimeout) as ei:
        barrier(s, 0, 2, tag="t", timeout=1)
    assert str(ei.value) == ("barrier 't' (generation 0): rank 0 hosts the store and timed out "
                             "waiting for every rank to leave; Wait timeout after 1s")
    assert s.waited == ["ncclpy/barrier/t/done/0", "ncclpy/barrier/t/gone/0"]
    err = ConnectionResetError("connection reset by peer")
    with pytest.raises(ConnectionResetError) as ei2:
        barrier(_HostLeftAlone(err), 0, 2, tag="t", timeout=1)
    assert ei2.value is err
