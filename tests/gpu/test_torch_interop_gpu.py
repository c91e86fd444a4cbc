"""GPU test: ncclpy inside a torch job, beside torch's own NCCL group on the same tensors
(``ncclpy.init(from_torch=True)``), and the object collectives on a real communicator.
Two ranks (on one GPU if need be) in one spawn, bounded by ``_gpu_spawn``'s short limits."""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import cuda_reason, requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _gpu_interop import torch_interop  # noqa: E402
from _gpu_spawn import SHORT_TEST_TIMEOUT, feature, short_run  # noqa: E402

pytestmark = pytest.mark.timeout(SHORT_TEST_TIMEOUT)


@pytest.fixture(scope="module")
def interop_run(tmp_path_factory):
    if not cuda_reason():
        pytest.importorskip("torch.distributed")
    return short_run(torch_interop, 2, tmp_path_factory, "interop")


@requires_gpu
@pytest.mark.gpu_world(2)
@pytest.mark.parametrize("name", ["from_torch_init", "from_torch_same_tensor",
                                  "from_torch_all_gather_bitwise", "object_collectives"])
def test_ncclpy_beside_torchs_nccl(name, interop_run):
    feature(interop_run, name, 2)
