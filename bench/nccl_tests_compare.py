"""nccl-tests beside ncclpy's bench: reading both JSONs and outputs, the medians over rounds,
the ratios, the verdicts against the targets, the comparison's status, and the Markdown tables.
Pure: no process, no GPU.

Both programs write nccl-tests' JSON (util.cu's writer, version 3): a ``results`` list with one
record per size, ``size`` in bytes and an ``out_of_place`` object with ``time`` (µs, latency)
or, under ``-C 1``, ``cpu_time`` (µs: the host's time of issuing one call, rank 0's own; the
bandwidths stay the latency's: common.cu's BenchTime), ``alg_bw`` and ``bus_bw`` (GB/s) and
``nwrong`` (an ``in_place`` object the same); a value that is not a number is the string
``"nan"`` (util.cu's jsonDouble).  The
bench keeps its first series in ``results`` in that form (its other series and additions live
under ``ncclpy``), so one reader serves both.

Targets (issue 50), out of place, on medians over the rounds:

* bus bandwidth within 3% (``BUSBW_TOL``) at every size >= 1 MiB, eager (per call) mode;
* latency within 5% (``LAT_TOL``) at every size <= 64 KiB in graph mode (``-G``);
* eager latency at <= 64 KiB: where it differs by more than 5%, the host cost of one call
  (``-C 1``) says by how much and why (:func:`explain_eager`).

A ratio outside a band from a single round is not a verdict (one round has no spread to judge
it by): :data:`SINGLE`.  A size a target covers with no figure makes that target
``incomplete``, never ``missed``.
"""
from __future__ import annotations

import re
from statistics import median
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ncclpy.selftest.parse import finite_number as _num

__all__ = ["BUSBW_TOL", "LAT_TOL", "BIG", "SMALL", "HOST_BOUND", "MODES", "TOOLS", "SINGLE",
           "parse_results", "out_of_bounds", "medians", "compare", "explain_eager", "summarise",
           "markdown", "size_text", "ratio", "render", "size_bytes", "planned_sizes",
           "version_line", "key_line", "status_of"]

KiB, MiB = 1 << 10, 1 << 20
BUSBW_TOL = 0.03
LAT_TOL = 0.05
#: the sizes the bus bandwidth target covers (>=) and the latency targets cover (<=)
BIG, SMALL = 1 * MiB, 64 * KiB
#: a call is host-bound when issuing it takes at least this share of its time
HOST_BOUND = 0.9
#: eager: per call, the whole sweep; graph: -G, small sizes; cputime: -C 1, small sizes
MODES = ("eager", "graph", "cputime")
TOOLS = ("nccl-tests", "ncclpy")
#: a ratio on a tolerance's edge (0.97 from 9.7 / 10.0) counts as within it
_EPS = 1e-9
_VERSION = re.compile(r"# nccl-tests version (\S+) nccl-headers=(\d+) nccl-library=(\d+)")
#: the verdict of a ratio outside its band measured in fewer than 2 rounds
SINGLE = "single round: not interpretable"


def size_bytes(text: str) -> int:
    """``8``, ``64K``, ``256M``, ``1G`` in bytes (powers of 1024, as both programs read them)."""
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def planned_sizes(minbytes: str, maxbytes: str, factor: int = 2) -> List[int]:
    """The sizes a sweep ``-b minbytes -e maxbytes -f factor`` measures (common.cu's run():
    from the smallest, times the factor, while <= the largest)."""
    out, size, top = [], size_bytes(minbytes), size_bytes(maxbytes)
    while 0 < size <= top:
        out.append(size)
        size *= max(2, factor)
    return out


def parse_results(doc: Any) -> Dict[int, Dict[str, Optional[float]]]:
    """size -> {time, cpu_time, alg_bw, bus_bw, nwrong, ip_time, ip_bus_bw, ip_nwrong} from a
    JSON of nccl-tests' layout (either program's; the first record of a size wins: ``-N`` cycles
    and the bench's first series come first).  ``{}`` for anything else."""
    out: Dict[int, Dict[str, Optional[float]]] = {}
    rows = doc.get("results") if isinstance(doc, dict) else None
    for r in rows if isinstance(rows, list) else []:
        try:
            size = int(r["size"])
        except (KeyError, TypeError, ValueError):
            continue
        oop = r.get("out_of_place") if isinstance(r.get("out_of_place"), dict) else {}
        ip = r.get("in_place") if isinstance(r.get("in_place"), dict) else {}
        if size in out or not oop:
            continue
        out[size] = {"time": _num(oop.get("time")), "cpu_time": _num(oop.get("cpu_time")),
                     "alg_bw": _num(oop.get("alg_bw")), "bus_bw": _num(oop.get("bus_bw")),
                     "nwrong": _num(oop.get("nwrong")),
                     "ip_time": _num(ip.get("time", ip.get("cpu_time"))),
                     "ip_bus_bw": _num(ip.get("bus_bw")), "ip_nwrong": _num(ip.get("nwrong"))}
    return out


