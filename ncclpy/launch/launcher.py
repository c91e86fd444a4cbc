"""``ncclpy run``: start N local ranks with the rendezvous environment, torchrun-style.

* Each rank gets ``NCCLPY_*`` and torchrun's variables (``ncclpy.launch.env.rank_env``), its
  device (``NCCLPY_DEVICE``) and the NCCL variables of ``ncclpy.launch.placement``, plus
  ``PYTHONUNBUFFERED=1`` (unless set) so output arrives line by line.
* Output: every line a rank writes is prefixed ``"[rank R] "`` (R the global rank) by a reader
  thread; stdout lines go to stdout, stderr lines to stderr; a last line without a newline is
  flushed at EOF (and terminated with one when prefixed); each prefixed line is written whole
  (:mod:`ncclpy.launch.output`).  ``--no-prefix`` passes lines through.
* Each rank runs in its own session: a terminal Ctrl-C reaches only the launcher, which forwards
  SIGINT/SIGTERM once to every rank's process group.  Ranks still running ``grace`` seconds after
  the first forwarded signal get SIGKILL; the launcher then exits with ``128 + signum``.
* Fail-fast: when a rank exits non-zero or dies by a signal, the others get SIGTERM, then SIGKILL
  after ``grace`` seconds; the exit code is the first failure's (signal death -> 128 + signum) and
  one summary line goes to stderr.  ``--keep-going``: the others run on (each failure is still
  published for their watchdogs: the recovery recipe, docs/reference/concepts/recovery.rst);
  the exit code is still the first failure's, and the summary names how every rank ended.
  Rank 0 gets the launcher's stdin, the others /dev/null.
* A rank's own children go with it: every signal goes to the rank's process group, and when a
  rank exits its group is signalled too (SIGTERM; SIGKILL to every group when the job ends), so a
  subprocess a rank started does not outlive it.
* ``--timeout S``: ranks still running S seconds after the start are stopped (SIGTERM, SIGKILL
  after ``grace``); the summary names them and the exit code is :data:`EXIT_TIMEOUT` (124).
* The job's ncclpy store lives in the launcher (node 0's, on several nodes), as torchrun's agent
  hosts its store: rank 0 joins it as a client (``NCCLPY_STORE_HOSTED_BY=launcher``), so the
  store outlives any rank, its connection limit is sized from the world size, and rank 0's
  death is reported like any other's.
* Peer death notice: when a rank fails, before the others are stopped, the launcher publishes
  it (:mod:`ncclpy.debug.deaths`: ``ncclpy/dead/<rank>`` with the exit code or signal as text,
  the dead list, the death epoch) for the ranks' watchdogs, bounded to about a second.
* ``--checked`` sets ``NCCLPY_CHECKED=1`` for every rank.
* Ranks die with the launcher (``PR_SET_PDEATHSIG``, Linux) if it is killed outright.
* Ranks sharing a GPU: :mod:`ncclpy.launch.placement` sets NCCL's variables (a CTA limit above 2
  ranks per GPU) and :mod:`ncclpy.launch.mps` starts a CUDA MPS daemon for the run (``--mps``,
  ``NCCLPY_MPS``; default ``auto``), stopped when the run ends, whatever the outcome; the
  placement line says what was set.
* ``--cpu`` (or ``NCCLPY_DEVICE=cpu`` in the launcher's environment): every rank gets
  ``NCCLPY_DEVICE=cpu`` (the CPU backend, :mod:`ncclpy.cpu`): no GPU placement, no NCCL
  variable, no MPS; one machine only (``--nnodes`` > 1, ``--ranks-per-gpu`` and ``--mps on``
  are refused in one line).
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from .ports import check_local, check_port, check_ports_free, free_port
from .limits import check_start_limits
from ..cli_util import EXIT_CLOSED_PIPE
from ..errors import ArgumentError, LaunchError
from ._pdeath import PR_SET_PDEATHSIG, prctl_function
from .mps import MPS_ENV, resolve_mode, setup_mps
from .placement import Placement, cpu_requested, place, plan_cpu, summary_line, with_mps
from .forensics import Forensics
from ..debug.jobfile import remove_job, write_job
from .output import pump as _pump

__all__ = ["launch", "build_command", "DEFAULT_GRACE",
           "PREFIX_FORMAT", "EXIT_TIMEOUT", "EXIT_USAGE", "DEAD_KEY", "HOSTED_ENV"]

#: Seconds between SIGTERM and SIGKILL (small, so a failed job stops within ~5 s).
DEFAULT_GRACE = 3.0
#: How each output line is prefixed (``rank`` is the global rank).
PREFIX_FORMAT = "[rank {rank}] "
#: Exit code when ``--timeout`` stopped ranks still running (as GNU ``timeout``).
EXIT_TIMEOUT = 124
#: Exit code of a usage error (a bad flag or value), as argparse.
EXIT_USAGE = 2
#: Store key where the launcher publishes a rank's death (format with ``rank=``).
DEAD_KEY = "ncclpy/dead/{rank}"
#: Set to "launcher" in every rank's environment when the launcher hosts the job's store.
HOSTED_ENV = "NCCLPY_STORE_HOSTED_BY"
#: The spellings of ``ncclpy run``'s options, by ``launch()`` keyword, for CLI error messages.
_FLAGS = {"nproc": "-n/--nprocs", "nnodes": "--nnodes", "node_rank": "--node-rank",
          "master_addr": "--master-addr", "master_port": "--master-port",
          "ranks_per_gpu": "--ranks-per-gpu", "grace": "--grace", "timeout": "--timeout",
          "mps": "--mps", "cpu": "--cpu", "command": "PROGRAM"}
#: seconds between looks, while ranks are being started, for a rank that already failed
_START_POLL = 0.2

log = logging.getLogger(__name__)


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def build_command(program: Sequence[str], module: bool = False) -> list[str]:
    """The argv that starts one rank: ``-m`` runs ``python -m program[0]``; ``*.py`` runs with
    this interpreter; anything else runs as given."""
    program = list(program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        raise ArgumentError("PROGRAM: expected a program (or a module with -m) to run, got none")
    if module:
        return [sys.executable, "-m", *program]
    if program[0].endswith(".py"):
        return [sys.executable, *program]
    return program


class _Sink:
    """A binary writer over a (text or binary) stream, serialised by a lock, never raising."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        #: the reader of this stream went away (``ncclpy run ... | head``): EPIPE on a write
        self.closed = False

    def write(self, data: bytes) -> None:
        with self.lock:
            try:
                buf = getattr(self.stream, "buffer", None)
                if buf is not None:         # a text stream: flush its text layer, write bytes
                    self.stream.flush()
                    buf.write(data)
                    buf.flush()
                elif hasattr(self.stream, "encoding"):
                    self.stream.write(data.decode(errors="replace"))
                    self.stream.flush()
                else:                       # a binary stream
                    self.stream.write(data)
                    self.stream.flush()
            except BrokenPipeError:          # the reader is gone: the supervisor stops the job
                self.closed = True
            except (OSError, ValueError):   # closed: keep draining the rank
                pass

    def line(self, text: str) -> None:
        self.write(text.encode(errors="replace") + b"\n")


