"""Which source files of the repository a process executes, per *context*: the GPU ledger's
record of what each GPU test ran (:mod:`ncclpy.selftest.ledger`).

A context is a name (a test's node id, a fixture, a pool task, a stage); the files executed
while it is the innermost one are recorded under it.  A process that starts with
``NCCLPY_LEDGER_DIR`` set (the selftest's stages: :mod:`ncclpy.selftest._sitehook` installs
this module at start-up, in every Python process they start) records from its first line, under
``NCCLPY_LEDGER_CONTEXT`` (inherited from whoever started it), and appends one JSON line per
ended context to ``$NCCLPY_LEDGER_DIR/trace-<pid>.jsonl``: ``{"pid", "context", "files"}``.

How: on Python >= 3.12, ``sys.monitoring``'s PY_START event (a code object's first
execution; each location then returns DISABLE, so the cost is once per function per context);
before 3.12, a profile function (``sys.setprofile`` and ``threading.setprofile``) that sees every
call.  Module bodies count: an import executes the module, once per process, so a module body
is also credited to the process's first context (a pooled rank's imports during one task are
what the later ones run on).  Only files under
``NCCLPY_LEDGER_ROOT`` (the repository) are kept, relative to it, minus the selftest itself.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from typing import Any, List, Optional, Set, Tuple

__all__ = ["install", "active", "begin", "end", "current", "checkpoint", "relative", "ENV_DIR", "ENV_CONTEXT",
           "ENV_ROOT", "TRACKED", "read_records"]

ENV_DIR = "NCCLPY_LEDGER_DIR"
ENV_CONTEXT = "NCCLPY_LEDGER_CONTEXT"
ENV_ROOT = "NCCLPY_LEDGER_ROOT"
#: the folders whose files are recorded (relative to the root); the selftest is not
TRACKED = ("ncclpy/", "bench/", "examples/", "tests/")
_SKIP = ("ncclpy/selftest/",)

_lock = threading.Lock()
_stack: List[Tuple[str, Set[str]]] = []
_state: dict = {"installed": False, "root": "", "dir": "", "tool": None, "names": {}}


def _relative(filename: str) -> Optional[str]:
    """The repository-relative path of a code object's file, or None when it is not tracked."""
    names = _state["names"]
    rel = names.get(filename, False)
    if rel is not False:
        return rel
    root = _state["root"]
    rel = None
    if not filename.startswith(root) and filename.startswith(os.sep):
        filename_real = os.path.realpath(filename)
    else:
        filename_real = filename
    if filename_real.startswith(root):
        r = filename_real[len(root):].lstrip(os.sep).replace(os.sep, "/")
        if r.endswith(".py") and r.startswith(TRACKED) and not r.startswith(_SKIP):
            rel = r
    names[filename] = rel
    return rel


def relative(path: str) -> Optional[str]:
    """``path`` relative to the repository when it is a tracked file, else None."""
    return _relative(path) if _state["installed"] else None


def _record(filename: str, module: bool = False) -> None:
    """``module``: a module's body ran (an import): it ran once for the whole process, so the
    process's first context gets it too -- every later context of a pooled rank depends on it."""
    rel = _relative(filename)
    if rel is not None and _stack:
        _stack[-1][1].add(rel)
        if module:
            _stack[0][1].add(rel)


def _install_monitoring() -> bool:
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        return False
    for tool in (3, 4, mon.OPTIMIZER_ID):        # not cProfile's PROFILER_ID
        if mon.get_tool(tool) is None:
            break
    else:
        return False
    mon.use_tool_id(tool, "ncclpy-ledger")

    def on_start(code: Any, offset: int) -> Any:
        _record(code.co_filename, code.co_name == "<module>")
        return mon.DISABLE

    mon.register_callback(tool, mon.events.PY_START, on_start)
    mon.set_events(tool, mon.events.PY_START)
    _state["tool"] = tool
    return True


def _install_profile() -> None:
    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            _record(frame.f_code.co_filename, frame.f_code.co_name == "<module>")

    sys.setprofile(prof)
    threading.setprofile(prof)


def _restart() -> None:
    """Make every code location report again (a new context must see what an earlier one
    already saw)."""
    if _state["tool"] is not None:
        sys.monitoring.restart_events()


def active() -> bool:
    """Whether this process records."""
    return bool(_state["installed"])


def install(root: str, out_dir: str, context: str = "") -> bool:
    """Start recording under ``context`` (idempotent); False when it cannot."""
    with _lock:
        if _state["installed"]:
            return True
        _state.update(root=os.path.realpath(root) + os.sep, dir=out_dir)
        _state["root"] = _state["root"].rstrip(os.sep) + os.sep
        _stack.append((context, set()))
        if not _install_monitoring():
            _install_profile()
        _state["installed"] = True
    atexit.register(_at_exit)
    return True


def _write(context: str, files: Set[str], base: bool = False) -> None:
    if not files:
        return
    doc = {"pid": os.getpid(), "context": context, "files": sorted(files)}
    if base:
        doc["base"] = True
    line = json.dumps(doc)
    path = os.path.join(_state["dir"], f"trace-{os.getpid()}.jsonl")
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:             # the run's folder is gone: nothing to record into
        pass


def begin(context: str) -> None:
    """Record under ``context`` until the matching :func:`end`."""
    if not _state["installed"]:
        return
    with _lock:
        _stack.append((context, set()))
    _restart()


def end() -> Optional[str]:
    """End the innermost context, write its record; its name (None: nothing to end)."""
    if not _state["installed"]:
        return None
    with _lock:
        if len(_stack) <= 1:
            return None
        context, files = _stack.pop()
    _write(context, files)
    _restart()
    return context


def checkpoint() -> None:
    """Write what the process executed under its first context so far (``"base": true``): a
    pooled rank's start-up, which every task it later runs depends on, kept even if the rank
    is killed before it exits."""
    if _state["installed"] and _stack:
        with _lock:
            context, files = _stack[0][0], set(_stack[0][1])
        _write(context, files, base=True)


def current() -> Optional[str]:
    """The innermost context's name (None when not recording)."""
    return _stack[-1][0] if _state["installed"] and _stack else None


def _at_exit() -> None:
    while len(_stack) > 1:
        end()
    if _stack:
        context, files = _stack.pop()
        _write(context, files, base=True)


def read_records(folder: str) -> List[dict]:
    """Every record written into ``folder`` (unreadable lines skipped: a killed process may
    leave half a line)."""
    out: List[dict] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        if not (name.startswith("trace-") and name.endswith(".jsonl")):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and isinstance(rec.get("files"), list):
                        out.append(rec)
        except OSError:
            continue
    return out
