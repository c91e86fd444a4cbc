"""Read what the stages leave behind: pytest's junit XML (or its summary line), the ``ncclpy
check`` JSON, the bench sweep JSON, the overhead JSON and the CUDA call costs, into the few
numbers a record needs.

Every reader takes a path (or text), returns None where the file is missing or unreadable, and
never raises for a malformed file: a stage that was killed may leave half a file.
"""
from __future__ import annotations

import json
import logging
import math
import re
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional

__all__ = ["junit_counts", "merge_counts", "pytest_log_counts", "check_summary", "bench_figures",
           "overhead_figures", "cuda_costs_figures", "nccl_tests_figures", "load_json",
           "BIG_BYTES", "MiB", "finite_number"]

log = logging.getLogger(__name__)

MiB = 1 << 20
#: the sizes at and above which the bench ratio ncclpy/torch is reported
BIG_BYTES = 64 * MiB
_MAX_FAILURES = 20
_MAX_MESSAGE = 2000


def load_json(path: str) -> Optional[Any]:
    """The JSON document at ``path``, or None (missing, empty, truncated)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        log.debug("cannot read %s: %s", path, e)
        return None


def _test_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # tests.gpu.test_comm_gpu -> tests/gpu/test_comm_gpu.py (a class name, if any, stays)
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test_"):
            path = "/".join(parts[:i]) + ".py"
            rest = parts[i:]
            return "::".join([path, *rest, name])
    return f"{cls}::{name}" if cls else name


def junit_counts(path: str) -> Optional[Dict[str, Any]]:
    """Counts from a pytest junit XML file: passed, failed, errors, skipped, total, the
    failures (id, kind, first part of the message), and the checks inside passing tests that
    were skipped (the ``skipped_checks`` property: id, "count: reasons").  None when missing
    or unparsable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        log.debug("cannot parse %s: %s", path, e)
        return None
    out: Dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0,
                           "failures": [], "skipped_checks": []}
    seen: Dict[str, str] = {}
    for case in root.iter("testcase"):
        if not case.get("name"):          # the test running when pytest was interrupted
            continue
        tid = _test_id(case)
        kind = "passed"
        msg = ""
        for prop in case.iter("property"):   # checks inside a test that could not run here
            if prop.get("name") == "skipped_checks" and \
                    len(out["skipped_checks"]) < _MAX_FAILURES:
                out["skipped_checks"].append({"id": tid, "checks": prop.get("value") or ""})
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed" if child.tag == "failure" else "errors"
                msg = (child.get("message") or "") + "\n" + (child.text or "")
                break
            if child.tag == "skipped":
                kind = "skipped"
                msg = child.get("message") or ""
        if tid in seen:                   # a teardown error after a pass or a failure
            if kind == "errors" and seen[tid] != "errors":
                out[seen[tid]] -= 1
                out["total"] -= 1
            else:
                continue
        seen[tid] = kind
        out[kind] += 1
        out["total"] += 1
        if kind in ("failed", "errors") and len(out["failures"]) < _MAX_FAILURES:
            out["failures"].append({"id": tid, "kind": "error" if kind == "errors" else "failed",
                                    "message": msg.strip()[:_MAX_MESSAGE]})
    return out


