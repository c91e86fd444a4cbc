"""The watchdog's verdicts (ncclpy.debug.verdicts), pure and fast: WatchState.step driven with
literal calls and peers, each expected Decision written by hand from the rule
(docs/reference/concepts/hangs.rst): a death aborts at once; a published abort is followed with
its suspects (one verdict, no cascade); a quiet peer is only suspected while a call waits on it,
and only once a fresh read confirms it; a slow store is never a dead peer; an NCCL error waits
for the heartbeats to name the peer; a timeout names the peers that never issued the call.
"""
from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ncclpy.debug.verdicts import (CONFIRM, Decision, Peer, Published, WatchState,  # noqa: E402
                                   carried_out, peers_from_beat, ranks_text, report_after,
                                   waits_on)

H = "ncclpy watchdog: communicator 'job' rank 0/4: "
T = "; the communicator was aborted (ncclCommAbort)"


class _Hang(Exception):
    pass


@pytest.fixture(autouse=True)
def _hang_bound():
    """Pure code answers at once: a loop that never ends fails the test (a bound on a hang,
    not an expected duration)."""
    def boom(signum, frame):
        raise _Hang("no answer within 10 s: a loop that never ends")
    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, 10.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def st(**kw) -> WatchState:
    """Rank 0 of 4, timeout 10 s, silence limit 3 s, started at 100."""
    kw.setdefault("dead_after", 3.0)
    kw.setdefault("start", 100.0)
    return WatchState(kw.pop("rank", 0), kw.pop("world", 4), "job", kw.pop("timeout", 10.0),
                      **kw)


def D(reason, coll, seq, sus) -> Decision:
    return Decision(reason, coll, seq, tuple(sus), "")


# -- helpers ------------------------------------------------------------------------------------
def test_ranks_text_writes_runs_as_ranges():
    assert ranks_text([]) == ""
    assert ranks_text([5]) == "5"
    assert ranks_text([3, 4]) == "3, 4"
    assert ranks_text([0, 2]) == "0, 2"
    assert ranks_text([1, 2, 3]) == "1-3"
    assert ranks_text([1, 4, 5, 6, 7, 8, 9, 12]) == "1, 4-9, 12"
    assert ranks_text([9, 3, 1, 2]) == "1-3, 9"
    assert ranks_text([7, 8, 10, 11, 12]) == "7, 8, 10-12"
    evens = list(range(0, 64, 2))                       # 32 items: all shown
    assert ranks_text(evens) == ", ".join(str(r) for r in evens)
    more = list(range(0, 80, 2))                        # 40 items: the first 32, then a count
    assert ranks_text(more) == ", ".join(str(r) for r in evens) + ", ... (40 ranks in all)"
    assert ranks_text([1, 3, 5], most=2) == "1, 3, ... (3 ranks in all)"


def test_report_after_is_one_interval_before_the_limit_never_under_one_interval():
    assert report_after(5.0, 1.0) == 4.0
    assert report_after(3.0, 0.5) == 2.5
    assert report_after(1.5, 1.0) == 1.0
    assert report_after(2.0, 1.0) == 1.0


def test_peers_from_beat_dates_the_stale_on_the_local_clock_and_the_never_after_the_grace():
    rep = SimpleNamespace(stale=[(1, 2.5), (0, 9.0), (3, 4.0)], never_listed=[2, 0])
    assert peers_from_beat(rep, 50.0, 0, False) == {1: Peer(seen=47.5), 3: Peer(seen=46.0)}
    assert peers_from_beat(rep, 50.0, 0, True) == {1: Peer(seen=47.5), 3: Peer(seen=46.0),
                                                   2: Peer()}
    rep2 = SimpleNamespace(stale=[(1, 2.5), (0, 9.0), (2, 4.0)], never_listed=[3, 2])
    assert peers_from_beat(rep2, 50.0, 2, True) == {1: Peer(seen=47.5), 0: Peer(seen=41.0),
                                                    3: Peer()}
    assert Peer() == Peer(None, 0, False)


def test_carried_out_says_revoked_only_under_revoke():
    msg = H + "x" + T
    assert carried_out(msg, False) == msg
    assert carried_out(msg, True) == (
        H + "x; the communicator was revoked (ncclCommRevoke; on_failure='revoke'): shrink it "
        "to the survivors (comm.shrink(exclude=err.suspects)), or close it")


