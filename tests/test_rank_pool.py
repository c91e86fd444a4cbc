"""The rank pool the GPU tests share (tests/rank_pool.py), on CPU with real processes: reuse
(one start-up, many tasks, a fresh rendezvous each, torch gloo and ncclpy on its CPU
backend), crash recovery (the task that broke the pool is reported, the next one runs on new
processes), and isolation (nothing a task changes reaches the next).

Each scenario has a pool of its own; those that need neither this process's signals nor its
environment run side by side on threads (:func:`scenarios`: they spend much of their time
waiting, on a timeout, a rank's death, a pool's start), and their tests check how each went."""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import pool_tasks as T  # noqa: E402
from rank_pool import RankPool  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("rank_pool")]


def _env() -> dict:
    return {"PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]),
            "NCCLPY_MPS": "off"}


def _read(d, n):
    return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(n)]


def _pool() -> RankPool:
    return RankPool(2, env=_env(), abandon_s=2.0)


@pytest.fixture
def pool():
    p = _pool()
    yield p
    p.close()


#: the scenarios that run on threads (test name -> its body, given a pool and a folder)
_THREADED: Dict[str, Callable[..., None]] = {}


def _threaded(body: Callable[..., None]) -> Callable[..., None]:
    _THREADED[body.__name__] = body
    return body


def _in_own_pool(body: Callable[..., None], tmp_path) -> None:
    p = _pool()
    try:
        body(p, tmp_path)
    finally:
        p.close()


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> Iterator[Dict[str, Future]]:
    """The threaded scenarios, three at a time, each with its own pool and folder (see the
    module docstring); a test waits for its own, whose assertion errors it raises."""
    tmps = {name: tmp_path_factory.mktemp(name[:30]) for name in _THREADED}
    with ThreadPoolExecutor(3) as workers:
        yield {name: workers.submit(_in_own_pool, body, tmps[name])
               for name, body in _THREADED.items()}


class _Cut(BaseException):
    """What pytest-timeout raises into a test that ran out of time."""


