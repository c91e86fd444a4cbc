"""One TCPStore shared by threads: a thread parked in get/wait never holds back another thread's
calls (issue 15). Real server, real sockets on loopback."""
from __future__ import annotations

import threading

import pytest

from ncclpy.errors import StoreConnectionError, StoreError
from ncclpy.store import StoreServer, TCPStore


@pytest.fixture()
def server():
    srv = StoreServer("127.0.0.1", 0).start()
    yield srv
    srv.close()


def _in_thread(fn, *args):
    """Run ``fn(*args)`` in a thread; returns (thread, box) with box['value'] or box['error']."""
    box: dict = {}

    def body():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # reported through the box
            box["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


def test_parked_get_does_not_block_another_threads_calls(server):
    store = TCPStore("127.0.0.1", server.port, timeout=30)
    try:
        parked, pbox = _in_thread(store.get, "late", 30)
        for _ in range(200):            # wait until the get really holds the main connection
            if store._lock.locked():
                break
            threading.Event().wait(0.01)
        assert store._lock.locked()

        def others():
            store.set("k", b"v")
            n = store.add("n", 5)
            store.wait(["k"], 5)
            return store.get("k"), n, store.check(["k", "n"])
        t, box = _in_thread(others)
        t.join(10)                      # would be 30 s (the parked get's timeout) behind one lock
        assert not t.is_alive() and box == {"value": (b"v", 5, True)}
        assert parked.is_alive()
        store.set("late", b"now")       # from a third call while the get is still parked
        parked.join(10)
        assert pbox == {"value": b"now"}
        assert len(store._spare_all) >= 1
    finally:
        store.close()


def test_single_thread_makes_no_spare_connection(server):
    with TCPStore("127.0.0.1", server.port, timeout=10) as store:
        for i in range(50):
            store.set(f"k{i}", b"x")
            assert store.get(f"k{i}") == b"x"
            store.add("c", 1)
        assert store._spare_all == []


def test_close_wakes_threads_parked_on_the_main_and_a_spare_connection(server):
    store = TCPStore("127.0.0.1", server.port, timeout=60)
    a, abox = _in_thread(store.get, "never-a", 60)
    for _ in range(200):
        if store._lock.locked():
            break
        threading.Event().wait(0.01)
    b, bbox = _in_thread(store.get, "never-b", 60)
    for _ in range(200):                # the second get is parked on a spare
        if store._spare_all and store._spare_all[0]._lock.locked():
            break
        threading.Event().wait(0.01)
    assert store._spare_all and store._spare_all[0]._lock.locked()
    store.close()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    for box in (abox, bbox):
        assert isinstance(box.get("error"), StoreError), box
    with pytest.raises(StoreConnectionError, match="closed"):
        store.set("x", b"y")
