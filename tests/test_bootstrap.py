"""The uid exchange: real processes, sockets and libnccl (ncclGetUniqueId needs no GPU)."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

import ncclpy
from ncclpy.bootstrap import (UID_BYTES, Bootstrap, _as_uid, ack_key, exchange_uid,
                              generation_key, get_unique_id, uid_key)
from ncclpy.errors import (ArgumentError, ArgumentTypeError, MissingDependencyError,
                           RendezvousError)
from ncclpy.rendezvous import free_port
from ncclpy.store import StoreServer, TCPStore

NPROCS = 8
TIMEOUT = 60.0


def _exchange_worker(rank: int, world: int, port: int, queue) -> None:
    """One rank: the default communicator, then 'a' and 'b' concurrently, then re-init 'a'."""
    try:
        store = TCPStore("127.0.0.1", port, is_server=rank == 0, timeout=TIMEOUT)
        got = {}
        uid, gen = exchange_uid(store, rank, timeout=TIMEOUT, world_size=world)
        got[("default", gen)] = uid

        def other(name: str) -> None:  # its own connection: truly concurrent exchanges
            with TCPStore("127.0.0.1", port, timeout=TIMEOUT) as s:
                for _ in range(2):  # generation 1, then a re-init: generation 2
                    u, g = exchange_uid(s, rank, name=name, timeout=TIMEOUT, world_size=world)
                    got[(name, g)] = u

        threads = [threading.Thread(target=other, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # explicit generation: no counter involved
        uid, gen = exchange_uid(store, rank, name="a", generation=7, timeout=TIMEOUT,
                                world_size=world)
        got[("a", gen)] = uid
        # no barrier: rank 0's last exchange returns only once every rank has read the uid, so
        # rank 0 (the store's host) may exit now without cutting anyone off
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
    assert generation_key("a", 3) == "ncclpy/gen/3"
    assert len({uid_key(n, g) for n in ("a", "b", "a/1") for g in (1, 2)}) == 6
    assert ack_key("a", 1) == "ncclpy/uid-ack/a/1"
    keys = [f(n, g) for f in (uid_key, ack_key) for n in ("a", "b", "a/1") for g in (1, 2)]
    assert len(set(keys) | {k + "/all" for k in keys}) == 24


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
    {"rank": 0, "world_size": 0}, {"rank": 2, "world_size": 2}, {"rank": 0, "world_size": "2"},
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


# ---------------------------------------------------------------- hand-over acknowledgement
def test_rank0_returns_only_after_every_rank_read_the_uid():
    """Rank 0 hosts the store; its bootstrap must not return (and let it close the store) while
    a rank has not read the uid yet."""
    port, out, errs = free_port(), {}, []

    def run(rank: int) -> None:
        try:
            out[rank] = ncclpy.bootstrap("handover", rank=rank, world_size=3,
                                         master_addr="127.0.0.1", master_port=port, env={},
                                         timeout=60)
        except BaseException as e:  # pragma: no cover - reported below
            errs.append(e)

    t0 = threading.Thread(target=run, args=(0,))
    t0.start()
    with TCPStore("127.0.0.1", port, timeout=30) as probe:
        probe.wait([uid_key("handover", 1)], 30)       # rank 0 has published the uid
        t0.join(0.5)
        assert t0.is_alive() and not errs, "rank 0 returned before any rank read the uid"
        run(1)
        assert probe.add(ack_key("handover", 1), 0) == 1
        t0.join(0.5)
        assert t0.is_alive() and not errs, "rank 0 returned before rank 2 read the uid"
        run(2)
        t0.join(30)
        assert not t0.is_alive() and not errs, errs
        # every rank has the uid: rank 0 dropped the exchange's keys
        assert not probe.check([uid_key("handover", 1)])
        assert not probe.check([ack_key("handover", 1)])
    assert out[0].uid == out[1].uid == out[2].uid


RANK_SCRIPT = """
import hashlib, sys, time
from ncclpy.bootstrap import bootstrap
rank, port = int(sys.argv[1]), int(sys.argv[2])
b = bootstrap("exit-early", rank=rank, world_size=3, master_addr="127.0.0.1", master_port=port,
              env={}, timeout=60)
