"""The rank and launcher side of the control plane at scale (issue 26), on CPU with real servers:
the watchdog's decision rules over the heartbeat table (a late reply judges nobody, a peer that
never beat gets the start-up grace, the death epoch), one request per rank per beat, checked
mode's one vote per rank per call and no key left behind, the launchers' node watch on a slow
store, and bootstrap's one generation key per rank.
"""
from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from ncclpy.debug.checked import Checker, fingerprint, round_hashes
from ncclpy.debug.deaths import EPOCH_KEY, RANKS_KEY, publish_deaths, read_deaths
from ncclpy.errors import StoreError
from ncclpy.store import StoreServer, TCPStore
from ncclpy.store import tablewire as W
from ncclpy.debug.watchdog import Watchdog
from store_util import env as _env, wait_until
from watchdog_crowd import Work     # a call that waits until told done

pytestmark = pytest.mark.timeout(120)


class _Comm:
    """What the Watchdog needs of a communicator (stand-in: no NCCL)."""

    def __init__(self, rank: int, world: int, name: str = "cp", timeout: float = 60.0) -> None:
        self.rank, self.world_size, self.name = rank, world, name
        self._timeout, self._device, self._watch = timeout, 0, None
        self.decision: Any = None

    def _watchdog_abort(self, d: Any) -> None:
        self.decision = d


class _Slow:
    """A stand-in at the store boundary: the real store, each beat ``delay`` s late."""

    supports_tables = True

    def __init__(self, store: TCPStore, delay: float) -> None:
        self.store, self.delay = store, delay

    def beat(self, *a: Any, **k: Any) -> Any:
        time.sleep(self.delay)
        return self.store.beat(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0).start()
    yield srv
    srv.close()


def _peer_beats(port: int, group: str, rank: int, world: int, every: float, stop: threading.Event):
    c = TCPStore("127.0.0.1", port, timeout=5)
    n = 0
    try:
        while not stop.wait(every):
            n += 1
            c.beat(group, rank, world, 1.0, f"{n}:5".encode())
    except StoreError:
        if not stop.is_set():      # the store went away under a running test: a real failure
            raise
    finally:
        c.close()


def _watchdog(store: Any, rank: int, world: int, waiting: bool = True, **kw: Any) -> Watchdog:
    """A Watchdog (not its thread) whose rank has a call waiting since 1 s ago."""
    wd = Watchdog(_Comm(rank, world), store, interval=0.1, dead_after=0.6, **kw)
    wd._connect()
    if waiting:
        wd.queue.append(Work())
        wd.drain(time.monotonic() - 1.0)
    return wd


def test_a_late_reply_judges_nobody_and_the_store_is_called_slow(server, caplog):
    """Stale read != dead peer, rank side: rank 1 is silent for real and rank 0's call waits on
    it, but while rank 0's replies come late (the store is slow) nobody is named; once they
    come on time, rank 1 is, after one fresh read."""
    real = TCPStore("127.0.0.1", server.port, timeout=5)
    TCPStore("127.0.0.1", server.port, timeout=5).beat("ncclpy/cp/0/hb", 1, 2, 0.6, b"1:0")
    slow = _Slow(real, 0.3)                        # on time: 0.25 s (one interval, floored)
    wd = _watchdog(slow, 0, 2)
    caplog.set_level(logging.WARNING, logger="ncclpy.debug.heartbeat")
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        now = time.monotonic()
        wd.beat(now)
        assert wd.decide(now) is None and wd.peers == {}
    assert "store slow: a heartbeat to the store took 0.3" in caplog.text
    assert "no peer is judged from a late reply" in caplog.text
    assert caplog.text.count("store slow") == 1    # once a minute, the rest counted
    assert wd._heart.errors == 0 and wd._heart.late >= 3
    slow.delay = 0.0
    d = None
    before = wd.confirms
    for _ in range(10):                            # on time now (a loaded machine may need
        now = time.monotonic()                     # a second try)
        wd.beat(now)
        d = wd.decide(now)
        if d is not None:
            break
    assert d is not None and d.reason == "peer_silent" and d.suspects == (1,), d
    assert wd.confirms > before and "read afresh from the store" in d.message


