"""GPU tests of issue 49 (the call path holds for every caller), on two ranks (one GPU if
need be) via ncclpy.spawn: what only CUDA, torch's caching allocator and CuPy show
(tests/gpu/_gpu_callpath.py says what each checks; the CPU side is
tests/test_call_path_defects.py).  Skipped with the reason where CUDA, CuPy or NCCL is
absent."""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_callpath as C  # noqa: E402
from _gpu_spawn import SHORT_TEST_TIMEOUT, feature, short_run  # noqa: E402

pytestmark = pytest.mark.timeout(SHORT_TEST_TIMEOUT)


@pytest.fixture(scope="module")
def call_run(tmp_path_factory):
    return short_run(C.callpath_worker, 2, tmp_path_factory, "callpath")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_work_whose_stream_was_destroyed_is_waited_on_safely(call_run):
    feature(call_run, "destroyed_stream", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_work_recorded_before_a_capture_is_waited_on_during_it(call_run):
    feature(call_run, "wait_during_capture", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_prepared_call_keeps_the_stream_it_was_given(call_run):
    feature(call_run, "prepared_keeps_its_stream", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_storage_freed_in_place_in_flight_is_not_handed_out_again(call_run):
    feature(call_run, "storage_freed_in_flight", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_tensor_re_pointed_in_flight_keeps_its_memory_for_the_call(call_run):
    feature(call_run, "set_in_flight", 2)