def _plan(*calls):
    return SimpleNamespace(calls=tuple(SimpleNamespace(fn=f, args=a) for f, a in calls))


def test_waits_on_a_plan_of_sends_and_receives_is_its_peers_else_everyone():
    assert waits_on(_plan(("Send", (0x10, 4, 7, 2, 9)))) == frozenset({2})
    assert waits_on(_plan(("Send", (0x10, 4, 7, 1)), ("Recv", (0x20, 4, 7, 3)))) \
        == frozenset({1, 3})
    assert waits_on(_plan(("Send", (0x10, 4, 7, 1)), ("AllReduce", (1, 2, 3, 4, 5)))) is None
    assert waits_on(_plan(("AllReduce", (1, 2, 3, 4, 5)))) is None
    assert waits_on(_plan()) is None
    assert waits_on(object()) is None


def test_published_encodes_and_decodes_a_verdict_and_nothing_else():
    p = Published(2, "peer_silent", (3, 1), "no heartbeat")
    raw = p.encode()
    assert isinstance(raw, bytes)
    assert Published.decode(b"5:6:7\n" + raw) == p
    long = Published(1, "timeout", (), "y" * 1000)
    assert Published.decode(b"p\n" + long.encode()).cause == "y" * 400
    assert Published.decode(raw) is None                   # no progress line before it
    assert Published.decode(b"5:6:7") is None
    assert Published.decode(b"p\n{bad") is None
    assert Published.decode(b'p\n{"rank": 1}') is None
    assert Published.decode(b'p\n{"rank": 1, "reason": "x", "suspects": 3, "cause": ""}') \
        is None


def test_published_keeps_the_cause_without_head_or_suspects():
    s = st()
    d = Decision("timeout", "x", 1, (2,), H + "the cause; suspected: rank(s) 2; suspected: 9" + T)
    assert s.published(d) == Published(0, "timeout", (2,), "the cause")
    other = Decision("peer_dead", "", -1, (1, 3), "no head here; suspected: rank(s) 1, 3")
    assert s.published(other) == Published(0, "peer_dead", (1, 3), "no head here")


def test_defaults():
    s = WatchState(1, 2, "j", 10)
    assert (s.dead_after, s.start, s.never_grace, s.timeout) == (5.0, 0.0, 5.0, 10.0)
    assert WatchState(1, 2, "j", 10, dead_after=2.0, never_grace=7).never_grace == 7.0
    # a peer never seen is silent from the start (0.0 by default)
    pend = [(0, "x", 0.0)]
    assert s.step(5.5, pend, {0: Peer()}) == CONFIRM
    assert s.step(4.9, pend, {0: Peer()}) is None


# -- nothing to do ------------------------------------------------------------------------------
def test_young_calls_and_fresh_peers_are_nothing():
    s = st()
    assert s.step(105.0, [], {}) is None
    assert s.step(105.0, [(1, "all_reduce", 104.0)], {}) is None
    assert s.step(105.0, [(1, "all_reduce", 104.0)], {1: Peer(seen=104.9, issued=0)}) is None


# -- a death ------------------------------------------------------------------------------------
def test_a_death_aborts_at_once_with_or_without_a_call():
    d = st().step(101.0, [], {}, dead=[2])
    assert d == D("peer_dead", "", -1, (2,))
    assert d.message == (H + "rank(s) 2 died (the launcher says so) while no call in flight; "
                         "suspected: rank(s) 2" + T)
    d = st().step(102.5, [(5, "all_gather", 101.0)], {}, dead=[3, 0, 1, 3])
    assert d == D("peer_dead", "all_gather", 5, (1, 3))
    assert d.message == (H + "rank(s) 1, 3 died (the launcher says so) while all_gather "
                         "(sequence 5, in flight for 1.5 s); suspected: rank(s) 1, 3" + T)
    assert st().step(102.5, [(5, "all_gather", 101.0)], {}, dead=[0]) is None   # itself
    d = st().step(101.0, [], {}, dead=(2,), nccl_error=("ncclRemoteError (6): gone", 100.5))
    assert d.message == (H + "rank(s) 2 died (the launcher says so) while no call in flight, "
                         "after NCCL reported: ncclRemoteError (6): gone; suspected: rank(s) 2"
                         + T)