def out_of_bounds(doc: Any) -> Optional[int]:
    """``out_of_bounds.count`` of a JSON of nccl-tests' layout: how many results (a size, out
    of place or in place) had wrong elements on any rank (common.cu's run() sums ``errors``
    over the ranks; util.cu's writeResultFooter writes it); None where it is not there (a run
    that did not get to its footer)."""
    oob = doc.get("out_of_bounds") if isinstance(doc, dict) else None
    n = _num(oob.get("count")) if isinstance(oob, dict) else None
    return None if n is None else int(n)


def medians(rounds: Sequence[Mapping[int, Mapping[str, Optional[float]]]]
            ) -> Dict[int, Dict[str, Any]]:
    """Per size the median of each figure over the rounds that have it, with ``n`` (rounds
    counted), ``spread`` (max/min - 1 of the time, or cpu_time under -C 1: how much the program
    disagreed with itself) and ``nwrong`` summed over the rounds, out of place and in place
    (None: never checked)."""
    out: Dict[int, Dict[str, Any]] = {}
    for size in sorted({s for r in rounds for s in r}):
        rows = [r[size] for r in rounds if size in r]
        m: Dict[str, Any] = {"n": len(rows)}
        for key in ("time", "cpu_time", "alg_bw", "bus_bw", "ip_time", "ip_bus_bw"):
            vals = [v for v in (row.get(key) for row in rows) if v is not None]
            m[key] = median(vals) if vals else None
        t = [v for v in (row.get("cpu_time") if row.get("cpu_time") is not None
                         else row.get("time") for row in rows) if v]
        m["spread"] = (max(t) / min(t) - 1.0) if len(t) > 1 and min(t) > 0 else None
        wrong = [row.get(k) for row in rows for k in ("nwrong", "ip_nwrong")
                 if row.get(k) is not None]
        m["nwrong"] = sum(wrong) if wrong else None
        out[size] = m
    return out


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def explain_eager(t_nt: Optional[float], t_nc: Optional[float], c_nt: Optional[float],
                  c_nc: Optional[float]) -> Tuple[str, str]:
    """(verdict, why) for an eager latency at <= 64 KiB: ``same`` within 5%; else
    ``host cost`` when ncclpy's calls are host-bound (issuing one takes >= 90% of its time:
    the GPU waits for the host) and the host cost's difference covers >= 80% of the time's;
    ``not host cost`` otherwise; ``no figure`` when a time is missing."""
    if t_nt is None or t_nc is None or not t_nt:
        return "no figure", "a time is missing"
    d_t = t_nc - t_nt
    rel = d_t / t_nt
    if abs(rel) <= LAT_TOL + _EPS:
        return "same", f"{rel:+.1%}: within 5%"
    if c_nt is None or c_nc is None:
        return "no figure", f"{rel:+.1%} ({d_t:+.2f} us); no host cost measured (-C 1)"
    d_c = c_nc - c_nt
    bound = c_nc >= HOST_BOUND * t_nc
    how = (f"{d_t:+.2f} us ({rel:+.1%}); host cost {c_nc:.2f} us vs {c_nt:.2f} us "
           f"({d_c:+.2f} us)")
    if d_t > 0 and bound and d_c >= 0.8 * d_t:
        return "host cost", (f"{how}: host-bound (issuing is {c_nc / t_nc:.0%} of ncclpy's "
                             f"call), the extra host time covers the gap")
    if d_t > 0 and not bound:
        return "not host cost", (f"{how}: issuing is {c_nc / t_nc:.0%} of ncclpy's call, so "
                                 f"the gap is on the GPU's side")
    if d_t > 0:
        return "not host cost", f"{how}: the extra host time covers only part of the gap"
    return "not host cost", f"{how}: ncclpy is faster, which no host cost explains"


def _target(mode: str, size: int) -> str:
    if mode == "eager" and size >= BIG:
        return "busbw"
    if mode == "graph" and size <= SMALL:
        return "latency"
    if mode == "eager" and size <= SMALL:
        return "eager"
    return ""


