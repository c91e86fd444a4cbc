"""``ncclpy.spawn``: run ``fn(rank, *args)`` in N local processes with the rendezvous env set.

The in-script counterpart of ``ncclpy run`` (and of ``torch.multiprocessing.spawn``): inside
``fn``, ``ncclpy.bootstrap()`` / ``ncclpy.init()`` just work.  Fail-fast: the first child that
raises, exits non-zero or dies by a signal stops the others (SIGTERM, then SIGKILL after
:data:`TERM_GRACE_S`) and is reported in the parent, an exception as
:class:`~ncclpy.errors.ProcessRaisedException` with the child's rank and traceback text.
Only strings cross the pipe back; nothing is unpickled from a child's exception.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from ncclpy.errors import ArgumentError, ArgumentTypeError, LaunchError, ProcessRaisedException
from ncclpy.launch.env import rank_env

__all__ = ["spawn", "SpawnContext", "TERM_GRACE_S"]

log = logging.getLogger(__name__)

#: seconds between SIGTERM and SIGKILL when stopping the remaining children
TERM_GRACE_S = 3.0


def _trampoline(fn: Callable[..., Any], rank: int, args: Sequence[Any], env: Mapping[str, str],
                conn: Any) -> None:
    """Child entry point: set the rank's environment, run ``fn``, send back a traceback on error."""
    os.environ.update(env)
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        # Ctrl-C reaches the whole process group; the parent reports it, the children stay quiet
        sys.exit(128 + signal.SIGINT)
    except Exception:
        try:
            conn.send(traceback.format_exc())
        finally:
            conn.close()
        sys.exit(1)
    conn.close()


def _signal_name(code: int) -> str:
    try:
        return f"{signal.Signals(code).name} ({code})"
    except ValueError:
        return f"signal {code}"


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        return f"died by signal {_signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


def _two_free_ports(host: str) -> tuple[int, int]:
    """Two distinct free ports on ``host`` (held open together so they differ)."""
    bind = host if host in ("127.0.0.1", "localhost", "::1") else ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as a, socket.socket(family) as b:
        a.bind((bind, 0))
        b.bind((bind, 0))
        return int(a.getsockname()[1]), int(b.getsockname()[1])


def _plan_placement(nprocs: int, child_env: Mapping[str, str]) -> tuple[list[Optional[int]],
                                                                         list[dict[str, str]]]:
    """The single placement call site: device and extra NCCL variables per rank (one node)."""
    from ncclpy.launch import placement

    ngpus = placement.visible_gpu_count(child_env)
    version = placement.loaded_nccl_version() if 0 < ngpus < nprocs else None
    plan = placement.plan_placement(nprocs, ngpus, version, single_node=True, env=child_env)
    log.info("spawn: %s", plan.summary)
    return [plan.device(r) for r in range(nprocs)], [plan.env(r) for r in range(nprocs)]