def test_a_death_comes_before_every_other_verdict():
    pub = Published(1, "timeout", (3,), "c")
    d = st().step(130.0, [(4, "x", 101.0)], {3: Peer(seen=100.0, issued=0)}, dead=[2],
                  aborted=pub, confirmed=True, nccl_error=("e", 101.0))
    assert d == D("peer_dead", "x", 4, (2,))


# -- a published abort: one verdict, no cascade -------------------------------------------------
def test_a_published_abort_is_followed_only_with_a_call_in_flight():
    pub = Published(2, "peer_silent", (3,), "no heartbeat for more than 3 s from rank(s) 3")
    quiet = {2: Peer(seen=100.0), 3: Peer(seen=100.0)}     # both silent since it aborted
    s = st()
    assert s.step(109.0, [], quiet, aborted=pub) is None   # idle: left alone
    assert s.step(109.0, [], quiet, aborted=pub, confirmed=True) is None
    d = s.step(109.0, [(9, "all_reduce", 108.5)], quiet, aborted=pub)
    assert d == D("peer_aborted", "all_reduce", 9, (3,))   # not rank 2's silence: no cascade
    assert d.message == (H + "rank 2 aborted the communicator (peer_silent: no heartbeat for "
                         "more than 3 s from rank(s) 3) while this rank had all_reduce "
                         "(sequence 9, in flight for 0.5 s); no call on it can complete; "
                         "suspected: rank(s) 3" + T)
    # a call waited long on the silent ranks: still the published verdict, not a new one
    assert s.step(109.0, [(9, "x", 101.0)], quiet, aborted=pub,
                  confirmed=True) == D("peer_aborted", "x", 9, (3,))
    # a call blocked inside NCCL counts as one in flight
    d = s.step(109.0, [], {}, aborted=pub, blocked=(4, "send", 108.0, frozenset({1})))
    assert d == D("peer_aborted", "send", 4, (3,))
    # an NCCL error with no call in flight follows it too
    d = s.step(109.0, [], {}, aborted=pub, nccl_error=("ncclRemoteError (6)", 108.0))
    assert d == D("peer_aborted", "", -1, (3,))
    assert "while this rank had no call in flight, after NCCL reported: ncclRemoteError" \
        in d.message


def test_a_published_abort_names_its_suspects_sorted_or_the_rank_that_aborted():
    s = st()
    pend = [(1, "x", 108.0)]
    assert s.step(109.0, pend, {}, aborted=Published(2, "timeout", (3, 1), "c")).suspects \
        == (1, 3)
    assert s.step(109.0, pend, {}, aborted=Published(2, "abort", (), "comm.abort()")) \
        == D("peer_aborted", "x", 1, (2,))
    # this rank's own published verdict is not followed again
    assert s.step(109.0, pend, {}, aborted=Published(0, "timeout", (3,), "c")) is None


# -- silence ------------------------------------------------------------------------------------
def test_a_silent_peer_is_suspected_while_a_call_waits_on_it_once_confirmed():
    s = st()
    peers = {1: Peer(seen=107.0), 2: Peer(seen=104.5)}
    pend = [(3, "all_reduce", 104.0)]
    assert s.step(108.0, pend, peers) == CONFIRM
    d = s.step(108.0, pend, peers, confirmed=True)
    assert d == D("peer_silent", "all_reduce", 3, (2,))
    assert d.message == (H + "no heartbeat for more than 3 s from rank(s) 2 (rank 2 silent "
                         "3.5 s, read afresh from the store; dead or hung) while all_reduce "
                         "(sequence 3, in flight for 4.0 s), which waits on it; suspected: "
                         "rank(s) 2" + T)
    # the fresh read says it beat since: nothing
    assert s.step(108.0, pend, {2: Peer(seen=107.9)}, confirmed=True) is None


