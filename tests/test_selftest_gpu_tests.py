"""The GPU tests as the selftest runs them, collected (never run) here: world-size selection,
sharding, each test's stage (the same selection as the stages' commands), time bounds."""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

import proc_speed
from ncclpy.selftest import parse as P
from ncclpy.selftest import stages as S

ROOT = Path(__file__).resolve().parents[1]
#: one worker for the file: its tests share their collections (_collect_all)
pytestmark = pytest.mark.xdist_group("selftest_gpu_tests")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


#: what each (arguments, extra environment) collected, for the tests after it in this process:
#: the collection of the stages' shards is the same command for every test that looks at it
_COLLECTED: Dict[Tuple[Tuple[str, ...], Tuple[Tuple[str, str], ...]], List[str]] = {}


def _collect_all(*runs: Tuple[Sequence[str], Optional[dict]]) -> List[List[str]]:
    """The test ids each of ``runs`` (pytest arguments, variables added to the environment)
    collects: one ``pytest --collect-only`` process each, as one would type it, the ones not
    collected yet in this process started together (their bytecode cached: proc_speed)."""
    keys = [(tuple(args), tuple(sorted((extra or {}).items()))) for args, extra in runs]
    todo = list(dict.fromkeys(k for k in keys if k not in _COLLECTED))
    cmds = []
    for args, extra in todo:
        env = _env()
        env.update(extra)
        cmds.append(([sys.executable, "-m", "pytest", "--collect-only", "-q",
                      "-p", "no:cacheprovider", *args], proc_speed.pytest_env(env)))
    for key, p in zip(todo, proc_speed.run_together(cmds, cwd=str(ROOT), timeout=120,
                                                    warm_first=True)):
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        _COLLECTED[key] = [ln for ln in p.stdout.splitlines() if "::" in ln]
    return [list(_COLLECTED[k]) for k in keys]


def _collect(*args: str, env_extra: dict = None) -> list:
    return _collect_all((args, env_extra))[0]


def test_gpu_worlds_selects_by_largest_world_size():
    base = ["tests/gpu", "-m", "gpu"]
    one_two, three_four, everything, one_to_six, six = _collect_all(
        ([*base, "--gpu-worlds", "1,2"], None), (base, {"NCCLPY_GPU_WORLDS": "3,4"}),
        (base, None), ([*base, "--gpu-worlds", "1,2,3,4,5,6"], None),
        ([*base, "--gpu-worlds", "6"], None))
    assert "tests/gpu/test_comm_gpu.py::test_collective_matrix[2]" in one_two
    assert "tests/gpu/test_comm_gpu.py::test_collective_matrix[3]" not in one_two
    assert "tests/gpu/test_comm_gpu.py::test_register_same_buffer_twice" in one_two
    assert "tests/gpu/test_fixes_gpu.py::test_nccl_comm_blocking_0_in_the_environment" in one_two
    assert "tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[4]" in three_four
    assert "tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[2]" in one_two
    assert "tests/gpu/test_comm_gpu.py::test_split_into_halves" in three_four
    assert "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[4]" in three_four
    assert not set(one_two) & set(three_four)
    # every GPU test has a world size: the union over 1..6 is everything
    assert sorted(one_to_six) == sorted(everything)
    # the examples that spawn 6 ranks belong to 6
    assert "tests/gpu/test_examples_gpu.py::test_example_standalone_spawn[02_all_gather.py]" \
        in six


def _shard_args(name: str) -> List[List[str]]:
    """Each shard's command of stage ``name``: its pytest arguments, minus the output files."""
    ctx = S.Ctx(python=sys.executable, work="/tmp/w", tmp="/tmp/t")
    return [[a for a in cmd.argv[3:] if not a.startswith(("--junitxml", "--basetemp", "-q"))]
            for (cmd,) in S.shard_commands(S.by_name(name), ctx)]


def _stage_ids(name: str) -> list:
    """What each shard of stage ``name`` collects (its own command, minus the output files)."""
    return _collect_all(*((args, None) for args in _shard_args(name)))


