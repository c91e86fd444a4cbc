"""``ncclpy run``: start N local ranks with the rendezvous environment, torchrun-style.

* Each rank gets ``NCCLPY_*`` and torchrun's variables (``ncclpy.launch.env.rank_env``), its
  device (``NCCLPY_DEVICE``) and the NCCL variables of ``ncclpy.launch.placement``, plus
  ``PYTHONUNBUFFERED=1`` (unless set) so output arrives line by line.
* Output: every line a rank writes is prefixed ``"[rank R] "`` (R the global rank) by a reader
  thread; stdout lines go to stdout, stderr lines to stderr; a last line without a newline is
  flushed at EOF (and terminated with one when prefixed).  ``--no-prefix`` passes lines through.
* Each rank runs in its own session: a terminal Ctrl-C reaches only the launcher, which forwards
  SIGINT/SIGTERM once to every rank's process group.  Ranks still running ``grace`` seconds after
  the first forwarded signal get SIGKILL; the launcher then exits with ``128 + signum``.
* Fail-fast: when a rank exits non-zero or dies by a signal, the others get SIGTERM, then SIGKILL
  after ``grace`` seconds; the exit code is the first failure's (signal death -> 128 + signum) and
  one summary line goes to stderr.  Rank 0 gets the launcher's stdin, the others /dev/null.
* Ranks die with the launcher (``PR_SET_PDEATHSIG``, Linux) if it is killed outright.
* Ranks sharing a GPU: :mod:`ncclpy.launch.placement` sets NCCL's variables (a CTA limit above 2
  ranks per GPU) and :mod:`ncclpy.launch.mps` starts a CUDA MPS daemon for the run (``--mps``,
  ``NCCLPY_MPS``; default ``auto``), stopped when the run ends, whatever the outcome; the
  placement line says what was set.
"""
from __future__ import annotations

import argparse
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Mapping, Optional, Sequence

from ..errors import ArgumentError, LaunchError
from ._pdeath import PR_SET_PDEATHSIG, prctl_function
from .mps import MPS_MODES, MPS_ENV, resolve_mode, setup_mps
from .placement import Placement, place, summary_line, with_mps

__all__ = ["launch", "add_run_arguments", "run_from_args", "build_command", "DEFAULT_GRACE",
           "PREFIX_FORMAT"]

#: Seconds between SIGTERM and SIGKILL (small, so a failed job stops within ~5 s).
DEFAULT_GRACE = 3.0
#: How each output line is prefixed (``rank`` is the global rank).
PREFIX_FORMAT = "[rank {rank}] "
_CHUNK = 1 << 16


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _bind_family(host: str, flag: str = "--master-addr") -> int:
    """The address family to bind ``host`` with; a precise error when it does not resolve."""
    try:
        return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ArgumentError(f"{flag} {host!r}: cannot resolve this host name "
                            f"({getattr(e, 'strerror', None) or e})") from None


def _check_local(host: str) -> None:
    """On one node rank 0 hosts the store here, so ``host`` must be an address of this machine."""
    fam = _bind_family(host)
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        raise ArgumentError(
            f"--master-addr {host}: not an address of this machine ({e.strerror or e}); with "
            f"--nnodes 1 rank 0 runs here and hosts the store, so leave --master-addr out "
            f"(127.0.0.1) or give one of this machine's addresses") from None


def _free_port(host: str) -> int:
    """A free port P on ``host`` (a local address) with P+1 free too (torch's store gets
    ``MASTER_PORT`` = P+1)."""
    fam = _bind_family(host)
    port = 0
    try:
        for _ in range(50):
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port >= 65535:
                continue
            try:
                with socket.socket(fam, socket.SOCK_STREAM) as s2:
                    s2.bind((host, port + 1))
                return port
            except OSError:
                continue
    except OSError as e:
        raise LaunchError(f"cannot pick a free port on {host} ({e.strerror or e}); pass "
                          f"--master-port") from None
    return port


def _check_port(port: Any) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65534:
        raise ArgumentError(f"--master-port: expected a port in 1..65534 (ncclpy's store listens "
                            f"on P, torch's on P+1), got {port!r}")


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
            except (OSError, ValueError):   # closed or broken pipe: keep draining the rank
                pass

    def line(self, text: str) -> None:
        self.write(text.encode(errors="replace") + b"\n")


