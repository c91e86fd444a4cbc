"""Store benchmark: ncclpy's TCP store side by side with ``torch.distributed.TCPStore``.

Two measurements, each taken for both stores in the same run, interleaved so that machine noise
hits both alike (the median of ``--repeat`` runs is reported):

* rendezvous: N ranks (threads of this process) connect to rank 0's store, rank 0 publishes a
  128-byte "unique id", every other rank gets it, then all ranks pass a barrier (ncclpy's
  :func:`ncclpy.store.barrier`, over either store). Rank 0's server is up before the clock
  starts; the ranks' connections are inside the timed region.
* ops/s: one client doing ``set`` then ``get`` of a 16-byte value, with the server in this
  process (rank 0's view) and in another process (every other rank's view).

Usage: ``python -m bench.store_bench [--ranks 8,32,128,512] [--ops 10000] [--repeat 3]
[--json PATH] [--no-torch]``. torch is imported lazily; without it its column says so.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

if __package__ in (None, ""):  # run as ``python bench/store_bench.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ncclpy.store import TCPStore, barrier  # noqa: E402

__all__ = ["main", "rendezvous_time", "ops_per_second"]

HOST = "127.0.0.1"
UID = bytes(range(128))
TIMEOUT = 60.0


def _torch_store():
    """``torch.distributed.TCPStore`` or None (with the reason printed once by the caller)."""
    try:
        import torch.distributed as dist
        return dist.TCPStore
    except Exception:  # pragma: no cover - depends on the environment
        return None


# ---------------------------------------------------------------------------- store makers
def _ncclpy_server():
    client = TCPStore(HOST, 0, is_server=True, timeout=TIMEOUT)
    return client, client.port


def _ncclpy_client(port: int):
    return TCPStore(HOST, port, timeout=TIMEOUT)


def _torch_server():
    store_cls = _torch_store()
    s = store_cls(HOST, 0, is_master=True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=TIMEOUT))
    return s, s.port


def _torch_client(port: int):
    store_cls = _torch_store()
    return store_cls(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))


MAKERS = {"ncclpy": (_ncclpy_server, _ncclpy_client), "torch": (_torch_server, _torch_client)}


def _close(store) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------------------- rendezvous
def rendezvous_time(kind: str, nranks: int) -> float:
    """Seconds for ``nranks`` thread-ranks to connect, exchange a 128-byte uid and barrier."""
    make_server, make_client = MAKERS[kind]
    server_store, port = make_server()
    start_gate = threading.Barrier(nranks + 1)
    errors: List[BaseException] = []
    stores: List[object] = [None] * nranks
    tag = f"bench-{time.monotonic_ns()}"

    def rank_fn(rank: int) -> None:
        try:
            start_gate.wait()
            store = server_store if rank == 0 else make_client(port)
            stores[rank] = store
            if rank == 0:
                store.set("uid", UID)
            else:
                uid = store.get("uid")
                if uid != UID:
                    raise AssertionError(f"rank {rank} got a wrong uid")
            barrier(store, rank, nranks, tag=tag, timeout=TIMEOUT)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(nranks)]
    for t in threads:
        t.start()
    start_gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for s in stores[1:]:
        if s is not None:
            _close(s)
    _close(server_store)
    if errors:
        raise RuntimeError(f"{kind} rendezvous of {nranks} ranks failed: {errors[0]!r}")
    return elapsed


# ---------------------------------------------------------------------------- ops/s
_SERVER_SCRIPT = r"""
import sys, datetime
kind = sys.argv[1]
if kind == "ncclpy":
    from ncclpy.store import StoreServer
    s = StoreServer("127.0.0.1", 0).start(); port = s.port
