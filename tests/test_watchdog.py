"""The watchdog (ncclpy.watchdog) on CPU: its decisions through WatchState.step, and liveness
across real processes with a real store (heartbeats, a killed rank, the launcher's notice, a
clean close).  The abort itself (ncclCommAbort) is in tests/gpu/test_watchdog_gpu.py.
Run as a script, this file is the worker of one rank.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ncclpy.comm import default_timeout, env_flag  # noqa: E402
from ncclpy.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from ncclpy.store import StoreServer, TCPStore  # noqa: E402
from ncclpy.debug.deaths import publish_deaths  # noqa: E402
from ncclpy.debug.watchdog import Peer, Published, Watchdog, WatchState  # noqa: E402
from ncclpy.debug.verdicts import CONFIRM, waits_on  # noqa: E402
from wait_util import HANG, wait_until  # noqa: E402
from watchdog_crowd import Work  # noqa: E402  (a call that waits until told done)


# -- decisions (pure) ---------------------------------------------------------------------------
def _state(timeout: float = 10.0) -> WatchState:
    return WatchState(0, 3, "job", timeout, dead_after=3.0, start=100.0)


def _peers(**kw: Any) -> Dict[int, Peer]:
    return {1: Peer(seen=kw.get("s1", 104.0), issued=kw.get("i1", 8)),
            2: Peer(seen=kw.get("s2", 104.0), issued=kw.get("i2", 8),
                    closed=kw.get("c2", False))}


def test_nothing_to_do_when_calls_are_young_and_peers_beat():
    assert _state().step(105.0, [(7, "all_reduce", 101.0)], _peers()) is None
    assert _state().step(105.0, [], _peers()) is None


def test_timeout_names_the_call_its_sequence_and_the_rank_that_skipped_it():
    d = _state().step(112.0, [(7, "all_reduce", 101.0)], _peers(i2=7, s1=111.0, s2=111.0))
    assert (d.reason, d.collective, d.seq, d.suspects) == ("timeout", "all_reduce", 7, (2,))
    assert ("all_reduce (sequence 7) did not complete within the communicator's timeout of "
            "10 s; suspected: rank(s) 2, which never issued it (rank 2 issued 7 calls)") \
        in d.message
    assert "ncclCommAbort" in d.message and "'job' rank 0/3" in d.message


def test_timeout_with_every_peer_past_the_call_suspects_every_peer():
    d = _state().step(112.0, [(7, "broadcast", 101.0)], _peers(s1=111.0, s2=111.0))
    assert d.suspects == (1, 2) and "every peer (1, 2)" in d.message


def test_a_call_blocked_inside_its_launch_times_out_like_a_pending_one():
    # seen inside NCCL since 101 (the launch never returned): no event, still timed
    blk = (2, "send", 101.0)
    assert _state().step(110.0, [], _peers(i1=2, i2=2, s1=109.0, s2=109.0), blocked=blk) is None
    d = _state().step(112.0, [], _peers(i1=2, i2=2, s1=111.0, s2=111.0), blocked=blk)
    assert (d.reason, d.collective, d.seq, d.suspects) == ("timeout", "send", 2, (1, 2))
    assert ("send (sequence 2) was still blocked inside its NCCL call on the host" in d.message
            and "timeout of 10 s; suspected: rank(s) 1, 2, which never issued it" in d.message)
    # an older pending call comes first; a younger blocked one waits its turn
    fresh = _peers(s1=111.0, s2=111.0)
    d = _state().step(112.0, [(1, "all_reduce", 100.5)], fresh, blocked=blk)
    assert d.collective == "all_reduce" and "did not complete within" in d.message
    assert _state().step(112.0, [(1, "all_reduce", 103.0)], fresh,
                         blocked=(2, "send", 104.0)) is None
    # a peer's death while a call is blocked says which call
    d = _state().step(105.0, [], _peers(), dead=[1], blocked=blk)
    assert "while send (sequence 2, blocked inside NCCL for 4.0 s)" in d.message


def test_the_thread_samples_the_lifecycle_for_a_call_inside_nccl():
    """Watchdog.blocked: the same entry seen again is the same call, timed from the first tick
    that saw it; a new entry restarts the clock; none inside: nothing."""
    from ncclpy.comm.lifecycle import Lifecycle
    comm = _Comm(0, 2, timeout=10.0)
    comm._life = Lifecycle("rank 0 of 'live'")
    wd = Watchdog(comm, None)
    assert wd.blocked(1.0) is None
    comm._life.enter("send")
    assert wd.blocked(2.0) == (0, "send", 2.0, None)          # no plan: every peer
    from ncclpy.plan.types import NcclCall, Plan
    comm._life.plan = Plan("send", (NcclCall("Send", (0x1000, 4, 7, 1)),))   # as execute sets
    assert wd.blocked(2.0) == (0, "send", 2.0, frozenset({1}))   # a send waits on its peer
    assert wd.blocked(9.0)[:3] == (0, "send", 2.0)          # still the same call
    assert wd.decide(11.0) is None and wd.decide(12.5).reason == "timeout"
    comm._life.leave()
    assert wd.blocked(13.0) is None
    comm._life.hold()                                   # an open group is not a call ...
    assert wd.blocked(14.0) is None
    comm._life.mark_call("ncclGroupEnd")                # ... its group end is
    assert wd.blocked(15.0)[:3] == (0, "ncclGroupEnd", 15.0)
    comm._life.unmark_call()
    comm._life.enter("all_reduce")                      # a new call: a new clock
    assert wd.blocked(16.0)[:3] == (0, "all_reduce", 16.0)
    comm._life.leave()
    comm._life.release_hold()
    assert (comm._life.inflight, comm._life.calls) == (0, 0)
    # a nonblocking call's wait for completion (issue 35's defect 8): one call, whose polls
    # (each entering the lifecycle and taking the API lock) never restart the clock
    comm._life.mark_call("all_gather")
    for t in (17.0, 18.0, 19.0):
        comm._life.enter_poll("all_gather")
        comm._life.release()
        assert wd.blocked(t)[:3] == (0, "all_gather", 17.0)
    assert wd.decide(27.5).reason == "timeout"
    comm._life.unmark_call()
    assert wd.blocked(28.0) is None and (comm._life.inflight, comm._life.calls) == (0, 0)


def test_the_heartbeat_says_a_call_is_blocked_once_seen_inside_at_two_ticks():
    """Watchdog.progress: a call inside NCCL at one sample only is a call in flight, not shown;
    seen again at a later tick it is blocked, timed from the first sighting (what ncclpy status
    prints); once it returned, the mark is gone."""
    from ncclpy.comm.lifecycle import Lifecycle
    from ncclpy.debug.status import decode
    comm = _Comm(0, 2, timeout=10.0)
    comm._life = Lifecycle("rank 0 of 'live'")
    wd = Watchdog(comm, None)
    comm._life.enter("send")
    first = decode(wd.progress(5.0))
    assert first.blocked is False and first.wait == 0.0
    p = decode(wd.progress(8.5))
    assert (p.blocked, p.call, p.wait, p.issued) == (True, "send", 3.5, 0), p
    comm._life.leave()
    assert decode(wd.progress(9.0)).blocked is False


def test_a_silent_peer_is_named_only_while_a_call_waits_on_it_and_only_once_confirmed():
    st = _state()
    silent = _peers(s1=107.0, s2=104.5)                       # rank 2 silent 3.5 s at 108
    assert st.step(108.0, [], silent) is None                 # nothing waits: no verdict
    assert st.step(108.0, [(3, "all_reduce", 105.5)], silent) is None   # waited 2.5 s < 3 s
    pend = [(3, "all_reduce", 104.0)]                         # waited 4 s
    assert st.step(108.0, pend, silent) == CONFIRM            # never from an older reply
    d = st.step(108.0, pend, silent, confirmed=True)
    assert (d.reason, d.seq, d.suspects) == ("peer_silent", 3, (2,))
    assert "rank 2 silent 3.5 s, read afresh from the store" in d.message
    assert "all_reduce (sequence 3, in flight for 4.0 s" in d.message
    assert "which waits on it" in d.message
    # the fresh read says rank 2 beat since: no verdict, and no other rule fires
    assert st.step(108.0, pend, _peers(s1=107.0, s2=107.9), confirmed=True) is None


def test_a_pause_of_any_length_with_nothing_waiting_is_never_a_verdict():
    st = _state(timeout=10.0)
    for gap in (1.5, 2.5, 60.0, 3600.0):
        assert st.step(104.0 + gap, [], _peers(s1=104.0 + gap, s2=104.0)) is None
        assert st.step(104.0 + gap, [], {1: Peer(seen=104.0), 2: Peer()}) is None


def test_a_call_made_of_sends_and_receives_waits_only_on_its_peers():
    from ncclpy.plan.types import NcclCall, Plan
    send = Plan("send", (NcclCall("Send", (0x1000, 4, 7, 1)),))
    both = Plan("sendrecv", (NcclCall("Send", (0x1000, 4, 7, 1)),
                             NcclCall("Recv", (0x2000, 4, 7, 2))))
    coll = Plan("all_reduce", (NcclCall("AllReduce", (0x1000, 0x1000, 4, 7, 0)),))
    assert waits_on(send) == frozenset({1}) and waits_on(both) == frozenset({1, 2})
    assert waits_on(coll) is None and waits_on(object()) is None
    st = _state()
    silent2 = _peers(s1=107.9, s2=100.0)
    assert st.step(108.0, [(3, "send", 101.0, frozenset({1}))], silent2) is None
    assert st.step(108.0, [(3, "send", 101.0, frozenset({2}))], silent2) == CONFIRM
    # its timeout suspects its peer only
    d = _state(timeout=5.0).step(108.0, [(3, "send", 101.0, frozenset({1}))],
                                 _peers(s1=107.9, s2=107.9, i1=9))
    assert (d.reason, d.suspects) == ("timeout", (1,)) and "its peer(s) 1" in d.message


def test_a_peer_that_never_beat_gets_the_start_up_grace_and_counts_only_while_waiting():
    st = WatchState(0, 3, "job", 600.0, dead_after=3.0, start=100.0, never_grace=60.0)
    pend = [(0, "all_reduce", 101.0)]
    assert st.step(150.0, pend, {1: Peer(seen=149.0), 2: Peer()}) is None
    assert st.step(150.0, pend, {1: Peer(seen=146.0), 2: Peer()}, confirmed=True).suspects \
        == (1,)
    assert st.step(160.5, [], {1: Peer(seen=160.0), 2: Peer()}) is None
    d = st.step(160.5, pend, {1: Peer(seen=160.0), 2: Peer()}, confirmed=True)
    assert d.suspects == (2,) and "rank 2 never sent one in 60.5 s" in d.message


def test_closed_peer_is_not_suspected():
    pend = [(3, "all_reduce", 101.0)]
    assert _state().step(108.0, pend, _peers(s1=107.0, s2=101.0, c2=True)) is None


def test_a_death_aborts_at_once_even_with_nothing_waiting():
    d = _state().step(101.0, [(0, "all_gather", 100.5)], _peers(), dead=[2, 0])
    assert (d.reason, d.suspects) == ("peer_dead", (2,))
    assert "rank(s) 2 died (the launcher says so) while all_gather (sequence 0" in d.message
    assert _state().step(101.0, [], _peers(), dead=[1]).reason == "peer_dead"


def test_a_published_abort_is_followed_with_its_suspects_not_a_new_cause():
    first = WatchState(4, 16, "job", 10.0, dead_after=3.0, start=100.0)
    d = first.step(108.0, [(3, "all_reduce", 104.0)], {15: Peer(seen=104.5)}, confirmed=True)
    pub = first.published(d)
    assert (pub.rank, pub.reason, pub.suspects) == (4, "peer_silent", (15,))
    assert pub.cause.startswith("no heartbeat for more than 3 s from rank(s) 15")
    assert "suspected" not in pub.cause and "ncclpy watchdog" not in pub.cause
    assert Published.decode(b"1:2:3\n" + pub.encode()) == pub
    assert Published.decode(b"1:2:3") is None and Published.decode(b"x\n{bad") is None
    other = WatchState(7, 16, "job", 10.0, dead_after=3.0, start=100.0)
    # idle: left alone (NCCL may share the communicator's resources with a child in use)
    assert other.step(109.0, [], {4: Peer(seen=100.0)}, aborted=pub) is None
    # a call in flight, however young: the published verdict, before rank 4's own silence
    f = other.step(109.0, [(9, "all_reduce", 108.95)], {4: Peer(seen=100.0)}, aborted=pub)
    assert (f.reason, f.suspects, f.seq) == ("peer_aborted", (15,), 9)
    assert "rank 4 aborted the communicator (peer_silent: no heartbeat" in f.message
    assert "suspected: rank(s) 15" in f.message
    blocked = (9, "send", 108.9, frozenset({3}))
    assert other.step(109.0, [], {}, blocked=blocked, aborted=pub).reason == "peer_aborted"
    # a user's abort (no suspects) names the rank that aborted; one's own is ignored
    user = Published(4, "abort", (), "comm.abort() was called")
    assert other.step(109.0, [(9, "x", 108.0)], {}, aborted=user).suspects == (4,)
    assert first.step(108.0, [(3, "all_reduce", 104.0)], {}, aborted=pub) is None


def test_an_nccl_error_waits_for_the_heartbeats_to_name_the_peer():
    err = ("ncclRemoteError (6): socketProgress: Connection closed by remote peer", 104.0)
    st = _state()
    pend = [(50, "all_reduce", 103.5)]
    # fresh heartbeats, error just reported: no verdict yet (the peer behind it is unknown)
    assert st.step(104.5, pend, _peers(s1=104.2, s2=104.2), nccl_error=err) is None
    # rank 2 stops beating: it is named (confirmed), and the NCCL error is in the message
    assert st.step(107.5, pend, _peers(s1=107.2, s2=104.2), nccl_error=err) == CONFIRM
    d = st.step(107.5, pend, _peers(s1=107.2, s2=104.2), nccl_error=err, confirmed=True)
    assert d.reason == "peer_silent" and d.suspects == (2,) and d.seq == 50
    assert "rank(s) 2" in d.message and "all_reduce (sequence 50" in d.message
    assert "after NCCL reported: ncclRemoteError (6)" in d.message


def test_an_nccl_error_with_every_heartbeat_fresh_suspects_every_peer_after_the_grace():
    err = ("ncclSystemError (2): some NCCL failure", 104.0)
    st = _state()
    pend = [(9, "broadcast", 103.0)]
    assert st.step(107.9, pend, _peers(s1=107.5, s2=107.5), nccl_error=err,
                   interval=1.0) is None                    # within dead_after + interval
    d = st.step(108.1, pend, _peers(s1=108.0, s2=108.0), nccl_error=err, interval=1.0)
    assert d.reason == "nccl_error" and d.suspects == (1, 2) and d.collective == "broadcast"
    assert "ncclSystemError (2)" in d.message and "every peer (1, 2)" in d.message


def test_a_late_confirmation_judges_no_silence_but_the_timeout_still_holds():
    st = _state(timeout=5.0)
    pend = [(3, "all_reduce", 101.0)]
    silent = _peers(s1=107.9, s2=100.0, i1=9, i2=9)
    assert st.step(108.0, pend, silent) == CONFIRM
    d = st.step(108.0, pend, silent, silence=False)            # the peek came late
    assert d.reason == "timeout" and d.suspects == (1, 2)
    d = st.step(108.0, pend, {}, silence=False, issued_known=False)
    assert d.suspects == (1, 2) and "the store did not say in time which ranks" in d.message
    assert st.step(104.0, [(3, "all_reduce", 103.0)], silent, silence=False) is None


def test_a_timeout_names_the_peers_a_behind_read_listed():
    d = _state().step(112.0, [(7, "all_reduce", 101.0)], {}, behind={2: 5})
    assert (d.reason, d.suspects) == ("timeout", (2,)) and "rank 2 issued 5" in d.message
    d = _state().step(112.0, [(7, "all_reduce", 101.0)], {}, behind={})
    assert d.suspects == (1, 2) and "every peer (1, 2): all issued it" in d.message


class _StandInComm:
    """The attributes a Watchdog reads of a communicator (stand-in: no NCCL, no GPU); its
    ``_watchdog_abort`` records the decision as the real one sets ``_abort_error``."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.name = 0, 2, "standin"
        self._timeout, self._device, self._watch = 60.0, 0, None
        self.aborted_with = None

    def _watchdog_abort(self, decision: Any) -> None:
        self.aborted_with = decision


