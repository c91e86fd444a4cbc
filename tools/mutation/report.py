"""Mutation reports: one JSON per target under docs/mutation/, and the figures table in
docs/testing.md (between its ``mutation-table`` markers), both from the same records."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

__all__ = ["EQUIVALENT", "load_equivalent", "figures", "table", "update_testing_md"]

EQUIVALENT = os.path.join(os.path.dirname(__file__), "equivalent.json")
_BEGIN, _END = "<!-- mutation-table:begin -->", "<!-- mutation-table:end -->"
TARGET_SCORE = 0.90


def load_equivalent() -> Dict[str, Dict[str, str]]:
    """{target: {mutant id: why it is equivalent}} — each reason says why no test can tell."""
    with open(EQUIVALENT) as f:
        return json.load(f)


def figures(rep: dict, equivalent: Dict[str, str]) -> Dict[str, object]:
    """Counts of one report; a survivor later explained in equivalent.json counts equivalent."""
    c = {"sites": rep["sites"], "mutants": len(rep["results"]), "killed": 0, "timeout": 0,
         "equivalent": 0, "survived": 0, "error": 0}
    for r in rep["results"]:
        o = "equivalent" if r["id"] in equivalent else r["outcome"]
        c[o] += 1
    judged = c["mutants"] - c["equivalent"] - c["error"]
    c["score"] = (c["killed"] + c["timeout"]) / judged if judged else 0.0
    return c


def table(reports: List[Tuple[str, dict]], equivalent: Dict[str, Dict[str, str]]) -> str:
    """The markdown table of every report."""
    rows = ["| module | sites | mutants run | killed | timeout | equivalent | survived | "
            "killed of non-equivalent |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rep in reports:
        c = figures(rep, equivalent.get(name, {}))
        rows.append(f"| `{rep['path']}` ({name}) | {c['sites']} | {c['mutants']} | "
                    f"{c['killed']} | {c['timeout']} | {c['equivalent']} | {c['survived']} | "
                    f"{100 * c['score']:.0f} % |")
    return "\n".join(rows)


def update_testing_md(path: str, text: str) -> None:
    """Replace the table between the markers of ``path``."""
    with open(path) as f:
        doc = f.read()
    a, b = doc.index(_BEGIN) + len(_BEGIN), doc.index(_END)
    with open(path, "w") as f:
        f.write(doc[:a] + "\n" + text + "\n" + doc[b:])