def _pump(pipe: IO[bytes], sink: _Sink, prefix: Optional[bytes]) -> None:
    """Copy a rank's pipe to ``sink`` line by line, with ``prefix`` at each line start."""
    at_start = True
    try:
        while True:
            chunk = pipe.readline(_CHUNK)
            if not chunk:
                break
            if prefix is not None:
                if at_start:
                    chunk = prefix + chunk
                at_start = chunk.endswith(b"\n")
            sink.write(chunk)
        if prefix is not None and not at_start:
            sink.write(b"\n")
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


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
    """Send ``sig`` to the rank's process group (its session), else to the rank alone."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def _rank_env(base: Mapping[str, str], **kw: Any) -> dict[str, str]:
    from .env import rank_env  # a colleague's module: imported when a launch happens
    env = dict(base)
    env.update(rank_env(**kw))
    return env


def launch(command: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int = 0,
           master_addr: Optional[str] = None, master_port: Optional[int] = None,
           ranks_per_gpu: Optional[int] = None, prefix: bool = True,
           grace: float = DEFAULT_GRACE, env: Optional[Mapping[str, str]] = None,
           stdout: Any = None, stderr: Any = None, mps: Optional[str] = None) -> int:
    """Start ``nproc`` local ranks of ``command`` and supervise them; returns the exit code.

    ``env`` (default ``os.environ``) is the base environment of every rank.  Multi-node runs
    (``nnodes > 1``) need ``master_addr``, ``master_port`` and a shared ``NCCLPY_STORE_TOKEN``
    in ``env``; single-node runs pick a free port and a fresh random token.  On one node
    ``master_addr`` must be an address of this machine (rank 0 hosts the store here); a
    ``master_port`` must lie in 1..65534 (torch's store gets ``master_port + 1``).  ``mps``
    (``"auto"``, ``"on"``, ``"off"``; None: ``NCCLPY_MPS`` in ``env``, else ``"auto"``) says whether
    to run a CUDA MPS daemon while ranks share a GPU (:mod:`ncclpy.launch.mps`).
    """
    base = dict(os.environ if env is None else env)
    for name, val, lo in (("nproc", nproc, 1), ("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(val, bool) or not isinstance(val, int) or val < lo:
            raise ArgumentError(f"{name}: expected an int >= {lo}, got {val!r}")
    if node_rank >= nnodes:
        raise ArgumentError(f"node_rank: expected 0 <= node_rank < nnodes={nnodes}, "
                            f"got {node_rank}")
    if not grace >= 0:
        raise ArgumentError(f"grace: expected seconds >= 0, got {grace!r}")
    if ranks_per_gpu is not None and (isinstance(ranks_per_gpu, bool)
                                      or not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        raise ArgumentError(f"--ranks-per-gpu: expected a positive int, got {ranks_per_gpu!r}")
    if master_port is not None:
        _check_port(master_port)
    mps_mode = resolve_mode(mps, base, name="--mps")
    command = list(command)
    if not command:
        raise ArgumentError("command: expected a program to run, got an empty command")
    out, err = _Sink(stdout or sys.stdout), _Sink(stderr or sys.stderr)

    single = nnodes == 1
    if single:
        if master_addr:
            _check_local(master_addr)
        master_addr = master_addr or "127.0.0.1"
        if master_port is None:
            master_port = _free_port(master_addr)
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

    placement: Placement = place(nproc, ranks_per_gpu=ranks_per_gpu, single_node=single, env=base)
    mps_setup = setup_mps(mps_mode, placement.shared, base, name="--mps")
    if mps_setup.status is not None:
        placement = with_mps(placement, mps_setup.status, mps_setup.env, mps_setup.unset)
    where = "" if single else f"node {node_rank} of {nnodes}, ranks {node_rank * nproc}-" \
                              f"{node_rank * nproc + nproc - 1} of {world}; "
    failed = True
    try:
        err.line(summary_line("ncclpy run", placement, where))
        rc = _start_and_supervise(command, base, placement, out, err, prefix, grace, master_addr,
                                  master_port, token, node_rank, nproc, world)
        failed = rc != 0
        return rc
    finally:
        kept = mps_setup.stop(failed=failed)   # also on errors and signals: never leave it
        if kept:
            err.line(f"ncclpy run: the run failed; MPS logs kept in {kept}")


def _start_and_supervise(command: list[str], base: Mapping[str, str], placement: Placement,
                         out: _Sink, err: _Sink, prefix: bool, grace: float, master_addr: str,
                         master_port: int, token: str, node_rank: int, nproc: int,
                         world: int) -> int:
    """Start the ranks with their environment and supervise them; the exit code."""
    preexec = _pdeathsig_fn()
    procs: list[subprocess.Popen] = []
    ranks = [node_rank * nproc + lr for lr in range(nproc)]
    # Handlers go in before the first rank starts: a signal that arrives while ranks are being
    # started is queued and forwarded to all of them by _supervise, never lost or fatal here.
    pending: list[int] = []
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        for lr, rank in enumerate(ranks):
            renv = _rank_env(base, rank=rank, world_size=world, local_rank=lr,
                             local_world_size=nproc, master_addr=master_addr,
                             master_port=master_port, token=token,
                             device=placement.devices[lr], extra=placement.envs[lr])
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
        return _supervise(procs, ranks, out, err, prefix, float(grace), pending)
    except BaseException:
        for p in procs:            # never leave ranks behind, whatever went wrong here
            _signal_group(p, signal.SIGKILL)
        for p in procs:
            p.wait()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _supervise(procs: list[subprocess.Popen], ranks: list[int], out: _Sink, err: _Sink,
               prefix: bool, grace: float, pending: list[int]) -> int:
    """Pump output, forward queued signals, stop everyone on the first failure; the exit code."""
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
    forwarded_to = 0
    stopped = 0
    killed = 0
    deadline: Optional[float] = None
    while alive:
        while pending:
            sig = pending.pop(0)
            if interrupt is None and failure is None:   # the first event decides the outcome
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
            if rc != 0 and failure is None and interrupt is None:
                failure = (i, rc)
                stopped = len(alive)
                for j in alive:
                    _signal_group(procs[j], signal.SIGTERM)
                deadline = time.monotonic() + grace
        if deadline is not None and alive and time.monotonic() >= deadline:
            killed = len(alive)
            for j in alive:
                _signal_group(procs[j], signal.SIGKILL)
            deadline = None
    end = time.monotonic() + 2.0
    for t in readers:   # a grandchild still holding a pipe must not hang the launcher
        t.join(max(0.0, end - time.monotonic()))

    def how(rc: int) -> str:
        return f"was killed by signal {_signame(-rc)}" if rc < 0 else f"exited with code {rc}"
    if interrupt is not None:
        summary = ", ".join(
            f"rank {ranks[i]} {codes[i] if codes[i] >= 0 else _signame(-codes[i])}"
            for i in sorted(codes))
        msg = (f"ncclpy run: received {_signame(interrupt)}; forwarded it to {forwarded_to} "
               f"rank{'s' if forwarded_to != 1 else ''}")
        if killed:
            msg += f", killed {killed} still running after {grace:g} s"
        err.line(f"{msg} (exit: {summary})")
        return 128 + int(interrupt)
    if failure is not None:
        i, rc = failure
        msg = f"ncclpy run: rank {ranks[i]} {how(rc)}; "
        if stopped:
            msg += f"stopped the other {stopped} rank{'s' if stopped != 1 else ''}"
            if killed:
                msg += f" ({killed} with SIGKILL after {grace:g} s)"
        else:
            msg += "no other rank was running"
        err.line(msg)
        return rc if rc > 0 else 128 + (-rc)
    return 0


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``ncclpy run``'s options to ``p`` (torchrun's names where the concept is the same)."""
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                   required=True, metavar="N", help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   metavar="K", help="this node's index, 0..M-1 (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="H",
                   help="address of the store (rank 0); default 127.0.0.1 on one node")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   metavar="P", help="port of ncclpy's store, 1..65534 (torch's store gets P+1); "
                                     "default: a free port on one node")
    p.add_argument("--ranks-per-gpu", "--ranks_per_gpu", dest="ranks_per_gpu", type=int,
                   default=None, metavar="R",
                   help="share each GPU among R ranks: N ranks use ceil(N/R) GPUs, rank r -> "
                        "GPU r mod ceil(N/R) (default: one rank per GPU while they suffice)")
    p.add_argument("--mps", choices=MPS_MODES, default=None,
                   help=f"CUDA MPS while ranks share a GPU: auto starts a daemon for the run when "
                        f"nvidia-cuda-mps-control is on PATH, on requires it, off never starts "
                        f"one (default: ${MPS_ENV}, else auto)")
    p.add_argument("--no-prefix", "--no_prefix", dest="no_prefix", action="store_true",
                   help="do not prefix output lines with '[rank R] '")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                   help=f"seconds between SIGTERM and SIGKILL when stopping ranks "
                        f"(default {DEFAULT_GRACE:g})")
    p.add_argument("-m", "--module", action="store_true",
                   help="PROGRAM is a Python module, run as 'python -m PROGRAM'")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM [ARGS...]",
                   help="the program (a *.py script runs with this Python) and its arguments")


def run_from_args(ns: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run ``ncclpy run`` from parsed arguments; usage errors exit 2 with a message."""
    try:
        command = build_command(ns.program, ns.module)
        return launch(command, ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
                      master_addr=ns.master_addr, master_port=ns.master_port,
                      ranks_per_gpu=ns.ranks_per_gpu, prefix=not ns.no_prefix, grace=ns.grace,
                      mps=getattr(ns, "mps", None))
    except (ArgumentError, LaunchError) as e:
        sys.stderr.write(f"ncclpy run: error: {e}\n")  # CLI usage error, as argparse does
        return 2
