"""``ncclpy.spawn``: run ``fn(rank, *args)`` in N local processes with the rendezvous env set.

The in-script counterpart of ``ncclpy run`` (and of ``torch.multiprocessing.spawn``): inside
``fn``, ``ncclpy.bootstrap()`` / ``ncclpy.init()`` just work.  Fail-fast: the first child
that raises, exits non-zero or dies by a signal stops the others (SIGTERM, then SIGKILL after
:data:`TERM_GRACE_S`) and is reported in the parent, an exception as
:class:`~ncclpy.errors.ProcessRaisedException` with the child's rank and traceback text.
Only strings cross the pipe back; nothing is unpickled from a child's exception.

Each child runs in a session (and process group) of its own, as ``ncclpy run``'s ranks do, and
every stop signal goes to the whole group: a subprocess a rank started ends with it on
fail-fast, on ``timeout`` and on Ctrl-C (SIGTERM to each rank's group, also a rank that already
exited; SIGKILL to every group after :data:`TERM_GRACE_S`, or at once when the ranks are gone).
A terminal's Ctrl-C therefore reaches the parent alone: while it starts or joins the children
(main thread, default handlers) the parent stops them before the signal takes its usual effect;
outside that (``join=False`` before :meth:`SpawnContext.join`) call :meth:`SpawnContext.stop`.
The children die with the parent (SIGTERM through ``PR_SET_PDEATHSIG`` on Linux, even when the
parent is SIGKILLed; what a child started is then left to the child).  GPU
placement is ``ncclpy run``'s (:mod:`ncclpy.launch.placement`, ``ranks_per_gpu`` included), and
when ranks share a GPU the same one-line mode statement goes to stderr, CUDA MPS included
(``mps=``, as ``ncclpy run --mps``; :mod:`ncclpy.launch.mps`): a daemon started for the children
is stopped once they have all ended, whatever the outcome.  ``device="cpu"`` (or
``NCCLPY_DEVICE=cpu`` in the environment) puts every child on the CPU backend instead, as
``ncclpy run --cpu`` does: no GPU placement, no MPS.

The job's ncclpy store lives in the parent, as ``ncclpy run``'s launcher hosts it: it listens
before the first child starts (``NCCLPY_STORE_HOSTED_BY=launcher``: rank 0 joins it as a
client), so a child may connect any store client to the rendezvous address at once
(``ncclpy.TCPStore(info.master_addr, info.master_port)``, the token from
``NCCLPY_STORE_TOKEN``), whichever rank starts first; its connection limit is sized for the
children, and it closes once they have all ended.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from ncclpy.errors import ArgumentError, ArgumentTypeError, LaunchError, ProcessRaisedException
from ncclpy.launch._pdeath import die_with_parent
from ncclpy.launch.env import rank_env
from ncclpy.launch.mps import MpsSetup, resolve_mode, setup_mps
from ncclpy.launch.launcher import HOSTED_ENV
from ncclpy.launch.ports import check_local

__all__ = ["spawn", "SpawnContext", "TERM_GRACE_S"]

log = logging.getLogger(__name__)

#: seconds between SIGTERM and SIGKILL when stopping the remaining children
TERM_GRACE_S = 3.0


def _trampoline(fn: Callable[..., Any], rank: int, args: Sequence[Any], env: Mapping[str, str],
                conn: Any, parent_pid: Optional[int] = None, unset: Sequence[str] = ()) -> None:
    """Child entry point: lead a session of its own (so the parent can signal the rank and
    whatever it starts as one group), die with the parent (SIGTERM, Linux), set the rank's
    environment (removing the names in ``unset``), run ``fn``, send back a traceback on error."""
    try:
        os.setsid()
    except (OSError, AttributeError):   # already a group leader, or not POSIX: signalled alone
        pass
    for sig, default in ((signal.SIGINT, signal.default_int_handler),
                         (signal.SIGTERM, signal.SIG_DFL)):
        if getattr(signal.getsignal(sig), "_ncclpy_spawn", False):  # inherited through fork
            signal.signal(sig, default)
    die_with_parent(signal.SIGTERM, parent_pid)
    os.environ.update(env)
    for name in unset:
        os.environ.pop(name, None)
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        # a SIGINT sent to the rank (its own session: a terminal's Ctrl-C goes to the parent,
        # which stops the ranks): the parent reports it, the children stay quiet
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


def _rank_list(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 1, 3``, as ``ncclpy run`` names them."""
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(str(r) for r in ranks))