def test_silence_counts_only_past_both_limits():
    s = st()
    silent = {2: Peer(seen=104.0)}
    assert s.step(108.0, [(3, "x", 105.0)], silent) is None      # waited exactly 3 s
    assert s.step(108.0, [(3, "x", 104.9)], silent) == CONFIRM
    assert s.step(108.0, [(3, "x", 104.0)], {2: Peer(seen=105.0)}) is None   # 3 s exactly
    assert s.step(108.0, [(3, "x", 104.0)], {2: Peer(seen=104.9)}) == CONFIRM


def test_a_pause_with_nothing_waiting_is_never_a_verdict():
    for s in (st(), st(dead_after=0.5, never_grace=0.5)):
        for gap in (0.6, 3.5, 60.0, 3600.0):
            peers = {1: Peer(seen=100.0), 2: Peer(), 3: Peer(seen=100.0 + gap)}
            assert s.step(100.0 + gap, [], peers) is None
            assert s.step(100.0 + gap, [], peers, confirmed=True) is None


def test_an_nccl_error_lets_silence_be_judged_before_the_wait_is_long():
    s = st()
    err = ("ncclRemoteError (6): closed", 107.5)
    silent = {2: Peer(seen=104.0)}
    assert s.step(108.0, [(3, "x", 107.9)], silent, nccl_error=err) == CONFIRM
    assert s.step(108.0, [], silent, nccl_error=err) == CONFIRM
    d = s.step(108.0, [(3, "x", 107.0)], silent, nccl_error=err, confirmed=True)
    assert d == D("peer_silent", "x", 3, (2,))
    assert "while x (sequence 3, in flight for 1.0 s), after NCCL reported: ncclRemoteError " \
           "(6): closed, which waits on it" in d.message


def test_a_slow_store_is_never_a_dead_peer():
    """silence=False: the confirmation could not be read in time; no silence is judged, the
    other rules are."""
    s = st()
    silent = {1: Peer(seen=100.0, issued=9), 2: Peer(seen=100.0, issued=9),
              3: Peer(seen=100.0, issued=9)}
    assert s.step(108.0, [(3, "x", 101.0)], silent, silence=False) is None
    assert s.step(108.0, [(3, "x", 101.0)], silent, silence=False, confirmed=True) is None
    d = s.step(111.5, [(3, "x", 101.0)], silent, silence=False)
    assert d == D("timeout", "x", 3, (1, 2, 3))
    assert s.step(108.0, [(3, "x", 101.0)], {}, dead=[1], silence=False).reason == "peer_dead"


def test_only_the_peers_the_call_waits_on_are_judged():
    s = st()
    peers = {0: Peer(seen=90.0), 2: Peer(seen=100.0), 3: Peer(seen=100.0, closed=True)}
    assert s.step(108.0, [(3, "x", 101.0)], {0: Peer(seen=90.0)}) is None   # itself
    assert s.step(108.0, [(3, "x", 101.0)], {3: Peer(seen=90.0, closed=True)}) is None
    assert s.step(108.0, [(3, "x", 101.0)], peers, confirmed=True).suspects == (2,)
    send1 = [(3, "send", 101.0, frozenset({1}))]
    assert s.step(108.0, send1, peers) is None              # rank 1 is fresh
    assert s.step(108.0, send1, peers, confirmed=True) is None
    send2 = [(3, "send", 101.0, frozenset({2, 3}))]
    assert s.step(108.0, send2, peers, confirmed=True) == D("peer_silent", "send", 3, (2,))
    # a blocked call's peers too
    assert s.step(108.0, [], {1: Peer(seen=100.0)},
                  blocked=(2, "recv", 101.0, frozenset({2}))) is None
    assert s.step(108.0, [], {2: Peer(seen=100.0)},
                  blocked=(2, "recv", 101.0, frozenset({2}))) == CONFIRM


def test_a_peer_never_seen_gets_the_start_up_grace():
    s = st()                                               # grace = dead_after = 3 s
    pend = [(0, "x", 100.5)]
    assert s.step(103.0, pend, {2: Peer()}) is None
    assert s.step(103.6, pend, {2: Peer()}, confirmed=True) == D("peer_silent", "x", 0, (2,))
    g = st(never_grace=60.0, timeout=600.0)
    assert g.step(150.0, pend, {2: Peer()}) is None
    assert g.step(150.0, pend, {1: Peer(seen=146.0), 2: Peer()}, confirmed=True) \
        == D("peer_silent", "x", 0, (1,))                  # a seen peer: dead_after
    d = g.step(160.5, pend, {1: Peer(seen=160.0), 2: Peer()}, confirmed=True)
    assert d == D("peer_silent", "x", 0, (2,))
    assert "(rank 2 never sent one in 60.5 s, read afresh" in d.message