def _pdeathsig_fn() -> Optional[Callable[[], None]]:
    """A preexec_fn that makes the child get SIGKILL when the launcher dies (Linux only)."""
    prctl = prctl_function()
    if prctl is None:
        return None
    parent = os.getpid()

    def fn() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher already died between fork and prctl
            os._exit(1)
    return fn


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the rank's process group (its session: the rank and the processes it
    started, also once the rank itself has exited), else to the rank alone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.returncode is None:
            try:
                proc.send_signal(sig)
            except (ProcessLookupError, OSError):
                pass


def _how(rc: int) -> str:
    return f"was killed by signal {_signame(-rc)}" if rc < 0 else f"exited with code {rc}"


def _publish_death(host: str, port: int, token: str, rank: int, rc: int) -> bool:
    """Publish ``rank``'s death in the job's ncclpy store for the ranks' watchdogs
    (:func:`ncclpy.debug.deaths.publish_deaths`); bounded to about a second, best effort (a
    store of another node may be unreachable). True when published."""
    from ..debug.deaths import publish_deaths
    from ..errors import StoreError
    from ..store import TCPStore
    try:
        with TCPStore(host, port, token=token or None, timeout=1.0,
                      connect_timeout=0.5) as store:
            publish_deaths(store, [rank], _how(rc))
        return True
    except (StoreError, OSError) as e:
        log.debug("ncclpy run: could not publish rank %d's death in the store at %s:%d: %s",
                  rank, host, port, e)
        return False


