"""examples/ on the CPU backend, no GPU: every script runs both ways the seeds launch --
``ncclpy run --cpu -n N python examples/x.py --only <ids>`` for each world size it uses, and
``python examples/x.py --cpu`` (it spawns its own ranks) -- and every value it prints (results,
inputs, errors) is compared with what tests/test_examples_cpu.py derives from the example's own
input builders, the seed table and the numpy reference.  Nothing printed goes unchecked: a
result, input or error line that no expectation accounts for fails the test.

The runs are independent and spend part of their time waiting (ranks starting, rendezvous, the
barrier's sleeps): :func:`runs` starts the selected tests' commands three at a time, in the
tests' order, and each test checks its own runs' output."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest

from ncclpy.semantics import reference as R
from ncclpy.check import seed_examples as S
from test_examples_cpu import (INPUTS, MODULES, ROOT, SCRIPTS, _common, _env as _plain_env,
                               _example_inputs)
from wait_util import HANG

#: one script run is bounded by RUN_TIMEOUT_S (the slowest, 02_all_gather.py, takes ~6-10 s on 2
#: cores); the file's 36 runs take 2 to 2.5 minutes there, other jobs running beside
RUN_TIMEOUT_S = 120
pytestmark = [pytest.mark.timeout(4 * RUN_TIMEOUT_S),
              pytest.mark.xdist_group("examples_on_cpu_backend")]
#: how many of this file's runs go at once (each is several processes)
AT_ONCE = 3
#: the errors the examples show on purpose: (label, ranks that print it, a word it must say)
ERRORS = {"E2": ([0], "contiguous"), "E4": (range(4), "contiguous"),
          "E10": (range(4), "contiguous"), "E12": (range(4), "contiguous"),
          **{f"OPS.{op}": (range(4), "bitwise") for op in ("band", "bor", "bxor")}}


def _env() -> dict:
    env = _plain_env()
    for v in ("NCCLPY_DEVICE", "NCCLPY_MPS", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        env.pop(v, None)
    return env


def _exec(cmd: list, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def _ok(cmd: list, res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, (f"{' '.join(map(str, cmd))} exited {res.returncode}\n--- stdout\n"
                                 f"{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}")
    assert "Traceback" not in res.stderr, res.stderr
    return res


def _sizes(script: Path) -> dict:
    """{world size: [ids]} in the order the script spawns them."""
    out: dict = {}
    for s in MODULES[script.name].SECTIONS:
        out.setdefault(s.world_size, []).append(s.eid)
    return out


# --------------------------------------------------------------------------- expectations

def _same(got, want) -> bool:
    w = np.asarray(want)
    g = np.asarray(got, dtype=w.dtype)
    return g.shape == w.shape and np.array_equal(g, w)


def _builders(eid: str) -> dict:
    """{printed input label: the example's input builder (rank, world)} of one section."""
    if eid == "OPS":
        return {"OPS": INPUTS["OPS.sum"][1]}
    return {k: fn for k, (_, fn) in INPUTS.items() if k == eid or k.startswith(eid + "-")}


def _expected(script: Path, eid: str) -> dict:
    """{(label, rank): result} for one section; None means the rank holds no result (printed
    null) or, NCCL never writing a non-root buffer, still holds its input."""
    mod = MODULES[script.name]
    if eid == "E11.uneven":
        n = 4
        ins = [mod.uneven_input(r, n) for r in range(n)]
        outs = R.all_to_all(ins, send_counts=[mod.uneven_send_counts(s, n) for s in range(n)])
        return {(eid, r): outs[r] for r in range(n)}
    if eid == "OPS":
        return {(label, r): np.asarray(v, np.float32)
                for label, v in mod.EXPECTED.items() for r in range(4)}
    out = {}
    for e in S.EXAMPLES:
        if e.id == eid:
            want = (e.expected_outputs() if e.collective == "barrier" or
                    e.extra.get("benchmark") else e.expected_outputs(_example_inputs(e)))
            out.update({(e.key, r): w for r, w in enumerate(want)})
    assert out, f"{eid}: no expectation"
    return out


def _check_section(script: Path, eid: str, world: int, text: str, seen: dict) -> None:
    results, builders = _expected(script, eid), _builders(eid)
    printed = _common.collect(text, "result")
    inputs = _common.collect(text, "input")
    errors = _common.collect(text, "error")
    if eid == "E29":                       # barrier: every rank leaves after the slowest (2 s)
        # a barrier that let a rank go before rank 2 arrived (2 s after the start) would print
        # rank 1's arrival (1 s) or less; 0.5 s: the skew the ranks' first barrier leaves
        # between their clocks' starts on a loaded machine.  No upper bound but a hang's: how
        # soon and how together they leave is a speed, not the barrier's contract.
        times = [printed[("E29", r)] for r in range(world)]
        assert all(2.0 - 0.5 <= t < HANG for t in times), times
    elif eid == "E33":                     # bandwidth: the figures' algebra, 4 MiB on the CPU
        for r in range(world):
            d = printed[("E33", r)]
            assert d["bytes"] == 4 * MODULES[script.name].CPU_ELEMENTS and d["iters"] == 10, d
            assert all(d[k] > 0 for k in d), d
            assert d["busbw_GBps"] == pytest.approx(d["algbw_GBps"] * 2 * (world - 1) / world,
                                                    rel=1e-4)
            assert d["seed003_GiBps"] == pytest.approx(
                S.busbw_003(d["bytes"], d["one_call_s"], world) / 1024 ** 3, rel=1e-4)
    for (label, r), want in results.items():
        if label in ("E29", "E33"):
            seen["result"].add((label, r))
            continue
        assert (label, r) in printed, f"{label}: rank {r} printed no result"
        got = printed[(label, r)]
        seen["result"].add((label, r))
        if want is None:
            own = builders.get(label)
            assert got is None or (own is not None and _same(got, own(r, world))), \
                f"{label} rank {r}: printed {got}, expected null or its own input"
        else:
            assert _same(got, want), f"{label} rank {r}: printed {got}, expected {want.tolist()}"
    for label, build in builders.items():      # every input printed is the builder's
        for r in range(world):
            if (label, r) in inputs:
                seen["input"].add((label, r))
                assert _same(inputs[(label, r)], build(r, world)), (label, r, inputs[(label, r)])
        if any(lb == label for lb, _r in inputs):   # a rank with an input printed it
            assert {r for lb, r in inputs if lb == label} == {
                r for r in range(world) if build(r, world) is not None}, label
    if eid == "E34":                       # seeded randn inputs: everyone holds all six
        assert all(printed[("E34", r)] == [inputs[("E34", i)] for i in range(6)]
                   for r in range(6))
    for label, (ranks, word) in ERRORS.items():
        if label == eid or label.startswith(eid + "."):
            for r in ranks:
                msg = errors.get((label, r))
                assert msg is not None and word in msg.lower(), (label, r, msg)
                seen["error"].add((label, r))


def _check_run(script: Path, text: str, worlds: dict) -> None:
    """Every section of the world sizes run checked, and nothing printed left over."""
    seen: dict = {"result": set(), "input": set(), "error": set()}
    for world, ids in worlds.items():
        for eid in ids:
            try:
                _check_section(script, eid, world, text, seen)
            except AssertionError as e:
                raise AssertionError(f"{script.name} {eid}: {e}\n--- the output\n{text}") from e
    for kind in seen:
        extra = set(_common.collect(text, kind)) - seen[kind]
        assert not extra, f"{script.name}: {kind} lines no expectation accounts for: {extra}"
    assert seen["result"], f"{script.name}: no result checked"


# --------------------------------------------------------------------------- the runs

def _spawned_cmd(script: Path) -> list:
    return [sys.executable, str(script.relative_to(ROOT)), "--cpu"]


def _run_cpu_cmd(script: Path, n: int, ids: list) -> list:
    return [sys.executable, "-m", "ncclpy", "run", "--cpu", "-n", str(n), sys.executable,
            str(script.relative_to(ROOT)), "--only", ",".join(ids)]


_SKIPPED_CMD = [sys.executable, "-m", "ncclpy", "run", "--cpu", "-n", "3", sys.executable,
                "examples/08_broadcast.py"]
_REFUSED_CMD = [sys.executable, "-m", "ncclpy", "run", "-n", "2", sys.executable,
                "examples/09_send_recv.py", "--cpu"]


def _no_cupy_env(tmp: Path) -> dict:
    """This file's environment with a ``cupy`` that cannot be imported first on the path."""
    fake = tmp / "cupy"
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('no CuPy on this machine (test)')\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp}{os.pathsep}{env['PYTHONPATH']}"
    return env