def test_verdict_on_hands_the_error_to_the_thread_and_returns_its_decision():
    comm = _StandInComm()
    wd = Watchdog(comm, None, interval=0.05, dead_after=0.1, tick=0.01).start()
    try:
        d = wd.verdict_on(RuntimeError("ncclRemoteError (6): peer closed"))
    finally:
        wd.stop()
    # the thread's decision, returned (verdict_on's own limit ran out first: None)
    assert d is not None and d.reason == "nccl_error" and comm.aborted_with is d
    assert "ncclRemoteError (6): peer closed" in d.message


def test_a_tick_that_fails_is_said_once_counted_and_shown_by_ncclpy_status(caplog):
    """A blind watchdog says so: WARNING the first time (then once a minute), a counter in its
    heartbeat value (``ncclpy status``), and the thread goes on (it recovers when ticks do)."""
    import logging
    from ncclpy.debug.status import decode
    comm = _StandInComm()
    wd = Watchdog(comm, None, interval=0.05, dead_after=0.1, tick=0.01)
    calls = []

    def broken(now, dead=()):
        calls.append(now)
        if len(calls) <= 5:
            raise RuntimeError("the table said nonsense")
        return None
    wd.decide = broken
    caplog.set_level(logging.DEBUG, logger="ncclpy.debug.watchdog")
    wd.start()
    try:
        wait_until(lambda: len(calls) >= 8, "eight ticks")
    finally:
        wd.stop()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "a tick failed (RuntimeError: the table said nonsense)" in \
        warnings[0].getMessage() and "detects nothing while this goes on" in \
        warnings[0].getMessage()
    assert wd.blind == 5 and len(calls) >= 8                 # it went on, and recovered
    assert decode(wd.progress(time.monotonic())).blind == 5


