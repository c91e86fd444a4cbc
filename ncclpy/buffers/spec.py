"""The parsed buffer, and the checks and lookups every buffer parser shares.

:class:`BufferSpec` (what :func:`ncclpy.buffers.buffer.as_buffer` returns) and ``_spec``, its fast
constructor; what both the device parsers (:mod:`ncclpy.buffers.buffer`) and the host memory mode
parsers (:mod:`ncclpy.buffers.host`) run: C-contiguity (``_check_layout``), shapes (``_shape``), the
logical dtype of a typestr (``_cai_dtype``), a numpy or torch dtype (each name cached in a dict
on first sight: ``_TYPESTRS``, ``_NP_NAMES``, ``_TORCH_NAMES``) and a torch tensor's checks
(:func:`torch_spec`); the device constants DEVICE_HOST and DEVICE_UNKNOWN.

Why a module of its own: so the imports point down.  :mod:`ncclpy.buffers.buffer` (entry point,
device parsers, the host memory switch) imports :mod:`ncclpy.buffers.host`; both import this module,
which imports neither.  ``ncclpy.buffers.buffer`` re-exports the public names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from ..semantics.dtypes import LOGICAL, dtype_name
from ..errors import ArgumentError, ArgumentTypeError, NcclpyError, UnsupportedError

__all__ = ["BufferSpec", "DEVICE_HOST", "DEVICE_UNKNOWN", "torch_spec"]

#: ``BufferSpec.device`` of host memory (rejected by the planners unless in host memory mode)
DEVICE_HOST = -1
#: ``BufferSpec.device`` when the object does not say (pure CAI objects, host buffers in host
#: memory mode): the executor takes the communicator's device
DEVICE_UNKNOWN = -2


# -- the parsed buffer -------------------------------------------------------------------------
_set = object.__setattr__


@dataclass(frozen=True, init=False)
class BufferSpec:
    """One parsed buffer.

    ``count`` is in elements of the logical ``dtype`` (a complex64 element is one element here
    and two float32 on the wire); ``device`` is the CUDA ordinal, -1 for host memory, -2 when
    unknown; ``framework`` in {'cupy', 'torch', 'cai', 'dlpack', 'raw'}; ``obj`` is the user's
    object (kept alive by the executor until the work completes).
    """

    ptr: int
    count: int
    dtype: str
    device: int
    shape: Tuple[int, ...] = ()
    framework: str = "raw"
    contiguous: bool = True
    obj: Any = field(default=None, compare=False, repr=False)
    #: the producer marked the memory read-only (CAI data[1], DLPack READ_ONLY flag)
    readonly: bool = False

    def __init__(self, ptr: int, count: int, dtype: str, device: int,
                 shape: Tuple[int, ...] = (), framework: str = "raw", contiguous: bool = True,
                 obj: Any = None, readonly: bool = False) -> None:
        # frozen: the fields go in with one object.__setattr__ instead of one per field (every
        # cold call parses its buffers, and this halves what a BufferSpec costs)
        _set(self, "__dict__", {"ptr": ptr, "count": count, "dtype": dtype, "device": device,
                                "shape": shape, "framework": framework,
                                "contiguous": contiguous, "obj": obj, "readonly": readonly})

    @property
    def itemsize(self) -> int:
        """Bytes per logical element."""
        return LOGICAL[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        """The bytes the buffer spans, ``count * itemsize`` of its dtype."""
        return self.count * self.itemsize

    @property
    def strides_ok(self) -> bool:
        """Alias of ``contiguous`` (the name used in docs/design.md)."""
        return self.contiguous

    def offset(self, elements: int) -> int:
        """Pointer ``elements`` logical elements past ``ptr``."""
        return self.ptr + elements * self.itemsize


_new = object.__new__


def _spec(ptr: int, count: int, dtype: str, device: int, shape: Tuple[int, ...],
          framework: str, obj: Any, readonly: bool = False) -> BufferSpec:
    """``BufferSpec(ptr, count, dtype, device, shape, framework, True, obj, readonly)`` for the
    parsers, without the cost of calling a class with a Python ``__init__`` (a cold call
    parses every buffer; on Python 3.11 the class call alone is ~150 ns)."""
    b = _new(BufferSpec)
    _set(b, "__dict__", {"ptr": ptr, "count": count, "dtype": dtype, "device": device,
                         "shape": shape, "framework": framework, "contiguous": True,
                         "obj": obj, "readonly": readonly})
    return b


# -- layout and dtype checks -------------------------------------------------------------------
def _prod(shape: Sequence[int]) -> int:
    """Product of a shape of ints (1 for ``()``)."""
    return math.prod(shape)


_GPU_COPY = ".contiguous() / cupy.ascontiguousarray"


def _check_layout(name: str, shape: Tuple[int, ...], strides: Optional[Sequence[int]],
                  unit: int, unit_name: str, fix: str = _GPU_COPY) -> None:
    """Raise unless ``strides`` (in ``unit_name``) describe a C-contiguous ``shape``."""
    if strides is None:
        return
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise ArgumentError(f"{name}: strides {strides} do not match shape {shape}")
    if _prod(shape) == 0:
        return
    for n, s in zip(shape, strides):
        if n > 1 and s < 0:
            raise ArgumentError(
                f"{name}: negative strides {strides} ({unit_name}) for shape {shape}; NCCL "
                f"needs one contiguous block: pass a contiguous copy")
    expect = unit
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            want = _c_strides(shape, unit)
            raise ArgumentError(
                f"{name}: not C-contiguous: shape {shape} has strides {strides} ({unit_name}); "
                f"expected {want}; NCCL needs one contiguous block: pass a contiguous copy "
                f"(e.g. {fix})")
        expect *= n


def _c_strides(shape: Tuple[int, ...], unit: int) -> Tuple[int, ...]:
    out, acc = [], unit
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _dtype(name: str, what: Any) -> str:
    """Logical dtype name of ``what`` with errors naming the buffer; unknown dtypes of real
    buffers are unsupported (not a type error)."""
    try:
        return dtype_name(what)
    except UnsupportedError as e:
        raise UnsupportedError(f"{name}: {e}") from None
    except ArgumentTypeError:
        raise UnsupportedError(
            f"{name}: dtype {str(what)!r} cannot be carried by NCCL; expected one of "
            f"{', '.join(LOGICAL)}") from None


# -- torch -------------------------------------------------------------------------------------
#: torch dtype object -> logical name (real torch dtypes only)
_TORCH_NAMES: Dict[Any, str] = {}


def _torch_dtype(name: str, d: Any) -> str:
    dt = _TORCH_NAMES.get(d) if type(d).__module__ == "torch" else None
    if dt is None:
        dt = _dtype(name, str(d))
        if type(d).__module__ == "torch" and len(_TORCH_NAMES) < 256:
            _TORCH_NAMES[d] = dt
    return dt


def torch_spec(obj: Any, name: str, device: int, what: str, copy: str) -> BufferSpec:
    """A torch tensor already known to be where it may be (``what``: 'CUDA tensor' or 'CPU
    tensor', for the messages; ``copy``: how to make a contiguous copy): layout, lazy
    conj/neg views, dtype, strides and pointer checked, as ``device``."""
    dtype_obj = getattr(obj, "dtype", "?")
    layout = str(getattr(obj, "layout", "torch.strided"))
    if layout != "torch.strided":
        raise UnsupportedError(f"{name}: torch layout {layout} is not supported; expected a "
                               f"dense (torch.strided) {what} (use .to_dense())")
    for flag, fix in (("is_conj", "resolve_conj()"), ("is_neg", "resolve_neg()")):
        f = getattr(obj, flag, None)
        if callable(f) and f():
            raise ArgumentError(f"{name}: the tensor is a lazy {flag[3:]} view whose memory "
                                f"does not hold its values; call .{fix} first")
    dt = _torch_dtype(name, dtype_obj)
    shape = tuple(map(int, obj.shape))
    _check_layout(name, shape, tuple(obj.stride()), 1, "elements", copy)
    count = _prod(shape)
    ptr = int(obj.data_ptr() or 0)
    if count and not ptr:
        raise ArgumentError(f"{name}: the tensor has {count} elements but a NULL data pointer")
    return _spec(ptr, count, dt, device, shape, "torch", obj)


# -- array interfaces (CUDA and host) ----------------------------------------------------------
#: CAI typestr -> logical name, for the typestrs that name a dtype on their own (not 'V')
_TYPESTRS: Dict[str, str] = {}


def _cai_dtype(name: str, obj: Any, typestr: Any,
               iface: str = "__cuda_array_interface__") -> str:
    """The logical dtype of an array interface's ``typestr`` (``iface``: which interface, for
    the messages; the host parser reads ``__array_interface__`` with it)."""
    dt = _TYPESTRS.get(typestr) if type(typestr) is str else None
    if dt is not None:
        return dt
    import numpy as np
    if not isinstance(typestr, str) or len(typestr) < 3:
        raise ArgumentError(f"{name}: {iface} typestr {typestr!r} is "
                            f"malformed; expected e.g. '<f4'")
    order, kind = typestr[0], typestr[1]
    try:
        size = int(typestr[2:])
    except ValueError:
        raise ArgumentError(f"{name}: {iface} typestr {typestr!r} is "
                            f"malformed; expected e.g. '<f4'") from None
    if order == ">" and size > 1:
        where = "CUDA devices are" if iface == "__cuda_array_interface__" else "ncclpy reads"
        raise UnsupportedError(f"{name}: typestr {typestr!r} is big-endian; {where} "
                               f"little-endian: expected '<{kind}{size}'")
    if kind == "V":
        # opaque: bfloat16 ('<V2', torch / ml_dtypes) and float8 ('|V1', ml_dtypes) travel
        # this way; believe them only when the object's own dtype says what they are
        own = getattr(obj, "dtype", None)
        if own is not None:
            try:
                dt = dtype_name(own)
            except NcclpyError:
                dt = ""
            if dt and LOGICAL[dt].itemsize == size:
                return dt
        raise UnsupportedError(
            f"{name}: {iface} typestr {typestr!r} is an opaque {size}-byte "
            f"type; ncclpy reads it as bfloat16/float8 only when the object's dtype says so "
            f"(got dtype {str(own)!r})")
    try:
        npdt = np.dtype(typestr)
    except TypeError:
        raise UnsupportedError(f"{name}: typestr {typestr!r} is not a dtype NCCL can carry; "
                               f"expected one of {', '.join(LOGICAL)}") from None
    dt = _dtype(name, npdt.name)
    if type(typestr) is str and len(_TYPESTRS) < 256:
        _TYPESTRS[typestr] = dt
    return dt


def _shape(name: str, shape: Any) -> Tuple[Tuple[int, ...], int]:
    """``shape`` as a tuple of ints and its element count; a negative extent is an error."""
    count = 1
    if type(shape) is tuple:
        for n in shape:
            if type(n) is not int or n < 0:
                break
            count *= n
        else:
            return shape, count         # exact non-negative ints (the common case): no copy
    shape = tuple(map(int, shape))
    count = 1
    for n in shape:
        if n < 0:
            raise ArgumentError(f"{name}: negative extent in shape {shape}")
        count *= n
    return shape, count


# -- numpy (and CuPy) --------------------------------------------------------------------------
#: numpy dtype (CuPy's dtypes are numpy's) -> logical name
_NP_NAMES: Dict[Any, str] = {}
