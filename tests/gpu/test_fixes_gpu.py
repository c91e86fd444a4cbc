"""GPU tests of issue 13's fixes that need a GPU: a split of a nonblocking communicator gives a
working child on every rank with a colour (None for colour < 0), and ``NCCL_COMM_BLOCKING=0``
makes ``ncclpy.init()`` communicators nonblocking, and ncclpy follows that mode.  (Registering
one buffer twice: ``test_comm_gpu.py::test_register_same_buffer_twice``.)  Skipped with the
reason where CUDA, CuPy or NCCL is absent."""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_fixes as X  # noqa: E402
from _gpu_spawn import (SHORT_SPAWN_TIMEOUT, SHORT_TEST_TIMEOUT, assert_clean,  # noqa: E402
                        feature, spawn_records)


@requires_gpu
@pytest.mark.timeout(SHORT_TEST_TIMEOUT)
@pytest.mark.parametrize("world_size", [pytest.param(n, marks=pytest.mark.gpu_world(n))
                                        for n in (2, 4)])
def test_nonblocking_split(world_size, tmp_path, monkeypatch):
    """Config(blocking=False): split(rank // 2, -rank) gives every rank its pair (ranks
    reversed) and the pair's sum; split(-1 on the last rank) gives None there and an
    (n-1)-rank communicator elsewhere; children close, then the parent still reduces and
    closes."""
    run = spawn_records(X.nonblocking_split, world_size, str(tmp_path), monkeypatch,
                        timeout=SHORT_SPAWN_TIMEOUT)
    assert_clean(run, min_checks=2)
    feature(run, "nonblocking_split", world_size)
    feature(run, "min_ctas_alone", world_size)   # Config(min_ctas=2) alone is accepted


@requires_gpu
@pytest.mark.timeout(SHORT_TEST_TIMEOUT)
@pytest.mark.gpu_world(2)
def test_nccl_comm_blocking_0_in_the_environment(tmp_path, monkeypatch):
    """With NCCL_COMM_BLOCKING=0 in the ranks' environment, ncclpy.init() (no Config) reports
    nonblocking, runs an all_reduce and a group of send/recv, and closes."""
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    run = spawn_records(X.env_nonblocking, 2, str(tmp_path), monkeypatch,
                        timeout=SHORT_SPAWN_TIMEOUT)
    assert_clean(run, min_checks=2)
    for name in ("env_nonblocking_session", "env_nonblocking_init"):
        feature(run, name, 2)
