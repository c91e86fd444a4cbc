"""``ncclpy check``'s fairness on CPU: the pins it sets, the placement it applies under a
launcher (torchrun), and which libnccl each side calls (torch's own, ncclpy's)."""
from __future__ import annotations

import ctypes
import os

import pytest


# -- fairness: pins, placement under torchrun, the libnccl each side calls -------------------
def test_fairness_pins_algorithm_protocol_and_channels():
    from ncclpy.check import fairness as F
    env, pinned, kept = F.fairness_env(False, {"NCCL_PROTO": "LL"})
    for k in ("NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE"):
        assert k in env
    assert env["NCCL_MIN_NCHANNELS"] == env["NCCL_MAX_NCHANNELS"]
    assert "NCCL_PROTO" not in env and kept == ["NCCL_PROTO=LL"]
    assert "NCCL_NVLS_ENABLE" not in F.fairness_env(True, {})[0]


def test_placement_is_applied_when_a_launcher_did_not():
    from ncclpy.check import fairness as F
    from ncclpy.launch import placement as P
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "CUDA_VISIBLE_DEVICES": "0"}                     # torchrun: 2 ranks, 1 GPU
    line = F.apply_launcher_placement(env)
    assert env["NCCLPY_DEVICE"] == "0" and "ncclpy check: placement" in line
    v = P.loaded_nccl_version()
    if v is not None and v >= P.MULTI_RANK_GPU_MIN_VERSION:
        assert env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    else:
        assert env["NCCL_HOSTID"].endswith("-1") and env["NCCL_NET"] == "Socket"
    assert F.apply_launcher_placement(env) is None          # placed already (ncclpy run too)
    cpu = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": ""}
    F.apply_launcher_placement(cpu)
    assert cpu["NCCLPY_DEVICE"] == "1" and not any(k.startswith("NCCL_") for k in cpu)


def test_libnccl_identification():
    pytest.importorskip("cupy")
    import sys as _sys
    from ncclpy._nccl import lib as L
    from ncclpy.check import fairness as F
    try:
        lib = L.get_lib()
    except Exception as e:  # noqa: BLE001 - MissingDependencyError where NCCL is absent
        pytest.skip(f"NCCL not loadable here: {e}")
    ext = _sys.modules["cupy_backends.cuda.libs.nccl"].__file__
    # ncclpy bound the very file CuPy's NCCL module calls
    assert os.path.samefile(F.symbol_library(ext), lib.path)
    assert L._pick(["/x/libnccl.so.2", lib.path], F.symbol_library(ext)) == lib.path
    assert L._pick(["/x/libnccl.so.2", "/y/libnccl.so.2"], None) == "/x/libnccl.so.2"
    from ncclpy.semantics.ops import format_version
    ver = format_version(lib.version)
    torch = pytest.importorskip("torch")         # loaded, as in a check's rank
    import torch.distributed as dist
    if dist.is_available() and dist.is_nccl_available():
        # a CUDA wheel (the package index's torch 2.15 is one) carries its libnccl, also on a
        # machine without a GPU: the report names that file, whatever ncclpy bound
        tver = ".".join(map(str, torch.cuda.nccl.version()))
        rep = F.libnccl_report(torch.cuda.nccl.version(), lib.path, ver)
        tpath = rep["torch_libnccl"]
        assert tpath and os.path.isfile(tpath), rep
        v = ctypes.c_int()
        assert ctypes.CDLL(tpath).ncclGetVersion(ctypes.byref(v)) == 0
        assert format_version(v.value) == tver == rep["torch_nccl_version"]
        same_file = os.path.samefile(tpath, lib.path)
        assert rep["same"] == (same_file and tver == ver), rep
        if not same_file:
            assert any(f"torch calls {tpath}" in p for p in rep["problems"]), rep
        assert os.path.realpath(lib.path) in rep["all_libnccl"]
    else:
        # a CPU wheel has no NCCL of its own: the report must say so, never claim "same"
        rep = F.libnccl_report(tuple(int(x) for x in ver.split(".")), lib.path, ver)
        assert rep["torch_libnccl"] is None and not rep["same"]
        assert any("cannot tell which libnccl torch calls" in p for p in rep["problems"])
        assert rep["all_libnccl"] == [os.path.realpath(lib.path)]
    assert rep["ncclpy_libnccl"] == os.path.realpath(lib.path)
    bad = F.libnccl_report((2, 0, 0), lib.path, ver)
    assert any("torch reports NCCL 2.0.0" in p for p in bad["problems"])


def test_placement_under_torchrun_limits_ctas_above_two_ranks_per_gpu():
    """4 torchrun ranks on 1 GPU: the same CTA limit as ncclpy run (SM count read, else the
    documented assumption), stated in the placement line."""
    from ncclpy.check import fairness as F
    from ncclpy.launch import placement as P
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
           "CUDA_VISIBLE_DEVICES": "0"}
    line = F.apply_launcher_placement(env)
    want = P.cta_limit(4, P.gpu_sm_count(env), P.loaded_nccl_version())
    assert want is not None and env["NCCL_MAX_CTAS"] == str(want), (env, line)
    assert f"NCCL_MAX_CTAS={want}" in line and env["NCCLPY_DEVICE"] == "0"
