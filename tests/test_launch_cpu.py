"""``ncclpy run --cpu`` and ``ncclpy.spawn(device="cpu")``: every rank gets NCCLPY_DEVICE=cpu
and meets the others on the CPU backend (real processes, a real all_reduce on numpy arrays); no
GPU placement, NCCL variable or MPS; what cannot go with it is refused in one line before
anything starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ncclpy.errors import ArgumentError, ArgumentTypeError
from ncclpy.launch import placement as P
from ncclpy.launch.launcher import launch
from ncclpy.launch.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)

#: a rank: its environment, then an all_reduce of numpy arrays on whatever backend init() picks
RANK = """
    import json, os, sys
    import numpy as np
    import ncclpy
    comm = ncclpy.init(timeout=60)
    x = np.full(3, comm.rank + 1, np.float32)
    comm.all_reduce(x, op="sum").wait()
    keys = ["NCCLPY_DEVICE", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_HOSTID", "NCCL_NVLS_ENABLE",
            "NCCL_MAX_CTAS", "CUDA_MPS_PIPE_DIRECTORY"]
    print(json.dumps({"rank": comm.rank, "cpu": ncclpy.cpu.installed(), "sum": x.tolist(),
                      "env": {k: os.environ.get(k) for k in keys}}))
    comm.close()