def test_verdict_on_without_a_running_thread_returns_at_once():
    """No thread to decide: None at once, not after verdict_on's limit (dead_after + 2
    intervals + 1 s: 2 x HANG here, so a wait for it cannot pass for 'at once')."""
    wd = Watchdog(_StandInComm(), None, interval=0.05, dead_after=2 * HANG, tick=0.01)
    t0 = time.monotonic()
    assert wd.verdict_on(RuntimeError("x")) is None
    assert time.monotonic() - t0 < HANG


def test_timeout_and_flags_from_the_environment(monkeypatch):
    monkeypatch.delenv("NCCLPY_TIMEOUT", raising=False)
    assert default_timeout() == 300.0 and default_timeout(2) == 2.0
    monkeypatch.setenv("NCCLPY_TIMEOUT", "7.5")
    assert default_timeout() == 7.5
    monkeypatch.setenv("NCCLPY_TIMEOUT", "soon")
    with pytest.raises(ArgumentError, match="NCCLPY_TIMEOUT: expected a positive number of "
                                            "seconds, got 'soon'"):
        default_timeout()
    with pytest.raises(ArgumentError, match="timeout: expected a positive number"):
        default_timeout(-1)
    monkeypatch.setenv("NCCLPY_CHECKED", "1")
    assert env_flag("checked", None, "NCCLPY_CHECKED", False) is True
    assert env_flag("checked", False, "NCCLPY_CHECKED", False) is False
    monkeypatch.setenv("NCCLPY_WATCHDOG", "maybe")
    with pytest.raises(ArgumentError, match="NCCLPY_WATCHDOG: expected 1/0"):
        env_flag("watchdog", None, "NCCLPY_WATCHDOG", True)
    with pytest.raises(ArgumentTypeError, match="watchdog: expected True, False or None"):
        env_flag("watchdog", "yes", "NCCLPY_WATCHDOG", True)


