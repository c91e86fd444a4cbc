"""Spawning GPU test workers (``fn(rank, outdir)`` on n ranks) and reading what they recorded.

Time bounds, innermost first (each fires before the next, so the innermost one that applies
says what hung):

* ``_gpu_common.HANG_S`` (150 s): a rank's watchdog ends a check that makes no progress,
  recording its name;
* ``SPAWN_TIMEOUT`` (420 s): the pool (or ``ncclpy.spawn``) stops every rank and says so; the
  ranks' records are reported with it;
* ``TEST_TIMEOUT`` (480 s): pytest-timeout's mark on each test, the last resort;
* all below the device tool's 600 s per command.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SPAWN_TIMEOUT = 420.0
TEST_TIMEOUT = 480
#: a smaller spawn bound for the short workers (one or two checks)
SHORT_SPAWN_TIMEOUT = 240.0
SHORT_TEST_TIMEOUT = 300

Records = Tuple[List[Dict[str, Any]], List[str], str]
#: what each pooled rank does once, before its first task: imports and the CUDA context
WARM = "_gpu_common:warm_up"
#: variables read once per process (NCCL's parameters, CUDA's, the loader's, torch's and CuPy's
#: allocators, ncclpy's launch-time ones): a test that sets or removes one gets processes of its
#: own; so does one that sets a rendezvous variable (the pool's ranks keep their own)
_PER_PROCESS = ("NCCL_", "CUDA_", "LD_", "TORCH_", "PYTORCH_", "CUPY_", "PYTHON", "OMP_",
                "NCCLPY_MPS", "NCCLPY_TRACE_SIGNAL")


def _rank_vars() -> Tuple[str, ...]:
    from ncclpy.launch.env import RENDEZVOUS_VARS
    return tuple(RENDEZVOUS_VARS) + ("GROUP_RANK", "TORCHELASTIC_RUN_ID")


#: the environment the pytest process started with: pools start from it, whatever a test
#: changed when it happened to start one (less the GPU ledger's context, which names the test
#: running: a pooled rank records each task under the task's own)
BASE_ENV = {k: v for k, v in os.environ.items() if k != "NCCLPY_LEDGER_CONTEXT"}


def _task_env(pool: Any) -> Optional[Dict[str, str]]:
    """The variables this test changed against the pool's environment (for its task), or None
    when one of them is read once per process (the test then needs processes of its own)."""
    start = pool.start_environ or {**BASE_ENV, **pool.env}
    now = {**os.environ, "PYTHONPATH": pool.env.get("PYTHONPATH", "")}
    now.pop("NCCLPY_LEDGER_CONTEXT", None)
    changed = {k: v for k, v in now.items() if start.get(k) != v}
    removed = [k for k in start if k not in now]
    if removed or any(k.startswith(_PER_PROCESS) or k in _rank_vars() for k in changed):
        return None
    return changed


def spawn_records(fn: Callable[..., Any], n: int, outdir: str, monkeypatch: Any,
                  timeout: float = SPAWN_TIMEOUT, own: bool = False) -> Records:
    """Run ``fn(rank, outdir)`` on ``n`` ranks; (records, failure lines, launch error text).

    The ranks are this session's pool of ``n`` (tests/rank_pool.py: one start-up per world
    size) unless ``own`` is true, ``NCCLPY_GPU_POOL=0``, or the test changed a variable that is
    read once per process (``NCCL_*``, ``CUDA_*``, ...): then ``ncclpy.spawn`` starts ranks for
    this call alone.  Other variables set with ``monkeypatch.setenv`` reach the ranks either
    way."""
    import ncclpy
    from rank_pool import get_pool, pool_enabled
    path = os.pathsep.join(
        p for p in (HERE, os.path.dirname(HERE), ROOT, BASE_ENV.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    launch_error = ""
    pool = (get_pool(n, env={"PYTHONPATH": path}, warm=WARM, base_environ=BASE_ENV)
            if pool_enabled() and not own else None)
    task_env = _task_env(pool) if pool is not None else None
    if pool is not None and task_env is not None:
        try:
            res = pool.run(fn, [outdir], timeout=timeout, env=task_env,
                           context=os.environ.get("NCCLPY_LEDGER_CONTEXT"))
            launch_error = res.error_text()
        except Exception as e:  # the pool did not start: reported like a launch error
            launch_error = f"{type(e).__name__}: {e}"
        pooled = True
    else:
        pooled = False
    if not pooled:
        try:
            ncclpy.spawn(fn, n, args=(outdir,), timeout=timeout)
        except Exception as e:  # reported together with what the ranks recorded
            launch_error = f"{type(e).__name__}: {e}"
    records, failures = [], []
    for path in sorted(glob.glob(os.path.join(outdir, "rank*.jsonl"))):
        rank = os.path.basename(path)[4:-6]
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                rec["rank"] = rank
                records.append(rec)
                if not rec["ok"]:
                    failures.append(f"rank {rank} {rec['name']}:\n{rec.get('error', '')}")
    if pooled and failures and pool is not None:
        # a failed check may have left a communicator behind (a split child, a kernel still
        # waiting): the next test gets fresh processes, as it would without the pool
        pool.close()
    return records, failures, launch_error


def short_run(fn: Callable[..., Any], n: int, tmp_path_factory: Any, name: str,
              own: bool = False) -> Records:
    """A module fixture's body for the short workers: skip (with the reason) without a GPU,
    else :func:`spawn_records` of ``fn`` on ``n`` ranks into a fresh directory ``name``
    (``own``: processes of its own, not the pool's)."""
    import pytest
    from gpu_util import cuda_reason
    if cuda_reason():
        pytest.skip(cuda_reason())
    mp = pytest.MonkeyPatch()
    try:
        return spawn_records(fn, n, str(tmp_path_factory.mktemp(name)), mp,
                             timeout=SHORT_SPAWN_TIMEOUT, own=own)
    finally:
        mp.undo()


def report(failures: List[str], launch_error: str, limit: int = 25) -> str:
    head = f"{len(failures)} failed checks" + (f"; launch: {launch_error}" if launch_error else "")
    return head + "\n\n" + "\n\n".join(failures[:limit])


def skipped_checks(records: List[Dict[str, Any]]) -> Dict[str, str]:
    """name -> reason of the checks that raised Skip (on any rank): they did not run."""
    return {r["name"]: r["skip"] for r in records if r.get("skip")}


def assert_clean(run: Records, min_checks: int, node: Any = None) -> None:
    """No check failed, the launch went well, and at least ``min_checks`` distinct checks ran
    (a skipped check is not one).  Skipped checks are listed on ``node`` (pytest's item) as the
    junit property ``skipped_checks``, which the GPU proof's report shows."""
    records, failures, launch_error = run
    assert not failures and not launch_error, report(failures, launch_error)
    skipped = skipped_checks(records)
    names = {r["name"] for r in records if not r["name"].startswith("_")} - set(skipped)
    assert len(names) >= min_checks, f"only {len(names)} checks ran: {sorted(names)[:20]}"
    if skipped and node is not None:
        reasons = sorted(set(skipped.values()))
        node.user_properties.append(("skipped_checks",
                                     f"{len(skipped)}: " + "; ".join(reasons)[:500]))


def feature(run: Records, name: str, n: int) -> None:
    """Check ``name`` ran and passed on each of the ``n`` ranks."""
    import pytest
    records, failures, err = run
    mine = [r for r in records if r["name"] == name]
    bad = [f for f in failures if f.split(":", 1)[0].endswith(" " + name)]
    assert mine, f"check {name!r} never ran; " + report(failures, err)
    assert not bad, report(bad, err)
    skips = sorted({r["skip"] for r in mine if r.get("skip")})
    if skips:                           # it did not run: pytest counts it as skipped
        pytest.skip(f"{name}: " + "; ".join(skips))
    assert all(r["ok"] for r in mine) and len(mine) == n, mine


if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:          # tests/: rank_pool, gpu_util
    sys.path.insert(0, os.path.dirname(HERE))