def test_stage_commands_select_what_they_say():
    shards = _stage_ids("gpu2")
    assert len(shards) == S.by_name("gpu2").shards == 2
    ids = [i for s in shards for i in s]
    assert len(ids) == len(set(ids)) and all(shards)        # shards are disjoint, none empty
    # gpu2: every GPU test file except the check, bench and examples ones (their own stages)
    assert ids and not [i for i in ids if i.startswith((
        "tests/gpu/test_check_gpu.py", "tests/gpu/test_bench_gpu.py",
        "tests/gpu/test_examples_gpu.py"))]
    assert "tests/gpu/test_comm_gpu.py::test_collective_matrix[1]" in ids
    assert "tests/gpu/test_fixes_gpu.py::test_nonblocking_split[2]" in ids
    assert any(i.startswith("tests/gpu/test_prepared_gpu.py") for i in ids)


def test_every_gpu_test_runs_in_exactly_the_stage_stage_of_names():
    """stage_of (the ledger's and the debt's idea of a test's stage) agrees with what the
    stages' own commands collect, and every GPU test is in one stage."""
    from ncclpy.selftest import debt
    stages = [s.name for s in S.STAGES if s.kind == "pytest"]
    runs = [(name, args) for name in stages for args in _shard_args(name)]
    with ThreadPoolExecutor(1) as pool, proc_speed.pytest_environ():
        _collect(*runs[0][1])                  # alone while the bytecode cache is empty
        tests_f = pool.submit(debt.collect_tests, str(ROOT))    # beside the shards' own
        ids = _collect_all(*((args, None) for _, args in runs))
        tests = tests_f.result()
    by_stage: dict = {}
    for (name, _), shard in zip(runs, ids):
        for i in shard:
            assert i not in by_stage, (i, by_stage.get(i), name)
            by_stage[i] = name
    assert {t["id"]: t["stage"] for t in tests} == by_stage
    assert len(by_stage) == len(tests) > 90


_MARKS_PLUGIN = """
import json, os
def pytest_collection_finish(session):
    out = []
    for item in session.items:
        t = item.get_closest_marker("timeout")
        out.append({"id": item.nodeid, "gpu": item.get_closest_marker("gpu") is not None,
                    "timeout": t.args[0] if t and t.args else None,
                    "worlds": sorted({a for m in item.iter_markers("gpu_world") for a in m.args})})
    with open(os.environ["MARKS_OUT"], "w") as f:
        json.dump(out, f)
"""


def test_every_gpu_test_has_an_explicit_bound_below_the_device_limit(tmp_path):
    (tmp_path / "marks_plugin.py").write_text(_MARKS_PLUGIN)
    out = tmp_path / "marks.json"
    env = {"MARKS_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get(
               "PYTHONPATH", "")])}
    _collect("tests/gpu", "-p", "marks_plugin", env_extra=env)
    items = [i for i in json.loads(out.read_text()) if i["gpu"]]
    assert len(items) > 40
    for i in items:
        assert i["timeout"] is not None and 0 < i["timeout"] <= 540, i
        assert i["worlds"], i
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import _gpu_common as G
        from _gpu_spawn import (SHORT_SPAWN_TIMEOUT, SHORT_TEST_TIMEOUT, SPAWN_TIMEOUT,
                                TEST_TIMEOUT)
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
    # a hung check is reported by its rank's watchdog before the spawn bound, which comes
    # before the test's mark
    assert G.HANG_S + 60 < SPAWN_TIMEOUT < TEST_TIMEOUT <= 540
    assert G.HANG_S + 60 < SHORT_SPAWN_TIMEOUT < SHORT_TEST_TIMEOUT <= 540


def test_checks_skipped_inside_a_passing_test_are_counted_and_reported(tmp_path):
    """Issue 21, defect 10: a GPU test whose sub-checks raised Skip passes, but its junit
    property ``skipped_checks`` says which did not run, and the report's block repeats it."""
    f = tmp_path / "j.xml"
    f.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                 '<testcase classname="tests.gpu.test_comm_gpu" name="test_collective_matrix[2]">'
                 '<properties><property name="skipped_checks" value="24: FP8 reductions need '
                 'compute capability &gt;= 9.0"/></properties></testcase>'
                 '</testsuite></testsuites>')
    c = P.junit_counts(str(f))
    assert (c["passed"], c["skipped"]) == (1, 0)
    assert c["skipped_checks"] == [{"id": "tests/gpu/test_comm_gpu.py::test_collective_matrix[2]",
                                    "checks": "24: FP8 reductions need compute capability >= 9.0"}]

