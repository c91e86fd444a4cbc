"""The reduction-order model against real NCCL (marker ``gpu``; the selftest's ``order``
stage): ``ncclpy order --observe --matrix proof`` runs ranks 3 and 4 on the one GPU (each rank
its own node in ncclpy's hostid-socket placement, so rings and trees cross "nodes"), NCCL_ALGO
Ring and Tree, NCCL_PROTO LL, LL128 and Simple, 1 and 2 channels, float32, bfloat16 and
float16, counts on the alignment path, in one and several loops and around the split's second
channel, reduce_scatter and reduce on Ring, each call twice on order-revealing inputs plus once
on random ones.  Every configuration must be PREDICTED: a MISMATCH is a bug in the model (or in
the source it follows) to fix and run again, never a row to mark as known.  It needs a GPU for
the reason it exists: the bits of NCCL's own kernels."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import requires_gpu

ROOT = Path(__file__).resolve().parents[2]
#: the whole matrix's bound: the stage's 240 s less set-up and the report
RUN_TIMEOUT_S = 225
TEST_TIMEOUT_S = 235


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCLPY_RANK", "NCCLPY_DEVICE", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG",
                                "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@requires_gpu
@pytest.mark.gpu_world(4)
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_every_proof_configuration_is_predicted_bit_for_bit(tmp_path):
    out = tmp_path / "order"
    out.mkdir()
    cmd = [sys.executable, "-m", "ncclpy", "order", "--observe", "--matrix", "proof",
           "--out", str(out), "--timeout", str(RUN_TIMEOUT_S - 15)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    report = out / "order-report.json"
    keep = os.environ.get("NCCLPY_GPU_ARTIFACTS")
    if keep and report.exists():
        shutil.copy(report, Path(keep) / "order-report.json")
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    rows = doc["rows"]
    from ncclpy.order.matrix import proof_matrix
    assert len(rows) == sum(len(g.cases) for j in proof_matrix() for g in j.groups)
    bad = [r for r in rows if r["verdict"] != "PREDICTED"]
    assert not bad, (f"{len(bad)} of {len(rows)} configurations not PREDICTED; first: "
                     f"{json.dumps(bad[:3], indent=1)[:3000]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
