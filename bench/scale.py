"""``python -m bench.scale``: ncclpy's control plane at 64 .. 8,192 ranks on one machine (no GPU).

What is real: the store server (its own process, ``StoreServer`` with the limits a job of N
ranks gets), the wire protocol, the watchdog's decisions (:class:`ncclpy.watchdog.WatchState`
fed by :func:`ncclpy.watchdog.peers_from_beat` from real BEAT replies, judged only when on
time, at every 0.1 s tick, with a fresh read before a silence becomes a verdict, verdicts published
in the table: :mod:`bench.scale_sim`), checked mode's fingerprints and hashes
(:func:`ncclpy.checked.fingerprint` of real plans, :func:`ncclpy.checked.round_hashes`)
and its one VOTE per rank, the launcher's death notice (:func:`ncclpy.debug.deaths.publish_deaths`),
and one rank of every run: a process running the real :class:`ncclpy.watchdog.Watchdog` thread
over a real ``TCPStore`` (the one paused, stalled or killed).  What is simulated: the other N-1
ranks are clients of one event loop (this process), one connection each for heartbeats plus one
each for checked-mode votes (as a rank's watchdog beats over a spare connection while its main
thread's vote is parked), starting at random times over the start spread.

Per run: store requests/s and CPU of the store process over a heartbeat-only window, beat latency
p50/p99 (send to reply, as the event loop sees it), an unrelated client's ``get`` p99 (another
process), false aborts (a decision naming a live rank, or any decision in a run without a
fault or with healthy pauses: must be 0), checked-mode time per call (all N votes sent to all N
verdicts back) and each rank's local cost, store keys after the run, connections held; with a
fault: "sigkill" (the launcher's notice) and "stall" (SIGSTOP while every rank waits on it):
how long until every simulated rank named the rank (or followed a published verdict naming
it), and whether anyone named another; "pause" (SIGSTOP 1.5 s, 2.5 s and ``--long-pause``
while nobody waits, then 1.5 s while everyone waits): any verdict is a false abort.  JSON with
``--json PATH`` (a ``results`` list).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ncclpy.debug.checked import fingerprint, round_hashes  # noqa: E402
from ncclpy.store import tablewire as W  # noqa: E402
from ncclpy.store.poller import raise_nofile_limit  # noqa: E402
from .scale_sim import (DEAD_AFTER, GRACE, NAME, Client, Loop, Sim)  # noqa: E402
from .scale_table import markdown  # noqa: E402

#: (world, start spread, fault); faults: "sigkill" (the launcher's notice), "stall" (SIGSTOP
#: for good while every rank waits on it), "pause" (SIGSTOP 1.5 s, 2.5 s and --long-pause
#: while nobody waits, then 1.5 s while every rank waits: no verdict may follow)
QUICK = [(256, 0, None), (1024, 0, None), (1024, 10, None), (1024, 0, "stall"),
         (1024, 0, "sigkill"), (256, 0, "pause")]
DEFAULT = [(n, 0, None) for n in (64, 256, 1024, 4096, 8192)] + \
    [(n, s, None) for n in (1024, 8192) for s in (10, 60)] + \
    [(n, 0, f) for n in (1024, 8192) for f in ("stall", "sigkill")] + \
    [(n, 0, "pause") for n in (64, 1024, 8192)]
PAUSES = (1.5, 2.5)             # then --long-pause (default 60 s)


# -- helper processes ------------------------------------------------------------------------------
def _server_main(world: int) -> None:
    """The store process: serve, answer "stats" on stdin with one JSON line."""
    from ncclpy.store import StoreLimits, StoreServer
    srv = StoreServer("127.0.0.1", 0, limits=StoreLimits.for_world(world))
    prof = os.environ.get("BENCH_SCALE_PROFILE")
    if prof:                    # profile the server thread (a developer's aid)
        import cProfile
        serve = srv._serve
        p = cProfile.Profile()

        def profiled() -> None:
            p.runcall(serve)
            p.dump_stats(prof)
        srv._serve = profiled   # type: ignore[method-assign]
    srv.start()
    print(srv.port, flush=True)
    for line in sys.stdin:
        if line.strip() != "stats":
            break
        t = os.times()
        print(json.dumps({"served": srv.served, "keys": srv.num_keys, "conns": srv.num_clients,
                          "cpu": t.user + t.system, "sys": t.system, "at": time.monotonic()}),
              flush=True)
    srv.close()


def _rank_main(port: int, rank: int, world: int) -> None:
    """One real rank: the real Watchdog thread over a real TCPStore, with a stand-in comm."""
    from ncclpy.store import TCPStore
    from ncclpy.debug.watchdog import Watchdog

    class Comm:
        name, _device, _watch, _timeout = NAME, 0, None, GRACE

        def __init__(self) -> None:
            self.rank, self.world_size = rank, world

        def _watchdog_abort(self, d: Any) -> None:
            print(json.dumps({"decision": d.reason, "suspects": list(d.suspects)}), flush=True)
    wd = Watchdog(Comm(), TCPStore("127.0.0.1", port, timeout=60)).start()
    print("up", flush=True)
    for line in sys.stdin:                  # "wait": a call that waits (never completes)
        if line.strip() == "wait" and wd.queue is not None:
            wd.queue.append(_Waiting())
    while True:
        time.sleep(3600)


class _Waiting:
    """A Work whose call never completes (its event recorded: the watchdog times it)."""

    _owned, _event, _error = False, object(), None
    plan = type("Plan", (), {"collective": "all_reduce", "calls": ()})()

    def is_completed(self) -> bool:
        return False

    def _reap(self, raising: bool = False) -> bool:
        """The watchdog's look (as for a real Work: True once complete)."""
        return False


