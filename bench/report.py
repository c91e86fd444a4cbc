"""Rank 0's end of a collective's sweep: the footer, then the ``-J``, ``--csv`` and ``--plot``
files.  A file that cannot be written (ENOSPC, EACCES, EPIPE from a FIFO's gone reader...) is
one line on stderr naming the flag, the file and the error, and the run's exit status is 1: the
other ranks still meet rank 0 at the final barrier, so nobody waits out a timeout and no
traceback is printed.  Standard output is not a file here: a closed stdout pipe is the command
line's business (quiet, 141)."""
from __future__ import annotations

import errno
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Protocol, Sequence

from . import output

if TYPE_CHECKING:
    from .backends import Backend
    from .config import SweepConfig
    from .rows import Row

__all__ = ["AVERAGE_NAMES", "SweepState", "finish", "per_collective_path", "version",
           "write_or_say"]

#: nccl-tests' -a values, by name
AVERAGE_NAMES = {0: "rank0", 1: "avg", 2: "min", 3: "max"}


class SweepState(Protocol):
    """What the report reads of one collective's sweep (bench.sweep's rank state): its rows
    per series, the cases skipped, the combinations not run, -M's statistics."""

    coll: Any
    rows: Dict[str, List["Row"]]
    skipped: List[str]
    refused: List[str]
    memory: Dict[str, Any]
    bits: Any


def per_collective_path(path: str, collective: str, several: bool) -> str:
    """``results.json`` -> ``results.all_reduce.json`` when a run covers several collectives."""
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{collective}{ext}"


def version() -> str:
    """ncclpy's version, for the header and the JSON."""
    try:
        import ncclpy
        return ncclpy.__version__
    except Exception:  # pragma: no cover
        return "?"


def write_or_say(prog: str, flag: str, path: str, write: Callable[[], Any]) -> bool:
    """Run ``write`` (which writes ``path``); on OSError print ``<prog>: <flag> <path>: cannot
    write: <error>`` on stderr and return False."""
    try:
        write()
        return True
    except OSError as e:
        why = e.strerror or str(e)
        name = errno.errorcode.get(e.errno or 0)
        print(f"{prog}: {flag} {path}: cannot write: {why}" + (f" ({name})" if name else ""),
              file=sys.stderr, flush=True)
        return False


def finish(cfg: "SweepConfig", state: "SweepState", program: str, nccl_version: int,
           devices: List[Dict[str, Any]], start: str, backends: Sequence["Backend"], world: int,
           first: bool) -> int:
    """Rank 0: ratios, footer and files of one collective; 0, or 1 (wrong results, the
    bandwidth floor missed, a bits column's MISMATCH or varied runs, or an output file not
    written)."""
    prog = cfg.argv[0] if cfg.argv else "python -m bench"
    env_bw = os.environ.get("NCCL_TESTS_MIN_BW")
    min_bw = float(env_bw) if env_bw else None
    for line in output.ratio_lines(output.ratio_rows(state.rows)):
        print(line)
    all_rows = [r for rows in state.rows.values() for r in rows]
    from .bits import summary_lines
    bits_footer, bits_ok = summary_lines(all_rows)
    for line in bits_footer:            # before nccl-tests' own footer
        print(line)
    footer, ok = output.footer_lines(state.rows, program, min_bw, checked=cfg.check > 0)
    ok = ok and bits_ok
    for line in footer:
        print(line)
    several = len(cfg.collectives) > 1
    written = True
    if cfg.output_file:
        doc = _json_doc(cfg, state, program, nccl_version, devices, start, backends, world,
                        min_bw)
        path = per_collective_path(cfg.output_file, state.coll.name, several)
        box: List[str] = []
        if write_or_say(prog, "-J/--output_file", path,
                        lambda: box.append(output.write_json(path, doc))):
            print(f"# Writing JSON output to {box[0]}")
        else:
            written = False
    if cfg.csv:
        if write_or_say(prog, "--csv", cfg.csv, lambda: output.write_csv(
                cfg.csv, all_rows, collective=state.coll.name, nranks=world,
                graph=cfg.cudagraph, device=cfg.device, append=not first)):
            print(f"# Writing CSV output to {cfg.csv}")
        else:
            written = False
    if cfg.plot:
        path = per_collective_path(cfg.plot, state.coll.name, several)
        title = f"{program} on {world} rank{'s' if world != 1 else ''} ({cfg.device})"
        if write_or_say(prog, "--plot", path,
                        lambda: output.write_plot(path, state.rows, title=title)):
            print(f"# Writing plot to {path}")
        else:
            written = False
    sys.stdout.flush()
    return 0 if ok and written else 1


