"""One program's run for :mod:`bench.nccl_tests_side`: the processes it leaves, its JSON, and
what it needs to start (a GPU, its libraries).

* Stopping a run stops its whole tree: the launcher's process group and every process below it
  (a launcher may start its ranks in groups of their own), then waits, bounded, until they are
  gone, so that the next run does not share the GPU with the last one's ranks.
* nccl-tests' JSON opens with the whole environment of rank 0 (util.cu's jsonOutputInit writes
  every ``envp`` entry under ``env``), and the run files are packed with the selftest's
  results: :func:`redact_json` rewrites that list with the bench's own filter
  (:func:`bench.output.safe_env`: only the variables that shape communication, secrets
  redacted) as soon as the run has ended, also when the file was cut short.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .nccl_tests_build import NotRunnable, find_cuda, nccl_library, tail
from .output import safe_env

__all__ = ["pdeathsig", "tree", "alive", "wait_gone", "stop_tree", "redact_json",
           "RANKS_WAIT_S", "gpu_reason", "library_dirs"]

#: the longest wait for a stopped run's processes to be gone
RANKS_WAIT_S = 15.0
#: between SIGTERM and SIGKILL
_TERM_S = 2.0
_ENV_KEY = re.compile(r'"env"\s*:\s*(?=\[)')


def pdeathsig() -> None:  # pragma: no cover - runs in the forked child
    """In the child before exec: a process group of its own, killed when this process dies."""
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _procs() -> List[Tuple[int, int, int, str]]:
    """(pid, parent, process group, state) of every process (Linux /proc; [] elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                text = f.read()
            rest = text[text.rfind(")") + 2:].split()   # after "pid (comm) "
            out.append((int(d), int(rest[1]), int(rest[2]), rest[0]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree(pid: int) -> List[int]:
    """The live processes below ``pid`` and in its process group (``pid`` leads one), but not
    ``pid`` itself."""
    procs = _procs()
    kids: Dict[int, List[int]] = {}
    for p, parent, _, _ in procs:
        kids.setdefault(parent, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    found |= {p for p, _, group, _ in procs if group == pid}
    live = {p for p, _, _, state in procs if state not in ("Z", "X")}
    return sorted((found & live) - {pid})


def alive(pids: List[int]) -> List[int]:
    """Those of ``pids`` that still run (a zombie has ended)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        if text[text.rfind(")") + 2:][:1] not in ("Z", "X"):
            out.append(pid)
    return out


def wait_gone(pids: List[int], seconds: float) -> List[int]:
    """Wait until none of ``pids`` runs, at most ``seconds``; those still running."""
    end = time.monotonic() + seconds
    left = alive(pids)
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = alive(left)
    return left


def _signal(pgid: int, pids: List[int], sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(proc: "subprocess.Popen[bytes]", wait_s: float = RANKS_WAIT_S) -> List[int]:
    """End ``proc`` (a launcher leading its own process group) and every process it left:
    SIGTERM, then SIGKILL ``_TERM_S`` later, to its group and to every process below it (taken
    before it dies: then they are orphans); reap it; wait at most ``wait_s`` for the rest to
    be gone.  The pids still running after that (the caller says so)."""
    pids = tree(proc.pid)
    if proc.poll() is None or pids:
        _signal(proc.pid, pids, signal.SIGTERM)
        end = time.monotonic() + _TERM_S
        while time.monotonic() < end and (proc.poll() is None or alive(pids)):
            time.sleep(0.05)
        _signal(proc.pid, pids + tree(proc.pid), signal.SIGKILL)
    proc.wait()
    return wait_gone(sorted(set(pids) | set(tree(proc.pid))), wait_s)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.redact"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _safe(entries: Any) -> List[str]:
    pairs = [str(e).split("=", 1) for e in entries if "=" in str(e)]
    return safe_env({k: v for k, v in pairs})


def _scrub_text(text: str) -> str:
    """``text`` (a JSON cut short) with its ``env`` list filtered, or cut off where that list
    begins when the list itself was cut short."""
    m = _ENV_KEY.search(text)
    if not m:
        return text
    try:
        entries, end = json.JSONDecoder().raw_decode(text, m.end())
    except ValueError:
        return text[:m.start()]
    return text[:m.end()] + json.dumps(_safe(entries)) + text[end:]


def redact_json(path: str) -> Tuple[Optional[Any], str]:
    """(the run's JSON, '') with its ``env`` rewritten in the file by
    :func:`bench.output.safe_env`; (None, why) when there is none or it does not parse (its
    environment list is scrubbed all the same)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        return None, f"no JSON ({type(e).__name__})"
    try:
        doc = json.loads(text)
    except ValueError as e:
        scrubbed = _scrub_text(text)
        if scrubbed != text:
            _write(path, scrubbed)
        return None, f"no JSON ({type(e).__name__})"
    if isinstance(doc, dict) and isinstance(doc.get("env"), list):
        safe = _safe(doc["env"])
        if safe != doc["env"]:
            doc["env"] = safe
            _write(path, json.dumps(doc, indent=1) + "\n")
    return doc, ""


_GPU_PROBE = ("from ncclpy.selftest.probe import cuda_reason\n"
              "print('GPU-REASON:' + cuda_reason())\n")


def gpu_reason(python: str, env: Mapping[str, str], timeout_s: float = 120.0) -> str:
    """'' when ``python`` (the bench's) sees a usable CUDA GPU, else why not: the selftest's
    probe (:func:`ncclpy.selftest.probe.cuda_reason`), asked in a child so that this process
    starts no CUDA."""
    try:
        r = subprocess.run([python, "-c", _GPU_PROBE], capture_output=True, text=True,
                           timeout=timeout_s, env=dict(env), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot ask {python} whether a GPU is usable: {e}"
    said = [ln[len("GPU-REASON:"):] for ln in r.stdout.splitlines()
            if ln.startswith("GPU-REASON:")]
    if r.returncode != 0 or not said:
        return (f"cannot ask {python} whether a GPU is usable (exit {r.returncode}): "
                f"{tail(r.stderr, 3) or r.stdout.strip()[-300:]}")
    return said[-1].strip()


def library_dirs(mpiexec: str, device: str, python: str, env: Mapping[str, str]
                 ) -> List[str]:
    """``LD_LIBRARY_PATH`` for programs built elsewhere (``--nccl-tests DIR`` without its
    ``build.json``): the MPI's ``lib`` beside the launcher's ``bin`` (through links), and on
    ``cuda`` the folder of the libnccl ncclpy loads (NotRunnable when it loads none) and CUDA's
    runtime folder where a toolkit is found."""
    out = []
    mpi_lib = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(mpiexec))), "lib")
    if os.path.isdir(mpi_lib):
        out.append(mpi_lib)
    if device == "cuda":
        out.append(os.path.dirname(nccl_library(python, env=env)[0]))
        try:
            out.append(find_cuda(env).lib)
        except NotRunnable:
            pass                        # then libcudart is where the loader finds it anyway
    return list(dict.fromkeys(out))
