"""The sweep: sizes x dtypes x ops x roots, timed as nccl-tests times them, on one or more backends.

Per case (dtype, op, root): a warm-up at every power-of-two size from ``-b`` to ``-e``, then per
size and per backend (backends alternate at each size) an out-of-place and an in-place
measurement.  Each measurement, as nccl-tests' ``BenchTime``: fill verifiable data, one call and a
stream synchronisation, a barrier, ``-n`` calls back to back (or ``-G`` replays of a CUDA graph
holding them), a stream synchronisation, time per call = elapsed / calls, aggregated across ranks
by ``-a``; then ``-c`` check iterations on fresh inputs compared with the numpy reference.

With ``--algo``/``--proto`` every backend has one communicator per combination, made under its
NCCL_ALGO/NCCL_PROTO (:mod:`bench.combos`); they alternate at each size as backends do, a
combination NCCL refuses or ignores for a collective is one line and never runs, and each row
gets the bits column (:mod:`bench.bits`: one more untimed call on random normals).

Ranks coordinate on the host through ncclpy's TCP store (barriers, aggregation, the device
report), never through the communicator being measured.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional

from ncclpy.semantics import registry
from ncclpy.semantics.dtypes import DTYPES, TESTS_NAMES
from ncclpy.errors import ArgumentError

from . import bits as bitcol
from . import output, periter, verify
from .backends import CPU_BACKEND_MODULES, Backend, Buffers, get_backend, layout
from .combos import applied, refusal
from .config import SweepConfig
from .output import Row, Side
from .report import AVERAGE_NAMES, finish, per_collective_path, version

__all__ = ["SweepConfig", "Coord", "run_rank", "spawn_ranks", "AVERAGE_NAMES", "warmup_sizes",
           "launched_world", "per_collective_path", "timed_calls", "per_call_seconds"]

_TYPE_NAMES = TESTS_NAMES    # nccl-tests' type names (ncclpy.dtypes' one table)


def warmup_sizes(minbytes: int, maxbytes: int) -> List[int]:
    """nccl-tests warms up at every doubling from minbytes to maxbytes."""
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(s)
        s = s * 2 if s else 1
    return out


def timed_calls(iters: int, graph_launches: int, agg_iters: int = 1) -> int:
    """Collective calls inside the timed window, as nccl-tests counts them: ``-n`` iterations of
    ``-m`` calls each, or with ``-G N`` a graph holding them launched N times."""
    calls = iters * agg_iters
    return calls * graph_launches if graph_launches else calls


def per_call_seconds(elapsed: float, iters: int, graph_launches: int,
                     agg_iters: int = 1) -> float:
    """nccl-tests' ``deltaSec``: the timed window divided by :func:`timed_calls`, per rank,
    before ``-a`` aggregates it across ranks."""
    return elapsed / timed_calls(iters, graph_launches, agg_iters)


# ------------------------------------------------------------------------ coordination
class Coord:
    """Host-side collectives over the store: rank 0 gathers, reduces, publishes."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float) -> None:
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.seq = 0

    def _exchange(self, payload: bytes, reducer) -> bytes:
        self.seq += 1
        if self.world == 1:
            return reducer([payload])
        key = f"bench/c/{self.seq}"
        self.store.set(f"{key}/{self.rank}", payload)
        if self.rank == 0:
            vals = [self.store.get(f"{key}/{r}", timeout=self.timeout) for r in range(self.world)]
            result = reducer(vals)
            self.store.set(f"{key}/out", result)
            for r in range(self.world):
                self.store.delete(f"{key}/{r}")
            if self.seq > 1:  # every rank has read the previous result: it posted this one
                self.store.delete(f"bench/c/{self.seq - 1}/out")
            return result
        return self.store.get(f"{key}/out", timeout=self.timeout)

    def reduce(self, value: float, how: str) -> float:
        """All ranks get ``how`` in {rank0, avg, min, max, sum} over every rank's value."""
        def red(vals: List[bytes]) -> bytes:
            xs = [float(v) for v in vals]
            r = {"rank0": xs[0], "avg": sum(xs) / len(xs), "min": min(xs), "max": max(xs),
                 "sum": sum(xs)}[how]
            return repr(r).encode()
        return float(self._exchange(repr(float(value)).encode(), red))

    def any(self, text: Optional[str]) -> Optional[str]:
        """The first non-empty ``text`` over ranks (e.g. a reason to skip), for every rank."""
        def red(vals: List[bytes]) -> bytes:
            return next((v for v in vals if v), b"")
        out = self._exchange((text or "").encode(), red).decode()
        return out or None

    def gather(self, payload: bytes) -> List[bytes]:
        """Every rank's payload, in rank order, on rank 0 (others get [])."""
        box: List[List[bytes]] = []

        def red(vals: List[bytes]) -> bytes:
            box.append(vals)
            return b""
        self._exchange(payload, red)
        return box[0] if box else []

    def barrier(self) -> None:
        self._exchange(b"", lambda vals: b"")