def _no_cupy_cmds() -> list:
    rel = str(SCRIPTS[8].relative_to(ROOT))
    return [[sys.executable, "-m", "ncclpy", "run", "--cpu", "-n", "2", sys.executable, rel],
            [sys.executable, rel, "--cpu"]]


def _commands(test: str, script: Optional[Path], tmp: Path) -> List[Tuple[Any, list, Any]]:
    """(key, command, environment or None) of every run of one test, in its order."""
    if test == "test_example_spawned_with_cpu_flag":
        return [(("spawned", script.name), _spawned_cmd(script), None)]
    if test == "test_example_under_ncclpy_run_cpu":
        return [(("run", script.name, n), _run_cpu_cmd(script, n, ids), None)
                for n, ids in _sizes(script).items()]
    if test == "test_skipped_sections_name_the_cpu_command":
        return [("skipped", _SKIPPED_CMD, None)]
    if test == "test_cpu_flag_under_a_launcher_that_chose_a_gpu_is_refused_in_one_line":
        return [("refused", _REFUSED_CMD, None)]
    if test == "test_the_cpu_backend_needs_no_cupy":
        env = _no_cupy_env(tmp)
        return [(("no-cupy", i), cmd, env) for i, cmd in enumerate(_no_cupy_cmds())]
    return []


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Iterator[Dict[Any, Future]]:
    """The runs of this file's selected tests, started :data:`AT_ONCE` at a time in the tests'
    order (see the module docstring): key -> the finished process, when it is."""
    tmp = tmp_path_factory.mktemp("examples-runs")
    todo = []
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            script = getattr(item, "callspec", None) and item.callspec.params.get("script")
            todo += _commands(item.originalname, script, tmp)
    with ThreadPoolExecutor(AT_ONCE) as pool:
        yield {key: pool.submit(_exec, cmd, env or _env()) for key, cmd, env in todo}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_spawned_with_cpu_flag(script, runs):
    """``python examples/x.py --cpu``: one group of ranks per world size, on the CPU backend."""
    worlds = _sizes(script)
    res = _ok(_spawned_cmd(script), runs[("spawned", script.name)].result())
    spawned = [ln for ln in res.stdout.splitlines() if ln.startswith("# ncclpy.spawn:")]
    assert spawned == [f"# ncclpy.spawn: {n} ranks on the CPU backend for {', '.join(ids)}"
                       for n, ids in worlds.items()], res.stdout
    _check_run(script, res.stdout, worlds)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_under_ncclpy_run_cpu(script, runs):
    """``ncclpy run --cpu -n N python examples/x.py --only <ids>`` for every world size."""
    for n, ids in _sizes(script).items():
        res = _ok(_run_cpu_cmd(script, n, ids), runs[("run", script.name, n)].result())
        assert (f"ncclpy run: placement: {n} ranks on the CPU backend (NCCLPY_DEVICE=cpu; no "
                f"GPU used, not NCCL)") in res.stderr.splitlines(), res.stderr
        _check_run(script, res.stdout, {n: ids})