print(hashlib.sha256(b.uid).hexdigest(), flush=True)
# rank 0 exits at once, taking its store server with it
"""


def test_rank0_process_may_exit_right_after_bootstrap(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()

    def start(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(rank), str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    p0 = start(0)
    try:
        with TCPStore("127.0.0.1", port, timeout=60) as probe:
            probe.wait([uid_key("exit-early", 1)], 60)  # published, nobody has read it yet
        assert p0.poll() is None, "rank 0 exited before the other ranks read the uid"
        others = [start(1), start(2)]                 # the late ranks connect only now
        results = [p.communicate(timeout=60) for p in (p0, *others)]
    finally:
        for p in (p0,):
            if p.poll() is None:
                p.kill()
    codes = [p0.returncode] + [p.returncode for p in others]
    assert codes == [0, 0, 0], results
    hashes = {out.strip() for out, _ in results}
    assert len(hashes) == 1 and len(hashes.pop()) == 64


# ---------------------------------------------------------------- torch store failures
@pytest.fixture
def torch_store():
    dist = pytest.importorskip("torch.distributed")
    import datetime
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=20),
                          wait_for_workers=False)
    return store, port


def test_torch_store_timeout_becomes_a_rendezvous_error(torch_store):
    store, port = torch_store
    with pytest.raises(RendezvousError) as ei:
        exchange_uid(store, 1, name="late-torch", timeout=0.3)
    msg = str(ei.value)
    assert type(ei.value) is RendezvousError
    assert "rank 1 waited 0.3 s" in msg and "'late-torch'" in msg
    assert "ncclpy/uid/late-torch/1" in msg and f"127.0.0.1:{port}" in msg
    assert type(ei.value.__cause__).__name__ == "DistStoreError"   # the original is kept


def test_torch_store_ack_timeout_on_rank0_names_the_missing_ranks(torch_store):
    store, port = torch_store
    with pytest.raises(RendezvousError) as ei:
        exchange_uid(store, 0, name="lonely", timeout=0.3, world_size=3)
    msg = str(ei.value)
    assert "rank 0 waited 0.3 s" in msg and "ncclpy/uid-ack/lonely/1/all" in msg
    assert f"127.0.0.1:{port}" in msg and "Only 0 of 2 other ranks read the id" in msg


def test_ncclpy_store_ack_timeout_on_rank0(server):
    with TCPStore(*server.address, timeout=10) as store:
        with pytest.raises(RendezvousError, match=r"Only 0 of 1 other ranks read the id"):
            exchange_uid(store, 0, name="lonely", timeout=0.3, world_size=2)


# ---------------------------------------------------------------- device checked before rendezvous
@pytest.mark.parametrize("device, exc, needle", [
    (-1, ArgumentError, "got -1"), ("0", ArgumentTypeError, "got str '0'"),
    (True, ArgumentTypeError, "got bool True"), (1.0, ArgumentTypeError, "got float 1.0"),
])
@pytest.mark.parametrize("entry", ["bootstrap", "init"])
def test_bad_device_fails_before_waiting_for_peers(device, exc, needle, entry):
    # rank 1 of 2 with no store listening: a check after the rendezvous would wait 60 s
    port = free_port()
    fn = getattr(ncclpy, entry)
    t0 = time.monotonic()
    with pytest.raises(exc) as ei:
        fn("dev", rank=1, world_size=2, master_addr="127.0.0.1", master_port=port,
           device=device, env={}, timeout=60)
    assert time.monotonic() - t0 < 10
    assert str(ei.value).startswith("device: expected None or an int GPU index >= 0")
    assert needle in str(ei.value)


DEVICE_SCRIPT = """
import sys, time
import ncclpy
from ncclpy.errors import ArgumentError
t0 = time.monotonic()
try:
    ncclpy.bootstrap("dev", rank=1, world_size=2, master_addr="127.0.0.1",
                     master_port=int(sys.argv[1]), timeout=60,
                     **({"device": int(sys.argv[2])} if len(sys.argv) > 2 else {}))