def test_a_refused_heartbeat_is_an_error_counted_and_said_not_a_slow_store(server, caplog):
    """A request the store refuses (here: the table has 3 ranks, this rank says 2) is not
    slowness: it is counted as an error, logged with the store's words, judges nobody, and
    ncclpy status shows the count."""
    from ncclpy.debug.status import decode
    TCPStore("127.0.0.1", server.port, timeout=5).beat("ncclpy/cp/0/hb", 1, 3, 0.6, b"1:0")
    wd = _watchdog(TCPStore("127.0.0.1", server.port, timeout=5), 0, 2)
    caplog.set_level(logging.WARNING, logger="ncclpy.debug.heartbeat")
    for _ in range(3):
        wd.beat(time.monotonic())
    h = wd._heart
    assert (h.errors, h.late) == (3, 0) and "has 3 ranks; rank 0 says 2" in h.last_error
    assert "the store refused a heartbeat" in caplog.text and "store slow" not in caplog.text
    assert caplog.text.count("refused a heartbeat") == 1         # then once a minute
    p = decode(wd.progress(time.monotonic()))
    assert (p.refused, p.late, p.blind) == (3, 0, 0)


def test_a_peer_that_never_beat_gets_the_start_up_grace(server):
    stop = threading.Event()
    t = threading.Thread(target=_peer_beats, args=(server.port, "ncclpy/cp/0/hb", 1, 3, 0.1,
                                                   stop), daemon=True)
    t.start()
    try:
        wd = _watchdog(TCPStore("127.0.0.1", server.port, timeout=5), 0, 3, grace=1.5)
        t0 = wd.state.start                        # the grace counts from the watchdog's start
        d, before, now = None, None, t0
        while d is None and now - t0 < 60:         # 60: a hang's deadline
            before, now = now, time.monotonic()
            wd.beat(now)
            d = wd.decide(now)
            time.sleep(0.1)
    finally:
        stop.set()
        t.join(10)                 # before the server fixture closes the store under it
    # decided at the first look past the grace, not at the one before (whatever the load)
    assert d is not None and d.suspects == (2,) and before - t0 < 1.5 <= now - t0, \
        (d, before - t0, now - t0)
    assert "rank 2 never sent one in 1." in d.message


def test_one_request_per_rank_per_beat_and_the_death_epoch(server):
    """A beat is one request whatever the world size; a death costs one more read per rank."""
    c = TCPStore("127.0.0.1", server.port, timeout=5)
    for r in range(1, 64):
        c.beat("ncclpy/cp/0/hb", r, 64, 0.6, b"1:0")
    wd = _watchdog(TCPStore("127.0.0.1", server.port, timeout=5), 0, 64)
    before = server.served
    for _ in range(10):
        wd.beat(time.monotonic())
    assert server.served - before == 10
    launchers = [threading.Thread(target=publish_deaths, args=(
        TCPStore("127.0.0.1", server.port, timeout=5), [r], f"rank {r} was killed"))
        for r in (7, 42)]                           # two nodes' launchers at once
    for t in launchers:
        t.start()
    for t in launchers:
        t.join(10)
    assert read_deaths(c) == {7, 42} and int(c.get(EPOCH_KEY)) == 2
    assert c.get("ncclpy/dead/7") == b"rank 7 was killed"
    before = server.served
    now = time.monotonic()
    wd.beat(now)
    assert server.served - before == 2              # the beat, then the dead list once
    d = wd.decide(now, wd.dead())
    assert d.reason == "peer_dead" and d.suspects == (7, 42), d
    before = server.served
    wd.beat(time.monotonic())
    assert server.served - before == 1
    assert c.get(RANKS_KEY) == b"7,42"