def _check_picklable(start_method: str, fn: Any, args: Sequence[Any]) -> None:
    """With "spawn" or "forkserver" the function and its arguments are pickled to reach the
    children: say so, naming what cannot be, before any child starts."""
    if start_method == "fork":
        return
    import pickle
    for what, obj in (("fn", fn), ("args", tuple(args))):
        try:
            pickle.dumps(obj)
        except Exception as e:  # noqa: BLE001 - PicklingError, AttributeError, TypeError
            name = getattr(obj, "__qualname__", type(obj).__name__)
            hint = (" (a lambda or a function defined inside another cannot be; define it at "
                    "the top level of a module)" if what == "fn" else "")
            raise ArgumentTypeError(
                f"{what}: {name} cannot be sent to the children: start_method="
                f"{start_method!r} pickles it, and pickling failed ({type(e).__name__}: "
                f"{e}){hint}") from None


def _two_free_ports(host: str) -> tuple[int, int]:
    """Two distinct free ports on ``host``, below the ephemeral range where possible (see
    :func:`ncclpy.rendezvous.free_port`): ncclpy's store and torch's ``MASTER_PORT``."""
    from ncclpy.rendezvous import free_port
    bind = host if host in ("127.0.0.1", "localhost", "::1") else ""
    a = free_port(bind or "0.0.0.0")
    b = free_port(bind or "0.0.0.0")
    while b == a:
        b = free_port(bind or "0.0.0.0")
    return a, b


def _host_store(addr: str, port: int, token: str, nprocs: int) -> Any:
    """The job's store server, here in the parent (as ``ncclpy run``'s launcher hosts it), its
    connection limit sized for ``nprocs`` ranks."""
    from ncclpy.store import StoreServer
    from ncclpy.store.limits import StoreLimits
    try:
        return StoreServer(addr, port, token=token or None,
                           limits=StoreLimits.for_world(nprocs)).start()
    except Exception as e:  # noqa: BLE001 - the port is taken, or the address not this host's
        raise LaunchError(f"spawn: could not host the job's store at {addr}:{port} "
                          f"(master_addr/master_port): {type(e).__name__}: {e}") from e


