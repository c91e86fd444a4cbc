"""The mutation tool (tools/mutation): its mutants are the planned one-line bugs and nothing
else, a run classifies them by what the tests really do, and docs/testing.md's figures are the
reports' figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.mutation.report import figures, load_equivalent, table
from tools.mutation.runner import Workspace, run_target
from tools.mutation.sites import apply, find_mutants
from tools.mutation.targets import TARGETS, Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOY = b'''"""Toy module."""
import logging
log = logging.getLogger(__name__)
__all__ = ["f", "g"]
LIMIT = 3


def f(a, b):
    """Docstring: not mutated."""
    log.debug("f %s", a)
    assert a is not None
    if a < b and not b == 9:
        return a + b
    msg = f"{a} > {b}"
    return len(msg)


def g(xs):
    out = []
    for x in xs:
        if x in (1, 2):  # pragma: no mutate
            continue
        out.append(x * 2)
    return out
'''


def _pairs(src: bytes) -> set:
    return {(m.func, m.op, m.before, m.after) for m in find_mutants(src)}


def test_the_mutants_of_a_toy_module_are_exactly_the_planned_bugs():
    got = _pairs(TOY)
    assert got == {
        ("f", "cond", "a < b and not b == 9", "not (a < b and not b == 9)"),
        ("f", "cmp", "<", "<="), ("f", "bool", "and", "or"), ("f", "not", "not b == 9", "b == 9"),
        ("f", "cmp", "==", "!="), ("f", "const", "9", "10"),
        ("f", "return", "return a + b", "return None"), ("f", "arith", "+", "-"),
        ("f", "return", "return len(msg)", "return None"),
        ("g", "delete", "out.append(x * 2)", "pass"), ("g", "arith", "*", "//"),
        ("g", "const", "2", "3"), ("g", "return", "return out", "return None"),
        ("g", "flow", "continue", "break"),     # the line after the pragma is mutated
    }, sorted(got)
    # not the docstring, the logging call, the assert, the f-string, __all__, module constants,
    # nor the line marked "pragma: no mutate"


def test_a_mutant_changes_only_its_own_bytes_and_its_id_survives_unrelated_edits():
    ms = find_mutants(TOY)
    for m in ms:
        out = apply(TOY, m)
        assert out[:m.start] == TOY[:m.start]
        assert out[m.start + len(m.after.encode()):] == TOY[m.end:]
        compile(out, "<mutant>", "exec")
    shifted = TOY.replace(b"LIMIT = 3\n", b"LIMIT = 3\nOTHER = 4  # a new line above\n")
    assert {m.id for m in find_mutants(shifted)} == {m.id for m in ms}
    assert len({m.id for m in ms}) == len(ms)


def test_functions_filter_and_module_level_formulas():
    src = b"T = {'ring': lambda n: 2 * (n - 1) / n}\n\n\ndef h(x):\n    return x + 1\n"
    assert {m.func for m in find_mutants(src)} == {"<lambda>", "h"}
    assert {m.func for m in find_mutants(src, ("<lambda>",))} == {"<lambda>"}
    assert {m.func for m in find_mutants(src, ("h",))} == {"h"}


def _toy_repo(tmp_path) -> str:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "m.py").write_text(
        "def clamp(x, hi):\n    if x > hi:\n        return hi\n    return x\n")
    # pins the clamp but not the boundary x == hi (so '>' -> '>=' survives: equivalent here,
    # as both return hi) and nothing about negative numbers
    (root / "tests" / "test_m.py").write_text(
        "from pkg.m import clamp\n\ndef test_clamp():\n"
        "    assert clamp(5, 3) == 3\n    assert clamp(1, 3) == 1\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return str(root)


def test_a_run_kills_what_the_tests_catch_and_reports_survivors(tmp_path):
    root = _toy_repo(tmp_path)
    t = Target("pkg/m.py", ("tests/test_m.py",), sample=0)
    ws = Workspace(root, str(tmp_path / "work"))
    src = open(os.path.join(root, "pkg/m.py"), "rb").read()
    ms = find_mutants(src)
    rep = run_target(ws, t, ms, {}, budget=600, note=lambda s: None)
    by = {(r["op"], r["before"], r["after"]): r["outcome"] for r in rep["results"]}
    assert by == {("cond", "x > hi", "not (x > hi)"): "killed",
                  ("cmp", ">", ">="): "survived",
                  ("return", "return hi", "return None"): "killed",
                  ("return", "return x", "return None"): "killed"}
    killer = [r["by"] for r in rep["results"] if r["outcome"] == "killed"]
    assert set(killer) == {"tests/test_m.py::test_clamp"}
    # the copy was restored and the real tree never touched
    assert open(os.path.join(ws.dir, "pkg/m.py"), "rb").read() == src
    assert open(os.path.join(root, "pkg/m.py"), "rb").read() == src
    eq = {m.id: "x == hi returns hi either way" for m in ms if m.op == "cmp"}
    c = figures({**rep, "sites": len(ms)}, eq)
    assert (c["killed"], c["survived"], c["equivalent"], c["score"]) == (3, 0, 1, 1.0)


def test_a_failing_baseline_is_refused(tmp_path):
    root = _toy_repo(tmp_path)
    with open(os.path.join(root, "tests", "test_m.py"), "a") as f:
        f.write("\ndef test_broken():\n    assert False\n")
    ws = Workspace(root, str(tmp_path / "work"))
    with pytest.raises(SystemExit, match="fail without a mutant"):
        run_target(ws, Target("pkg/m.py", ("tests/test_m.py",)), [], {}, 60, lambda s: None)


def _reports():
    out = []
    for name in TARGETS:
        p = os.path.join(ROOT, "docs", "mutation", f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                out.append((name, json.load(f)))
    return out


def test_docs_testing_md_shows_the_reports_figures_and_every_module_meets_the_target():
    reps = _reports()
    assert [n for n, _ in reps] == list(TARGETS), "a target without a report"
    eq = load_equivalent()
    doc = open(os.path.join(ROOT, "docs", "testing.md")).read()
    assert table(reps, eq) in doc
    for name, rep in reps:
        c = figures(rep, eq.get(name, {}))
        assert c["score"] >= 0.90, (name, c)
        assert c["error"] == 0, (name, c)


def test_every_equivalent_mutant_is_explained_and_was_run():
    eq = load_equivalent()
    reps = dict(_reports())
    for name, ids in eq.items():
        assert name in TARGETS
        seen = {r["id"] for r in reps[name]["results"]}
        for mid, why in ids.items():
            assert mid in seen, f"{name}: {mid} is not in the report (stale explanation)"
            assert len(why) > 20, f"{name}: {mid} needs a reason, not {why!r}"


def test_the_cli_refuses_an_unknown_target_precisely():
    p = subprocess.run([sys.executable, "-m", "tools.mutation", "run", "nosuch"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "unknown target(s) ['nosuch']" in p.stderr and "reference" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_mutant_that_crashes_the_tests_is_killed_and_says_so(tmp_path):
    root = _toy_repo(tmp_path)
    (tmp_path / "repo" / "tests" / "test_m.py").write_text(
        "import os, signal\nfrom pkg.m import clamp\n\ndef test_clamp():\n"
        "    if clamp(5, 3) != 3:\n        os.kill(os.getpid(), signal.SIGKILL)\n")
    ws = Workspace(root, str(tmp_path / "work"))
    src = open(os.path.join(root, "pkg/m.py"), "rb").read()
    ms = [m for m in find_mutants(src) if m.before == "return hi"]
    rep = run_target(ws, Target("pkg/m.py", ("tests/test_m.py",)), ms, {}, 600, lambda s: None)
    assert [(r["outcome"], r["by"]) for r in rep["results"]] == [
        ("killed", "pytest killed by signal 9")]


def test_survivors_without_a_report_is_refused_in_one_line(tmp_path):
    """--survivors needs the target's last report; without one: one line, no traceback."""
    from tools.mutation import __main__ as cli
    saved = cli.OUT
    cli.OUT = str(tmp_path)
    try:
        with pytest.raises(SystemExit, match=r"--survivors: reference has no report .*"
                                              r"run its sample first"):
            cli.main(["run", "reference", "--survivors", "--work", str(tmp_path / "w")])
    finally:
        cli.OUT = saved
