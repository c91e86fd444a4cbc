"""A first day's surprises (issue 22), each pinned: 64-bit pointers and counts, init()'s own
argument errors before the GPU check, the no-GPU error in ``ncclpy info``'s words."""
from __future__ import annotations

import os

import pytest

import ncclpy
from ncclpy import Buffer
from ncclpy.buffers import BufferSpec
from ncclpy.comm.resolver import Resolver
from ncclpy.errors import ArgumentError, ArgumentTypeError, CudaUnavailableError
from ncclpy.plan.types import PlanContext


@pytest.mark.parametrize("args, words", [
    ((2 ** 64, 4, "float32", 0), "ptr is 18446744073709551616; expected an int <= "),
    ((0x1000, 2 ** 64 + 5, "float32", 0), "count is 18446744073709551621"),
    ((2 ** 64 - 8, 4, "float32", 0), "past the 64-bit address space"),
    ((0x1000, 2 ** 62, "float64", 0), "past the 64-bit address space"),
    ((0x1000, 4, "float32", 2 ** 40), "device is 1099511627776"),
])
def test_buffer_refuses_what_does_not_fit_64_bits(args, words):
    with pytest.raises(ArgumentError, match="Buffer: ") as ei:
        Buffer(*args)
    assert words in str(ei.value)


def test_the_largest_buffer_that_fits_is_accepted():
    b = Buffer(2 ** 64 - 16, 4, "float32", 0)          # ends exactly at 2**64
    assert b.ptr + b.count * 4 == 2 ** 64


def test_planners_refuse_a_span_past_2_64_and_counts_past_size_t():
    r = Resolver(PlanContext(0, 2))
    with pytest.raises(ArgumentError, match="sendbuf at ptr 0xfffffffffffffff8 with 4 elements "
                                            "ends past the 64-bit address space"):
        r.resolve("all_reduce", 0, BufferSpec(2 ** 64 - 8, 4, "float32", 0), None, ("sum",))
    x = Buffer(0x100000, 8, "float32", 0)
    with pytest.raises(ArgumentError, match=r"send_counts\[1\] is 18446744073709551621"):
        r.resolve("all_to_all", 0, x, Buffer(0x200000, 8, "float32", 0),
                  ([4, 2 ** 64 + 5], [4, 4]))


@pytest.mark.parametrize("kwargs, cls, words", [
    ({"config": "x"}, ArgumentTypeError, "config must be an ncclpy.Config or None, got 'x'"),
    ({"uid_exchange": "bogus"}, ArgumentError, "uid_exchange: expected one of store, mpi, auto, "
                                               "got 'bogus'"),
    ({"timout": 1}, ArgumentTypeError, "unexpected keyword argument 'timout'; did you mean "
                                       "'timeout'?"),
    ({"name": ""}, ArgumentTypeError, "name must be a non-empty str"),
])
def test_init_checks_its_own_arguments_before_looking_for_a_gpu(kwargs, cls, words):
    with pytest.raises(cls) as ei:
        ncclpy.init(**kwargs)
    assert words in str(ei.value)
    assert not isinstance(ei.value, CudaUnavailableError)


def test_init_checks_the_uid_exchange_variable_first(monkeypatch):
    monkeypatch.setenv("NCCLPY_UID_EXCHANGE", "carrier-pigeon")
    with pytest.raises(ArgumentError, match="NCCLPY_UID_EXCHANGE: expected one of store, mpi, "
                                            "auto, got 'carrier-pigeon'"):
        ncclpy.init()


def test_no_gpu_error_is_public_and_speaks_like_ncclpy_info():
    from ncclpy.info import no_gpu_reason
    why = no_gpu_reason()
    if not why:
        pytest.skip("this machine has a usable GPU: the no-GPU error cannot be seen here")
    if why.startswith("CuPy is not"):
        pytest.skip("CuPy is not installed: init() stops earlier, at MissingDependencyError")
    assert ncclpy.CudaUnavailableError is CudaUnavailableError
    assert CudaUnavailableError.__module__ == "ncclpy.errors"
    with pytest.raises(CudaUnavailableError) as ei:
        ncclpy.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1)
    reason = why.split(";")[0]
    assert f"no usable CUDA device ({reason})" in str(ei.value), (str(ei.value), why)
    if "driver" in reason:
        assert "insufficient" not in str(ei.value)
    assert os.environ.get("NCCLPY_UID_EXCHANGE") is None
