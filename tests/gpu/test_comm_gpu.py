"""GPU tests of the communicator: several ranks (on one GPU if need be) via ncclpy.spawn.

One spawn per world size runs the whole collective x dtype x op matrix inside
(``_gpu_matrix.matrix``); the other features share a few spawns.  Each rank writes one JSON
line per check; the parent collects the failures of every rank into one message.
Skipped with the reason where CUDA, CuPy or NCCL is absent.
"""
from __future__ import annotations

import os
import sys

import pytest

from gpu_util import cuda_reason, requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common as G  # noqa: E402
import _gpu_features as F  # noqa: E402
import _gpu_matrix as M  # noqa: E402
from _gpu_spawn import (TEST_TIMEOUT, assert_clean, feature,  # noqa: E402
                        skipped_checks, spawn_records)

# every test here: bounded below the device tool's 10 minutes (see _gpu_spawn)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT)


@requires_gpu
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [pytest.param(n, marks=pytest.mark.gpu_world(n))
                                        for n in (1, 2, 3, 4)])
def test_collective_matrix(world_size, tmp_path, monkeypatch, request):
    """Every collective x dtype x op, in and out of place, lists, uneven all_to_all, the
    send/recv fallback paths, zero-size buffers, groups and barrier, at this world size.
    Checks that cannot run here (float8 reductions below compute capability 9.0) are not
    counted as run; they are listed in the junit property ``skipped_checks``."""
    run = spawn_records(M.matrix, world_size, str(tmp_path), monkeypatch)
    skipped = len(skipped_checks(run[0]))
    assert_clean(run, min_checks=len(G.ALL_DTYPES) * 50 - skipped, node=request.node)
    ranks = {r["rank"] for r in run[0]}
    assert len(ranks) == world_size


@pytest.fixture(scope="module")
def misc_run(tmp_path_factory):
    if cuda_reason():
        pytest.skip(cuda_reason())
    mp = pytest.MonkeyPatch()
    try:
        out = str(tmp_path_factory.mktemp("misc"))
        return spawn_records(F.misc, 2, out, mp)
    finally:
        mp.undo()


def _feature(run, name: str) -> None:
    feature(run, name, 2)


@requires_gpu
@pytest.mark.gpu_world(2)
def test_work_on_a_side_stream(misc_run):
    """Work.is_completed is False while the stream is held, wait(stream) orders another
    stream after it without blocking the host, wait() blocks the host."""
    _feature(misc_run, "work_side_stream")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_stream_arguments(misc_run):
    """stream= as a CuPy stream, a raw handle, a __cuda_stream__ object; default = current."""
    _feature(misc_run, "stream_kinds")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_raw_pointers(misc_run):
    """ncclpy.Buffer(ptr, count, dtype, device) for plain device pointers."""
    _feature(misc_run, "raw_pointers")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_premul_sum_bf16_raw(misc_run):
    """premul_sum(0.5) on bf16 gives n (the scalar converted to bf16), not zeros."""
    _feature(misc_run, "premul_bf16_raw")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_large_all_reduce_256MiB(misc_run):
    """A 256 MiB float32 all_reduce, checked element by element on the device."""
    _feature(misc_run, "large_256MiB")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_cuda_graph_replays_all_reduce(misc_run):
    """An all_reduce captured in a CUDA graph gives the right sums on three replays."""
    _feature(misc_run, "cuda_graph")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_register_and_mem_alloc(misc_run):
    """ncclMemAlloc'd Buffer, ncclCommRegister/Deregister, ncclMemFree, close() frees rest."""
    _feature(misc_run, "register_mem_alloc")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_register_same_buffer_twice(misc_run):
    """Two registrations of one buffer are two distinct Registrations, each deregistered once
    (a third deregister is an ArgumentError); close() deregisters every one still held."""
    _feature(misc_run, "register_twice")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_ctypes_communicator_and_split(misc_run):
    """A communicator made by ncclCommInitRankConfig (Config()) runs the collectives through
    ctypes, and splits through ncclCommSplit."""
    _feature(misc_run, "ctypes_comm")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_nonblocking_communicator(misc_run):
    """Config(blocking=False, comm_name, CTA limits): init, calls, group, finalize, close."""
    _feature(misc_run, "nonblocking_comm")


@requires_gpu
@pytest.mark.gpu_world(2)
def test_lifecycle(misc_run):
    """Context manager, idempotent close, calls after close refused, abort."""
    _feature(misc_run, "lifecycle")


@requires_gpu
@pytest.mark.slow
@pytest.mark.gpu_world(4)
def test_split_into_halves(tmp_path, monkeypatch, request):
    """4 ranks split into two halves that reduce independently; NOCOLOR returns None."""
    assert_clean(spawn_records(F.split, 4, str(tmp_path), monkeypatch), min_checks=2,
                 node=request.node)


@requires_gpu
@pytest.mark.slow
@pytest.mark.gpu_world(2)
def test_torch_tensors(tmp_path, monkeypatch, request):
    """torch tensors (float32, int64, complex64, bool, float8), bf16 premul_sum, torch streams."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    assert_clean(spawn_records(F.torch_worker, 2, str(tmp_path), monkeypatch), min_checks=3,
                 node=request.node)