def merge_counts(parts: List[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """The counts of a sharded stage: its shards' counts added up (None when none has any)."""
    have = [c for c in parts if c]
    if not have:
        return None
    out: Dict[str, Any] = {k: 0 for k in ("passed", "failed", "errors", "skipped", "total")}
    out.update(failures=[], skipped_checks=[])
    for c in have:
        for k in ("passed", "failed", "errors", "skipped", "total"):
            out[k] += int(c.get(k, 0))
        out["failures"] += c.get("failures", [])
        out["skipped_checks"] += c.get("skipped_checks", [])
    out["failures"] = out["failures"][:_MAX_FAILURES]
    out["skipped_checks"] = out["skipped_checks"][:_MAX_FAILURES]
    return out


_SUMMARY = re.compile(r"^=*\s*(?P<body>(?:\d+ \w+(?:, )?)+)(?: in [0-9.]+s.*)?=*\s*$")
_PART = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)")


def pytest_log_counts(text: str) -> Optional[Dict[str, Any]]:
    """Counts from pytest's last summary line (``1 failed, 3 passed, 2 skipped in 4.0s``),
    for when the junit file is missing.  None when there is no such line."""
    for line in reversed(text.splitlines()):
        m = _SUMMARY.match(line.strip())
        if not m or not _PART.search(m.group("body")):
            continue
        out: Dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                               "total": 0, "failures": []}
        for num, word in _PART.findall(m.group("body")):
            key = {"error": "errors", "errors": "errors", "xfailed": "skipped",
                   "xpassed": "passed"}.get(word, word)
            if key in ("passed", "failed", "errors", "skipped"):
                out[key] += int(num)
                out["total"] += int(num)
        return out
    return None


def check_summary(path: str) -> Optional[Dict[str, Any]]:
    """The verdict of one ``ncclpy check --json`` file: world size, the summary counts, exit
    code, whether torch and ncclpy used one libnccl, the problems, the seconds."""
    doc = load_json(path)
    if not isinstance(doc, dict) or "summary" not in doc:
        return None
    h = doc.get("header") or {}
    lib = h.get("libnccl") or {}
    return {"world_size": h.get("world_size"), "backend": h.get("backend"),
            "device": h.get("device"), "summary": dict(doc["summary"]),
            "exit_code": doc.get("exit_code"), "problems": list(doc.get("problems") or []),
            "same_libnccl": lib.get("same"), "nccl": lib.get("ncclpy_nccl_version"),
            "seconds": doc.get("seconds")}


