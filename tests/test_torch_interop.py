"""ncclpy inside a torch job, on CPU with gloo, up to the point a GPU is needed: the uid of
``ncclpy.init(from_torch=group)`` goes through torch's own store (no port of ncclpy's) or, where
that store cannot be reached, a broadcast in the group; rank r of the group is rank r of the
communicator; subgroups and several communicators never share keys.  The object collectives
(``broadcast_object`` / ``all_gather_object``) over both stores, with the writer hosting the store
and leaving at once.  Real processes, real torch.distributed (gloo), real libnccl unique ids.
Each rank is a process of its own, forked from one interpreter that imported torch and ncclpy
once (tests/proc_speed.py); the three torch jobs run one after another in one such interpreter,
shared by their tests.  Run as a script, this file is one rank."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict

import pytest

import proc_speed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("torch_interop")]


def _torch_dist():
    """torch.distributed, for the tests that run it (the object collectives over ncclpy's own
    store, with the writer hosting it, need no torch and run without it)."""
    return pytest.importorskip("torch.distributed")


def _uid_available() -> str:
    try:
        from ncclpy.bootstrap import get_unique_id
        get_unique_id()
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------ the rank (script mode)
def _rank_main(mode: str, portfile: str, rank: int, world: int) -> None:
    import datetime

    import torch.distributed as dist
    from port_file import publish_port, read_port
    tmo = datetime.timedelta(seconds=60)
    if rank == 0:       # the job's store on a port the kernel picked (no free-port race)
        store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False, timeout=tmo)
        publish_port(portfile, store.port)
    else:
        store = dist.TCPStore("127.0.0.1", read_port(portfile), world, False, timeout=tmo)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=tmo)
    from ncclpy.rendezvous import torch_group as T
    out: dict = {"rank": rank}
    if mode == "broadcast":     # a torch whose store cannot be reached: the broadcast path
        from torch.distributed import distributed_c10d as c10d

        def no_store():
            raise RuntimeError("no default store in this torch")
        c10d._get_default_store = no_store
    if mode in ("store", "broadcast"):
        a = T.bootstrap_from_torch(None, "a", timeout=30)
        b = T.bootstrap_from_torch(True, "a", timeout=30)       # the same name again: gen 1
        sub = dist.new_group([1, 2])
        out.update(a=[a.rank, a.world_size, a.generation, a.uid.hex(), a.uid_exchange],
                   b=[b.generation, b.uid.hex()])
        if rank in (1, 2):
            s = T.bootstrap_from_torch(sub, "a", timeout=30)
            out["sub"] = [s.rank, s.world_size, s.generation, s.uid.hex()]
        else:
            try:
                T.bootstrap_from_torch(sub, "a", timeout=30)
            except Exception as e:  # noqa: BLE001
                out["sub_error"] = f"{type(e).__name__}: {e}"
        out["source"] = a.info.source
    elif mode == "objects":     # through torch's store, from a communicator's point of view
        from ncclpy.comm.objects import ObjectExchange
        _, g, r, n, gname = T.torch_group(None)
        ex = ObjectExchange(T._group_store(dist, gname, 30), r, n, "t/obj", 30)
        out["b"] = ex.broadcast({"from": rank, "x": [1.5, rank]} if rank == 1 else None, 1)
        out["g"] = ex.all_gather(("rank", rank, "y" * rank))
        try:
            ex.all_gather(b"z" * 2048, max_bytes=1024)
        except Exception as e:  # noqa: BLE001
            out["big"] = f"{type(e).__name__}: {e}"
        t0 = time.monotonic()
        try:          # one rank cannot send: every rank raises at once, naming it
            ex.all_gather("z" * 2048 if rank == 1 else "ok", max_bytes=1024)
        except Exception as e:  # noqa: BLE001
            out["one_big"] = f"{type(e).__name__}: {e}"
        try:
            ex.broadcast((lambda: 0) if rank == 2 else None, 2)
        except Exception as e:  # noqa: BLE001
            out["unpicklable"] = f"{type(e).__name__}: {e}"
        out["fail_s"] = time.monotonic() - t0
        out["after"] = ex.all_gather(rank)          # the ranks still agree on the sequence
    # rank 0 hosts the job's store: it leaves only once no rank needs it (the others may still
    # be in an exchange, or in gloo, when rank 0 is done; not this test's subject)
    dist.barrier()
    print(json.dumps(out), flush=True)
    if mode != "objects":
        dist.destroy_process_group()
    os._exit(0)


def _objects_hosted(portfile: str, rank: int, world: int) -> None:
    """Rank 0 hosts ncclpy's store and exits the moment its collective returns."""
    from port_file import publish_port, read_port
    from ncclpy.comm.objects import ObjectExchange
    from ncclpy.store import StoreServer, TCPStore
    if rank == 0:
        publish_port(portfile, StoreServer("127.0.0.1", 0).start().port)
    store = TCPStore("127.0.0.1", read_port(portfile), timeout=30)
    ex = ObjectExchange(store, rank, world, "h/obj", 30)
    got = ex.all_gather({"r": rank})
    b = ex.broadcast(["root", rank] if rank == 0 else None, 0)
    print(json.dumps({"g": got, "b": b}), flush=True)
    os._exit(0)