"""
CPU_LINE = "ncclpy run: placement: {n} ranks on the CPU backend (NCCLPY_DEVICE=cpu{src}; no GPU " \
           "used, not NCCL)"


def _env(**kw: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for k in ("NCCLPY_DEVICE", "NCCLPY_STORE_TOKEN", "CUDA_MPS_PIPE_DIRECTORY", "NCCLPY_MPS",
              "NCCLPY_RANK", "RANK", "CUDA_VISIBLE_DEVICES"):
        env.pop(k, None)
    env.update(kw)
    return env


def _run(args: list, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncclpy", "run", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _prog(tmp_path: Path, body: str = RANK) -> Path:
    p = tmp_path / "rank.py"
    p.write_text(textwrap.dedent(body))
    return p


def _ranks(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        tag, _, rest = line.partition("] ")
        out[int(tag.removeprefix("[rank "))] = json.loads(rest)
    return out


def _assert_cpu_ranks(stdout: str, n: int) -> None:
    ranks = _ranks(stdout)
    assert sorted(ranks) == list(range(n)), stdout
    total = float(n * (n + 1) // 2)
    for r, d in ranks.items():
        assert d["cpu"] is True and d["sum"] == [total] * 3, d
        assert d["env"] == {"NCCLPY_DEVICE": "cpu", "NCCL_MULTI_RANK_GPU_ENABLE": None,
                            "NCCL_HOSTID": None, "NCCL_NVLS_ENABLE": None, "NCCL_MAX_CTAS": None,
                            "CUDA_MPS_PIPE_DIRECTORY": None}, d


# --------------------------------------------------------------------------- ncclpy run --cpu

def test_run_cpu_places_no_gpu_even_where_gpus_are_visible(tmp_path):
    """Three ranks, CUDA_VISIBLE_DEVICES naming one GPU (GPU placement would share it and set
    NCCL's variables): with --cpu every rank has NCCLPY_DEVICE=cpu and nothing else, and they
    all-reduce on the CPU backend; the placement line says so."""
    cp = _run(["--cpu", "-n", 3, "--mps", "auto", _prog(tmp_path)],
              _env(CUDA_VISIBLE_DEVICES="0"))
    assert cp.returncode == 0, cp.stderr
    _assert_cpu_ranks(cp.stdout, 3)
    lines = [ln for ln in cp.stderr.splitlines() if ln.startswith("ncclpy run:")]
    assert lines == [CPU_LINE.format(n=3, src="")], cp.stderr


def test_run_honours_ncclpy_device_cpu_in_its_environment(tmp_path):
    cp = _run(["-n", 2, _prog(tmp_path)], _env(NCCLPY_DEVICE="CPU"))
    assert cp.returncode == 0, cp.stderr
    _assert_cpu_ranks(cp.stdout, 2)
    assert CPU_LINE.format(n=2, src=", from the environment") in cp.stderr.splitlines()


def test_run_without_cpu_gives_device_indices(tmp_path):
    """The control: the same job without --cpu places by GPU (here none: the local rank)."""
    prog = _prog(tmp_path, "import os; print(os.environ['NCCLPY_DEVICE'])")
    cp = _run(["-n", 2, prog], _env())
    assert cp.returncode == 0, cp.stderr
    assert sorted(cp.stdout.split()) == ["0", "0]", "1", "1]", "[rank", "[rank"]
    assert "CPU backend" not in cp.stderr


@pytest.mark.parametrize("args, env, message", [
    (["--cpu", "--nnodes", 2, "--master-addr", "127.0.0.1", "--master-port", 29555], {},
     "--nnodes: the CPU backend (--cpu) runs every rank on this machine (its ranks meet through "
     "shared memory), so expected --nnodes 1, got --nnodes 2"),
    (["--nnodes=3", "--node-rank", 1], {"NCCLPY_DEVICE": "cpu"},
     "--nnodes: the CPU backend (NCCLPY_DEVICE=cpu in the launcher's environment) runs every "
     "rank on this machine (its ranks meet through shared memory), so expected --nnodes 1, "
     "got --nnodes 3"),
    (["--cpu", "--ranks-per-gpu", 2], {},
     "--ranks-per-gpu: the CPU backend (--cpu) uses no GPU, so there is none to share; leave "
     "--ranks-per-gpu out (got --ranks-per-gpu 2)"),
    (["--cpu", "--ranks_per_gpu=1"], {},
     "--ranks_per_gpu: the CPU backend (--cpu) uses no GPU, so there is none to share; leave "
     "--ranks_per_gpu out (got --ranks_per_gpu 1)"),
    (["--cpu", "--mps", "on"], {},
     "--mps: the CPU backend (--cpu) uses no GPU, so CUDA MPS has nothing to serve; leave --mps "
     "out or set --mps off (got --mps on)"),
    (["--cpu"], {"NCCLPY_MPS": "on"},
     "NCCLPY_MPS: the CPU backend (--cpu) uses no GPU, so CUDA MPS has nothing to serve; leave "
     "NCCLPY_MPS out or set NCCLPY_MPS=off (got NCCLPY_MPS=on)"),
])
def test_run_cpu_refusals_are_one_line_before_anything_starts(tmp_path, args, env, message):
    marker = tmp_path / "started"
    prog = _prog(tmp_path, f"open({str(marker)!r}, 'w').close()")
    cp = _run(["-n", 2, *args, prog], _env(**env), timeout=60)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert cp.stdout == "" and cp.stderr == f"ncclpy run: error: {message}\n", cp.stderr
    assert not marker.exists()


def test_launch_api_names_its_keywords(tmp_path):
    with pytest.raises(ArgumentError, match=r"^ranks_per_gpu: the CPU backend \(cpu=True\) .* "
                                            r"\(got ranks_per_gpu=2\)$"):
        launch(["true"], 2, cpu=True, ranks_per_gpu=2, env=_env())
    with pytest.raises(ArgumentError, match=r"^mps: .* set mps='off' \(got mps='on'\)$"):
        launch(["true"], 2, cpu=True, mps="on", env=_env())


def test_plan_cpu_is_a_placement_without_gpu_indices():
    p = P.plan_cpu(4, why="--cpu")
    assert p.mode == "cpu" and p.mode in P.MODES and p.cpu and not p.shared
    assert p.envs == ({"NCCLPY_DEVICE": "cpu"},) * 4 and p.ngpus == 0 and p.mps is None
    assert P.summary_line("ncclpy run", p) == CPU_LINE.format(n=4, src="")
    one = P.plan_cpu(1, why="NCCLPY_DEVICE=cpu", from_env=True)
    assert one.summary == ("placement: 1 rank on the CPU backend (NCCLPY_DEVICE=cpu, from the "
                           "environment; no GPU used, not NCCL)")
    assert P.cpu_requested({"NCCLPY_DEVICE": " Cpu "}) and not P.cpu_requested({})
    assert not P.cpu_requested({"NCCLPY_DEVICE": "0"})


# --------------------------------------------------------------------------- spawn(device=)

def _spawned(rank: int, outdir: str) -> None:
    import ncclpy
    comm = ncclpy.init(timeout=60)
    x = np.full(2, rank + 1, np.float32)
    comm.all_reduce(x, op="sum").wait()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"cpu": ncclpy.cpu.installed(), "sum": x.tolist(),
                   "device": os.environ.get("NCCLPY_DEVICE"),
                   "nvls": os.environ.get("NCCL_NVLS_ENABLE")}, f)
    comm.close()


def _spawned_results(outdir: Path, n: int) -> list:
    return [json.loads((outdir / f"{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("how", ["device", "env", "parent-env"])
def test_spawn_on_the_cpu_backend(tmp_path, monkeypatch, how):
    """device="cpu", env={"NCCLPY_DEVICE": "cpu"} or the parent's NCCLPY_DEVICE=cpu: the
    children run on the CPU backend, and no GPU placement is even looked at."""
    def no_gpu_placement(*a, **k):
        raise AssertionError("GPU placement consulted for a CPU job")
    monkeypatch.setattr(P, "place", no_gpu_placement)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    kw: dict = {"device": {"device": "cpu"}, "env": {"env": {"NCCLPY_DEVICE": "cpu"}},
                "parent-env": {}}[how]
    if how == "parent-env":
        monkeypatch.setenv("NCCLPY_DEVICE", "cpu")
    spawn(_spawned, 3, args=(str(tmp_path),), timeout=120, **kw)
    for d in _spawned_results(tmp_path, 3):
        assert d == {"cpu": True, "sum": [6.0, 6.0], "device": "cpu", "nvls": None}, d


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"device": 0}, ArgumentTypeError,
     "device: expected None (GPU placement: rank r -> GPU r mod the GPU count) or 'cpu' (the "
     "CPU backend), got int 0"),
    ({"device": True}, ArgumentTypeError, "got bool True"),
    ({"device": "cuda"}, ArgumentError,
     "device: expected None (GPU placement, or the CPU backend when NCCLPY_DEVICE=cpu is in the "
     "environment) or 'cpu', got 'cuda'"),
    ({"device": "cpu", "ranks_per_gpu": 2}, ArgumentError,
     "ranks_per_gpu: the CPU backend (device='cpu') uses no GPU, so there is none to share; "
     "leave ranks_per_gpu out (got ranks_per_gpu=2)"),
    ({"device": "cpu", "mps": "on"}, ArgumentError,
     "mps: the CPU backend (device='cpu') uses no GPU, so CUDA MPS has nothing to serve; leave "
     "mps out or set mps='off' (got mps='on')"),
    ({"env": {"NCCLPY_DEVICE": "cpu", "NCCLPY_MPS": "on"}}, ArgumentError,
     "NCCLPY_MPS: the CPU backend (env={'NCCLPY_DEVICE': 'cpu'}) uses no GPU"),
])
def test_spawn_device_errors_before_anything_starts(tmp_path, kwargs, exc, message):
    with pytest.raises(exc) as e:
        spawn(_spawned, 2, args=(str(tmp_path),), **kwargs)
    assert message in str(e.value) and type(e.value) is exc
    assert list(tmp_path.iterdir()) == []
