"""ncclpy.launch.placement: GPU counting and the placement table (no GPU needed: pure rules)."""
from __future__ import annotations

import itertools
import math
import os

import pytest

from ncclpy.errors import ArgumentError
from ncclpy.launch.placement import (MODES, SHARED_MODES, Placement, loaded_nccl_version,
                                     plan_placement, summary_line, visible_gpu_count)

NCCL_227, NCCL_230, NCCL_232 = 22703, 23000, 23203


# ---------------------------------------------------------------- visible_gpu_count
@pytest.mark.parametrize("value, expected", [
    ("0", 1), ("0,1", 2), ("3,1,0,2", 4), (" 0 , 1 ", 2), ("", 0), ("-1", 0),
    ("0,-1,1", 1), ("0,,1", 1), ("GPU-5f2a1b3c-aaaa-bbbb-cccc-123456789abc", 1),
    ("MIG-1234,MIG-5678", 2),
])
def test_visible_gpu_count_honours_cuda_visible_devices(value, expected):
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": value}) == expected


def test_visible_gpu_count_without_cvd_never_raises_and_matches_cuda():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    n = visible_gpu_count(env)
    assert isinstance(n, int) and n >= 0
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        from gpu_util import gpu_count
        assert n == gpu_count()


def test_loaded_nccl_version_matches_cupy():
    try:
        from cupy.cuda import nccl
        expected = nccl.get_version()
    except Exception:
        expected = None
    assert loaded_nccl_version() == expected


# ---------------------------------------------------------------- plan_placement table
def expected_devices(nranks, ngpus, rpg):
    """The spec: rank r -> GPU r mod G, G the GPUs used (with R ranks per GPU: ceil(N / R))."""
    if ngpus == 0:
        return list(range(nranks))
    used = min(ngpus, math.ceil(nranks / rpg)) if rpg and rpg > 1 else ngpus
    return [r % used for r in range(nranks)]


CASES = list(itertools.product([0, 1, 2, 4], [1, 2, 3, 4, 8], [NCCL_227, NCCL_230, NCCL_232, None],
                               [None, 1, 2]))


@pytest.mark.parametrize("ngpus, nranks, ver, rpg", CASES)
def test_placement_table(ngpus, nranks, ver, rpg):
    p = plan_placement(nranks, ngpus, ver, ranks_per_gpu=rpg, env={})
    assert isinstance(p, Placement) and p.mode in MODES
    assert p.nranks == nranks and p.ngpus == ngpus
    assert list(p.devices) == expected_devices(nranks, ngpus, rpg)
    assert len(p.envs) == nranks
    assert "\n" not in p.summary and p.summary.startswith("placement: ")
    shared = ngpus > 0 and len(set(p.devices)) < nranks
    if ngpus == 0:
        assert p.mode == "no-gpu"
        assert all(e == {} for e in p.envs)
        assert "no GPU" in p.summary
    elif not shared:
        assert p.mode == "one-per-gpu"
        assert all(e == {} for e in p.envs)
        assert p.devices == tuple(range(nranks))
    elif ver is not None and ver >= 23000:
        assert p.mode == "multi-rank-gpu"
        assert all(e == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} for e in p.envs)
        assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in p.summary and ">= 2.30" in p.summary
    else:
        assert p.mode == "hostid-socket"
        hostids = [e["NCCL_HOSTID"] for e in p.envs]
        assert len(set(hostids)) == nranks
        assert all(e["NCCL_NET"] == "Socket" and e["NCCL_SOCKET_IFNAME"] == "lo" for e in p.envs)
        assert ("< 2.30" in p.summary) if ver else ("unknown" in p.summary)
    assert p.mode in p.summary


def test_one_per_gpu_when_ranks_fit():
    p = plan_placement(2, 4, NCCL_232, env={})
    assert p.mode == "one-per-gpu" and p.devices == (0, 1)
    assert p.summary == "placement: 2 ranks on 2 GPUs of 4 (one-per-gpu: rank r -> GPU r)"


def test_summary_example():
    p = plan_placement(4, 1, NCCL_232, env={})
    assert p.summary == ("placement: 4 ranks on 1 GPU (multi-rank-gpu: NCCL 2.32.3 >= 2.30, "
                         "NCCL_MULTI_RANK_GPU_ENABLE=1)")


