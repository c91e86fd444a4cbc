"""The selftest's results: one :class:`StageResult` per stage, the report (``report.md``), the
summary (``summary.json``) and the block to paste into ``docs/gpu-runs.md``.

Pure formatting: everything here works on plain data, so it is tested without a GPU.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["StageResult", "RunRecord", "versions", "stage_line", "paste_block", "report_md",
           "summary_doc", "write_outputs", "exit_code", "verdict_line", "STATUSES", "PROGRAM"]

PROGRAM = "ncclpy.selftest"
#: every status a stage can end in
STATUSES = ("passed", "failed", "skipped", "did not finish", "interrupted", "not run")


@dataclass
class StageResult:
    """What one stage did.  ``counts``: pytest's (passed/failed/errors/skipped/total);
    ``figures``: what the stage measured or checked (check, bench, overhead, info)."""

    name: str
    title: str
    status: str = "not run"
    reason: str = ""
    seconds: float = 0.0
    timeout_s: float = 0.0
    commands: List[Dict[str, Any]] = field(default_factory=list)
    counts: Optional[Dict[str, Any]] = None
    figures: Dict[str, Any] = field(default_factory=dict)
    files: List[str] = field(default_factory=list)
    log_tail: str = ""
    start_s: float = 0.0            # when it started, seconds after the run did


@dataclass
class RunRecord:
    """A whole run: when, the command, the budget, the versions (from the info stage)."""

    date: str
    command: str
    budget_s: float
    stages: List[StageResult]
    elapsed_s: float = 0.0
    info: Dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False
    outdir: str = ""
    setup: Dict[str, Any] = field(default_factory=dict)   # jobs, capacity, MPS, CTA limit
    debt: Dict[str, Any] = field(default_factory=dict)    # the GPU debt after the run


def exit_code(rec: RunRecord) -> int:
    """0 only when every selected stage passed; 130 when interrupted; else 1 -- a stage whose
    tests all skipped proved nothing, so it is not a success either (:func:`verdict_line`)."""
    if rec.interrupted:
        return 130
    return 0 if rec.stages and all(s.status == "passed" for s in rec.stages) else 1


def verdict_line(rec: RunRecord) -> str:
    """The run in one line: how many stages passed, and which did not, by outcome."""
    n = len(rec.stages)
    ok = sum(s.status == "passed" for s in rec.stages)
    if n and ok == n:
        return f"[selftest] PASSED: all {n} stages passed"
    other: Dict[str, List[str]] = {}
    for s in rec.stages:
        if s.status != "passed":
            other.setdefault(s.status, []).append(s.name)
    rest = "; ".join(f"{st}{' (proves nothing)' if st in ('skipped', 'not run') else ''}: "
                     f"{', '.join(names)}" for st, names in other.items())
    head = "INTERRUPTED" if rec.interrupted else "NOT PASSED"
    return f"[selftest] {head}: {ok} of {n} stages passed; {rest or 'no stage selected'}"


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def versions(info: Dict[str, Any]) -> Dict[str, str]:
    """The versions a record names, as display strings ("?" where unknown)."""
    ni = info.get("ncclpy_info") or {}
    gpus = _get(ni, "cuda", "gpus") or []
    names = [g.get("name", "?") for g in gpus if isinstance(g, dict)]
    if names:
        same = len(set(names)) == 1
        gpu = (f"{len(names)} x {names[0]}" if same and len(names) > 1 else
               names[0] if same else ", ".join(names))
        cc = gpus[0].get("compute_capability")
        mem = gpus[0].get("memory_bytes")
        extra = [f"cc {cc}"] if cc else []
        if mem:
            extra.append(f"{mem / (1 << 30):.0f} GiB")
        gpu += f" ({', '.join(extra)})" if extra else ""
    else:
        gpu = _get(ni, "cuda", "gpus_note") or "?"
    cuda_drv = _get(ni, "cuda", "driver_str")
    driver = info.get("nvidia_driver") or "?"
    if cuda_drv:
        driver += f" (CUDA driver API {cuda_drv})"
    nccl = _get(ni, "nccl", "runtime_str") or "?"
    lib = _get(ni, "nccl", "library")
    t = ni.get("torch") or {}
    torch = str(t.get("version") or "not installed")
    if t.get("version"):
        parts = [f"CUDA {t.get('cuda') or 'none'}", f"NCCL {t.get('nccl') or '?'}"]
        if t.get("cuda_available") is False:
            parts.append("no GPU visible to torch")
        torch += f" ({', '.join(parts)})"
    mps = info.get("mps_control")
    return {
        "gpu": gpu, "driver": driver,
        "nccl": nccl + (f" ({os.path.basename(str(lib))})" if lib else ""),
        "cupy": str(_get(ni, "cupy", "version") or "?"),
        "torch": torch, "python": str(ni.get("python") or "?"),
        "ncclpy": str(ni.get("ncclpy") or "?"),
        "cuda_runtime": str(_get(ni, "cuda", "runtime_str") or "?"),
        "mps": f"nvidia-cuda-mps-control at {mps}" if mps else "not installed "
                                                               "(no nvidia-cuda-mps-control)",
    }


def _targets(n: Dict[str, Any]) -> str:
    """The nccl-tests stage's verdicts against its targets, per collective, in a few words: its
    stage passes when the comparison completed and was comparable, whatever they are."""
    parts = []
    for coll, sm in (n.get("summary") or {}).items():
        if sm:
            parts.append(f"{coll} busbw {(sm.get('busbw') or {}).get('verdict', '?')}, graph "
                         f"latency {(sm.get('graph_latency') or {}).get('verdict', '?')}")
    return "comparison completed; targets: " + ("; ".join(parts) or "none measured")


def _result(s: StageResult) -> str:
    if s.status == "passed" and s.figures.get("nccl_tests"):
        return f"passed: {_targets(s.figures['nccl_tests'])}"
    if s.status == "did not finish":
        return f"did not finish (bound {s.timeout_s:.0f} s)"
    if s.status == "not run" and s.reason:
        return f"not run: {s.reason}"
    if s.status == "failed" and s.reason:
        return f"FAILED: {s.reason}"
    return s.status.upper() if s.status == "failed" else s.status


def _count(s: StageResult, key: str) -> str:
    return str(s.counts.get(key, 0)) if s.counts else ""


def stage_line(s: StageResult) -> str:
    """One line for the console: ``gpu2: passed: 14 passed, 0 failed, ... in 130 s``."""
    text = f"{s.name}: {_result(s)}"
    if s.counts:
        c = s.counts
        text += (f": {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
                 f"{c.get('errors', 0)} errors, {c.get('skipped', 0)} skipped")
    if s.status != "not run":
        text += f" in {s.seconds:.0f} s"
    return text


def _fmt(v: Optional[float], spec: str = ".2f") -> str:
    return "?" if v is None else format(v, spec)


def _size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def _figure_lines(stages: Sequence[StageResult]) -> List[str]:
    out: List[str] = []
    for s in stages:
        for key in sorted(k for k in s.figures if k.startswith("check_n")):
            c = s.figures[key]
            sm = c.get("summary") or {}
            lib = {True: "one libnccl", False: "DIFFERENT libnccl"}.get(c.get("same_libnccl"),
                                                                        "libnccl ?")
            ran = sm.get("ncclpy_cases")
            ran_note = "" if ran is None or ran == sm.get("cases") else \
                f" (ncclpy ran in only {ran} of them)"
            out.append(f"- `ncclpy check -n {c.get('world_size')} --backend nccl` (one GPU): "
                       f"{sm.get('cases', '?')} cases{ran_note}, {sm.get('passed', '?')} "
                       f"passed bit for "
                       f"bit, {sm.get('failed', '?')} failed, {sm.get('within_ulp', '?')} "
                       f"within ULP, {sm.get('torch_divergence', '?')} torch divergences, "
                       f"{sm.get('unsupported', '?')} unsupported, {sm.get('skipped', '?')} "
                       f"skipped; {lib}; exit {c.get('exit_code')}; "
                       f"{_fmt(c.get('seconds'), '.0f')} s")
        b = s.figures.get("bench")
        if b:
            parts = []
            for other in ("torch", "cupy"):
                r = (b.get("ratios") or {}).get(other)
                if not r:
                    continue
                per = ", ".join(f"{_size(int(k))} {_fmt(v)}" for k, v in r["by_size"].items())
                parts.append(f"ncclpy/{other} {per or '?'} (mean {_fmt(r.get('mean'))})")
            at = b.get("busbw_at_max") or {}
            top = ", ".join(f"{k} {_fmt(v, '.1f')}" for k, v in at.items())
            out.append(f"- bench {b.get('collective') or 'all_reduce'} float32 sum, "
                       f"{b.get('world_size')} ranks on one GPU, busbw ratio out of place at "
                       f">= 64 MiB: {'; '.join(parts) or 'no ratio (a backend is missing)'}; "
                       f"busbw GB/s at {_size(int(b['max_size'])) if b.get('max_size') else '?'}"
                       f": {top or '?'}; #wrong {b.get('out_of_bounds')}")
        o = s.figures.get("overhead")
        if o:
            out.append(_overhead_line(o))
        n = s.figures.get("nccl_tests")
        if n:
            out += _nccl_tests_lines(n)
        c = s.figures.get("cuda_costs")
        if c:
            costs = ", ".join(f"{k} {_fmt(v, '.0f')}" for k, v in (c.get("costs_ns") or {}).items())
            out.append(f"- CUDA calls' host cost, ns per call (median) on {c.get('device')}, CUDA "
                       f"runtime {c.get('cuda_runtime')}, CuPy {c.get('cupy')}: {costs or '?'} "
                       f"(Python loop floor {_fmt(c.get('floor_ns'), '.0f')})")
    return out


#: the overhead backends, in the order the report names them
_OVERHEAD_BACKENDS = ("ncclpy", "ncclpy-bare", "cupy", "torch", "nccl4py")


def _overhead_line(o: Dict[str, Any]) -> str:
    """The overhead stage's line: per call modes with each ncclpy flavour minus cupy; graph
    replay and the one-off capture with their medians only."""
    modes = o.get("modes") or {}
    parts = []
    for mode in ("eager", "prepared", "graph", "capture"):
        m = modes.get(mode)
        if not m:
            continue
        med = ", ".join(f"{b} {_fmt(m.get(b))}" for b in _OVERHEAD_BACKENDS if b in m)
        if mode in ("eager", "prepared"):
            diffs = [f"{fl} - cupy = {_fmt(m.get(f'{fl}_minus_cupy_us'))} us"
                     for fl in ("ncclpy", "ncclpy-bare") if f"{fl}_minus_cupy_us" in m]
            parts.append(f"{mode}: {', '.join(diffs) or 'no ncclpy - cupy'} ({med})")
        elif mode == "graph":
            parts.append(f"graph replay, the same kind of graph for all: {med}")
        else:
            parts.append(f"capture, one-off per captured call: {med}")
    return (f"- overhead all_reduce {o.get('size')} B, median per call, "
            f"{o.get('world_size')} ranks: {'; '.join(parts) or '?'}")


def _nccl_tests_lines(n: Dict[str, Any]) -> List[str]:
    """The nccl-tests stage: one line per collective with its verdicts against the targets
    (its tables are in report.md and the stage's own Markdown file)."""
    v = n.get("version_line") or {}
    head = (f"- nccl-tests {v.get('version', '?')} beside ncclpy's bench, {n.get('nproc')} ranks "
            f"on {n.get('gpu') or '?'}, NCCL {(n.get('versions') or {}).get('ncclpy', '?')}, "
            f"medians of {n.get('rounds')} of {n.get('rounds_planned')} rounds")
    if n.get("build_seconds"):
        head += f", built in {_fmt(n['build_seconds'], '.0f')} s"
    if n.get("status") != "complete":
        head += f"; {n.get('status')}: {n.get('reason') or '?'}"
    if n.get("rounds") is not None and n["rounds"] < 2:
        head += ("; fewer than 2 rounds: the spread is unknown, a ratio outside its band is "
                 "not a verdict")
    out = [head + "".join(f"; NOT COMPARABLE: {f}" for f in n.get("flags") or [])]
    for coll, sm in (n.get("summary") or {}).items():
        if not sm:
            continue
        parts = []
        for key, label in (("busbw", "busbw >= 1 MiB within 3%"),
                           ("graph_latency", "graph latency <= 64 KiB within 5%")):
            t = sm.get(key) or {}
            spread = ("" if t.get("worst") is None else
                      f", nccl-tests' spread {t['nt_spread']:.1%}"
                      if t.get("nt_spread") is not None else ", spread unknown (one round)"
                      if t.get("rounds") is not None and t["rounds"] < 2 else "")
            parts.append(f"{label}: {t.get('verdict', '?')} ({t.get('met', 0)}/"
                         f"{t.get('sizes', 0)}, worst ratio {_fmt(t.get('worst'), '.3f')}"
                         f"{spread})")
        eager = ", ".join(f"{k} {c}" for k, c in (sm.get("eager_latency") or {}).items())
        parts.append(f"eager <= 64 KiB: {eager or '?'}")
        oob = f" ({sm['out_of_bounds']} results out of bounds)" \
            if sm.get("out_of_bounds") else ""
        out.append(f"  - {coll}: {'; '.join(parts)}; #wrong "
                   f"{'unchecked' if sm.get('wrong') is None else int(sm['wrong'])}{oob}")
    return out


def _rerun(rec: RunRecord, names: Sequence[str]) -> str:
    flags = " ".join(f"--stage {n}" for n in names)
    return f"`PYTHONPATH=. python3 -m {PROGRAM} $OUT {flags}`"


def paste_block(rec: RunRecord) -> str:
    """The Markdown block for ``docs/gpu-runs.md``'s "Runs" section."""
    v = versions(rec.info)
    lines = [f"### {rec.date}: {PROGRAM} on {v['gpu']}", "",
             f"- GPU: {v['gpu']}; driver {v['driver']}; CUDA runtime {v['cuda_runtime']}; "
             f"MPS: {v['mps']}",
             f"- NCCL {v['nccl']}; CuPy {v['cupy']}; torch {v['torch']}; Python {v['python']}; "
             f"ncclpy {v['ncclpy']}",
             f"- Command: `{rec.command}` (budget {rec.budget_s:.0f} s, took "
             f"{rec.elapsed_s:.0f} s)" + ("; INTERRUPTED" if rec.interrupted else "")]
    if rec.setup:
        st = rec.setup
        lines.append(f"- Side by side: {st.get('jobs', 1)} commands at once, at most "
                     f"{st.get('capacity', 0)} ranks; NCCL_MAX_CTAS {st.get('max_ctas', '?')}; "
                     f"MPS {st.get('mps', '?')}")
    lines += ["", "| stage | result | passed | failed | errors | skipped | time | start |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in rec.stages:
        t = "" if s.status == "not run" else f"{s.seconds:.0f} s"
        at = "" if s.status == "not run" else f"{s.start_s:.0f} s"
        lines.append(f"| {s.name} | {_result(s)} | {_count(s, 'passed')} | "
                     f"{_count(s, 'failed')} | {_count(s, 'errors')} | {_count(s, 'skipped')} "
                     f"| {t} | {at} |")
    lines.append("")
    lines += _figure_lines(rec.stages)
    failed = [f["id"] for s in rec.stages for f in (s.counts or {}).get("failures", [])]
    if failed:
        more = "" if len(failed) <= 12 else f" and {len(failed) - 12} more"
        lines.append(f"- Failed tests: {', '.join(failed[:12])}{more}")
    inner = [f"{k['id']} ({k['checks']})" for s in rec.stages
             for k in (s.counts or {}).get("skipped_checks", [])]
    if inner:                 # checks that did not run inside tests that passed
        lines.append(f"- Checks skipped inside passing tests: {'; '.join(inner[:6])}")
    faults = [s for s in rec.stages if s.figures.get("device_fault")]
    if faults:                # one fault under MPS reaches every process on the GPU
        first = min(faults, key=lambda s: s.start_s + s.seconds)
        lines.append(f"- A device-wide CUDA fault shows in {', '.join(s.name for s in faults)} "
                     f"(\"{first.figures['device_fault'][:120]}\", {first.name}): under MPS one "
                     f"process's fault, or a rank killed with a kernel in flight, reaches every "
                     f"process on the GPU, so these failures may share one cause -- find the "
                     f"first failure before them")
    unfinished = [s.name for s in rec.stages if s.status in ("did not finish", "interrupted")]
    not_run = [s.name for s in rec.stages if s.status == "not run"]
    if unfinished:
        lines.append(f"- Did not finish: {', '.join(unfinished)}")
    if not_run:
        lines.append(f"- Not run: {', '.join(not_run)}")
    if unfinished or not_run:
        lines.append(f"- To finish: {_rerun(rec, unfinished + not_run)}")
    lines += _debt_lines(rec.debt)
    return "\n".join(lines) + "\n"


def _debt_lines(d: Dict[str, Any]) -> List[str]:
    """The ledger and the GPU debt after the run (docs/gpu-ledger.json, issue 34)."""
    if not d:
        return []
    if d.get("error"):
        return [f"- GPU ledger: {d['error']}"]
    out = [f"- GPU ledger: {d.get('ledger', '?')} updated with {d.get('recorded', 0)} results "
           f"(commit it with this block)"]
    if "debt" in d:
        by = ", ".join(f"{k or 'no stage'} {v}" for k, v in (d.get("by_stage") or {}).items())
        out.append(f"- GPU debt after this run: {d['debt']} of {d.get('items', '?')} items "
                   f"({d.get('proven', 0)} proven, {d.get('version_skipped', 0)} skipped for "
                   f"their NCCL version)" + (f"; by stage: {by}" if by else ""))
        for item in (d.get("open") or [])[:12]:
            out.append(f"  - {item}")
        if len(d.get("open") or []) > 12 or d["debt"] > len(d.get("open") or []):
            out.append("  - ... (python -m ncclpy.selftest --debt lists all)")
    return out


def report_md(rec: RunRecord) -> str:
    """``report.md``: the paste block, then per stage its commands and failures."""
    out = ["# ncclpy selftest report", "", paste_block(rec).rstrip(), "", "## Stages", ""]
    for s in rec.stages:
        out.append(f"### {s.name}: {s.title}")
        out.append("")
        out.append(f"- result: {_result(s)}" + (f" in {s.seconds:.1f} s (bound "
                                                 f"{s.timeout_s:.0f} s)" if s.commands else ""))
        for c in s.commands:
            rc = "killed at the bound" if c.get("timed_out") else f"exit {c.get('rc')}"
            out.append(f"- `{c.get('shell')}`: {rc}, {c.get('seconds', 0):.1f} s")
        if s.files:
            out.append(f"- files: {', '.join(s.files)}")
        for f in (s.counts or {}).get("failures", []):
            out += ["", f"{f['kind']}: `{f['id']}`", "", "```", f["message"][:2000], "```"]
        if s.log_tail:
            out += ["", "end of the log:", "", "```", s.log_tail, "```"]
        tables = (s.figures.get("nccl_tests") or {}).get("markdown")
        if tables:                # to paste into docs/performance.md
            out += ["", tables.rstrip()]
        out.append("")
    return "\n".join(out)


def summary_doc(rec: RunRecord) -> Dict[str, Any]:
    """``summary.json``: the whole record as JSON."""
    doc = asdict(rec)
    doc["exit_code"] = exit_code(rec)
    doc["versions"] = versions(rec.info)
    doc["version"] = 1
    return doc


def write_outputs(rec: RunRecord, outdir: str) -> None:
    """Write ``report.md`` and ``summary.json`` in ``outdir`` (each replaced atomically)."""
    for name, text in (("report.md", report_md(rec)),
                       ("summary.json", json.dumps(summary_doc(rec), indent=1, default=str))):
        tmp = os.path.join(outdir, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        os.replace(tmp, os.path.join(outdir, name))