def test_skipped_sections_name_the_cpu_command(runs):
    """Under ``ncclpy run --cpu`` a section for another world size names the command (with
    --cpu) that runs it."""
    res = _ok(_SKIPPED_CMD, runs["skipped"].result())
    for eid in ("E13", "E16"):
        assert (f"# {eid} skipped: the seed runs it with 4 ranks, this run has 3: ncclpy run "
                f"--cpu -n 4 python examples/08_broadcast.py --only {eid}") in res.stdout
    assert SCRIPTS[7].name == "08_broadcast.py"
    _check_run(SCRIPTS[7], res.stdout, {3: ["E22"]})


def test_cpu_flag_under_a_launcher_that_chose_a_gpu_is_refused_in_one_line(runs):
    """``ncclpy run -n 2 python examples/09_send_recv.py --cpu``: the launcher decides; rank 0
    says how to start the job on the CPU backend, no rank starts a communicator."""
    res = runs["refused"].result()
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("[rank")]
    assert lines == ["[rank 0] python examples/09_send_recv.py: --cpu: under a launcher the "
                     "launcher chooses the backend, and it gave this rank NCCLPY_DEVICE='0'; "
                     "start the job with ncclpy run --cpu -n 2 python examples/09_send_recv.py "
                     "(or give every rank NCCLPY_DEVICE=cpu)"], res.stderr
    assert _common.collect(res.stdout) == {}


def test_the_cpu_backend_needs_no_cupy(runs):
    """``pip install -e .`` without the CUDA extra is enough: with a ``cupy`` that cannot be
    imported first on the path, an example still runs on the CPU backend both ways."""
    script = SCRIPTS[8]
    assert script.name == "09_send_recv.py" and _sizes(script) == {2: ["E14", "E15"]}
    for i in range(len(_no_cupy_cmds())):
        res = runs[("no-cupy", i)].result()
        assert res.returncode == 0 and "CuPy" not in res.stderr, res.stdout + res.stderr
        _check_run(script, res.stdout, {2: ["E14", "E15"]})
