"""The selftest's scheduler with real subprocesses (harmless commands, never a pretend GPU):
shared stages run side by side within ``jobs`` and the rank capacity, the timed ones alone and
after them with their minimum kept back, a sharded pytest stage counts every shard, the order
of a default run follows the GPU debt, and Ctrl-C stops everything that runs."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ncclpy.selftest import gpuenv, order, schedule as SC, stages as S
from sigint_util import sigint_handled
from wait_util import HANG

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(240)


def _ctx(tmp_path: Path) -> S.Ctx:
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    return S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp))


_SPAN = ("import os, sys, time; f = open(sys.argv[1], 'a'); "
         "f.write(f'{sys.argv[2]} start {time.time()} {os.environ.get(\"X_SEEN\", \"-\")}\\n');"
         " f.flush(); time.sleep(float(sys.argv[3])); f.write(f'{sys.argv[2]} end {time.time()}"
         "\\n')")


def _span(tmp_path: Path, name: str, seconds: float, ranks: int = 1, exclusive: bool = False,
          min_s: float = 0.5, timeout: float = 60) -> S.Stage:
    return S.Stage(name, f"span {name}", "cmd", timeout, min_s,
                   args=("-c", _SPAN, str(tmp_path / "spans.txt"), name, str(seconds)),
                   ranks=ranks, exclusive=exclusive)


def _spans(tmp_path: Path) -> dict:
    out: dict = {}
    for line in (tmp_path / "spans.txt").read_text().splitlines():
        name, what, t, *rest = line.split()
        out.setdefault(name, {})[what] = float(t)
        if rest:
            out[name]["seen"] = rest[0]
    return out


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_shared_stages_run_side_by_side_and_timed_ones_alone_after_them(tmp_path):
    stages = [_span(tmp_path, "a", 2), _span(tmp_path, "b", 2), _span(tmp_path, "c", 2),
              _span(tmp_path, "timed", 1, exclusive=True)]
    res, interrupted = SC.run_stages(stages, _ctx(tmp_path), str(ROOT), 120,
                                     say=lambda s: None, jobs=3, capacity=8,
                                     env_for=lambda s: {"X_SEEN": s.name})
    assert not interrupted and [r.status for r in res] == ["passed"] * 4
    sp = _spans(tmp_path)
    # the three shared ones at once (each pair overlaps: not one after another), the timed one
    # alone after them -- read from the stages' own spans, not from the run's duration
    assert _overlap(sp["a"], sp["b"]) and _overlap(sp["b"], sp["c"]) and _overlap(sp["a"], sp["c"])
    assert sp["timed"]["start"] >= max(sp[n]["end"] for n in "abc")     # alone, after them
    assert {n: sp[n]["seen"] for n in sp} == {n: n for n in sp}        # env_for reached each


def test_one_job_runs_one_stage_after_another(tmp_path):
    stages = [_span(tmp_path, "a", 1), _span(tmp_path, "b", 1)]
    res, _ = SC.run_stages(stages, _ctx(tmp_path), str(ROOT), 120, say=lambda s: None, jobs=1)
    sp = _spans(tmp_path)
    assert not _overlap(sp["a"], sp["b"]) and [r.status for r in res] == ["passed", "passed"]


def test_the_rank_capacity_holds_a_big_stage_back_and_a_small_one_fills_in(tmp_path):
    stages = [_span(tmp_path, "big1", 2, ranks=3), _span(tmp_path, "big2", 1, ranks=3),
              _span(tmp_path, "small", 1, ranks=1)]
    said: list = []
    res, _ = SC.run_stages(stages, _ctx(tmp_path), str(ROOT), 120, say=said.append, jobs=4,
                           capacity=4)
    sp = _spans(tmp_path)
    assert not _overlap(sp["big1"], sp["big2"])          # 3 + 3 ranks > 4: never together
    assert _overlap(sp["big1"], sp["small"])             # 3 + 1 fits: it did not wait
    assert all(r.status == "passed" for r in res)
    starts = [s.split(":")[0] for s in said if "(bound" in s]
    assert starts == ["[selftest] big1", "[selftest] small", "[selftest] big2"], said


def test_the_timed_stages_minimum_is_kept_back_from_the_shared_phase(tmp_path):
    budget = S.RESERVE_S + 6
    stages = [_span(tmp_path, "long", 30, timeout=60), _span(tmp_path, "timed", 0.1,
                                                             exclusive=True, min_s=3)]
    res, _ = SC.run_stages(stages, _ctx(tmp_path), str(ROOT), budget, say=lambda s: None,
                           jobs=2, grace_s=1)
    assert res[0].status == "did not finish" and res[0].timeout_s <= 3.01
    assert res[1].status == "passed"                      # its 3 s were kept for it


_TESTS = """
import pytest
pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("i", range(5))
def test_n(i):
    assert i != 3, "three"
