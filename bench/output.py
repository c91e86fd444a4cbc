"""Results out: nccl-tests' text table, its JSON file format (2.19's, version 3), CSV and a plot.

The table and JSON follow nccl-tests' ``src/util.cu`` field for field (column widths, number
formatting, the "Avg bus bandwidth" footer; JSON keys in its order, booleans written as
"true"/"false" strings, ``root`` as the ``%6i`` string, NaN as "nan"), so tools that read
nccl-tests' output read ours.  What nccl-tests has no place for (several backends, ratios, every
series' rows) goes into extra row columns after the standard ones and into a top-level
``"ncclpy"`` object in the JSON; see ``bench/schema.json``.
"""
from __future__ import annotations

import csv
import datetime
import json
import math
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .periter import TEXT_COLUMNS
from .rows import Row, Side

__all__ = ["Side", "Row", "float_str", "header_lines", "table_header", "format_row",
           "footer_lines", "ratio_rows", "ratio_lines", "build_json", "write_json",
           "write_csv", "write_plot", "CSV_FIELDS", "safe_env", "JSON_VERSION",
           "PER_ITER_KEYS"]

#: nccl-tests' JSON_FILE_VERSION (src/util.cu, 2.19)
JSON_VERSION = 3
_TIME_FMT = "%Y-%m-%d %H:%M:%S"


def float_str(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: as many decimals as fit in ``width`` characters."""
    power, val = 0, 1
    while value >= val and power < 40:
        power += 1
        val *= 10
    if power < width - 2:
        return f"{value:{width}.2f}"
    if power < width - 1:
        return f"{value:{width}.1f}"
    if power < width + 1:
        return f"{value:{width}.0f}"
    if width >= 7:
        return f"{value:{width}.1e}"
    return f"{value:{width}.0e}"


def header_lines(*, program: str, backends: str, nccl_version: int, minbytes: int,
                 maxbytes: int, stepfactor: int, stepbytes: int, warmup: int, iters: int,
                 check: int, graph: int, devices: Sequence[Dict[str, object]],
                 version: str, agg_iters: int = 1, blocking: int = 0,
                 parallel_init: int = 0, notes: Sequence[str] = (), unalign: int = 0,
                 per_iter_line: str = "") -> List[str]:
    """The preamble nccl-tests prints before the table (run parameters with ``-u``'s
    ``unalign``, the ``-z``, ``-I`` (``per_iter_line``, when given) and ``-p`` lines, devices);
    ``notes``: what the figures are where they are not NCCL's (``--device cpu``), one ``# ``
    line each after the first."""
    from .nccl_tests_flags import BLOCKING_LINES
    step = f"{stepfactor}(factor)" if stepfactor > 1 else f"{stepbytes}(bytes)"
    out = [f"# ncclpy bench {version} (nccl-tests format) backend={backends} "
           f"nccl-library={nccl_version}"]
    out += [f"# {n}" for n in notes]
    out += [f"# Collective test starting: {program}",
           f"# nThread 1 nGpus 1 minBytes {minbytes} maxBytes {maxbytes} step: {step} "
           f"warmup iters: {warmup} iters: {iters} agg iters: {agg_iters} validation: {check} "
           f"graph: {graph} unalign: {unalign}"]
    if blocking:
        out.append(BLOCKING_LINES[blocking])
    if per_iter_line:
        out.append(per_iter_line)
    if parallel_init:   # ranks are processes here: they always initialise concurrently
        out.append("# Parallel Init Enabled: every rank is a process and initialises its "
                   "communicator concurrently")
    out += ["#", "# Using devices"]
    for d in devices:
        out.append(f"#  Rank {d['rank']:2d} Group {0:2d} Pid {d['pid']:6d} on "
                   f"{str(d['hostname']):>10s} device {d['device']:2d} [{d['device_hex']}] "
                   f"{d['device_info']}")
    out.append("#")
    return out


def table_header(multi: bool = False, predict: bool = False, cputime: bool = False,
                 timestamps: bool = False, bits: bool = False, width: int = 0,
                 series: str = "backend", per_iter: bool = False) -> List[str]:
    """nccl-tests' three column-header lines (a ``series`` column, ``width`` wide, when
    ``multi``: the backend, or the backend and combination; NCCL's predicted time of the
    out-of-place call, ``ncclGroupSimulateEnd``, when ``predict``; the bits column last when
    ``bits``); ``cputime`` (-C 1) heads the time columns ``cputime``, ``timestamps`` (-S 1)
    adds the ``timestamp`` column and ``per_iter`` (-I 1) each side's i_min, i_max, i_p99 and
    i_cv% after its #wrong, as nccl-tests' ``writeResultHeader`` does (util.cu)."""
    e = ("", "", "", "", "")
    t = "cputime" if cputime else "time"
    lead = "# %10s  %12s  %8s  %6s  %6s"
    i_cols = "".join("  %7s" % c[0] for c in TEXT_COLUMNS) if per_iter else ""
    i_units = "".join("  %7s" % c[2] for c in TEXT_COLUMNS) if per_iter else ""
    side = "  %7s  %6s  %6s  %6s" % (t, "algbw", "busbw", "#wrong") + i_cols
    side_units = "  %7s  %6s  %6s  %6s" % ("(us)", "(GB/s)", "(GB/s)", "") + i_units
    title = ("              out-of-place (+ per-iteration)                                "
             "in-place (+ per-iteration)" if per_iter else
             "           out-of-place                       in-place          ")
    # -S 1: util.cu's " %*s" of width 19, "timestamp" over its strftime format (one column
    # narrower than the rows' "%21s" stamps, as there); one more space where columns follow
    after = " " if (predict or multi or bits) else ""
    stamp = ((" " if bits else "") + "%19s" % "timestamp" + after) if timestamps else ""
    tail = stamp + ("  %7s" % "predict" if predict else "") + (
        f"  {series:<{width}}" if multi else "") + ("  bits (out of place)" if bits else "")
    units = ("%19s" % "%Y-%m-%d %H:%M:%S" + after if timestamps else "") + (
        "  %7s" % "(us)" if predict else "")
    return [
        "#",
        lead % e + title,
        # nccl-tests' space after the last #wrong; with the bits column, none: every column
        # after it lines up with its rows
        (lead % ("size", "count", "type", "redop", "root") + side + side
         + ("" if bits else " ") + tail).rstrip(" ") + (" " if not tail else ""),
        lead % ("(B)", "(elements)", "", "", "") + side_units + side_units + " " + units,
    ]


