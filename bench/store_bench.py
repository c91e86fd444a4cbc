"""Store benchmark: ncclpy's TCP store side by side with ``torch.distributed.TCPStore``.

Both stores are measured in the same run, interleaved so that machine noise hits both alike;
every cell reports min / median / max of ``--repeat`` runs (after ``--warmup`` untimed ones).

* rendezvous: N ranks connect to rank 0's store, rank 0 publishes a 128-byte "unique id", every
  other rank gets it, then all ranks pass a barrier (ncclpy's :func:`ncclpy.store.barrier`, over
  either store). Rank 0's process hosts the server, started before the clock; the ranks'
  connections are inside the timed region. Two modes: ``threads`` (``--ranks``: ranks are
  threads of this process, so they share its GIL with the in-process ncclpy server) and
  ``processes`` (``--process-ranks``: ranks are processes forked before the clock starts and
  released through a pipe, as in a real job; the clock stops when every rank has reported
  back, so exits fall outside it, though on a small machine their CPU time competes with the
  ranks still at work).
* ops/s: one client against a server in this process (rank 0's view) and in another process
  (every other rank's view): ``set+get`` pairs, ``get`` and ``add``. torch's ``set`` is not
  acknowledged (no reply), so a bare set rate compares a one-way send with a round trip; a set
  followed by a get of the same key makes both sides complete the write before the clock moves.

A third column in both tables, the floor (:mod:`bench.store_floor`, ``--no-floor`` leaves it
out), times a store that does nothing but the system calls and a dict (its barrier: one
``arrive`` per rank): the least a pure-Python store of this design costs here, which tells
ncclpy's own overhead apart from Python's. Ratios are speeds, ``a/b`` > 1 meaning a is faster.

Usage: ``python -m bench.store_bench [--ranks 8,64,512] [--process-ranks 8,64] [--ops N]
[--repeat R] [--warmup W] [--json PATH] [--no-torch] [--no-floor]``. Tables (each line within 100
columns) on stdout; the JSON file only with ``--json``. ``--process-ranks`` defaults to at most
64: where DNS is unreachable c10d's per-connection reverse lookups stall each of torch's forked
ranks for seconds, and hundreds of them retrying at once can swamp a small machine.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import select
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):  # run as ``python bench/store_bench.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench  # noqa: F401,E402  (PEP 366: the package its relative imports name)
    __package__ = "bench"

from ncclpy.errors import ArgumentError  # noqa: E402
from ncclpy.store import TCPStore, barrier  # noqa: E402
from .store_floor import FloorClient, floor_server  # noqa: E402

__all__ = ["main", "build_parser", "rendezvous_time", "ops_per_second", "MODES", "max_ranks",
           "WIDTH"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
UID = bytes(range(128))
TIMEOUT = 120.0
MODES = ("threads", "processes")
OPS = ("set+get", "get", "add")
JSON_VERSION = 1


def _torch_store():
    """``torch.distributed.TCPStore`` or None."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns per client otherwise
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
    s = _torch_store()(HOST, 0, is_master=True, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=TIMEOUT))
    return s, s.port


def _torch_client(port: int):
    return _torch_store()(HOST, port, is_master=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT))


MAKERS: Dict[str, Tuple[Callable, Callable]] = {
    "ncclpy": (_ncclpy_server, _ncclpy_client), "torch": (_torch_server, _torch_client),
    "floor": (floor_server, lambda port: FloorClient(HOST, port))}


def torch_warmup() -> float:
    """One torch master and client in this process, before any timing; seconds it took.

    c10d looks up the peer's host name when it logs a connection and, after its first DNS
    failure, stops doing so for the rest of the process. Where DNS is unreachable that first
    lookup stalls (5 s per attempt here), so it is paid once, up front, and reported; forked
    ranks inherit the "stop looking up" state.
    """
    t0 = time.perf_counter()
    server, port = _torch_server()
    client = _torch_client(port)
    client.set("warm", b"up")
    server.get("warm")
    del client, server
    return time.perf_counter() - t0


def _close(store) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


