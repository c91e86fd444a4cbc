"""ncclpy.launch.placement: GPU counting and the placement table (no GPU needed: pure rules)."""
from __future__ import annotations

import itertools
import math
import os

import pytest

from ncclpy.errors import ArgumentError
from ncclpy.launch import placement as P
from ncclpy.launch.placement import (ASSUMED_SM_COUNT, MODES, SHARED_MODES, Placement, cta_limit,
                                     gpu_sm_count, loaded_nccl_version, place, plan_placement,
                                     summary_line, visible_gpu_count, with_mps)

NCCL_216, NCCL_224, NCCL_225 = 21603, 22405, 22501
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
    else:
        per_gpu = max(p.devices.count(d) for d in p.devices)
        assert p.ranks_per_gpu == per_gpu and p.shared
        # the CTA limit: none up to 2 ranks per GPU (NCCL's defaults), S // R above (S unknown
        # here: ASSUMED_SM_COUNT), in NCCL_MAX_CTAS (NCCL_MAX_NCHANNELS too when the version is
        # unknown: one of the two is what that NCCL reads)
        limit = None if per_gpu <= 2 else max(1, ASSUMED_SM_COUNT // per_gpu)
        assert p.max_ctas == limit
        ctas = {} if limit is None else {"NCCL_MAX_CTAS": str(limit)}
        if limit is not None and ver is None:
            ctas["NCCL_MAX_NCHANNELS"] = str(limit)
        assert all({k: e.get(k) for k in ctas} == ctas for e in p.envs)
        assert ("NCCL_MAX_CTAS" in p.summary) == (limit is not None)
        # NVLS off wherever ranks share a GPU (NCCL's own guard counts only the last rank pair)
        assert all(e["NCCL_NVLS_ENABLE"] == "0" for e in p.envs)
        assert "NCCL_NVLS_ENABLE=0" in p.summary
        if ver is not None and ver >= 23000:
            assert p.mode == "multi-rank-gpu"
            assert all(e == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", **ctas}
                       for e in p.envs)
            assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in p.summary and ">= 2.30" in p.summary
        else:
            assert p.mode == "hostid-socket"
            hostids = [e["NCCL_HOSTID"] for e in p.envs]
            assert len(set(hostids)) == nranks
            assert all(e["NCCL_NET"] == "Socket" and e["NCCL_SOCKET_IFNAME"] == "lo"
                       for e in p.envs)
            assert ("< 2.30" in p.summary) if ver else ("unknown" in p.summary)
    assert p.mode in p.summary


def test_one_per_gpu_when_ranks_fit():
    p = plan_placement(2, 4, NCCL_232, env={})
    assert p.mode == "one-per-gpu" and p.devices == (0, 1)
    assert p.summary == "placement: 2 ranks on 2 GPUs of 4 (one-per-gpu: rank r -> GPU r)"


def test_summary_example():
    p = plan_placement(4, 1, NCCL_232, env={}, sm_count=132)
    assert p.summary == ("placement: 4 ranks on 1 GPU (multi-rank-gpu: NCCL 2.32.3 >= 2.30, "
                         "NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL_MAX_CTAS=33 (4 ranks per GPU, "
                         "132 SMs), NCCL_NVLS_ENABLE=0)")
    p = plan_placement(2, 1, NCCL_232, env={}, sm_count=132)     # NCCL's defaults fit 2
    assert p.summary == ("placement: 2 ranks on 1 GPU (multi-rank-gpu: NCCL 2.32.3 >= 2.30, "
                         "NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL_NVLS_ENABLE=0)")
    p = plan_placement(4, 1, NCCL_232, env={})
    assert p.summary.endswith(
        "NCCL_MAX_CTAS=2 (4 ranks per GPU, SM count unknown, 8 assumed), NCCL_NVLS_ENABLE=0)")


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


# ---------------------------------------------------------------- CTA limit (defect 9)
@pytest.mark.parametrize("nranks, sms, expected", [
    (2, 132, None),       # "NCCL should be able to run up to 2 ranks per GPU" by default
    (3, 132, 44), (4, 132, 33), (6, 132, 22), (3, 40, 13), (6, 40, 6), (8, 40, 5),
    (4, None, ASSUMED_SM_COUNT // 4), (6, None, 1),
])
def test_cta_limit_on_one_gpu(nranks, sms, expected):
    p = plan_placement(nranks, 1, NCCL_232, env={}, sm_count=sms)
    assert p.mode == "multi-rank-gpu" and p.ranks_per_gpu == nranks
    assert p.max_ctas == expected
    assert cta_limit(nranks, sms, NCCL_232) == expected
    for e in p.envs:
        assert e.get("NCCL_MAX_CTAS") == (None if expected is None else str(expected))
        assert "NCCL_MAX_NCHANNELS" not in e            # NCCL >= 2.17 reads NCCL_MAX_CTAS
    if expected is not None:
        assert f"NCCL_MAX_CTAS={expected} ({nranks} ranks per GPU, " in p.summary
        assert expected * nranks <= (sms or ASSUMED_SM_COUNT)   # all ranks' CTAs fit together
    else:
        assert "CTAS" not in p.summary


def test_cta_limit_eight_ranks_on_two_gpus():
    p = plan_placement(8, 2, NCCL_232, ranks_per_gpu=4, env={}, sm_count=132)
    assert p.devices == (0, 1, 0, 1, 0, 1, 0, 1) and p.ranks_per_gpu == 4
    assert p.max_ctas == 33 and {e["NCCL_MAX_CTAS"] for e in p.envs} == {"33"}
    assert "rank r -> GPU r mod 2" in p.summary and "NCCL_MAX_CTAS=33 (4 ranks per GPU" in p.summary


def test_cta_limit_uses_the_busiest_gpu():
    p = plan_placement(5, 2, NCCL_232, env={}, sm_count=132)   # 3 ranks on GPU 0, 2 on GPU 1
    assert p.devices == (0, 1, 0, 1, 0) and p.ranks_per_gpu == 3 and p.max_ctas == 44


@pytest.mark.parametrize("ver, nranks, sms, expected", [
    (NCCL_224, 3, 132, 32),   # up to 32 before 2.25 (NCCL's env docs)
    (NCCL_225, 3, 132, 44),   # up to 64 from 2.25
    (NCCL_232, 3, 228, 64),
])
def test_cta_limit_is_capped_at_nccls_maximum(ver, nranks, sms, expected):
    assert plan_placement(nranks, 1, ver, env={}, sm_count=sms).max_ctas == expected


def test_cta_limit_more_ranks_than_sms_says_it_may_not_fit():
    p = plan_placement(12, 1, NCCL_232, env={}, sm_count=10)
    assert p.max_ctas == 1 and "even 1 CTA per rank may not fit" in p.summary


def test_one_rank_per_gpu_sets_no_cta_limit():
    p = plan_placement(4, 4, NCCL_232, env={}, sm_count=132)
    assert p.mode == "one-per-gpu" and p.max_ctas is None and p.ranks_per_gpu == 1
    assert all(e == {} for e in p.envs) and "CTAS" not in p.summary


def test_user_max_ctas_is_kept_and_reported():
    p = plan_placement(4, 1, NCCL_232, env={"NCCL_MAX_CTAS": "16"}, sm_count=132)
    assert all("NCCL_MAX_CTAS" not in e for e in p.envs)
    assert p.max_ctas is None and p.kept == ("NCCL_MAX_CTAS",)
    assert ("; kept the user's NCCL_MAX_CTAS=16 (ncclpy's limit: 33, 4 ranks per GPU, 132 SMs)"
            in p.summary)


def test_user_min_ctas_below_the_limit_is_left_alone():
    p = plan_placement(4, 1, NCCL_232, env={"NCCL_MIN_CTAS": "8"}, sm_count=132)
    assert p.max_ctas == 33 and {e["NCCL_MAX_CTAS"] for e in p.envs} == {"33"}
    assert all("NCCL_MIN_CTAS" not in e for e in p.envs) and "raised" not in p.summary


@pytest.mark.parametrize("user", [{"NCCL_MIN_CTAS": "40"}, {"NCCL_MIN_NCHANNELS": "40"},
                                  {"NCCL_MIN_CTAS": "12", "NCCL_MIN_NCHANNELS": "40"}])
def test_user_min_ctas_above_the_limit_raises_the_limit_and_says_so(user):
    # NCCL 2.17 refuses min > max (ncclInvalidArgument); later versions lower min to max,
    # silently overriding the user: ncclpy raises its max to the user's min and says so
    p = plan_placement(4, 1, NCCL_232, env=user, sm_count=132)
    assert p.max_ctas == 40 and {e["NCCL_MAX_CTAS"] for e in p.envs} == {"40"}
    assert all(not (set(e) & set(user)) for e in p.envs)            # the user's min untouched
    name = "NCCL_MIN_NCHANNELS" if "NCCL_MIN_NCHANNELS" in user else "NCCL_MIN_CTAS"
    assert (f"NCCL_MAX_CTAS=40 (raised to the user's {name}=40: NCCL refuses or lowers a min "
            f"above the max; 4 ranks per GPU, 132 SMs call for <= 33, so ranks may hang)"
            in p.summary)


def test_user_min_ctas_unparsable_is_ignored():
    p = plan_placement(4, 1, NCCL_232, env={"NCCL_MIN_CTAS": "lots"}, sm_count=132)
    assert p.max_ctas == 33


def test_older_nccl_hostid_socket_gets_the_cta_limit_too():
    p = plan_placement(4, 1, NCCL_227, env={}, sm_count=132)
    assert p.mode == "hostid-socket" and p.max_ctas == 33
    assert {e["NCCL_MAX_CTAS"] for e in p.envs} == {"33"}
    assert len({e["NCCL_HOSTID"] for e in p.envs}) == 4
    assert "NCCL_MAX_CTAS=33 (4 ranks per GPU, 132 SMs)" in p.summary


def test_nccl_before_2_17_gets_max_nchannels():
    p = plan_placement(4, 1, NCCL_216, env={}, sm_count=40)
    assert p.mode == "hostid-socket" and p.max_ctas == 10
    assert all(e["NCCL_MAX_NCHANNELS"] == "10" and "NCCL_MAX_CTAS" not in e for e in p.envs)
    assert "NCCL_MAX_NCHANNELS=10 (4 ranks per GPU, 40 SMs)" in p.summary
    kept = plan_placement(4, 1, NCCL_216, env={"NCCL_MAX_NCHANNELS": "2"}, sm_count=40)
    assert kept.kept == ("NCCL_MAX_NCHANNELS",) and "kept the user's NCCL_MAX_NCHANNELS=2" in \
        kept.summary


def test_unknown_nccl_version_sets_both_names():
    p = plan_placement(3, 1, None, env={}, sm_count=132)
    assert p.max_ctas == 32          # the cap NCCL has had since 2.5 (64 only from 2.25)
    assert all(e["NCCL_MAX_CTAS"] == e["NCCL_MAX_NCHANNELS"] == "32" for e in p.envs)
    assert "NCCL_MAX_CTAS/NCCL_MAX_NCHANNELS=32" in p.summary


def test_user_nvls_enable_1_is_flagged():
    p = plan_placement(2, 1, NCCL_232, env={"NCCL_NVLS_ENABLE": "1"})
    assert "NCCL_NVLS_ENABLE=1 (it makes NCCL fail init with several ranks per GPU" in p.summary
    safe = plan_placement(2, 1, NCCL_232, env={"NCCL_NVLS_ENABLE": "0"}).summary
    assert "kept the user's NCCL_NVLS_ENABLE=0" in safe and "fail" not in safe


@pytest.mark.parametrize("bad", [0, -4, True, 1.5, "132"])
def test_bad_sm_count(bad):
    with pytest.raises(ArgumentError, match="sm_count"):
        plan_placement(4, 1, NCCL_232, env={}, sm_count=bad)


def test_with_mps_adds_env_unset_and_summary():
    p = plan_placement(3, 1, NCCL_232, env={}, sm_count=132)
    q = with_mps(p, "started (CUDA_MPS_PIPE_DIRECTORY=/x/pipe)",
                 {"CUDA_MPS_PIPE_DIRECTORY": "/x/pipe"}, ("CUDA_VISIBLE_DEVICES",))
    assert q.summary == p.summary + "; MPS: started (CUDA_MPS_PIPE_DIRECTORY=/x/pipe)"
    assert q.mps.startswith("started") and q.unset == ("CUDA_VISIBLE_DEVICES",)
    assert all(e == {**pe, "CUDA_MPS_PIPE_DIRECTORY": "/x/pipe"} for e, pe in zip(q.envs, p.envs))
    assert p.mps is None and all("CUDA_MPS_PIPE_DIRECTORY" not in e for e in p.envs)
    line = summary_line("ncclpy run", q)
    assert "\n" not in line and line.endswith("; MPS: started (CUDA_MPS_PIPE_DIRECTORY=/x/pipe)")


# ---------------------------------------------------------------- the probes behind place()
def test_gpu_sm_count_never_raises():
    n = gpu_sm_count()
    assert n is None or (isinstance(n, int) and n > 0)
    assert gpu_sm_count({**os.environ, "CUDA_VISIBLE_DEVICES": ""}) is None   # no device


def test_place_reads_sm_count_only_above_two_ranks_per_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(P, "gpu_sm_count", lambda env=None: calls.append(1) or 100)
    monkeypatch.setattr(P, "loaded_nccl_version", lambda: NCCL_232)
    p = place(2, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert p.ranks_per_gpu == 2 and p.max_ctas is None and calls == []
    p = place(3, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert p.max_ctas == 33 and calls == [1] and "100 SMs" in p.summary
    p = place(3, env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert p.mode == "one-per-gpu" and calls == [1]
    monkeypatch.setattr(P, "gpu_sm_count", lambda env=None: None)   # unreadable: assumed
    assert place(4, env={"CUDA_VISIBLE_DEVICES": "0"}).max_ctas == ASSUMED_SM_COUNT // 4


@pytest.mark.parametrize("value, warned", [("0", False), ("1", True), ("2", True)])
def test_the_users_nvls_setting_is_kept_and_a_risky_one_said(value, warned):
    """Defect 6 of issue 21: with r mod G placement and G >= 2, NCCL's shared-GPU guard
    (hasMultiRankNvml, assigned in a pair loop) sees only the last pair, on two GPUs."""
    for ver in (NCCL_232, 22809):
        p = plan_placement(4, 2, ver, env={"NCCL_NVLS_ENABLE": value})
        assert all("NCCL_NVLS_ENABLE" not in e for e in p.envs)
        assert f"kept the user's NCCL_NVLS_ENABLE={value}" in p.summary
        assert (("NVLS may be set up" in p.summary or "fail init" in p.summary)) == warned
    one = plan_placement(2, 2, NCCL_232, env={})
    assert all("NCCL_NVLS_ENABLE" not in e for e in one.envs)    # no GPU shared: untouched
