"""The GPU proof's pytest plugin (``-p ncclpy.selftest.ledger_plugin``): what each test did and
which files it executed, for the GPU ledger (:mod:`ncclpy.selftest.ledger`).

* With ``NCCLPY_LEDGER_DIR`` (the selftest's stages): every test's outcome, duration and skip
  or failure reason, and the *contexts* its files were recorded under
  (:mod:`ncclpy.selftest.filetrace`): the test itself (``NCCLPY_LEDGER_CONTEXT`` is its node id
  while it runs, so the processes it starts record under it too), the collection of its module
  (imports) plus the files its module's names come from, and the module- or session-scoped
  fixtures it uses (their set-up ran once, for several tests).  Written at the end of the
  session to ``$NCCLPY_LEDGER_DIR/pytest-<pid>.json``.
* With ``NCCLPY_COLLECT_OUT=FILE``: the GPU tests collected (node id, world sizes), as JSON, for
  ``python -m ncclpy.selftest --debt``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types
from typing import Any, Dict, Iterator, List, Optional

import pytest

__all__ = ["ENV_COLLECT_OUT", "ENV_STAGE", "test_worlds"]

ENV_COLLECT_OUT = "NCCLPY_COLLECT_OUT"
#: the stage a pytest command belongs to (set by the selftest's runner)
ENV_STAGE = "NCCLPY_SELFTEST_STAGE"
_CTX = "NCCLPY_LEDGER_CONTEXT"

_tests: Dict[str, Dict[str, Any]] = {}
_fixture_ctx: Dict[int, str] = {}
_collect_refs: Dict[str, List[str]] = {}


def _tracer() -> Any:
    mod = sys.modules.get("ncclpy.selftest.filetrace")
    return mod if mod is not None and mod.active() else None


def test_worlds(item: pytest.Item) -> List[int]:
    """The world sizes of an item's ``gpu_world`` marks."""
    out = set()
    for m in item.iter_markers("gpu_world"):
        out.update(int(a) for a in m.args)
    return sorted(out)


class _Context:
    """``NCCLPY_LEDGER_CONTEXT`` and the tracer's innermost context, for a ``with`` block."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.old: Optional[str] = None

    def __enter__(self) -> "_Context":
        self.old = os.environ.get(_CTX)
        os.environ[_CTX] = self.name
        ft = _tracer()
        if ft is not None:
            ft.begin(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        ft = _tracer()
        if ft is not None:
            ft.end()
        if self.old is None:
            os.environ.pop(_CTX, None)
        else:
            os.environ[_CTX] = self.old


def _module_refs(mod: Any) -> List[str]:
    """The tracked files a test module's names come from (its helpers may have been imported,
    hence executed, while another module was collected)."""
    ft = _tracer()
    if ft is None or mod is None:
        return []
    out = set()
    for v in list(vars(mod).values()):
        src = v if isinstance(v, types.ModuleType) else sys.modules.get(
            getattr(v, "__module__", "") or "")
        path = getattr(src, "__file__", None)
        if path:
            rel = ft.relative(os.path.realpath(path))
            if rel:
                out.add(rel)
    return sorted(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    if _tracer() is None or not isinstance(collector, pytest.Module):
        yield
        return
    with _Context(f"collect:{collector.nodeid}"):
        yield
    try:
        _collect_refs[collector.nodeid] = _module_refs(collector.obj)
    except Exception:  # noqa: BLE001 - a module that failed to import has no names
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Iterator[None]:
    if _tracer() is None or fixturedef.scope == "function":
        yield
        return
    name = f"fixture:{request.node.nodeid}::{fixturedef.argname}"
    _fixture_ctx[id(fixturedef)] = name
    with _Context(name):
        yield


def _fixture_contexts(item: pytest.Item) -> List[str]:
    info = getattr(item, "_fixtureinfo", None)
    out = []
    for defs in (getattr(info, "name2fixturedefs", None) or {}).values():
        for d in defs:
            ctx = _fixture_ctx.get(id(d))
            if ctx:
                out.append(ctx)
    return sorted(set(out))


def _module_id(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    if not os.environ.get("NCCLPY_LEDGER_DIR"):
        yield
        return
    rec = _tests.setdefault(item.nodeid, {"outcome": "did not finish", "reason": "",
                                          "worlds": test_worlds(item)})
    t0 = time.monotonic()
    with _Context(item.nodeid):
        yield
    rec["seconds"] = round(time.monotonic() - t0, 3)
    mod = _module_id(item)
    rec["contexts"] = [item.nodeid, f"collect:{mod}", *_fixture_contexts(item)]
    rec["module_refs"] = _collect_refs.get(mod, [])


def _reason(report: Any) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        text = str(lr[2])
        return text[len("Skipped: "):] if text.startswith("Skipped: ") else text
    text = (getattr(report, "longreprtext", "") or "").strip()
    errors = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    last = text.splitlines()[-1] if text else ""
    return (errors[0] if errors else last)[:500]


def pytest_runtest_logreport(report: Any) -> None:
    rec = _tests.get(report.nodeid)
    if rec is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome if report.when == "call" else (
            "skipped" if report.skipped else "error")
        rec["outcome"] = outcome
        rec["reason"] = "" if outcome == "passed" else _reason(report)
    elif report.when == "teardown" and report.failed and rec["outcome"] == "passed":
        rec.update(outcome="error", reason=_reason(report))


def pytest_collection_finish(session: pytest.Session) -> None:
    out = os.environ.get(ENV_COLLECT_OUT)
    if not out:
        return
    items = [{"id": it.nodeid, "worlds": test_worlds(it)} for it in session.items
             if it.get_closest_marker("gpu") is not None]
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"tests": items}, f)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    folder = os.environ.get("NCCLPY_LEDGER_DIR")
    if not folder or not _tests:
        return
    doc = {"stage": os.environ.get(ENV_STAGE, ""), "pid": os.getpid(), "tests": _tests}
    path = os.path.join(folder, f"pytest-{os.getpid()}.json")
    try:
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(path + ".part", path)
    except OSError:               # the run's folder is gone: nothing to report into
        pass
