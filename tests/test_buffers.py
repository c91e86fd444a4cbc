"""Buffer parsing: CuPy-like, torch-like, CAI v2/v3, DLPack (ctypes-built CUDA capsules and real
torch CPU capsules), raw Buffer.  Fakes are plain Python objects exposing the protocols with
made-up device pointers -- parsing never dereferences a pointer."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ncclpy.buffers.buffer import (DEVICE_UNKNOWN, Buffer, BufferSpec, DLManagedTensor,
                                   DLManagedTensorVersioned, as_buffer, parse_dlpack_capsule)
from ncclpy.errors import ArgumentError, ArgumentTypeError, UnsupportedError

PTR = 0x7F00_0000_1000


# -- fakes -----------------------------------------------------------------------------------------
class _Dev:
    def __init__(self, id=None, index=None, type="cuda"):
        self.id, self.index, self.type = id, index, type


class CupyLike:
    """Looks like cupy.ndarray to the parser (module 'cupy...')."""

    def __init__(self, shape, typestr, ptr=PTR, strides=None, device=0, version=3, dtype=None,
                 **extra):
        self.device = _Dev(id=device)
        self.dtype = np.dtype(typestr) if dtype is None else dtype
        self.__cuda_array_interface__ = dict(shape=tuple(shape), typestr=typestr,
                                             data=(ptr, False), strides=strides,
                                             version=version, stream=1, **extra)


CupyLike.__module__ = "cupy._core.core"


class CaiOnly:
    """A pure __cuda_array_interface__ producer (numba-like): no device attribute."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class TorchLike:
    """Duck-types a torch CUDA tensor (module 'torch')."""

    def __init__(self, shape, dtype="float32", ptr=PTR, strides=None, device="cuda", index=0,
                 conj=False):
        self.shape, self.dtype, self._ptr = tuple(shape), _TorchDtype(dtype), ptr
        self.device = _Dev(index=index, type=device)
        self.layout = "torch.strided"
        acc, st = 1, []
        for s in reversed(shape):
            st.append(acc)
            acc *= s
        self._strides = tuple(strides) if strides is not None else tuple(reversed(st))
        self._conj = conj

    def data_ptr(self):
        return self._ptr

    def stride(self):
        return self._strides

    def is_conj(self):
        return self._conj

    def is_neg(self):
        return False


TorchLike.__module__ = "torch"

_NAMES = {False: b"dltensor", True: b"dltensor_versioned"}
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DLPackCuda:
    """A DLPack producer for a CUDA buffer, built with ctypes (no GPU needed to describe one)."""

    def __init__(self, shape, code=2, bits=32, lanes=1, ptr=PTR, strides=None, byte_offset=0,
                 dev=(2, 0), versioned=False, readonly=False):
        self.dev, self.versioned = dev, versioned
        nd = len(shape)
        self._shape = (ctypes.c_int64 * max(nd, 1))(*shape)
        self._strides = (ctypes.c_int64 * max(nd, 1))(*strides) if strides is not None else None
        self.mt = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        t = self.mt.dl_tensor
        t.data, t.ndim, t.byte_offset = ptr, nd, byte_offset
        t.device.device_type, t.device.device_id = dev
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        if versioned:
            self.mt.version.major, self.mt.version.minor = 1, 0
            self.mt.flags = 1 if readonly else 0
        self.calls = []

    def __dlpack_device__(self):
        return self.dev

    def __dlpack__(self, stream=None, **kw):
        self.calls.append(stream)
        return _capsule_new(ctypes.addressof(self.mt), _NAMES[self.versioned], None)


