"""The CPU backend beside real NCCL (marker ``gpu``): on a GPU machine the same example gives the
same values on both (the CPU backend claims NCCL's results, bit for bit); a CuPy array (GPU
memory) handed to a CPU communicator is refused in one line, and a numpy array (host memory)
handed to a GPU communicator; a process that runs a GPU communicator cannot switch to the CPU
backend.  Each needs a GPU: real NCCL, real CuPy device
memory, a real CUDA runtime in the process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import requires_gpu

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import _common  # noqa: E402

RUN_TIMEOUT_S = 180
TEST_TIMEOUT_S = 240


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCLPY_RANK", "NCCLPY_DEVICE", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run(cmd: list) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


@requires_gpu
@pytest.mark.gpu_world(4)
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("script, only", [("04_all_reduce.py", "E6,E19,E30"),
                                          ("06_reduce_scatter.py", "E8,E9,E31"),
                                          ("12_reduce_ops.py", "")])
def test_an_example_gives_the_same_values_on_nccl_and_on_the_cpu_backend(script, only):
    args = [sys.executable, str(EXAMPLES / script)] + (["--only", only] if only else [])
    gpu, cpu = _run(args), _run(args + ["--cpu"])
    assert gpu.returncode == 0, gpu.stdout[-2000:] + gpu.stderr[-2000:]
    assert cpu.returncode == 0, cpu.stdout[-2000:] + cpu.stderr[-2000:]
    on_gpu, on_cpu = _common.collect(gpu.stdout), _common.collect(cpu.stdout)
    assert on_gpu and on_gpu == on_cpu, (on_gpu, on_cpu)


_CUPY_TO_CPU_COMM = """
import cupy as cp, ncclpy
comm = ncclpy.init(device="cpu", rank=0, world_size=1, master_addr="127.0.0.1", master_port={port})
try:
    comm.all_reduce(cp.ones(4, cp.float32))
    print("ACCEPTED")
except ncclpy.NcclpyError as e:
    print("REFUSED", type(e).__name__, e)
comm.close()
"""

_GPU_THEN_CPU = """
import numpy as np, ncclpy
g = ncclpy.init("g", rank=0, world_size=1, master_addr="127.0.0.1", master_port={port})
try:
    g.all_reduce(np.ones(4, np.float32))
    print("HOST ACCEPTED")
except ncclpy.NcclpyError as e:
    print("HOST REFUSED", type(e).__name__, e)
try:
    ncclpy.init("c", device="cpu", rank=0, world_size=1, master_addr="127.0.0.1",
                master_port={port2})
    print("SWITCHED")
except ncclpy.NcclpyError as e:
    print("REFUSED", type(e).__name__, e)
g.close()
"""


@requires_gpu
@pytest.mark.gpu_world(1)
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gpu_memory_to_a_cpu_communicator_and_a_gpu_process_switching_are_refused():
    """Also host memory to a GPU communicator (the reverse), in one line."""
    from ncclpy.launch.ports import free_port
    r = _run([sys.executable, "-c", _CUPY_TO_CPU_COMM.format(port=free_port("127.0.0.1"))])
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED ArgumentError") and "is in GPU memory" in line \
        and "device='cpu'" in line, line
    r = _run([sys.executable, "-c", _GPU_THEN_CPU.format(port=free_port("127.0.0.1"),
                                                        port2=free_port("127.0.0.1"))])
    assert r.returncode == 0, r.stderr[-2000:]
    host = [ln for ln in r.stdout.splitlines() if ln.startswith("HOST ")]
    assert len(host) == 1 and host[0].startswith("HOST REFUSED ArgumentError sendbuf: ") and \
        "is in host memory" in host[0] and "ncclpy.init(device='cpu')" in host[0], host
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED ArgumentError") and "either on the GPU or on the CPU" \
        in line, line
