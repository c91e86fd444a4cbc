"""The CPU backend (``ncclpy.init(device="cpu")``) across real processes: every collective bit
for bit with the reference, p2p and groups, split, nonblocking, abort, what it refuses; and its
shared-memory channel leaves nothing behind.  Rank bodies: tests/cpu_backend_jobs.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ncclpy
from ncclpy.cpu.reduce import reduce as fast_reduce
from ncclpy.semantics import reference as R

import cpu_backend_jobs as J

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _left_behind(out: list) -> list:
    """The job's shared-memory names still in /dev/shm (its channels' prefixes, its pids' payload
    segments; other jobs may run meanwhile)."""
    prefixes = {p for o in out for p in o["prefixes"]}
    pids = {f"-p{o['pid']}" for o in out}
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes)
            or (n.startswith("ncclpy-") and any(n.endswith(p) for p in pids))]


def _run(fn, n: int, tmp_path, *args) -> list:
    ncclpy.spawn(fn, n, args=(str(tmp_path), *args), timeout=120)
    out = [json.load(open(tmp_path / f"{r}.json")) for r in range(n)]
    assert all(o["prefixes"] for o in out), out
    assert _left_behind(out) == [], "the job left shared memory behind"
    assert [o["violations"] for o in out] == [[]] * n, "NCCL rules broken"
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_bit_for_bit(tmp_path, n):
    out = _run(J.collectives, n, tmp_path)
    assert [o["checked"] for o in out] == [out[0]["checked"]] * n and out[0]["checked"] > 40


def test_p2p_groups_objects_prepared(tmp_path):
    out = _run(J.p2p_and_groups, 3, tmp_path)
    assert len(out) == 3


def test_split_nonblocking_abort_and_gpu_buffer_refused(tmp_path):
    out = _run(J.lifecycle, 4, tmp_path)
    for o in out:
        assert "is in GPU memory" in o["refused"] and "device='cpu'" in o["refused"], o


@pytest.mark.parametrize("kind", ["count", "skip"])
def test_a_mismatched_or_skipped_collective_waits_as_nccl_would(tmp_path, kind):
    out = _run(J.mismatch, 2, tmp_path, kind)
    assert out[0]["error"] == "NcclTimeoutError" and out[0]["waited"] >= 1.9, out
    if kind == "count":
        assert out[1]["error"] == "NcclTimeoutError", out


def test_ping_pong_self_sends_two_streams_big_groups_premul(tmp_path):
    out = _run(J.edges, 2, tmp_path, 1500)
    for o in out:
        assert o["alone"].startswith("ArgumentError: send: peer") and "is this rank" in o["alone"]
        assert o["unmatched"].startswith("NcclInvalidUsage") and \
            "send to self without a matching recv" in o["unmatched"], o


def test_ranks_on_two_machines_are_refused_on_every_rank(tmp_path):
    ncclpy.spawn(J.two_nodes, 2, args=(str(tmp_path),), timeout=120)
    for r in range(2):
        err = json.load(open(tmp_path / f"{r}.json"))["error"]
        assert err.startswith("UnsupportedError") and "one machine" in err, err


def test_fast_reduce_is_the_reference_bit_for_bit():
    rng = np.random.default_rng(7)
    for wire, ut in (("float32", np.uint32), ("float64", np.uint64)):
        for op in ("sum", "prod"):
            ins = [rng.integers(0, np.iinfo(ut).max, 4096, dtype=ut, endpoint=True).view(wire)
                   for _ in range(4)]
            special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan,
                                np.finfo(wire).smallest_subnormal, np.finfo(wire).max], wire)
            for a in ins:
                a[:7] = rng.permutation(special)
            got = fast_reduce(ins, op, wire, 4)
            with np.errstate(all="ignore"):
                want = R.reduce_arrays(ins, op, wire, 4)
            assert got.view(ut).tobytes() == np.asarray(want).view(ut).tobytes(), (wire, op)


def test_sweep_removes_only_segments_no_live_process_holds(tmp_path):
    import fcntl
    import time
    from ncclpy.cpu.shm import sweep
    names = ["ncclpy-" + "ab" * 8 + "-0", "ncclpy-" + "cd" * 8 + "-1-d1-p1", "ncclpy-young",
             "unrelated"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 60
    for name in names[:2] + names[3:]:
        os.utime(tmp_path / name, (old, old))
    held = os.open(tmp_path / names[1], os.O_RDWR)      # its owner is alive: a shared flock
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        assert sweep(str(tmp_path), min_age=10.0) == 1
        assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
    finally:
        os.close(held)


def test_device_cpu_is_refused_after_the_gpu_runtime_was_used():
    code = ("import ncclpy._nccl.cuda as c, ncclpy.cpu.backend as b\n"
            "class CupyRuntime: pass\n"
            "c._set(CupyRuntime())\n"
            "try:\n    b.install()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_ROOT,
                       timeout=60)
    assert "ArgumentError" in r.stdout and "either on the GPU or on the CPU" in r.stdout, r


def test_bad_device_argument_is_refused_before_any_rendezvous():
    with pytest.raises(ncclpy.ArgumentTypeError, match="'cpu'"):
        ncclpy.init(device="gpu0")
