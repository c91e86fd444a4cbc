"""GPU tests of issue 37 (the thin call), on two ranks (one GPU if need be) via ncclpy.spawn:
a torch tensor re-pointed in place is a miss; a captured call is learned from
cudaErrorCapturedEvent without invalidating the capture; a steady loop with the defaults
creates no event and its dropped Works are released by the tracker; a record on the legacy
stream with another device current (two GPUs).  The CPU side of each (tests/test_fast_path.py,
tests/test_call_budget.py) runs on the stand-in.  Skipped with the reason where CUDA, CuPy or
NCCL is absent."""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_fastpath as F  # noqa: E402
from _gpu_spawn import SHORT_TEST_TIMEOUT, feature, short_run  # noqa: E402

pytestmark = pytest.mark.timeout(SHORT_TEST_TIMEOUT)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    return short_run(F.fastpath_worker, 2, tmp_path_factory, "fast")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_tensor_re_pointed_in_place_is_a_miss(fast_run):
    feature(fast_run, "repointed_tensor", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_captured_call_is_learned_from_its_event_after_the_capture(fast_run):
    feature(fast_run, "captured_learned", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_steady_loop_creates_no_event_and_its_tracker_releases_buffers(fast_run):
    feature(fast_run, "pool_holds_what_is_in_flight", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_record_on_the_legacy_stream_with_another_device_current(fast_run):
    feature(fast_run, "legacy_stream_other_device", 2)