except ArgumentError as e:
    print(f"{time.monotonic() - t0:.3f}", e)
"""


@pytest.mark.parametrize("cvd, arg, env, needle", [
    ("0", ["3"], {}, "device: 3 (from argument device) is out of range: this process sees 1 GPU "
                     "(CUDA_VISIBLE_DEVICES='0'); rank 1 did not join the rendezvous"),
    ("0,1", [], {"NCCLPY_DEVICE": "2"}, "device: 2 (from NCCLPY_DEVICE) is out of range: this "
                                        "process sees 2 GPUs (CUDA_VISIBLE_DEVICES='0,1')"),
])
def test_device_beyond_visible_gpus_fails_before_waiting_for_peers(tmp_path, cvd, arg, env,
                                                                    needle):
    # CUDA_VISIBLE_DEVICES is counted without touching CUDA, so this runs without a GPU too
    script = tmp_path / "dev.py"
    script.write_text(DEVICE_SCRIPT)
    full = {k: v for k, v in os.environ.items() if not k.startswith("NCCLPY_")}
    full.update(CUDA_VISIBLE_DEVICES=cvd, **env)
    cp = subprocess.run([sys.executable, str(script), str(free_port()), *arg], env=full,
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    elapsed, _, msg = cp.stdout.strip().partition(" ")
    assert needle in msg
    assert float(elapsed) < 10     # not the 60 s a rank 1 would wait for its peers


_TORCHRUN_SCRIPT = """
import sys
from ncclpy.bootstrap import bootstrap
a = bootstrap("a", timeout=60)
b = bootstrap("b", timeout=60)
with open(sys.argv[1] + f"/rank{a.rank}.txt", "w") as f:   # not stdout: ranks share a pipe
    f.write(" ".join(map(str, (a.rank, a.world_size, a.info.store_kind,
                               type(a.store).__name__, a.uid.hex(), b.uid.hex()))))
"""


def test_under_torchrun_ranks_join_torchruns_store(tmp_path):
    """Real torchrun, 3 ranks: no port of ncclpy's own (nothing to collide with torchrun's
    sockets); every rank joins torchrun's agent store and holds the same ids."""
    pytest.importorskip("torch")
    script = tmp_path / "tr.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLPY_", "MASTER_"))}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                          str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(3)]
    assert [r[:4] for r in rows] == [[str(i), "3", "torchrun", "TorchStoreAdapter"]
                                     for i in range(3)]
    assert len({r[4] for r in rows}) == 1 and len({r[5] for r in rows}) == 1
    assert rows[0][4] != rows[0][5] and len(rows[0][4]) == 2 * UID_BYTES


def test_torch_store_adapter_errors_name_key_and_address():
    """ncclpy's store methods over a real torch TCPStore; a missing key is a StoreTimeout."""
    dist = pytest.importorskip("torch.distributed")
    import datetime

    from ncclpy.errors import StoreTimeout
    from ncclpy.rendezvous.torch_store import TorchStoreAdapter
    server = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    s = TorchStoreAdapter(dist.PrefixStore("p", server), "127.0.0.1:x", timeout=30)
    s.set("k", b"v")
    assert s.get("k", timeout=5) == b"v" and server.get("p/k") == b"v"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.compare_set("c", b"", b"x") == b"x"
    s.wait(["k", "c"], timeout=5)
    assert s.delete("k") is True
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as ei:
        s.get("absent", timeout=0.5)
    assert time.monotonic() - t0 < 20
    assert "'absent'" in str(ei.value) and "127.0.0.1:x" in str(ei.value)