def test_ranks_per_gpu_forces_sharing_even_with_enough_gpus():
    p = plan_placement(4, 4, NCCL_232, ranks_per_gpu=2, env={})
    assert p.devices == (0, 1, 0, 1) and p.mode == "multi-rank-gpu"   # r mod 2 GPUs used
    assert p.summary.startswith("placement: 4 ranks on 2 GPUs of 4, rank r -> GPU r mod 2 (")


def test_ranks_per_gpu_uneven_and_more_than_needed():
    assert plan_placement(5, 4, NCCL_232, ranks_per_gpu=2, env={}).devices == (0, 1, 2, 0, 1)
    p = plan_placement(2, 4, NCCL_232, ranks_per_gpu=3, env={})
    assert p.devices == (0, 0) and p.mode == "multi-rank-gpu"


def test_ranks_per_gpu_wraps_and_says_so():
    p = plan_placement(8, 2, NCCL_232, ranks_per_gpu=2, env={})
    assert p.devices == (0, 1, 0, 1, 0, 1, 0, 1)
    assert "wrap" in p.summary and "rank r -> GPU r mod 2" in p.summary


def test_summary_line_is_one_line_naming_the_mode():
    p = plan_placement(4, 1, NCCL_227, env={})
    line = summary_line("ncclpy spawn", p)
    assert line == "ncclpy spawn: " + p.summary and "\n" not in line and "hostid-socket" in line
    assert p.mode in SHARED_MODES
    assert summary_line("ncclpy run", p, "node 1 of 2; ") == "ncclpy run: node 1 of 2; " + p.summary


def test_hostid_multi_node_does_not_force_loopback():
    p = plan_placement(4, 1, NCCL_227, single_node=False, env={})
    assert p.mode == "hostid-socket"
    assert all("NCCL_SOCKET_IFNAME" not in e and e["NCCL_NET"] == "Socket" for e in p.envs)
    assert "NCCL_SOCKET_IFNAME" not in p.summary


def test_hostids_differ_between_launchers():
    a = plan_placement(2, 1, NCCL_227, env={})
    b = plan_placement(2, 1, NCCL_227, env={})
    assert not set(e["NCCL_HOSTID"] for e in a.envs) & set(e["NCCL_HOSTID"] for e in b.envs)


@pytest.mark.parametrize("ver, user, kept_name", [
    (NCCL_232, {"NCCL_MULTI_RANK_GPU_ENABLE": "0"}, "NCCL_MULTI_RANK_GPU_ENABLE"),
    (NCCL_227, {"NCCL_NET": "IB"}, "NCCL_NET"),
    (NCCL_227, {"NCCL_SOCKET_IFNAME": "eth0"}, "NCCL_SOCKET_IFNAME"),
    (NCCL_227, {"NCCL_HOSTID": "mine"}, "NCCL_HOSTID"),
])
def test_user_set_variables_are_never_overridden(ver, user, kept_name):
    p = plan_placement(4, 2, ver, env=user)
    assert all(kept_name not in e for e in p.envs)
    assert p.kept == (kept_name,)
    assert f"kept the user's {kept_name}={user[kept_name]}" in p.summary


def test_user_vars_ignored_when_no_sharing():
    p = plan_placement(2, 2, NCCL_227, env={"NCCL_NET": "IB"})
    assert p.mode == "one-per-gpu" and p.kept == () and "kept" not in p.summary


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("NCCL_NET", "IB")
    p = plan_placement(2, 1, NCCL_227)
    assert p.kept == ("NCCL_NET",)


def test_accessors_return_copies():
    p = plan_placement(2, 1, NCCL_232, env={})
    e = p.env(1)
    e["X"] = "1"
    assert "X" not in p.envs[1] and p.device(1) == 0


@pytest.mark.parametrize("kwargs", [
    dict(nranks=0, ngpus=1), dict(nranks=-1, ngpus=1), dict(nranks=2, ngpus=-1),
    dict(nranks=True, ngpus=1), dict(nranks=2, ngpus=1, ranks_per_gpu=0),
    dict(nranks=2.0, ngpus=1),
])
def test_bad_arguments(kwargs):
    nranks, ngpus = kwargs.pop("nranks"), kwargs.pop("ngpus")
    with pytest.raises(ArgumentError):
        plan_placement(nranks, ngpus, NCCL_232, env={}, **kwargs)