# ------------------------------------------------------------------------ launching
def spawn_ranks(cfg: SweepConfig) -> int:
    """Start ``cfg.nproc`` ranks with ncclpy.spawn; non-zero if any rank failed."""
    from ncclpy.launch.spawn import spawn
    try:
        spawn(_spawned, cfg.nproc, args=(cfg,))
    except Exception as e:
        print(f"python -m bench: a rank failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _spawned(rank: int, cfg: SweepConfig) -> None:
    code = run_rank(cfg)       # the same on every rank (reduced with max)
    if cfg.result_file is not None:
        if rank == 0:
            with open(cfg.result_file, "w") as f:
                f.write(str(int(code)))
        return
    if code:
        raise SystemExit(code)


def launched_world() -> Optional[int]:
    """World size if an outer launcher started this process (its rank variables are set)."""
    for r, w in (("NCCLPY_RANK", "NCCLPY_WORLD_SIZE"), ("RANK", "WORLD_SIZE"),
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if os.environ.get(r) is not None and os.environ.get(w):
            try:
                return int(os.environ[w])
            except ValueError:
                return None
    return None


def _rendezvous():
    """(rank, world, local_rank, device-from-launcher, RendezvousInfo or None when alone)."""
    if launched_world() is None:
        return 0, 1, 0, None, None
    from ncclpy.rendezvous import resolve
    info = resolve()
    return info.rank, info.world_size, info.local_rank, info.device, info


def _make_store(info: Any, timeout: float):
    """The harness's store client: the launcher's rendezvous store (rank 0 hosts ncclpy's, or
    torchrun's agent store is joined), or a private one for a lone rank."""
    if info is None or info.world_size == 1:
        from ncclpy.store import TCPStore
        return TCPStore("127.0.0.1", 0, timeout=timeout, is_server=True)
    from ncclpy.rendezvous.bootstrap import connect_store
    return connect_store(info, timeout=timeout)


def _pick_device(kind: str, local_rank: int, launcher_device: Optional[int]):
    """CUDA ordinal for this rank (None on cpu): the launcher's choice, else local_rank mod GPUs."""
    if kind != "cuda":
        return None
    if launcher_device is not None:
        return int(launcher_device)
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise ArgumentError(f"--device cuda: no usable CUDA device ({e})") from None
    if n < 1:
        raise ArgumentError("--device cuda: no CUDA device is visible")
    return local_rank % n


# ------------------------------------------------------------------------ one rank
class _Rank:
    """The state of one rank's run."""

    def __init__(self, cfg: SweepConfig, collective: str, rank: int, world: int, coord: Coord,
                 backends: List[Backend]) -> None:
        self.cfg, self.rank, self.world, self.coord = cfg, rank, world, coord
        self.memory: Dict[str, Any] = {}       # -M: series -> ncclCommMemStats of rank 0
        self.coll = registry.get(collective)
        self.backends: List[Backend] = []
        why_not: Dict[str, List[str]] = {}       # one line per reason, its series in order
        for b in backends:
            why = (refusal(b.combo, collective, world, cfg.device, b.nccl_env)
                   if b.combo is not None else None)
            if why:
                why_not.setdefault(why, []).append(b.series)
            else:
                self.backends.append(b)
        #: the combinations NCCL refuses or ignores for this collective: not run, said once
        self.refused = [f"{', '.join(names)}: not run for {collective}: {why}"
                        for why, names in why_not.items()]
        self.rows: Dict[str, List[Row]] = {b.series: [] for b in self.backends}
        self.skipped: List[str] = []
        self.multi = len(backends) > 1 or bool(cfg.combos)
        #: the series column's heading and width (padded only where the bits column follows)
        self.series_name = "backend combination" if cfg.combos else "backend"
        self.width = max([len(self.series_name)] + [len(b.series) for b in backends]
                         ) if cfg.bits else 0
        first: Dict[str, str] = {}     # backend -> its first combination that runs, where
        for b in self.backends:        # another of its combinations runs too
            if b.combo is not None and sum(x.name == b.name for x in self.backends) > 1:
                first.setdefault(b.name, b.combo.label)
        self.bits = bitcol.BitsColumn(self, first) if cfg.bits else None
        self._expected_cache: Dict[tuple, Any] = {}
        #: the timer of the measurements (a test may give its own)
        self.clock = time.perf_counter
        #: -I 1: the marks of the measurement under way (bench.periter)
        self.recorder: Optional[periter.Recorder] = None

    def say(self, line: str = "") -> None:
        if self.rank == 0:
            print(line, flush=True)

    def progress(self, text: str) -> None:
        if self.rank == 0 and not self.cfg.quiet:
            print(f"[bench] {text}", file=sys.stderr, flush=True)

    # -- one measurement (nccl-tests' BenchTime) --
    def bench_time(self, b: Backend, bufs: Buffers, op: str, root: int, in_place: bool,
                   seed_base: int = 1000) -> Side:
        cfg, coll = self.cfg, self.coll
        name = coll.name

        def once() -> None:
            b.run(name, bufs, op, root, in_place)

        if cfg.check:
            b.fill(bufs, self.input_for(bufs, op, 99), in_place)
        once()
        b.sync()
        self.coord.barrier()
        graph = None
        if cfg.cudagraph:
            graph = b.capture(lambda: [self._iteration(b, once) for _ in range(cfg.iters)])
            self.coord.barrier()
        clock = self.clock
        rec = self.recorder = (periter.Recorder(b, cfg.iters, cfg.agg_iters, cfg.blocking, clock)
                               if cfg.per_iter_timing else None)
        if cfg.timer == "events":
            begin, stop = b.event_timer()
            begin()
            t0 = clock()
            self._loop(b, once, graph)
            issued = clock() - t0
            elapsed = stop()
        else:
            t0 = clock()
            excluded = self._loop(b, once, graph)     # -z 3: the barriers' time
            issued = clock() - t0 - excluded          # -C 1: the host's time of issuing them
            b.sync()
            elapsed = clock() - t0 - excluded
        if graph is not None:
            b.release(graph)
        samples, self.recorder = (rec.seconds() if rec is not None else None), None
        seconds = self.coord.reduce(
            per_call_seconds(elapsed, cfg.iters, cfg.cudagraph, cfg.agg_iters),
            AVERAGE_NAMES[cfg.average])
        shown = seconds
        if cfg.report_cputime:   # nccl-tests prints rank 0's own; the bandwidth stays latency's
            # and divides it by iters x agg_iters only, not by the graph launches (common.cu:
            # cputimeSec /= iters*agg_iters; deltaSec alone is divided by cudaGraphLaunches)
            shown = self.coord.reduce(
                per_call_seconds(issued, cfg.iters, 0, cfg.agg_iters), "rank0")
        nbytes = bufs.layout.nbytes(DTYPES[bufs.dtype].itemsize)
        alg, bus = coll.bandwidths(nbytes, seconds, self.world)
        wrong: Optional[int] = None
        if cfg.check and (not in_place or b.checks_in_place(name)):
            wrong = 0
            for c in range(cfg.check):
                # the same seeds for every backend at this size: one reference serves them all
                seed = seed_base + 2 * c + int(in_place)
                b.fill(bufs, self.input_for(bufs, op, seed), in_place)
                once()
                out = b.output(bufs, in_place)
                mine = 0
                if b.output_defined(name, self.rank, root, in_place):
                    mine = self.count_wrong(bufs, op, root, in_place, seed, out)
                wrong = int(self.coord.reduce(mine, "sum"))
                if wrong:
                    break
        per_iter = (periter.gather_report(self.coord, samples, cfg.per_iter_skip)
                    if samples is not None else None)
        return Side(shown * 1e6, alg, bus, wrong, per_iter)

    def _loop(self, b: Backend, once, graph) -> float:
        """The timed iterations (or ``-G`` graph replays); the seconds -z 3 excludes."""
        if graph is not None:
            for _ in range(self.cfg.cudagraph):
                b.replay(graph)
            return 0.0
        excluded = sum(self._iteration(b, once) for _ in range(self.cfg.iters))
        if self.recorder is not None:
            self.recorder.close()
        return excluded

    def _iteration(self, b: Backend, once) -> float:
        """One of the ``-n`` iterations, as nccl-tests' ``BenchTime`` and ``startColl``: ``-m``
        calls (inside one NCCL group when more than one) and ``-z``'s waits (1: stream sync and
        barrier after each call, 2: sync after each call, 3: sync and barrier after the
        iteration).  Returns the seconds of -z 3's barrier, which the reported time excludes."""
        cfg, rec = self.cfg, self.recorder
        if rec is not None:          # -I 1: the boundary before it (common.cu: recordEvents)
            rec.begin()
        group = b.group() if cfg.agg_iters > 1 else None
        with group if group is not None else contextlib.nullcontext():
            for _ in range(cfg.agg_iters):
                once()
                if cfg.blocking in (1, 2):
                    b.sync()
                    if cfg.blocking == 1:
                        self.coord.barrier()
        if cfg.blocking != 3:
            return 0.0
        b.sync()
        if rec is not None:
            rec.end()
        t0 = self.clock()
        self.coord.barrier()
        return self.clock() - t0

    def predicted(self, b: Backend, bufs: Buffers, op: str, root: int) -> Optional[float]:
        """NCCL's estimate of the out-of-place call (each rank's, aggregated by ``-a``)."""
        t = b.predict(self.coll.name, bufs, op, root)
        v = self.coord.reduce(-1.0 if t is None else t,
                              "min" if t is None else AVERAGE_NAMES[self.cfg.average])
        return None if v < 0 else v

    # -- verification --
    def input_for(self, bufs: Buffers, op: str, seed: int):
        return verify.rank_input(self.coll.name, bufs.dtype, op, self.rank, self.world,
                                 bufs.layout.send, seed)

    def count_wrong(self, bufs: Buffers, op: str, root: int, in_place: bool, seed: int,
                    out) -> int:
        lay = bufs.layout
        key = (bufs.dtype, op, root, in_place, seed, lay.total)
        if key not in self._expected_cache:
            if any(k[:3] != key[:3] or k[5] != lay.total for k in self._expected_cache):
                self._expected_cache.clear()  # a new size or case: the old ones are done
            inputs = [verify.rank_input(self.coll.name, bufs.dtype, op, r, self.world,
                                        layout(self.coll.name, lay.total, self.world, r).send,
                                        seed) for r in range(self.world)]
            self._expected_cache[key] = verify.expected(
                self.coll.name, inputs, bufs.dtype, op, root, self.world, in_place)[self.rank]
        exp = self._expected_cache[key]
        if exp is None:  # NCCL leaves this rank's output undefined (e.g. reduce off root)
            return 0
        if self.cfg.test_corrupt.get(self.rank):
            out = verify.corrupt(out, self.cfg.test_corrupt[self.rank])
        return verify.count_wrong(out, exp, bufs.dtype, op)

    # -- the whole sweep --
    def case_ok(self, b: Backend, dtype: str, op: str, root: int) -> bool:
        reason = self.coord.any(b.unsupported(self.coll.name, dtype, op))
        if reason:
            self.note_skip(b, dtype, op, root, reason)
            return False
        err = ""
        sizes, iters = warmup_sizes(self.cfg.sizes[0], self.cfg.sizes[-1]), self.cfg.warmup_iters
        if not iters:   # -w 0: still one call at the first size, out of place (the untimed call
            sizes, iters = sizes[:1], 1   # BenchTime makes first anyway), so that a case the
            # library refuses is a skip line here rather than a traceback in the measurement
        try:  # warm-up, nccl-tests style: out of place at every doubling of the size range
            for size in sizes:
                bufs = b.alloc(self.coll.name, size // DTYPES[dtype].itemsize, dtype)
                try:
                    for _ in range(iters):
                        b.run(self.coll.name, bufs, op, root, False)
                    b.sync()
                finally:        # deregistered (-R) before the memory goes, refused or not
                    b.free(bufs)
        except TimeoutError:    # -T's StreamTimeout (the communicator aborted): a failure,
            raise               # never a skip
        except Exception as e:  # e.g. a dtype/op the library refuses: same on every rank
            err = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        reason = self.coord.any(err)
        if reason:
            self.note_skip(b, dtype, op, root, reason)
            return False
        return True

    def note_skip(self, b: Backend, dtype: str, op: str, root: int, reason: str) -> None:
        text = (f"{_who(b)}: skipped {self.coll.name} {_TYPE_NAMES[dtype]} "
                f"{op} root {root}: {reason}")
        self.skipped.append(text)
        self.say(f"# {text}")

    def sweep(self) -> None:
        cfg, coll = self.cfg, self.coll
        ops = cfg.ops if coll.reduces else ["none"]
        if coll.rooted:
            roots = list(range(self.world)) if cfg.root == -1 else [cfg.root]
        else:
            roots = [-1]
        for dtype in cfg.dtypes:
            item = DTYPES[dtype].itemsize
            for op in ops:
                for root in roots:
                    active = [b for b in self.backends if self.case_ok(b, dtype, op, root)]
                    cycles = [(c, i, s) for c in range(cfg.run_cycles)
                              for i, s in enumerate(cfg.sizes)]     # -N: the sweep N times
                    for cycle, i, size in cycles:
                        total = size // item
                        for b in active:
                            t0 = time.perf_counter()
                            bufs = b.alloc(coll.name, total, dtype)
                            seed = 1000 * (i + 1)
                            oop = self.bench_time(b, bufs, op, root, False, seed)
                            ip = self.bench_time(b, bufs, op, root, True, seed)
                            row = Row(b.name, bufs.layout.nbytes(item), bufs.layout.count,
                                      _TYPE_NAMES[dtype], dtype, op, root, oop, ip, cfg.iters,
                                      combo=b.combo.label if b.combo is not None else "")
                            if b.combo is not None:
                                row.extra["combination"] = b.combo.to_json()
                            if self.bits is not None:
                                row.extra["bits"] = self.bits.row(b, bufs, dtype, op, root, seed)
                            if cfg.predict:
                                row.extra["predicted_us"] = self.predicted(b, bufs, op, root)
                            if cfg.report_timestamps:
                                row.extra["timestamp"] = output.now()
                            if cfg.run_cycles > 1:
                                row.extra["cycle"] = cycle
                            self.rows[b.series].append(row)
                            self.say(output.format_row(row, self.multi, self.width))
                            self.progress(f"{_who(b)} {_TYPE_NAMES[dtype]} {op} root {root} "
                                          f"size {size} B ({i + 1}/{len(cfg.sizes)}) "
                                          f"{time.perf_counter() - t0:.2f} s")
                            b.free(bufs)
                            del bufs


def run_rank(cfg: SweepConfig) -> int:
    """Run the sweep as this process's rank; rank 0 prints and writes the files.  Returns the
    exit status (non-zero when a check found wrong elements or the bandwidth floor failed).
    Several collectives run one after the other, each with its own table, as if the nccl-tests
    binaries had been run in turn."""
    rank, world, local_rank, ldev, info = _rendezvous()
    for name in cfg.collectives:
        if registry.get(name).rooted and cfg.root >= world:
            raise ArgumentError(f"-r/--root: {cfg.root} is not a rank of a world of {world}")
    store = _make_store(info, cfg.timeout)
    coord = Coord(store, rank, world, cfg.timeout)
    device = _pick_device(cfg.device, local_rank, ldev)
    backends: List[Backend] = []
    try:
        table = CPU_BACKEND_MODULES if cfg.device == "cpu" else None
        # one communicator per backend and combination, each made under its NCCL_ALGO and
        # NCCL_PROTO (NCCL reads them at init: bench/combos.py), in the same order on every rank
        for name, combo in [(n, c) for n in cfg.backends for c in (cfg.combos or [None])]:
            b = get_backend(name, table)
            b.register, b.cta_policy, b.combo = cfg.register, cfg.cta_policy, combo
            b.unalign = cfg.unalign                      # -u: every buffer moved (alloc)
            if hasattr(b, "sync_timeout"):
                b.sync_timeout = cfg.sync_timeout        # -T: bounds each stream sync
            with applied(combo) as env:
                b.nccl_env = env
                b.setup(rank, world, device, store,
                        master_addr=info.master_addr if info is not None else "127.0.0.1",
                        timeout=cfg.timeout)
            backends.append(b)
            if cfg.cudagraph and not b.supports_graphs:
                raise ArgumentError(f"-G/--cudagraph: backend {b.label} cannot capture graphs")
            if cfg.timer == "events" and not b.supports_events:
                raise ArgumentError(f"--timer events: backend {b.label} has no CUDA events")
        devices = _device_report(coord, rank, backends[0], device)
        nccl_version = backends[0].nccl_version()
        label = ",".join(dict.fromkeys(b.label for b in backends))
        notes = list(dict.fromkeys(f"{b.label}: {b.note}" for b in backends if b.note))
        code = 0
        for n, name in enumerate(cfg.collectives):
            start = output.now()
            state = _Rank(cfg, name, rank, world, coord, backends)
            program = f"{state.coll.tests_name}_perf"
            if rank == 0:
                if n:
                    print()
                for line in output.header_lines(
                        program=program, backends=label, nccl_version=nccl_version,
                        minbytes=cfg.minbytes, maxbytes=cfg.maxbytes, stepfactor=cfg.stepfactor,
                        stepbytes=cfg.stepbytes, warmup=cfg.warmup_iters, iters=cfg.iters,
                        check=cfg.check, graph=cfg.cudagraph, devices=devices,
                        version=version(), agg_iters=cfg.agg_iters, blocking=cfg.blocking,
                        parallel_init=cfg.parallel_init, notes=notes, unalign=cfg.unalign,
                        per_iter_line=periter.header_line(backends, cfg)):
                    print(line)
                for line in _bits_lines(cfg, state, backends):
                    print(line)
                for line in output.table_header(state.multi, cfg.predict, cfg.report_cputime,
                                                cfg.report_timestamps, bits=cfg.bits,
                                                width=state.width, series=state.series_name,
                                                per_iter=cfg.per_iter_timing):
                    print(line, flush=True)
            state.sweep()
            if cfg.register and rank == 0:
                what = "windows" if cfg.register == 2 else "buffers (ncclCommRegister)"
                for b in backends:
                    got, asked = getattr(b, "registered_seen", (0, 0))
                    print(f"# {b.series}: -R {cfg.register}: NCCL registered {got} of the {asked} "
                          f"{what} on rank 0" + ("" if got == asked else
                                                 "; the others ran unregistered"))
            if cfg.memory_report:
                state.memory = {b.series: b.mem_stats() for b in backends}
                if rank == 0:
                    for line in output.memory_lines(state.memory):
                        print(line)
            if rank == 0:
                code = max(code, finish(cfg, state, program, nccl_version, devices, start,
                                         backends, world, first=(n == 0)))
        code = int(coord.reduce(code, "max"))  # also the final barrier before rank 0 leaves
        return code
    finally:
        for b in reversed(backends):
            try:
                b.teardown()
            except Exception as e:  # pragma: no cover - best effort at exit
                print(f"[bench] rank {rank}: {b.label} teardown: {e}", file=sys.stderr)
        store.close()


def _who(b: Backend) -> str:
    """A backend in progress and skip lines: its label, or its series with a combination."""
    return b.series if b.combo is not None else b.label


def _bits_lines(cfg: SweepConfig, state: _Rank, backends: List[Backend]) -> List[str]:
    """The lines between the header and the table: each combination not run for this
    collective, and what the bits column compares."""
    out = [f"# {line}" for line in state.refused]
    if state.bits is not None and state.backends:
        from ncclpy.order.cli import basis
        firsts = list(dict.fromkeys(state.bits.first_combo.values()))
        out.append(bitcol.header_line(basis(backends[0].bits_version()),
                                      ", ".join(firsts) or None, cfg.repeat_bits))
    return out


def _device_report(coord: Coord, rank: int, backend: Backend, device) -> List[Dict[str, Any]]:
    import json
    info = {"rank": rank, "group": 0, "pid": os.getpid(), "hostname": socket.gethostname(),
            "device": -1 if device is None else int(device)}
    info.update(backend.device_info())
    got = coord.gather(json.dumps(info).encode())
    return [json.loads(x) for x in got]
