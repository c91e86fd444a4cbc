"""One rank's ``ncclpy check`` session: set up torch.distributed (and ncclpy on a GPU, or on its
CPU backend with ``--backend cpu``: :mod:`.cpu_side`), prove the comparison fair, walk the
matrix, and (rank 0) print the table, the summary and the JSON.

Exit codes (the same on every rank): 0 every counted case passed; 1 a mismatch or an error, or
the comparison is unfair (torch and ncclpy on different libnccl files or versions), or ncclpy
could not start on a GPU run; 2 nothing to run, a bad ``NCCLPY_CHECK_INJECT``, a ``--json``
file that could not be written, or the ranks could not meet (torch's store: one line per
rank, :mod:`.launched`).  With ``--json -`` the JSON is the only thing on stdout and the
report goes to stderr.

What rank 0 prints (:mod:`.overview`): the header, a progress line on a terminal's stderr, the
collective x dtype matrix, the cases that did not pass with their reasons, the summary; ``-v``
adds the full table, one row per case, as the cases run.  When the reader of its output goes
away (``ncclpy check | head``) rank 0 stops the run at once, quietly, with exit status 141.

torch's side runs on one backend (gloo, or torch's ``nccl``), or with ``--torch-backend a,b``
on each of several of torch's NCCL backends (one process group each, every case through each):
every case then has one record per torch backend, and the report a matrix, a list and a
summary per backend.  The header names, per backend, the implementation torch really ran and
whether the divergence and refusal tables were validated with this torch
(:func:`ncclpy.check.divergences.tables_status`); when not, the summary says so.
"""
from __future__ import annotations

import datetime
import inspect
import os
import sys
import time
from typing import Any, Dict, List, Optional, TextIO, Tuple

from ..cli_util import EXIT_CLOSED_PIPE, silence_stdout, stdout_reader_gone
from . import cases as C
from . import divergences as D
from . import overview as O
from . import report as R
from . import torch_backends as TB
from .compare import INJECT_ENV, backend_parts, merge
from .runner import PHASES, _short, parse_inject, run_case, torch_groups

__all__ = ["worker", "spawn_entry", "OutputClosed", "Output", "VERDICT_BATCH", "BATCH_ENV",
           "verdict_batch"]

#: cases whose verdicts each rank sends rank 0 in one gather: a gather per case was a third of
#: a case's time at 2 ranks (docs/performance.md, "ncclpy check: where a case's time goes");
#: ``NCCLPY_CHECK_VERDICT_BATCH`` sets another (1: a gather per case, as before; bench.check_cost)
VERDICT_BATCH = 32
BATCH_ENV = "NCCLPY_CHECK_VERDICT_BATCH"