# -- liveness across real processes ------------------------------------------------------------
class _Comm:
    """What the Watchdog thread needs of a communicator; ``_watchdog_abort`` records the
    verdict (the real abort is ncclCommAbort: GPU test)."""

    def __init__(self, rank: int, world: int, timeout: float) -> None:
        self.rank, self.world_size, self.name = rank, world, "live"
        self._timeout, self._device, self._watch = timeout, 0, None
        self.decision: Any = None

    def _watchdog_abort(self, d: Any) -> None:
        self.decision = d


def worker(host: str, port: int, rank: int, world: int, mode: str, secs: float) -> None:
    store = TCPStore(host, port, timeout=30)
    comm = _Comm(rank, world, timeout=60.0)
    wd = Watchdog(comm, store, interval=0.2, dead_after=1.5, tick=0.05).start()
    if mode == "wait":                     # a call that waits on the peers, never completing
        wd.queue.append(Work())
    print("up", flush=True)
    t0 = time.monotonic()
    while comm.decision is None and time.monotonic() - t0 < secs:
        time.sleep(0.05)
    d = comm.decision
    wd.stop(closed=mode != "no_close")
    print(json.dumps(None if d is None else {"reason": d.reason, "suspects": list(d.suspects),
                                             "message": d.message,
                                             "after": time.monotonic() - t0}), flush=True)


