"""Device buffers: what ncclpy accepts as a send or receive buffer, parsed into one form.

:func:`as_buffer` turns a CuPy array, a torch CUDA tensor, any object exposing
``__cuda_array_interface__`` (v2/v3) or DLPack, or a raw :class:`Buffer` into a
:class:`BufferSpec`: pointer, element count of the logical dtype, dtype name, device and the
original object (the executor reads the framework's current stream from it).  Parsing never
touches the GPU and never imports torch or CuPy: pointers are only read, never dereferenced.

Rejected here, each with a message naming the argument: host memory (numpy arrays, CPU tensors,
DLPack CPU/pinned buffers), non-contiguous or negative strides, CAI masks, dtypes NCCL cannot
carry, NULL pointers of non-empty buffers.

Host memory mode (:func:`set_host_memory`: the CPU backend, ``ncclpy.init(device="cpu")``):
the other way round, host memory parsed by :mod:`ncclpy.buffers.host` (every check above applies)
and GPU memory refused.  One module-global read per parse decides which.

Cheap by type: what kind of object a buffer is (raw, CuPy array, torch tensor, numpy, something
else) is decided once per Python type (:func:`type_kind`), never by scanning the MRO per call;
CuPy arrays (exactly ``cupy.ndarray``) are read directly (pointer, size, dtype, flags) instead of
through ``__cuda_array_interface__``, whose export costs a stream lookup; dtype names are looked
up in dicts filled on first sight.  Every check still runs on every parse.
The parsed form (:class:`BufferSpec`), the device constants and the checks the host parsers
share with these live in :mod:`ncclpy.buffers.spec` and are re-exported here.  Imports point down:
this module imports :mod:`ncclpy.buffers.host` (the host memory parsers), which imports only
:mod:`ncclpy.buffers.spec`, never this module.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from . import host as _hostbuf
from .spec import (_GPU_COPY, _NP_NAMES, _TYPESTRS, DEVICE_HOST, DEVICE_UNKNOWN, BufferSpec,
                   _cai_dtype, _check_layout, _dtype, _prod, _shape, _spec, torch_spec)
from .dlpack import (DL_DEVICE_NAMES, DLDataType, DLDevice, DLManagedTensor,  # noqa: F401
                     DLManagedTensorVersioned, DLPackInfo, DLPackVersion, DLTensor, dlpack_dtype,
                     parse_dlpack_capsule)
from ..semantics.dtypes import LOGICAL, dtype_name
from ..errors import (U64_MAX, ArgumentError, ArgumentTypeError, NcclpyError, UnsupportedError,
                      as_int)

#: the largest CUDA device ordinal (a C int)
I32_MAX = (1 << 31) - 1

__all__ = ["BufferSpec", "Buffer", "as_buffer", "DEVICE_HOST", "DEVICE_UNKNOWN",
           "parse_dlpack_capsule", "DLPackInfo", "type_kind", "device_of", "from_cai",
           "set_host_memory", "host_memory"]

log = logging.getLogger(__name__)

#: host memory mode (see :func:`set_host_memory`): read on every parse, so a plain module global
_host = False


def set_host_memory(on: bool) -> None:
    """On: :func:`as_buffer` accepts host memory and refuses GPU memory, for the whole process
    (the CPU backend's installer sets it, before any communicator exists); off (the default):
    the other way round.  Calls cached under one mode are not re-checked under the other."""
    global _host
    _host = bool(on)
    _host = bool(on)


def host_memory() -> bool:
    """Whether host memory mode is on (see :func:`set_host_memory`)."""
    return _host


def _int_arg(name: str, what: str, value: Any, minimum: int) -> int:
    return as_int(f"{name}: {what}", value, minimum)


_DEVICE_EXPECTED = (f"expected a CUDA device ordinal (0..{I32_MAX}), or 'cpu' (or -1) for "
                    f"host memory")


def _buffer_device(value: Any) -> int:
    """``Buffer``'s ``device``: a CUDA ordinal, or DEVICE_HOST for ``'cpu'`` / -1."""
    if isinstance(value, str):
        if value.strip().lower() != "cpu":
            raise ArgumentError(f"Buffer: device {value!r} is not a device; {_DEVICE_EXPECTED}")
        return DEVICE_HOST
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ArgumentTypeError(f"Buffer: device must be an int or 'cpu', got {value!r} "
                                f"({type(value).__name__}); {_DEVICE_EXPECTED}")
    device = as_int("Buffer: device", value)
    if device != DEVICE_HOST and not 0 <= device <= I32_MAX:
        raise ArgumentError(f"Buffer: device is {device}; {_DEVICE_EXPECTED}")
    return device


@dataclass(frozen=True)
class Buffer:
    """A raw pointer: ``count`` elements of ``dtype`` on CUDA device ``device``, or in host
    memory with ``device="cpu"`` (or -1; stored as -1) for the CPU backend.

    ncclpy cannot check what lies behind a raw pointer; it is the caller's promise that
    ``ptr`` is memory of at least ``count * itemsize`` bytes where ``device`` says.
    """

    ptr: int
    count: int
    dtype: Any = "float32"
    device: Union[int, str] = 0

    def __post_init__(self) -> None:
        ptr = as_int("Buffer: ptr", self.ptr, 0, U64_MAX)
        count = as_int("Buffer: count", self.count, 0, U64_MAX)
        device = _buffer_device(self.device)
        try:
            dt = dtype_name(self.dtype)
        except NcclpyError as e:
            raise type(e)(f"Buffer: dtype: {e}") from None
        end = ptr + count * LOGICAL[dt].itemsize
        if end > U64_MAX + 1:
            raise ArgumentError(f"Buffer: ptr {ptr:#x} + count {count} x {LOGICAL[dt].itemsize} "
                                f"bytes ends at {end:#x}, past the 64-bit address space; "
                                f"expected a buffer that ends at or below 2**64")
        if ptr == 0 and count:
            raise ArgumentError(f"Buffer: ptr is NULL (0) but count is {count}; only an empty "
                                f"buffer (count 0) may have a NULL pointer")
        object.__setattr__(self, "ptr", ptr)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", dt)

    @property
    def nbytes(self) -> int:
        """The bytes the buffer spans, ``count * itemsize`` of its dtype."""
        return self.count * LOGICAL[self.dtype].itemsize


# -- helpers -----------------------------------------------------------------------------------
def _device_of(obj: Any, hint: Optional[int], known: Optional[int] = None) -> int:
    """The object's own device (``known``, else ``obj.device`` as an int, ``.id`` (CuPy) or
    ``.index`` (torch)); the caller's ``hint`` only where the object does not say."""
    if known is None:
        d = getattr(obj, "device", None)
        if d is not None:
            for v in (d, getattr(d, "id", None), getattr(d, "index", None)):
                if isinstance(v, int) and not isinstance(v, bool):
                    known = v
                    break
    if known is not None:
        return known
    if hint is not None:
        return _int_arg("device", "device", hint, 0)
    return DEVICE_UNKNOWN


#: what the host memory refusal adds: where host memory is welcome
HOST_HINT = " (for host memory, a CPU communicator: ncclpy.init(device='cpu'))"


def _host_error(name: str, what: str, expected: str) -> ArgumentError:
    """Host memory outside host memory mode: refused, saying where it would be accepted."""
    return ArgumentError(f"{name}: {what} is in host memory; NCCL needs device memory: "
                         f"expected {expected}{HOST_HINT}")


def device_of(obj: Any) -> int:
    """The device ``obj`` states itself (see :func:`_device_of`), else DEVICE_UNKNOWN."""
    return _device_of(obj, None)


# -- what a type is, decided once per type ------------------------------------------------------
#: type -> kind (see type_kind); bounded, refilled on demand
_KINDS: Dict[type, str] = {}
_NOT_BUFFERS = (type(None), bool, int, float, str, bytes, list, tuple, dict)


def _mro_modules(t: type) -> Tuple[str, ...]:
    return tuple((getattr(c, "__module__", "") or "").split(".")[0] for c in t.__mro__)


def _classify(t: type) -> str:
    if issubclass(t, BufferSpec):
        return "spec"
    if issubclass(t, Buffer):
        return "raw"
    if issubclass(t, _NOT_BUFFERS):
        return "prim"
    mods = _mro_modules(t)
    if "torch" in mods:
        return "torch"
    if "numpy" in mods:
        return "numpy"
    cp = sys.modules.get("cupy")
    if cp is not None and t is getattr(cp, "ndarray", None):
        return "cupy"
    return "cupy-cai" if "cupy" in mods else "other"


def type_kind(t: type) -> str:
    """What an object of type ``t`` is as a buffer, decided once per type (a class's MRO and
    module do not change): 'spec' (BufferSpec), 'raw' (Buffer), 'prim' (None, numbers,
    strings, containers: never a buffer), 'torch' (a class from torch), 'numpy', 'cupy'
    (exactly ``cupy.ndarray``: read directly), 'cupy-cai' (another CuPy class: read through
    ``__cuda_array_interface__``) or 'other' (probed per object: CAI, DLPack, host arrays)."""
    k = _KINDS.get(t)
    if k is None:
        k = _classify(t)
        if len(_KINDS) >= 1024:   # classes made on the fly must not pile up
            _KINDS.clear()
        _KINDS[t] = k
    return k


# -- torch -------------------------------------------------------------------------------------
def _from_torch(obj: Any, name: str, hint: Optional[int]) -> BufferSpec:
    dev = getattr(obj, "device", None)
    dev_type = str(getattr(dev, "type", dev))
    if dev_type != "cuda":
        if dev_type == "cpu":
            raise _host_error(name, f"a torch tensor on device 'cpu' "
                              f"({getattr(obj, 'dtype', '?')})",
                              "a CUDA tensor (e.g. tensor.cuda())")
        raise UnsupportedError(f"{name}: a torch tensor on device {dev_type!r}; expected a "
                               f"CUDA tensor")
    return torch_spec(obj, name, _device_of(obj, hint), "CUDA tensor", _GPU_COPY)


# -- __cuda_array_interface__ ------------------------------------------------------------------
def from_cai(obj: Any, cai: Any, name: str, hint: Optional[int] = None,
             framework: str = "cai") -> BufferSpec:
    """Parse ``obj`` from its ``__cuda_array_interface__`` export ``cai``, already read (what
    :func:`as_buffer` does for such an object after reading ``obj.__cuda_array_interface__``;
    the resolver reads the export once per call and shares it with the stream and the key).
    In host memory mode such an object is GPU memory: refused."""
    if _host:
        raise _hostbuf.cai_refusal(obj, cai, name)
    if type(cai) is not dict and not isinstance(cai, dict):
        raise ArgumentTypeError(f"{name}: __cuda_array_interface__ must be a dict, got "
                                f"{type(cai).__name__}")
    try:
        shape, typestr, data = cai["shape"], cai["typestr"], cai["data"]
    except KeyError:
        missing = [k for k in ("shape", "typestr", "data") if k not in cai]
        raise ArgumentError(f"{name}: __cuda_array_interface__ lacks "
                            f"{', '.join(missing)}") from None
    version = cai.get("version", 0)
    if not isinstance(version, int) or not 0 <= version <= 3:
        raise UnsupportedError(f"{name}: __cuda_array_interface__ version {version!r} is not "
                               f"supported; expected 0..3")
    if cai.get("mask") is not None:
        raise UnsupportedError(f"{name}: masked arrays (__cuda_array_interface__ 'mask' is "
                               f"set) cannot be communicated; expected mask None")
    dt = _TYPESTRS.get(typestr) if type(typestr) is str else None
    if dt is None:
        dt = _cai_dtype(name, obj, typestr)
    shape, count = _shape(name, shape)
    if (type(data) is not tuple and not isinstance(data, (tuple, list))) or len(data) != 2:
        raise ArgumentError(f"{name}: __cuda_array_interface__ data must be (ptr, readonly), "
                            f"got {data!r}")
    ptr, readonly = data
    if type(ptr) is not int:
        ptr = int(ptr or 0)
    strides = cai.get("strides")
    if strides is not None:
        _check_layout(name, shape, strides, LOGICAL[dt].itemsize, "bytes")
    if count and not ptr:
        raise ArgumentError(f"{name}: {count} elements but a NULL data pointer")
    own = getattr(obj, "device", None)    # a pure CAI object does not say: the hint decides
    device = DEVICE_UNKNOWN if own is None and hint is None else _device_of(obj, hint)
    return _spec(ptr, count, dt, device, shape, framework, obj, bool(readonly))


# -- CuPy, read directly -----------------------------------------------------------------------
def _from_cupy(obj: Any, name: str) -> BufferSpec:
    """A ``cupy.ndarray``: its memory pointer, size, dtype, flags and device, read directly (the
    ``__cuda_array_interface__`` export would also look up the current stream)."""
    d = obj.dtype
    dt = _NP_NAMES.get(d)
    if dt is None:
        dt = _dtype(name, d)
        if len(_NP_NAMES) < 256:
            _NP_NAMES[d] = dt
    shape = obj.shape
    try:
        contiguous = obj._c_contiguous
    except AttributeError:  # pragma: no cover - a CuPy without the cached flag
        contiguous = obj.flags.c_contiguous
    if not contiguous:      # same rule as CuPy's flag; this names the strides in the error
        _check_layout(name, shape, obj.strides, LOGICAL[dt].itemsize, "bytes")
    mem = obj.data
    count, ptr = obj.size, mem.ptr
    if count and not ptr:
        raise ArgumentError(f"{name}: {count} elements but a NULL data pointer")
    return _spec(ptr, count, dt, mem.device_id, shape, "cupy", obj)


# -- DLPack (the capsule layout and reader live in ncclpy.buffers.dlpack) ----------------------
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_ROCM_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 11, 13


def _from_dlpack(obj: Any, name: str, hint: Optional[int]) -> BufferSpec:
    dev_fn = getattr(obj, "__dlpack_device__", None)
    if dev_fn is None:
        raise ArgumentTypeError(f"{name}: object has __dlpack__ but no __dlpack_device__")
    dev_type, dev_id = (int(x) for x in dev_fn())
    dev_name = DL_DEVICE_NAMES.get(dev_type, f"device type {dev_type}")
    if dev_type in (_DL_CPU, _DL_CUDA_HOST, _DL_ROCM_HOST):
        raise _host_error(name, f"a DLPack buffer on {dev_name}",
                          "a CUDA device buffer (DLPack kDLCUDA)")
    if dev_type != _DL_CUDA:
        raise UnsupportedError(f"{name}: a DLPack buffer on {dev_name} is not supported; "
                               f"expected a CUDA device buffer (kDLCUDA)")
    try:   # -1: no synchronisation, only the metadata is read here
        cap = obj.__dlpack__(stream=-1)
    except TypeError:
        cap = obj.__dlpack__()
    info = parse_dlpack_capsule(cap, name)
    del cap
    if info.device_type != _DL_CUDA:
        raise ArgumentError(f"{name}: __dlpack_device__ says kDLCUDA but the capsule says "
                            f"{DL_DEVICE_NAMES.get(info.device_type, info.device_type)}")
    dt = dlpack_dtype(name, info.code, info.bits, info.lanes)
    _check_layout(name, info.shape, info.strides, 1, "elements")
    count = _prod(info.shape)
    if count and not info.ptr:
        raise ArgumentError(f"{name}: {count} elements but a NULL data pointer")
    return BufferSpec(info.ptr, count, dt, _device_of(obj, hint, info.device_id), info.shape,
                      "dlpack", True, obj, info.readonly)


# -- entry point -------------------------------------------------------------------------------
_ACCEPTED = ("a CuPy array, a torch CUDA tensor, an object with __cuda_array_interface__ or "
             "__dlpack__, or ncclpy.Buffer(ptr, count, dtype, device)")


def as_buffer(obj: Any, name: str = "buffer", device: Optional[int] = None) -> BufferSpec:
    """Parse ``obj`` into a :class:`BufferSpec` (see the module docstring).

    ``device`` is a hint for objects that do not say where they live (pure
    ``__cuda_array_interface__`` objects); without it such buffers get ``device`` -2 and the
    executor resolves it.  Objects that do say (CuPy, torch, DLPack) keep their own device.
    In host memory mode (:func:`set_host_memory`) :func:`ncclpy.buffers.host.as_host_buffer`
    parses instead: host buffers get ``device`` -2, GPU buffers are refused.
    """
    t = type(obj)
    kind = _KINDS.get(t) or type_kind(t)
    if _host:
        return _hostbuf.as_host_buffer(obj, name, kind)
    if kind == "cupy":
        return _from_cupy(obj, name)
    if kind == "raw":
        if obj.device == DEVICE_HOST:
            raise _host_error(name, f"an ncclpy.Buffer with device 'cpu' ({obj.dtype})",
                              "ncclpy.Buffer(ptr, count, dtype, device) on a CUDA device")
        return _spec(obj.ptr, obj.count, obj.dtype, obj.device, (obj.count,), "raw", obj)
    if kind == "spec":
        return obj
    if kind == "prim":
        hint = " (for a raw pointer use ncclpy.Buffer(ptr, count, dtype, device))" \
            if isinstance(obj, int) and not isinstance(obj, bool) else ""
        raise ArgumentTypeError(f"{name}: expected {_ACCEPTED}; got {t.__name__}{hint}")
    if kind == "torch" and callable(getattr(obj, "data_ptr", None)):
        return _from_torch(obj, name, device)
    if kind == "numpy":
        raise _host_error(name, f"a numpy array ({getattr(obj, 'dtype', '?')})",
                          "a device array (e.g. cupy.asarray(x))")
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        return from_cai(obj, cai, name, device, "cupy" if kind == "cupy-cai" else "cai")
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, name, device)
    if hasattr(obj, "__array_interface__"):
        raise _host_error(name, f"a {type(obj).__name__} exposing __array_interface__",
                          "a device array")
    raise ArgumentTypeError(f"{name}: expected {_ACCEPTED}; got {type(obj).__name__}")
