"""Host buffers: what :func:`ncclpy.buffers.buffer.as_buffer` makes of a buffer in host memory mode.

When this process's communicators run on the CPU backend (``ncclpy.init(device="cpu")``, which
switches :func:`ncclpy.buffers.buffer.set_host_memory` on), buffers live in host memory: numpy
arrays and any object exposing ``__array_interface__`` (v3), torch CPU tensors, DLPack buffers on
kDLCPU or kDLCUDAHost (pinned host memory is host memory) and
``ncclpy.Buffer(ptr, count, dtype, device="cpu")``.  Each parses into a
:class:`~ncclpy.buffers.buffer.BufferSpec` with ``device`` DEVICE_UNKNOWN (the executor takes the
communicator's) and every check of the device parsers: contiguity, negative strides, dtypes NCCL
cannot carry, NULL pointers of non-empty buffers, the read-only flag.

GPU memory (CuPy arrays, torch CUDA tensors, ``__cuda_array_interface__`` objects, DLPack
kDLCUDA / kDLCUDAManaged, a Buffer on a CUDA device) is refused in one line naming the argument
and what is expected instead.  Like the device parsers, nothing here dereferences a pointer.

Imports point down: :mod:`ncclpy.buffers.buffer` imports this module (its host memory mode
dispatches here); this module takes the checks it shares with the device parsers from
:mod:`ncclpy.buffers.spec` and never imports :mod:`ncclpy.buffers.buffer`.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Tuple

from .spec import (_NP_NAMES, _TYPESTRS, DEVICE_HOST, DEVICE_UNKNOWN, BufferSpec, _cai_dtype,
                   _check_layout, _dtype, _prod, _shape, _spec, torch_spec)
from .dlpack import DL_DEVICE_NAMES, dlpack_dtype, parse_dlpack_capsule
from ..semantics.dtypes import LOGICAL
from ..errors import ArgumentError, ArgumentTypeError, UnsupportedError

__all__ = ["as_host_buffer", "from_array_interface", "gpu_refusal", "cai_refusal",
           "HOST_ACCEPTED"]

#: what a host memory mode call accepts, for the messages
HOST_ACCEPTED = ("a numpy array, a torch CPU tensor, a DLPack CPU buffer or "
                 "ncclpy.Buffer(ptr, count, dtype, device='cpu')")
_BACKEND = ("this process's communicators run on the CPU backend "
            "(ncclpy.init(device='cpu'))")
#: how a non-contiguous host buffer is fixed
_HOST_COPY = "numpy.ascontiguousarray(x) / .contiguous()"
#: DLPack device types: host memory (kDLCPU, kDLCUDAHost, kDLROCMHost) and GPU memory
_DL_HOST = (1, 3, 11)
_DL_GPU = (2, 13)


def gpu_refusal(name: str, what: str) -> ArgumentError:
    """The refusal of GPU memory ``what`` (e.g. "a CuPy array (float32)") in argument ``name``."""
    return ArgumentError(f"{name}: {what} is in GPU memory, but {_BACKEND}; expected host "
                         f"memory: {HOST_ACCEPTED}")


def cai_refusal(obj: Any, cai: Any, name: str) -> ArgumentError:
    """The refusal of a ``__cuda_array_interface__`` producer ``obj`` (its export ``cai``)."""
    ts = cai.get("typestr") if isinstance(cai, dict) else None
    kind = "a CuPy array" if type(obj).__module__.split(".")[0] == "cupy" else \
        f"a {type(obj).__name__} exposing __cuda_array_interface__"
    return gpu_refusal(name, f"{kind}" + (f" ({ts})" if isinstance(ts, str) else ""))


def as_host_buffer(obj: Any, name: str, kind: str) -> BufferSpec:
    """Parse ``obj`` (of :func:`~ncclpy.buffers.buffer.type_kind` ``kind``) as a host buffer, or
    refuse it (see the module docstring)."""
    if kind == "numpy":
        return _from_numpy(obj, name)
    if kind == "raw":
        if obj.device != DEVICE_HOST:
            raise gpu_refusal(name, f"an ncclpy.Buffer on CUDA device {obj.device} "
                                    f"({obj.dtype})")
        return _spec(obj.ptr, obj.count, obj.dtype, DEVICE_UNKNOWN, (obj.count,), "raw", obj)
    if kind == "spec":
        return obj
    if kind == "torch" and callable(getattr(obj, "data_ptr", None)):
        return _from_torch(obj, name)
    if kind == "prim":
        hint = " (for a raw pointer use ncclpy.Buffer(ptr, count, dtype, device='cpu'))" \
            if isinstance(obj, int) and not isinstance(obj, bool) else ""
        raise ArgumentTypeError(f"{name}: expected {HOST_ACCEPTED}; got "
                                f"{type(obj).__name__}{hint}")
    if kind == "cupy" or kind == "cupy-cai":
        raise gpu_refusal(name, f"a CuPy array ({getattr(obj, 'dtype', '?')})")
    return _from_other(obj, name)


def _from_other(obj: Any, name: str) -> BufferSpec:
    """An object of no known framework: by the protocol it offers (CUDA array interface:
    refused; array interface; DLPack)."""
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        raise cai_refusal(obj, cai, name)
    try:
        ai = obj.__array_interface__
    except AttributeError:
        ai = None
    if ai is not None:
        return from_array_interface(obj, ai, name)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, name)
    raise ArgumentTypeError(f"{name}: expected {HOST_ACCEPTED}, or an object with "
                            f"__array_interface__ or __dlpack__; got {type(obj).__name__}")


# -- numpy and __array_interface__ -------------------------------------------------------------
def _from_numpy(obj: Any, name: str) -> BufferSpec:
    """A numpy array: its ``__array_interface__``, with the dtype read from the array itself
    (exact for ml_dtypes' bfloat16/float8, whose typestr is opaque)."""
    np = sys.modules["numpy"]
    if not isinstance(obj, np.ndarray):   # a scalar's interface points at a temporary array
        raise ArgumentTypeError(f"{name}: a numpy {type(obj).__name__} is not an array; "
                                f"expected {HOST_ACCEPTED} (e.g. numpy.asarray(x))")
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(obj, ma.MaskedArray):
        raise UnsupportedError(f"{name}: a numpy masked array cannot be communicated (its "
                               f"mask would be lost); expected a plain array (e.g. .filled())")
    d = obj.dtype
    if d.byteorder == ">":
        raise UnsupportedError(f"{name}: dtype {d.str!r} is big-endian; ncclpy reads "
                               f"little-endian: expected {d.newbyteorder('<').str!r} "
                               f"(e.g. x.astype(x.dtype.newbyteorder('<')))")
    dt = _NP_NAMES.get(d)
    if dt is None:
        dt = _dtype(name, d)
        if len(_NP_NAMES) < 256:
            _NP_NAMES[d] = dt
    return _interface_spec(obj, obj.__array_interface__, name, dt, "numpy")


def from_array_interface(obj: Any, ai: Any, name: str) -> BufferSpec:
    """Parse ``obj`` from its ``__array_interface__`` export ``ai`` (v3; ``data`` must be a
    ``(ptr, readonly)`` pair): framework 'array_interface'."""
    if not isinstance(ai, dict):
        raise ArgumentTypeError(f"{name}: __array_interface__ must be a dict, got "
                                f"{type(ai).__name__}")
    missing = [k for k in ("shape", "typestr", "data") if k not in ai]
    if missing:
        raise ArgumentError(f"{name}: __array_interface__ lacks {', '.join(missing)}")
    version = ai.get("version", 3)
    if type(version) is not int or version != 3:
        raise UnsupportedError(f"{name}: __array_interface__ version {version!r} is not "
                               f"supported; expected 3")
    if ai.get("mask") is not None:
        raise UnsupportedError(f"{name}: masked arrays (__array_interface__ 'mask' is set) "
                               f"cannot be communicated; expected mask None")
    ts = ai["typestr"]
    dt = (_TYPESTRS.get(ts) if type(ts) is str else None) or \
        _cai_dtype(name, obj, ts, "__array_interface__")
    return _interface_spec(obj, ai, name, dt, "array_interface")


def _interface_spec(obj: Any, ai: Dict[str, Any], name: str, dt: str,
                    framework: str) -> BufferSpec:
    """The spec of an ``__array_interface__`` export whose dtype ``dt`` is known."""
    shape, count = _shape(name, ai["shape"])
    data = ai["data"]
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ArgumentError(f"{name}: __array_interface__ data must be (ptr, readonly), got "
                            f"{data!r}; pass a numpy array (numpy.asarray(x))")
    ptr, readonly = data
    ptr = int(ptr or 0)
    strides = ai.get("strides")
    if strides is not None:
        _check_layout(name, shape, strides, LOGICAL[dt].itemsize, "bytes", _HOST_COPY)
    if count and not ptr:
        raise ArgumentError(f"{name}: {count} elements but a NULL data pointer")
    return _spec(ptr, count, dt, DEVICE_UNKNOWN, shape, framework, obj, bool(readonly))


# -- torch and DLPack ---------------------------------------------------------------------------
def _from_torch(obj: Any, name: str) -> BufferSpec:
    """A torch tensor: on the CPU, parsed with every check of a CUDA one; on CUDA, refused."""
    dev = getattr(obj, "device", None)
    dev_type = str(getattr(dev, "type", dev))
    if dev_type == "cpu":
        return torch_spec(obj, name, DEVICE_UNKNOWN, "CPU tensor", _HOST_COPY)
    if dev_type == "cuda":
        raise gpu_refusal(name, f"a torch tensor on device {str(dev)!r} "
                                f"({getattr(obj, 'dtype', '?')})")
    raise UnsupportedError(f"{name}: a torch tensor on device {dev_type!r}; expected a CPU "
                           f"tensor (host memory: {_BACKEND})")


def _dlpack_device(obj: Any, name: str) -> Tuple[int, str]:
    """The DLPack device type of ``obj`` and its name."""
    dev_fn = getattr(obj, "__dlpack_device__", None)
    if dev_fn is None:
        raise ArgumentTypeError(f"{name}: object has __dlpack__ but no __dlpack_device__")
    dev_type = int(dev_fn()[0])
    return dev_type, DL_DEVICE_NAMES.get(dev_type, f"device type {dev_type}")


def _capsule(obj: Any) -> Any:
    """``obj``'s DLPack capsule: versioned where the producer offers it (it carries the
    read-only flag; numpy exports a read-only array no other way), else legacy."""
    try:
        return obj.__dlpack__(max_version=(1, 0))
    except TypeError:
        return obj.__dlpack__()


def _from_dlpack(obj: Any, name: str) -> BufferSpec:
    """A DLPack producer: host (kDLCPU, kDLCUDAHost, kDLROCMHost) memory parsed from its
    capsule, read without being consumed; GPU memory refused before any capsule is made."""
    dev_type, dev_name = _dlpack_device(obj, name)
    if dev_type in _DL_GPU:
        raise gpu_refusal(name, f"a DLPack buffer on {dev_name}")
    if dev_type not in _DL_HOST:
        raise UnsupportedError(f"{name}: a DLPack buffer on {dev_name} is not supported; "
                               f"expected host memory (kDLCPU or kDLCUDAHost)")
    cap = _capsule(obj)
    info = parse_dlpack_capsule(cap, name)
    del cap
    if info.device_type not in _DL_HOST:
        raise ArgumentError(f"{name}: __dlpack_device__ says {dev_name} but the capsule says "
                            f"{DL_DEVICE_NAMES.get(info.device_type, info.device_type)}")
    dt = dlpack_dtype(name, info.code, info.bits, info.lanes)
    _check_layout(name, info.shape, info.strides, 1, "elements", _HOST_COPY)
    count = _prod(info.shape)
    if count and not info.ptr:
        raise ArgumentError(f"{name}: {count} elements but a NULL data pointer")
    return _spec(info.ptr, count, dt, DEVICE_UNKNOWN, info.shape, "dlpack", obj, info.readonly)