def test_a_timeout_asks_once_who_never_issued_the_call_and_reads_no_whole_table(server):
    """On the way to a timeout a rank asks the store which ranks' counters are below the call
    (BEAT_BEHIND): one request per call, and a reply that lists those ranks only -- never the
    whole table (O(N) per rank: O(N^2) on the store when every rank times out at once)."""
    c = TCPStore("127.0.0.1", server.port, timeout=5)
    for r, issued in ((1, 4), (2, 9), (3, 9)):
        c.beat("ncclpy/cp/0/hb", r, 4, 0.6, f"9:{issued}".encode(), count=issued)
    wd = Watchdog(_Comm(0, 4, timeout=0.2), TCPStore("127.0.0.1", server.port, timeout=5),
                  interval=0.1, dead_after=30.0)
    wd._connect()
    for _ in range(6):
        wd.queue.append(Work())
    t0 = time.monotonic()
    wd.drain(t0)
    wd.beat(t0)
    assert wd.peers == {}                            # all fresh: nothing to judge
    before = server.served
    d = wd.decide(t0 + 0.5)
    assert server.served - before == 1 and wd._behind == (0, {}), wd._behind
    assert (d.reason, d.seq, d.suspects) == ("timeout", 0, (1, 2, 3)), d
    assert "every peer (1-3): all issued it" in d.message
    for w in wd.pending[:5]:
        w.done = True
    wd.drain(time.monotonic())                       # sequence 5 is the oldest now
    before = server.served
    d = wd.decide(time.monotonic() + 0.5)
    assert server.served - before == 1 and wd._behind == (5, {1: 4})
    assert (d.seq, d.suspects) == (5, (1,)) and "rank 1 issued 4" in d.message, d
    before = server.served
    wd.decide(time.monotonic() + 0.5)
    assert server.served == before                   # once per call
    rep = c.beat("ncclpy/cp/0/hb", 0, 4, 0.6, flags=W.BEAT_PEEK | W.BEAT_BEHIND, count=9)
    assert rep.nbehind == 4 and rep.full is None             # rank 0 beat with its 6 calls
    assert sorted(rep.behind) == [(0, 6), (1, 4), (2, 9), (3, 9)]


def test_verdicts_reached_at_once_all_report_the_first_ones_suspects(server):
    """Two ranks decide at about the same time, naming different ranks: the table keeps the
    first verdict, and the second rank reports that one's cause and suspects, so that every
    survivor agrees (e.g. on whom comm.shrink(exclude=err.suspects) excludes)."""
    from ncclpy.debug.watchdog import Decision
    a = _watchdog(TCPStore("127.0.0.1", server.port, timeout=5), 0, 8)
    b = _watchdog(TCPStore("127.0.0.1", server.port, timeout=5), 1, 8)
    a.beat(time.monotonic())
    b.beat(time.monotonic())
    first = a.act(Decision("peer_silent", "all_reduce", 0, (5,),
                           a.state._head() + ": no heartbeat from rank(s) 5; suspected: 5"))
    second = b.act(Decision("peer_silent", "all_reduce", 0, (5, 7),
                            b.state._head() + ": no heartbeat from rank(s) 5, 7; suspected"))
    assert first.suspects == (5,) and a.comm.decision is first
    assert (second.reason, second.suspects) == ("peer_aborted", (5,)), second
    assert "rank 0 aborted the communicator (peer_silent: no heartbeat from rank(s) 5)" in \
        second.message and b.comm.decision is second


def test_per_key_heartbeats_belong_to_one_generation(server):
    """On a store without the table (torch's), a verdict an earlier communicator of the same
    name left in its keys is never read as this one's: the keys carry the generation."""
    from ncclpy.debug.watchdog import Published

    class KeysOnly:
        supports_tables = False

        def __init__(self) -> None:
            self.s = TCPStore("127.0.0.1", server.port, timeout=5)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.s, name)
    old = Watchdog(_Comm(1, 2), KeysOnly(), interval=0.1, dead_after=0.6, group="ncclpy/cp/0/hb")
    old._connect()
    old.beat(time.monotonic())
    old.publish(Published(1, "abort", (), "the old one"))
    assert KeysOnly().get("ncclpy/cp/0/hb/1").startswith(b"closed\n")
    new = Watchdog(_Comm(0, 2), KeysOnly(), interval=0.1, dead_after=0.6, group="ncclpy/cp/1/hb")
    new._connect()
    new.queue.append(Work())
    new.drain(time.monotonic())
    new.beat(time.monotonic())
    assert new.published is None and new.decide(time.monotonic()) is None
    same = Watchdog(_Comm(0, 2), KeysOnly(), interval=0.1, dead_after=0.6,
                    group="ncclpy/cp/0/hb")
    same._connect()
    same.queue.append(Work())
    same.drain(time.monotonic())
    same.beat(time.monotonic())                       # the same generation: followed
    d = same.decide(time.monotonic())
    assert same.published.cause == "the old one" and d.reason == "peer_aborted", d