def _side(s: Side) -> str:
    body = "  %7s  %6s  %6s" % (float_str(s.time_us, 7), float_str(s.algbw, 6),
                                float_str(s.busbw, 6))
    body += "    N/A" if s.wrong is None else "  %6g" % s.wrong
    if s.per_iter is not None:      # -I 1: util.cu's writePerIterReport, after #wrong
        body += "".join("  %7s" % float_str(float(s.per_iter[key]), 7)
                        for _, key, _ in TEXT_COLUMNS)
    return body


def format_row(r: Row, multi: bool = False, width: int = 0) -> str:
    """One line of the table, as nccl-tests prints it (the series, ``width`` wide, appended
    when several; the bits column's text last)."""
    line = "%12d  %12d  %8s  %6s  %6s" % (r.size, r.count, r.type, r.redop, "%6i" % r.root)
    line += _side(r.oop) + _side(r.ip)
    if "timestamp" in r.extra:             # -S 1, as nccl-tests' writeTimestamp
        line += "%21s" % r.extra["timestamp"]
    if "predicted_us" in r.extra:          # None: NCCL gave no estimate
        p = r.extra["predicted_us"]
        line += "  %7s" % ("N/A" if p is None else float_str(float(p), 7))
    if multi:
        line += f"  {r.series:<{width}}"
    bits = r.extra.get("bits")
    if isinstance(bits, dict):
        line += f"  {bits['text']}"
    return line.rstrip(" ") if bits else line