def _rank_work(store, rank: int, nranks: int, tag: str) -> None:
    if rank == 0:
        store.set("uid", UID)
    elif store.get("uid") != UID:
        raise AssertionError(f"rank {rank} got a wrong uid")
    if isinstance(store, FloorClient):   # the least a barrier can be: one arrival each
        store.arrive(f"barrier/{tag}", nranks)
    else:
        barrier(store, rank, nranks, tag=tag, timeout=TIMEOUT)


# ---------------------------------------------------------------------------- rendezvous
def _rendezvous_threads(kind: str, nranks: int) -> float:
    make_server, make_client = MAKERS[kind]
    server_store, port = make_server()
    gate = threading.Barrier(nranks + 1)
    errors: List[BaseException] = []
    stores: List[object] = [None] * nranks
    tag = f"bench-{time.monotonic_ns()}"

    def rank_fn(rank: int) -> None:
        try:
            gate.wait()
            store = server_store if rank == 0 else make_client(port)
            stores[rank] = store
            _rank_work(store, rank, nranks, tag)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(nranks)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for s in stores[1:]:
        if s is not None:
            _close(s)
    _close(server_store)
    if errors:
        raise RuntimeError(f"{kind} rendezvous of {nranks} thread-ranks failed: {errors[0]!r}")
    return elapsed


def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("pipe closed")
        out += chunk
    return out


def _rendezvous_processes(kind: str, nranks: int) -> float:
    """Ranks 1.. are forked first (before any server thread exists) and wait on a pipe; the
    clock starts when rank 0's server is up and the port is handed to them all."""
    make_server, make_client = MAKERS[kind]
    tag = f"bench-{time.monotonic_ns()}"
    gate_r, gate_w = os.pipe()   # the port, 4 bytes per rank
    done_r, done_w = os.pipe()   # one byte per finished rank
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # children's garbage collections then leave the parent's pages shared
    for rank in range(1, nranks):
        pid = os.fork()
        if pid == 0:  # child: one rank, then _exit without any clean-up of the parent's state
            ok = False
            try:
                os.close(gate_w)
                os.close(done_r)
                (port,) = struct.unpack("!I", _read_exact(gate_r, 4))
                _rank_work(make_client(port), rank, nranks, tag)
                ok = True
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    os.write(done_w, b"1" if ok else b"0")
                finally:
                    os._exit(0 if ok else 1)
        pids.append(pid)
    gc.unfreeze()
    os.close(gate_r)
    os.close(done_w)
    server_store = None
    try:
        server_store, port = make_server()
        t0 = time.perf_counter()
        msg = struct.pack("!I", port) * (nranks - 1)
        for i in range(0, len(msg), 4096):  # <= PIPE_BUF per write: whole messages only
            os.write(gate_w, msg[i:i + 4096])
        _rank_work(server_store, 0, nranks, tag)
        got = b""
        deadline = time.monotonic() + TIMEOUT
        while len(got) < nranks - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([done_r], [], [], left)[0]:
                raise RuntimeError(f"{kind} rendezvous of {nranks} process-ranks: only "
                                   f"{len(got)} ranks finished within {TIMEOUT:.0f} s")
            chunk = os.read(done_r, nranks)
            if not chunk:
                break
            got += chunk
        elapsed = time.perf_counter() - t0
        if got.count(b"1") != nranks - 1:
            raise RuntimeError(f"{kind} rendezvous of {nranks} process-ranks: "
                               f"{nranks - 1 - got.count(b'1')} ranks failed (see stderr)")
        return elapsed
    finally:
        os.close(gate_w)
        os.close(done_r)
        deadline = time.monotonic() + 30
        for pid in pids:
            try:
                while os.waitpid(pid, os.WNOHANG) == (0, 0):
                    if time.monotonic() > deadline:
                        os.kill(pid, 9)
                        os.waitpid(pid, 0)
                        break
                    time.sleep(0.001)
            except ChildProcessError:
                pass
        if server_store is not None:
            _close(server_store)