def verdict_batch() -> int:
    """The run's verdict batch: :data:`VERDICT_BATCH`, or ``NCCLPY_CHECK_VERDICT_BATCH`` (an int
    >= 1; anything else is ignored, with the default)."""
    text = os.environ.get(BATCH_ENV, "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else VERDICT_BATCH


class OutputClosed(Exception):
    """The reader of the report went away (EPIPE): the run stops, quietly."""


class Output:
    """Rank 0's report stream (stderr when ``--json -`` takes stdout) and its progress line."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.stream: TextIO = sys.stderr if cfg.get("json") == "-" else sys.stdout
        self.progress: Optional[O.Progress] = None

    def line(self, text: str) -> None:
        """Print one line (erasing the progress line first); OutputClosed on a closed pipe."""
        if self.progress is not None:
            self.progress.clear()
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except BrokenPipeError as e:
            raise OutputClosed(str(e)) from None

    def check_reader(self) -> None:
        """OutputClosed as soon as the reader of a piped report has gone (``| head -3``), not
        only when the next line is printed."""
        if stdout_reader_gone(self.stream):
            raise OutputClosed("the reader of the report has gone")

    def lines(self, texts: List[str]) -> None:
        for t in texts:
            self.line(t)


def _wrapped(text: str, indent: str = "    ") -> List[str]:
    import textwrap
    return textwrap.wrap(text, width=R.WIDTH, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False) or [""]


def _setup_torch(rank: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)   # reduce_scatter_tensor et al.
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
    import torch
    import torch.distributed as dist
    n, backend = cfg["world_size"], cfg["backend"]
    tmo = float(cfg.get("timeout", 300))
    timeout = datetime.timedelta(seconds=tmo)
    ctx: Dict[str, Any] = {"torch": torch, "dist": dist, "n": n, "rank": rank, "backend": backend,
                           "seed": int(cfg.get("seed", 0)), "device": "cpu", "comm": None,
                           "verbose": cfg.get("verbose", False), "timeout": tmo, "gpu_cc": None}
    header: Dict[str, Any] = {"world_size": n, "backend": backend, "torch": torch.__version__,
                              "seed": ctx["seed"], "pinned": cfg.get("pinned", []),
                              "kept": cfg.get("kept", []), "timeout_s": tmo,
                              "placement": cfg.get("placement"),
                              "window": bool(cfg.get("window"))}
    ctx["header"] = header
    if backend != "nccl":
        dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timeout)
        ctx["ctrl"] = dist.group.WORLD
        _torch_sides(ctx, [("gloo", None)])
        if backend == "cpu":          # ncclpy on its CPU backend beside torch's gloo
            from .cpu_side import setup
            setup(ctx, header, tmo)
        else:
            header["ncclpy_error"] = (cfg.get("no_gpu_reason")
                                      or "no GPU: the ncclpy column needs one")
        return ctx
    _log_env(ctx)                     # NCCL's debug log: what the exact reference reads
    ndev = torch.cuda.device_count()
    dev = int(os.environ.get("NCCLPY_DEVICE") or os.environ.get("LOCAL_RANK") or rank) % ndev
    torch.cuda.set_device(dev)
    ctx["device"] = torch.device("cuda", dev)
    ctx["gpu_cc"] = tuple(torch.cuda.get_device_capability(dev))
    names = list(cfg.get("torch_backends") or [TB.DEFAULT])
    dist.init_process_group(names[0], rank=rank, world_size=n, timeout=timeout,
                            device_id=ctx["device"])
    ctx["ctrl"] = dist.new_group(backend="gloo", timeout=timeout)
    groups: List[Tuple[str, Any]] = [(names[0], None)]
    kw = {"device_id": ctx["device"]} if "device_id" in inspect.signature(
        dist.new_group).parameters else {}
    for b in names[1:]:               # --torch-backend a,b: one group per further backend
        groups.append((b, dist.new_group(backend=b, timeout=timeout, **kw)))
    for _, g in groups:
        x = torch.ones(1, device=ctx["device"])
        dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    _torch_sides(ctx, groups)
    header["device"] = torch.cuda.get_device_name(dev)
    header["compute_capability"] = "%d.%d" % ctx["gpu_cc"]
    ok = True
    npath = nver = None
    try:
        import ncclpy
        from .._nccl.lib import get_lib
        from ..semantics.ops import format_version
        ctx["comm"] = ncclpy.init(timeout=tmo)
        npath, nver = get_lib().path, format_version(ctx["comm"].nccl_version)
        if cfg.get("window"):         # --window: a precise refusal, not a column of errors
            from .._nccl.lib import require_version
            require_version("ncclCommWindowRegister", ctx["comm"].nccl_version, npath)
            ctx["window"] = True
    except Exception as e:  # noqa: BLE001 - reported in the header; the run then fails
        ok = False
        header["ncclpy_error"] = _short(e)
    flags: List[Any] = [None] * n
    dist.all_gather_object(flags, ok, group=ctx["ctrl"])
    if not all(flags) and ctx["comm"] is not None:
        header.setdefault("ncclpy_error", "ncclpy.init failed on another rank")
        ctx["comm"] = None
    if all(flags):
        from .nccl_log import after_init
        after_init(ctx)
    from .fairness import libnccl_report
    header["libnccl"] = libnccl_report(torch.cuda.nccl.version(), npath, nver)
    env_keys = sorted(k for k in os.environ if k.startswith(("NCCL_", "TORCH_NCCL_"))
                      or k == "ENABLE_INTRA_NODE_COMM")
    header["nccl_env"] = {k: os.environ[k] for k in env_keys}
    return ctx


def _log_env(ctx: Dict[str, Any]) -> None:
    """A GPU run: NCCL's debug log into this rank's own directory (removed at the end), set
    before torch's NCCL starts (NCCL reads it once per process); what the user set is kept."""
    import tempfile
    from .nccl_log import log_env
    ctx["log_dir"] = tempfile.mkdtemp(prefix="ncclpy-check-nccl-log-")
    env, kept = log_env(os.environ, ctx["log_dir"])
    os.environ.update(env)
    ctx["header"]["nccl_log"] = {"set": [f"{k}={v}" for k, v in env.items()], "kept": kept}


def _torch_sides(ctx: Dict[str, Any], groups: List[Tuple[str, Any]]) -> None:
    """Record the run's torch backends (``ctx["torch_groups"]``) and, per backend, in the
    header: its name, the implementation torch really ran (its backend's class) and whether
    the divergence and refusal tables were validated with this torch (``torch_backends``)."""
    torch, dist = ctx["torch"], ctx["dist"]
    ctx["torch_groups"] = groups
    rows = []
    for name, g in groups:
        impl = TB.implementation(g if g is not None else dist.group.WORLD,
                                 torch.device(ctx["device"]))
        rows.append({"name": name, "implementation": impl,
                     "tables": D.tables_status(torch.__version__,
                                               C.torch_family(ctx["backend"]), impl)})
    ctx["header"]["torch_backends"] = rows


def _print_header(out: Output, cfg: Dict[str, Any], ctx: Dict[str, Any], ncases: int,
                  skipped: List[dict]) -> None:
    h = ctx["header"]
    emit = out.line
    emit(f"ncclpy check: {R.plural(h['world_size'], 'rank')}, torch {h['torch']}, backend "
         f"{h['backend']}, seed {h['seed']}, timeout {h['timeout_s']:g} s per collective")
    gloo_note = " (what gloo refuses; --list-skips gives each reason)" \
        if skipped and h["backend"] == "gloo" else ""
    emit(f"  {R.plural(ncases, 'case')}, {R.plural(len(skipped), 'combination')} "
         f"skipped{gloo_note}")
    if h.get("placement"):
        out.lines(_wrapped(f"  {h['placement']}"))
    if h["backend"] == "cpu":
        from .cpu_side import header_lines
        for ln in header_lines(h):
            out.lines(_wrapped(ln))
    from .refheader import header_lines as ref_lines
    for ln in ref_lines(h):
        out.lines(_wrapped(ln))
    for tb in h.get("torch_backends") or []:
        out.lines(_wrapped(f"  torch backend {tb['name']}: {tb['implementation']}; "
                           f"{tb['tables']['note']}"))
    if h["backend"] == "nccl":
        lib = h["libnccl"]
        emit(f"  device: {h.get('device')} (compute capability {h.get('compute_capability')})")
        out.lines(_wrapped(f"  torch libnccl:  {lib['torch_libnccl'] or '?'} "
                           f"(NCCL {lib['torch_nccl_version']}; {lib['torch_found_by']})"))
        out.lines(_wrapped(f"  ncclpy libnccl: {lib['ncclpy_libnccl'] or '?'} "
                           f"(NCCL {lib['ncclpy_nccl_version'] or '?'})"))
        out.lines(_wrapped("  same libnccl on both sides: " + (
            "yes" if lib["same"] else "NO: " + "; ".join(lib["problems"]))))
        pinned = ", ".join(h.get("pinned") or []) or "nothing"
        out.lines(_wrapped(f"  pinned for both sides: {pinned}"))
        if h.get("kept"):
            out.lines(_wrapped(f"  kept from your environment: {', '.join(h['kept'])}"))
        out.lines(_wrapped("  NCCL env: " + (
            " ".join(f"{k}={v}" for k, v in h.get("nccl_env", {}).items()) or "(none)")))
        if h.get("window"):
            from .runner import WINDOW_COLLECTIVES
            out.lines(_wrapped(f"  --window: ncclpy's {', '.join(WINDOW_COLLECTIVES)} run on "
                               f"symmetric windows (NCCL memory, ncclCommWindowRegister); "
                               f"the other cases as without it"))
    if h.get("ncclpy_error"):
        need = "did not run" if h["backend"] == "cpu" else "needs GPU"
        out.lines(_wrapped(f"  ncclpy column: {need} ({h['ncclpy_error']})"))
    if cfg.get("verbose"):
        out.lines(_wrapped("  \"==\" columns: yes only when the bytes are identical on every "
                           "rank; each side against its reference ([NCCL's order] where the "
                           "model predicts the call, else rank order), bit for bit unless the "
                           "inputs are normal or revealing ones (max ULP shows any distance)"))
        emit(R.format_header_row())
        if h["backend"] == "nccl":
            for sk in skipped:
                emit(R.format_skip_row(sk))


def _fatal(cfg: Dict[str, Any], ctx: Optional[Dict[str, Any]], rank: int, msg: str,
           rc: int) -> int:
    if rank == 0:
        sys.stderr.write(f"ncclpy check: {msg}\n")
        if cfg.get("result_file"):
            R.write_json(cfg["result_file"], {"exit_code": rc, "error": msg})
        if cfg.get("json") and cfg["json"] != "-":
            try:
                R.write_json(cfg["json"], {"exit_code": rc, "error": msg,
                                           "header": (ctx or {}).get("header")})
            except OSError as e:
                sys.stderr.write(f"ncclpy check: --json {cfg['json']}: could not write: "
                                 f"{e.strerror or e}\n")
    if ctx is not None:
        _close(ctx)
    return rc


def _close(ctx: Dict[str, Any]) -> None:
    if ctx.get("comm") is not None:
        try:
            ctx["comm"].close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    try:
        ctx["dist"].destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    if ctx.get("log_dir"):
        import shutil
        shutil.rmtree(ctx["log_dir"], ignore_errors=True)


def worker(rank: int, cfg: Dict[str, Any]) -> int:
    """Run the whole matrix as ``rank``; returns the exit code (the same on every rank)."""
    os.environ.update({k: str(v) for k, v in (cfg.get("env") or {}).items()})
    t0 = time.time()
    try:
        inject = parse_inject(os.environ.get(INJECT_ENV))
    except (ValueError, KeyError) as e:
        return _fatal(cfg, None, rank, f"bad {INJECT_ENV}: {e}", 2)
    from .launched import held_stderr
    msg: Optional[str] = None
    with held_stderr() as held:     # torch's C++ log of a failed wait: one line says it all
        try:
            ctx = _setup_torch(rank, cfg)
        except Exception as e:  # noqa: BLE001 - not meeting the peers: one line, no traceback
            msg = _rendezvous_failure(e, rank, cfg)
            if msg is None:
                raise
            held.keep = bool(cfg.get("verbose"))
    if msg is not None:
        if rank != 0:               # _fatal speaks for rank 0
            sys.stderr.write(f"ncclpy check: {msg}\n")
        return _fatal(cfg, None, rank, msg, 2)
    ctx["inject"] = inject
    h = ctx["header"]
    if any(side == "ncclpy" for _, _, side, _ in inject) and ctx.get("comm") is None:
        return _fatal(cfg, ctx, rank, f"{INJECT_ENV} corrupts the ncclpy side, but this run has "
                                      f"no ncclpy column ({h.get('ncclpy_error')})", 2)
    cases, skipped = C.build_matrix(
        ctx["n"], backend=ctx["backend"], collectives=cfg.get("collectives"),
        dtypes=cfg.get("dtypes"), ops=cfg.get("ops"), sizes=cfg.get("sizes"),
        roots=cfg.get("roots"), in_place=cfg.get("in_place"),
        premul_scalar=cfg.get("premul_scalar", C.PREMUL_SCALAR), gpu_cc=ctx.get("gpu_cc"),
        inputs=cfg.get("inputs"))
    from .refheader import describe
    h["reference"] = describe(ctx)
    if not cases:
        return _fatal(cfg, ctx, rank, f"no case to run: the filters leave nothing the "
                                      f"{ctx['backend']} backend can run on "
                                      f"{R.plural(ctx['n'], 'rank')} "
                                      f"({R.plural(len(skipped), 'combination')} skipped; see "
                                      f"--list-skips)", 2)
    if ctx["backend"] == "cpu":
        from .cpu_side import reference_only_cases
        h["reference_only_cases"] = reference_only_cases(cases)
    out = Output(cfg) if rank == 0 else None
    try:
        return _walk(rank, cfg, ctx, cases, skipped, out, t0)
    except OutputClosed:
        _output_closed(cfg)
        raise AssertionError("unreachable")  # pragma: no cover
    except KeyboardInterrupt:
        if out is not None and out.progress is not None:
            out.progress.clear()
        raise


def _rendezvous_failure(e: BaseException, rank: int, cfg: Dict[str, Any]) -> Optional[str]:
    """One line when torch could not meet the peers (:mod:`.launched`), else None."""
    from .launched import rendezvous_failure
    return rendezvous_failure(e, rank, int(cfg["world_size"]), float(cfg.get("timeout", 300)),
                              cfg.get("launched"))


def _walk(rank: int, cfg: Dict[str, Any], ctx: Dict[str, Any], cases: List[C.Case],
          skipped: List[dict], out: Optional[Output], t0: float) -> int:
    """Run every case; rank 0 reports (see the module docstring); the exit code."""
    dist, h = ctx["dist"], ctx["header"]
    verbose, quiet = bool(cfg.get("verbose")), bool(cfg.get("quiet"))
    if out is not None:
        _print_header(out, cfg, ctx, len(cases), skipped)
        out.progress = O.Progress(len(cases))
    names = [b for b, _ in torch_groups(ctx)]
    multi = len(names) > 1
    by_backend: Dict[str, List[Dict[str, Any]]] = {b: [] for b in names}
    records: List[Dict[str, Any]] = []
    failed = 0
    t_walk = time.time()
    phases = ctx.setdefault("phases", dict.fromkeys(PHASES, 0.0))
    batch = int(cfg.get("verdict_batch") or verdict_batch())   # rank 0's, for every rank
    pending: List[Dict[str, Any]] = []
    for i, case in enumerate(cases):
        pending.append(run_case(ctx, case))
        if len(pending) < batch and i + 1 < len(cases):
            continue
        t = time.perf_counter()
        parts: Optional[List[Any]] = [None] * ctx["n"] if rank == 0 else None
        dist.gather_object(pending, parts, dst=0, group=ctx["ctrl"])
        phases["sync"] += time.perf_counter() - t
        if out is not None:
            assert parts is not None and out.progress is not None
            first = i + 1 - len(pending)
            for j, c in enumerate(cases[first:i + 1]):
                for b in names:
                    rec = merge(c, backend_parts([p[j] for p in parts], b), ctx)
                    rec["torch_backend"] = b
                    records.append(rec)
                    by_backend[b].append(rec)
                    failed += O.symbol_of(rec["status"]) == "X"
                    if verbose and (not quiet or rec["status"] != "pass"):
                        out.line((f"{b}: " if multi else "") + R.format_row(rec))
                out.progress.update(first + j + 1, failed, c.collective)
            out.check_reader()
        pending = []
    walk_s = time.time() - t_walk
    rc = 0
    if out is not None:
        assert out.progress is not None
        out.progress.clear()
        counts = R.summarize(records, len(skipped))
        by_counts = {b: R.summarize(by_backend[b], len(skipped)) for b in names}
        problems = _run_problems(h, counts, bool(cfg.get("require_ncclpy")))
        rc = 1 if counts["failed"] or problems else 0
        _report(out, h, by_backend, by_counts, skipped, quiet, time.time() - t0, ctx)
        if multi:
            out.lines(_wrapped(f"ncclpy check: torch backends {', '.join(names)} each against "
                               f"ncclpy and the reference: {counts['failed']} failed in all"))
        for p in problems:
            out.lines(_wrapped(f"ncclpy check: FAILED: {p}"))
        if h.get("window"):            # what NCCL actually registered, never more
            seen = ctx.get("window_seen") or []
            h["windows_registered"] = [sum(seen), len(seen)]
            out.lines(_wrapped(
                f"--window: NCCL registered {sum(seen)} of the {len(seen)} windows on rank 0"
                + ("" if all(seen) else "; where it registered none (no symmetric support, "
                                        "e.g. ranks sharing a GPU) the regular kernels ran")))
        doc = {"header": h, "summary": counts, "by_torch_backend": by_counts, "exit_code": rc,
               "problems": problems, "compared": _compared(counts, ", ".join(names),
                                                           h["backend"]),
               "seconds": round(time.time() - t0, 3), "cases": records, "skipped": skipped,
               "timing": _timing(t_walk - t0, walk_s, len(cases), phases, batch)}
        if verbose:
            out.lines(_wrapped(_timing_line(doc["timing"])))
        if cfg.get("json"):
            try:
                R.write_json(cfg["json"], doc)
            except BrokenPipeError:
                raise OutputClosed("stdout") from None
            except OSError as e:
                sys.stderr.write(f"ncclpy check: --json {cfg['json']}: could not write the "
                                 f"results: {e.strerror or e}\n")
                rc = rc or 2
        if cfg.get("result_file"):
            R.write_json(cfg["result_file"], {"exit_code": rc, "summary": counts})
    box = [rc]
    dist.broadcast_object_list(box, src=0, group=ctx["ctrl"])
    _close(ctx)
    return int(box[0])


def _report(out: Output, h: Dict[str, Any], by_backend: Dict[str, List[Dict[str, Any]]],
            by_counts: Dict[str, Dict[str, int]], skipped: List[dict], quiet: bool,
            seconds: float, ctx: Dict[str, Any]) -> None:
    """Per torch backend: its matrix (not with -q), what did not pass and its summary; where
    the tables were not validated with this torch, the summary says so (its last line)."""
    tables = {tb["name"]: tb for tb in h.get("torch_backends") or []}
    multi = len(by_backend) > 1
    for i, (b, recs) in enumerate(by_backend.items()):
        tb = tables.get(b) or {}
        validated = bool((tb.get("tables") or {}).get("validated", True))
        if multi:
            out.lines(["", f"== torch backend {b} ({tb.get('implementation', '?')}) vs ncclpy "
                           f"and the reference =="])
        if not quiet:
            out.lines(O.matrix_lines(recs, skipped))
        out.lines(O.problem_lines(recs, skipped if i == 0 else [], ctx["backend"],
                                  validated=validated))
        cpu = h["backend"] == "cpu"
        ran = cpu and bool(by_counts[b].get("ncclpy_cases"))
        out.lines([""] + R.summary_lines(
            by_counts[b], seconds, f"cpu vs {b}" if ran else b, ctx["n"],
            h.get("ncclpy_error") or "",
            "ncclpy's CPU backend did not start" if cpu else "ncclpy needs a GPU",
            (h.get("reference") or {}).get("basis", "")))
        if ran:
            out.lines(_wrapped("  ncclpy ran on its CPU backend, not on NCCL (no GPU): these "
                               "results are the CPU engine's, bit for bit"))
        if not validated:
            out.lines(_wrapped(f"  {tb['tables']['note']}"))


def _timing(setup_s: float, walk_s: float, ncases: int, phases: Dict[str, float],
            batch: int) -> Dict[str, Any]:
    """Where rank 0's time went (the JSON's ``timing``): start-up (torch, ncclpy, the first
    communicators), the walk over the cases, and the walk's phases (:data:`PHASES`)."""
    per = 1000.0 / max(ncases, 1)
    return {"setup_s": round(setup_s, 3), "walk_s": round(walk_s, 3), "cases": ncases,
            "per_case_ms": round(walk_s * per, 3), "verdict_batch": batch,
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "phases_per_case_ms": {k: round(v * per, 3) for k, v in phases.items()}}


def _timing_line(t: Dict[str, Any]) -> str:
    """``-v``: the timing in one line."""
    parts = ", ".join(f"{k} {v:.2f}" for k, v in t["phases_per_case_ms"].items())
    return (f"time: start-up {t['setup_s']:.1f} s, {t['per_case_ms']:.2f} ms per case on rank 0 "
            f"({parts}; the rest: rank 0's report)")


def _output_closed(cfg: Dict[str, Any]) -> None:
    """The report's reader went away: tell the parent (result file), then end this rank at
    once with 141; the launcher or spawn stops the other ranks."""
    silence_stdout()
    try:
        if cfg.get("result_file"):
            R.write_json(cfg["result_file"], {"exit_code": EXIT_CLOSED_PIPE,
                                              "output_closed": True})
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CLOSED_PIPE)