def test_a_real_stopped_rank_is_named_by_waiting_ranks_and_live_ranks_never_are(server):
    """Three processes with the real Watchdog thread, ranks 0 and 1 waiting in a call: once
    every rank beat, SIGSTOP rank 2; the others name it, and only it, as silent past the
    silence limit (1.5 s).  Each rank waits 30 s at most for a verdict (a hang's bound)."""
    code = (
        "import json, sys, time\n"
        "from ncclpy.store import TCPStore\nfrom ncclpy.watchdog import Watchdog\n"
        "class C:\n  name, _device, _watch, _timeout = 'live', 0, None, 60.0\n"
        "  rank, world_size, decision = int(sys.argv[2]), 3, None\n"
        "  def _watchdog_abort(self, d): self.decision = d\n"
        "class W:\n  _owned, _event, _error = False, object(), None\n"
        "  plan = type('P', (), {'collective': 'all_reduce', 'calls': ()})()\n"
        "  def is_completed(self): return False\n"
        "  def _reap(self, raising=False): return False\n"
        "c = C(); wd = Watchdog(c, TCPStore('127.0.0.1', int(sys.argv[1]), timeout=10), "
        "interval=0.2, dead_after=1.5).start()\nwd.queue.append(W())\nprint('up', flush=True)\n"
        "t0 = time.monotonic()\n"
        "while c.decision is None and time.monotonic() - t0 < 30: time.sleep(0.02)\n"
        "d = c.decision\nprint(json.dumps(d and {'s': list(d.suspects), 'm': d.message}), "
        "flush=True)\n")
    ps = [subprocess.Popen([sys.executable, "-c", code, str(server.port), str(r)],
                           stdout=subprocess.PIPE, text=True, env=_env()) for r in range(3)]
    try:
        for p in ps:
            assert p.stdout.readline().strip() == "up"

        def all_beat() -> bool:                  # rank 2 was seen: not a start-up grace case
            try:
                return any(not t.never for t in list(server._tables.values()))
            except RuntimeError:                 # the server thread changed the dict
                return False
        wait_until(all_beat, "every rank's first heartbeat")
        ps[2].send_signal(signal.SIGSTOP)
        res = [json.loads(p.stdout.readline()) for p in ps[:2]]
    finally:
        for p in ps:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
    for r in res:
        assert r is not None and r["s"] == [2], r
        assert float(re.search(r"rank 2 silent (\d+\.\d) s", r["m"]).group(1)) >= 1.5, r


def test_checked_mode_is_one_vote_per_rank_per_call_and_leaves_no_key(server):
    from ncclpy import Buffer
    from ncclpy.comm.resolver import Resolver
    from ncclpy.plan.types import PlanContext
    calls = 300
    stores = [TCPStore("127.0.0.1", server.port, timeout=30) for _ in range(2)]
    plans = [Resolver(PlanContext(r, 2)).resolve(
        "all_reduce", 0, Buffer(0x100000, 16, "float32", 0), None, ("sum",)).plan
        for r in range(2)]
    before_keys, before = server.num_keys, server.served

    def rank(r: int) -> None:
        chk = Checker(stores[r], r, 2, name="k", timeout=30)
        for _ in range(calls):
            chk.check([plans[r]])
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert server.served - before == 2 * calls
    assert server.num_keys == before_keys and not server._votes


def test_round_hashes_pair_every_send_with_its_receive():
    from ncclpy import Buffer
    from ncclpy.comm.resolver import Resolver
    from ncclpy.plan.types import PlanContext
    world = 4

    def fp(r: int, count: int = 16) -> Any:
        res = Resolver(PlanContext(r, world))
        nxt, prv = (r + 1) % world, (r - 1) % world
        send = res.plan("send", res.parse("send", Buffer(0x1000, count, "float32", 0), None),
                        (nxt,), in_group=True)
        recv = res.plan("recv", res.parse("recv", Buffer(0x2000, 16, "float32", 0), None),
                        (prv,), in_group=True)
        return fingerprint([send, recv], 0, ["send", "recv"])
    ok = [round_hashes(fp(r), r) for r in range(world)]
    assert len({h for h, _ in ok}) == 1 and sum(s for _, s in ok) % (1 << 64) == 0
    bad = [round_hashes(fp(r, 8 if r == 2 else 16), r) for r in range(world)]
    assert sum(s for _, s in bad) % (1 << 64) != 0