def test_many_silent_peers_are_all_suspected_eight_described():
    s = st(world=12)
    pend = [(1, "x", 100.0)]
    ten = {r: Peer(seen=103.0) for r in range(1, 11)}
    d = s.step(108.0, pend, ten, confirmed=True)
    assert d == D("peer_silent", "x", 1, range(1, 11))
    desc = ", ".join(f"rank {r} silent 5.0 s" for r in range(1, 9))
    assert f"from rank(s) 1-10 ({desc}, and 2 more, read afresh" in d.message
    nine = {r: Peer(seen=103.0) for r in range(1, 10)}
    d = s.step(108.0, pend, nine, confirmed=True)
    assert f"from rank(s) 1-9 ({desc}, and 1 more, read afresh" in d.message
    eight = {r: Peer(seen=103.0) for r in range(1, 9)}
    d = s.step(108.0, pend, eight, confirmed=True)
    assert f"from rank(s) 1-8 ({desc}, read afresh" in d.message


# -- an NCCL error with every heartbeat fresh ---------------------------------------------------
def test_an_nccl_error_suspects_every_peer_once_the_heartbeats_had_their_time():
    err = ("ncclSystemError (2): x", 104.0)
    s = st(timeout=100.0)
    pend = [(9, "broadcast", 103.0)]
    assert s.step(106.0, [(9, "broadcast", 90.0)], {}, nccl_error=err) is None
    assert s.step(108.0, pend, {}, nccl_error=err) is None             # 4 s = 3 + 1
    d = s.step(108.1, pend, {}, nccl_error=err)
    assert d == D("nccl_error", "broadcast", 9, (1, 2, 3))
    assert d.message == (H + "broadcast (sequence 9, in flight for 5.1 s), after NCCL "
                         "reported: ncclSystemError (2): x; every peer's heartbeat is still "
                         "fresh, so none is singled out; suspected: every peer (1-3)" + T)
    assert s.step(108.5, pend, {}, nccl_error=err, interval=2.0) is None
    assert s.step(109.1, pend, {}, nccl_error=err, interval=2.0).reason == "nccl_error"
    assert s.step(108.1, [], {}, nccl_error=err) == D("nccl_error", "", -1, (1, 2, 3))
    r2 = st(rank=2, timeout=100.0)
    assert r2.step(108.1, pend, {}, nccl_error=err).suspects == (0, 1, 3)


# -- the timeout --------------------------------------------------------------------------------
def test_a_timeout_names_the_peers_that_never_issued_the_call():
    s = st()
    pend = [(7, "all_reduce", 101.0)]
    peers = {1: Peer(seen=111.0, issued=8), 2: Peer(seen=111.0, issued=7),
             3: Peer(seen=111.0, issued=6), 0: Peer(seen=111.0, issued=0)}
    assert s.step(111.0, pend, peers) is None                        # exactly 10 s
    d = s.step(111.5, pend, peers)
    assert d == D("timeout", "all_reduce", 7, (2, 3))
    assert d.message == (H + "all_reduce (sequence 7) did not complete within the "
                         "communicator's timeout of 10 s; suspected: rank(s) 2, 3, which never "
                         "issued it (rank 2 issued 7, rank 3 issued 6 calls)" + T)
    assert s.step(111.5, [], peers) is None                          # no call: no timeout


def test_a_timeout_with_every_peer_past_the_call_suspects_every_peer():
    s = st()
    d = s.step(111.5, [(7, "all_reduce", 101.0)], {1: Peer(seen=111.0, issued=8)})
    assert d == D("timeout", "all_reduce", 7, (1, 2, 3))
    assert d.message.endswith("suspected: every peer (1-3): all issued it, none is known dead"
                              + T)


