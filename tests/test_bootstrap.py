"""The uid exchange: real processes, sockets and libnccl (ncclGetUniqueId needs no GPU)."""
from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading

import pytest

import ncclpy
from ncclpy.bootstrap import (UID_BYTES, Bootstrap, _as_uid, exchange_uid, generation_key,
                              get_unique_id, uid_key)
from ncclpy.errors import ArgumentError, MissingDependencyError, RendezvousError
from ncclpy.rendezvous import free_port
from ncclpy.store import StoreServer, TCPStore, barrier

NPROCS = 8
TIMEOUT = 60.0


def _exchange_worker(rank: int, world: int, port: int, queue) -> None:
    """One rank: the default communicator, then 'a' and 'b' concurrently, then re-init 'a'."""
    try:
        store = TCPStore("127.0.0.1", port, is_server=rank == 0, timeout=TIMEOUT)
        got = {}
        uid, gen = exchange_uid(store, rank, timeout=TIMEOUT)
        got[("default", gen)] = uid

        def other(name: str) -> None:  # its own connection: truly concurrent exchanges
            with TCPStore("127.0.0.1", port, timeout=TIMEOUT) as s:
                for _ in range(2):  # generation 1, then a re-init: generation 2
                    u, g = exchange_uid(s, rank, name=name, timeout=TIMEOUT)
                    got[(name, g)] = u

        threads = [threading.Thread(target=other, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # explicit generation: no counter involved
        uid, gen = exchange_uid(store, rank, name="a", generation=7, timeout=TIMEOUT)
        got[("a", gen)] = uid
        barrier(store, rank, world, timeout=TIMEOUT)  # rank 0 keeps the server up until all read
        queue.put((rank, {f"{k[0]}/{k[1]}": v.hex() for k, v in got.items()}, None))
    except BaseException as e:  # report instead of hanging the parent
        import traceback
        queue.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from e


@pytest.fixture(scope="module")
def exchanged():
    """Run the 8-process exchange once; {rank: {"name/generation": uid hex}}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_exchange_worker, args=(r, NPROCS, port, queue))
             for r in range(NPROCS)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(NPROCS):
            rank, got, err = queue.get(timeout=TIMEOUT)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            else:
                results[rank] = got
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return results


def test_uid_exchange_8_processes_identical(exchanged):
    assert sorted(exchanged) == list(range(NPROCS))
    uids = {exchanged[r]["default/1"] for r in range(NPROCS)}
    assert len(uids) == 1
    assert len(bytes.fromhex(uids.pop())) == UID_BYTES


def test_concurrent_communicators_and_reinit_do_not_collide(exchanged):
    keys = {"default/1", "a/1", "a/2", "b/1", "b/2", "a/7"}
    for r in range(NPROCS):
        assert set(exchanged[r]) == keys
    per_key = {k: {exchanged[r][k] for r in range(NPROCS)} for k in keys}
    for k, vals in per_key.items():
        assert len(vals) == 1, f"ranks disagree on {k}"
    distinct = {vals.pop() for vals in per_key.values()}
    assert len(distinct) == len(keys), "two communicators or generations shared a uid"


def test_get_unique_id_is_128_fresh_bytes():
    a, b = get_unique_id(), get_unique_id()
    assert isinstance(a, bytes) and len(a) == len(b) == UID_BYTES
    assert a != b


@pytest.mark.parametrize("raw", [
    bytes(range(128)), bytearray(range(128)),
    tuple(v - 256 if v > 127 else v for v in range(128)),  # CuPy <= 13: signed chars
    list(range(128)),
])
def test_uid_normalisation(raw):
    assert _as_uid(raw, "uid") == bytes(range(128))


@pytest.mark.parametrize("raw", [b"x" * 127, b"x" * 129, (), "x" * 128, object(), [1.5] * 128])
def test_uid_normalisation_rejects(raw):
    with pytest.raises(RendezvousError):
        _as_uid(raw, "uid")


def test_keys_are_scoped_by_name_and_generation():
    assert uid_key("a", 1) == "ncclpy/uid/a/1"
    assert generation_key("a", 3) == "ncclpy/gen/a/3"
    assert len({uid_key(n, g) for n in ("a", "b", "a/1") for g in (1, 2)}) == 6


@pytest.fixture
def server():
    srv = StoreServer().start()
    yield srv
    srv.close()


def test_missing_publisher_times_out_with_a_named_error(server):
    with TCPStore(*server.address, timeout=10) as store:
        with pytest.raises(RendezvousError) as ei:
            exchange_uid(store, 1, name="late", timeout=0.3)
    msg = str(ei.value)
    assert "rank 1" in msg and "'late'" in msg and "generation 1" in msg
    assert "ncclpy/uid/late/1" in msg and "0.3 s" in msg


def test_bad_uid_in_store_is_rejected(server):
    with TCPStore(*server.address, timeout=10) as store:
        store.set(uid_key("bad", 1), b"short")
        with pytest.raises(RendezvousError, match="expected 128 bytes, got 5"):
            exchange_uid(store, 1, name="bad", generation=1, timeout=5)


@pytest.mark.parametrize("kwargs", [
    {"rank": -1}, {"rank": "0"}, {"rank": 0, "name": ""}, {"rank": 0, "name": 3},
    {"rank": 0, "generation": -1}, {"rank": 0, "generation": "1"}, {"rank": 0, "timeout": 0},
])
def test_exchange_argument_errors(server, kwargs):
    with TCPStore(*server.address, timeout=10) as store:
        rank = kwargs.pop("rank")
        with pytest.raises(ArgumentError):
            exchange_uid(store, rank, **kwargs)


def test_bootstrap_world_size_one():
    boot = ncclpy.bootstrap("solo", rank=0, world_size=1, env={}, timeout=10)
    assert isinstance(boot, Bootstrap)
    assert (boot.rank, boot.world_size, boot.local_rank, boot.name) == (0, 1, 0, "solo")
    assert len(boot.uid) == UID_BYTES and boot.generation == 1 and boot.device >= 0
    assert boot.info.source == "args" and boot.info.master_addr == "127.0.0.1"
    again = ncclpy.bootstrap("solo", rank=0, world_size=1, master_port=boot.info.master_port,
                             env={}, timeout=10)
    assert again.store is boot.store  # one store per address and process
    assert again.generation == 2 and again.uid != boot.uid


def test_bootstrap_two_ranks_in_threads_with_token():
    port, out, errs = free_port(), {}, []

    def run(rank: int) -> None:
        try:
            out[rank] = ncclpy.bootstrap("pair", rank=rank, world_size=2, master_addr="127.0.0.1",
                                         master_port=port, token="s3cret", timeout=20, env={})
        except BaseException as e:  # pragma: no cover - reported below
            errs.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]  # rank 0 starts last
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errs, errs
    assert out[0].uid == out[1].uid and out[0].store is not out[1].store
    assert (out[0].device, out[1].device) in ((0, 1), (0, 0))


def test_bootstrap_with_a_torch_store():
    dist = pytest.importorskip("torch.distributed")
    import datetime
    port, out = free_port(), {}
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=20))

    def run(rank: int, store) -> None:
        out[rank] = ncclpy.bootstrap("torch", store=store, rank=rank, world_size=2,
                                     master_addr="127.0.0.1", master_port=port, timeout=20)

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in ((1, client), (0, master))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0].uid == out[1].uid and len(out[0].uid) == UID_BYTES
    assert out[0].generation == out[1].generation == 1


def test_missing_cupy_names_the_extras():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from ncclpy.bootstrap import get_unique_id\n"
            "from ncclpy.errors import MissingDependencyError\n"
            "try:\n    get_unique_id()\nexcept MissingDependencyError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ncclpy[cu12]" in out.stdout and "ncclpy[cu13]" in out.stdout, out.stdout + out.stderr
    assert issubclass(MissingDependencyError, ImportError)


def test_import_ncclpy_bootstrap_loads_no_cupy_or_torch():
    code = ("import sys, ncclpy, ncclpy.bootstrap, ncclpy.rendezvous, ncclpy.launch.spawn\n"
            "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