def _json_doc(cfg: "SweepConfig", state: "SweepState", program: str, nccl_version: int,
              devices: List[Dict[str, Any]], start: str, backends: Sequence["Backend"],
              world: int, min_bw: Any) -> Dict[str, object]:
    """The ``-J`` document: nccl-tests' config object as writeDeviceReport writes it (util.cu;
    ``devices`` is added last by :func:`bench.output.build_json`), then ncclpy's extension
    (what nccl-tests' JSON has no key for: the backends, ``-u``'s unalign, the combinations,
    the bits...)."""
    config: Dict[str, Any] = {"nthreads": 1, "ngpus": 1, "minimum_bytes": cfg.minbytes,
                              "maximum_bytes": cfg.maxbytes}
    if cfg.stepfactor > 1:
        config["step_factor"] = cfg.stepfactor
    else:
        config["step_bytes"] = cfg.stepbytes
    config.update({"warmup_iters": cfg.warmup_iters, "iterations": cfg.iters,
                   "aggregated_iterations": cfg.agg_iters, "validation": cfg.check,
                   "graph": cfg.cudagraph,
                   "blocking_collectives": "true" if cfg.blocking else "false",
                   "per_iter_timing": "true" if cfg.per_iter_timing else "false",
                   "per_iter_skip": int(cfg.per_iter_skip),
                   "parallel_init": "true" if cfg.parallel_init else "false"})
    ext: Dict[str, Any] = {
        "bench_version": version(), "collective": state.coll.name, "program": program,
        "world_size": world, "device": cfg.device, "average": AVERAGE_NAMES[cfg.average],
        "timer": cfg.timer,
        "backends": list({b.name: {"name": b.name, "label": b.label,
                                   "nccl_version": b.nccl_version()} for b in backends}.values()),
        "dtypes": list(cfg.dtypes), "ops": list(cfg.ops), "skipped": state.skipped,
        "registration": cfg.register, "cta_policy": cfg.cta_policy,
        "blocking": cfg.blocking, "run_cycles": cfg.run_cycles, "timeout": cfg.timeout,
        "stream_timeout": cfg.sync_timeout, "unalign": cfg.unalign,
        "notes": {b.label: b.note for b in backends if getattr(b, "note", "")}}
    if cfg.combos:   # one communicator each; rows carry theirs (ncclpy.results[].combination)
        ext["combinations"] = [c.to_json() for c in cfg.combos]
        ext["refused"] = list(state.refused)
    if cfg.bits and state.bits is not None:
        from ncclpy.order.cli import basis
        ext["bits"] = {"basis": basis(backends[0].bits_version()),
                       "reference": dict(state.bits.first_combo) or None,
                       "repeat_bits": cfg.repeat_bits,
                       "inputs": "seeded random normals (integer types: normals x 10 rounded)",
                       "summary": _bits_summary(state)}
    cpu = [b for b in backends if getattr(b, "label", "") == "ncclpy/cpu-backend"]
    if cpu:          # what ran instead of NCCL, in so many words
        ext["cpu_backend"] = {"ran": True, "nccl": False, "gpu": False, "note": cpu[0].note,
                              "models_nccl": cpu[0].models()}
    if cfg.register:
        ext["registered"] = list(getattr(backends[0], "registered_seen", [0, 0]))
    if cfg.memory_report:
        ext["memory"] = state.memory
    return output.build_json(rows_by_backend=state.rows, args=cfg.argv,
                             nccl_version=nccl_version, config=config, devices=devices,
                             start_time=start, extension=ext, min_bw=min_bw,
                             checked=cfg.check > 0, cputime=cfg.report_cputime)


def _bits_summary(state: "SweepState") -> Dict[str, int]:
    """The bits column's verdicts counted over the collective's rows."""
    docs = [r.extra["bits"] for rows in state.rows.values() for r in rows
            if isinstance(r.extra.get("bits"), dict)]
    kinds = [d["model"]["verdict"] for d in docs]
    return {"exact": kinds.count("exact"), "mismatch": kinds.count("MISMATCH"),
            "not_predicted": kinds.count("n/a"),
            "varied": sum(1 for d in docs if (d.get("repeats") or {}).get("differing"))}