def finite_number(v: Any) -> Optional[float]:
    """``v`` as a float, or None where it is none, not a number, NaN or infinite (a JSON
    figure written as \"nan\" reads as None)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) or math.isinf(x) else x


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def bench_figures(path: str, big: int = BIG_BYTES) -> Optional[Dict[str, Any]]:
    """From a ``python -m bench -J`` file: per backend the out-of-place bus bandwidth by size,
    the ratios ncclpy/torch and ncclpy/cupy at sizes >= ``big`` (out of place), their mean,
    and the wrong-element count.  Every backend's rows are in ``ncclpy.results`` (each named by
    its ``series``; nccl-tests' own ``results`` holds the first backend's only); a file of the
    layout before (nccl-tests' version 2, every row in ``results`` named by
    ``experiment_name``) is read too."""
    doc = load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        return None
    ext = doc.get("ncclpy") if isinstance(doc.get("ncclpy"), dict) else {}
    rows, name = doc["results"], "experiment_name"
    if isinstance(ext.get("results"), list):
        rows, name = ext["results"], "series"
    busbw: Dict[str, Dict[int, Optional[float]]] = {}
    for r in rows:
        try:
            size, backend = int(r["size"]), str(r[name])
            busbw.setdefault(backend, {})[size] = finite_number(r["out_of_place"]["bus_bw"])
        except (KeyError, TypeError, ValueError):
            continue
    out: Dict[str, Any] = {
        "collective": ext.get("collective"), "world_size": ext.get("world_size"),
        "backends": list(busbw), "nccl_version": doc.get("nccl_version"),
        "out_of_bounds": (doc.get("out_of_bounds") or {}).get("count"),
        "max_size": max((s for b in busbw.values() for s in b), default=None),
        "busbw_at_max": {}, "ratios": {}}
    if out["max_size"] is not None:
        out["busbw_at_max"] = {b: v.get(out["max_size"]) for b, v in busbw.items()}
    base = busbw.get("ncclpy", {})
    for other in ("torch", "cupy"):
        if other not in busbw:
            continue
        per = {s: _ratio(base.get(s), busbw[other].get(s)) for s in sorted(base) if s >= big}
        vals = [v for v in per.values() if v is not None]
        out["ratios"][other] = {"by_size": per,
                                "mean": sum(vals) / len(vals) if vals else None}
    return out


def overhead_figures(path: str, size: int = 8) -> Optional[Dict[str, Any]]:
    """From a ``python -m bench.overhead -J`` file: per mode at ``size`` bytes the medians of
    every backend, and in the per-call modes (eager, prepared) each ncclpy flavour (``ncclpy``:
    its defaults, ``ncclpy-bare``) minus cupy / minus torch / minus nccl4py (µs), keyed
    ``<flavour>_minus_<other>_us``.  Graph replay and the one-off capture get no difference:
    every backend replays the same kind of graph, and building one is not the eager target."""
    doc = load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        return None
    modes: Dict[str, Dict[str, Any]] = {}
    for r in doc["results"]:
        try:
            if int(r["size"]) != size:
                continue
            modes.setdefault(str(r["mode"]), {})[str(r["backend"])] = finite_number(r["median_us"])
        except (KeyError, TypeError, ValueError):
            continue
    for mode, med in modes.items():
        if mode not in ("eager", "prepared"):
            continue
        for flavour in ("ncclpy", "ncclpy-bare"):
            nc = med.get(flavour)
            for other in ("cupy", "torch", "nccl4py"):
                if nc is not None and med.get(other) is not None:
                    med[f"{flavour}_minus_{other}_us"] = nc - med[other]
    sizes: List[int] = sorted({int(r.get("size", 0)) for r in doc["results"]
                               if isinstance(r, dict)})
    return {"size": size, "modes": modes, "sizes": sizes, "calls": doc.get("calls"),
            "world_size": doc.get("world_size")}


def cuda_costs_figures(path: str) -> Optional[Dict[str, Any]]:
    """From a ``python -m bench.cuda_costs --json`` file: the device, versions and the median
    host ns per call of each CUDA call (None: missing, unreadable or another schema)."""
    doc = load_json(path)
    if not isinstance(doc, dict) or doc.get("schema") != "ncclpy-cuda-costs/1" or \
            not isinstance(doc.get("costs_ns"), dict):
        return None
    costs = {str(k): finite_number(v) for k, v in doc["costs_ns"].items()}
    return {"device": doc.get("device"), "cuda_runtime": doc.get("cuda_runtime"),
            "cupy": doc.get("cupy"), "costs_ns": costs, "floor_ns": finite_number(doc.get("floor_ns"))}


def nccl_tests_figures(path: str) -> Optional[Dict[str, Any]]:
    """From ``python -m bench.nccl_tests_side``'s JSON: its status and reason, what makes it not
    comparable, the ranks, rounds, GPU, versions, build time, per collective the summary of the
    verdicts, and the Markdown tables (None: missing, unreadable or another schema)."""
    doc = load_json(path)
    if not isinstance(doc, dict) or doc.get("schema") != "ncclpy-nccl-tests-side/1":
        return None
    st = doc.get("setup") if isinstance(doc.get("setup"), dict) else {}
    nt = doc.get("nccl_tests") if isinstance(doc.get("nccl_tests"), dict) else {}
    colls = doc.get("collectives") if isinstance(doc.get("collectives"), dict) else {}
    return {"status": str(doc.get("status") or "?"), "reason": str(doc.get("reason") or ""),
            "flags": [str(f) for f in doc.get("flags") or []],
            "comparable": bool(doc.get("comparable")), "nproc": st.get("nproc"),
            "rounds": st.get("rounds_done"), "rounds_planned": st.get("rounds_planned"),
            "gpu": nt.get("gpu"), "version_line": nt.get("version_line"),
            "build_seconds": nt.get("build_seconds"), "versions": doc.get("versions") or {},
            "summary": {str(k): v.get("summary") for k, v in colls.items()
                        if isinstance(v, dict)},
            "markdown": str(doc.get("markdown") or "")}
