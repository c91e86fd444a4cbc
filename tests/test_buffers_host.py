"""Host memory mode (the CPU backend, ``ncclpy.buffers.buffer.set_host_memory``): host buffers
(numpy, ``__array_interface__``, torch CPU tensors, DLPack CPU/pinned, ``Buffer(device='cpu')``)
parse with every check, GPU buffers are refused naming the argument, the default stream is the CPU
runtime's; with the mode off, host memory is refused with a hint.  The mode is process-wide:
the ``host`` fixture switches it on and always puts it back."""
from __future__ import annotations

import numpy as np
import pytest

from ncclpy._nccl import cuda as cudamod
from ncclpy.buffers.buffer import (DEVICE_UNKNOWN, Buffer, BufferSpec, as_buffer, from_cai,
                                   host_memory, set_host_memory)
from ncclpy.buffers.key import Uncacheable, buffer_key
from ncclpy.comm import hot, streams
from ncclpy.comm.resolver import Resolver
from ncclpy.semantics.dtypes import LOGICAL
from ncclpy.errors import ArgumentError, ArgumentTypeError, UnsupportedError
from ncclpy.plan import checks
from ncclpy.plan.types import PlanContext
from nccl_standin import DevArray
from test_buffers import PTR, CupyLike, DLPackCuda, TorchLike

GPU = "is in GPU memory, but this process's communicators run on the CPU backend " \
      "(ncclpy.init(device='cpu')); expected host memory: a numpy array, a torch CPU tensor, " \
      "a DLPack CPU buffer or ncclpy.Buffer(ptr, count, dtype, device='cpu')"
HINT = "(for host memory, a CPU communicator: ncclpy.init(device='cpu'))"


@pytest.fixture
def host():
    """Host memory mode on for the test, then back to what it was."""
    before = host_memory()
    set_host_memory(True)
    try:
        yield
    finally:
        set_host_memory(before)


class ArrayIface:
    """A plain ``__array_interface__`` producer (no numpy type)."""

    def __init__(self, ai):
        self.__array_interface__ = ai