def _compared(counts: Dict[str, int], backend: str, run_backend: str = "") -> str:
    """What the run compared, in words (the JSON's ``compared``)."""
    if run_backend == "cpu":
        from .cpu_side import compared
        return compared(counts)
    if counts.get("ncclpy_cases"):
        return f"ncclpy vs torch ({backend}) vs numpy reference"
    return f"torch ({backend}) vs numpy reference only; ncclpy did not run"


def _run_problems(h: Dict[str, Any], counts: Optional[Dict[str, int]] = None,
                  require_ncclpy: bool = False) -> List[str]:
    """What makes a run fail whatever the cases say: on a GPU run ncclpy not starting or a
    different libnccl; with ``--require-ncclpy``, any case ncclpy did not run."""
    out = []
    if require_ncclpy and counts is not None and counts.get("ncclpy_cases", 0) < counts["cases"]:
        out.append(f"--require-ncclpy: ncclpy ran {counts.get('ncclpy_cases', 0)} of "
                   f"{R.plural(counts['cases'], 'case')} ({h.get('ncclpy_error') or 'no GPU'})")
    if h["backend"] == "cpu":
        from .cpu_side import problems
        return out + problems(h)
    if h["backend"] != "nccl":
        return out
    if h.get("ncclpy_error"):
        out.append(f"ncclpy did not run: {h['ncclpy_error']}")
    lib = h.get("libnccl") or {}
    if not lib.get("same", False):
        out.append("torch and ncclpy do not use the same libnccl: "
                   + "; ".join(lib.get("problems") or ["unknown"]))
    return out


def spawn_entry(rank: int, cfg: Dict[str, Any]) -> None:
    """Entry point for :func:`ncclpy.spawn` / multiprocessing children (exit code via file)."""
    worker(rank, cfg)
