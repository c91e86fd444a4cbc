"""The ``ncclpy check`` table rows (``-v``), the summary lines and the JSON file.

The default report (progress line, matrix, list of what did not pass) is in
:mod:`ncclpy.check.overview`; every line here and there fits in :data:`WIDTH` columns except the
full table rows of ``-v``.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["COLUMNS", "format_header_row", "format_row", "format_skip_row", "summarize",
           "summary_line", "summary_lines", "write_json", "STATUS_COUNTED", "mark", "plural",
           "WIDTH"]

#: the columns every line of the default report fits in
WIDTH = 100

#: (title, width) of the table columns
COLUMNS = (("collective", 14), ("dtype", 11), ("op", 15), ("size", 10), ("root", 4),
           ("inplace", 7), ("ncclpy==torch", 13), ("ncclpy==ref", 11), ("torch==ref", 10),
           ("max ULP", 7), ("status", 0))

#: status -> summary counter ("failed" makes the exit status 1; the others do not)
STATUS_COUNTED = {"pass": "passed", "fail": "failed", "error": "failed",
                  "within ULP": "within_ulp", "torch divergence": "torch_divergence",
                  "unsupported": "unsupported", "reference only": "passed_reference_only"}


def mark(value: Optional[bool], gpu: bool = True) -> str:
    """A table cell for a comparison: yes (bytes identical on every rank) / NO (some byte
    differs; the max ULP column says by how much) / - (nothing to compare) / needs GPU."""
    if not gpu:
        return "needs GPU"
    if value is None:
        return "-"
    return "yes" if value else "NO"


def _cell(text: str, width: int) -> str:
    return text if width == 0 else f"{text:<{width}.{width}}" if len(text) > width else \
        f"{text:<{width}}"


def format_header_row() -> str:
    return " ".join(_cell(t, w) for t, w in COLUMNS).rstrip()


def _ulp(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:g}"


def format_row(rec: Dict[str, Any]) -> str:
    """One table line for a case record (see :mod:`ncclpy.check.runner`)."""
    c = rec["case"]
    gpu = rec.get("ncclpy_ran", False)
    op = c.get("op") or "-"
    if op == "premul_sum":
        op = f"premul_sum({c.get('scalar'):g})"
    size = c.get("size_label", str(c.get("count", "")))
    if c.get("variant") == "uneven":
        size += "~"
    if c.get("inputs", "verifiable") != "verifiable":
        size += " " + c["inputs"][:3]          # nor(mal), rev(eal)
    root = "-" if c.get("root") is None else str(c["root"])
    status = rec["status"]
    if rec.get("reference") == "nccl-order":
        status += " [NCCL's order]"
    if rec.get("reason"):
        status = f"{status}: {rec['reason']}"
    cells = [c["collective"], c.get("dtype") or "-", op, size, root,
             "yes" if c.get("in_place") else "no",
             mark(rec.get("ncclpy_torch"), gpu), mark(rec.get("ncclpy_ref"), gpu),
             mark(rec.get("torch_ref")), _ulp(rec.get("max_ulp")), status]
    return " ".join(_cell(t, w) for t, (_, w) in zip(cells, COLUMNS)).rstrip()


def format_skip_row(skip: Dict[str, Any]) -> str:
    """A table line for a combination the run leaves out, with the reason."""
    cells = [skip["collective"], skip.get("dtype") or "-", skip.get("op") or "-", "*", "*", "*",
             "-", "-", "-", "-", f"skipped: {skip['reason']}"]
    return " ".join(_cell(t, w) for t, (_, w) in zip(cells, COLUMNS)).rstrip()


def summarize(records: Iterable[Dict[str, Any]], skipped: int = 0) -> Dict[str, int]:
    """Counts by outcome (an unknown status counts as failed).

    ``passed`` counts only cases in which ncclpy ran and matched torch and the reference;
    a case in which only torch was compared with the reference (no GPU: ncclpy did not run)
    passes into ``passed_torch_only`` instead, one in which only ncclpy was (``--backend
    cpu``: gloo cannot run it) into ``passed_reference_only``, and ``ncclpy_cases`` says in how
    many cases ncclpy ran at all: a reader of the JSON can never take one side's result for
    both.  ``nccl_order_cases`` counts the cases judged against NCCL's order (the model's
    prediction, :mod:`ncclpy.check.exact`), ``exact_nccl_order`` those of them in which every
    side so judged gave its bits exactly, whatever the case's status."""
    out = {"cases": 0, "passed": 0, "passed_torch_only": 0, "passed_reference_only": 0,
           "failed": 0, "within_ulp": 0, "torch_divergence": 0, "unsupported": 0,
           "skipped": skipped, "ncclpy_cases": 0, "nccl_order_cases": 0,
           "exact_nccl_order": 0}
    for r in records:
        out["cases"] += 1
        out["nccl_order_cases"] += "nccl-order" in (r.get("reference"), r.get("torch_reference"))
        out["exact_nccl_order"] += r.get("exact_nccl_order") is True
        ran = bool(r.get("ncclpy_ran"))
        out["ncclpy_cases"] += ran
        key = STATUS_COUNTED.get(r["status"], "failed")
        if key == "passed" and not ran:
            key = "passed_torch_only"
        out[key] += 1
    return out


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    """``1 rank``, ``2 ranks``, ``0 ranks`` (``many`` for irregular plurals)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def summary_lines(counts: Dict[str, int], seconds: float, backend: str,
                  world_size: int, no_ncclpy: str = "",
                  no_ncclpy_label: str = "ncclpy needs a GPU", basis: str = "") -> List[str]:
    """The last lines of a run (each within :data:`WIDTH` columns).  When ncclpy did not run
    (``no_ncclpy``: why, after ``no_ncclpy_label``), the first line says so and counts torch
    against the reference only.  Where cases were judged against NCCL's order, one line
    counts those exact against it, apart from those within ULP (``basis``: what the
    prediction rests on, :func:`ncclpy.order.cli.basis`)."""
    head = (f"ncclpy check: {plural(counts['cases'], 'case')} on {plural(world_size, 'rank')} "
            f"({backend}) in {seconds:.1f} s: ")
    torch_only = counts.get("passed_torch_only", 0)
    if counts.get("ncclpy_cases", counts["cases"]) == 0:
        first = [head + "ncclpy NOT run",
                 f"  torch ({backend}) vs numpy reference only: {torch_only} passed bit for bit, "
                 f"{counts['failed']} failed"]
        if no_ncclpy:
            first.append(f"  {no_ncclpy_label}: {no_ncclpy}"[:WIDTH])
    else:
        first = [head + f"{counts['passed']} passed bit for bit, {counts['failed']} failed"]
        if torch_only:
            first.append(f"  {torch_only} passed with torch vs the reference only (ncclpy did "
                         f"not run them)")
        ref_only = counts.get("passed_reference_only", 0)
        if ref_only:
            first.append(f"  {ref_only} with ncclpy vs the reference only (torch cannot run "
                         f"them: not compared, not counted as passed)")
    judged = counts.get("nccl_order_cases", 0)
    if judged:
        first.append(f"  exact vs NCCL's order: {counts.get('exact_nccl_order', 0)} of "
                     f"{plural(judged, 'case')} judged against the model's prediction")
        if basis:
            first.append(f"    (the prediction: {basis})"[:WIDTH])
    return first + [
            f"  {plural(counts['torch_divergence'], 'torch divergence')}, "
            f"{counts.get('within_ulp', 0)} within ULP tolerance, "
            f"{counts['unsupported']} unsupported, "
            f"{plural(counts['skipped'], 'combination')} skipped"]


def summary_line(counts: Dict[str, int], seconds: float, backend: str, world_size: int,
                 no_ncclpy: str = "") -> str:
    """The summary as one line (:func:`summary_lines` joined)."""
    return " ".join(ln.strip() for ln in summary_lines(counts, seconds, backend, world_size,
                                                       no_ncclpy))


def write_json(path: str, doc: Dict[str, Any]) -> None:
    """Write the run as JSON (``-`` for stdout, where it is then the only output: the runner
    prints the table on stderr); infinities become the string "inf"."""
    def fix(o: Any) -> Any:
        if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
            return str(o)
        if isinstance(o, dict):
            return {k: fix(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [fix(v) for v in o]
        return o
    text = json.dumps(fix(doc), indent=1, default=str)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    with open(path, "w") as f:
        f.write(text + "\n")
