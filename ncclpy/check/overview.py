"""The default ``ncclpy check`` report: a progress line while it runs, then a matrix of
collective x dtype (one symbol per cell) and the list of every case that did not pass, grouped,
with its reason; every line within :data:`ncclpy.check.report.WIDTH` columns.

The progress line goes to stderr and only when stderr is a terminal: piped or redirected
output never sees it (like the progress meters of pip or curl).  It is redrawn in place and
erased before anything else is printed.  The full table, one row per case, is ``-v``'s
(:func:`ncclpy.check.report.format_row`); ``--json`` holds every case whatever is printed.
"""
from __future__ import annotations

import sys
import textwrap
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, TextIO, Tuple

from ..semantics.dtypes import SHORT_NAMES
from .cases import ALL_DTYPES, COLLECTIVES
from .report import WIDTH, plural

__all__ = ["SYMBOLS", "LEGEND", "LEGEND_REFERENCE_ONLY", "DTYPE_ABBREV", "symbol_of",
           "matrix_lines", "problem_lines", "Progress"]

#: status -> matrix symbol, most serious first (a cell shows its most serious case)
SYMBOLS: Tuple[Tuple[str, str], ...] = (
    ("fail", "X"), ("torch divergence", "d"), ("within ULP", "~"), ("unsupported", "u"),
    ("reference only", "r"), ("pass", "."), ("skipped", "s"), ("none", "-"))
_RANK = {sym: i for i, (_, sym) in enumerate(SYMBOLS)}
LEGEND = ("legend: . passed bit for bit   d torch divergence (predicted, not a failure)   "
          "X failed\n"
          "        ~ within ULP tolerance   u known torch refusal   s skipped (the backend "
          "cannot run it)\n"
          "        - no such case    (a cell shows the most serious of its cases: ops, sizes, "
          "roots, in place)")
#: the legend's line for ``r`` (printed only where a cell shows it: ``--backend cpu``)
LEGEND_REFERENCE_ONLY = ("        r ncclpy == reference bit for bit; torch not compared (gloo "
                         "cannot run it)")
#: short column titles of the matrix: the dtypes' short names
#: (:data:`ncclpy.dtypes.SHORT_NAMES`, each accepted by ``--dtypes`` as the same dtype)
DTYPE_ABBREV: Dict[str, str] = dict(SHORT_NAMES)
_LABEL = 15          # width of the collective column
_CELL = 5            # width of a dtype column
_KINDS = (("X", "failed"), ("d", "torch divergences (torch's documented wrong output; not "
                                 "failures)"),
          ("~", "within ULP tolerance (these cases are not claimed exact)"),
          ("u", "unsupported (torch's known refusals)"),
          ("r", "ncclpy vs the reference only (torch cannot run them: not compared, not "
                "passed)"))
#: the titles where the tables were not validated with the run's torch
_KINDS_FOUND = (_KINDS[0], ("d", "torch divergences found (tables not validated with this "
                                 "torch; not failures)"),
                _KINDS[2], ("u", "unsupported (refusals the tables name; not validated with "
                                 "this torch)"), _KINDS[4])
_MAX_DETAILS = 8


def symbol_of(status: str) -> str:
    """The matrix symbol of a case status (an unknown status counts as failed)."""
    for st, sym in SYMBOLS:
        if st == status:
            return sym
    return "X"


def _worst(a: str, b: str) -> str:
    return a if _RANK[a] <= _RANK[b] else b


def matrix_lines(records: Iterable[Dict[str, Any]], skipped: Iterable[Dict[str, Any]]
                 ) -> List[str]:
    """The collective x dtype matrix with its legend (dtype columns: those in the run)."""
    cells: Dict[Tuple[str, Optional[str]], str] = {}
    for rec in records:
        c = rec["case"]
        k = (c["collective"], c.get("dtype"))
        cells[k] = _worst(cells.get(k, "-"), symbol_of(rec["status"]))
    for sk in skipped:
        k = (sk["collective"], sk.get("dtype"))
        cells[k] = _worst(cells.get(k, "-"), "s")
    colls = [c for c in COLLECTIVES if any(k[0] == c for k in cells)]
    dts = [d for d in ALL_DTYPES if any(k[1] == d for k in cells)]
    out = ["", "by collective and dtype:",
           " " * _LABEL + "".join(f"{DTYPE_ABBREV.get(d, d[:4]):>{_CELL}}" for d in dts)]
    for coll in colls:
        if not any(k[0] == coll and k[1] is not None for k in cells):
            out.append(f"{coll:<{_LABEL}}{cells.get((coll, None), '-'):>{_CELL}}   "
                       f"(no dtype)")
            continue
        out.append(f"{coll:<{_LABEL}}" + "".join(f"{cells.get((coll, d), '-'):>{_CELL}}"
                                                 for d in dts))
    out += LEGEND.splitlines()
    if "r" in cells.values():
        out.append(LEGEND_REFERENCE_ONLY)
    if dts:
        out.append("        dtypes: i/u int/uint, f float, bf16 bfloat16, e4m3/e5m2 float8, "
                   "c complex (bits)")
    return out


