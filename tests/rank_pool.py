"""A pool of rank processes kept alive across tests: one start-up per world size.

Most of a multi-rank GPU test's time is start-up, not NCCL: a process per rank, importing CuPy,
torch and ncclpy, creating the CUDA context.  A :class:`RankPool` starts ``n`` ranks once
(through :func:`ncclpy.spawn`, so the placement, several ranks per GPU, MPS and the children's
death with the parent are ``ncclpy run``'s) and then runs one *task* after another on every
rank: ``fn(rank, *args)``, a module-level function named by module and qualified name.

What a task gets, and what it cannot leak:

* a fresh rendezvous: its own ncclpy store port, torch ``MASTER_PORT`` and store token, so the
  communicators of one task never meet a store of the last;
* the environment, working directory and CuPy allocator as they were before the task, restored
  after it; a torch process group the task left initialised is destroyed (and said);
* a verdict per rank: ok, or the traceback text (only JSON crosses the connection; nothing of a
  child is unpickled in the parent).

A task in which a rank raises, dies, or outlives ``timeout`` (start-up included) ends the pool:
every rank is stopped (the others may be blocked in a collective with the failed one), the result
says what happened, and the next task starts a fresh pool -- the task that broke it is reported,
not the ones after it.  So does a task that leaves a rank unclean (a thread still inside NCCL
finalizing or aborting, a communicator's watchdog still running: ``unclean``), and a caller that
is itself interrupted (pytest-timeout) while a task runs.  Tasks that kill, stop or time out a rank on purpose, or that need NCCL variables
NCCL reads once per process, take processes of their own (``ncclpy.spawn``), as before.
"""
from __future__ import annotations

import atexit
import importlib
import json
import logging
import multiprocessing.connection as mpc
import os
import secrets
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

__all__ = ["RankPool", "RankOutcome", "PoolResult", "get_pool", "close_pools", "target_name",
           "POOL_ENV", "pool_enabled", "START_TIMEOUT_S", "ABANDON_S"]

log = logging.getLogger(__name__)

#: set to 0 to give every test processes of its own (ncclpy.spawn per test)
POOL_ENV = "NCCLPY_GPU_POOL"
#: seconds for every rank of a new pool to connect back (imports and CUDA context included)
START_TIMEOUT_S = 180.0
#: once a rank failed, seconds the others get to finish before the pool is stopped
ABANDON_S = 10.0
_HEADER = "ncclpy-rank-pool/1"


def pool_enabled() -> bool:
    """Whether tests share pools (``NCCLPY_GPU_POOL`` unset or not ``0``)."""
    return os.environ.get(POOL_ENV, "1").strip() not in ("0", "no", "off", "false")


def target_name(fn: Any) -> str:
    """``module:qualname`` of a module-level function (ValueError for anything else)."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"fn: expected 'module:function', got {fn!r}")
        return fn
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or not qual or "<" in qual:
        raise ValueError(f"fn: {fn!r} is not a module-level function: a pool task is named by "
                         f"module and name")
    return f"{mod}:{qual}"


def _resolve(name: str) -> Callable[..., Any]:
    mod, _, qual = name.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class RankOutcome:
    """One rank's part of a task: ``ok``, the traceback text when not, its seconds."""

    rank: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)
    unclean: List[str] = field(default_factory=list)


