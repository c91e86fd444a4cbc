"""Shared helpers for the examples: one output format, and launching both ways the seeds do.

Output format (one line per value, parseable, also readable)::

    E3 rank=2 input=[[2.0,2.0,2.0,2.0,2.0]]
    E3 rank=2 result=[[0.0,0.0,0.0,0.0,0.0],[1.0,1.0,1.0,1.0,1.0],...]
    E2 rank=0 error="ArgumentError: recvbuf[0]: not C-contiguous: shape (5, 2) has strides ..."

``<label> rank=<r> <kind>=<json>`` where ``kind`` is ``input``, ``result`` or ``error`` and the
value is JSON (nested lists for arrays, ``null`` where a rank holds no result, a string for an
error).  ``ncclpy run`` may put a rank prefix in front of the line; :func:`parse` ignores it.
Lines starting with ``#`` are commentary for humans.

Launching: a script started by a launcher (``ncclpy run -n 4 python examples/x.py``, torchrun,
mpirun: ``NCCLPY_RANK``/``RANK``/... in the environment) runs as one rank and calls
``ncclpy.init()``; a script started plainly (``python examples/x.py``) starts its own ranks
with ``ncclpy.spawn(...)``, as the seeds do with ``torch.multiprocessing.spawn``.  Both work with
several ranks on one GPU (the launcher and spawn set what NCCL needs for that).

On a GPU the examples need an NVIDIA GPU with a working CUDA driver, CuPy and NCCL.  Without one
the script says so in one line on stderr (the reason is :func:`ncclpy.info.no_gpu_reason`'s, the
words of ``ncclpy info``), with the command that runs it on the CPU backend, and exits with
status 1 before starting any rank; under a launcher only local rank 0 prints it (the other ranks
wait for the launcher to stop them, so rank 0 ends first).

The CPU backend (:mod:`ncclpy.cpu`, no GPU needed): ``python examples/x.py --cpu`` spawns its
ranks with ``NCCLPY_DEVICE=cpu``; under a launcher the launcher decides (``ncclpy run --cpu``,
or ``NCCLPY_DEVICE=cpu`` in every rank's environment).  The sections create their arrays with
:func:`array_module` (numpy there, CuPy on a GPU) and wait with :func:`sync`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Section", "comment", "emit", "emit_input", "emit_error", "parse", "collect", "LINE_RE",
           "launched_by_launcher", "main", "load_example", "to_json", "sync", "column_views",
           "require_gpu", "EXIT_NO_GPU", "EXIT_USAGE", "QUIET_RANK_WAIT", "array_module",
           "on_cpu"]

#: ``E3 rank=2 result=[...]`` anywhere in a line (after an optional launcher prefix).
LINE_RE = re.compile(
    r"(?:^|[\s\]:|>])(?P<label>[A-Za-z][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*) "
    r"rank=(?P<rank>\d+) (?P<kind>input|result|error)=(?P<value>.*)$")

# Environment variables that say "a launcher started this process as one rank".
_LAUNCHER_VARS = ("NCCLPY_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# ... and those that give its local rank
_LOCAL_RANK_VARS = ("NCCLPY_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "MPI_LOCALRANKID", "SLURM_LOCALID")
#: exit status of an example started where no GPU can run it
EXIT_NO_GPU = 1
#: exit status of a usage error (argparse's)
EXIT_USAGE = 2


@dataclass(frozen=True)
class Section:
    """One seed example inside a script: its id, the world size the seed uses, the function
    that runs it on a communicator, and a one-line title."""

    eid: str
    world_size: int
    run: Callable[[Any], None]
    title: str


# --------------------------------------------------------------------------- printing

def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
        value = value.get()                     # CuPy -> numpy (synchronises the stream)
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value


def to_json(value: Any) -> str:
    """Compact JSON for a CuPy/numpy array or a list of them (nested lists), a number, a
    string, a dict or None."""
    return json.dumps(_plain(value), separators=(",", ":"))


def _print(label: str, rank: int, kind: str, payload: str) -> None:
    # one write of the whole line: ranks share the pipe, and print()'s separate write of the
    # newline let two ranks' lines run together on an unbuffered stdout (seen on a GPU)
    sys.stdout.write(f"{label} rank={rank} {kind}={payload}\n")
    sys.stdout.flush()


def comment(text: str) -> None:
    """Print ``# text``, a line for humans (no value for :func:`parse`), in one write as
    :func:`emit` does: spawned ranks share one stdout pipe, and ``print``'s separate write of the
    newline let another rank's line run into this one."""
    sys.stdout.write(f"# {text}\n")
    sys.stdout.flush()


def emit(label: str, rank: int, value: Any) -> None:
    """Print this rank's result for example ``label`` (None: this rank holds no result)."""
    _print(label, rank, "result", to_json(value))


def emit_input(label: str, rank: int, value: Any) -> None:
    """Print this rank's input for example ``label`` (what the seed prints "before")."""
    _print(label, rank, "input", to_json(value))