def _op_label(c: Dict[str, Any]) -> str:
    op = c.get("op") or "-"
    if op == "premul_sum" and c.get("scalar") is not None:
        op = f"premul_sum({c['scalar']:g})"
    return op


def _detail(c: Dict[str, Any]) -> str:
    """'7 r1 ip': size (~ uneven), root, in place, and the inputs unless verifiable."""
    size = str(c.get("size_label", c.get("count", "")))
    if c.get("variant") == "uneven":
        size += "~"
    parts = [size]
    if c.get("root") is not None:
        parts.append(f"r{c['root']}")
    parts.append("ip" if c.get("in_place") else "oop")
    if c.get("inputs", "verifiable") != "verifiable":
        parts.append(c["inputs"])
    return " ".join(parts)


def _wrap(text: str, indent: str = "    ") -> List[str]:
    return textwrap.wrap(text, width=WIDTH, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=True) or [""]


def problem_lines(records: Iterable[Dict[str, Any]], skipped: Sequence[Dict[str, Any]],
                  backend: str, validated: bool = True) -> List[str]:
    """Every case that did not pass, grouped by collective, dtype, op and reason, with the
    sizes (``~`` uneven), roots (``rN``) and in-place variants of its cases; on a GPU run also
    what was skipped and why (on gloo: ``--list-skips`` has gloo's refusals).  ``validated``
    False (the tables were not validated with this torch): divergences and refusals are
    titled as found on this torch, not as known."""
    groups: Dict[Tuple[str, str, str, str, str], List[str]] = {}
    for rec in records:
        sym = symbol_of(rec["status"])
        if sym in (".", "s", "-"):
            continue
        c = rec["case"]
        reason = rec.get("reason") or rec["status"]
        k = (sym, c["collective"], c.get("dtype") or "-", _op_label(c), reason)
        groups.setdefault(k, []).append(_detail(c))
    out: List[str] = []
    for sym, title in (_KINDS if validated else _KINDS_FOUND):
        mine = [(k, v) for k, v in groups.items() if k[0] == sym]
        if not mine:
            continue
        n = sum(len(v) for _, v in mine)
        out += ["", f"{title}: {plural(n, 'case')}"]
        if sym == "r":                  # many combinations, few reasons: one entry per reason
            out += _by_reason(mine)
            continue
        for (_, coll, dt, op, reason), details in mine:
            shown = ", ".join(details[:_MAX_DETAILS]) + (", ..." if len(details) > _MAX_DETAILS
                                                         else "")
            out += _wrap(f"  {sym} {coll} {dt} {op} ({plural(len(details), 'case')}: {shown}):"
                         f" {reason}", indent="      ")
    if skipped and backend != "gloo":
        by_reason: Dict[str, List[str]] = {}
        for sk in skipped:
            name = " ".join(x for x in (sk["collective"], sk.get("dtype"), sk.get("op")) if x)
            by_reason.setdefault(sk["reason"], []).append(name)
        out += ["", f"skipped (the backend cannot run them): "
                    f"{plural(len(skipped), 'combination')}"]
        for reason, names in by_reason.items():
            out += _wrap(f"  s {', '.join(names)}: {reason}", indent="      ")
    return out


def _by_reason(groups: List[Tuple[Tuple[str, str, str, str, str], List[str]]]) -> List[str]:
    """``r`` entries, one per reason: ``all_reduce uint32 sum/prod/max, broadcast uint32 (12
    cases): <reason>`` (the ops of a collective and dtype joined)."""
    by: Dict[str, Dict[Tuple[str, str], List[str]]] = {}
    count: Dict[str, int] = {}
    for (_, coll, dt, op, reason), details in groups:
        ops = by.setdefault(reason, {}).setdefault((coll, dt), [])
        if op != "-":
            ops.append(op)
        count[reason] = count.get(reason, 0) + len(details)
    out: List[str] = []
    for reason, cells in by.items():
        names = ", ".join(f"{coll} {dt}" + (f" {'/'.join(ops)}" if ops else "")
                          for (coll, dt), ops in cells.items())
        out += _wrap(f"  r {names} ({plural(count[reason], 'case')}): {reason}",
                     indent="      ")
    return out


class Progress:
    """A one-line progress meter on a terminal: cases done/total, elapsed seconds, failures so
    far and the current collective; drawn only when ``stream`` (default stderr) is a TTY."""

    def __init__(self, total: int, stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            try:
                enabled = bool(self.stream.isatty())
            except (AttributeError, ValueError, OSError):
                enabled = False
        self.enabled = enabled
        self.t0 = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, done: int, failed: int, current: str = "") -> None:
        """Redraw (at most ten times a second, and always for the last case)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        text = (f"  {done}/{plural(self.total, 'case')}, {now - self.t0:.0f} s, "
                f"{plural(failed, 'failure')}" + (f"  ({current})" if current else ""))
        self._write("\r" + text[:WIDTH - 1] + "\033[K")
        self._shown = True

    def clear(self) -> None:
        """Erase the line (before other output, and at the end)."""
        if self._shown:
            self._write("\r\033[K")
            self._shown = False

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False
