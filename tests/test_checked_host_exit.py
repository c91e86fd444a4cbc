"""Checked mode when rank 0 hosts the store and leaves the moment its check raises (real
processes, real stores, no GPU): a mismatch must raise CallMismatchError on *every* rank, with
the full table, never a StoreConnectionError on a rank still reading (issue 22, item 4: 2 of 7
runs of a 3-rank job failed so before).  Both paths: ncclpy's store (the vote) and a torch
TCPStore (the exchange through keys).  Each rank is a process of its own, forked from one
interpreter that imported ncclpy (and torch) once (tests/proc_speed.py), 6 jobs of 3 ranks one
after another.  Run as a script, this file is one rank."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

import proc_speed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytestmark = pytest.mark.timeout(600)
#: every wait's bound in a rank: a deadline for a hang (a machine's load only delays arrivals)
BOUND = 120


def _rank(kind: str, portfile: str, rank: int, world: int) -> None:
    """One rank: rank 0 hosts the store; the last rank plans 17 elements, the others 16."""
    from ncclpy import Buffer
    from ncclpy.debug.checked import Checker
    from ncclpy.comm.resolver import Resolver
    from ncclpy.plan.types import PlanContext
    server = None
    from port_file import publish_port, read_port
    if kind == "ncclpy":
        from ncclpy.store import StoreServer, TCPStore
        if rank == 0:
            server = StoreServer("127.0.0.1", 0).start()
            publish_port(portfile, server.port)
        port = read_port(portfile)
        store = TCPStore("127.0.0.1", port, timeout=BOUND)
    else:
        import datetime
        import torch.distributed as dist
        from ncclpy.rendezvous.torch_store import TorchStoreAdapter
        if rank == 0:
            raw = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=BOUND))
            port = raw.port
            publish_port(portfile, port)
        else:
            port = read_port(portfile)
            raw = dist.TCPStore("127.0.0.1", port, world, False,
                                timeout=datetime.timedelta(seconds=BOUND))
        store = TorchStoreAdapter(raw, f"127.0.0.1:{port}", BOUND)
    count = 17 if rank == world - 1 else 16
    plan = Resolver(PlanContext(rank, world)).resolve(
        "all_reduce", 0, Buffer(0x100000, count, "float32", 0), None, ("sum",)).plan
    t0 = time.monotonic()
    try:
        Checker(store, rank, world, name="t", prefix="t/chk", timeout=BOUND).check([plan])
        out = {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"error": type(e).__name__, "msg": str(e)}
    out["took"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    os._exit(0)      # at once, store and server with it: the race this test is about


#: what a rank imports before its check, imported once by the interpreter the ranks fork from
_PRELOAD = ("ncclpy", "ncclpy.debug.checked", "ncclpy.comm.resolver", "ncclpy.plan.types",
            "ncclpy.store", "port_file")
_PRELOAD_TORCH = ("torch.distributed", "ncclpy.rendezvous.torch_store")


@pytest.mark.parametrize("kind", ["ncclpy", "torch"])
def test_every_rank_raises_the_mismatch_though_rank_0_leaves_at_once(kind, tmp_path):
    if kind == "torch":
        pytest.importorskip("torch.distributed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((ROOT, os.path.join(ROOT, "tests"))))
    env.pop("NCCLPY_STORE_TOKEN", None)
    world = 3
    jobs = [[[kind, str(tmp_path / f"port{attempt}"), r, world] for r in range(world)]
            for attempt in range(6)]
    runs = proc_speed.forked_jobs(
        "test_checked_host_exit:_rank", jobs, str(tmp_path / "ranks"), env=env,
        preload=_PRELOAD + (_PRELOAD_TORCH if kind == "torch" else ()), timeout=3 * BOUND)
    for attempt, job in enumerate(runs):
        for r, p in enumerate(job.ranks):
            assert p.returncode == 0, p.stderr[-2000:]
            res = json.loads(p.stdout.strip().splitlines()[-1])
            assert res.get("error") == "CallMismatchError", (kind, attempt, r, res)
            assert "*count=17*" in res["msg"] and "could not collect" not in res["msg"], res
            # no rank waited out its bound for a store that had gone with rank 0
            assert res["took"] < BOUND, (kind, attempt, r, res)


if __name__ == "__main__":
    _rank(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