def test_a_timeout_reads_behind_before_the_peers_counts():
    s = st()
    pend = [(7, "all_reduce", 101.0)]
    peers = {1: Peer(seen=111.0, issued=0)}
    d = s.step(111.5, pend, peers, behind={3: 2, 0: 1})
    assert d == D("timeout", "all_reduce", 7, (3,))
    assert "suspected: rank(s) 3, which never issued it (rank 3 issued 2 calls)" in d.message
    assert s.step(111.5, pend, peers, behind={}).suspects == (1, 2, 3)
    # behind known: it holds even when the peers' counts were not
    assert s.step(111.5, pend, peers, behind={3: 2}, issued_known=False).suspects == (3,)


def test_a_timeout_without_the_counts_suspects_every_peer_and_says_why():
    s = st()
    d = s.step(111.5, [(7, "x", 101.0)], {1: Peer(seen=111.0, issued=0)}, issued_known=False)
    assert d == D("timeout", "x", 7, (1, 2, 3))
    assert d.message.endswith("suspected: every peer (1-3): the store did not say in time "
                              "which ranks issued it" + T)
    d = s.step(111.5, [(7, "send", 101.0, frozenset({2}))], {}, issued_known=False)
    assert d.suspects == (2,)


def test_a_timeout_of_a_send_suspects_its_peers_only():
    s = st()
    send = [(3, "send", 101.0, frozenset({1, 2}))]
    d = s.step(111.5, send, {1: Peer(seen=111.0, issued=9), 3: Peer(seen=111.0, issued=0)})
    assert d == D("timeout", "send", 3, (1, 2))
    assert d.message.endswith("suspected: its peer(s) 1, 2" + T)
    d = s.step(111.5, send, {1: Peer(seen=111.0, issued=1), 3: Peer(seen=111.0, issued=0)})
    assert d == D("timeout", "send", 3, (1,))
    assert s.step(111.5, send, {}, behind={2: 0, 3: 0}).suspects == (2,)


def test_a_timeout_describes_eight_late_peers():
    s = st(world=12)
    peers = {r: Peer(seen=111.0, issued=0) for r in range(1, 11)}
    d = s.step(111.5, [(0, "x", 101.0)], peers)
    assert d.suspects == tuple(range(1, 11))
    why = ", ".join(f"rank {r} issued 0" for r in range(1, 9))
    assert f"rank(s) 1-10, which never issued it ({why} calls)" in d.message


def test_a_call_blocked_inside_nccl_is_timed_like_a_pending_one():
    s = st()
    blk = (2, "send", 101.0)
    assert s.step(111.0, [], {}, blocked=blk) is None
    d = s.step(111.5, [], {}, blocked=blk)
    assert d == D("timeout", "send", 2, (1, 2, 3))
    assert d.message == (H + "send (sequence 2) was still blocked inside its NCCL call on the "
                         "host (the launch never returned: a peer never made the matching "
                         "call, e.g. a send/recv's first use, which connects the pair) after "
                         "the communicator's timeout of 10 s; suspected: every peer (1-3): all "
                         "issued it, none is known dead" + T)


def test_the_oldest_of_the_pending_and_the_blocked_call_is_judged():
    s = st()
    dead = dict(dead=[1])
    # the blocked call is older
    d = s.step(105.0, [(5, "all_reduce", 103.0)], {}, blocked=(4, "send", 102.0), **dead)
    assert (d.collective, d.seq) == ("send", 4)
    assert "while send (sequence 4, blocked inside NCCL for 3.0 s)" in d.message
    # the pending call is older, or as old: it comes first
    for since in (101.0, 102.0):
        d = s.step(105.0, [(3, "all_reduce", since)], {}, blocked=(4, "send", 102.0), **dead)
        assert (d.collective, d.seq) == ("all_reduce", 3)
        assert f"while all_reduce (sequence 3, in flight for {105.0 - since:.1f} s)" \
            in d.message
    # only a blocked one
    d = s.step(105.0, [], {}, blocked=(4, "send", 102.0), **dead)
    assert (d.collective, d.seq) == ("send", 4)
    # the pending list is oldest first: its head is judged
    d = s.step(105.0, [(3, "a", 104.0), (4, "b", 101.0)], {}, **dead)
    assert (d.collective, d.seq) == ("a", 3)
