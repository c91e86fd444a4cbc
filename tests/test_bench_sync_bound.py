"""nccl-tests' ``-T`` on the GPU backends' stream sync (bench/backends/_cuda.py), driven on CPU
through a scripted ``cudaStreamQuery``: done ends the wait, a CUDA error other than
cudaErrorNotReady is raised at once (never waited out), an NCCL asynchronous error aborts the
communicator at once, and only a stream still pending past the bound is a StreamTimeout; and a
StreamTimeout in the warm-up fails the run instead of skipping the case (review, 2026-11-27)."""
from __future__ import annotations

import types
from typing import List

import pytest

from bench.backends._cuda import CupyStreamBackend, StreamTimeout
from bench.backends import Backend
from bench.sweep import Coord, SweepConfig, _Rank

pytestmark = pytest.mark.timeout(120)


class _CudaError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA status {status}")
        self.status = status


class _Comm:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.aborted, self.checks = error, 0, 0

    def check_async_error(self) -> None:
        self.checks += 1
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self.aborted += 1


def _backend(answers: List[int], comm: _Comm, timeout: float | None) -> CupyStreamBackend:
    """A backend whose stream answers ``answers`` in turn (the last one for ever)."""
    queue = list(answers)

    def stream_query(ptr: int) -> int:
        assert ptr == 1234
        return queue.pop(0) if len(queue) > 1 else queue[0]

    b = object.__new__(CupyStreamBackend)
    b.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        streamQuery=stream_query, CUDARuntimeError=_CudaError)))
    b.stream = types.SimpleNamespace(ptr=1234, synchronize=lambda: None)
    b.sync_timeout, b.rank, b.label, b.comm = timeout, 0, "cupy", comm
    return b


def test_a_stream_that_finishes_ends_the_wait_and_checks_the_communicator():
    comm = _Comm()
    _backend([600, 600, 0], comm, 60.0).sync()
    assert comm.checks == 2 and comm.aborted == 0


def test_a_cuda_fault_is_raised_at_once_not_waited_out():
    comm = _Comm()
    b = _backend([600, 700], comm, 3600.0)       # cudaErrorIllegalAddress, an hour's bound
    with pytest.raises(_CudaError) as e:
        b.sync()
    assert e.value.status == 700 and comm.checks == 1


def test_an_nccl_async_error_aborts_the_communicator_at_once():
    comm = _Comm(error=RuntimeError("ncclRemoteError: peer closed"))
    b = _backend([600], comm, 3600.0)
    with pytest.raises(RuntimeError, match="ncclRemoteError"):
        b.sync()
    assert comm.aborted == 1 and b.comm is None


def test_a_stream_still_pending_past_the_bound_aborts_and_raises_stream_timeout():
    comm = _Comm()
    b = _backend([600], comm, 0.01)
    with pytest.raises(StreamTimeout, match=r"-T/--timeout 0.01: rank 0's cupy stream did not "
                                            r"finish within 0.01 s; its communicator was aborted"):
        b.sync()
    assert comm.aborted == 1 and b.comm is None


def test_without_T_the_sync_is_cuda_s_own():
    seen = []
    b = _backend([600], _Comm(), None)
    b.stream.synchronize = lambda: seen.append("sync")
    b.sync()
    assert seen == ["sync"]


class _HangingWarmup(Backend):
    name = label = "hang"

    def alloc(self, collective, count, dtype):
        return None

    def run(self, collective, bufs, op, root, in_place) -> None:
        pass

    def sync(self) -> None:
        raise StreamTimeout("-T/--timeout 1: rank 0's hang stream did not finish within 1 s")

    def free(self, bufs) -> None:
        pass


def test_a_timeout_in_the_warm_up_fails_the_run_instead_of_skipping_the_case():
    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=1, check=0)
    b = _HangingWarmup()
    state = _Rank(cfg, "all_reduce", 0, 1, Coord(None, 0, 1, 10.0), [b])
    with pytest.raises(StreamTimeout):
        state.case_ok(b, "float32", "sum", -1)
    assert state.skipped == []