class DLPackWrap:
    """Only the DLPack protocol of a real tensor (the DLPack path, not the torch path)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, *a, **kw):
        return self.t.__dlpack__(*a, **kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


# -- raw Buffer ------------------------------------------------------------------------------------
def test_raw_buffer():
    b = Buffer(PTR, 10, "bf16", 1)
    assert b.dtype == "bfloat16" and b.nbytes == 20
    s = as_buffer(b, "x")
    assert s == BufferSpec(PTR, 10, "bfloat16", 1, (10,), "raw", True)
    assert s.obj is b and s.nbytes == 20 and s.strides_ok
    assert as_buffer(Buffer(0, 0, "float32", 0)).count == 0
    assert as_buffer(s) is s
    assert Buffer(np.int64(PTR), np.int32(3), np.float64, 0).dtype == "float64"


@pytest.mark.parametrize("kw, exc, words", [
    (dict(ptr=-1, count=1), ArgumentError, ["ptr", ">= 0"]),
    (dict(ptr=0, count=4), ArgumentError, ["NULL", "count 0"]),
    (dict(ptr=PTR, count=-2), ArgumentError, ["count", ">= 0"]),
    (dict(ptr=PTR, count=2.5), ArgumentTypeError, ["count", "int"]),
    (dict(ptr="0x10", count=2), ArgumentTypeError, ["ptr", "int"]),
    (dict(ptr=PTR, count=2, device=-2), ArgumentError, ["device is -2", "'cpu'"]),
    (dict(ptr=PTR, count=2, device="gpu"), ArgumentError, ["device 'gpu'", "'cpu'", "ordinal"]),
    (dict(ptr=PTR, count=2, device=1.0), ArgumentTypeError, ["device", "1.0", "float"]),
    (dict(ptr=PTR, count=2, dtype="int16"), UnsupportedError, ["int16", "NCCL"]),
    (dict(ptr=PTR, count=2, dtype="quux"), ArgumentTypeError, ["quux"]),
    (dict(ptr=True, count=2), ArgumentTypeError, ["bool"]),
])
def test_raw_buffer_rejects(kw, exc, words):
    kw.setdefault("dtype", "float32")
    with pytest.raises(exc) as ei:
        Buffer(**kw)
    for w in words:
        assert w in str(ei.value)


# -- CuPy-like / CAI -------------------------------------------------------------------------------
@pytest.mark.parametrize("typestr, dtype", [
    ("<f4", "float32"), ("<f2", "float16"), ("<f8", "float64"), ("|i1", "int8"),
    ("|u1", "uint8"), ("<i4", "int32"), ("<u4", "uint32"), ("<i8", "int64"), ("<u8", "uint64"),
    ("|b1", "bool"), ("<c8", "complex64"), ("<c16", "complex128")])
def test_cupy_like(typestr, dtype):
    a = CupyLike((3, 4), typestr, device=2)
    s = as_buffer(a, "x")
    assert (s.ptr, s.count, s.dtype, s.device, s.shape, s.framework) == \
        (PTR, 12, dtype, 2, (3, 4), "cupy")
    assert s.obj is a and s.contiguous and not s.readonly


def test_cai_v2_v3_and_strides():
    # v2, strides None
    s = as_buffer(CaiOnly(dict(shape=(5,), typestr="<f4", data=(PTR, False), version=2)))
    assert (s.count, s.framework, s.device) == (5, "cai", DEVICE_UNKNOWN)
    # device hint for objects that do not say
    s = as_buffer(CaiOnly(dict(shape=(5,), typestr="<f4", data=(PTR, False), version=2)),
                  device=3)
    assert s.device == 3
    # ... but never overrides a device the object states itself
    assert as_buffer(CupyLike((2,), "<f4", device=2), device=5).device == 2
    assert as_buffer(TorchLike((2,), index=1), device=5).device == 1
    assert as_buffer(DLPackCuda((2,), dev=(2, 4)), device=5).device == 4
    # v3 with explicit C-contiguous strides (bytes)
    s = as_buffer(CupyLike((2, 3), "<f8", strides=(24, 8)))
    assert s.count == 6
    # size-1 dimensions may have any stride
    assert as_buffer(CupyLike((1, 4, 1), "<i4", strides=(999, 4, 7))).count == 4
    # empty arrays: NULL pointer and any strides are fine
    s = as_buffer(CupyLike((0, 3), "<f4", ptr=0, strides=(4, 400)))
    assert (s.ptr, s.count) == (0, 0)
    # 0-d
    assert as_buffer(CupyLike((), "<f4")).count == 1
    # read-only flag kept
    cai = dict(shape=(2,), typestr="<f4", data=(PTR, True), version=3)
    assert as_buffer(CaiOnly(cai)).readonly


def test_cai_bfloat16_needs_the_objects_dtype():
    # torch/ml_dtypes publish bfloat16 as '<V2': believed when the object's dtype says so
    class MlDtype:
        name = "bfloat16"
    s = as_buffer(CupyLike((4,), "<V2", dtype=MlDtype()))
    assert s.dtype == "bfloat16" and s.nbytes == 8

    class Fp8:
        name = "float8_e4m3fn"
    assert as_buffer(CupyLike((4,), "|V1", dtype=Fp8())).dtype == "float8_e4m3"
    with pytest.raises(UnsupportedError, match="opaque 2-byte"):
        as_buffer(CaiOnly(dict(shape=(4,), typestr="<V2", data=(PTR, False), version=3)))


@pytest.mark.parametrize("obj, exc, words", [
    (CupyLike((4, 4), "<f4", strides=(4, 16)), ArgumentError, ["not C-contiguous", "(4, 16)"]),
    (CupyLike((4,), "<f4", strides=(-4,)), ArgumentError, ["negative strides"]),
    (CupyLike((4, 2), "<f4", strides=(16, 4)), ArgumentError, ["not C-contiguous"]),
    (CupyLike((4,), "<i2"), UnsupportedError, ["int16"]),
    (CupyLike((4,), "<u2"), UnsupportedError, ["uint16"]),
    (CupyLike((4,), ">f4"), UnsupportedError, ["big-endian"]),
    (CupyLike((4,), "<M8"), UnsupportedError, ["cannot be carried"]),
    (CupyLike((4,), "<f4", mask=object()), UnsupportedError, ["mask"]),
    (CupyLike((4,), "<f4", version=4), UnsupportedError, ["version 4"]),
    (CupyLike((4,), "<f4", ptr=0), ArgumentError, ["NULL"]),
    (CaiOnly(dict(shape=(4,), data=(PTR, False))), ArgumentError, ["lacks typestr"]),
    (CaiOnly([1, 2]), ArgumentTypeError, ["must be a dict"]),
    (CaiOnly(dict(shape=(4,), typestr="f", data=(PTR, False))), ArgumentError, ["malformed"]),
])
def test_cai_rejects(obj, exc, words):
    with pytest.raises(exc) as ei:
        as_buffer(obj, "mybuf")
    msg = str(ei.value)
    assert "mybuf" in msg
    for w in words:
        assert w in msg


# -- torch-like and real torch ---------------------------------------------------------------------
@pytest.mark.parametrize("tdtype, dtype", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("float8_e4m3fn", "float8_e4m3"), ("float8_e5m2", "float8_e5m2"), ("bool", "bool"),
    ("complex64", "complex64"), ("complex32", "complex32"), ("uint64", "uint64")])
def test_torch_like(tdtype, dtype):
    t = TorchLike((2, 3), tdtype, index=1)
    s = as_buffer(t, "t")
    assert (s.ptr, s.count, s.dtype, s.device, s.shape, s.framework) == \
        (PTR, 6, dtype, 1, (2, 3), "torch")


@pytest.mark.parametrize("t, exc, words", [
    (TorchLike((3, 3), strides=(1, 3)), ArgumentError, ["not C-contiguous"]),
    (TorchLike((3,), "int16"), UnsupportedError, ["int16"]),
    (TorchLike((3,), "float8_e4m3fnuz"), UnsupportedError, ["float8_e4m3fnuz"]),
    (TorchLike((3,), device="cpu"), ArgumentError, ["host memory", "'cpu'", "CUDA tensor"]),
    (TorchLike((3,), device="mps"), UnsupportedError, ["'mps'"]),
    (TorchLike((3,), "complex64", conj=True), ArgumentError, ["resolve_conj"]),
])
def test_torch_like_rejects(t, exc, words):
    with pytest.raises(exc) as ei:
        as_buffer(t, "tensor_arg")
    assert "tensor_arg" in str(ei.value)
    for w in words:
        assert w in str(ei.value)


def test_real_torch_cpu_tensor_is_host_memory():
    torch = pytest.importorskip("torch")
    with pytest.raises(ArgumentError) as ei:
        as_buffer(torch.ones(4), "sendbuf")
    msg = str(ei.value)
    assert "sendbuf" in msg and "host memory" in msg and "'cpu'" in msg and "CUDA tensor" in msg
    with pytest.raises(UnsupportedError, match="'meta'"):
        as_buffer(torch.empty(4, device="meta"), "x")
    # the DLPack path of the same CPU tensor: also host memory, before any capsule is made
    with pytest.raises(ArgumentError, match="kDLCPU"):
        as_buffer(DLPackWrap(torch.ones(4)), "y")


def test_numpy_is_host_memory():
    with pytest.raises(ArgumentError, match="numpy array.*host memory"):
        as_buffer(np.zeros(3, np.float32), "recvbuf")


@pytest.mark.parametrize("obj", [None, 12345, 1.5, "buf", [1, 2], object()])
def test_not_a_buffer(obj):
    with pytest.raises(ArgumentTypeError) as ei:
        as_buffer(obj, "sendbuf")
    assert "sendbuf" in str(ei.value) and "expected" in str(ei.value)
    if isinstance(obj, int):
        assert "ncclpy.Buffer" in str(ei.value)


# -- DLPack ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, bits, dtype", [
    (2, 32, "float32"), (2, 16, "float16"), (2, 64, "float64"), (4, 16, "bfloat16"),
    (0, 8, "int8"), (0, 32, "int32"), (0, 64, "int64"), (1, 8, "uint8"), (1, 32, "uint32"),
    (1, 64, "uint64"), (6, 8, "bool"), (5, 64, "complex64"), (5, 128, "complex128"),
    (10, 8, "float8_e4m3"), (12, 8, "float8_e5m2")])
@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_cuda_capsule(code, bits, dtype, versioned):
    p = DLPackCuda((2, 5), code, bits, byte_offset=64, dev=(2, 3), versioned=versioned)
    s = as_buffer(p, "d")
    assert (s.ptr, s.count, s.dtype, s.device, s.shape, s.framework) == \
        (PTR + 64, 10, dtype, 3, (2, 5), "dlpack")
    assert p.calls == [-1]          # metadata only: asked for no stream synchronisation


def test_dlpack_strides_and_flags():
    assert as_buffer(DLPackCuda((2, 3), strides=(3, 1))).count == 6
    assert as_buffer(DLPackCuda((), strides=None)).count == 1
    assert as_buffer(DLPackCuda((0,), ptr=0)).count == 0
    assert as_buffer(DLPackCuda((4,), versioned=True, readonly=True)).readonly
    with pytest.raises(ArgumentError, match="not C-contiguous"):
        as_buffer(DLPackCuda((2, 3), strides=(1, 2)), "d")
    with pytest.raises(ArgumentError, match="negative strides"):
        as_buffer(DLPackCuda((3,), strides=(-1,)), "d")


@pytest.mark.parametrize("kw, exc, words", [
    (dict(code=2, bits=32, lanes=4), UnsupportedError, ["lanes"]),
    (dict(code=0, bits=16), UnsupportedError, ["int16"]),
    (dict(code=8, bits=8), UnsupportedError, ["float8_e4m3 (with inf)"]),
    (dict(code=17, bits=4), UnsupportedError, ["float4_e2m1fn"]),
    (dict(dev=(1, 0)), ArgumentError, ["host memory", "kDLCPU"]),
    (dict(dev=(3, 0)), ArgumentError, ["host memory", "kDLCUDAHost"]),
    (dict(dev=(13, 0)), UnsupportedError, ["kDLCUDAManaged"]),
    (dict(dev=(10, 0)), UnsupportedError, ["kDLROCM"]),
])
def test_dlpack_rejects(kw, exc, words):
    with pytest.raises(exc) as ei:
        as_buffer(DLPackCuda((4,), **kw), "dl")
    assert "dl" in str(ei.value)
    for w in words:
        assert w in str(ei.value)


def test_dlpack_parser_against_real_torch_capsules():
    """The ctypes struct layout matches a real producer; reading does not consume the capsule."""
    torch = pytest.importorskip("torch")
    cases = [(torch.float32, 2, 32), (torch.bfloat16, 4, 16), (torch.bool, 6, 8),
             (torch.complex64, 5, 64), (torch.int64, 0, 64), (torch.uint8, 1, 8),
             (torch.float8_e4m3fn, 10, 8), (torch.float8_e5m2, 12, 8)]
    for dt, code, bits in cases:
        t = torch.zeros(3, 4, dtype=dt)[1:]
        for kw in ({}, {"max_version": (1, 0)}):
            try:
                cap = t.__dlpack__(**kw)
            except TypeError:   # pragma: no cover - torch without versioned DLPack
                continue
            info = parse_dlpack_capsule(cap)
            assert info.ptr == t.data_ptr() and info.shape == (2, 4)
            assert info.strides in (None, (4, 1)) and (info.code, info.bits) == (code, bits)
            assert (info.device_type, info.lanes) == (1, 1)
            assert info.versioned == bool(kw)
            if not kw and dt is torch.float32:   # still consumable afterwards
                assert torch.from_dlpack(cap).data_ptr() == t.data_ptr()
    info = parse_dlpack_capsule(torch.zeros(3, 4).t().__dlpack__())
    assert info.strides == (1, 4)


def test_dlpack_consumed_capsule_rejected():
    torch = pytest.importorskip("torch")
    cap = torch.zeros(2).__dlpack__()
    torch.from_dlpack(cap)    # renames it to used_dltensor
    with pytest.raises(ArgumentError, match="already consumed"):
        parse_dlpack_capsule(cap, "x")
    with pytest.raises(ArgumentTypeError, match="PyCapsule"):
        parse_dlpack_capsule(object(), "x")


# -- real CuPy arrays, read directly (no __cuda_array_interface__ export, no device touched) --
def _cupy_array(shape, dtype="float32", ptr=PTR, device=0):
    cupy = pytest.importorskip("cupy")
    n = int(np.prod(shape)) if shape else 1
    mem = cupy.cuda.UnownedMemory(ptr, max(n, 1) * np.dtype(dtype).itemsize, None, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int8", "uint8", "int32",
                                   "uint32", "int64", "uint64", "bool", "complex64",
                                   "complex128"])
def test_real_cupy_array(dtype):
    a = _cupy_array((3, 4), dtype)
    s = as_buffer(a, "x")
    assert (s.ptr, s.count, s.dtype, s.device, s.shape, s.framework) == \
        (PTR, 12, dtype, 0, (3, 4), "cupy")
    assert s.obj is a and s.contiguous and not s.readonly


def test_real_cupy_views_and_refusals():
    a = _cupy_array((4, 6))
    s = as_buffer(a[1:], "x")                      # a contiguous view: offset pointer
    assert (s.ptr, s.count) == (PTR + 24, 18)
    assert as_buffer(a[:, :1][:1], "x").count == 1   # size-1 dims, any stride
    assert as_buffer(_cupy_array((0, 3)), "x").count == 0
    assert as_buffer(_cupy_array(()), "x").count == 1
    with pytest.raises(ArgumentError, match=r"not C-contiguous.*\(24, 8\)"):
        as_buffer(a[:, ::2], "x")
    with pytest.raises(ArgumentError, match="not C-contiguous"):
        as_buffer(a.T, "x")
    with pytest.raises(ArgumentError, match="negative strides"):
        as_buffer(a[::-1], "x")
    with pytest.raises(UnsupportedError) as ei:
        as_buffer(_cupy_array((4,), "int16"), "mybuf")
    assert "mybuf" in str(ei.value) and "int16" in str(ei.value)
    assert as_buffer(_cupy_array((4,), device=1), "x").device == 1


def test_type_kind_is_decided_once_per_type():
    from ncclpy.buffers.buffer import _KINDS, type_kind
    assert type_kind(Buffer) == "raw" and type_kind(BufferSpec) == "spec"
    assert type_kind(int) == type_kind(list) == type_kind(type(None)) == "prim"
    assert type_kind(np.ndarray) == "numpy" and type_kind(TorchLike) == "torch"
    assert type_kind(CupyLike) == "cupy-cai" and type_kind(CaiOnly) == "other"
    cupy = pytest.importorskip("cupy")
    assert type_kind(cupy.ndarray) == "cupy"

    class Sub(cupy.ndarray):
        pass
    assert type_kind(Sub) == "cupy-cai"             # only the exact type is read directly
    assert _KINDS[Buffer] == "raw"


# -- from_cai: the parse of an export already read -----------------------------------------------
class _Exp:
    def __init__(self, cai, device=None):
        self.__cuda_array_interface__ = cai
        if device is not None:
            self.device = device


@pytest.mark.parametrize("cai", [
    dict(shape=(2, 3), typestr="<f4", data=(PTR, False), version=3),
    dict(shape=(np.int64(4),), typestr="<i8", data=(PTR, True), strides=(8,), version=2),
    dict(shape=[0], typestr="<f2", data=(0, False), version=3),
    dict(shape=(True, 5), typestr="|u1", data=[PTR, 0], version=1),
])
def test_from_cai_equals_as_buffer(cai):
    from ncclpy.buffers.buffer import from_cai
    x = _Exp(cai)
    a, b = from_cai(x, cai, "b"), as_buffer(x, "b")
    assert a == b and a.readonly == b.readonly and a.obj is x and a.framework == "cai"
    assert type(a.count) is int and all(type(n) is int for n in a.shape)
    assert from_cai(_Exp(cai, 1), cai, "b").device == 1 == as_buffer(_Exp(cai, 1)).device


@pytest.mark.parametrize("cai, err, words", [
    (dict(shape=(-1,), typestr="<f4", data=(PTR, False)), ArgumentError, "negative extent"),
    (dict(shape=(2, -1), typestr="<f4", data=(PTR, False)), ArgumentError, "negative extent"),
    (dict(shape=(2,), typestr="<f4", data=(PTR,)), ArgumentError, "data must be"),
    (dict(shape=(2,), typestr="<f4", data=(0, False)), ArgumentError, "NULL"),
    (dict(shape=(2,), typestr="<f4", data=(PTR, False), version=True + 3), UnsupportedError,
     "version"),
])
def test_from_cai_refuses_what_as_buffer_refuses(cai, err, words):
    from ncclpy.buffers.buffer import from_cai
    with pytest.raises(err, match=words) as e1:
        from_cai(_Exp(cai), cai, "b")
    with pytest.raises(err, match=words) as e2:
        as_buffer(_Exp(cai), "b")
    assert str(e1.value) == str(e2.value)


def test_dlpack_names_stay_importable_from_buffers():
    import ncclpy.buffers.buffer as nb
    import ncclpy.buffers.dlpack as nd
    for n in ("DLManagedTensor", "DLManagedTensorVersioned", "DLPackInfo",
              "parse_dlpack_capsule", "DLTensor"):
        assert getattr(nb, n) is getattr(nd, n)