def emit_error(label: str, rank: int, exc: BaseException) -> None:
    """Print an error ncclpy raised, as ``"<Type>: <message>"``, on one line."""
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    _print(label, rank, "error", json.dumps(msg))


def _cpu_env(env: Optional[Dict[str, str]] = None) -> bool:
    """Whether ``env`` (default os.environ) says ``NCCLPY_DEVICE=cpu`` (what ``--cpu`` and
    ``ncclpy run --cpu`` set for the ranks)."""
    env = os.environ if env is None else env
    return env.get("NCCLPY_DEVICE", "").strip().lower() == "cpu"


def on_cpu() -> bool:
    """Whether this process runs on the CPU backend: it is installed here, or the environment
    says it will be (``NCCLPY_DEVICE=cpu``)."""
    import ncclpy.cpu
    return ncclpy.cpu.installed() or _cpu_env()


def array_module() -> Any:
    """The module a section creates its arrays with: CuPy on a GPU (on the communicator's
    device: ``ncclpy.init()`` made it current), numpy on the CPU backend, whose buffers are
    host memory.  ``xp = array_module()``, then ``xp.empty(...)``, ``xp.asarray(...)``."""
    import ncclpy.cpu
    if ncclpy.cpu.installed():
        return np
    import cupy
    return cupy


def sync() -> None:
    """Wait for everything queued on this rank's device (all streams): the GPU's, or the CPU
    backend's streams."""
    import ncclpy.cpu
    if ncclpy.cpu.installed():
        ncclpy.cpu.synchronize()
        return
    import cupy
    cupy.cuda.Device().synchronize()