def rendezvous_time(kind: str, nranks: int, mode: str = "threads") -> float:
    """Seconds for ``nranks`` ranks to connect, exchange a 128-byte uid and pass a barrier."""
    if mode == "threads":
        return _rendezvous_threads(kind, nranks)
    if mode == "processes":
        if not hasattr(os, "fork"):  # pragma: no cover - Windows
            raise RuntimeError("processes mode needs os.fork")
        return _rendezvous_processes(kind, nranks)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


# ---------------------------------------------------------------------------- ops/s
_SERVER_SCRIPT = r"""
import os, signal, sys, datetime
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's; it ends us
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
kind = sys.argv[1]
if kind == "ncclpy":
    from ncclpy.store import StoreServer
    s = StoreServer("127.0.0.1", 0).start(); port = s.port
elif kind == "floor":
    from __PKG__.store_floor import FloorServer
    s = FloorServer("127.0.0.1", 0); port = s.port
else:
    import torch.distributed as dist
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60)); port = s.port
try:
    print(port, flush=True)
except BrokenPipeError:   # the parent is gone already (interrupted while starting us)
    os._exit(0)
sys.stdin.read()   # serve until the parent closes our stdin (or exits)
"""


class _RemoteServer:
    """A store server in a child process (what every rank but 0 talks to)."""

    def __init__(self, kind: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT.replace(
            "__PKG__", __package__ or "bench"), kind],
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
    """Rates of one client: ``set+get`` pairs/s (16-byte values), ``get``/s and ``add``/s."""
    value = b"v" * 16
    keys = [f"k{i % 64}" for i in range(nops)]
    t0 = time.perf_counter()
    for k in keys:
        store.set(k, value)
        store.get(k)
    t1 = time.perf_counter()
    for k in keys:
        store.get(k)
    t2 = time.perf_counter()
    for _ in keys:
        store.add("counter", 1)
    t3 = time.perf_counter()
    return {"set+get": nops / (t1 - t0), "get": nops / (t2 - t1), "add": nops / (t3 - t2)}


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


# ---------------------------------------------------------------------------- output
#: columns every table line fits in
WIDTH = 100
#: a cell whose max exceeds its min by more than this factor is flagged as noisy
NOISY = 3.0


def _stats(runs: List[float]) -> Dict[str, object]:
    return {"runs": runs, "min": min(runs), "median": statistics.median(runs), "max": max(runs)}


def _num(x: float) -> str:
    """A short number: 4 significant digits at most, k/M for rates."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def _cell(st: Dict[str, object], scale: float = 1.0) -> str:
    """``median ±spread%`` of one cell (half of max - min, relative to the median; times in ms
    with ``scale`` 1e3); min, median and max of every run are in the JSON."""
    lo, med, hi = (float(st[k]) * scale for k in ("min", "median", "max"))  # type: ignore
    spread = 50.0 * (hi - lo) / med if med else 0.0
    return f"{_num(med)} ±{spread:.0f}%" if spread < 999.5 else f"{_num(med)} ±>999%"


def _speeds(st: Dict[str, Dict[str, object]], pairs: List[Tuple[str, str]],
            times: bool) -> str:
    """The speed ratio a/b of each pair, from medians (of times: b/a; of rates: a/b)."""
    cells = []
    for a, b in pairs:
        fast, slow = (b, a) if times else (a, b)
        cells.append(f"{_ratio(st[fast]['median'], st[slow]['median']):>13}")
    return "".join(cells)


def _ratio(num: Optional[float], den: Optional[float]) -> str:
    return f"{num / den:.2f}x" if num and den else "n/a"


def _noisy(st: Dict[str, Dict[str, object]], what: str) -> List[str]:
    """A note for each cell whose runs spread by more than :data:`NOISY` (a stall, another
    load): its median, and a ratio built on it, may mislead."""
    out = []
    for k, v in st.items():
        lo, hi = float(v["min"]), float(v["max"])  # type: ignore[arg-type]
        if lo > 0 and hi / lo > NOISY:
            out.append(f"NOISY: {k} {what}: its slowest run is {hi / lo:.0f}x its fastest; "
                       f"its median and ratios may mislead (more --repeat, a quieter machine)")
    return out


def _count_list(text: str, flag: str) -> List[int]:
    """Comma-separated positive ints (empty: none)."""
    out = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            v = int(x)
        except ValueError:
            raise ArgumentError(f"{flag}: expected comma-separated rank counts, got {x.strip()!r} "
                                f"in {text!r}") from None
        if v < 1:
            raise ArgumentError(f"{flag}: expected rank counts >= 1, got {v}")
        out.append(v)
    return out


def max_ranks() -> int:
    """The most ranks one cell may have here: each rank holds a client socket and the server
    one more, within this process's open-file limit (``ulimit -n``) and the store's default
    ``max_clients``."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fds = (soft - 64) // 2 if soft != resource.RLIM_INFINITY else 1 << 20
    from ncclpy.store.limits import StoreLimits
    return max(1, min(fds, StoreLimits().max_clients))