def out_of_bounds(rows: Iterable[Row]) -> int:
    """nccl-tests' error count: one per timed half whose check found wrong elements."""
    return sum((r.oop.wrong or 0) > 0 for r in rows) + sum((r.ip.wrong or 0) > 0 for r in rows)


def avg_busbw(rows: Sequence[Row]) -> float:
    """Mean bus bandwidth over every half of every row (nccl-tests' "Avg bus bandwidth")."""
    vals = [s.busbw for r in rows for s in (r.oop, r.ip)]
    return sum(vals) / len(vals) if vals else 0.0


def footer_lines(rows_by_backend: Dict[str, List[Row]], program: str,
                 min_bw: Optional[float] = None, checked: bool = True
                 ) -> Tuple[List[str], bool]:
    """The footer and whether the run passed (something was measured, no wrong elements,
    bandwidth above the ``NCCL_TESTS_MIN_BW`` floor when one is given).  Never "OK" for what
    did not happen: ``-c 0`` (``checked`` False) reads "not checked", and a run in which every
    case was skipped reads "nothing measured" and fails."""
    all_rows = [r for rows in rows_by_backend.values() for r in rows]
    errors = out_of_bounds(all_rows)
    ok = errors == 0 and bool(all_rows)
    if not all_rows:
        out = ["# %-20s : nothing measured: every case was skipped (see above) FAILED"
               % "Out of bounds values"]
    elif not checked:
        out = ["# %-20s : not checked (-c 0)" % "Out of bounds values"]
    else:
        out = ["# %-20s : %d %s" % ("Out of bounds values", errors,
                                    "FAILED" if errors else "OK")]
    multi = len(rows_by_backend) > 1
    for name, rows in rows_by_backend.items():
        bw = avg_busbw(rows)
        verdict = ""
        if min_bw is not None:
            good = bw >= min_bw * 0.9
            ok = ok and good
            verdict = "OK" if good else "FAILED"
        tag = f" {name}" if multi else ""
        out.append(("# %-20s : %g %s" % ("Avg bus bandwidth", bw, verdict)).rstrip() + tag)
    out += ["#", f"# Collective test concluded: {program}", "#"]
    return out, ok


def ratio_rows(rows_by_backend: Dict[str, List[Row]]) -> List[Dict[str, object]]:
    """For each backend after the first: per (type, op, root, size), first/other ratios of
    bus bandwidth (>1: the first is faster) and of time (<1: the first is faster)."""
    names = list(rows_by_backend)
    if len(names) < 2:
        return []
    base = {(r.type, r.redop, r.root, r.size): r for r in rows_by_backend[names[0]]}
    out = []
    for other in names[1:]:
        for r in rows_by_backend[other]:
            b = base.get((r.type, r.redop, r.root, r.size))
            if b is None:
                continue
            out.append({
                "numerator": names[0], "denominator": other, "size": r.size, "type": r.type,
                "redop": r.redop, "root": r.root,
                "out_of_place_busbw": _div(b.oop.busbw, r.oop.busbw),
                "in_place_busbw": _div(b.ip.busbw, r.ip.busbw),
                "out_of_place_time": _div(b.oop.time_us, r.oop.time_us),
                "in_place_time": _div(b.ip.time_us, r.ip.time_us)})
    return out