def _host_store(addr: str, port: int, token: str, world: int) -> Any:
    """Start the job's store server here, its connection limit sized for ``world`` ranks."""
    from ..store import StoreServer
    from ..store.limits import StoreLimits
    try:
        return StoreServer(addr, port, token=token or None,
                           limits=StoreLimits.for_world(world)).start()
    except Exception as e:
        raise LaunchError(f"ncclpy run: could not host the job's store at {addr}:{port}: "
                          f"{type(e).__name__}: {e}") from e


def _rank_env(base: Mapping[str, str], **kw: Any) -> dict[str, str]:
    from .env import rank_env  # a colleague's module: imported when a launch happens
    env = dict(base)
    env.update(rank_env(**kw))
    return env


def launch(command: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int = 0,
           master_addr: Optional[str] = None, master_port: Optional[int] = None,
           ranks_per_gpu: Optional[int] = None, prefix: bool = True,
           grace: float = DEFAULT_GRACE, env: Optional[Mapping[str, str]] = None,
           stdout: Any = None, stderr: Any = None, mps: Optional[str] = None,
           timeout: Optional[float] = None, checked: bool = False,
           keep_going: bool = False, cpu: bool = False,
           _flags: Optional[Mapping[str, str]] = None) -> int:
    """Start ``nproc`` local ranks of ``command`` and supervise them; returns the exit code.

    ``env`` (default ``os.environ``) is the base environment of every rank.  Multi-node runs
    (``nnodes > 1``) need ``master_addr``, ``master_port`` and a shared ``NCCLPY_STORE_TOKEN``
    in ``env``; single-node runs pick a free port and a fresh random token.  On one node
    ``master_addr`` must be an address of this machine (the launcher hosts the store here); a
    ``master_port`` must lie in 1..65534 (torch's store gets ``master_port + 1``).  ``mps``
    (``"auto"``, ``"on"``, ``"off"``; None: ``NCCLPY_MPS`` in ``env``, else ``"auto"``) says whether
    to run a CUDA MPS daemon while ranks share a GPU (:mod:`ncclpy.launch.mps`).  ``timeout``
    (seconds, None: none) stops ranks still running after it (exit :data:`EXIT_TIMEOUT`);
    ``checked`` sets ``NCCLPY_CHECKED=1`` for every rank; ``keep_going``: a failed rank does not
    stop the others (see the module docstring); ``cpu`` (or ``NCCLPY_DEVICE=cpu`` in ``env``)
    runs every rank on the CPU backend (:func:`ncclpy.launch.placement.plan_cpu`: one machine,
    no GPU, no MPS).  Errors name the keyword arguments
    (``_flags``: the CLI's spellings instead).
    """
    fl = dict(_flags or {})

    def N(key: str) -> str:
        return fl.get(key, key)
    base = dict(os.environ if env is None else env)
    for name, val, lo in (("nproc", nproc, 1), ("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(val, bool) or not isinstance(val, int) or val < lo:
            raise ArgumentError(f"{N(name)}: expected an int >= {lo}, got {val!r}")
    if node_rank >= nnodes:
        raise ArgumentError(f"{N('node_rank')}: expected 0 <= {N('node_rank')} < "
                            f"{N('nnodes')}={nnodes}, got {node_rank}")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ArgumentError(f"{N('grace')}: expected seconds >= 0, got {grace!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise ArgumentError(f"{N('timeout')}: expected seconds > 0, got {timeout!r} ("
                            + (f"for no limit, leave {N('timeout')} out)" if "timeout" in fl
                               else "or None for no limit)"))
    if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool)
                                      or not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        raise ArgumentError(f"{N('ranks_per_gpu')}: expected a positive int, "
                            f"got {ranks_per_gpu!r}")
    if master_port is not None:
        check_port(master_port, N("master_port"))
    mps_mode = resolve_mode(mps, base, name=fl.get("mps", "--mps"))
    cpu_plan: Optional[Placement] = None
    if cpu or cpu_requested(base):     # before anything starts: its refusals are usage errors
        why = (fl.get("cpu", "cpu=True") if cpu
               else "NCCLPY_DEVICE=cpu in the launcher's environment")
        cpu_plan = plan_cpu(nproc, why=why, from_env=not cpu, nnodes=nnodes,
                            ranks_per_gpu=ranks_per_gpu, mps=mps_mode,
                            names={"nnodes": N("nnodes"), "ranks_per_gpu": N("ranks_per_gpu"),
                                   "mps": N("mps") if mps is not None else MPS_ENV})
    command = list(command)
    if not command:
        raise ArgumentError(f"{N('command')}: expected a program to run, got an empty command")
    if checked:
        base["NCCLPY_CHECKED"] = "1"
    check_start_limits(nproc, N("nproc"))      # before anything starts: no half-started job
    out, err = _Sink(stdout or sys.stdout), _Sink(stderr or sys.stderr)

    single = nnodes == 1
    if single:
        if master_addr:
            check_local(master_addr)
        master_addr = master_addr or "127.0.0.1"
        if master_port is None:
            master_port = free_port(master_addr)
        else:
            check_ports_free(master_addr, master_port, N("master_port"))
        token = secrets.token_hex(16)
    else:
        missing = [n for n, v in (("--master-addr", master_addr), ("--master-port", master_port))
                   if v is None]
        if missing:
            raise ArgumentError(f"{' and '.join(missing)}: a multi-node run (nnodes={nnodes}) "
                                f"needs the address and port of node 0's rank 0 on every node; "
                                f"pass the same --master-addr and --master-port to each node "
                                f"(no port is picked: the other nodes could not know it)")
        token = base.get("NCCLPY_STORE_TOKEN", "")
        if not token:
            raise LaunchError(
                f"multi-node run (nnodes={nnodes}) needs a shared store token: set the same "
                f"NCCLPY_STORE_TOKEN on every node, e.g. "
                f"export NCCLPY_STORE_TOKEN="
                f"$(python -c 'import secrets; print(secrets.token_hex(16))')")
    assert master_addr is not None and master_port is not None
    world = nnodes * nproc

    placement: Placement = cpu_plan or place(nproc, ranks_per_gpu=ranks_per_gpu,
                                             single_node=single, env=base)
    mps_setup = setup_mps(mps_mode, placement.shared, base, name="--mps")
    if mps_setup.status is not None:
        placement = with_mps(placement, mps_setup.status, mps_setup.env, mps_setup.unset)
    where = "" if single else f"node {node_rank} of {nnodes}, ranks {node_rank * nproc}-" \
                              f"{node_rank * nproc + nproc - 1} of {world}; "
    failed = True
    server = job = None
    forensics = Forensics(master_addr, master_port, token, base, err.line)
    try:
        if node_rank == 0:      # the job's store lives here, not in rank 0
            server = _host_store(master_addr, master_port, token, world)
            base[HOSTED_ENV] = "launcher"
            job = write_job(master_addr, master_port, token, world, forensics.trace_dir,
                            command)
        err.line(summary_line("ncclpy run", placement, where))
        rc = _start_and_supervise(command, base, placement, out, err, prefix, grace, master_addr,
                                  master_port, token, node_rank, nproc, world, timeout,
                                  forensics, keep_going)
        failed = rc != 0
        if failed:
            said = forensics.summary()
            if said:
                err.line(said)
        return rc
    finally:
        remove_job(job)
        if server is not None:
            server.close()
        kept = mps_setup.stop(failed=failed)   # also on errors and signals: never leave it
        if kept:
            err.line(f"ncclpy run: the run failed; MPS logs kept in {kept}")


def _start_and_supervise(command: list[str], base: Mapping[str, str], placement: Placement,
                         out: _Sink, err: _Sink, prefix: bool, grace: float, master_addr: str,
                         master_port: int, token: str, node_rank: int, nproc: int,
                         world: int, timeout: Optional[float] = None,
                         forensics: Optional[Forensics] = None, keep_going: bool = False) -> int:
    """Start the ranks with their environment and supervise them; the exit code."""
    preexec = _pdeathsig_fn()
    procs: list[subprocess.Popen] = []
    ranks = [node_rank * nproc + lr for lr in range(nproc)]
    # Handlers go in before the first rank starts: a signal that arrives while ranks are being
    # started is queued and forwarded to all of them by _supervise, never lost or fatal here.
    pending: list[int] = []
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            old[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
    watch = None
    try:
        if world > nproc:   # multi-node: the launchers watch each other through the store;
            from .nodewatch import NodeWatch   # the first beat precedes the ranks
            watch = NodeWatch(master_addr, master_port, token, node_rank, world // nproc,
                              nproc).start()
        next_poll = time.monotonic() + _START_POLL
        for lr, rank in enumerate(ranks):
            if time.monotonic() >= next_poll:   # a rank that already failed stops the start-up
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                next_poll = time.monotonic() + _START_POLL
            renv = _rank_env(base, rank=rank, world_size=world, local_rank=lr,
                             local_world_size=nproc, master_addr=master_addr,
                             master_port=master_port, token=token,
                             device=None if placement.cpu else placement.devices[lr],
                             extra=placement.envs[lr])
            renv.setdefault("PYTHONUNBUFFERED", "1")
            for name in placement.unset:      # e.g. CUDA_VISIBLE_DEVICES under ncclpy's MPS
                renv.pop(name, None)
            try:
                procs.append(subprocess.Popen(
                    command, env=renv, stdin=None if lr == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=preexec))
            except OSError as e:
                raise LaunchError(f"cannot start rank {rank}: {command[0]!r}: {e}") from e
        notify = functools.partial(_publish_death, master_addr, master_port, token)
        outcome: list[str] = []
        try:
            rc = _supervise(procs, ranks[:len(procs)], out, err, prefix, float(grace), pending,
                            timeout, notify, watch, outcome, unstarted=len(ranks) - len(procs),
                            forensics=forensics, keep_going=keep_going)
        finally:
            if watch is not None:
                watch.finish(outcome[0] if outcome else None)
                watch = None
        return rc
    except BaseException:
        if watch is not None:
            watch.finish("its launcher could not start its ranks")
        for p in procs:            # never leave ranks behind, whatever went wrong here
            _signal_group(p, signal.SIGKILL)
        for p in procs:
            p.wait()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        # what a CPU-backend rank killed mid-job left in /dev/shm (--cpu, or a rank's own
        # init(device="cpu"); a GPU job has none: one directory listing)
        from ncclpy.cpu.shm import sweep
        sweep(pids=[p.pid for p in procs if p.poll() is not None])


def _supervise(procs: list[subprocess.Popen], ranks: list[int], out: _Sink, err: _Sink,
               prefix: bool, grace: float, pending: list[int], timeout: Optional[float] = None,
               notify: Optional[Callable[[int, int], bool]] = None, watch: Any = None,
               outcome: Optional[list] = None, unstarted: int = 0,
               forensics: Any = None, keep_going: bool = False) -> int:
    """Pump output, forward queued signals, stop everyone on the first failure, at ``timeout``
    or when ``watch.failure`` (another node) is set; the exit code. ``notify(rank, rc)``
    publishes the first failure first; ``outcome`` gets a line about a failure here.
    ``forensics`` (:class:`~ncclpy.launch.forensics.Forensics`): the status table and the
    ranks' dumps on SIGUSR1, before stopping them at a failure or the timeout."""
    n = len(procs)
    readers = []
    for p, rank in zip(procs, ranks):
        pre = PREFIX_FORMAT.format(rank=rank).encode() if prefix else None
        for pipe, sink in ((p.stdout, out), (p.stderr, err)):
            t = threading.Thread(target=_pump, args=(pipe, sink, pre), daemon=True,
                                 name=f"ncclpy-run-out-{rank}")
            t.start()
            readers.append(t)
    events: "queue.Queue[tuple[int, int]]" = queue.Queue()

    def waiter(i: int) -> None:
        events.put((i, procs[i].wait()))
    for i in range(n):
        threading.Thread(target=waiter, args=(i,), daemon=True,
                         name=f"ncclpy-run-wait-{ranks[i]}").start()

    alive = set(range(n))
    codes: dict[int, int] = {}
    failure: Optional[tuple[int, int]] = None      # (index, returncode)
    interrupt: Optional[int] = None                # first signal received
    timed_out: list[int] = []                      # ranks still running at --timeout
    forwarded_to = 0
    stopped = 0
    killed = 0
    deadline: Optional[float] = None
    job_end = None if timeout is None else time.monotonic() + timeout

    remote: Optional[str] = None                   # another node failed (multi-node)
    kept: list[tuple[int, int]] = []               # failures the others ran on after
    pipe_closed = False                            # stdout's reader went away (| head)

    def decided() -> bool:   # the first event (signal, failure, timeout) decides the outcome
        return (interrupt is not None or failure is not None or bool(timed_out) or bool(remote)
                or pipe_closed)
    while alive:
        if out.closed and not decided():           # nobody reads the ranks' output: stop them
            pipe_closed = True
            for j in alive:
                _signal_group(procs[j], signal.SIGTERM)
            deadline = time.monotonic() + grace
        if watch is not None and watch.failure and not decided():
            remote, stopped = watch.failure, len(alive)
            watch.announce(remote)
            for j in alive:
                _signal_group(procs[j], signal.SIGTERM)
            deadline = time.monotonic() + grace
        while pending:
            sig = pending.pop(0)
            if sig == signal.SIGUSR1:             # a look inside: the job goes on
                if forensics is not None and not decided():
                    forensics.on_signal({ranks[j]: procs[j].pid for j in alive})
                continue
            if not decided():
                interrupt = sig
                forwarded_to = len(alive)
                if deadline is None:
                    deadline = time.monotonic() + grace
            for i in alive:
                _signal_group(procs[i], sig)
        try:
            i, rc = events.get(timeout=0.05)
        except queue.Empty:
            pass
        else:
            alive.discard(i)
            codes[i] = rc
            # the rank is gone: so are the processes it started (its group)
            _signal_group(procs[i], signal.SIGTERM if rc == 0 else signal.SIGKILL)
            if rc != 0 and keep_going and not decided():
                kept.append((i, rc))                # published; the others run on
                if alive and notify is not None:
                    notify(ranks[i], rc)
            elif rc != 0 and not decided():
                failure = (i, rc)
                stopped = len(alive)
                if alive and notify is not None:    # the store is the launcher's: also rank 0
                    notify(ranks[i], rc)
                if alive and watch is not None:
                    watch.announce(f"rank {ranks[i]} {_how(rc)}")
                if alive and forensics is not None:
                    forensics.collect(f"rank {ranks[i]} {_how(rc)}",
                                      {ranks[j]: procs[j].pid for j in alive})
                for j in alive:
                    _signal_group(procs[j], signal.SIGTERM)
                deadline = time.monotonic() + grace
        if job_end is not None and alive and not decided() and time.monotonic() >= job_end:
            timed_out = sorted(alive)
            if forensics is not None:
                forensics.collect(f"--timeout {timeout:g} s passed",
                                  {ranks[j]: procs[j].pid for j in alive})
            for j in alive:
                _signal_group(procs[j], signal.SIGTERM)
            deadline = time.monotonic() + grace
        if deadline is not None and alive and time.monotonic() >= deadline:
            killed = len(alive)
            for j in alive:
                _signal_group(procs[j], signal.SIGKILL)
            deadline = None
    for p in procs:     # whatever the outcome, no process a rank started outlives the job
        _signal_group(p, signal.SIGKILL)
    end = time.monotonic() + 2.0
    for t in readers:   # a grandchild still holding a pipe must not hang the launcher
        t.join(max(0.0, end - time.monotonic()))

    if pipe_closed:      # quiet, as a tool stopped by a closed pipe (128 + SIGPIPE)
        if outcome is not None:
            outcome.append("its output pipe was closed")
        return EXIT_CLOSED_PIPE
    if interrupt is not None:
        summary = ", ".join(
            f"rank {ranks[i]} {codes[i] if codes[i] >= 0 else _signame(-codes[i])}"
            for i in sorted(codes))
        msg = (f"ncclpy run: received {_signame(interrupt)}; forwarded it to {forwarded_to} "
               f"rank{'s' if forwarded_to != 1 else ''}")
        if killed:
            msg += f", killed {killed} still running after {grace:g} s"
        err.line(f"{msg} (exit: {summary})")
        if outcome is not None:
            outcome.append(f"its launcher received {_signame(interrupt)}")
        return 128 + int(interrupt)
    if timed_out:
        names = ", ".join(str(ranks[i]) for i in timed_out)
        many = len(timed_out) != 1
        msg = (f"ncclpy run: --timeout {timeout:g} s passed with rank{'s' if many else ''} "
               f"{names} still running; stopped {'them' if many else 'it'}")
        if killed:
            msg += f" ({killed} with SIGKILL after {grace:g} s)"
        err.line(f"{msg}; exit code {EXIT_TIMEOUT}")
        return EXIT_TIMEOUT
    if remote:
        err.line(f"ncclpy run: {remote}; stopped this node's {stopped} running rank"
                 f"{'s' if stopped != 1 else ''}" + (f" ({killed} with SIGKILL after {grace:g} s)"
                                                    if killed else "") + "; exit code 1")
        return 1
    if kept:
        i, rc = kept[0]
        ends = ", ".join(f"rank {ranks[j]} " + (_how(codes[j]) if codes[j] else "exit 0")
                         for j in sorted(codes))
        err.line(f"ncclpy run: {len(kept)} rank{'s' if len(kept) != 1 else ''} failed; "
                 f"--keep-going: the others ran to their end ({ends}); exit code of the first "
                 f"failure")
        return rc if rc > 0 else 128 + (-rc)
    if failure is not None:
        i, rc = failure
        if outcome is not None:
            outcome.append(f"rank {ranks[i]} {_how(rc)}")
        msg = f"ncclpy run: rank {ranks[i]} {_how(rc)}; "
        if stopped:
            msg += f"stopped the other {stopped} rank{'s' if stopped != 1 else ''}"
            if killed:
                msg += f" ({killed} with SIGKILL after {grace:g} s)"
        else:
            msg += "no other rank was running"
        if unstarted:
            msg += (f"; {unstarted} rank{'s were' if unstarted != 1 else ' was'} never started "
                    f"(the failure came during start-up)")
        err.line(msg)
        return rc if rc > 0 else 128 + (-rc)
    return 0