def column_views(a: Any, width: int) -> List[Any]:
    """``a``'s column blocks of ``width`` columns, as views (``torch.split(a, width, dim=1)``).

    Column views of a C-order array are strided: the wrong thing to hand a raw-buffer collective,
    which the column examples do on purpose to show ncclpy's error.  Numpy and CuPy alike."""
    return [a[:, width * i:width * (i + 1)] for i in range(a.shape[1] // width)]


# --------------------------------------------------------------------------- parsing

def parse(text: str) -> List[Tuple[str, int, str, Any]]:
    """Every ``(label, rank, kind, value)`` printed in ``text``, in order."""
    out = []
    for line in text.splitlines():
        m = LINE_RE.search(line.rstrip("\r"))
        if m:
            out.append((m["label"], int(m["rank"]), m["kind"], json.loads(m["value"])))
    return out


def collect(text: str, kind: str = "result") -> Dict[Tuple[str, int], Any]:
    """``{(label, rank): value}`` for one kind; a label printed twice by one rank is an error."""
    found: Dict[Tuple[str, int], Any] = {}
    for label, rank, k, value in parse(text):
        if k != kind:
            continue
        if (label, rank) in found:
            raise ValueError(f"{label} rank={rank} {kind} printed twice")
        found[(label, rank)] = value
    return found


# --------------------------------------------------------------------------- launching

def launched_by_launcher(env: Optional[Dict[str, str]] = None) -> bool:
    """True when a launcher (ncclpy run, torchrun, mpirun) started this process as one rank."""
    env = os.environ if env is None else env
    return any(v in env for v in _LAUNCHER_VARS)


def load_example(path: str):
    """Import an example script by path (its names start with digits, so not by ``import``)."""
    here = os.path.dirname(os.path.abspath(path))
    if here not in sys.path:
        sys.path.insert(0, here)
    name = "ncclpy_example_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _select(sections: Sequence[Section], only: Optional[Iterable[str]]) -> List[Section]:
    if not only:
        return list(sections)
    wanted = {s.strip().upper() for s in only if s.strip()}
    known = {s.eid.upper() for s in sections}
    unknown = wanted - known
    if unknown:
        raise SystemExit(f"--only: unknown id(s) {', '.join(sorted(unknown))}; this script has "
                         f"{', '.join(s.eid for s in sections)}")
    return [s for s in sections if s.eid.upper() in wanted]


def run_rank(sections: Sequence[Section], script: str) -> None:
    """Run, in this process (one rank), every section written for this world size."""
    import ncclpy

    # rank, world size and device come from the environment the launcher or spawn set
    # (NCCLPY_DEVICE=cpu: the CPU backend); on a GPU init() also makes the communicator's GPU
    # CuPy's current device.  Leaving the with-block closes the communicator (comm.close()),
    # or aborts it if a section raised.
    with ncclpy.init() as comm:
        n = comm.world_size
        for s in sections:
            if s.world_size == n:
                if comm.rank == 0:
                    comment(f"{s.eid} ({n} ranks): {s.title}")
                s.run(comm)
                sync()
        if comm.rank == 0:
            run = "ncclpy run --cpu" if on_cpu() else "ncclpy run"
            for s in sections:
                if s.world_size != n:
                    comment(f"{s.eid} skipped: the seed runs it with {s.world_size} ranks, "
                            f"this run has {n}: {run} -n {s.world_size} python {script} "
                            f"--only {s.eid}")


#: Seconds a silent rank (a launched rank other than local rank 0) waits before its no-GPU exit:
#: a launcher stops every rank when the first one fails, so a silent rank exiting first would get
#: local rank 0 stopped before it said why (seen in CI); waiting lets rank 0's exit come first.
QUIET_RANK_WAIT = 15.0


def _stop(line: str, code: int, env: Dict[str, str], quiet_wait: float) -> None:
    """Exit with ``code`` after ``line`` on stderr; under a launcher only local rank 0 says it,
    the other ranks exit after ``quiet_wait`` seconds unless the launcher stops them first (it
    does once rank 0 has exited), so the job's first failure is always the rank that said why."""
    local = next((env[v] for v in _LOCAL_RANK_VARS if env.get(v)), "0")
    if not launched_by_launcher(env) or local.strip() == "0":
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(quiet_wait)
    raise SystemExit(code)


def require_gpu(prog: str, env: Optional[Dict[str, str]] = None,
                quiet_wait: float = QUIET_RANK_WAIT, hint: str = "") -> None:
    """Exit (status :data:`EXIT_NO_GPU`) with one line on stderr when no CUDA GPU with NCCL is
    usable here (``hint``, the command that runs on the CPU backend instead, ends the line);
    nothing to check on the CPU backend (``NCCLPY_DEVICE=cpu``).  Under a launcher only local
    rank 0 prints the line (see :func:`_stop`)."""
    env = os.environ if env is None else env
    if _cpu_env(env):
        return
    from ncclpy.info import no_gpu_reason
    why = no_gpu_reason()
    if not why:
        return
    _stop(f"{prog}: needs an NVIDIA GPU with a working CUDA driver, CuPy and NCCL; here: {why}"
          + (f"; without a GPU: {hint}" if hint else ""), EXIT_NO_GPU, env, quiet_wait)


def _spawned(rank: int, path: str, ids: List[str]) -> None:
    """Body of each process ``ncclpy.spawn`` starts: load the script, run its sections."""
    mod = load_example(path)
    sections = _select(mod.SECTIONS, ids)
    run_rank(sections, os.path.relpath(path))


def main(sections: Sequence[Section], path: str, doc: Optional[str] = None,
         argv: Optional[Sequence[str]] = None) -> None:
    """Command line of every example: ``[--only E1,E2] [--cpu]``; launcher or spawn as
    described above."""
    script = os.path.relpath(path)
    sizes: List[int] = []
    for s in sections:
        if s.world_size not in sizes:
            sizes.append(s.world_size)
    table = "\n".join(f"  {s.eid:<5} {s.world_size} ranks  {s.title}" for s in sections)
    p = argparse.ArgumentParser(
        prog=f"python {script}",
        description=(doc or "").strip().splitlines()[0] if doc else None,
        epilog=f"examples in this script:\n{table}\n\nrun: python {script}  (spawns its own "
               f"ranks) or ncclpy run -n N python {script}\nwithout a GPU: python {script} "
               f"--cpu  or  ncclpy run --cpu -n {sizes[0]} python {script}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", metavar="IDS",
                   help="comma-separated example ids to run (default: all)")
    p.add_argument("--cpu", action="store_true",
                   help="run on ncclpy's CPU backend, no GPU needed: the ranks this script "
                        "spawns get NCCLPY_DEVICE=cpu (under a launcher the launcher decides: "
                        "ncclpy run --cpu)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s.strip()]
    chosen = _select(sections, only)
    if launched_by_launcher():
        env = dict(os.environ)
        n = next((env[v] for v in ("NCCLPY_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE") if v in env),
                 "N")
        if args.cpu and not on_cpu():
            _stop(f"{p.prog}: --cpu: under a launcher the launcher chooses the backend, and it "
                  f"gave this rank NCCLPY_DEVICE={env.get('NCCLPY_DEVICE', '')!r}; start the "
                  f"job with ncclpy run --cpu -n {n} python {script} (or give every rank "
                  f"NCCLPY_DEVICE=cpu)", EXIT_USAGE, env, QUIET_RANK_WAIT)
        require_gpu(p.prog, hint=f"ncclpy run --cpu -n {n} python {script}")
        run_rank(chosen, script)
        return
    if not args.cpu:
        require_gpu(p.prog, hint=f"python {script} --cpu")
    import ncclpy
    where = " on the CPU backend" if args.cpu or on_cpu() else ""
    for n in [n for n in sizes if any(s.world_size == n for s in chosen)]:
        ids = [s.eid for s in chosen if s.world_size == n]
        comment(f"ncclpy.spawn: {n} ranks{where} for {', '.join(ids)}")
        ncclpy.spawn(_spawned, nprocs=n, args=(os.path.abspath(path), ids),
                     device="cpu" if args.cpu else None)