class DLWrap:
    """Only the DLPack protocol of a numpy array (the DLPack path, not the numpy path)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_mode_is_off_by_default_and_switches():
    assert host_memory() is False
    try:
        set_host_memory(True)
        assert host_memory() is True
    finally:
        set_host_memory(False)
    assert host_memory() is False


# -- numpy and __array_interface__ -----------------------------------------------------------------
def test_numpy_1d_2d_empty(host):
    a = np.arange(6, dtype=np.float32)
    s = as_buffer(a, "sendbuf")
    assert (s.ptr, s.count, s.dtype, s.device, s.shape, s.framework) == \
        (a.ctypes.data, 6, "float32", DEVICE_UNKNOWN, (6,), "numpy")
    assert s.obj is a and s.contiguous and not s.readonly
    b = np.zeros((3, 4), np.int64)
    assert (as_buffer(b).count, as_buffer(b).shape) == (12, (3, 4))
    assert as_buffer(b[1:]).ptr == b.ctypes.data + 32          # a contiguous view
    assert as_buffer(b[:, :1][:1]).count == 1                  # size-1 dims, any stride
    assert as_buffer(np.zeros(0, np.float32)).count == 0
    assert as_buffer(np.zeros((0, 3), np.float32)).count == 0
    assert as_buffer(np.zeros((), np.float64)).count == 1


def test_numpy_every_dtype_numpy_has(host):
    seen = []
    for name in LOGICAL:
        try:
            dt = np.dtype(name)
        except TypeError:       # bfloat16, float8, complex32 (numpy without ml_dtypes)
            continue
        assert as_buffer(np.zeros(3, dt), "x").dtype == name
        seen.append(name)
    assert len(seen) >= 12, seen


def test_numpy_readonly(host):
    a = np.zeros(4, np.float32)
    a.flags.writeable = False
    assert as_buffer(a).readonly
    ctx = PlanContext(0, 2, 0, 23203, False)
    assert checks.buf(ctx, "all_reduce", "sendbuf", a).readonly
    with pytest.raises(ArgumentError, match="recvbuf is read-only"):
        checks.buf(ctx, "all_reduce", "recvbuf", a, output=True)


@pytest.mark.parametrize("view, words", [
    (lambda a: a[:, ::2], ["not C-contiguous", "(32, 16)", "numpy.ascontiguousarray"]),
    (lambda a: a.T, ["not C-contiguous"]),
    (lambda a: a[::-1], ["negative strides"]),
])
def test_numpy_layout_refused(host, view, words):
    with pytest.raises(ArgumentError) as ei:
        as_buffer(view(np.zeros((3, 4), np.float64)), "sendbuf")
    for w in ["sendbuf", *words]:
        assert w in str(ei.value)


@pytest.mark.parametrize("obj, exc, words", [
    (np.zeros(3, np.int16), UnsupportedError, ["int16"]),
    (np.zeros(3, ">f4"), UnsupportedError, ["big-endian", "'<f4'"]),
    (np.float32(1.0), ArgumentTypeError, ["numpy float32 is not an array"]),
    (np.ma.masked_array(np.zeros(3)), UnsupportedError, ["masked"]),
])
def test_numpy_refusals(host, obj, exc, words):
    with pytest.raises(exc) as ei:
        as_buffer(obj, "buf")
    for w in ["buf", *words]:
        assert w in str(ei.value)


def test_array_interface_objects(host):
    a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    s = as_buffer(ArrayIface(a.__array_interface__), "x")
    assert (s.ptr, s.count, s.dtype, s.shape, s.framework, s.device) == \
        (a.ctypes.data, 6, "uint8", (2, 3), "array_interface", DEVICE_UNKNOWN)
    ro = dict(a.__array_interface__, data=(a.ctypes.data, True))
    assert as_buffer(ArrayIface(ro)).readonly
    for ai, exc, words in [
            (dict(shape=(2,), typestr="<f4", data=(0, False), version=3), ArgumentError, "NULL"),
            (dict(shape=(2, 2), typestr="<f4", data=(PTR, False), strides=(4, 8), version=3),
             ArgumentError, "not C-contiguous"),
            (dict(shape=(2,), typestr="<i2", data=(PTR, False), version=3), UnsupportedError,
             "int16"),
            (dict(shape=(2,), typestr="<f4", data=None, version=3), ArgumentError, "data must"),
            (dict(shape=(2,), typestr="<f4", data=(PTR, False), version=2), UnsupportedError,
             "version 2"),
            (dict(shape=(2,), data=(PTR, False)), ArgumentError, "lacks typestr")]:
        with pytest.raises(exc, match=words):
            as_buffer(ArrayIface(ai), "x")


# -- torch CPU tensors, DLPack, raw Buffers --------------------------------------------------------
def test_torch_cpu_tensor(host):
    torch = pytest.importorskip("torch")
    t = torch.ones(2, 3, dtype=torch.bfloat16)
    s = as_buffer(t, "t")
    assert (s.ptr, s.count, s.dtype, s.device, s.shape, s.framework) == \
        (t.data_ptr(), 6, "bfloat16", DEVICE_UNKNOWN, (2, 3), "torch")
    assert as_buffer(torch.zeros(0)).count == 0
    with pytest.raises(ArgumentError, match="t: not C-contiguous"):
        as_buffer(torch.zeros(3, 4).t(), "t")
    with pytest.raises(ArgumentError, match="resolve_conj"):
        as_buffer(torch.zeros(3, dtype=torch.complex64).conj(), "t")
    with pytest.raises(UnsupportedError, match="int16"):
        as_buffer(torch.zeros(3, dtype=torch.int16), "t")
    with pytest.raises(UnsupportedError, match="'meta'.*CPU tensor"):
        as_buffer(torch.empty(3, device="meta"), "t")


def test_dlpack_host_buffers(host):
    a = np.arange(8, dtype=np.float32)
    s = as_buffer(DLWrap(a), "d")
    assert (s.ptr, s.count, s.dtype, s.device, s.framework) == \
        (a.ctypes.data, 8, "float32", DEVICE_UNKNOWN, "dlpack")
    assert np.from_dlpack(DLWrap(a)).ctypes.data == a.ctypes.data   # still consumable
    ro = np.zeros(4, np.int32)
    ro.flags.writeable = False
    assert as_buffer(DLWrap(ro)).readonly                  # the versioned capsule says so
    with pytest.raises(ArgumentError, match="not C-contiguous"):
        as_buffer(DLWrap(np.zeros((2, 3), np.float32).T), "d")
    pinned = as_buffer(DLPackCuda((2, 5), dev=(3, 0)), "p")   # kDLCUDAHost: host memory
    assert (pinned.ptr, pinned.count, pinned.device) == (PTR, 10, DEVICE_UNKNOWN)
    with pytest.raises(UnsupportedError, match="kDLROCM is not supported"):
        as_buffer(DLPackCuda((2,), dev=(10, 0)), "d")


@pytest.mark.parametrize("device", ["cpu", "CPU", -1])
def test_raw_host_buffer(host, device):
    b = Buffer(PTR, 5, "f16", device)
    assert b.device == -1
    s = as_buffer(b, "r")
    assert (s.ptr, s.count, s.dtype, s.device, s.framework) == \
        (PTR, 5, "float16", DEVICE_UNKNOWN, "raw")
    assert buffer_key(b) == buffer_key(Buffer(PTR, 5, "float16", "cpu"))


# -- GPU memory in host memory mode ----------------------------------------------------------------
@pytest.mark.parametrize("obj, what", [
    (CupyLike((4,), "<f4"), "a CuPy array (float32)"),
    (TorchLike((4,)), "a torch tensor on device"),
    (DevArray(np.zeros(4, np.float32)), "a DevArray exposing __cuda_array_interface__ (<f4)"),
    (DLPackCuda((4,)), "a DLPack buffer on kDLCUDA"),
    (DLPackCuda((4,), dev=(13, 0)), "a DLPack buffer on kDLCUDAManaged"),
    (Buffer(PTR, 4, "float32", 0), "an ncclpy.Buffer on CUDA device 0 (float32)"),
])
def test_gpu_memory_refused(host, obj, what):
    with pytest.raises(ArgumentError) as ei:
        as_buffer(obj, "sendbuf")
    msg = str(ei.value)
    assert msg.startswith(f"sendbuf: {what}") and msg.endswith(GPU) and "\n" not in msg
    if isinstance(obj, DLPackCuda):
        assert obj.calls == []                          # refused before any capsule


def test_gpu_memory_refused_exact_and_through_the_resolver(host):
    with pytest.raises(ArgumentError) as ei:
        as_buffer(CupyLike((4,), "<f4"), "x")
    assert str(ei.value) == f"x: a CuPy array (float32) {GPU}"
    d = DevArray(np.zeros(4, np.float32))
    with pytest.raises(ArgumentError, match="GPU memory"):
        from_cai(d, d.__cuda_array_interface__, "x")
    res = Resolver(PlanContext(0, 2, 0, 23203, False))
    for _ in range(2):                                  # refused every time, never cached
        with pytest.raises(ArgumentError, match="^sendbuf: a DevArray.*GPU memory"):
            res.resolve("all_reduce", 0x51, d, None, ("sum",))
    assert len(res) == 0
    with pytest.raises(ArgumentTypeError, match="device='cpu'"):
        as_buffer(1234, "x")


# -- mode off: host memory refused, with the hint --------------------------------------------------
def test_mode_off_refuses_host_memory_with_hint():
    assert not host_memory()
    for obj in (np.zeros(3, np.float32), Buffer(PTR, 3, "float32", "cpu"),
                DLPackCuda((3,), dev=(1, 0))):
        with pytest.raises(ArgumentError) as ei:
            as_buffer(obj, "recvbuf")
        assert "recvbuf" in str(ei.value) and "host memory" in str(ei.value)
        assert str(ei.value).endswith(HINT)
    spec = BufferSpec(PTR, 3, "float32", -1)
    ctx = PlanContext(0, 2, 0, 23203, False)
    with pytest.raises(ArgumentError, match="host memory") as ei:
        checks.buf(ctx, "all_reduce", "sendbuf", spec)
    assert str(ei.value).endswith(HINT)
    with pytest.raises(Uncacheable):                    # numpy: parsed (and refused) each call
        buffer_key(np.zeros(3))


def test_host_spec_passes_the_plan_check(host):
    ctx = PlanContext(0, 2, 0, 23203, False)
    assert checks.buf(ctx, "all_reduce", "sendbuf", BufferSpec(PTR, 3, "float32", -1)).count == 3


# -- streams and keys ------------------------------------------------------------------------------
class FakeRuntime:
    """Only the current stream: a sentinel per device."""

    def current_stream(self, device):
        return 0x5E00 + device


def test_default_stream_is_the_runtimes(host, monkeypatch):
    torch = pytest.importorskip("torch")

    def boom(*a, **kw):
        raise AssertionError("torch.cuda touched in host memory mode")
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    if hasattr(torch._C, "_cuda_getCurrentRawStream"):
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", boom)
    a, t = np.zeros(4, np.float32), torch.zeros(4)
    with cudamod.use(FakeRuntime()):
        for obj in (a, t, Buffer(PTR, 4, "float32", "cpu"), as_buffer(a), DLWrap(a)):
            assert streams.default_stream_of(obj, 1) == 0x5E01
            assert streams.default_stream([as_buffer(obj)], 1) == 0x5E01
            assert streams.resolve_stream(None, [obj], 1) == 0x5E01
        assert streams.torch_stream(2) == 0x5E02
        for obj in (a, t, Buffer(PTR, 4, "float32", "cpu")):
            getter = hot._default_getter(obj, buffer_key(obj))
            assert getter is not None and getter(0) == 0x5E00
        res = Resolver(PlanContext(0, 2, 0, 23203, False))
        r1 = res.resolve("all_reduce", None, a, None, ("sum",))
        r2 = res.resolve("all_reduce", None, a, None, ("sum",))
        assert r1 is r2 and r1.stream == 0x5E00 and res.misses == 1   # the fast path's cache
        assert res.resolve("all_reduce", None, t, None, ("sum",)).stream == 0x5E00


def test_numpy_keys_in_host_mode(host):
    a = np.zeros((2, 3), np.float32)
    k = buffer_key(a)
    assert buffer_key(a) == k and k == buffer_key(a.view())       # same memory, same parse
    assert buffer_key(a[1:]) != k and buffer_key(a.T) != k
    assert buffer_key(a.view(np.int32)) != k
    a.flags.writeable = False
    assert buffer_key(a) != k
    with pytest.raises(Uncacheable):
        buffer_key(np.float32(1.0))                              # scalars: parsed and refused
    with pytest.raises(Uncacheable):
        buffer_key(np.ma.masked_array(np.zeros(3)))
    torch = pytest.importorskip("torch")
    t = torch.zeros(3)
    assert buffer_key(t) == buffer_key(t)                         # torch CPU: keyed as before
