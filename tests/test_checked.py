"""Checked mode (ncclpy.checked) across real processes and a real store, no GPU.

Every rank is a real process (or, at 64 ranks, a thread with its own store client) holding a
real ncclpy TCPStore client; its calls are planned by the real planners
(:class:`ncclpy.comm.resolver.Resolver` on :class:`ncclpy.Buffer` specs) and compared by
:class:`ncclpy.checked.Checker`.  Run as a script, this file is the worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ncclpy import Buffer  # noqa: E402
from ncclpy.debug.checked import Checker, compare, fingerprint, format_table  # noqa: E402
from ncclpy.errors import CallCheckTimeout, CallMismatchError, NcclpyError  # noqa: E402
from ncclpy.semantics.ops import premul_sum  # noqa: E402
from ncclpy.plan.types import PlanContext  # noqa: E402
from ncclpy.comm.resolver import Resolver  # noqa: E402
from ncclpy.store import StoreServer, TCPStore  # noqa: E402
from ncclpy.store.sync import barrier  # noqa: E402

X = Buffer(0x100000, 16, "float32", 0)
#: the bound of a wait that must not end (a hang's deadline), where the checks' own bound must
#: not count the ranks' start: a process starts seconds late on a loaded machine
HANG = 120


def _buf(count: int = 16, dtype: str = "float32", at: int = 0x100000) -> Buffer:
    return Buffer(at, count, dtype, 0)


def rounds(scenario: str, rank: int, world: int) -> List[List[tuple]]:
    """The calls each rank makes: a list of rounds, each a list of (name, a, b, params);
    a round of several calls is a group."""
    ar = ("all_reduce", X, None, ("sum",))
    last = world - 1
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if scenario == "ok":
        ring = [ar, ("send", X, None, (nxt,)), ("recv", _buf(at=0x200000), None, (prv,))]
        return [[ar], [("broadcast", X, None, (0,))], ring,
                [("send_recv", X, _buf(at=0x200000), (nxt, prv))],
                [("all_reduce", X, None, (premul_sum(0.5),))]]
    if scenario == "collective":
        return [[("broadcast", X, None, (0,)) if rank == last else ar]]
    if scenario == "count":
        return [[("all_reduce", _buf(17) if rank == last else X, None, ("sum",))]]
    if scenario == "dtype":
        return [[("all_reduce", _buf(dtype="float64") if rank == last else X, None, ("sum",))]]
    if scenario == "op":
        return [[("all_reduce", X, None, ("max" if rank == last else "sum",))]]
    if scenario == "premul":
        s = 0.25 if rank == last else 0.5
        return [[("all_reduce", X, None, (premul_sum(s),))]]
    if scenario == "root":
        return [[("broadcast", X, None, (1 if rank == last else 0,))]]
    if scenario == "in_place":
        return [[("all_reduce", X, _buf(at=0x200000) if rank == last else None, ("sum",))]]
    if scenario == "sequence":   # the last rank makes one call fewer in its first group
        first = [ar] if rank == last else [ar, ar]
        return [first, [ar]]
    if scenario == "p2p_missing_recv":   # rank 0 sends to 1, which does not receive
        if rank == 0:
            return [[ar, ("send", X, None, (1,))]]
        return [[ar]]
    if scenario == "p2p_count":
        if rank == 0:
            return [[("send", X, None, (1,))]]
        if rank == 1:
            return [[("recv", _buf(8), None, (0,))]]
        return [[]]
    if scenario == "p2p_bystander":   # 0 -> 1 standalone; rank 2+ takes no part at all
        if rank == 0:
            return [[("send", X, None, (1,))], [ar]]
        if rank == 1:
            return [[("recv", X, None, (0,))], [ar]]
        return [[ar]]
    if scenario == "p2p_order":       # the same two messages, received in the other order
        if rank == 0:
            return [[("send", X, None, (1,)), ("send", _buf(8), None, (1,))]]
        if rank == 1:
            return [[("recv", _buf(8), None, (0,)), ("recv", X, None, (0,))]]
        return []
    if scenario == "p2p_regrouped":   # standalone on one side, one group on the other: fine
        if rank == 0:
            return [[("send", X, None, (1,))], [("recv", X, None, (1,))]]
        if rank == 1:
            return [[("recv", X, None, (0,)), ("send", X, None, (0,))]]
        return []
    if scenario == "p2p_both_send_first":   # standalone sends on both sides: NCCL deadlocks
        # (no recv round after it: the rank that times out first would post its recv, and the
        # other rank's send, still waiting, would rightly pair with it and pass)
        if rank in (0, 1):
            return [[("send", X, None, (1 - rank,))]]
        return []
    if scenario == "missing":     # the last rank never comes to the second check
        return [[ar], [ar]] if rank != last else [[ar]]
    raise ValueError(scenario)


def run_rank(host: str, port: int, rank: int, world: int, scenarios: List[str],
             timeout: float) -> Dict[str, List[Dict[str, Any]]]:
    """Play ``scenarios`` as ``rank`` through a store client of its own.  Every scenario starts
    with a barrier: the checks' ``timeout`` then bounds the ranks' waits for each other's calls,
    not how far apart the processes started (a p2p deadline runs from each rank's own post; a
    peer posting after it is rightly "posted nothing", which is not what these tests ask)."""
    store = TCPStore(host, port, timeout=HANG)
    resolver = Resolver(PlanContext(rank, world))
    out: Dict[str, List[Dict[str, Any]]] = {}
    try:
        for sc in scenarios:
            barrier(store, rank, world, tag=f"t/{sc}/start", timeout=HANG)
            chk = Checker(store, rank, world, name=sc, prefix=f"t/{sc}", timeout=timeout)
            res = out[sc] = []
            for rnd in rounds(sc, rank, world):
                grouped = len(rnd) != 1
                plans = []
                for name, a, b, params in rnd:
                    if grouped:
                        plans.append(resolver.plan(name, resolver.parse(name, a, b), params,
                                                   in_group=True))
                    else:
                        plans.append(resolver.resolve(name, 0, a, b, params).plan)
                try:
                    chk.check(plans, [c[0] for c in rnd])
                    res.append({"ok": True})
                except NcclpyError as e:
                    res.append({"error": type(e).__name__, "msg": str(e),
                                "missing": getattr(e, "missing", None)})
    finally:
        store.close()
    return out


def _procs(world: int, scenarios: List[str], timeout: float = 20.0,
           late: float = 0.0) -> List[Dict[str, Any]]:
    """``world`` rank processes playing ``scenarios``; ranks 1.. start ``late`` s after rank 0
    (a loaded machine's worst case, made certain)."""
    srv = StoreServer("127.0.0.1", 0).start()
    try:
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("NCCLPY_STORE_TOKEN", None)
        ps = []
        for r in range(world):
            if r == 1 and late:
                time.sleep(late)
            ps.append(subprocess.Popen([sys.executable, __file__, "127.0.0.1", str(srv.port),
                                        str(r), str(world), ",".join(scenarios), str(timeout)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
        outs = []
        for p in ps:
            o, e = p.communicate(timeout=240)
            assert p.returncode == 0, e.decode()
            outs.append(json.loads(o.decode().strip().splitlines()[-1]))
        return outs
    finally:
        srv.close()


def _threads(world: int, scenarios: List[str], timeout: float = 60.0) -> List[Dict[str, Any]]:
    srv = StoreServer("127.0.0.1", 0).start()
    outs: List[Any] = [None] * world
    errs: List[BaseException] = []

    def go(r: int) -> None:
        try:
            outs[r] = run_rank("127.0.0.1", srv.port, r, world, scenarios, timeout)
        except BaseException as e:  # noqa: B902 - reported below
            errs.append(e)
    ts = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert not errs, errs
        assert all(o is not None for o in outs)
        return outs
    finally:
        srv.close()


MISMATCHES = {  # scenario -> the field marked in the table
    "collective": "*coll=broadcast*", "count": "*count=17*", "dtype": "*dtype=float64*",
    "op": "*op=MAX*", "premul": "*op=premul_sum(0.25)*", "root": "*root=1*",
    "in_place": "*in_place=False*",
}


def _all_raise(outs: List[Dict[str, Any]], sc: str, rnd: int = 0) -> List[str]:
    msgs = []
    for r, o in enumerate(outs):
        res = o[sc][rnd]
        assert res.get("error") == "CallMismatchError", (sc, r, res)
        msgs.append(res["msg"])
    return msgs


@pytest.fixture(scope="module")
def two() -> List[Dict[str, Any]]:
    return _procs(2, ["ok", *MISMATCHES, "sequence", "p2p_count"])


def test_matching_calls_pass_at_two_ranks(two):
    assert all(res == {"ok": True} for o in two for res in o["ok"])


@pytest.mark.parametrize("sc", sorted(MISMATCHES))
def test_each_mismatch_kind_raises_on_every_rank_with_the_field_marked(two, sc):
    for msg in _all_raise(two, sc):
        assert MISMATCHES[sc] in msg, msg
        assert "rank" in msg and "seq" in msg and "nothing of this round was given" in msg


def test_sequence_mismatch_is_marked(two):
    for msg in _all_raise(two, "sequence", 0):
        assert "1 collective call(s) in the round, rank 0 made 2" in msg
    for msg in _all_raise(two, "sequence", 1):   # rank 1 is one call behind from then on
        assert "sequence number 1 != rank 0's 2" in msg and "*1" in msg


@pytest.fixture(scope="module")
def pairs() -> List[Dict[str, Any]]:
    """Point-to-point scenarios on three ranks, with a short timeout (a missing peer is found
    by waiting for it)."""
    return _procs(3, ["p2p_bystander", "p2p_order", "p2p_regrouped", "p2p_missing_recv"],
                  timeout=2.0)          # the one that waits out its timeout comes last


@pytest.fixture(scope="module")
def deadlock() -> List[Dict[str, Any]]:
    # rank 1 starts after rank 0's 2 s would have passed, had rank 0 not waited at the start
    return _procs(2, ["p2p_both_send_first"], timeout=2.0, late=2.5)


def test_send_without_its_receive_is_named_by_the_sender(pairs):
    res = pairs[0]["p2p_missing_recv"][0]
    assert res["error"] == "CallCheckTimeout" and res["missing"] == [1], res
    assert ("rank 0: send #0 to rank 1 (16xfloat32) was not met by rank 1's recv #0 within "
            "2 s; rank 1 posted nothing for rank 0") in res["msg"], res["msg"]
    assert "nothing of this round was given to NCCL" in res["msg"]
    for r in (1, 2):       # the collective of that group passed; they had nothing to pair
        assert pairs[r]["p2p_missing_recv"] == [{"ok": True}]


def test_p2p_count_mismatch_raises_on_both_ranks_of_the_pair(two):
    m0, m1 = _all_raise(two, "p2p_count")
    assert ("mismatched: rank 0's send #0 to rank 1 (16xfloat32) meets rank 1's recv #0 of "
            "8xfloat32") in m0, m0
    assert ("mismatched: rank 1's recv #0 from rank 0 (8xfloat32) meets rank 0's send #0 of "
            "16xfloat32") in m1, m1


def test_a_rank_that_makes_no_point_to_point_call_never_waits_for_one(pairs):
    for o in pairs:
        assert all(res == {"ok": True} for res in o["p2p_bystander"]), o["p2p_bystander"]
        assert all(res == {"ok": True} for res in o["p2p_regrouped"]), o["p2p_regrouped"]


def test_the_same_messages_in_another_order_are_ambiguous(pairs):
    for r in (0, 1):
        res = pairs[r]["p2p_order"][0]
        assert res["error"] == "CallMismatchError", res
        assert "ambiguous: rank" in res["msg"] and "16xfloat32, 8xfloat32" in res["msg"] and \
            "8xfloat32, 16xfloat32" in res["msg"] and "issue order" in res["msg"], res["msg"]


def test_both_ranks_sending_first_outside_a_group_is_named_a_deadlock(deadlock):
    for r in (0, 1):
        res = deadlock[r]["p2p_both_send_first"][0]
        assert res["error"] == "CallCheckTimeout", res
        assert f"rank {1 - r} posted instead: send #0 to rank {r}" in res["msg"], res["msg"]
        assert "both ranks send first outside a group" in res["msg"]


def test_eight_ranks_in_processes():
    outs = _procs(8, ["ok", "count", "missing"], timeout=8.0)
    assert all(res == {"ok": True} for o in outs for res in o["ok"])
    for msg in _all_raise(outs, "count"):
        assert msg.count("*count=17*") == 1 and "rank 7: call 0 differs" in msg
    for r, o in enumerate(outs[:7]):           # rank 7 never came to check 1
        assert o["missing"][0] == {"ok": True}
        res = o["missing"][1]
        assert res["error"] == "CallCheckTimeout" and res["missing"] == [7], res
        assert "rank(s) 7 never arrived" in res["msg"] and "(never arrived)" in res["msg"]


def test_sixty_four_ranks_as_threads():
    outs = _threads(64, ["ok", "dtype"])
    assert all(res == {"ok": True} for o in outs for res in o["ok"])
    for msg in _all_raise(outs, "dtype"):
        assert msg.count("*dtype=float64*") == 1 and "rank 63" in msg


def test_fingerprint_and_table_from_real_plans():
    r0, r1 = Resolver(PlanContext(0, 2)), Resolver(PlanContext(1, 2))
    p0 = r0.resolve("all_reduce", 0, X, None, ("sum",)).plan
    p1 = r1.resolve("all_reduce", 0, _buf(17), None, ("sum",)).plan
    f0, f1 = fingerprint([p0], 3), fingerprint([p1], 3)
    assert f0["calls"][0] == {"seq": 3, "coll": "all_reduce", "nccl": "AllReduce", "count": 16,
                              "dtype": "float32", "op": "SUM", "root": None, "in_place": True,
                              "config": None}
    problems = compare({0: f0, 1: f1})
    assert problems == ["rank 1: call 0 differs from rank 0's in count"]
    table = format_table({0: f0, 1: f1}, "x", 0, problems)
    assert "*count=17*" in table and "count=16" in table


def test_checker_one_rank_and_no_store_round_trip():
    chk = Checker(None, 0, 1)
    chk.check([Resolver(PlanContext(0, 1)).resolve("all_reduce", 0, X, None, ("sum",)).plan])
    assert chk.seq == 1 and chk.round == 1
    with pytest.raises(CallMismatchError, match="its sends to itself"):
        plan = Resolver(PlanContext(0, 1), ).plan("send", (X,), (0,), in_group=True)
        chk.check([plan], ["send"])     # a send to self without its receive


def test_error_family():
    assert issubclass(CallCheckTimeout, CallMismatchError)
    assert issubclass(CallMismatchError, NcclpyError)


if __name__ == "__main__":
    host, port, rank, world, scs, tmo = sys.argv[1:7]
    print(json.dumps(run_rank(host, int(port), int(rank), int(world), scs.split(","),
                              float(tmo))))