def test_a_caller_cut_off_mid_task_leaves_no_rank_running_the_task(scenarios, pool, tmp_path):
    """(Here first: on this thread, whose signals it uses, while the scenarios run.)"""
    import signal

    def cut(signum, frame):
        raise _Cut()
    old = signal.signal(signal.SIGALRM, cut)
    try:
        pool.run(T.report, [str(tmp_path)], timeout=60)      # started, warm
        pids = pool.pids
        signal.alarm(2)
        with pytest.raises(_Cut):
            pool.run(T.sleep, [str(tmp_path), 60], timeout=120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not pool.alive
    for pid in pids:                    # stopped, not left sleeping in the old task
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split(") ")[1][0] in "ZX"
    res = pool.run(T.report, [str(tmp_path)], timeout=60)
    assert res.ok and res.started


def test_one_start_up_many_tasks_each_with_its_own_rendezvous(scenarios):
    scenarios["_one_start_up_many_tasks_each_with_its_own_rendezvous"].result()


@_threaded
def _one_start_up_many_tasks_each_with_its_own_rendezvous(pool, tmp_path):
    runs = []
    for i, fn in enumerate((T.report, T.gloo_sum, T.cpu_all_reduce, T.report)):
        d = tmp_path / f"t{i}"
        d.mkdir()
        res = pool.run(fn, [str(d)], timeout=120, env={"POOL_TASK_VAR": str(i)})
        assert res.ok, res.error_text()
        assert res.started == (i == 0)
        runs.append(_read(str(d), 2))
    assert pool.starts == 1 and pool.tasks == 4
    pids = {tuple(r["pid"] for r in run) for run in runs}
    assert len(pids) == 1 and len(set(next(iter(pids)))) == 2     # the same two processes
    assert [r["sum"] for r in runs[1]] == [3.0, 3.0]               # gloo: 1 + 2 on both ranks
    assert [(r["rank"], r["n"]) for r in runs[2]] == [(0, 2), (1, 2)]   # ncclpy communicator
    assert [r["sum"] for r in runs[2]] == [3.0, 3.0]               # on the CPU backend
    first, last = runs[0], runs[3]
    assert first[0]["store_port"] == first[1]["store_port"]        # one store per task ...
    assert first[0]["store_port"] != last[0]["store_port"]         # ... a new one each task
    assert first[0]["token"] != last[0]["token"]
    assert [r["rank_env"] for r in first] == ["0", "1"]
    assert [r["task_var"] for r in first] == ["0", "0"] and last[0]["task_var"] == "3"


def test_a_dead_rank_is_reported_and_the_next_task_gets_new_processes(scenarios):
    scenarios["_a_dead_rank_is_reported_and_the_next_task_gets_new_processes"].result()


@_threaded
def _a_dead_rank_is_reported_and_the_next_task_gets_new_processes(pool, tmp_path):
    res = pool.run(T.report, [str(tmp_path)], timeout=60)
    before = res.pids
    res = pool.run(T.die, [str(tmp_path)], timeout=60)
    assert not res.ok and "rank 1" in res.broken and "exit code 7" in res.broken, res.broken
    assert not pool.alive
    d = tmp_path / "after"
    d.mkdir()
    res = pool.run(T.report, [str(d)], timeout=60)
    assert res.ok and res.started, res.error_text()
    assert set(res.pids).isdisjoint(before) and pool.starts == 2
    assert [r["pid"] for r in _read(str(d), 2)] == res.pids


def test_an_exception_ends_the_blocked_peers_and_carries_the_traceback(scenarios):
    scenarios["_an_exception_ends_the_blocked_peers_and_carries_the_traceback"].result()


@_threaded
def _an_exception_ends_the_blocked_peers_and_carries_the_traceback(pool, tmp_path):
    res = pool.run(T.raise_one, [str(tmp_path)], timeout=60)
    assert not res.ok and not res.outcomes[0].ok
    assert "ValueError: boom on rank 0" in res.outcomes[0].error
    assert "still running" in res.broken and "1" in res.broken, res.broken
    assert res.seconds < 30                       # abandon_s, not the task's timeout
    res = pool.run(T.report, [str(tmp_path)], timeout=60)
    assert res.ok and res.started


def test_a_task_past_its_timeout_is_stopped(scenarios):
    scenarios["_a_task_past_its_timeout_is_stopped"].result()


@_threaded
def _a_task_past_its_timeout_is_stopped(pool, tmp_path):
    # the pool started first: a task's timeout counts the start-up of a pool it starts, and
    # 3 s is to time the task, not two processes starting on a loaded machine
    assert pool.run(T.sleep, [str(tmp_path), 0], timeout=120).ok
    res = pool.run(T.sleep, [str(tmp_path), 60], timeout=3)
    assert not res.ok and "timeout=3 s passed" in res.broken and res.seconds < 20
    assert pool.run(T.sleep, [str(tmp_path), 0], timeout=30).ok


def test_what_a_task_changes_does_not_reach_the_next(scenarios):
    scenarios["_what_a_task_changes_does_not_reach_the_next"].result()


@_threaded
def _what_a_task_changes_does_not_reach_the_next(pool, tmp_path):
    pytest.importorskip("torch")
    d = tmp_path / "mess"
    d.mkdir()
    res = pool.run(T.leave_a_mess, [str(d)], timeout=120)
    assert res.ok, res.error_text()
    notes = " ".join(n for o in res.outcomes for n in o.notes)
    assert "torch process group" in notes and "working directory" in notes, notes
    d2 = tmp_path / "clean"
    d2.mkdir()
    res = pool.run(T.report, [str(d2)], timeout=60)
    assert res.ok and not res.started
    for r in _read(str(d2), 2):
        assert r["leak"] is None and r["cwd"] == os.getcwd(), r
    assert pool.run(T.gloo_sum, [str(d2)], timeout=120).ok       # a new group can start


def test_a_task_that_leaves_a_communicator_running_passes_and_retires_its_pool(scenarios):
    scenarios["_a_task_that_leaves_a_communicator_running_passes_and_retires_its_pool"].result()


@_threaded
def _a_task_that_leaves_a_communicator_running_passes_and_retires_its_pool(pool, tmp_path):
    res = pool.run(T.leave_a_thread, [str(tmp_path)], timeout=60)
    assert res.ok and all(o.unclean == ["ncclpy-watchdog-left"] for o in res.outcomes)
    assert not pool.alive and pool.retired == [
        "pool_tasks:leave_a_thread: left ncclpy-watchdog-left running"]
    assert pool.run(T.report, [str(tmp_path)], timeout=60).started


def test_only_module_level_functions_and_json_arguments(pool, tmp_path):
    with pytest.raises(ValueError, match="module-level"):
        pool.run(lambda r: None, [], timeout=5)
    with pytest.raises(TypeError):
        pool.run(T.report, [object()], timeout=5)
    assert not pool.alive                          # nothing was started for either


def test_spawn_records_uses_the_pool_unless_the_environment_differs(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(HERE, "gpu"))
    import _gpu_spawn as G
    from rank_pool import close_pools
    try:
        a, _, err = G.spawn_records(T.report, 2, str(tmp_path), monkeypatch, timeout=60)
        assert not err, err
        pids1 = [r["pid"] for r in _read(str(tmp_path), 2)]
        G.spawn_records(T.report, 2, str(tmp_path), monkeypatch, timeout=60)
        pids2 = [r["pid"] for r in _read(str(tmp_path), 2)]
        assert pids1 == pids2                       # the same pool
        monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")   # NCCL reads it once per process
        G.spawn_records(T.report, 2, str(tmp_path), monkeypatch, timeout=60)
        pids3 = [r["pid"] for r in _read(str(tmp_path), 2)]
        assert set(pids3).isdisjoint(pids1)        # processes of its own
    finally:
        close_pools()