def _div(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def memory_lines(memory: Dict[str, object]) -> List[str]:
    """-M: one comment line per backend with NCCL's memory of rank 0's communicator."""
    out = []
    for name, st in memory.items():
        if not isinstance(st, dict):
            out.append(f"# {name}: NCCL memory: not reported by this backend")
            continue
        out.append(f"# {name}: NCCL memory of rank 0's communicator (ncclCommMemStats): "
                   f"total {st['total_bytes']} B, persistent {st['persistent_bytes']} B, "
                   f"suspendable {st['suspendable_bytes']} B")
    return out


def ratio_lines(ratios: List[Dict[str, object]]) -> List[str]:
    """The ratio tables printed after the main table, one per backend pair."""
    if not ratios:
        return []
    out = []
    pairs = sorted({(x["numerator"], x["denominator"]) for x in ratios},
                   key=lambda p: [x["denominator"] for x in ratios].index(p[1]))
    for num, den in pairs:
        out += ["#", f"# Ratios {num} / {den} (busbw > 1 and time < 1: {num} is faster)",
                "# %10s  %8s  %6s  %6s  %9s  %9s  %9s  %9s" % (
                    "size", "type", "redop", "root", "oop_busbw", "ip_busbw", "oop_time",
                    "ip_time")]
        for x in ratios:
            if (x["numerator"], x["denominator"]) != (num, den):
                continue
            vals = [("%9.3f" % v if v is not None else "%9s" % "N/A") for v in (
                x["out_of_place_busbw"], x["in_place_busbw"], x["out_of_place_time"],
                x["in_place_time"])]
            out.append("%12d  %8s  %6s  %6i  %s" % (x["size"], x["type"], x["redop"],
                                                     x["root"], "  ".join(vals)))
    return out


# ---------------------------------------------------------------------------------- JSON
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|KEY|AUTH", re.I)
_ENV_PREFIXES = ("NCCL", "CUDA", "NVIDIA", "UCX", "OMPI_COMM_WORLD", "PMI_", "SLURM_",
                 "TORCH", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LD_LIBRARY_PATH",
                 "CUPY", "GLOO")
#: writePerIterReport's keys in its order (nccl-tests util.cu); ``per_process_max_times_us``
#: follows them only when several processes timed (allProcessTimes && nProcs > 1)
PER_ITER_KEYS = ("skipped_iterations", "min_us", "max_us", "avg_us", "p50_us", "p95_us",
                 "p99_us", "stdev_us", "cv_pct", "times_us")
_PER_PROCESS = "per_process_max_times_us"


def safe_env(env: Optional[Dict[str, str]] = None) -> List[str]:
    """``KEY=VALUE`` lines for the JSON ``env`` list: only variables that shape communication,
    never anything that looks like a secret (nccl-tests dumps the whole environment; we don't)."""
    env = dict(os.environ if env is None else env)
    out = []
    for k in sorted(env):
        if not k.startswith(_ENV_PREFIXES):
            continue
        out.append(f"{k}=<redacted>" if _SECRET.search(k) else f"{k}={env[k]}")
    return out


def _jnum(x: float) -> Union[float, str]:
    """A double as nccl-tests' jsonDouble writes it: a number, NaN the string "nan" (and, where
    its ``%lf`` would write a bare ``inf`` that no JSON reader takes, "inf"/"-inf")."""
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


def _jside(s: Side, cputime: bool = False) -> Dict[str, object]:
    """One side of a result, as nccl-tests' writeBenchmarkLineBody writes it; ``cputime``
    (-C 1): the time is keyed ``cpu_time``.  ``nwrong`` is a double (null: not checked)."""
    return {"cpu_time" if cputime else "time": _jnum(s.time_us), "alg_bw": _jnum(s.algbw),
            "bus_bw": _jnum(s.busbw), "nwrong": None if s.wrong is None else float(s.wrong)}


def _jper_iter(d: Dict[str, Any]) -> Dict[str, object]:
    """-I 1: one side's per-iteration report in writePerIterReport's order and types
    (``skipped_iterations`` an int, the rest doubles in microseconds)."""
    unknown = set(d) - set(PER_ITER_KEYS) - {_PER_PROCESS}
    if unknown:
        raise ValueError(f"per-iteration report: keys nccl-tests does not write: "
                         f"{sorted(unknown)} (expected {', '.join(PER_ITER_KEYS)}, "
                         f"{_PER_PROCESS})")
    out: Dict[str, object] = {"skipped_iterations": int(d["skipped_iterations"])}
    for k in PER_ITER_KEYS[1:-1]:
        out[k] = _jnum(d[k])
    out["times_us"] = [_jnum(t) for t in d["times_us"]]
    rows = d.get(_PER_PROCESS)
    if rows is not None and len(rows) > 1:
        out[_PER_PROCESS] = [[_jnum(t) for t in row] for row in rows]
    return out


def _jrecord(r: Row, cputime: bool = False) -> Dict[str, object]:
    """One ``results`` record, nccl-tests' exactly: writeBenchmarkLinePreamble's keys, each
    side (its per-iteration report right after it with -I 1), writeBenchmarkLineTerminator's
    ``actual_iterations`` and ``experiment_name`` ("": TimeTest's name)."""
    rec: Dict[str, object] = {"size": int(r.size), "count": int(r.count), "type": r.type,
                              "redop": r.redop, "root": "%6i" % r.root}
    for key, side in (("out_of_place", r.oop), ("in_place", r.ip)):
        rec[key] = _jside(side, cputime)
        if side.per_iter is not None:
            rec[f"{key}_per_iter"] = _jper_iter(side.per_iter)
    rec["actual_iterations"] = int(r.iters)
    rec["experiment_name"] = ""
    return rec


def _jseries_record(r: Row, cputime: bool = False) -> Dict[str, object]:
    """One ``ncclpy.results`` record: the ``results`` record, then the row's ``series`` and
    ``backend`` and its extras (``combination``, ``bits``, ``predicted_us``, ``timestamp``,
    ``cycle``: what the flags that add them asked for)."""
    rec = _jrecord(r, cputime)
    rec["series"] = r.series
    rec["backend"] = r.backend
    for k, v in r.extra.items():
        rec[k] = _jnum(v) if isinstance(v, float) else v
    return rec


def _jbool(b: bool) -> str:
    return "true" if b else "false"


def build_json(*, rows_by_backend: Dict[str, List[Row]], args: Sequence[str],
               nccl_version: int, config: Dict[str, object], devices: List[Dict[str, object]],
               start_time: str, extension: Dict[str, object], min_bw: Optional[float] = None,
               errors: Sequence[str] = (), checked: bool = True, cputime: bool = False
               ) -> Dict[str, object]:
    """The JSON document: nccl-tests 2.19's (``JSON_FILE_VERSION`` 3, src/util.cu) key for
    key, then the ``ncclpy`` extension.  ``results`` holds the first series' rows, what
    nccl-tests would have written for that backend (and combination); ``ncclpy.results`` holds
    every series' rows, the first included, with what nccl-tests has no place for.
    ``config`` is nccl-tests' config object without ``devices`` (added here, last, as
    writeDeviceReport does).  ``out_of_bounds`` counts every series' checks; its ``okay`` is
    "unchecked" with ``-c 0`` or when nothing was measured (never "true" for work not done).
    ``errors``: NCCL's last error text, one string as nccl-tests' writeErrors writes
    ncclGetLastError ("" when there is none)."""
    all_rows = [r for rows in rows_by_backend.values() for r in rows]
    first = next(iter(rows_by_backend.values()), [])
    bw = avg_busbw(first)
    oob = out_of_bounds(all_rows)
    ext = dict(extension)
    ext["series"] = list(rows_by_backend)
    ext["average_bus_bandwidth_by_backend"] = {k: _jnum(avg_busbw(v)) for k, v in
                                               rows_by_backend.items()}
    ext["ratios"] = ratio_rows(rows_by_backend)
    predicted = [{"backend": r.series, "size": r.size, "type": r.type, "redop": r.redop,
                  "root": r.root, "predicted_us": r.extra["predicted_us"],
                  "measured_us": _jnum(r.oop.time_us)}
                 for r in all_rows if "predicted_us" in r.extra]
    if predicted:
        ext["predicted"] = predicted
    ext["results"] = [_jseries_record(r, cputime) for r in all_rows]
    cfg = {k: v for k, v in config.items() if k != "devices"}
    cfg["devices"] = list(devices)
    return {
        "version": JSON_VERSION,
        "start_time": start_time,
        "args": list(args),
        "env": safe_env(),
        "nccl_version": int(nccl_version),
        "config": cfg,
        "results": [_jrecord(r, cputime) for r in first],
        "out_of_bounds": {"count": oob, "okay": (
            "unchecked" if not checked or not all_rows else _jbool(oob == 0))},
        "average_bus_bandwidth": {
            "bandwidth": _jnum(bw),
            "okay": "unchecked" if min_bw is None else _jbool(bw >= min_bw * 0.9)},
        "errors": list(errors) or [""],
        "end_time": now(),
        "ncclpy": ext,
    }


def now() -> str:
    """Local time in nccl-tests' JSON format (``%Y-%m-%d %H:%M:%S``)."""
    return datetime.datetime.now().strftime(_TIME_FMT)


def _finite(x: Any) -> Any:
    """``x`` with every non-finite float (anywhere, the extension included) written as
    nccl-tests writes NaN, a string: the file stays JSON that every reader takes."""
    if isinstance(x, float):
        return _jnum(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _dump(doc: Dict[str, object], f: Any) -> None:
    json.dump(_finite(doc), f, indent=1, allow_nan=False)
    f.write("\n")


def write_json(path: str, doc: Dict[str, object]) -> str:
    """Write like nccl-tests: never overwrite; an existing ``path`` becomes ``path.0``, ``.1``...
    (a device or pipe such as /dev/stdout is written as it is).  Returns the path written."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        with open(path, "w") as f:
            _dump(doc, f)
        return path
    try_path, n = path, 0
    while True:
        try:
            with open(try_path, "x") as f:
                _dump(doc, f)
            return try_path
        except FileExistsError:
            try_path = f"{path}.{n}"
            n += 1


# ---------------------------------------------------------------------------------- CSV
CSV_FIELDS = ("backend", "collective", "nranks", "size", "count", "type", "redop", "root",
              "oop_time_us", "oop_algbw_GBps", "oop_busbw_GBps", "oop_wrong",
              "ip_time_us", "ip_algbw_GBps", "ip_busbw_GBps", "ip_wrong", "iters", "graph",
              "device", "combination", "bits", "predicted_us")


def write_csv(path: str, rows: Iterable[Row], *, collective: str, nranks: int, graph: int,
              device: str, append: bool = False) -> None:
    """One header line, one line per row and backend (empty #wrong: not checked; the
    combination and bits columns empty without --algo/--proto/--repeat-bits); ``append`` adds
    rows (of another collective) under an existing header."""
    with open(path, "a" if append else "w", newline="") as f:
        w = csv.writer(f)
        if not append:
            w.writerow(CSV_FIELDS)
        for r in rows:
            w.writerow([r.backend, collective, nranks, r.size, r.count, r.type, r.redop, r.root,
                        f"{r.oop.time_us:.3f}", f"{r.oop.algbw:.6f}", f"{r.oop.busbw:.6f}",
                        "" if r.oop.wrong is None else r.oop.wrong,
                        f"{r.ip.time_us:.3f}", f"{r.ip.algbw:.6f}", f"{r.ip.busbw:.6f}",
                        "" if r.ip.wrong is None else r.ip.wrong, r.iters, graph, device,
                        r.combo, _csv_bits(r), _csv_pred(r)])


def _csv_bits(r: Row) -> str:
    b = r.extra.get("bits")
    return b["text"] if isinstance(b, dict) else ""


def _csv_pred(r: Row) -> str:
    p = r.extra.get("predicted_us")
    return "" if p is None else f"{float(p):.3f}"


# ---------------------------------------------------------------------------------- plot
def write_plot(path: str, rows_by_backend: Dict[str, List[Row]], *, title: str) -> None:
    """The ``--plot`` figure (:mod:`bench.plot`: a colour per backend, a panel per case, the
    legend outside the panels) written to ``path``."""
    from .plot import write_plot as _write
    _write(path, rows_by_backend, title=title)