def compare(nt: Mapping[int, Mapping[str, Any]], nc: Mapping[int, Mapping[str, Any]],
            mode: str, host: Optional[Tuple[Mapping[int, Mapping[str, Any]],
                                            Mapping[int, Mapping[str, Any]]]] = None
            ) -> List[Dict[str, Any]]:
    """One row per size of either program's medians: both times and bus bandwidths, the ratios
    ncclpy / nccl-tests, the target the size falls under and its verdict.  ``host``: the
    cputime mode's medians (nccl-tests, ncclpy) for the eager explanation."""
    rows: List[Dict[str, Any]] = []
    for size in sorted(set(nt) | set(nc)):
        a, b = nt.get(size, {}), nc.get(size, {})
        key = "cpu_time" if mode == "cputime" else "time"
        row: Dict[str, Any] = {
            "size": size, "nt_time": a.get(key), "nc_time": b.get(key),
            "nt_busbw": a.get("bus_bw"), "nc_busbw": b.get("bus_bw"),
            "time_ratio": ratio(b.get(key), a.get(key)),
            "busbw_ratio": ratio(b.get("bus_bw"), a.get("bus_bw")),
            "nt_spread": a.get("spread"), "nc_spread": b.get("spread"),
            "nt_wrong": a.get("nwrong"), "nc_wrong": b.get("nwrong"),
            "rounds": min(a.get("n", 0), b.get("n", 0)), "target": _target(mode, size)}
        verdict, why = "", ""
        if row["target"] in ("busbw", "latency"):
            busbw = row["target"] == "busbw"
            r = row["busbw_ratio" if busbw else "time_ratio"]
            tol, band = (BUSBW_TOL, "3%") if busbw else (LAT_TOL, "5%")
            verdict = "no figure" if r is None else \
                f"within {band}" if abs(r - 1) <= tol + _EPS else f"OUTSIDE {band}"
            why = "" if r is None else f"{'busbw' if busbw else 'time'} {r - 1:+.1%}"
            if verdict.startswith("OUTSIDE") and row["rounds"] < 2:
                verdict, why = SINGLE, f"{why}, outside {band}; one round has no spread"
        elif row["target"] == "eager":
            ht, hc = host if host else ({}, {})
            verdict, why = explain_eager(a.get("time"), b.get("time"),
                                         ht.get(size, {}).get("cpu_time"),
                                         hc.get(size, {}).get("cpu_time"))
            if host:
                row["nt_cpu"] = ht.get(size, {}).get("cpu_time")
                row["nc_cpu"] = hc.get(size, {}).get("cpu_time")
        row["verdict"], row["why"] = verdict, why
        rows.append(row)
    return rows


def _verdict(rows: Sequence[Mapping[str, Any]], n: int, met: int, measured: int) -> str:
    """A target's verdict over its sizes: ``n`` it covers (planned or seen), ``measured`` with
    a ratio, ``met`` within the band."""
    if not n:
        return "not measured"
    if measured < n:
        return f"incomplete ({measured} of {n} sizes measured)"
    if any(r["verdict"] == SINGLE for r in rows):
        return f"{SINGLE} ({met} of {n} sizes within)"
    return "met" if met == n else "missed"


def summarise(rows_by_mode: Mapping[str, Sequence[Mapping[str, Any]]],
              planned: Optional[Mapping[str, Sequence[int]]] = None) -> Dict[str, Any]:
    """The verdicts of one collective: per target how many sizes met it, of how many, the worst
    ratio, the fewest rounds behind a size; the eager sizes by explanation; whether both
    programs found no wrong element.  ``planned``: per mode the sizes the sweep was to measure
    (a covered size without a row counts as not measured)."""
    out: Dict[str, Any] = {}
    for name, mode, target, ok in (("busbw", "eager", "busbw", "within 3%"),
                                   ("graph_latency", "graph", "latency", "within 5%")):
        rows = [r for r in rows_by_mode.get(mode, []) if r["target"] == target]
        sizes = {r["size"] for r in rows} | {s for s in (planned or {}).get(mode, ())
                                              if _target(mode, s) == target}
        key = "busbw_ratio" if target == "busbw" else "time_ratio"
        vals = [r[key] for r in rows if r[key] is not None]
        met = sum(r["verdict"] == ok for r in rows)
        spreads = [r["nt_spread"] for r in rows if r.get("nt_spread") is not None]
        rounds = [r["rounds"] for r in rows if r[key] is not None and "rounds" in r]
        out[name] = {"sizes": len(sizes), "met": met, "measured": len(vals),
                     "worst": max(vals, key=lambda v: abs(v - 1)) if vals else None,
                     "verdict": _verdict(rows, len(sizes), met, len(vals)),
                     "rounds": min(rounds) if rounds else None,
                     # how much nccl-tests disagreed with itself over the rounds at these
                     # sizes: a miss smaller than this is within its own noise (None: fewer
                     # than 2 rounds, the spread is unknown)
                     "nt_spread": max(spreads) if spreads else None}
    eager = [r for r in rows_by_mode.get("eager", []) if r["target"] == "eager"]
    counts: Dict[str, int] = {}
    for r in eager:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    out["eager_latency"] = counts
    wrong = [r[k] for rows in rows_by_mode.values() for r in rows
             for k in ("nt_wrong", "nc_wrong") if r.get(k) is not None]
    out["wrong"] = sum(wrong) if wrong else None
    return out


