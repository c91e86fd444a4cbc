"""GPU: ``ncclpy check -n 2`` and ``-n 4`` on one GPU (several ranks per GPU) pass bit for bit,
torch.distributed's NCCL backend and ncclpy on the same libnccl, except documented torch
divergences.  Skipped with the reason where CUDA, CuPy, NCCL or a CUDA build of torch is absent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import requires_gpu

ROOT = Path(__file__).resolve().parents[2]


def _torch_cuda_reason() -> str:
    try:
        import torch
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA"
    if not torch.distributed.is_nccl_available():
        return "torch was built without NCCL"
    return ""


def _check(n: int, tmp_path: Path, *extra: str):
    js = tmp_path / f"check{n}.json"
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "ncclpy", "check", "--backend", "nccl", "-n", str(n),
                        "-q", "--json", str(js), *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    doc = json.loads(js.read_text()) if js.exists() else None
    return p, doc


@requires_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_check_on_one_gpu_is_bitwise(n, tmp_path):
    why = _torch_cuda_reason()
    if why:
        pytest.skip(why)
    p, doc = _check(n, tmp_path)
    out = p.stdout[-6000:] + p.stderr[-3000:]
    assert doc is not None, out
    h = doc["header"]
    assert h["backend"] == "nccl" and "ncclpy_error" not in h, out
    # both sides on one libnccl, with the algorithm and protocol pinned
    assert len(h["all_libnccl"]) == 1, h
    assert any(s.startswith("NCCL_ALGO=") for s in h["pinned"] + h["kept"])
    assert any(s.startswith("NCCL_PROTO=") for s in h["pinned"] + h["kept"])
    assert p.returncode == 0 and doc["summary"]["failed"] == 0, out
    for c in doc["cases"]:
        assert c["status"] in ("pass", "torch divergence", "unsupported"), c
        if c["status"] == "pass" and c["case"]["collective"] != "barrier":
            assert c["ncclpy_torch"] is not False and c["ncclpy_ref"] is not False, c
        if c["status"] == "torch divergence":
            assert c["ncclpy_ref"] is not False, c          # ncclpy itself must be right
    divs = {(c["case"]["dtype"], c["case"]["op"]) for c in doc["cases"]
            if c["status"] == "torch divergence"}
    assert divs <= {("bfloat16", "premul_sum")}, divs
    assert {c["case"]["collective"] for c in doc["cases"] if c["status"] == "pass"} >= {
        "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
        "gather", "scatter", "send_recv", "barrier"}


@requires_gpu
def test_injected_corruption_fails_on_gpu(tmp_path):
    why = _torch_cuda_reason()
    if why:
        pytest.skip(why)
    env_backup = os.environ.get("NCCLPY_CHECK_INJECT")
    os.environ["NCCLPY_CHECK_INJECT"] = "all_reduce:0"
    try:
        js = tmp_path / "inj.json"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, "-m", "ncclpy", "check", "--backend", "nccl", "-n",
                            "2", "--collectives", "all_reduce", "--dtypes", "float32",
                            "--sizes", "8", "--json", str(js)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    finally:
        if env_backup is None:
            os.environ.pop("NCCLPY_CHECK_INJECT", None)
        else:
            os.environ["NCCLPY_CHECK_INJECT"] = env_backup
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(js.read_text())
    assert any(c["status"] == "fail" and c["ncclpy_torch"] is False for c in doc["cases"])
