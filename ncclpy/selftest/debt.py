"""The GPU debt: which GPU tests and timed stages are unproven at the current tree, from the
GPU ledger (:mod:`ncclpy.selftest.ledger`) -- no GPU needed (``python -m ncclpy.selftest
--debt``, seconds).

An item (a GPU test collected from ``tests/gpu``, or a timed stage) is

* **proven** when its last GPU run passed and no file it executed then has changed since;
* **skipped for its NCCL version** when its last GPU run skipped it because that libnccl was too
  old ("NCCL 2.28.9 < 2.29.2"): not proven, not debt -- no GPU lent so far can run it;
* **debt** otherwise: never run on a GPU, never passed (failed, error, did not finish, skipped
  for another reason), failed on its last run after an earlier pass, or passed but a file it
  executed has changed since (the files, with the lines added and removed where git still has
  the old version).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from . import ledger as L
from .stages import TIMED, stage_of

__all__ = ["Item", "Debt", "collect_tests", "compute", "format_text", "stage_counts",
           "CollectError"]


class CollectError(RuntimeError):
    """The GPU tests could not be collected (pytest missing or a test module broken)."""


@dataclass
class Item:
    """One GPU test or timed stage and its standing."""

    id: str
    stage: str
    status: str                   # proven | version-skipped | debt
    why: str = ""                 # never run | never passed | failed last | changed
    detail: str = ""
    changed: List[Dict[str, Any]] = field(default_factory=list)   # path, added, removed
    last_run: str = ""


@dataclass
class Debt:
    """The standing of every item of the tree against a ledger."""

    items: List[Item]
    runs: Dict[str, str]

    @property
    def debt(self) -> List[Item]:
        return [i for i in self.items if i.status == "debt"]

    def count(self, status: str) -> int:
        return sum(i.status == status for i in self.items)

    def as_json(self) -> Dict[str, Any]:
        return {"items": len(self.items), "proven": self.count("proven"),
                "version_skipped": self.count("version-skipped"), "debt": len(self.debt),
                "by_stage": stage_counts(self), "runs": self.runs,
                "entries": [asdict(i) for i in self.items]}


def collect_tests(root: str, python: str = sys.executable, timeout: float = 120.0
                  ) -> List[Dict[str, Any]]:
    """The GPU tests of ``root``'s ``tests/gpu`` (id, world sizes, stage), by pytest's own
    collection (no GPU needed: nothing runs)."""
    fd, out = tempfile.mkstemp(prefix="ncclpy-collect-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, NCCLPY_COLLECT_OUT=out)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    for k in ("NCCLPY_GPU_WORLDS", "NCCLPY_GPU_SHARD"):
        env.pop(k, None)
    try:
        cp = subprocess.run([python, "-m", "pytest", "tests/gpu", "--collect-only", "-q",
                             "-m", "gpu", "-p", "no:cacheprovider",
                             "-p", "ncclpy.selftest.ledger_plugin"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
        try:
            with open(out, encoding="utf-8") as f:
                tests = json.load(f)["tests"]
        except (OSError, ValueError, KeyError):
            tail = (cp.stdout + cp.stderr).strip().splitlines()[-3:]
            raise CollectError(f"pytest could not collect tests/gpu (exit {cp.returncode}): "
                               + " | ".join(tail)) from None
    except (OSError, subprocess.SubprocessError) as e:
        raise CollectError(f"pytest could not be run: {e}") from None
    finally:
        try:
            os.unlink(out)
        except OSError:
            pass
    for t in tests:
        t["stage"] = stage_of(t["id"], t.get("worlds") or []) or ""
    return tests


def _run_short(doc: Mapping[str, Any], rid: str) -> str:
    run = doc["runs"].get(rid) or {}
    return f"{rid}, commit {run['commit']}" if run.get("commit") else rid


def _run_label(doc: Mapping[str, Any], rid: str) -> str:
    run = doc["runs"].get(rid) or {}
    bits = [rid, run.get("gpu", "?")]
    if run.get("nccl"):
        bits.append(f"NCCL {run['nccl']}")
    if run.get("commit"):
        bits.append(f"commit {run['commit']}")
    return ", ".join(bits)


def _changes(doc: Mapping[str, Any], entry: Mapping[str, Any], current: Mapping[str, str],
             root: str) -> List[Dict[str, Any]]:
    out = []
    for path, old in sorted(L.item_files(doc, entry).items()):
        new = current.get(path)
        if new == old:
            continue
        ch: Dict[str, Any] = {"path": path, "added": None, "removed": None}
        if new is None:
            ch["how"] = "deleted" if old else "not in the tree"
        elif old is None:
            ch["how"] = "not recorded at that run"
        else:
            before = L.git_blob(root, old)
            if before is None:
                ch["how"] = "changed (the old version is not in this repository's history)"
            else:
                try:
                    with open(os.path.join(root, path), "rb") as f:
                        ch["added"], ch["removed"] = L.lines_changed(before, f.read())
                except OSError:
                    pass
                ch["how"] = f"+{ch['added']} -{ch['removed']} lines"
        out.append(ch)
    return out


def compute(doc: Mapping[str, Any], root: str, tests: Sequence[Mapping[str, Any]],
            timed: Sequence[str] = TIMED, current: Optional[Mapping[str, str]] = None) -> Debt:
    """The standing of ``tests`` (from :func:`collect_tests`) and the ``timed`` stages."""
    current = L.tree_hashes(root) if current is None else current
    wanted = [(t["id"], t.get("stage", "")) for t in tests] + \
        [(f"stage:{s}", s) for s in timed]
    items: List[Item] = []
    for iid, stage in wanted:
        e = doc["items"].get(iid)
        if not e or "last" not in e:
            items.append(Item(iid, stage, "debt", "never run", "never run on a GPU"))
            continue
        last, lp = e["last"], e.get("last_pass")
        label = _run_short(doc, last["run"])
        if last["outcome"] == "skipped" and L.version_skip(last.get("reason", "")):
            items.append(Item(iid, stage, "version-skipped", "skipped",
                              f"skipped: {L.version_skip(last['reason'])}", last_run=label))
            continue
        if lp is None:
            detail = f"never passed on a GPU; last: {last['outcome']} ({label})"
            if last.get("reason"):
                detail += f": {last['reason'][:200]}"
            items.append(Item(iid, stage, "debt", "never passed", detail, last_run=label))
            continue
        if last["run"] != lp["run"] and last["outcome"] != "passed":
            detail = f"{last['outcome']} on its last GPU run ({label})"
            if last.get("reason"):
                detail += f": {last['reason'][:200]}"
            items.append(Item(iid, stage, "debt", "failed last", detail, last_run=label))
            continue
        changed = _changes(doc, lp, current, root)
        pass_label = _run_short(doc, lp["run"])
        if changed:
            seeded = lp.get("files") == "*"
            detail = (f"passed ({pass_label}); since then {len(changed)} file"
                      f"{'s' if len(changed) != 1 else ''} it "
                      f"{'may have ' if seeded else ''}executed changed")
            items.append(Item(iid, stage, "debt", "changed", detail, changed,
                              last_run=pass_label))
        else:
            items.append(Item(iid, stage, "proven", "", f"passed ({pass_label})",
                              last_run=pass_label))
    runs = {rid: _run_label(doc, rid) for rid in doc["runs"]}
    return Debt(items, runs)


def stage_counts(d: Debt) -> Dict[str, int]:
    """Items in debt per stage ("" for a test no stage runs)."""
    out: Dict[str, int] = {}
    for i in d.debt:
        out[i.stage] = out.get(i.stage, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _files_text(changed: List[Dict[str, Any]], limit: int = 4) -> str:
    parts = [f"{c['path']} ({c['how']})" for c in changed[:limit]]
    if len(changed) > limit:
        parts.append(f"{len(changed) - limit} more")
    return "; ".join(parts)


def format_text(d: Debt, ledger_path: str, limit: int = 0) -> List[str]:
    """The debt as lines (``limit`` > 0: at most that many items per group)."""
    n = len(d.items)
    lines = [f"GPU debt of this tree against {ledger_path}: {n} GPU tests and timed stages; "
             f"{d.count('proven')} proven, {d.count('version-skipped')} skipped for their "
             f"NCCL version, {len(d.debt)} in debt"]
    if d.runs:
        lines.append("runs in the ledger:")
        lines += [f"  {label}" for label in d.runs.values()]
    else:
        lines.append("the ledger has no run: every item counts as never run")
    groups = (("never run", "never run on a GPU"), ("never passed", "never passed on a GPU"),
              ("failed last", "failed on their last GPU run"),
              ("changed", "changed since they passed on a GPU"))
    for why, title in groups:
        mine = [i for i in d.debt if i.why == why]
        if not mine:
            continue
        lines.append(f"{title} ({len(mine)}):")
        shown = mine if limit <= 0 else mine[:limit]
        for i in shown:
            where = f" [{i.stage}]" if i.stage else " [no stage runs it]"
            text = f"  {i.id}{where}"
            if why != "never run":
                text += f": {i.detail}"
            if i.changed:
                text += f": {_files_text(i.changed)}"
            lines.append(text)
        if len(shown) < len(mine):
            lines.append(f"  ... and {len(mine) - len(shown)} more (--json lists all)")
    skipped = [i for i in d.items if i.status == "version-skipped"]
    if skipped:
        lines.append(f"skipped on the GPU for their NCCL version, not debt ({len(skipped)}):")
        for i in skipped:
            lines.append(f"  {i.id} [{i.stage}]: {i.detail}")
    by_stage = stage_counts(d)
    if by_stage:
        lines.append("debt by stage: " + ", ".join(f"{k or '(none)'} {v}"
                                                   for k, v in by_stage.items()))
    return lines