@dataclass
class PoolResult:
    """A task's result on every rank.  ``broken``: why the pool ended during this task (a rank
    raised, died or timed out; empty when it lives on); ``started``: this task started the pool
    (``startup_s`` its start-up); ``pids``: the ranks' processes."""

    outcomes: List[RankOutcome]
    broken: str = ""
    started: bool = False
    startup_s: float = 0.0
    seconds: float = 0.0
    pids: List[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.broken and all(o.ok for o in self.outcomes)

    def error_text(self) -> str:
        """'' when ok, else what went wrong on which rank (for a test's failure message)."""
        if self.ok:
            return ""
        parts = [self.broken] if self.broken else []
        for o in self.outcomes:
            if not o.ok and o.error:
                parts.append(f"rank {o.rank}:\n{o.error}")
        return "\n".join(parts)


# -- the rank side ----------------------------------------------------------------------------
def _send(conn: Any, doc: Dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(doc, default=str).encode())


def _recv(conn: Any) -> Dict[str, Any]:
    return json.loads(conn.recv_bytes().decode())


def _restore_env(saved: Dict[str, str]) -> None:
    for k in [k for k in os.environ if k not in saved]:
        del os.environ[k]
    for k, v in saved.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


def _cleanup_after_task(cwd: str, env: Dict[str, str], allocator: Any) -> List[str]:
    """Put back what a task may have changed; what had to be undone, in words."""
    notes: List[str] = []
    if "torch.distributed" in sys.modules:
        dist = sys.modules["torch.distributed"]
        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
                notes.append("the task left a torch process group initialised: destroyed")
        except Exception as e:  # noqa: BLE001 - said, the next task still gets a clean slate
            notes.append(f"destroying the torch process group the task left failed: {e!r}")
    if allocator is not None and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        try:
            if cupy.cuda.get_allocator() is not allocator:
                cupy.cuda.set_allocator(allocator)
                notes.append("the task changed CuPy's allocator: restored")
        except Exception as e:  # noqa: BLE001
            notes.append(f"restoring CuPy's allocator failed: {e!r}")
    try:
        if os.getcwd() != cwd:
            os.chdir(cwd)
            notes.append("the task changed the working directory: restored")
    except OSError:
        os.chdir(cwd)
    _restore_env(env)
    return notes


#: threads that mean a communicator of the task is still open or still inside NCCL
_UNCLEAN_THREADS = ("ncclpy-finalize", "ncclpy-resume", "ncclpy-abort", "ncclpy-watchdog",
                    "ncclpy-stuck")


def _unclean() -> List[str]:
    """What a finished task left running that the next one must not share a process with."""
    import threading
    return sorted({t.name for t in threading.enumerate()
                   if t.is_alive() and t.name.startswith(_UNCLEAN_THREADS)})


def _free_memory() -> None:
    """Give back what the task's arrays held in CuPy's and torch's caching pools."""
    try:
        if "cupy" in sys.modules:
            cupy = sys.modules["cupy"]
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - no CUDA here: nothing was cached
        pass


def _allocator() -> Any:
    if "cupy" not in sys.modules:
        return None
    try:
        return sys.modules["cupy"].cuda.get_allocator()
    except Exception:  # noqa: BLE001 - no CUDA: nothing to restore
        return None


def _trace() -> Any:
    """The GPU ledger's file tracer when this process records (the selftest installs it at
    start-up, :mod:`ncclpy.selftest.filetrace`), else None."""
    mod = sys.modules.get("ncclpy.selftest.filetrace")
    return mod if mod is not None and mod.active() else None


def serve(rank: int, address: Any, authkey_hex: str, warm: Optional[str] = None) -> None:
    """A pool rank (run by :func:`ncclpy.spawn`): warm up, connect back, run tasks until told
    to stop or until the parent goes away."""
    t0 = time.monotonic()
    if warm:
        _resolve(warm)(rank)
    tracer = _trace()
    if tracer is not None:
        tracer.checkpoint()          # the start-up every task of this rank depends on
    conn = mpc.Client(address, authkey=bytes.fromhex(authkey_hex))
    _send(conn, {"hello": _HEADER, "rank": rank, "pid": os.getpid(),
                 "startup_s": round(time.monotonic() - t0, 3)})
    while True:
        try:
            task = _recv(conn)
        except (EOFError, OSError):
            return
        if task.get("stop"):
            return
        saved_env, cwd, alloc = dict(os.environ), os.getcwd(), _allocator()
        os.environ.update({str(k): str(v) for k, v in (task.get("env") or {}).items()})
        if tracer is not None:
            tracer.begin(task.get("context") or "")
        start = time.monotonic()
        reply: Dict[str, Any] = {"id": task["id"], "rank": rank, "ok": True}
        try:
            _resolve(task["fn"])(rank, *task.get("args", []))
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: B902 - SystemExit too: the parent decides
            reply.update(ok=False, error=traceback.format_exc(limit=20)[-8000:])
        reply["seconds"] = round(time.monotonic() - start, 3)
        if tracer is not None:
            tracer.end()
            tracer.checkpoint()          # what it imported, for the tasks after it
        reply["notes"] = _cleanup_after_task(cwd, saved_env, alloc)
        _free_memory()
        reply["unclean"] = _unclean()
        try:
            _send(conn, reply)
        except (EOFError, OSError):
            return


# -- the parent side --------------------------------------------------------------------------
def _free_ports() -> tuple:
    from ncclpy.rendezvous import free_port
    a = free_port("127.0.0.1")
    b = free_port("127.0.0.1")
    while b == a:
        b = free_port("127.0.0.1")
    return a, b


class RankPool:
    """``n`` rank processes that run task after task (see the module docstring).

    ``env``: variables for every rank (on top of this process's environment, fixed for the
    pool's life); ``base_environ``: the environment the ranks start from instead of this
    process's current one (so that what one test set when it happened to start the pool does
    not stay for the others); ``warm``: ``module:function`` each rank calls with its rank before
    it reports ready (imports, the CUDA context)."""

    def __init__(self, n: int, *, env: Optional[Mapping[str, str]] = None,
                 warm: Optional[str] = None, start_timeout: float = START_TIMEOUT_S,
                 abandon_s: float = ABANDON_S,
                 base_environ: Optional[Mapping[str, str]] = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected an int >= 1, got {n!r}")
        self.n = n
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.warm = warm
        self.base_environ = dict(base_environ) if base_environ is not None else None
        self.start_timeout = start_timeout
        self.abandon_s = abandon_s
        self.starts = 0
        self.tasks = 0
        #: why the pool was restarted after a task that passed (what it left running)
        self.retired: List[str] = []
        self._ctx: Any = None
        self._conns: List[Any] = []
        self._pids: List[int] = []
        self._startup_s = 0.0
        self._next_id = 0
        #: the environment the ranks started with (NCCL reads its variables once per process)
        self.start_environ: Dict[str, str] = {}

    @property
    def alive(self) -> bool:
        return self._ctx is not None

    @property
    def pids(self) -> List[int]:
        return list(self._pids)

    def start(self, timeout: Optional[float] = None) -> float:
        """Start the ranks and wait until each has connected back (within ``timeout``, default
        ``start_timeout``); the seconds it took."""
        import ncclpy
        self.close()
        limit = self.start_timeout if timeout is None else timeout
        key = secrets.token_bytes(16)
        listener = mpc.Listener(("127.0.0.1", 0), authkey=key)
        t0 = time.monotonic()
        base = self.base_environ if self.base_environ is not None else dict(os.environ)
        self.start_environ = {**base, **self.env}
        try:
            saved = dict(os.environ)
            _restore_env(base)           # the children inherit it (start method 'spawn')
            try:
                self._ctx = ncclpy.spawn(serve, self.n, args=(listener.address, key.hex(),
                                                              self.warm),
                                         join=False, env=self.env or None)
            finally:
                _restore_env(saved)
            conns: Dict[int, Any] = {}
            deadline = t0 + limit
            while len(conns) < self.n:
                self._check_start(deadline, limit)
                conn = self._accept(listener, deadline)
                if conn is None:
                    continue
                hello = _recv(conn)
                if hello.get("hello") != _HEADER:
                    conn.close()
                    raise RuntimeError(f"rank pool: an unexpected client connected: {hello!r}")
                conns[int(hello["rank"])] = (conn, int(hello["pid"]))
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self._conns = [conns[r][0] for r in range(self.n)]
        self._pids = [conns[r][1] for r in range(self.n)]
        self._startup_s = round(time.monotonic() - t0, 3)
        self.starts += 1
        log.info("rank pool: %d ranks started in %.1f s", self.n, self._startup_s)
        return self._startup_s

    def _check_start(self, deadline: float, limit: float) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self._ctx.processes)
                if p.exitcode is not None]
        if dead:
            r, code = dead[0]
            raise RuntimeError(f"rank pool: rank {r} exited with code {code} while starting "
                               f"(before it connected back)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank pool: the {self.n} ranks did not all connect back within "
                               f"{limit:g} s")

    @staticmethod
    def _accept(listener: Any, deadline: float) -> Any:
        """A connection, or None after at most a second (so a rank that died before it
        connected is seen): the listening socket gets a timeout (CPython's Listener keeps it as
        ``_listener._socket``; without it, accept blocks)."""
        sock = getattr(getattr(listener, "_listener", None), "_socket", None)
        if sock is not None:
            sock.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
        try:
            conn = listener.accept()
        except (TimeoutError, OSError):
            return None
        return conn

    def run(self, fn: Any, args: Sequence[Any] = (), *, timeout: float,
            context: Optional[str] = None, env: Optional[Mapping[str, str]] = None
            ) -> PoolResult:
        """Run ``fn(rank, *args)`` on every rank (starting the pool if need be); never raises
        for what the task did: the result says it.  ``env``: variables for this task only
        (not NCCL's: those are read once per process); ``context``: the GPU ledger's name for
        the files the task executes."""
        name = target_name(fn)
        json.dumps(list(args))          # only JSON crosses: fail here, not in a rank
        t_call = time.monotonic()
        started, startup = False, 0.0
        if not self.alive:
            startup, started = self.start(min(self.start_timeout, timeout)), True
        try:
            return self._run(name, args, t_call + timeout, timeout, context, env, started,
                             startup)
        except BaseException:           # the caller was interrupted: no rank is left mid-task
            self.close()
            raise

    def _run(self, name: str, args: Sequence[Any], deadline: float, timeout: float,
             context: Optional[str], env: Optional[Mapping[str, str]], started: bool,
             startup: float) -> PoolResult:
        self.tasks += 1
        self._next_id += 1
        tid = self._next_id
        store_port, torch_port = _free_ports()
        task_env = {**{str(k): str(v) for k, v in (env or {}).items()},
                    "NCCLPY_MASTER_PORT": str(store_port), "MASTER_PORT": str(torch_port),
                    "NCCLPY_STORE_TOKEN": secrets.token_hex(16)}
        doc = {"id": tid, "fn": name, "args": list(args), "env": task_env, "context": context}
        t0 = time.monotonic()
        outcomes: Dict[int, RankOutcome] = {}
        broken = ""
        for r, conn in enumerate(self._conns):
            try:
                _send(conn, doc)
            except OSError as e:
                broken = f"rank {r} could not be given the task ({e}); the pool was restarted"
                break
        if not broken:
            broken = self._collect(tid, outcomes, deadline, timeout)
        res = PoolResult([outcomes.get(r, RankOutcome(r, False, "no verdict"))
                          for r in range(self.n)], broken, started, startup,
                         round(time.monotonic() - t0, 3), self.pids)
        unclean = sorted({t for o in res.outcomes for t in o.unclean})
        if broken or not all(o.ok for o in res.outcomes):
            if not broken:
                res.broken = "a rank raised; the pool was restarted for the next task"
            self.close()
        elif unclean:                    # not the task's failure: the next task's hazard
            log.info("rank pool: the task left %s running; the pool is restarted", unclean)
            self.retired.append(f"{name}: left {', '.join(unclean)} running")
            self.close()
        return res

    def _collect(self, tid: int, outcomes: Dict[int, RankOutcome], deadline: float,
                 timeout: float) -> str:
        """Read the ranks' verdicts until all came, one died, or the time is up; '' or why
        the pool broke."""
        conns = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._ctx.processes)}
        failed_at: Optional[float] = None
        while len(outcomes) < self.n:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + self.abandon_s)
            if now >= limit:
                missing = [r for r in range(self.n) if r not in outcomes]
                why = (f"timeout={timeout:g} s passed" if failed_at is None else
                       f"a rank failed and {self.abandon_s:g} s later")
                return (f"{why} with rank(s) {', '.join(map(str, missing))} still running the "
                        f"task; every rank was stopped and the pool restarted")
            waiting = [c for c, r in conns.items() if r not in outcomes]
            ready = mpc.wait(waiting + list(sentinels), timeout=limit - now)
            for obj in ready:
                if obj in conns:
                    r = conns[obj]
                    try:
                        rep = _recv(obj)
                    except (EOFError, OSError):
                        del conns[obj]             # its death shows on the sentinel
                        continue
                    if rep.get("id") != tid:
                        continue
                    outcomes[r] = RankOutcome(r, bool(rep.get("ok")), rep.get("error", ""),
                                              float(rep.get("seconds", 0.0)),
                                              list(rep.get("notes") or []),
                                              list(rep.get("unclean") or []))
                    if not outcomes[r].ok and failed_at is None:
                        failed_at = time.monotonic()
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    if r in outcomes:
                        continue
                    self._ctx.processes[r].join(timeout=1.0)
                    code = self._ctx.processes[r].exitcode
                    return (f"rank {r} (pid {self._pids[r]}) died during the task "
                            f"({_describe(code)}); every rank was stopped and the pool restarted")
        return ""

    def close(self) -> None:
        """Stop the ranks (politely, then by signal); idempotent."""
        ctx, self._ctx = self._ctx, None
        conns, self._conns = self._conns, []
        for c in conns:
            try:
                _send(c, {"stop": True})
            except OSError:
                pass
        if ctx is not None:
            deadline = time.monotonic() + 5.0
            for p in ctx.processes:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            ctx.stop(grace=2.0)
        for c in conns:
            try:
                c.close()
            except OSError:
                pass
        self._pids = []


def _describe(code: Optional[int]) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_POOLS: Dict[tuple, RankPool] = {}


def get_pool(n: int, *, env: Optional[Mapping[str, str]] = None, warm: Optional[str] = None,
             base_environ: Optional[Mapping[str, str]] = None) -> RankPool:
    """This process's pool of ``n`` ranks with these settings (made on first use)."""
    key = (n, tuple(sorted((env or {}).items())), warm)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = RankPool(n, env=env, warm=warm, base_environ=base_environ)
    return pool


def close_pools() -> None:
    """Stop every pool of this process."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(close_pools)