def test_a_slow_store_never_ends_the_node_watch_and_a_killed_launcher_is_named(tmp_path):
    """The store stopped for 2 s (every call times out): both nodes' watches go on, and judge
    nobody at their first on-time replies after it; then node 0's launcher stops beating
    (killed): node 1 names it, silent past its silence limit (3 s)."""
    from ncclpy.launch.nodewatch import NodeWatch
    code = ("import time\nfrom ncclpy.store import StoreServer\n"
            "s = StoreServer('127.0.0.1', 0).start()\nprint(s.port, flush=True)\n"
            "time.sleep(600)\n")
    srv = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                           env=_env())
    port = int(srv.stdout.readline())
    w0 = NodeWatch("127.0.0.1", port, "", 0, 2, 2, interval=0.2, dead_after=3.0).start()
    w1 = NodeWatch("127.0.0.1", port, "", 1, 2, 2, interval=0.2, dead_after=3.0).start()
    def replied_after(w, t: float) -> bool:     # an on-time reply after t (or a verdict)
        h = w._heart
        return w.failure is not None or (h is not None and h.replied_at > t)

    try:                                           # (both beat once in start())
        srv.send_signal(signal.SIGSTOP)
        time.sleep(2.0)                            # the scenario: the store stopped for 2 s
        srv.send_signal(signal.SIGCONT)
        for w in (w0, w1):                         # two on-time replies: the first one's
            cont = time.monotonic()                # verdict, if any, is made by the second
            wait_until(lambda: replied_after(w, cont), "an on-time reply after the stop")
            first = w._heart.replied_at if w._heart is not None else cont
            wait_until(lambda: replied_after(w, first), "a second on-time reply")
        assert w0._thread.is_alive() and w1._thread.is_alive()
        assert w0.failure is None and w1.failure is None, (w0.failure, w1.failure)
        w0._stop.set()                             # node 0's launcher is gone, without a word
        wait_until(lambda: w1.failure is not None, "node 1 names node 0")
        m = re.search(r"node 0 \(ranks 0-1\) stopped heartbeating (\d+\.\d) s ago", w1.failure)
        assert m and float(m.group(1)) >= 3.0, w1.failure   # silent past its limit
        c = TCPStore("127.0.0.1", port, timeout=5)
        assert read_deaths(c) == {0, 1}            # for the ranks' watchdogs
    finally:
        srv.send_signal(signal.SIGCONT)
        srv.kill()
        srv.wait()


def test_bootstrap_keeps_one_generation_key_per_rank(server):
    from ncclpy.bootstrap import _never_came, _next_generation, generation_key
    c = TCPStore("127.0.0.1", server.port, timeout=5)
    for name in [f"n{i}" for i in range(20)] * 2:
        for r in range(3):
            _next_generation(c, name, r)
    keys = [generation_key("any", r) for r in range(3)]
    assert server.num_keys == 3 and all(c.check([k]) for k in keys)
    assert json.loads(c.get(generation_key("x", 1)))["n7"] == 2
    assert _next_generation(TCPStore("127.0.0.1", server.port), "n7", 1) == 3   # a new process
    _next_generation(c, "solo", 0)
    assert "Ranks 1, 2 never reached the store" in _never_came(c, "solo", 3)


def test_a_mismatch_whose_table_cannot_be_collected_still_raises_saying_so():
    """Stand-in at the store boundary: the vote says the calls differ, then the store is gone;
    the rank still raises CallMismatchError (nothing reaches NCCL), naming why the table is
    partial."""
    from ncclpy import Buffer
    from ncclpy.comm.resolver import Resolver
    from ncclpy.errors import CallMismatchError, StoreConnectionError
    from ncclpy.plan.types import PlanContext
    from ncclpy.store import tablewire as TW

    class Store:
        supports_tables = supports_arrive = True

        def vote(self, *a: Any, **k: Any) -> Any:
            return TW.VoteReply(TW.HASH_DIFFERS, 2, [])

        def set(self, *a: Any, **k: Any) -> None:
            raise StoreConnectionError("set: lost the connection to the store")
    plan = Resolver(PlanContext(0, 2)).resolve(
        "all_reduce", 0, Buffer(0x100000, 16, "float32", 0), None, ("sum",)).plan
    with pytest.raises(CallMismatchError) as ei:
        Checker(Store(), 0, 2, name="t", timeout=5).check([plan])
    msg = str(ei.value)
    assert "rank 0 could not collect every rank's calls for this table" in msg, msg
    assert "lost the connection to the store" in msg and "nothing of this round" in msg