def build_parser() -> argparse.ArgumentParser:
    from ncclpy.cli_util import OneLineParser
    ap = OneLineParser(prog="python -m bench.store_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,64,512",
                    help="comma-separated rank counts for the rendezvous (default 8,64,512)")
    ap.add_argument("--process-ranks", default="8,64",
                    help="comma-separated rank counts for the rendezvous with ranks as forked "
                         "processes; empty: skip (default 8,64)")
    ap.add_argument("--ops", type=int, default=5000,
                    help="operations of each kind per ops/s run (default 5000)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed runs per cell: the median, its spread and (JSON) min/max "
                         "(default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per cell (default 1)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the results as JSON to PATH (its directory must exist); "
                         "default: no file")
    ap.add_argument("--no-json", action="store_true",
                    help="write no JSON file (the default; kept for old command lines)")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's column out")
    ap.add_argument("--no-floor", action="store_true",
                    help="leave out the floor's columns (bench/store_floor.py: the least a "
                         "pure-Python store does per request)")
    return ap


def main(argv=None) -> int:
    """Entry point: a usage error is one line naming the flag (exit 2); Ctrl-C exits 130 and a
    closed output pipe (``| head``) 141, quietly."""
    from ncclpy.cli_util import run_main
    return run_main("python -m bench.store_bench", lambda: _main(argv))


def _main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    cells: List[Tuple[str, int]] = []
    try:
        for mode, dest, text in (("threads", "ranks", args.ranks),
                                 ("processes", "process_ranks", args.process_ranks)):
            cells += [(mode, n) for n in _count_list(text, ap.flag(dest))]
    except ArgumentError as e:
        ap.error(str(e))
    if cells and any(mode == "processes" for mode, _ in cells) and not hasattr(os, "fork"):
        ap.error(f"{ap.flag('process_ranks')}: needs os.fork (pass {ap.flag('process_ranks')} "
                 f"'')")
    for dest, lo in (("ops", 1), ("repeat", 1), ("warmup", 0)):
        if getattr(args, dest) < lo:
            ap.error(f"{ap.flag(dest)}: expected an integer >= {lo}, got {getattr(args, dest)}")
    limit = max_ranks()
    for mode, n in cells:
        if n > limit:
            dest = "ranks" if mode == "threads" else "process_ranks"
            ap.error(f"{ap.flag(dest)}: {n} ranks is more than this machine allows one cell "
                     f"({limit}: two open files per rank within ulimit -n, and the store's "
                     f"max_clients); expected at most {limit}")
    if args.json:
        from ncclpy.cli_util import check_output_path
        why = check_output_path(args.json)
        if why:
            ap.error(f"{ap.flag('json')}: {why}")
    return _run(args, cells)