class SpawnContext:
    """The running children of one :func:`spawn` call (what ``join=False`` returns)."""

    def __init__(self, processes: list, envs: list[dict[str, str]]) -> None:
        self.processes = processes
        self.envs = envs
        self._conns: dict[int, Any] = {}
        self._tracebacks: dict[int, str] = {}
        self._done = False

    def pids(self) -> list[Optional[int]]:
        return [p.pid for p in self.processes]

    def _read(self, rank: int) -> None:
        conn = self._conns.pop(rank, None)
        if conn is None:
            return
        try:
            if conn.poll():
                msg = conn.recv()
                if isinstance(msg, str):
                    self._tracebacks[rank] = msg
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def stop(self, grace: Optional[float] = None) -> None:
        """SIGTERM every live child, SIGKILL those still alive after ``grace`` seconds
        (default :data:`TERM_GRACE_S`)."""
        if grace is None:
            grace = TERM_GRACE_S
        alive = [p for p in self.processes if p.is_alive()]
        for p in alive:
            try:
                p.terminate()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in alive],
                                            timeout=max(0.0, deadline - time.monotonic()))
            alive = [p for p in alive if p.is_alive()]
        for p in alive:
            log.debug("spawn: pid %s ignored SIGTERM for %.1f s; sending SIGKILL", p.pid, grace)
            try:
                p.kill()
            except (OSError, ValueError):
                pass
        for p in self.processes:
            p.join(timeout=5.0)
        for rank in list(self._conns):
            self._read(rank)

    def _fail(self, rank: int) -> None:
        p = self.processes[rank]
        tb = self._tracebacks.get(rank)
        if tb is not None:
            p.join(timeout=5.0)  # it exits right after sending its traceback
        self.stop()
        self._done = True
        if tb is not None:
            raise ProcessRaisedException(rank, p.exitcode, tb)
        code = p.exitcode if p.exitcode is not None else -signal.SIGKILL
        raise LaunchError(f"rank {rank} (pid {p.pid}) {_describe_exit(code)}"
                          f"{' without raising an exception' if code > 0 else ''}; "
                          f"the other ranks were stopped")

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the children: True when all exited 0, False if ``timeout`` passed first.

        The first failing child raises here (after the others are stopped).
        """
        if self._done:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            running = {p.sentinel: r for r, p in enumerate(self.processes) if p.exitcode is None}
            conns = {c: r for r, c in self._conns.items()}
            if not running:
                for rank in list(self._conns):
                    self._read(rank)
                for r, p in enumerate(self.processes):
                    if p.exitcode != 0:
                        self._fail(r)
                self._done = True
                return True
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([*running, *conns], timeout=wait_s)
            if not ready:
                return False
            for obj in ready:
                if obj in conns:
                    rank = conns[obj]
                    self._read(rank)
                    if rank in self._tracebacks:
                        self._fail(rank)
            for obj in ready:
                if obj in running:
                    rank = running[obj]
                    p = self.processes[rank]
                    p.join()
                    if p.exitcode != 0:
                        self._read(rank)
                        self._fail(rank)


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, join: bool = True,
          timeout: Optional[float] = None, master_addr: str = "127.0.0.1",
          master_port: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
          start_method: str = "spawn") -> Optional[SpawnContext]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes of one node with the rendezvous env set.

    ``master_port`` None picks a free port; ``env`` adds variables for every child (the
    rendezvous variables always win).  ``join=False`` returns a :class:`SpawnContext`; with
    ``join=True`` this returns None when every child exited 0 and raises otherwise
    (:class:`ProcessRaisedException` for an exception, :class:`LaunchError` for a non-zero exit, a
    signal, or ``timeout`` seconds passing; the other children are stopped in every case).
    """
    if not callable(fn):
        raise ArgumentTypeError(f"fn: expected a callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ArgumentError(f"nprocs: expected an int >= 1, got {nprocs!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ArgumentError(f"timeout: expected None or seconds > 0, got {timeout!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ArgumentTypeError(f"args: expected a tuple or list, got {type(args).__name__}")
    try:
        ctx = multiprocessing.get_context(start_method)
    except ValueError as e:
        methods = multiprocessing.get_all_start_methods()
        raise ArgumentError(f"start_method: expected one of {methods}, "
                            f"got {start_method!r}") from e

    user_env = {str(k): str(v) for k, v in (env or {}).items()}
    if master_port is None:
        master_port, torch_port = _two_free_ports(master_addr)
    else:
        torch_port = None  # rank_env's default: master_port + 1
    token = secrets.token_hex(16)
    devices, extras = _plan_placement(nprocs, {**os.environ, **user_env})
    envs = [{**user_env, **rank_env(r, nprocs, r, nprocs, master_addr, master_port, token,
                                    device=devices[r], extra=extras[r],
                                    torch_master_port=torch_port)}
            for r in range(nprocs)]
    log.debug("spawn: %d ranks, store %s:%d", nprocs, master_addr, master_port)

    processes: list = []
    context = SpawnContext(processes, envs)
    try:
        for r in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_trampoline, args=(fn, r, tuple(args), envs[r], writer),
                            name=f"ncclpy-rank-{r}")
            p.start()
            writer.close()
            processes.append(p)
            context._conns[r] = reader
    except BaseException:
        context.stop(grace=0.5)
        raise
    if not join:
        return context
    try:
        if not context.join(timeout):
            running = [r for r, p in enumerate(processes) if p.exitcode is None]
            context.stop()
            raise LaunchError(f"spawn: timeout={timeout:g} s passed with ranks {running} still "
                              f"running; all ranks were stopped")
    except BaseException:
        if any(p.exitcode is None for p in processes):
            context.stop()
        raise
    return None
