"""CUDA MPS for ranks that share a GPU: ``ncclpy run --mps`` / ``spawn(mps=...)`` / ``NCCLPY_MPS``.

Without MPS, kernels of different processes on one GPU are time-sliced; under MPS they run
concurrently (NVIDIA's MPS docs).  NCCL's own advice for several ranks per GPU is in
:mod:`ncclpy.launch.placement` (the CTA limit); this module only manages the daemon.

Modes (:data:`MPS_MODES`; the flag or keyword wins over ``NCCLPY_MPS``, default ``"auto"``):

* ``off``: never start a daemon.
* ``auto``: when ranks share a GPU and ``nvidia-cuda-mps-control`` is on ``PATH``, start one for
  the run; otherwise (or if it fails to start) run without, and say so.
* ``on``: as ``auto``, but a missing binary, a daemon that does not start, or a
  ``CUDA_MPS_PIPE_DIRECTORY`` with no daemon in it is an error.

A daemon ncclpy starts must serve a first CUDA client (a context on device 0, in a child process)
before the ranks start, so that an MPS server that cannot start is reported once, with its logs
kept, instead of failing every rank (``NCCLPY_MPS_CHECK=0`` skips this check).

``CUDA_MPS_PIPE_DIRECTORY`` already set means the user runs a daemon: it is used, none started.
A daemon ncclpy starts runs in the foreground (``nvidia-cuda-mps-control -f``) as its child, in
its own session (a terminal Ctrl-C does not reach it), dies with the launcher
(``PR_SET_PDEATHSIG``), and has its own ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``
under a fresh temporary directory; the ranks get those two variables.  MPS remaps the devices of
``CUDA_VISIBLE_DEVICES`` given to the daemon, and its docs say clients must not set it: the
daemon gets it and the ranks do not (their device indices stay the same).  At the end of the run
``echo quit | nvidia-cuda-mps-control`` (with those variables) stops it, then SIGTERM/SIGKILL if
it is still there; the directory is removed, or kept (and named) when the run failed.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Mapping, Optional

from ..errors import ArgumentError, LaunchError
from ._pdeath import PR_SET_PDEATHSIG, prctl_function

__all__ = ["MPS_MODES", "DEFAULT_MPS", "MPS_ENV", "MPS_CHECK_ENV", "CONTROL", "MpsDaemon",
           "MpsSetup", "resolve_mode", "setup_mps", "daemon_ready", "check_client"]

log = logging.getLogger(__name__)

MPS_MODES = ("auto", "on", "off")
DEFAULT_MPS = "auto"
#: Environment variable that chooses the mode when the flag/keyword does not.
MPS_ENV = "NCCLPY_MPS"
#: Set to 0 to skip the first-client check of a daemon ncclpy started.
MPS_CHECK_ENV = "NCCLPY_MPS_CHECK"
#: The MPS control program.
CONTROL = "nvidia-cuda-mps-control"
#: Files a running control daemon keeps in its pipe directory (the pid file is documented).
_READY_FILES = ("control", "nvidia-cuda-mps-control.pid")
READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
CLIENT_CHECK_TIMEOUT_S = 60.0

# A first MPS client, run before the ranks: creating a context makes the daemon start its MPS
# server, so a server that cannot start shows here rather than in every rank.  "nolib": no
# CUDA driver here, nothing to check (the ranks could not use a GPU either).
_CLIENT_PROBE = """
import ctypes, sys
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError:
    print("nolib"); sys.exit(0)
dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
for step, call in (("cuInit", lambda: cu.cuInit(0)),
                   ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), 0)),
                   ("cuDevicePrimaryCtxRetain",
                    lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
    rc = call()
    if rc != 0:
        print(f"{step} returned CUresult {rc}"); sys.exit(1)
cu.cuDevicePrimaryCtxRelease(dev)
print("ok")
"""


def resolve_mode(value: Optional[str], env: Optional[Mapping[str, str]] = None,
                 name: str = "mps") -> str:
    """The MPS mode: ``value`` (the flag or keyword ``name``), else ``NCCLPY_MPS`` in ``env``
    (default os.environ), else :data:`DEFAULT_MPS`; a precise ArgumentError for anything else."""
    env = os.environ if env is None else env
    if value is None:
        raw = env.get(MPS_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_MPS
        mode = raw.strip().lower()
        if mode not in MPS_MODES:
            raise ArgumentError(f"{MPS_ENV}: expected one of {', '.join(MPS_MODES)}, got {raw!r}")
        return mode
    if not isinstance(value, str) or value.strip().lower() not in MPS_MODES:
        raise ArgumentError(f"{name}: expected None or one of {', '.join(map(repr, MPS_MODES))}, "
                            f"got {value!r}")
    return value.strip().lower()


def _said(name: str, mode: str) -> str:
    """How the user wrote ``mode``: ``--mps on`` on the command line, ``mps='on'`` in Python."""
    return f"{name} {mode}" if name.startswith("-") else f"{name}={mode!r}"


def daemon_ready(pipe_dir: str) -> bool:
    """True when ``pipe_dir`` holds a control daemon's files."""
    return any(os.path.exists(os.path.join(pipe_dir, f)) for f in _READY_FILES)


def _pdeath_fn() -> Optional[Callable[[], None]]:
    prctl = prctl_function()
    if prctl is None:
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return " ".join(f.read().decode(errors="replace").split())
    except OSError:
        return ""


class MpsDaemon:
    """One MPS control daemon started by ncclpy (see the module docstring)."""

    def __init__(self, exe: str, root: str, proc: "subprocess.Popen[bytes]",
                 env: Mapping[str, str], output: IO[bytes]) -> None:
        self.exe, self.root, self.proc = exe, root, proc
        self.pipe_dir = os.path.join(root, "pipe")
        self.log_dir = os.path.join(root, "log")
        self._env = dict(env)
        self._output = output
        self._stopped = False
        self.ready = False

    @classmethod
    def start(cls, exe: str, env: Mapping[str, str],
              ready_timeout: float = READY_TIMEOUT_S) -> "MpsDaemon":
        """Start ``exe -f`` with fresh pipe/log directories; LaunchError (saying why) when it
        exits or shows no control files within ``ready_timeout`` seconds."""
        root = tempfile.mkdtemp(prefix="ncclpy-mps-")
        pipe, logs = os.path.join(root, "pipe"), os.path.join(root, "log")
        os.mkdir(pipe, 0o700)
        os.mkdir(logs, 0o700)
        denv = {**env, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
        out_path = os.path.join(logs, "ncclpy-control-output.log")
        output = open(out_path, "wb")
        try:
            proc = subprocess.Popen([exe, "-f"], env=denv, stdin=subprocess.DEVNULL,
                                    stdout=output, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_pdeath_fn())
        except OSError as e:
            output.close()
            shutil.rmtree(root, ignore_errors=True)
            raise LaunchError(f"cannot run {exe} -f: {e}") from e
        daemon = cls(exe, root, proc, denv, output)
        try:
            deadline = time.monotonic() + ready_timeout
            while not daemon_ready(pipe):
                if proc.poll() is not None:
                    tail = _tail(out_path)
                    raise LaunchError(f"{exe} -f exited with code {proc.returncode}"
                                      + (f": {tail}" if tail else " without output"))
                if time.monotonic() >= deadline:
                    raise LaunchError(f"{exe} -f created no control pipe in {pipe} within "
                                      f"{ready_timeout:g} s")
                time.sleep(0.02)
            daemon.ready = True
        except BaseException:   # a failure, or a signal while waiting: never leave it behind
            daemon.stop()
            raise
        log.info("MPS control daemon pid %d, CUDA_MPS_PIPE_DIRECTORY=%s", proc.pid, pipe)
        return daemon

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def client_env(self) -> dict[str, str]:
        """What each rank needs to reach this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def stop(self, keep_logs: bool = False, timeout: float = STOP_TIMEOUT_S) -> Optional[str]:
        """``echo quit | nvidia-cuda-mps-control``, wait, SIGTERM then SIGKILL this daemon if it is
        still there; remove the directory, or keep it and return its log directory when
        ``keep_logs``.  Idempotent; never raises."""
        if self._stopped:
            return self.log_dir if keep_logs and os.path.isdir(self.log_dir) else None
        self._stopped = True
        if self.proc.poll() is None and self.ready:
            try:
                cp = subprocess.run([self.exe], input=b"quit\n", env=self._env,
                                    capture_output=True, timeout=timeout)
                if cp.returncode != 0:
                    log.debug("MPS quit: rc %d %r", cp.returncode, cp.stderr[-300:])
            except (OSError, subprocess.SubprocessError) as e:
                log.debug("MPS quit failed: %s", e)
        if self.proc.poll() is None:   # wait for quit (not sent if it never got ready)
            steps = ((None, timeout if self.ready else 0.0), (signal.SIGTERM, 3.0),
                     (signal.SIGKILL, 5.0))
            for sig, wait_s in steps:
                if sig is not None and self.proc.poll() is None:
                    log.log(logging.WARNING if self.ready else logging.DEBUG,
                            "MPS control daemon pid %d still running: sending %s", self.pid,
                            signal.Signals(sig).name)
                    try:
                        self.proc.send_signal(sig)
                    except OSError:
                        pass
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:
            self._output.close()
        except OSError:
            pass
        if keep_logs:
            return self.log_dir
        shutil.rmtree(self.root, ignore_errors=True)
        return None


def check_client(env: Mapping[str, str],
                 timeout: float = CLIENT_CHECK_TIMEOUT_S) -> Optional[str]:
    """Run one CUDA client with ``env`` (a started daemon's client environment); None when it
    got a context (or there is no CUDA driver to ask), else what failed.  ``NCCLPY_MPS_CHECK=0``
    in ``env`` skips it (None)."""
    if str(env.get(MPS_CHECK_ENV, "1")).strip() == "0":
        return None
    try:
        cp = subprocess.run([sys.executable, "-c", _CLIENT_PROBE], env=dict(env),
                            capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"a first CUDA client did not initialise within {timeout:g} s"
    except OSError as e:
        return f"cannot run a first CUDA client: {e}"
    out = cp.stdout.strip()
    if cp.returncode == 0 and out in ("ok", "nolib"):
        return None
    detail = out or " ".join(cp.stderr.split())[-300:] or f"exit code {cp.returncode}"
    return f"a first CUDA client failed under it: {detail}"


@dataclass
class MpsSetup:
    """What :func:`setup_mps` did: ``status`` (the summary text after ``"MPS: "``; None when no
    GPU is shared), the variables for every rank, those the ranks must not inherit, and the
    daemon started (None when none was)."""

    status: Optional[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    daemon: Optional[MpsDaemon] = None

    def stop(self, failed: bool = False) -> Optional[str]:
        """Stop the daemon started, if any; with ``failed`` keep its logs and return where."""
        return self.daemon.stop(keep_logs=failed) if self.daemon is not None else None


def setup_mps(mode: str, shared: bool, env: Mapping[str, str], *, name: str = "--mps",
              starter: Callable[..., Any] = MpsDaemon.start,
              check: Callable[[Mapping[str, str]], Optional[str]] = check_client) -> MpsSetup:
    """Apply ``mode`` (see :func:`resolve_mode`) for a run whose ranks share a GPU when
    ``shared``; ``env`` is the ranks' base environment (its ``PATH`` finds the control program).
    A daemon started must serve a first client (``check``) before the ranks start.
    LaunchError with ``mode="on"`` when MPS cannot be had; the message names ``name``."""
    if mode not in MPS_MODES:
        raise ArgumentError(f"{name}: expected one of {', '.join(MPS_MODES)}, got {mode!r}")
    if not shared:
        return MpsSetup(None)
    if mode == "off":
        return MpsSetup("off")
    user_pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if user_pipe:
        if daemon_ready(user_pipe):
            return MpsSetup(f"already running (the user's CUDA_MPS_PIPE_DIRECTORY={user_pipe})")
        if mode == "on":
            raise LaunchError(f"{_said(name, 'on')}: CUDA_MPS_PIPE_DIRECTORY={user_pipe} holds "
                              f"no MPS control daemon (no {' or '.join(_READY_FILES)} there); "
                              f"start one with that directory ({CONTROL} -d) or unset "
                              f"CUDA_MPS_PIPE_DIRECTORY so that ncclpy starts one")
        return MpsSetup(f"none (the user's CUDA_MPS_PIPE_DIRECTORY={user_pipe} holds no daemon; "
                        f"none started)")
    exe = shutil.which(CONTROL, path=env.get("PATH"))
    if exe is None:
        if mode == "on":
            raise LaunchError(f"{_said(name, 'on')}: {CONTROL} is not on PATH, so ncclpy cannot "
                              f"start CUDA MPS for the ranks sharing a GPU; install the NVIDIA "
                              f"driver utilities that provide it, or pass {_said(name, 'auto')} "
                              f"or {_said(name, 'off')}")
        return MpsSetup(f"not available ({CONTROL} not on PATH)")
    unset = ("CUDA_VISIBLE_DEVICES",) if "CUDA_VISIBLE_DEVICES" in env else ()
    try:
        daemon = starter(exe, env)
        try:
            problem = check({**{k: v for k, v in env.items() if k not in unset},
                             **daemon.client_env()})
        except BaseException:
            daemon.stop()
            raise
        if problem is not None:
            kept = daemon.stop(keep_logs=True)
            raise LaunchError(f"{problem} (MPS logs kept in {kept})")
    except LaunchError as e:
        if mode == "on":
            raise LaunchError(f"{_said(name, 'on')}: cannot start CUDA MPS: {e}") from None
        log.warning("MPS: %s; running without MPS", e)
        return MpsSetup(f"failed to start ({e}); running without")
    status = f"started (CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}"
    if unset:
        status += f", daemon given CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}, ranks not"
    return MpsSetup(status + ")", daemon.client_env(), unset, daemon)
