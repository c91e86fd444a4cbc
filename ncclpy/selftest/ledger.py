"""The GPU ledger (``docs/gpu-ledger.json``): for every GPU test and timed stage, what its last
GPU run gave (outcome, seconds, reason, the run's commit, GPU and versions) and, for its last
pass, which repository files it executed and their content then (git blob hashes), so that
what is unproven at the current tree -- the GPU debt, :mod:`ncclpy.selftest.debt` -- shows on
any machine, without a GPU.

The document::

    {"version": 1,
     "runs":  {RUN: {"date", "commit", "gpu", "driver", "nccl", "cupy", "torch", "python",
                     "command", "files": {PATH: BLOB}, "files_recorded": bool, "note"}},
     "items": {ID: {"stage", "last": {"run", "outcome", "seconds", "reason"},
                    "last_pass": {"run", "seconds", "files": [PATH, ...] | "*"}}}}

ID is a pytest node id or ``stage:NAME`` (the stages that are not pytest: bench, overhead).
``files`` ``"*"`` means every file of the run's table: the seeded runs, whose per-test file sets
were never recorded, count every file.  Outcomes: passed, failed, error, skipped, did not finish.
Everything here but :func:`tree_hashes` and the git helpers is pure.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import subprocess
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from .filetrace import TRACKED

__all__ = ["LEDGER_PATH", "VERSION", "blob_hash", "tree_hashes", "load", "save", "dumps", "empty",
           "version_skip", "files_by_test", "update", "item_files", "lines_changed",
           "OUTCOMES", "git_blob"]

LEDGER_PATH = os.path.join("docs", "gpu-ledger.json")
VERSION = 1
OUTCOMES = ("passed", "failed", "error", "skipped", "did not finish")
_SKIP_DIRS = {"__pycache__", ".git", "build", "dist", ".eggs"}
_EXCLUDE = ("ncclpy/selftest/",)


def empty() -> Dict[str, Any]:
    """A ledger with no run."""
    return {"version": VERSION, "runs": {}, "items": {}}


def blob_hash(data: bytes) -> str:
    """git's object id of a blob with these bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_hashes(root: str) -> Dict[str, str]:
    """path -> blob hash of every tracked Python file under ``root`` (the folders
    :data:`ncclpy.selftest.filetrace.TRACKED`, the selftest itself left out)."""
    out: Dict[str, str] = {}
    for top in TRACKED:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS
                                 and not d.endswith(".egg-info"))
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                if rel.startswith(_EXCLUDE):
                    continue
                try:
                    with open(path, "rb") as f:
                        out[rel] = blob_hash(f.read())
                except OSError:
                    continue
    return dict(sorted(out.items()))