def _stderr_line(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # no usable stderr: the log still has it
        pass


def _device_choice(device: Any, user_env: Mapping[str, str],
                   child_env: Mapping[str, str]) -> Optional[tuple[str, bool]]:
    """``spawn(device=...)``: None (GPU placement, unless the children's environment says
    ``NCCLPY_DEVICE=cpu``) or ``"cpu"``; for the CPU backend, (who asked, from the environment),
    else None.  A precise error for anything else, before anything starts."""
    from ncclpy.launch.placement import CPU_DEVICE, cpu_requested
    if device is not None and not isinstance(device, str):
        raise ArgumentTypeError(
            f"device: expected None (GPU placement: rank r -> GPU r mod the GPU count) or "
            f"'cpu' (the CPU backend), got {type(device).__name__} {device!r}")
    if device is not None:
        if device.strip().lower() != CPU_DEVICE:
            raise ArgumentError(f"device: expected None (GPU placement, or the CPU backend when "
                                f"NCCLPY_DEVICE=cpu is in the environment) or 'cpu', got "
                                f"{device!r}")
        return "device='cpu'", False
    if cpu_requested(user_env):
        return "env={'NCCLPY_DEVICE': 'cpu'}", True
    if cpu_requested(child_env):
        return "NCCLPY_DEVICE=cpu in the environment", True
    return None


def _plan_placement(nprocs: int, child_env: Mapping[str, str], ranks_per_gpu: Optional[int],
                    mps_mode: str = "off", cpu_plan: Any = None
                    ) -> tuple[list[Optional[int]], list[dict[str, str]], tuple[str, ...],
                               MpsSetup]:
    """The single placement call site (one node): device, extra variables and variables to
    remove per rank, and the MPS set up for them (``mps_mode``, :mod:`ncclpy.launch.mps`);
    ``cpu_plan`` (:func:`~ncclpy.launch.placement.plan_cpu`): the CPU backend's, no GPU looked
    for, no MPS, no device index (``NCCLPY_DEVICE=cpu`` is in each rank's variables).

    When ranks share a GPU the mode is stated in one line on stderr, as ``ncclpy run`` does.
    """
    from ncclpy.launch import placement

    if cpu_plan is not None:
        log.info("%s", placement.summary_line("ncclpy spawn", cpu_plan))
        return [None] * nprocs, [cpu_plan.env(r) for r in range(nprocs)], (), MpsSetup(None)
    plan = placement.place(nprocs, ranks_per_gpu=ranks_per_gpu, single_node=True, env=child_env)
    mps_setup = setup_mps(mps_mode, plan.shared, child_env, name="mps")
    if mps_setup.status is not None:
        plan = placement.with_mps(plan, mps_setup.status, mps_setup.env, mps_setup.unset)
    line = placement.summary_line("ncclpy spawn", plan)
    if plan.shared:
        _stderr_line(line)
    log.info("%s", line)
    return ([plan.device(r) for r in range(nprocs)], [plan.env(r) for r in range(nprocs)],
            plan.unset, mps_setup)


class _Interrupted(BaseException):
    """Raised in the parent by SIGINT/SIGTERM while children run, so they are stopped first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_children() -> Iterator[None]:
    """While active (main thread only): SIGINT and SIGTERM, when they have their default
    handlers, raise :class:`_Interrupted` instead of killing the parent outright."""
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def handler(signum: int, frame: Any) -> None:
            raise _Interrupted(signum)
        handler._ncclpy_spawn = True  # type: ignore[attr-defined]
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _after_interrupt(context: "SpawnContext", e: _Interrupted) -> None:
    """Stop the children, then let the signal do what it would have done (handlers restored):
    SIGINT raises KeyboardInterrupt, SIGTERM ends the process."""
    log.debug("spawn: got %s; stopping the children", _signal_name(e.signum))
    context.stop()
    context._done = True
    signal.raise_signal(e.signum)
    raise KeyboardInterrupt if e.signum == signal.SIGINT else SystemExit(128 + e.signum)


class SpawnContext:
    """The running children of one :func:`spawn` call (what ``join=False`` returns)."""

    def __init__(self, processes: list, envs: list[dict[str, str]],
                 mps: Optional[MpsSetup] = None, server: Any = None) -> None:
        self.processes = processes
        self.envs = envs
        self._conns: dict[int, Any] = {}
        self._tracebacks: dict[int, str] = {}
        self._done = False
        self._mps = mps
        self._server = server   # the job's store, hosted here until every child ended

    def _end(self) -> None:
        """Every child has ended: close the job's store, unlink the shared memory a CPU-backend
        rank killed mid-job left, stop the MPS daemon."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        # what a CPU-backend rank killed mid-job left in /dev/shm (whether the job asked for
        # the backend or each rank chose it; a GPU job has none: one directory listing)
        from ncclpy.cpu.shm import sweep
        sweep(pids=[p.pid for p in self.processes if p.pid and p.exitcode is not None])
        self._end_mps()

    def _end_mps(self) -> None:
        """Stop the MPS daemon started for these children (once they all ended); keep its logs
        and say where when a child failed."""
        setup, self._mps = self._mps, None
        if setup is None or setup.daemon is None:
            return
        failed = any(p.exitcode != 0 for p in self.processes)
        kept = setup.stop(failed=failed)
        if kept:
            log.warning("spawn: a rank failed; MPS logs kept in %s", kept)
            _stderr_line(f"ncclpy spawn: a rank failed; MPS logs kept in {kept}")

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

    @staticmethod
    def _signal(p: Any, sig: int) -> None:
        """Send ``sig`` to the rank's process group (the rank and the processes it started, also
        once the rank itself has exited), else (no such group yet) to the rank alone."""
        if p.pid is None:
            return
        try:
            os.killpg(p.pid, sig)
            return
        except (ProcessLookupError, PermissionError, AttributeError):
            pass
        if p.exitcode is None:
            try:
                os.kill(p.pid, sig)
            except OSError:
                pass

    def stop(self, grace: Optional[float] = None) -> None:
        """SIGTERM every child's process group (a child that already exited included: what it
        started goes too), then SIGKILL every group once the children are gone or ``grace``
        seconds (default :data:`TERM_GRACE_S`) have passed."""
        if grace is None:
            grace = TERM_GRACE_S
        alive = [p for p in self.processes if p.is_alive()]
        for p in self.processes:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in alive],
                                            timeout=max(0.0, deadline - time.monotonic()))
            alive = [p for p in alive if p.is_alive()]
        for p in alive:
            log.debug("spawn: pid %s ignored SIGTERM for %.1f s; sending SIGKILL", p.pid, grace)
        for p in self.processes:   # stubborn ranks, and whatever their groups still hold
            self._signal(p, signal.SIGKILL)
        for p in self.processes:
            p.join(timeout=5.0)
        for rank in list(self._conns):
            self._read(rank)
        if not any(p.is_alive() for p in self.processes):
            self._end()

    def _fail(self, rank: int) -> None:
        p = self.processes[rank]
        tb = self._tracebacks.get(rank)
        if tb is not None:
            p.join(timeout=5.0)  # it exits right after sending its traceback
        self.stop()
        self._done = True
        if tb is not None:
            raise ProcessRaisedException(rank, p.exitcode, tb, message=self._no_gpu(rank, tb))
        code = p.exitcode if p.exitcode is not None else -signal.SIGKILL
        raise LaunchError(f"rank {rank} (pid {p.pid}) {_describe_exit(code)}"
                          f"{' without raising an exception' if code > 0 else ''}; "
                          f"the other ranks were stopped")

    def _no_gpu(self, rank: int, tb: str) -> Optional[str]:
        """One line for a rank placed on a GPU that found none (its traceback ends with
        CudaUnavailableError): the remedy is ``spawn(device="cpu")``; None otherwise."""
        last = tb.rstrip().rsplit("\n", 1)[-1]
        kind, sep, what = last.partition(": ")
        if not sep or kind.rsplit(".", 1)[-1] != "CudaUnavailableError" or \
                self.envs[rank].get("NCCLPY_DEVICE", "").strip().lower() == "cpu":
            return None
        return (f"rank {rank}: {what.split('; ', 1)[0]}: ncclpy.spawn placed its ranks on GPUs; "
                f"without a GPU, run them on the CPU backend (NCCL's semantics on host memory) "
                f"with ncclpy.spawn(..., device=\"cpu\")")

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the children: True when all exited 0, False if ``timeout`` passed first.

        The first failing child raises here (after the others are stopped).  SIGINT or SIGTERM
        reaching the parent meanwhile (main thread, default handlers) stops the children first,
        then takes its usual effect (KeyboardInterrupt, or the end of the process).
        """
        if self._done:
            return True
        try:
            with _signals_stop_children():
                return self._join(timeout)
        except _Interrupted as e:
            _after_interrupt(self, e)
            raise  # pragma: no cover - _after_interrupt never returns

    def _join(self, timeout: Optional[float]) -> bool:
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
                self._end()
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
          start_method: str = "spawn", ranks_per_gpu: Optional[int] = None,
          mps: Optional[str] = None, checked: Optional[bool] = None,
          device: Optional[str] = None) -> Optional[SpawnContext]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes of one node with the rendezvous env set.

    ``master_port`` None picks two free ports, ncclpy's store on the first and torch's
    ``MASTER_PORT`` on the second (not necessarily P+1); a given P uses P and P+1.  The store
    is hosted here, in the calling process, from before the first child starts until the last
    one ended (see the module docstring); a port it cannot bind is a :class:`LaunchError`.
    ``env`` adds variables for every child (the rendezvous variables always win).
    ``ranks_per_gpu`` is ``ncclpy run --ranks-per-gpu``: R ranks share each GPU (see
    :mod:`ncclpy.launch.placement`); when ranks share a GPU the mode chosen is stated in one line on
    stderr.  ``mps`` is ``ncclpy run --mps`` (``"auto"``, ``"on"``, ``"off"``; None: ``NCCLPY_MPS``,
    else ``"auto"``): a CUDA MPS daemon for children sharing a GPU, stopped when they have all
    ended.  ``checked`` is ``ncclpy run --checked``: True sets ``NCCLPY_CHECKED=1`` in every child
    (False: ``0``; None: inherited).  ``timeout`` is ``ncclpy run --timeout``: children still
    running after it are stopped and named in the :class:`LaunchError`.  ``device`` is
    ``ncclpy run --cpu``: ``"cpu"`` (or None with ``NCCLPY_DEVICE=cpu`` in this process's
    environment or in ``env``) sets ``NCCLPY_DEVICE=cpu`` in every child, the CPU backend
    (:mod:`ncclpy.cpu`): no GPU placement, no MPS (so not with ``ranks_per_gpu`` or ``mps="on"``).
    ``join=False`` returns a :class:`SpawnContext`; with ``join=True`` this returns None when every
    child exited 0 and raises otherwise (:class:`ProcessRaisedException` for an exception,
    :class:`LaunchError` for a non-zero exit, a signal, or ``timeout`` seconds passing; the other
    children are stopped in every case).  A rank placed on a GPU that finds none (no
    ``device="cpu"``) raises it in one line naming the remedy, ``spawn(..., device="cpu")`` (its
    traceback stays in ``.traceback``).

    The children die with the parent (SIGTERM via ``PR_SET_PDEATHSIG``, Linux): with
    ``join=False``, call this from a thread that outlives them (e.g. the main thread).  SIGINT
    and SIGTERM reaching the parent while it starts or joins the children stop them first.
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
    if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool)
                                      or not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        raise ArgumentError(f"ranks_per_gpu: expected None or an int >= 1, got {ranks_per_gpu!r}")
    try:
        ctx = multiprocessing.get_context(start_method)
    except ValueError as e:
        methods = multiprocessing.get_all_start_methods()
        raise ArgumentError(f"start_method: expected one of {methods}, "
                            f"got {start_method!r}") from e

    _check_picklable(start_method, fn, args)
    if not isinstance(master_addr, str) or not master_addr:
        raise ArgumentTypeError(f"master_addr: expected a host name or address, got "
                                f"{master_addr!r}")
    check_local(master_addr, "master_addr")      # the store is hosted here, by rank 0
    if checked is not None and not isinstance(checked, bool):
        raise ArgumentTypeError(f"checked: expected None, True or False, got "
                                f"{type(checked).__name__} {checked!r}")
    user_env = {str(k): str(v) for k, v in (env or {}).items()}
    if checked is not None:
        user_env["NCCLPY_CHECKED"] = "1" if checked else "0"
    child_env = {**os.environ, **user_env}
    mps_mode = resolve_mode(mps, child_env, name="mps")
    cpu_plan = None
    on_cpu = _device_choice(device, user_env, child_env)
    if on_cpu is not None:
        from ncclpy.launch.placement import plan_cpu
        cpu_plan = plan_cpu(nprocs, why=on_cpu[0], from_env=on_cpu[1],
                            ranks_per_gpu=ranks_per_gpu, mps=mps_mode,
                            names={"mps": "mps" if mps is not None else "NCCLPY_MPS"})
    if master_port is None:
        master_port, torch_port = _two_free_ports(master_addr)
    else:
        torch_port = None  # rank_env's default: master_port + 1
    token = secrets.token_hex(16)
    devices, extras, unset, mps_setup = _plan_placement(nprocs, child_env, ranks_per_gpu,
                                                        mps_mode, cpu_plan)
    try:
        envs = [{k: v for k, v in {**user_env, **rank_env(
                    r, nprocs, r, nprocs, master_addr, master_port, token, device=devices[r],
                    extra=extras[r], torch_master_port=torch_port),
                    HOSTED_ENV: "launcher"}.items() if k not in unset}
                for r in range(nprocs)]
        server = _host_store(master_addr, master_port, token, nprocs)
    except BaseException:
        mps_setup.stop()
        raise
    log.debug("spawn: %d ranks, store %s:%d (hosted here)", nprocs, master_addr, master_port)

    processes: list = []
    context = SpawnContext(processes, envs, mps_setup, server)
    # a forkserver child's parent is the fork server (which dies with this process), not us
    parent = None if start_method == "forkserver" else os.getpid()
    try:
        with _signals_stop_children():
            for r in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_trampoline,
                                args=(fn, r, tuple(args), envs[r], writer, parent, unset),
                                name=f"ncclpy-rank-{r}")
                p.start()
                writer.close()
                processes.append(p)
                context._conns[r] = reader
    except _Interrupted as e:
        _after_interrupt(context, e)
    except BaseException:
        context.stop(grace=0.5)
        raise
    if not join:
        return context
    try:
        if not context.join(timeout):
            running = [r for r, p in enumerate(processes) if p.exitcode is None]
            context.stop()
            raise LaunchError(f"spawn: timeout={timeout:g} s passed with {_rank_list(running)} "
                              f"still running; all ranks were stopped")
    except BaseException as e:
        if any(p.exitcode is None for p in processes):
            context.stop()
        if isinstance(e, ProcessRaisedException) and "\n" not in str(e):
            raise e.with_traceback(None) from None    # a known mistake: its one line says it
        raise
    return None