def _start(world: int, secs: float, mode: str = "run"):
    srv = StoreServer("127.0.0.1", 0).start()
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("NCCLPY_STORE_TOKEN", None)
    ps = [subprocess.Popen([sys.executable, __file__, str(srv.port), str(r), str(world), mode,
                            str(secs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=env, text=True)
          for r in range(world)]
    for p in ps:                                 # every rank's watchdog is running
        assert p.stdout.readline().strip() == "up", p.stderr.read()
    return srv, ps


def _result(p: subprocess.Popen) -> Any:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_killed_rank_is_named_by_every_rank_whose_call_waits_on_it():
    srv, ps = _start(3, secs=30.0, mode="wait")
    try:
        time.sleep(1.0)                          # heartbeats flow
        ps[2].send_signal(signal.SIGKILL)
        ps[2].wait(10)
        res = [_result(p) for p in ps[:2]]
    finally:
        srv.close()
    for r in res:         # named, or the other waiting rank's published verdict followed
        assert r is not None and r["reason"] in ("peer_silent", "peer_aborted"), r
        assert r["suspects"] == [2] and "from rank(s) 2 (rank 2 silent" in r["message"], r
        assert "read afresh from the store" in r["message"]


def test_the_launchers_notice_is_read():
    srv, ps = _start(2, secs=30.0)
    try:
        publish_deaths(TCPStore("127.0.0.1", srv.port, timeout=10), [1], "killed by signal 9")
        res = _result(ps[0])
        ps[1].kill()
        ps[1].wait(10)
    finally:
        srv.close()
    assert res["reason"] == "peer_dead" and res["suspects"] == [1], res


def test_live_ranks_and_a_clean_close_are_not_suspected():
    srv, ps = _start(3, secs=4.0)
    try:
        res = [_result(p) for p in ps]
    finally:
        srv.close()
    assert res == [None, None, None]


if __name__ == "__main__":
    worker("127.0.0.1", int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
           float(sys.argv[5]))


def test_an_async_error_read_by_a_wait_becomes_the_watchdogs_named_abort():
    """Communicator._raise_async_error with a stand-in libnccl (async error 6) and a stand-in
    watchdog: with a verdict the caller gets CommAbortedError (the NCCL error as its cause),
    without one the NCCL error itself."""
    from ncclpy.comm import Communicator
    from ncclpy.comm.lifecycle import Lifecycle
    from ncclpy.errors import CommAbortedError, NcclRemoteError

    class Lib:
        def async_error(self, handle):
            return 6

        def error(self, code, name, handle):
            return NcclRemoteError(code, name, "socketProgress: Connection closed")

    class WD:
        def __init__(self, comm, decide):
            self.comm, self.decide, self.got = comm, decide, None

        def verdict_on(self, err):
            self.got = err
            if not self.decide:
                return None
            self.comm._life.abort_error = CommAbortedError(
                "rank(s) 2 died", collective="all_reduce", seq=50, suspects=(2,))
            return object()

    for decide in (True, False):
        comm = Communicator.__new__(Communicator)
        comm._life, comm._lib, comm._handle = Lifecycle("rank 0 of 'x'"), Lib(), 1
        comm._watchdog = WD(comm, decide)
        with pytest.raises((CommAbortedError, NcclRemoteError)) as ei:
            comm._raise_async_error()
        assert isinstance(comm._watchdog.got, NcclRemoteError)
        if decide:
            assert isinstance(ei.value, CommAbortedError) and ei.value.suspects == [2]
            assert isinstance(ei.value.__cause__, NcclRemoteError)
        else:
            assert type(ei.value) is NcclRemoteError