def version_line(text: str) -> Optional[Dict[str, Any]]:
    """nccl-tests' ``# nccl-tests version V nccl-headers=H nccl-library=L`` (util.cu's
    writeDeviceReport), or None (then it was not nccl-tests that ran)."""
    m = _VERSION.search(text)
    return None if not m else {"version": m.group(1), "headers": int(m.group(2)),
                               "library": int(m.group(3))}


def key_line(text: str) -> str:
    """The line of a program's output that says what went wrong: a Python traceback's last
    line, else the first line that names an error or failure (nccl-tests' cause comes first,
    ``.. pid N: Test failure common.cu:...`` after it), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("$ ")
             and not ln.startswith("# bound")]
    if any(ln.startswith("Traceback") for ln in lines):
        return lines[-1][:300]
    for ln in lines:
        if re.search(r"error|failure|failed|refused|No such|not found", ln, re.I):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def status_of(runs: Sequence[Mapping[str, Any]], halt: str = "") -> Tuple[str, str]:
    """(status, reason) of the runs so far (each with ``tool``, ``error``; ``output_tail``
    where it failed): ``failed`` when the rounds were ended (``halt``, the reason) or a program
    failed at every run; ``partial`` when some runs failed; ``complete``; ``not run`` with no
    run at all."""
    failed = [r for r in runs if r["error"]]
    silent = [t for t in TOOLS if not any(r["tool"] == t and not r["error"] for r in runs)]
    status = ("failed" if halt or (silent and runs) else "partial" if failed else
              "complete" if runs else "not run")
    if halt or not failed:
        return status, halt
    first = next((r for r in failed if not silent or r["tool"] == silent[0]), failed[0])
    head = (f"{' and '.join(silent)} failed at every run" if silent else
            f"{len(failed)} of {len(runs)} runs failed")
    return status, (f"{head}; first: {first['tool']} {first['collective']} {first['mode']} "
                    f"round {first['round']}: {first['error']}"
                    + (f": {key_line(first['output_tail'])}" if first.get("output_tail")
                       else ""))


def size_text(n: int) -> str:
    """8 B, 64 KiB, 256 MiB."""
    for unit, k in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def _f(v: Optional[float], spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _bw(v: Optional[float]) -> str:
    return "-" if v is None else format(v, ".2f" if v >= 1 else ".4f")


def _cell(r: Mapping[str, Any]) -> str:
    return f"{r['verdict']}: {r['why']}" if r["verdict"] and r["why"] else r["verdict"]


def markdown(collective: str, rows_by_mode: Mapping[str, Sequence[Mapping[str, Any]]],
             heading_level: int = 4) -> str:
    """The tables of one collective, one per mode, ready for docs/performance.md."""
    h = "#" * heading_level
    out: List[str] = []
    titles = {"eager": "per call (eager), out of place: busbw within 3% at >= 1 MiB",
              "graph": "CUDA graph (-G), out of place: latency within 5% at <= 64 KiB",
              "cputime": "host cost of issuing one call (-C 1), eager, out of place"}
    for mode in MODES:
        rows = rows_by_mode.get(mode) or []
        if not rows:
            continue
        out += [f"{h} {collective}: {titles[mode]}", ""]
        if mode == "cputime":
            out += ["| size | nccl-tests cputime (us) | ncclpy cputime (us) | ratio | "
                    "difference (us) |", "|---:|---:|---:|---:|---:|"]
            for r in rows:
                d = None if r["nc_time"] is None or r["nt_time"] is None else \
                    r["nc_time"] - r["nt_time"]
                out.append(f"| {size_text(r['size'])} | {_f(r['nt_time'])} | "
                           f"{_f(r['nc_time'])} | {_f(r['time_ratio'], '.3f')} | "
                           f"{_f(d, '+.2f')} |")
        else:
            out += ["| size | nccl-tests time (us) | ncclpy time (us) | time ratio | "
                    "nccl-tests busbw (GB/s) | ncclpy busbw (GB/s) | busbw ratio | verdict |",
                    "|---:|---:|---:|---:|---:|---:|---:|---|"]
            for r in rows:
                out.append(f"| {size_text(r['size'])} | {_f(r['nt_time'])} | "
                           f"{_f(r['nc_time'])} | {_f(r['time_ratio'], '.3f')} | "
                           f"{_bw(r['nt_busbw'])} | {_bw(r['nc_busbw'])} | "
                           f"{_f(r['busbw_ratio'], '.3f')} | {_cell(r)} |")
        out.append("")
    return "\n".join(out)


def render(doc: Mapping[str, Any], version: str) -> str:
    """The Markdown of ``bench.nccl_tests_side``'s document: what ran, on what (nccl-tests
    ``version``), its flags and status, the end of the first failed run's output, the tables."""
    st = doc["setup"]
    nt = doc.get("nccl_tests") or {}
    v = nt.get("version_line") or {}
    lines = [f"### ncclpy bench beside nccl-tests {version}: {doc['date']}", "",
             f"- status: {doc['status']}" + (f" ({doc['reason']})" if doc.get("reason") else ""),
             f"- {st['nproc']} ranks on {nt.get('gpu') or st['device']}; nccl-tests "
             f"{v.get('version', '?')} (nccl-headers={v.get('headers', '?')}, nccl-library="
             f"{v.get('library', '?')}); ncclpy's NCCL "
             f"{(doc.get('versions') or {}).get('ncclpy', '?')}; placement: "
             f"{st.get('placement', '?')}; MPS: {st.get('mps', '?')}",
             f"- medians of {st['rounds_done']} round(s) (of {st['rounds_planned']}) per size"
             + ("" if st["rounds_done"] >= 2 else " (fewer than 2: the spread over the rounds "
                "is unknown, and a ratio outside its band is not a verdict)") + "; "
             f"-n {st['iters']} -w {st['warmup']}, -c {st['check']} in eager mode (0 in the "
             f"others), -G {st['graph']}; {st['order']}"
             + (f"; {st['rounds_note']}" if st.get("rounds_note") else "")]
    if nt.get("build_seconds") is not None:
        lines.append(f"- nccl-tests built here in {nt['build_seconds']:.0f} s "
                     f"({nt.get('gencode', '?')}, CUDA {nt.get('cuda_version', '?')})")
    for f in doc.get("flags") or []:
        lines.append(f"- NOT COMPARABLE: {f}")
    bad = next((r for r in doc.get("runs") or [] if r.get("output_tail")), None)
    if bad and doc["status"] != "complete":
        lines += [f"- the end of {bad['log']} ({bad['tool']} {bad['collective']} "
                  f"{bad['mode']}, round {bad['round']}):", "", "```",
                  bad["output_tail"], "```"]
    for mode, by in (doc.get("commands") or {}).items():
        for coll, c in by.items():
            lines.append(f"- {mode} {coll}: `{c['ncclpy']}` beside `{c['nccl-tests']}`")
            break
    lines.append("")
    for coll, c in (doc.get("collectives") or {}).items():
        s = c["summary"]
        parts = []
        for key, label in (("busbw", "busbw within 3% at >= 1 MiB"),
                           ("graph_latency", "graph latency within 5% at <= 64 KiB")):
            t = s[key]
            worst = "" if t["worst"] is None else f", worst ratio {t['worst']:.3f}"
            if t.get("nt_spread") is not None:
                worst += f"; nccl-tests' own spread over the rounds up to {t['nt_spread']:.1%}"
            elif t["worst"] is not None and (t.get("rounds") or 0) < 2:
                worst += "; spread unknown: a single round"
            parts.append(f"{label}: {t['verdict']} ({t['met']} of {t['sizes']} sizes{worst})")
        eager = ", ".join(f"{k} {n}" for k, n in s["eager_latency"].items()) or "-"
        parts.append(f"eager latency at <= 64 KiB: {eager}")
        parts.append(f"#wrong {'unchecked' if s['wrong'] is None else int(s['wrong'])}"
                     + (f" ({s['out_of_bounds']} results out of bounds)"
                        if s.get("out_of_bounds") else ""))
        lines += [f"{coll}: " + "; ".join(parts) + ".", ""]
        lines.append(markdown(coll, c["rows"]))
    return "\n".join(lines).rstrip() + "\n"