else:
    import torch.distributed as dist
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60)); port = s.port
print(port, flush=True)
sys.stdin.read()   # serve until the parent closes our stdin
"""


class _RemoteServer:
    """A store server in a child process (what every rank but 0 talks to)."""

    def __init__(self, kind: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     text=True)
        line = self.proc.stdout.readline()
        if not line.strip():
            self.close()
            raise RuntimeError(f"{kind} server process did not start")
        self.port = int(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def ops_per_second(store, nops: int) -> Dict[str, float]:
    """set/s and get/s of one client doing ``nops`` of each (16-byte values)."""
    value = b"v" * 16
    keys = [f"k{i % 64}" for i in range(nops)]
    t0 = time.perf_counter()
    for k in keys:
        store.set(k, value)
    t1 = time.perf_counter()
    for k in keys:
        store.get(k)
    t2 = time.perf_counter()
    return {"set": nops / (t1 - t0), "get": nops / (t2 - t1)}


def _ops_local(kind: str, nops: int) -> Dict[str, float]:
    store, _ = MAKERS[kind][0]()
    try:
        return ops_per_second(store, nops)
    finally:
        _close(store)


def _ops_remote(kind: str, nops: int, servers: Dict[str, _RemoteServer]) -> Dict[str, float]:
    client = MAKERS[kind][1](servers[kind].port)
    try:
        return ops_per_second(client, nops)
    finally:
        _close(client)


# ---------------------------------------------------------------------------- main
def _median(runs: List[Dict[str, float]]) -> Dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "n/a"
    return f"{v * 1000:9.1f} ms" if unit == "s" else f"{v:9.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.store_bench", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--ranks", default="8,32,128,512",
                    help="comma-separated rank counts for the rendezvous (default 8,32,128,512)")
    ap.add_argument("--ops", type=int, default=10000,
                    help="set and get operations per ops/s run (default 10000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; median (default 3)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's column out")
    args = ap.parse_args(argv)
    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ranks: expected comma-separated ints, got {args.ranks!r}")
    if not ranks or min(ranks) < 1 or args.ops < 1 or args.repeat < 1:
        ap.error("--ranks, --ops and --repeat must be positive")

    kinds = ["ncclpy"]
    torch_note = ""
    if not args.no_torch:
        if _torch_store() is None:
            torch_note = "torch is not installed: its column is skipped"
        else:
            kinds.append("torch")
    if torch_note:
        print(torch_note)
    print(f"store benchmark on {platform.node()} ({os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}), median of {args.repeat} run(s)")

    results: Dict[str, object] = {"ranks": {}, "ops": {}}
    print("\nrendezvous (connect + 128-byte uid get + barrier), ranks as threads")
    print(f"{'ranks':>6} " + " ".join(f"{k:>12}" for k in kinds)
          + ("   torch/ncclpy" if "torch" in kinds else ""))
    for n in ranks:
        runs: Dict[str, List[float]] = {k: [] for k in kinds}
        for _ in range(args.repeat):
            for k in kinds:  # interleaved: the same noise for both
                runs[k].append(rendezvous_time(k, n))
        med = {k: statistics.median(v) for k, v in runs.items()}
        results["ranks"][str(n)] = {k: {"median_s": med[k], "runs_s": runs[k]} for k in kinds}
        ratio = f"   {med['torch'] / med['ncclpy']:12.2f}x" if "torch" in kinds else ""
        print(f"{n:>6} " + " ".join(_fmt(med[k], "s") for k in kinds) + ratio, flush=True)

    print(f"\none client, {args.ops} set then {args.ops} get of 16 bytes (ops/s)")
    print(f"{'server':>14} {'op':>4} " + " ".join(f"{k:>12}" for k in kinds)
          + ("   ncclpy/torch" if "torch" in kinds else ""))
    remote = {k: _RemoteServer(k) for k in kinds}
    try:
        for where, fn in (("same process", lambda k: _ops_local(k, args.ops)),
                          ("other process", lambda k: _ops_remote(k, args.ops, remote))):
            runs2: Dict[str, List[Dict[str, float]]] = {k: [] for k in kinds}
            for _ in range(args.repeat):
                for k in kinds:
                    runs2[k].append(fn(k))
            med2 = {k: _median(v) for k, v in runs2.items()}
            results["ops"][where] = {k: {"median_ops_s": med2[k], "runs": runs2[k]}
                                     for k in kinds}
            for op in ("set", "get"):
                ratio = (f"   {med2['ncclpy'][op] / med2['torch'][op]:12.2f}x"
                         if "torch" in kinds else "")
                print(f"{where:>14} {op:>4} " + " ".join(_fmt(med2[k][op], "ops")
                                                          for k in kinds) + ratio, flush=True)
    finally:
        for r in remote.values():
            r.close()

    if args.json:
        doc = {"benchmark": "store", "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                           "python": platform.python_version()},
               "repeat": args.repeat, "ops": args.ops, "stores": kinds, "note": torch_note,
               "rendezvous": results["ranks"], "ops_per_second": results["ops"]}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