"""


def test_a_sharded_pytest_stage_runs_each_test_once_and_adds_the_shards_up(tmp_path):
    d = tmp_path / "gpu"
    d.mkdir()
    (d / "conftest.py").write_text((ROOT / "tests" / "gpu" / "conftest.py").read_text())
    (d / "test_sharded.py").write_text(_TESTS)
    st = S.Stage("sharded", "a sharded sample", "pytest", 60, 1, ranks=1, shards=2,
                 paths=(str(d),))
    ctx = _ctx(tmp_path)
    res, _ = SC.run_stages([st], ctx, str(ROOT), 120, say=lambda s: None, jobs=2)
    r = res[0]
    assert r.status == "failed" and len(r.commands) == 2
    assert {c["shard"] for c in r.commands} == {1, 2}
    c = r.counts
    assert (c["passed"], c["failed"], c["total"]) == (4, 1, 5), c
    assert c["failures"][0]["id"].endswith("test_n[3]")
    assert sorted(f for f in os.listdir(ctx.work) if f.endswith(".xml")) == [
        "00-sharded.s1.xml", "00-sharded.s2.xml"]


def test_ctrl_c_stops_every_stage_that_runs(tmp_path):
    stages = [_span(tmp_path, "a", 60), _span(tmp_path, "b", 60), _span(tmp_path, "later", 1,
                                                                        exclusive=True)]

    def interrupt() -> None:
        for _ in range(200):
            p = tmp_path / "spans.txt"
            if p.exists() and p.read_text().count("start") >= 2:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    with sigint_handled():            # SIGINT raises KeyboardInterrupt, however pytest started
        th = threading.Thread(target=interrupt, daemon=True)
        th.start()
        t0 = time.monotonic()
        res, interrupted = SC.run_stages(stages, _ctx(tmp_path), str(ROOT), 120,
                                         say=lambda s: None, jobs=2, grace_s=2)
        th.join(5)
    assert interrupted and time.monotonic() - t0 < HANG      # not the stages' 60 s
    assert [r.status for r in res] == ["interrupted", "interrupted", "not run"]
    assert res[2].reason == "the run was interrupted first"


def test_a_default_run_orders_the_stages_by_debt_then_expected_time(tmp_path):
    from ncclpy.selftest import ledger as L
    doc = L.empty()
    tests_ok = ["tests/gpu/test_check_gpu.py::test_check_on_one_gpu_is_bitwise[4]"]
    L.update(doc, "r1", {"files": L.tree_hashes(str(ROOT))},
             {t: {"stage": "check4", "outcome": "passed", "seconds": 100.0, "files": []}
              for t in tests_ok})
    path = tmp_path / "ledger.json"
    L.save(doc, str(path))
    ordered, tests, note = order.order_stages(S.select(None), str(ROOT), str(path))
    names = [s.name for s in ordered]
    assert names[0] == "info" and tests
    assert names.index("check4") > names.index("gpu2")     # proven: last among equals
    assert names.index("examples") < names.index("check4")
    assert "GPU debt before the run:" in note and "stages by debt: info," in note
    fixed, _, note2 = order.order_stages(S.select(["check4", "gpu2"]), str(ROOT), str(path),
                                         by_debt=False)
    assert [s.name for s in fixed] == ["info", "gpu2", "check4"] and "(--stage)" in note2


def test_run_environment_without_a_gpu_sets_no_cta_limit_and_no_daemon(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = gpuenv.prepare(4, 12, dict(os.environ, PATH="/nonexistent"))
    assert env.shared_env == {} and env.mps is None
    assert env.notes["mps"].startswith("not available") and "not set" in env.notes["max_ctas"]
    mine = gpuenv.prepare(4, 12, dict(os.environ, NCCL_MAX_CTAS="7", PATH="/nonexistent"))
    assert mine.notes["max_ctas"] == "7 (yours, kept)" and mine.shared_env == {}
    assert gpuenv.default_jobs(16) == 8 and gpuenv.default_jobs(2) == 1
    assert gpuenv.default_capacity(16) == 14 and gpuenv.default_capacity(2) == 4
    json.dumps(env.notes)


def test_a_stage_that_kills_ranks_runs_outside_the_shared_mps_server():
    # 2026-11-27, H200: a rank SIGKILLed with a kernel in flight (worlds34) faulted every
    # client of the run's one MPS server; such stages get a pipe folder with no daemon in it
    env = gpuenv.RunEnv(4, 12, shared_env={"NCCL_MAX_CTAS": "4"},
                        all_env={"CUDA_MPS_PIPE_DIRECTORY": "/tmp/d/pipe",
                                 "CUDA_MPS_LOG_DIRECTORY": "/tmp/d/log"},
                        unset=("CUDA_VISIBLE_DEVICES",))
    shared = env.env_for(False)
    assert shared["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/d/pipe" and "NCCLPY_MPS" not in shared
    own = env.env_for(False, kills_ranks=True)
    empty = own["CUDA_MPS_PIPE_DIRECTORY"]
    assert empty != "/tmp/d/pipe" and os.path.isdir(empty) and os.listdir(empty) == []
    assert own["CUDA_MPS_LOG_DIRECTORY"] is None and own["NCCLPY_MPS"] == "off"
    assert own["NCCL_MAX_CTAS"] == "4" and own["CUDA_VISIBLE_DEVICES"] is None
    assert env.env_for(False, kills_ranks=True)["CUDA_MPS_PIPE_DIRECTORY"] == empty   # one folder
    env.close()
    assert not os.path.exists(empty) and env.no_mps_dir is None
    killers = {s.name for s in S.STAGES if s.kills_ranks}
    assert killers == {"worlds34", "part2", "forensics"}
    for test_id, worlds in (
            ("tests/gpu/test_watchdog_gpu.py::test_killed_rank_aborts_the_others_with_a_named_"
             "error", [3]),
            ("tests/gpu/test_part2_gpu.py::test_shrink_after_a_sigkilled_rank_and_carry_on", [3]),
            ("tests/gpu/test_forensics_gpu.py::test_gpu_a_stopped_rank_is_suspected_and_its_dump_"
             "missing", [3])):
        assert S.stage_of(test_id, worlds) in killers, test_id


def test_under_an_exclusive_compute_mode_the_killing_stages_stay_mps_clients(monkeypatch):
    # review, 2026-11-27: in Exclusive_Process only the MPS server may hold a context, so a
    # stage sent outside the server could not use the GPU at all
    from ncclpy.launch import mps as M

    class _Daemon:
        def stop(self, keep_logs=False):
            return None

    def fake_setup(mode, shared, env, name="--mps"):
        return M.MpsSetup("started", {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/d/pipe"}, (), _Daemon())

    monkeypatch.setattr(M, "setup_mps", fake_setup)
    default = gpuenv.prepare(4, 12, {"PATH": "/nonexistent"}, modes=lambda: ["Default"])
    assert default.isolate and default.env_for(False, True)["NCCLPY_MPS"] == "off"
    default.close()
    excl = gpuenv.prepare(4, 12, {"PATH": "/nonexistent"},
                          modes=lambda: ["Default", "Exclusive_Process"])
    own = excl.env_for(False, kills_ranks=True)
    assert not excl.isolate and "NCCLPY_MPS" not in own
    assert own["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/d/pipe" and excl.no_mps_dir is None
    assert "compute mode Exclusive_Process" in excl.notes["mps"], excl.notes
    excl.close()
