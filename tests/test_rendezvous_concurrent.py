"""Concurrent rendezvous (issue 15): two communicators bootstrapped at once from two threads of
each process, over the process's one shared store client; and the error family when rank 0
never comes up. Real processes, threads and loopback sockets."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import ncclpy
from ncclpy.errors import RendezvousError
from ncclpy.launch.env import rank_env
from ncclpy.rendezvous import free_port

from store_util import env as child_env

NPROCS = 6
ROUNDS = 4            # each thread bootstraps its communicator this many times in a row
BOOT_TIMEOUT = 15.0   # each bootstrap's own bound; a stalled one fails after this

_RANK = r'''
import json, sys, threading, time, traceback
import ncclpy
timeout = float(sys.argv[1])
ROUNDS = int(sys.argv[2])
start = threading.Barrier(2)
out = {}

def boot(name):
    start.wait()
    for gen in range(1, ROUNDS + 1):   # a re-init per round: generations 1..ROUNDS
        t0 = time.monotonic()
        key = f"{name}/{gen}"
        try:
            b = ncclpy.bootstrap(name, timeout=timeout)
            out[key] = {"uid": b.uid.hex(), "s": time.monotonic() - t0, "gen": b.generation}
        except BaseException as e:
            out[key] = {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - t0}

threads = [threading.Thread(target=boot, args=(n,)) for n in ("alpha", "beta")]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out), flush=True)
'''


def _run_job(tmp_path, nprocs: int, timeout: float) -> dict:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = free_port()
    procs = []
    for r in range(nprocs):
        env = {**child_env(), **rank_env(r, nprocs, r, nprocs, "127.0.0.1", port, "tok")}
        procs.append(subprocess.Popen([sys.executable, str(script), str(timeout), str(ROUNDS)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = {}
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=2 * ROUNDS * timeout + 60)
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err}"
            results[r] = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_two_threads_per_process_bootstrap_two_communicators_at_once(tmp_path):
    """6 processes x 2 threads, 'alpha' and 'beta' bootstrapped at the same moment (and re-inited
    twice), all over each process's one shared store client: every bootstrap succeeds well
    inside its timeout, and the ranks agree on each communicator's uid. Before the store client
    gave concurrent threads their own connection, a thread's parked get held back the other's
    set/add and most runs stalled until the timeout."""
    t0 = time.monotonic()
    results = _run_job(tmp_path, NPROCS, BOOT_TIMEOUT)
    failed = {(r, k): v["error"] for r, res in results.items() for k, v in res.items()
              if "error" in v}
    assert not failed, f"{len(failed)} of {2 * ROUNDS * NPROCS} bootstraps failed: {failed}"
    keys = {f"{n}/{g}" for n in ("alpha", "beta") for g in range(1, ROUNDS + 1)}
    uids = set()
    for key in keys:
        got = {results[r][key]["uid"] for r in results}
        assert len(got) == 1, f"ranks disagree on {key}"
        assert {results[r][key]["gen"] for r in results} == {int(key.split("/")[1])}
        uids |= got
        slowest = max(results[r][key]["s"] for r in results)
        assert slowest < BOOT_TIMEOUT / 2, f"{key}: a bootstrap took {slowest:.1f} s"
    assert len(uids) == len(keys), "two communicators or generations shared a uid"
    assert time.monotonic() - t0 < ROUNDS * BOOT_TIMEOUT


def test_rank0_never_up_is_a_rendezvous_error_naming_address_and_wait():
    port = free_port()
    env = rank_env(1, 2, 1, 2, "127.0.0.1", port, "tok")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as ei:
        ncclpy.bootstrap("never", timeout=1.0, env=env)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "within 1 s" in msg and "rank 0" in msg, msg
    assert "StoreConnectionError" in msg   # the cause is named, and chained
    assert type(ei.value.__cause__).__name__ == "StoreConnectionError"


def test_rank0_whose_acks_all_arrived_but_the_notice_did_not_succeeds():
    """The count is the truth: when every other rank counted itself in but the last one's
    '/all' notice is missing, rank 0 is done (no 'Only 2 of 2 other ranks read the id')."""
    from ncclpy.bootstrap import ack_key, exchange_uid
    from ncclpy.store import StoreServer, TCPStore
    srv = StoreServer("127.0.0.1", 0).start()
    try:
        with TCPStore(*srv.address, timeout=10) as store:
            store.add(ack_key("full", 1), 2)
            uid, gen = exchange_uid(store, 0, name="full", timeout=0.3, world_size=3)
            assert gen == 1 and len(uid) == 128
            with pytest.raises(RendezvousError, match=r"Only 1 of 2 other ranks read the id"):
                store.add(ack_key("part", 1), 1)
                exchange_uid(store, 0, name="part", timeout=0.3, world_size=3)
    finally:
        srv.close()
