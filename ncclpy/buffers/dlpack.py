"""DLPack capsules, read without being consumed: the ctypes layout of ``dlpack.h`` (legacy
``dltensor`` and versioned ``dltensor_versioned`` capsules), what a capsule describes
(:class:`DLPackInfo`) and its dtype as a logical ncclpy dtype.
:func:`ncclpy.buffers.buffer.as_buffer` uses them for objects that offer only ``__dlpack__``; the
names are re-exported there."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..semantics.dtypes import LOGICAL
from ..errors import ArgumentError, ArgumentTypeError, UnsupportedError

__all__ = ["DLDevice", "DLDataType", "DLTensor", "DLManagedTensor", "DLPackVersion",
           "DLManagedTensorVersioned", "DLPackInfo", "parse_dlpack_capsule", "dlpack_dtype",
           "DL_DEVICE_NAMES"]

DL_DEVICE_NAMES = {1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL",
                    7: "kDLVulkan", 8: "kDLMetal", 9: "kDLVPI", 10: "kDLROCM",
                    11: "kDLROCMHost", 12: "kDLExtDev", 13: "kDLCUDAManaged", 14: "kDLOneAPI",
                    15: "kDLWebGPU", 16: "kDLHexagon", 17: "kDLMAIA"}
#: (code, bits) -> logical dtype; codes from dlpack.h
_DL_DTYPES = {
    (0, 8): "int8", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (5, 32): "complex32", (5, 64): "complex64", (5, 128): "complex128",
    (6, 8): "bool", (10, 8): "float8_e4m3", (12, 8): "float8_e5m2",
}
_DL_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat",
                  5: "complex", 6: "bool", 7: "float8_e3m4", 8: "float8_e4m3 (with inf)",
                  9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn", 11: "float8_e4m3fnuz",
                  12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
                  15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]


@dataclass(frozen=True)
class DLPackInfo:
    """What a DLPack capsule describes (pointer already includes ``byte_offset``)."""

    ptr: int
    device_type: int
    device_id: int
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]]   # elements; None: compact row-major
    code: int
    bits: int
    lanes: int
    readonly: bool
    versioned: bool


def _capsule_api():
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return api


def parse_dlpack_capsule(capsule: Any, name: str = "buffer") -> DLPackInfo:
    """Read a ``dltensor`` or ``dltensor_versioned`` capsule without consuming it.

    The capsule is neither renamed nor its deleter called here: when the caller drops it, the
    producer's capsule destructor frees the managed tensor, while the data stays owned by the
    producing object.
    """
    if type(capsule).__name__ != "PyCapsule":
        raise ArgumentTypeError(f"{name}: __dlpack__() returned {type(capsule).__name__}, "
                                f"expected a PyCapsule")
    api = _capsule_api()
    cname = api.PyCapsule_GetName(capsule)
    if cname == b"dltensor":
        mt = DLManagedTensor.from_address(api.PyCapsule_GetPointer(capsule, cname))
        t, readonly, versioned = mt.dl_tensor, False, False
    elif cname == b"dltensor_versioned":
        mv = DLManagedTensorVersioned.from_address(api.PyCapsule_GetPointer(capsule, cname))
        if mv.version.major != 1:
            raise UnsupportedError(f"{name}: DLPack ABI version {mv.version.major}."
                                   f"{mv.version.minor} is not supported; expected 1.x")
        t, readonly, versioned = mv.dl_tensor, bool(mv.flags & 1), True
    else:
        raise ArgumentError(f"{name}: DLPack capsule named {cname!r} (already consumed?); "
                            f"expected 'dltensor' or 'dltensor_versioned'")
    ndim = int(t.ndim)
    if ndim < 0:
        raise ArgumentError(f"{name}: DLPack ndim {ndim} is negative")
    shape = tuple(int(t.shape[i]) for i in range(ndim)) if ndim else ()
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if ndim and t.strides else None
    return DLPackInfo(int(t.data or 0) + int(t.byte_offset), int(t.device.device_type),
                      int(t.device.device_id), shape, strides, int(t.dtype.code),
                      int(t.dtype.bits), int(t.dtype.lanes), readonly, versioned)


def dlpack_dtype(name: str, code: int, bits: int, lanes: int) -> str:
    if lanes != 1:
        raise UnsupportedError(f"{name}: DLPack vector dtype ({lanes} lanes) is not supported; "
                               f"expected lanes 1")
    dt = _DL_DTYPES.get((code, bits))
    if dt is None:
        kind = _DL_CODE_NAMES.get(code, f"type code {code}")
        raise UnsupportedError(f"{name}: DLPack dtype {kind}{bits} cannot be carried by NCCL; "
                               f"expected one of {', '.join(LOGICAL)}")
    return dt