def load(path: str) -> Dict[str, Any]:
    """The ledger at ``path`` (an empty one when the file does not exist); ValueError when it
    exists but is not a ledger this code reads."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return empty()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable GPU ledger ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or \
            not isinstance(doc.get("runs"), dict) or not isinstance(doc.get("items"), dict):
        raise ValueError(f"{path}: not a GPU ledger of version {VERSION}")
    return doc


_LIST = re.compile(r'\[\n\s*((?:"[^"\n]*",\n\s*)*"[^"\n]*")\n\s*\]')


def dumps(doc: Mapping[str, Any]) -> str:
    """The ledger's text: sorted keys, one key per line, a list of files on one line (a run
    changes few lines of it)."""
    text = json.dumps(doc, indent=1, sort_keys=True)
    return _LIST.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text) + "\n"


def save(doc: Mapping[str, Any], path: str) -> None:
    """Write ``doc`` to ``path`` atomically (:func:`dumps`)."""
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(doc))
    os.replace(tmp, path)


_VER = r"(\d+)\.(\d+)\.(\d+)"
#: a version as the GPU tests and ncclpy's refusals write it: 2.28.9, 2.31, or a code 22809
_ANY = r"(\d+\.\d+(?:\.\d+)?|\d{5,})"


def _fmt_code(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _norm(text: str) -> str:
    if "." not in text:
        return _fmt_code(int(text))
    parts = text.split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def version_skip(reason: str) -> Optional[str]:
    """``"NCCL 2.28.9 < 2.29.2"`` when a skip reason says the test needs a newer NCCL than the
    GPU had (the forms the GPU tests and ncclpy's refusals use: ``NCCL 2.28.9 < 2.29.2``,
    ``X needs NCCL >= 2.31.0; the loaded NCCL is 2.28.9``, ``... >= 22902; this is 22809``),
    else None."""
    text = reason or ""
    m = re.search(r"NCCL " + _VER + r" < " + _VER, text)
    if m:
        return f"NCCL {'.'.join(m.groups()[:3])} < {'.'.join(m.groups()[3:])}"
    m = re.search(r"needs NCCL >= ?" + _ANY + r"[^\n]*?(?:this is|NCCL is|libnccl is|loaded is)"
                  r" (?:NCCL )?" + _ANY, text)
    if m:
        return f"NCCL {_norm(m.group(2))} < {_norm(m.group(1))}"
    return None


def files_by_test(records: Iterable[Mapping[str, Any]],
                  tests: Mapping[str, Mapping[str, Any]]) -> Dict[str, Set[str]]:
    """Each test's executed files from the tracer's records and the plugin's tests: the
    records of its contexts, the start-up ("base") records of every process with such a record
    (a pooled rank's imports, the pytest process's conftest), the files its module's names come
    from, and its own test file."""
    by_ctx: Dict[str, List[Tuple[int, List[str]]]] = {}
    base: Dict[int, Set[str]] = {}
    for r in records:
        pid, files = int(r.get("pid", -1)), list(r.get("files") or [])
        by_ctx.setdefault(str(r.get("context", "")), []).append((pid, files))
        if r.get("base"):
            base.setdefault(pid, set()).update(files)
    out: Dict[str, Set[str]] = {}
    for tid, t in tests.items():
        files: Set[str] = set(t.get("module_refs") or [])
        pids: Set[int] = set()
        for ctx in t.get("contexts") or [tid]:
            for pid, fs in by_ctx.get(ctx, []):
                files.update(fs)
                pids.add(pid)
        for pid in pids:
            files.update(base.get(pid, ()))
        files.add(tid.split("::", 1)[0])
        out[tid] = files
    return out


def update(doc: Dict[str, Any], run_id: str, run: Mapping[str, Any],
           results: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Add run ``run_id`` (its metadata, ``files`` its table) and each item's result
    (``{"stage", "outcome", "seconds", "reason", "files"}``) to ``doc``; runs no item refers to
    any more are dropped.  Returns ``doc``."""
    doc.setdefault("runs", {})[run_id] = dict(run)
    items = doc.setdefault("items", {})
    for iid, r in results.items():
        outcome = str(r.get("outcome", "did not finish"))
        e = items.setdefault(iid, {})
        e["stage"] = r.get("stage") or e.get("stage", "")
        e["last"] = {"run": run_id, "outcome": outcome,
                     "seconds": round(float(r.get("seconds") or 0.0), 3),
                     "reason": str(r.get("reason") or "")[:500]}
        if outcome == "passed":
            files = r.get("files")
            e["last_pass"] = {"run": run_id, "seconds": e["last"]["seconds"],
                              "files": files if files == "*" else sorted(files or [])}
    used = {e[k]["run"] for e in items.values() for k in ("last", "last_pass") if k in e}
    for rid in [rid for rid in doc["runs"] if rid not in used]:
        del doc["runs"][rid]
    return doc


def item_files(doc: Mapping[str, Any], entry: Mapping[str, Any]) -> Dict[str, Optional[str]]:
    """path -> blob hash at the run of ``entry`` (a ``last_pass``), for the files it executed."""
    run = doc["runs"].get(entry.get("run"), {})
    table = run.get("files") or {}
    files = entry.get("files")
    if files == "*":
        return dict(table)
    return {f: table.get(f) for f in files or []}


def git_blob(root: str, blob: str) -> Optional[bytes]:
    """The bytes of a blob from the repository's history (None: no git, or not there)."""
    try:
        cp = subprocess.run(["git", "-C", root, "cat-file", "blob", blob], capture_output=True,
                            timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return cp.stdout if cp.returncode == 0 else None


def lines_changed(old: bytes, new: bytes) -> Tuple[int, int]:
    """(lines added, lines removed) from ``old`` to ``new``."""
    a = old.decode("utf-8", "replace").splitlines()
    b = new.decode("utf-8", "replace").splitlines()
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            removed += i2 - i1
        if tag in ("replace", "insert"):
            added += j2 - j1
    return added, removed
