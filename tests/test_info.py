"""``ncclpy info``: the real CuPy/libnccl of this machine, GPU or not."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import cuda_reason
from ncclpy.info import collect, format_info, loaded_library_path, rendezvous_env
from ncclpy.semantics.ops import format_version

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)
SECRET = "s3cr3t-token-value-4242"


def _env(**kw):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(kw)
    return env


def _info(*args, cmd=None, **env):
    cmd = cmd or [sys.executable, "-m", "ncclpy"]
    return subprocess.run([*cmd, "info", *args], env=_env(**env), capture_output=True, text=True,
                          timeout=60)


def _cupy_nccl():
    try:
        from cupy.cuda import nccl
        return nccl
    except Exception:
        return None


def test_info_text_subprocess():
    cp = _info(NCCLPY_STORE_TOKEN=SECRET, NCCL_DEBUG="WARN", RANK="5", MASTER_PORT="1234",
               OMPI_COMM_WORLD_RANK="2", SLURM_PROCID="1", UNRELATED_VAR="zzz")
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout
    import ncclpy
    assert f"ncclpy:               {ncclpy.__version__}" in out
    assert f"Python:               {sys.version.split()[0]}" in out
    for k in ("platform:", "numpy:", "CuPy:", "CUDA runtime:", "CUDA driver:", "GPUs:",
              "torch:"):
        assert k in out
    assert SECRET not in out and "NCCLPY_STORE_TOKEN=<set, hidden>" in out
    for kv in ("NCCL_DEBUG=WARN", "RANK=5", "MASTER_PORT=1234", "OMPI_COMM_WORLD_RANK=2",
               "SLURM_PROCID=1"):
        assert f"  {kv}" in out.splitlines() or f"  {kv}\n" in out
    assert "UNRELATED_VAR" not in out
    nccl = _cupy_nccl()
    if nccl is not None:
        assert f"NCCL runtime:         {format_version(nccl.get_version())}" in out
        assert f"NCCL build (CuPy):    {format_version(nccl.get_build_version())}" in out
        line = next(x for x in out.splitlines() if x.startswith("libnccl loaded:"))
        path = line.split(":", 1)[1].strip()
        assert os.path.basename(path).startswith("libnccl.so") and os.path.exists(path)


@pytest.mark.skipif(not cuda_reason(), reason="a CUDA GPU is present")
def test_info_without_gpu_says_so_plainly():
    cp = _info()
    assert cp.returncode == 0
    gpus = next(x for x in cp.stdout.splitlines() if x.startswith("GPUs:"))
    assert gpus.split(":", 1)[1].strip().startswith("none visible")
    try:
        from cupy.cuda import runtime
        no_driver = runtime.driverGetVersion() == 0
    except Exception:
        no_driver = False
    if no_driver:
        assert "GPUs:                 none visible (no CUDA driver)" in cp.stdout
        assert "CUDA driver:          no CUDA driver" in cp.stdout


def test_info_reports_the_version_of_the_libnccl_it_names():
    """The version printed is the one of the library file printed, asked directly through
    ctypes (ncclGetVersion), not a number written into the test."""
    if _cupy_nccl() is None:
        pytest.skip("CuPy cannot load libnccl here")
    cp = _info()
    assert cp.returncode == 0, cp.stderr
    rows = dict(x.split(":", 1) for x in cp.stdout.splitlines() if x and not x[0].isspace())
    path = rows["libnccl loaded"].strip()
    lib = ctypes.CDLL(path)
    code = ctypes.c_int(0)
    assert lib.ncclGetVersion(ctypes.byref(code)) == 0
    assert rows["NCCL runtime"].strip() == format_version(code.value)


def test_info_json_parses():
    cp = _info("--json", NCCLPY_STORE_TOKEN=SECRET)
    assert cp.returncode == 0, cp.stderr
    d = json.loads(cp.stdout)
    for k in ("ncclpy", "python", "platform", "numpy", "cupy", "nccl", "cuda", "torch", "env"):
        assert k in d
    assert d["env"]["NCCLPY_STORE_TOKEN"] == "<set, hidden>"
    assert SECRET not in cp.stdout
    nccl = _cupy_nccl()
    if nccl is not None:
        assert d["nccl"]["runtime"] == nccl.get_version()
        assert os.path.exists(d["nccl"]["library"])
    assert isinstance(d["cuda"]["gpus"], list)
    if cuda_reason():
        assert d["cuda"]["gpus"] == [] and d["cuda"]["gpus_note"].startswith("none visible")


def test_info_without_cupy_still_reports():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from ncclpy.cli import main\n"
            "sys.exit(main(['info']))")
    cp = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "CuPy:                 not installed (pip install 'ncclpy[cu13]'" in cp.stdout
    assert "GPUs:                 none visible (CuPy is not installed)" in cp.stdout
    assert "numpy:" in cp.stdout and "torch:" in cp.stdout


def test_info_does_not_import_torch():
    code = ("import sys, ncclpy.info as i; d = i.collect(); i.format_info(d); "
            "print('torch' in sys.modules)")
    cp = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "False"


@pytest.mark.slow
def test_info_torch_flag():
    pytest.importorskip("torch")
    """torch's own version (with the wheel's local tag: 2.15.0+cu132 for the package index's
    CUDA wheel, 2.13.0+cpu for a CPU wheel), pip's version apart, the build, and torch's NCCL:
    its libnccl for a CUDA wheel (even without a GPU), none for a CPU wheel; the same version
    with and without --torch (without, torch is not imported)."""
    import importlib.metadata
    import torch
    import torch.distributed as dist
    cp = _info("--torch", "--json")
    assert cp.returncode == 0, cp.stderr
    t = json.loads(cp.stdout)["torch"]
    assert t["version"] == torch.__version__
    assert t["wheel_version"] == importlib.metadata.version("torch")
    assert t["version"].split("+")[0] == t["wheel_version"].split("+")[0]
    assert t["build"] == (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU")
    assert isinstance(t["cuda_available"], bool)
    if dist.is_available() and dist.is_nccl_available():      # a CUDA wheel: its own libnccl
        assert t["nccl"] == ".".join(map(str, torch.cuda.nccl.version()))
        assert t["libnccl"] and os.path.basename(t["libnccl"]).startswith("libnccl")
        lib = ctypes.CDLL(t["libnccl"])
        v = ctypes.c_int()
        assert lib.ncclGetVersion(ctypes.byref(v)) == 0
        major, minor, patch = torch.cuda.nccl.version()
        assert v.value == major * 10000 + minor * 100 + patch     # the very NCCL torch reports
    else:                                                      # a CPU wheel: none, said so
        assert t["libnccl"] is None and t["nccl"].startswith("none")
    plain = _info("--json")
    assert plain.returncode == 0, plain.stderr
    p = json.loads(plain.stdout)["torch"]
    assert (p["version"], p["wheel_version"], p["build"]) == \
        (t["version"], t["wheel_version"], t["build"])
    text = _info("--torch").stdout
    assert f"torch:                {torch.__version__} ({t['build']} build" in text


def test_console_script_if_installed():
    exe = shutil.which("ncclpy")
    if exe is None:
        pytest.skip("the ncclpy console script is not installed (pip install -e .)")
    cp = _info(cmd=[exe])
    assert cp.returncode == 0, cp.stderr
    assert "ncclpy:" in cp.stdout and "GPUs:" in cp.stdout


def test_collect_and_format_in_process():
    d = collect()
    text = format_info(d)
    assert json.loads(json.dumps(d)) == d
    assert text.splitlines()[0].startswith("ncclpy:")
    if _cupy_nccl() is not None:
        # collect() imported cupy.cuda.nccl, so libnccl is mapped in this process now
        assert loaded_library_path("libnccl.so") == d["nccl"]["library"]


def test_rendezvous_env_filter_and_mask():
    env = {"NCCLPY_STORE_TOKEN": SECRET, "NCCL_IB_DISABLE": "1", "NCCLPY_RANK": "0",
           "PMI_RANK": "3", "LOCAL_RANK": "1", "SLURM_JOB_NODELIST": "n[1-2]",
           "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root", "RANKX": "no"}
    out = rendezvous_env(env)
    assert out == {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "1", "NCCLPY_RANK": "0",
                   "NCCLPY_STORE_TOKEN": "<set, hidden>", "NCCL_IB_DISABLE": "1",
                   "PMI_RANK": "3", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert list(out) == sorted(out)


@pytest.mark.parametrize("var", [
    "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID",
    "SLURM_STEP_NODELIST", "SLURM_NODELIST", "TORCHELASTIC_RUN_ID", "NCCLPY_DEVICE",
])
def test_rendezvous_env_reports_launcher_variables(var):
    assert rendezvous_env({var: "7", "UNRELATED": "x"}) == {var: "7"}


def test_every_variable_rendezvous_reads_is_reported():
    from ncclpy.rendezvous import ENV_VARS
    env = {v: "1" for v in ENV_VARS}
    assert set(rendezvous_env(env)) == set(ENV_VARS)


def test_format_info_with_gpus_and_no_env():
    d = {"ncclpy": "0.1.0", "python": "3.11.0", "python_executable": "/py", "platform": "Linux",
         "numpy": "2.0", "cupy": {"installed": True, "version": "14.0"},
         "nccl": {"runtime_str": "2.32.3", "build_str": "2.27.7", "library": "/x/libnccl.so.2"},
         "cuda": {"driver_str": "13.0", "runtime_str": "13.0", "gpus": [
             {"index": 0, "name": "NVIDIA H100", "memory_bytes": 80 << 30,
              "compute_capability": "9.0", "pci_bus_id": "0000:1b:00"}]},
         "torch": {"installed": False}, "env": {}}
    text = format_info(d)
    assert "GPUs:                 1" in text
    assert "  GPU 0: NVIDIA H100, 80.0 GiB, compute 9.0, PCI 0000:1b:00" in text
    assert "torch:                not installed" in text
    assert "no NCCL_* or rendezvous variables set" in text


# -- one reason for "no GPU": ncclpy info, the GPU tests' skips, the examples -------------------
def test_info_gives_the_shared_no_gpu_reason():
    """The GPUs line of ``ncclpy info`` says what :func:`ncclpy.info.no_gpu_reason` says (the
    reason the GPU tests skip with and the examples print); with no CUDA driver at all that is
    "no CUDA driver", not a CUDA error name."""
    from ncclpy.info import NO_DRIVER, gpu_device_reason, no_gpu_reason
    why = gpu_device_reason()
    if not why:
        pytest.skip("a CUDA GPU is visible here")
    cp = _info()
    assert cp.returncode == 0, cp.stderr
    assert f"GPUs:                 none visible ({why})" in cp.stdout.splitlines()
    assert no_gpu_reason().startswith(why)
    try:
        from cupy.cuda import runtime
        no_driver = runtime.driverGetVersion() == 0
    except Exception:
        no_driver = False
    if no_driver:
        assert no_gpu_reason() == why == NO_DRIVER == "no CUDA driver"
        assert f"CUDA driver:          {NO_DRIVER}" in cp.stdout


def test_gpu_tests_skip_with_the_same_reason():
    """tests/gpu_util.py's skip reason is ncclpy.info.no_gpu_reason() (one wording)."""
    from ncclpy.info import no_gpu_reason
    assert cuda_reason() == no_gpu_reason()