# ------------------------------------------------------------------ the tests
def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((ROOT, os.path.join(ROOT, "tests"))))
    for k in ("NCCLPY_STORE_TOKEN", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


#: what the ranks import before they start, once, in the interpreter they fork from
_PRELOAD = ("ncclpy", "ncclpy.comm.objects", "ncclpy.store", "port_file")
_PRELOAD_TORCH = ("torch.distributed", "ncclpy.rendezvous.torch_group")


def _outs(job: proc_speed.JobRun) -> list:
    """Every rank exited 0; what each printed last (its JSON line), in rank order."""
    outs = []
    for p in job.ranks:
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return outs


@pytest.fixture(scope="module")
def torch_jobs(tmp_path_factory) -> Dict[str, proc_speed.JobRun]:
    """The 3-rank torch jobs of this file (the uid's two paths where libnccl can make a uid,
    the object collectives through torch's store), one after another: one import of torch
    for the three, shared by the tests that read them."""
    _torch_dist()
    modes = (["store", "broadcast"] if not _uid_available() else []) + ["objects"]
    tmp = tmp_path_factory.mktemp("torch-jobs")
    jobs = [[[mode, str(tmp / f"port-{mode}"), r, 3] for r in range(3)] for mode in modes]
    runs = proc_speed.forked_jobs("test_torch_interop:_rank_main", jobs, str(tmp / "ranks"),
                                  preload=_PRELOAD + _PRELOAD_TORCH, env=_env(), timeout=240)
    return dict(zip(modes, runs))


@pytest.mark.parametrize("mode", ["store", "broadcast"])
def test_from_torch_shares_one_uid_per_group_and_generation(mode, torch_jobs):
    _torch_dist()
    why = _uid_available()
    if why:
        pytest.skip(f"libnccl cannot make a unique id here: {why}")
    outs = _outs(torch_jobs[mode])
    a = [o["a"] for o in outs]
    assert [x[:3] for x in a] == [[0, 3, 1], [1, 3, 1], [2, 3, 1]]      # group rank = rank
    assert len({x[3] for x in a}) == 1 and {x[4] for x in a} == {
        "store" if mode == "store" else "torch-broadcast"}
    b = [o["b"] for o in outs]
    assert {x[0] for x in b} == {2} and len({x[1] for x in b}) == 1 and b[0][1] != a[0][3]
    sub = [o.get("sub") for o in outs]
    assert sub[0] is None and "is not a member of the group" in outs[0]["sub_error"]
    assert [s[:3] for s in sub[1:]] == [[0, 2, 1], [1, 2, 1]]         # ranks 1, 2 -> 0, 1
    assert sub[1][3] == sub[2][3] and sub[1][3] not in (a[0][3], b[0][1])
    assert outs[0]["source"].startswith("torch.distributed group ")


def test_object_collectives_through_torchs_store(torch_jobs):
    _torch_dist()
    outs = _outs(torch_jobs["objects"])
    for o in outs:
        assert o["b"] == {"from": 1, "x": [1.5, 1]}
        assert o["g"] == [["rank", 0, ""], ["rank", 1, "y"], ["rank", 2, "yy"]]
        assert o["big"].startswith("ArgumentError: all_gather_object: the object pickles to ")
        assert "expected at most max_bytes=1024" in o["big"]
        assert o["after"] == [0, 1, 2] and o["fail_s"] < 20       # nobody waited it out
    assert outs[1]["one_big"].startswith("ArgumentError: all_gather_object: the object pickles")
    for o in (outs[0], outs[2]):
        assert o["one_big"].startswith("ArgumentError: all_gather_object: rank 1 could not "
                                       "send its object: all_gather_object: the object pickles")
    assert outs[2]["unpicklable"].startswith("ArgumentError: broadcast_object: the object "
                                             "cannot be pickled")
    for o in outs[:2]:
        assert o["unpicklable"].startswith("ArgumentError: broadcast_object: rank 2 could not "
                                           "send its object: broadcast_object: the object cannot")


def test_object_collectives_when_the_writer_hosts_the_store_and_leaves_at_once(tmp_path):
    jobs = [[[str(tmp_path / f"port{attempt}"), r, 3] for r in range(3)] for attempt in range(4)]
    runs = proc_speed.forked_jobs("test_torch_interop:_objects_hosted", jobs,
                                  str(tmp_path / "ranks"), preload=_PRELOAD, env=_env(),
                                  timeout=120)
    for attempt, job in enumerate(runs):
        for got in _outs(job):
            assert got == {"g": [{"r": 0}, {"r": 1}, {"r": 2}], "b": ["root", 0]}, got
        assert job.seconds < 25, attempt        # nobody waited out its 30 s bound


def test_from_torch_errors_come_before_any_gpu_or_store(monkeypatch):
    import ncclpy
    from ncclpy.errors import (ArgumentError, ArgumentTypeError, CudaUnavailableError,
                               RendezvousError)
    dist = _torch_dist()
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this test process")
    with pytest.raises(RendezvousError, match="torch.distributed is not initialised"):
        ncclpy.init(from_torch=True)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ArgumentTypeError, match="from_torch: expected a torch.distributed "
                                                    "ProcessGroup"):
            ncclpy.init(from_torch="world")
        with pytest.raises(ArgumentError, match="from_torch takes rank, world size and store "
                                                "from the torch group; drop rank"):
            ncclpy.init(from_torch=True, rank=0)
        from ncclpy.info import no_gpu_reason
        why = no_gpu_reason()
        if why and not why.startswith("CuPy is not"):
            with pytest.raises(CudaUnavailableError):     # the GPU check, before the store
                ncclpy.init(from_torch=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    m, prt, rk, ws = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if m == "hosted":
        _objects_hosted(prt, rk, ws)
    else:
        _rank_main(m, prt, rk, ws)