def _getter_main(port: int, seconds: float) -> None:
    """An unrelated client: a get of an existing key every 10 ms; prints p50/p99/max (ms)."""
    from ncclpy.store import TCPStore
    s = TCPStore("127.0.0.1", port, timeout=60)
    s.set("bench/unrelated", b"x")
    ts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        s.get("bench/unrelated")
        ts.append(time.perf_counter() - t0)
        time.sleep(0.01)
    ts.sort()
    print(json.dumps({"p50": ts[len(ts) // 2] * 1e3, "p99": ts[int(len(ts) * 0.99)] * 1e3,
                      "max": ts[-1] * 1e3, "n": len(ts)}), flush=True)


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"{__package__ or 'bench'}.scale", *args],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))


# -- one run -----------------------------------------------------------------------------------
def _stats(srv: subprocess.Popen) -> Dict[str, Any]:
    srv.stdin.write("stats\n")
    srv.stdin.flush()
    return json.loads(srv.stdout.readline())


def _plan(world: int, rank: int) -> Any:
    """Rank ``rank``'s plan of an in-place float32 all_reduce, by the real Resolver."""
    from ncclpy import Buffer
    from ncclpy.comm.resolver import Resolver
    from ncclpy.plan.types import PlanContext
    return Resolver(PlanContext(rank, world)).resolve(
        "all_reduce", 0, Buffer(0x100000, 1024, "float32", 0), None, ("sum",)).plan


