"""GPU tests of issue 24 (NCCL 2.22-2.32's host API) on two ranks (one GPU if need be) via
ncclpy.spawn: every 2.29+ Config field accepted by a real init, simulate vs measured within a
factor of 20, per-collective config accepted (each collective) and refused (an unsatisfiable
forced algorithm by NCCL; a rank-mismatched config by checked mode), scalable init with 2 ids,
the parameter API after init.  The CPU side is tests/test_nccl_host_api.py and the binding gate
tests/test_binding_gate.py.  Skipped with the reason where CUDA, CuPy or NCCL is absent."""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_host_api as H  # noqa: E402
from _gpu_spawn import SHORT_TEST_TIMEOUT, feature, short_run  # noqa: E402

pytestmark = pytest.mark.timeout(SHORT_TEST_TIMEOUT)


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    return short_run(H.host_api_worker, 2, tmp_path_factory, "hostapi")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_every_new_config_field_is_accepted_by_a_real_init(api_run):
    feature(api_run, "config_fields", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_simulated_group_estimates_within_a_factor_of_the_measured_time(api_run):
    feature(api_run, "simulate_vs_measured", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_collectives_take_a_per_collective_config(api_run):
    feature(api_run, "coll_config", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_a_bad_or_mismatched_per_collective_config_is_refused(api_run):
    feature(api_run, "coll_config_refused", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_scalable_init_with_two_unique_ids(api_run):
    feature(api_run, "scalable_init", 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_the_parameter_api_after_init(api_run):
    feature(api_run, "params_after_init", 2)
