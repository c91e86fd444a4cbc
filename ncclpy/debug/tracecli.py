"""``ncclpy trace DIR...``: what went wrong, from every rank's flight-recorder dump.

First thing on the screen, per communicator: the problems :func:`ncclpy.debug.trace.analyze`
found (missing or cut-short dumps, the first collective the ranks disagree on, unmatched
send/recv, where the first unfinished call completed), then a compact per-rank timeline.
Exit status 0 when nothing is wrong, 1 when a problem was found, 2 for bad input (one line:
among it a dump of a schema this ncclpy does not read, which is refused, never guessed at);
``--json`` for tools.
"""
from __future__ import annotations

import json
import sys
from typing import List, Optional, Sequence

from ..cli_util import OneLineParser, int_at_least, run_main
from ..errors import ArgumentError
from .trace import CommReport, analyze, load

__all__ = ["main", "build_parser", "format_reports"]

PROG = "ncclpy trace"


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description="Join the flight-recorder dumps of every rank "
                      "(NCCLPY_TRACE_DIR, comm.dump_trace(), ncclpy run's dumps) and say what "
                      "went wrong: the rank, the call and the line of the program.")
    p.add_argument("paths", nargs="+", metavar="DIR",
                   help="dump directories or files (give every host's directory)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--last", type=int_at_least(0, "a number of calls >= 0"), default=5,
                   metavar="N", help="calls per rank in the timeline (default 5; 0: no "
                                     "timeline, only the problems)")
    return p


def format_reports(reports: Sequence[CommReport], skipped: Sequence[tuple]) -> List[str]:
    """The text report: problems first, then the timeline of each communicator."""
    lines: List[str] = []
    bad = [r for r in reports if not r.ok]
    if bad:
        lines.append(f"{PROG}: PROBLEMS FOUND on {len(bad)} of {len(reports)} communicator"
                     f"{'s' if len(reports) != 1 else ''}")
    else:
        lines.append(f"{PROG}: no problem found in the dumps of {len(reports)} communicator"
                     f"{'s' if len(reports) != 1 else ''}: every rank issued the same calls "
                     f"and every recorded call completed")
    for rep in reports:
        lines.append("")
        lines.append(f"communicator {rep.comm!r} (id {rep.comm_id}, {rep.world_size} ranks; "
                     f"dumps of rank(s) {', '.join(map(str, rep.ranks))})")
        for i, f in enumerate(rep.findings, 1):
            lines.append(f"  {i}. {f.lines[0]}")
            lines.extend(f"     {ln}" for ln in f.lines[1:])
        if rep.ok:
            lines.append("  ok")
    for rep in reports:
        if not any(rep.timeline.values()):
            continue
        lines.append("")
        lines.append(f"timeline of {rep.comm!r} (last calls per rank, oldest first; -Ns: "
                     f"issued N s before the dump)")
        for r, tl in rep.timeline.items():
            lines.append(f"  rank {r}:" + ("" if tl else " (no call recorded)"))
            lines.extend(f"    {t}" for t in tl)
    if skipped:
        lines.append("")
        lines.append(f"skipped {len(skipped)} file(s) that are not dumps:")
        lines.extend(f"  {p}: {why}" for p, why in skipped[:10])
    return lines


def _main(argv: List[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    try:
        dumps, skipped = load(ns.paths)
    except ArgumentError as e:
        p.exit(2, f"{PROG}: error: {e}\n")
    reports = analyze(dumps, ns.last)
    if ns.json:
        print(json.dumps({"ok": all(r.ok for r in reports),
                          "communicators": [r.to_json() for r in reports],
                          "skipped": [{"path": a, "why": b} for a, b in skipped]}, indent=1))
    else:
        for ln in format_reports(reports, skipped):
            print(ln)
    return 0 if all(r.ok for r in reports) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ncclpy trace``; the exit code (0 ok, 1 problems, 2 bad input, 130, 141)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_main(PROG, lambda: _main(args))