def run_one(world: int, spread: float, fault: Optional[str], window: float,
            checked_calls: int, seed: int = 1, long_pause: float = 60.0) -> Dict[str, Any]:
    """One run (see the module docstring); its figures."""
    rng = random.Random(seed)
    srv = _spawn("--_server", str(world))
    port = int(srv.stdout.readline())
    real = None
    loop = None
    try:
        t0 = time.monotonic() + 0.5
        sims = [Sim(r, world, t0 + (rng.uniform(0, spread) if spread else 0.0))
                for r in range(world - 1)]
        loop = Loop(port, world, sims)
        votes = _vote_bodies(world, checked_calls) if checked_calls else None
        real = _spawn("--_rank", str(port), str(world - 1), str(world))
        assert real.stdout.readline().strip() == "up"
        loop.run_until(t0 + spread + 3.0)                   # everyone started and beating
        if not all(s.client is not None and s.client.greeted for s in sims):
            raise RuntimeError("not every simulated rank connected")
        getter = _spawn("--_getter", str(port), str(window))
        a = _stats(srv)
        loop.record = True
        loop.run_until(time.monotonic() + window)
        b = _stats(srv)
        loop.record = False
        dt = b["at"] - a["at"]
        rtts = sorted(loop.rtts)
        out: Dict[str, Any] = {
            "ranks": world, "spread_s": spread, "fault": fault, "window_s": round(dt, 2),
            "store_requests_per_s": round((b["served"] - a["served"]) / dt),
            "store_cpu_fraction": round((b["cpu"] - a["cpu"]) / dt, 4),
            "store_sys_fraction": round((b["sys"] - a["sys"]) / dt, 4),
            "store_cpu_us_per_request": round(1e6 * (b["cpu"] - a["cpu"]) /
                                              max(1, b["served"] - a["served"]), 2),
            "beat_p50_s": round(rtts[len(rtts) // 2], 5) if rtts else None,
            "beat_p99_s": round(rtts[int(len(rtts) * 0.99)], 5) if rtts else None,
            "late_beats": sum(s.late for s in sims)}
        loop.run_until(time.monotonic() + 1.0, lambda: getter.poll() is not None)
        g = json.loads(getter.communicate(timeout=30)[0].strip().splitlines()[-1])
        out["unrelated_get_p99_ms"] = round(g["p99"], 3)
        if votes is not None:
            c0 = _stats(srv)
            out.update(_checked(loop, world, *votes))
            c1 = _stats(srv)
            out["checked_store_cpu_ms"] = round(1e3 * (c1["cpu"] - c0["cpu"]) /
                                                out["checked_calls"], 3)
        if fault:
            out.update(_fault(loop, real, fault, port, long_pause))
        healthy = fault in (None, "pause")      # no verdict at all may follow
        false = [s.decision.message for s in sims if s.decision is not None and
                 (healthy or set(s.decision.suspects) != {world - 1})]
        if healthy:                  # the real rank's own watchdog must not have decided
            real.kill()
            said = real.communicate(timeout=30)[0]
            false += [line for line in said.splitlines() if line.startswith('{"decision"')]
        out["false_aborts"] = len(false)
        if false:
            out["false_abort_example"] = false[0][:300]
        st = _stats(srv)
        out["store_keys_after"], out["connections"] = st["keys"], st["conns"]
        return out
    finally:
        if loop is not None:
            loop.close()
        try:
            srv.stdin.write("quit\n")
            srv.stdin.flush()
            srv.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for p in (real, srv):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def _vote_bodies(world: int, calls: int) -> tuple:
    """Every rank's VOTE of ``calls`` checked calls (real plans, fingerprints, hashes), made
    before the run so the loop never stalls; and the median local cost per rank per call."""
    plans = [_plan(world, r) for r in range(world)]
    rounds, local = [], []
    for i in range(calls):
        key = f"ncclpy/{NAME}/0/chk/{i}/v".encode()
        bodies = []
        for r in range(world):
            t = time.perf_counter()
            coll, total = round_hashes(fingerprint([plans[r]], i), r)
            bodies.append(W.pack_vote(key, world, r, coll, total, 0, 60000))
            local.append(time.perf_counter() - t)
        rounds.append((key, bodies))
    return rounds, statistics.median(local)


def _checked(loop: Loop, world: int, rounds: List[Any], local: float) -> Dict[str, Any]:
    """The checked calls of all ranks, one after the other (N more connections: the voters)."""
    loop.voters = [Client(loop, loop.port) for _ in range(world)]
    loop.run_until(time.monotonic() + 60, lambda: all(c.greeted for c in loop.voters))
    if not all(c.greeted for c in loop.voters):
        raise RuntimeError("checked mode: not every voter connected within 60 s")
    for key, bodies in rounds:
        loop.vote_round(key, bodies)
        loop.run_until(time.monotonic() + 60, lambda: loop.votes_left == 0)
    ts = sorted(loop.vote_times)
    return {"checked_call_ms": round(1e3 * statistics.median(ts), 3),
            "checked_call_p99_ms": round(1e3 * ts[int(len(ts) * 0.99)], 3),
            "checked_local_us": round(1e6 * local, 1),
            "checked_calls": len(rounds), "checked_mismatches": loop.vote_bad}


def _line(p: subprocess.Popen, seconds: float) -> Optional[str]:
    """The next line ``p`` prints within ``seconds`` (None: nothing)."""
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if sel.select(seconds):
            return p.stdout.readline().strip() or None
    return None


def _fault(loop: Loop, real: subprocess.Popen, fault: str, port: int,
           long_pause: float) -> Dict[str, Any]:
    victim = loop.world - 1
    if fault == "pause":            # healthy pauses: no verdict may follow (counted after)
        pauses = list(PAUSES) + [long_pause]
        for gap in pauses:
            real.send_signal(signal.SIGSTOP)
            loop.run_until(time.monotonic() + gap)
            real.send_signal(signal.SIGCONT)
            loop.run_until(time.monotonic() + 2.0)
        loop.wait_all(True)         # every rank waits in a call on it: a short pause is fine
        real.send_signal(signal.SIGSTOP)
        loop.run_until(time.monotonic() + PAUSES[0])
        real.send_signal(signal.SIGCONT)
        loop.run_until(time.monotonic() + 2.0)
        loop.wait_all(False)
        return {"victim": victim, "pauses_s": pauses + [f"{PAUSES[0]} waited on"],
                "pause_verdicts": sum(s.decision is not None for s in loop.sims),
                "confirms": sum(s.confirms for s in loop.sims), "silence_limit_s": DEAD_AFTER}
    t = time.monotonic()
    if fault == "stall":
        loop.wait_all(True)
        t = time.monotonic()
        real.send_signal(signal.SIGSTOP)
    else:
        real.kill()
        real.wait()
        from ncclpy.debug.deaths import publish_deaths
        from ncclpy.store import TCPStore
        with TCPStore("127.0.0.1", port, timeout=5) as s:   # what ncclpy run does
            publish_deaths(s, [victim], "was killed by signal SIGKILL")
    loop.run_until(t + DEAD_AFTER + 10, lambda: all(s.decision for s in loop.sims))
    named = [s.decided_at - t for s in loop.sims
             if s.decision is not None and s.decision.suspects == (victim,)]
    out: Dict[str, Any] = {
        "victim": victim, "named_by": len(named), "of": len(loop.sims),
        "detect_max_s": round(max(named), 2) if named else None,
        "detect_p50_s": round(statistics.median(named), 2) if named else None,
        "followed": sum(s.decision is not None and s.decision.reason == "peer_aborted"
                        for s in loop.sims),
        "confirms": sum(s.confirms for s in loop.sims), "silence_limit_s": DEAD_AFTER}
    if fault == "stall":            # back: idle, left alone; its next call follows the
        real.send_signal(signal.SIGCONT)        # published verdict, naming itself
        idle = _line(real, 2.0)
        real.stdin.write("wait\n")
        real.stdin.flush()
        said = idle or _line(real, 5.0)
        d = json.loads(said) if said and said.startswith("{") else None
        out["victim_followed"] = bool(d and not idle and d["decision"] == "peer_aborted"
                                      and d["suspects"] == [victim])
    return out


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench.scale``'s parser (one-line usage errors, exit status 2)."""
    from ncclpy.cli_util import OneLineParser
    p = OneLineParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a subset within about 2 minutes")
    p.add_argument("--ranks", default=None, metavar="N,N,...",
                   help="world sizes to run, spread 0, no fault (default: the full table)")
    p.add_argument("--window", type=float, default=None, metavar="S",
                   help="seconds of heartbeat measurement per run (default 10; --quick 5)")
    p.add_argument("--checked-calls", type=int, default=20, metavar="K",
                   help="checked-mode calls per run without a fault (default 20)")
    p.add_argument("--key-rounds", type=int, default=None, metavar="K",
                   help="checked calls of 2 ranks for the key-count check (default 100000; "
                        "--quick 20000)")
    p.add_argument("--pauses", action="store_true",
                   help="only the pause and stall runs (at 16, 256 and 1,024 ranks)")
    p.add_argument("--long-pause", type=float, default=60.0, metavar="S",
                   help="the long pause of the pause runs (default 60)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="print the table of a JSON file this benchmark wrote, and exit")
    p.add_argument("--_server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_rank", nargs=3, type=int, help=argparse.SUPPRESS)
    p.add_argument("--_getter", nargs=2, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; a usage error is one line (exit 2)."""
    from ncclpy.cli_util import exit_status
    try:
        return _main(argv)
    except SystemExit as e:
        return exit_status(e)


def _main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a._server:
        _server_main(a._server)
        return 0
    if a._rank:
        _rank_main(*a._rank)
        return 0
    if a._getter:
        _getter_main(int(a._getter[0]), float(a._getter[1]))
        return 0
    if a.markdown:
        try:
            with open(a.markdown) as f:
                print(markdown(json.load(f)))
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--markdown: cannot read {a.markdown!r}: {e}")
        return 0
    for flag, v, lo in (("--window", a.window, 0.5), ("--checked-calls", a.checked_calls, 0),
                        ("--key-rounds", a.key_rounds, 1), ("--long-pause", a.long_pause, 0)):
        if v is not None and v < lo:
            p.error(f"{flag}: expected a number >= {lo:g}, got {v:g}")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        p.error(f"--json: the folder of {a.json!r} does not exist")
    raise_nofile_limit()
    if a.ranks:
        try:
            runs = [(int(n), 0, None) for n in a.ranks.split(",")]
        except ValueError:
            p.error(f"--ranks: expected world sizes like 64,1024, got {a.ranks!r}")
        if any(n < 2 for n, _, _ in runs):
            p.error(f"--ranks: expected world sizes >= 2, got {a.ranks!r}")
    elif a.pauses:
        runs = [(n, 0, f) for n in (16, 256, 1024) for f in ("pause", "stall")]
    else:
        runs = QUICK if a.quick else DEFAULT
    window = a.window or (5.0 if a.quick else 10.0)
    results = []
    for world, spread, fault in runs:
        r = run_one(world, spread, fault, window, 0 if fault else a.checked_calls,
                    long_pause=a.long_pause)
        results.append(r)
        print(json.dumps(r), flush=True)
    keys = _key_count(a.key_rounds or (20000 if a.quick else 100000))
    print(json.dumps(keys), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "checked_keys": keys,
                       "machine": {"cpus": os.cpu_count()}}, f, indent=1)
    bad = [r for r in results if r["false_aborts"] or (
        r.get("fault") in ("stall", "sigkill") and r["named_by"] != r["of"]) or
        r.get("victim_followed") is False]
    return 1 if bad or keys["keys_after"] > keys["keys_before"] else 0


def _key_count(rounds: int) -> Dict[str, Any]:
    """Two ranks (threads, the real Checker over real TCPStores) make ``rounds`` checked calls;
    the store's key count before and after."""
    import threading
    from ncclpy.debug.checked import Checker
    from ncclpy import Buffer
    from ncclpy.comm.resolver import Resolver
    from ncclpy.plan.types import PlanContext
    from ncclpy.store import StoreServer, TCPStore
    srv = StoreServer("127.0.0.1", 0).start()
    before = srv.num_keys

    def rank(r: int) -> None:
        s = TCPStore("127.0.0.1", srv.port, timeout=60)
        plan = Resolver(PlanContext(r, 2)).resolve(
            "all_reduce", 0, Buffer(0x100000, 1024, "float32", 0), None, ("sum",)).plan
        chk = Checker(s, r, 2, name="keys", timeout=60)
        for _ in range(rounds):
            chk.check([plan])
        s.close()
    t0 = time.monotonic()
    th = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    out = {"rounds": rounds, "keys_before": before, "keys_after": srv.num_keys,
           "seconds": round(time.monotonic() - t0, 1)}
    srv.close()
    return out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(141)
