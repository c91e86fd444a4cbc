"""Cheap per-call keys of buffer arguments, for the resolver's cache.

A key is a tuple of the values that decide what :func:`ncclpy.buffers.buffer.as_buffer` makes of an
object, read again on every call: never the object's identity (an id is reused once an object
is freed, a torch tensor can be re-pointed in place with ``set_``/``resize_``, a
``__cuda_array_interface__`` dict can change).  Two objects with equal keys parse to buffers
with the same pointer, element count, dtype, device and layout, so they plan to the same NCCL
calls.  How a type is keyed is decided once per type (like the parser's kind, see
:func:`ncclpy.buffers.buffer.type_kind`):

* ``Buffer`` / ``BufferSpec``: their fields;
* ``cupy.ndarray`` (exactly): pointer, size, dtype, C-contiguity, device (plus shape and strides
  when not C-contiguous);
* ``torch.Tensor`` and subclasses: ``data_ptr()``, ``numel()``, dtype, device, layout,
  contiguity, the lazy conj/neg bits (plus sizes and strides when not contiguous);
* other ``__cuda_array_interface__`` producers: the interface's data, shape, typestr, strides,
  version and stream, and the device the object states;
* ``numpy.ndarray`` and subclasses (not masked arrays), in host memory mode only (the CPU
  backend; otherwise numpy is refused every call): the ``__array_interface__``'s data pointer
  and read-only flag, shape and strides, and the array's dtype;
* lists/tuples of those: the tuple of their keys.

Anything else (DLPack-only objects, whose capsule costs as much as parsing; opaque CAI ``V``
typestrs, which depend on the object's own dtype; masked arrays; what is not a buffer at all)
raises :class:`Uncacheable`: the resolver then parses and plans it in full, every call.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Hashable

from . import buffer as _buffers
from .buffer import DEVICE_UNKNOWN, device_of, type_kind

__all__ = ["Uncacheable", "buffer_key", "keyer", "cai_key"]

Keyer = Callable[[Any], Hashable]


class Uncacheable(Exception):
    """This argument has no cheap key: resolve the call in full."""


def _none(obj: Any) -> None:
    return None


def _raw(obj: Any) -> Hashable:
    return (type(obj), obj.ptr, obj.count, obj.dtype, obj.device)


def _spec(obj: Any) -> Hashable:
    return (type(obj), obj.ptr, obj.count, obj.dtype, obj.device, obj.contiguous, obj.readonly)


def _cupy(obj: Any) -> Hashable:
    mem = obj.data
    if obj._c_contiguous:
        return (type(obj), mem.ptr, obj.size, obj.dtype, mem.device_id)
    return (type(obj), mem.ptr, obj.size, obj.dtype, mem.device_id, obj.shape, obj.strides)


def _torch(obj: Any) -> Hashable:
    key = (type(obj), obj.data_ptr(), obj.numel(), obj.dtype, obj.device, obj.layout,
           obj.is_conj(), obj.is_neg())
    if obj.is_contiguous():
        return key
    return key + (tuple(obj.shape), obj.stride())


def _cai(obj: Any) -> Hashable:
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        raise Uncacheable(type(obj).__name__) from None
    return cai_key(obj, cai)


def _cupy_cai(obj: Any) -> Hashable:
    """Another CuPy class: keyed like any CAI producer (its own function, because its default
    stream is CuPy's, not the export's: the resolver shares the export only for 'other')."""
    return _cai(obj)


def cai_key(obj: Any, cai: Any) -> Hashable:
    """The key of ``obj`` from its ``__cuda_array_interface__`` export ``cai``, already read."""
    if type(cai) is not dict or cai.get("mask") is not None:
        raise Uncacheable("unusual __cuda_array_interface__")
    ts = cai.get("typestr")
    if type(ts) is not str or "V" in ts:   # opaque: the object's own dtype decides
        raise Uncacheable(f"typestr {ts!r}")
    get = cai.get
    return (type(obj), get("data"), get("shape"), ts, get("strides"), get("version"),
            get("stream"), DEVICE_UNKNOWN if getattr(obj, "device", None) is None
            else device_of(obj))


def _numpy(obj: Any) -> Hashable:
    """A numpy array's key in host memory mode; outside it, none (numpy is refused)."""
    if not _buffers._host:
        raise Uncacheable("numpy array outside host memory mode")
    ai = obj.__array_interface__
    return (type(obj), ai["data"], ai["shape"], ai["strides"], obj.dtype)


def _seq(obj: Any) -> Hashable:
    return (list, *map(buffer_key, obj))


def _never(obj: Any) -> Hashable:
    raise Uncacheable(type(obj).__name__)


#: type -> how to key its objects (filled on first sight of a type; bounded)
_KEYERS: Dict[type, Keyer] = {type(None): _none, list: _seq, tuple: _seq}


def _choose(t: type) -> Keyer:
    kind = type_kind(t)
    if kind == "raw":
        return _raw
    if kind == "spec":
        return _spec
    if kind == "cupy":
        return _cupy
    if kind == "torch":
        torch = sys.modules.get("torch")
        if torch is not None and issubclass(t, torch.Tensor):
            return _torch
        return _never
    if kind == "cupy-cai":
        return _cupy_cai
    if kind == "other":
        return _cai
    if kind == "numpy":
        np, ma = sys.modules.get("numpy"), sys.modules.get("numpy.ma")
        if np is not None and issubclass(t, np.ndarray) and \
                (ma is None or not issubclass(t, ma.MaskedArray)):
            return _numpy
    return _never            # 'prim' (not a buffer), numpy scalars and masked arrays


def keyer(t: type) -> Keyer:
    """The key function for objects of type ``t`` (decided once per type)."""
    k = _KEYERS.get(t)
    if k is None:
        k = _choose(t)
        if len(_KEYERS) >= 1024:
            _KEYERS.clear()
            _KEYERS.update({type(None): _none, list: _seq, tuple: _seq})
        _KEYERS[t] = k
    return k


def buffer_key(obj: Any) -> Hashable:
    """``obj``'s key (see the module docstring); raises :class:`Uncacheable` (or whatever
    reading the object raised) when it has none."""
    k = _KEYERS.get(type(obj))
    if k is None:
        k = keyer(type(obj))
    return k(obj)
