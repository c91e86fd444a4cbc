"""examples/ on a GPU (marker ``gpu``): every script runs both ways the seeds launch -- plainly
(it spawns its own ranks with ncclpy.spawn) and under ``ncclpy run -n N`` -- with several ranks
on one GPU, and the values it prints (parsed, not compared as text) equal the tutorial's
(ncclpy.check.seed_examples) or, for the lessons beyond the seed table,
ncclpy.reference's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_util import requires_gpu
from ncclpy.semantics import reference as R
from ncclpy.check import seed_examples as S

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import _common  # noqa: E402

SCRIPTS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
#: one example run is bounded by RUN_TIMEOUT_S, each test by its mark (TEST_TIMEOUT_S); both
#: below the device tool's 600 s
RUN_TIMEOUT_S = 420
TEST_TIMEOUT_S = 480
MISSING = object()


def _module(script: Path):
    return _common.load_example(str(script))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for v in ("NCCLPY_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
              "PMI_RANK"):
        env.pop(v, None)
    return env


def _run(cmd: list) -> str:
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert res.returncode == 0, (f"{' '.join(cmd)} exited {res.returncode}\n"
                                 f"--- stdout\n{res.stdout[-6000:]}\n--- stderr\n"
                                 f"{res.stderr[-6000:]}")
    return res.stdout


# --------------------------------------------------------------------------- checks

def _check_seed_key(results: dict, key: str) -> None:
    e = S.get(key)
    want = e.expected_outputs()
    for r in range(e.world_size):
        got = results.get((key, r), MISSING)
        assert got is not MISSING, f"{key}: rank {r} printed no result"
        if want[r] is None:
            continue
        w = np.asarray(want[r])
        g = np.asarray(got, dtype=w.dtype)
        assert g.shape == w.shape and np.array_equal(g, w), f"{key} rank {r}: {got} != {w}"


def _check_errors(errors: dict, label: str, ranks, words) -> None:
    for r in ranks:
        msg = errors.get((label, r))
        assert msg is not None, f"{label}: rank {r} printed no error"
        low = msg.lower()
        assert any(w in low for w in words), f"{label} rank {r}: unclear error {msg!r}"


def _check_barrier(results: dict) -> None:
    e = S.get("E29")
    times = [results[("E29", r)] for r in range(e.world_size)]
    slowest = e.expected_outputs()[0]                     # 2.0 s
    assert all(slowest - 0.05 <= t <= slowest + 2.0 for t in times), times
    assert max(times) - min(times) < 0.5, f"ranks did not leave together: {times}"


def _check_bandwidth(results: dict) -> None:
    n = S.get("E33").world_size
    for r in range(n):
        d = results[("E33", r)]
        for k in ("bytes", "one_call_s", "seed003_GiBps", "time_per_iter_s", "algbw_GBps",
                  "busbw_GBps"):
            assert d[k] > 0, (r, d)
        assert d["busbw_GBps"] == pytest.approx(d["algbw_GBps"] * 2 * (n - 1) / n, rel=1e-4)
        seed = S.busbw_003(d["bytes"], d["one_call_s"], n) / 1024 ** 3
        assert d["seed003_GiBps"] == pytest.approx(seed, rel=1e-4)


def _check_section(script: Path, eid: str, text: str) -> None:
    results = _common.collect(text, "result")
    errors = _common.collect(text, "error")
    inputs = _common.collect(text, "input")
    mod = _module(script)
    if eid == "E29":
        return _check_barrier(results)
    if eid == "E33":
        return _check_bandwidth(results)
    if eid == "E11.uneven":
        n = 4
        ins = [mod.uneven_input(r, n) for r in range(n)]
        outs = R.all_to_all(ins, send_counts=[mod.uneven_send_counts(s, n) for s in range(n)])
        for r in range(n):
            assert np.array_equal(np.asarray(results[(eid, r)], np.float32), outs[r]), r
        return
    if eid == "OPS":
        for label, want in mod.EXPECTED.items():
            for r in range(4):
                assert np.array_equal(np.asarray(results[(label, r)], np.float32),
                                      np.asarray(want, np.float32)), (label, r)
        for name in mod.BITWISE:
            _check_errors(errors, f"OPS.{name}", range(4), ("bitwise",))
        return
    keys = [e.key for e in S.EXAMPLES if e.id == eid]
    assert keys, f"{eid} is not in the seed table"
    for key in keys:
        _check_seed_key(results, key)
    if eid == "E34":      # random inputs: every rank holds all six inputs, in rank order
        printed = [inputs[("E34", r)] for r in range(6)]
        for r in range(6):
            assert results[("E34", r)] == printed, r
    if eid == "E2":       # column views refused on the root, before any NCCL call
        _check_errors(errors, "E2", [0], ("contiguous", "stride"))
    if eid in ("E4", "E10", "E12"):
        _check_errors(errors, eid, range(S.get(eid).world_size), ("contiguous", "stride"))


def _check_run(script: Path, text: str, world_sizes) -> None:
    mod = _module(script)
    ran = [s for s in mod.SECTIONS if s.world_size in world_sizes]
    assert ran, f"{script.name}: nothing to run for {world_sizes}"
    for s in ran:
        _check_section(script, s.eid, text)


# --------------------------------------------------------------------------- tests

def _params(main_only: bool) -> list:
    """One param per script, marked with the world sizes the run spawns (gpu_world)."""
    out = []
    for script in SCRIPTS:
        sections = _module(script).SECTIONS
        worlds = [sections[0].world_size] if main_only else sorted(
            {s.world_size for s in sections})
        out.append(pytest.param(script, id=script.name, marks=pytest.mark.gpu_world(*worlds)))
    return out


@requires_gpu
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("script", _params(main_only=False))
def test_example_standalone_spawn(script):
    """``python examples/x.py``: the script spawns every world size it needs."""
    text = _run([sys.executable, str(script)])
    _check_run(script, text, {s.world_size for s in _module(script).SECTIONS})


@requires_gpu
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("script", _params(main_only=True))
def test_example_under_ncclpy_run(script):
    """``ncclpy run -n N python examples/x.py`` at the script's main world size; the sections
    written for other world sizes are skipped with the command that runs them."""
    sections = _module(script).SECTIONS
    n = sections[0].world_size
    text = _run([sys.executable, "-m", "ncclpy", "run", "-n", str(n), sys.executable,
                 str(script)])
    _check_run(script, text, {n})
    for s in sections:
        if s.world_size != n:
            assert f"{s.eid} skipped" in text and f"ncclpy run -n {s.world_size}" in text, s.eid
