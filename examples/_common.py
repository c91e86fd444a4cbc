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

Every example needs an NVIDIA GPU with a working CUDA driver, CuPy and NCCL.  Without one the
script says so in one line on stderr (the reason is :func:`ncclpy.info.no_gpu_reason`'s, the
words of ``ncclpy info``) and exits with status 1 before starting any rank; under a launcher only
local rank 0 prints it (the other ranks wait for the launcher to stop them, so rank 0 ends first).
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

__all__ = ["Section", "emit", "emit_input", "emit_error", "parse", "collect", "LINE_RE",
           "launched_by_launcher", "main", "load_example", "to_json", "sync", "column_views",
           "require_gpu", "EXIT_NO_GPU", "QUIET_RANK_WAIT"]

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


def sync() -> None:
    """Wait for everything queued on this rank's GPU (all streams)."""
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

    # rank, world size and device come from the environment the launcher or spawn set;
    # init() also makes the communicator's GPU CuPy's current device.  Leaving the with-block
    # closes the communicator (comm.close()), or aborts it if a section raised.
    with ncclpy.init() as comm:
        n = comm.world_size
        for s in sections:
            if s.world_size == n:
                if comm.rank == 0:
                    print(f"# {s.eid} ({n} ranks): {s.title}", flush=True)
                s.run(comm)
                sync()
        if comm.rank == 0:
            for s in sections:
                if s.world_size != n:
                    print(f"# {s.eid} skipped: the seed runs it with {s.world_size} ranks, this "
                          f"run has {n}: ncclpy run -n {s.world_size} python {script} "
                          f"--only {s.eid}", flush=True)


#: Seconds a silent rank (a launched rank other than local rank 0) waits before its no-GPU exit:
#: a launcher stops every rank when the first one fails, so a silent rank exiting first would get
#: local rank 0 stopped before it said why (seen in CI); waiting lets rank 0's exit come first.
QUIET_RANK_WAIT = 15.0


def require_gpu(prog: str, env: Optional[Dict[str, str]] = None,
                quiet_wait: float = QUIET_RANK_WAIT) -> None:
    """Exit (status :data:`EXIT_NO_GPU`) with one line on stderr when no CUDA GPU with NCCL is
    usable here; under a launcher only local rank 0 prints the line, and the other ranks exit
    after ``quiet_wait`` seconds unless the launcher stops them first (it does once rank 0 has
    exited), so the job's first failure is always the rank that said why."""
    from ncclpy.info import no_gpu_reason
    why = no_gpu_reason()
    if not why:
        return
    env = os.environ if env is None else env
    local = next((env[v] for v in _LOCAL_RANK_VARS if env.get(v)), "0")
    if not launched_by_launcher(env) or local.strip() == "0":
        print(f"{prog}: needs an NVIDIA GPU with a working CUDA driver, CuPy and NCCL; here: "
              f"{why}", file=sys.stderr, flush=True)
    else:
        time.sleep(quiet_wait)
    raise SystemExit(EXIT_NO_GPU)


def _spawned(rank: int, path: str, ids: List[str]) -> None:
    """Body of each process ``ncclpy.spawn`` starts: load the script, run its sections."""
    mod = load_example(path)
    sections = _select(mod.SECTIONS, ids)
    run_rank(sections, os.path.relpath(path))


def main(sections: Sequence[Section], path: str, doc: Optional[str] = None,
         argv: Optional[Sequence[str]] = None) -> None:
    """Command line of every example: ``[--only E1,E2]``; launcher or spawn as described above."""
    table = "\n".join(f"  {s.eid:<5} {s.world_size} ranks  {s.title}" for s in sections)
    p = argparse.ArgumentParser(
        prog=f"python {os.path.relpath(path)}",
        description=(doc or "").strip().splitlines()[0] if doc else None,
        epilog=f"examples in this script:\n{table}\n\nrun: python {os.path.relpath(path)}  "
               f"(spawns its own ranks) or ncclpy run -n N python {os.path.relpath(path)}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", metavar="IDS",
                   help="comma-separated example ids to run (default: all)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s.strip()]
    chosen = _select(sections, only)
    require_gpu(p.prog)
    if launched_by_launcher():
        run_rank(chosen, os.path.relpath(path))
        return
    import ncclpy
    sizes: List[int] = []
    for s in chosen:
        if s.world_size not in sizes:
            sizes.append(s.world_size)
    for n in sizes:
        ids = [s.eid for s in chosen if s.world_size == n]
        print(f"# ncclpy.spawn: {n} ranks for {', '.join(ids)}", flush=True)
        ncclpy.spawn(_spawned, nprocs=n, args=(os.path.abspath(path), ids))