def _run(args: argparse.Namespace, cells: List[Tuple[str, int]]) -> int:
    kinds = ["ncclpy"]   # then torch, then the floor, as asked
    notes = ["torch's set is not acknowledged: rates time a set followed by a get of the same "
             "key so that both stores complete the write inside the clock"]
    torch_version = None
    warm = None
    if not args.no_torch:
        if _torch_store() is None:
            notes.append("torch is not installed: its column is skipped")
        else:
            import torch
            torch_version = torch.__version__
            kinds.append("torch")
            warm = torch_warmup()
            if warm > 1.0:
                notes.append(f"torch's first connection in this process took {warm:.1f} s (its "
                             f"reverse-DNS lookup of the peer stalled; c10d then stops looking "
                             f"up); paid before timing")
    if not args.no_floor:
        kinds.append("floor")
    # speed ratios a/b (rates a/b, times b/a), medians, for the columns present
    pairs = [(a, b) for a, b in (("ncclpy", "torch"), ("floor", "torch"), ("ncclpy", "floor"))
             if a in kinds and b in kinds]
    ratio_head = "".join(f"{a + '/' + b:>13}" for a, b in pairs)
    print(f"store benchmark on {platform.node()} ({os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, torch {torch_version or 'n/a'})")
    print(f"each cell: median ±half its range, of {args.repeat} run(s) after {args.warmup} "
          f"warm-up; speed ratios of medians")

    rendezvous: List[Dict[str, object]] = []
    print("\nrendezvous: connect + 128-byte uid get + barrier; rank 0 hosts the server (ms)")
    print(f"{'mode':>9} {'ranks':>5} " + "".join(f"{k:>13}" for k in kinds) + ratio_head)
    for mode, n in cells:
        runs: Dict[str, List[float]] = {k: [] for k in kinds}
        for i in range(args.warmup + args.repeat):
            for k in kinds:  # interleaved: the same noise for all
                t = rendezvous_time(k, n, mode)
                if i >= args.warmup:
                    runs[k].append(t)
        st = {k: _stats(v) for k, v in runs.items()}
        for k in kinds:
            rendezvous.append({"mode": mode, "ranks": n, "store": k,
                               **{f"{f}_s": st[k][f] for f in ("runs", "min", "median", "max")}})
        notes += _noisy(st, f"rendezvous of {n} ranks ({mode})")
        print(f"{mode:>9} {n:>5} " + "".join(f"{_cell(st[k], 1e3):>13}" for k in kinds)
              + _speeds(st, pairs, times=True), flush=True)

    ops: List[Dict[str, object]] = []
    print(f"\none client, {args.ops} operations of each kind, 16-byte values (ops/s; set+get: "
          f"pairs/s)")
    print(f"{'server':>9} {'op':>7} " + "".join(f"{k:>13}" for k in kinds) + ratio_head)
    remote = {k: _RemoteServer(k) for k in kinds}
    try:
        for where, fn in (("same process", lambda k: _ops_local(k, args.ops)),
                          ("other process", lambda k: _ops_remote(k, args.ops, remote))):
            runs2: Dict[str, List[Dict[str, float]]] = {k: [] for k in kinds}
            for i in range(args.warmup + args.repeat):
                for k in kinds:
                    r = fn(k)
                    if i >= args.warmup:
                        runs2[k].append(r)
            short = "same" if where == "same process" else "other"
            for op in OPS:
                st = {k: _stats([r[op] for r in runs2[k]]) for k in kinds}
                for k in kinds:
                    ops.append({"server": where, "op": op, "store": k,
                                **{f"{f}_ops_s": st[k][f] for f in ("runs", "min", "median",
                                                                    "max")}})
                notes += _noisy(st, f"{op} ops/s ({where})")
                print(f"{short:>9} {op:>7} " + "".join(f"{_cell(st[k]):>13}" for k in kinds)
                      + _speeds(st, pairs, times=False), flush=True)
    finally:
        for r in remote.values():
            r.close()
    import textwrap
    for note in notes:
        print(textwrap.fill(f"note: {note}", WIDTH, subsequent_indent="  "))

    if args.json:
        doc = {"benchmark": "store", "version": JSON_VERSION,
               "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "torch": torch_version},
               "config": {"ranks": [n for m, n in cells if m == "threads"],
                          "process_ranks": [n for m, n in cells if m == "processes"],
                          "ops": args.ops,
                          "repeat": args.repeat, "warmup": args.warmup},
               "stores": kinds, "notes": notes, "torch_warmup_s": warm,
               "rendezvous": rendezvous,
               "ops_per_second": ops}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
