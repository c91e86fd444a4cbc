"""GPU tests of issue 21 (abort- and capture-safety), on two ranks (one GPU if need be) via
ncclpy.spawn: a torch.cuda.graph capture in CUDA's default global mode right after ~200 eager
calls with the watchdog on (in-place all_reduce, list-form all_gather, replayed values
checked); a dropped Work's buffers are not reused while NCCL writes them; close() with a live
CUDA graph returns with the reason instead of hanging.  The CPU side of each (ordering,
locking, stream-ordered scratch) is tests/test_call_path_lifecycle.py, on a stand-in.
Skipped with the reason where CUDA, CuPy or NCCL is absent."""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_lifecycle as L  # noqa: E402
from _gpu_spawn import SHORT_TEST_TIMEOUT, feature, short_run  # noqa: E402

pytestmark = pytest.mark.timeout(SHORT_TEST_TIMEOUT)


@pytest.fixture(scope="module")
def life_run(tmp_path_factory):
    # processes of its own: it leaves a finalize blocked inside NCCL on purpose (close() with
    # a live graph), which a pooled rank would carry into the next test
    return short_run(L.lifecycle_worker, 2, tmp_path_factory, "life", own=True)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_torch_graph_capture_after_eager_calls_with_the_watchdog_on(life_run):
    feature(life_run, "torch_graph_after_eager", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_dropped_work_keeps_its_buffers_from_the_allocator(life_run):
    feature(life_run, "dropped_work_keeps_buffers", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_close_with_a_live_graph_returns_and_says_why(life_run):
    feature(life_run, "close_with_live_graph", 2)
