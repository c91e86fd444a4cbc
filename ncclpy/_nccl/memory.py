"""Arrays in NCCL's own memory (``ncclMemAlloc``, NCCL >= 2.19): what symmetric windows need.

* :func:`nccl_empty` -- a CuPy array (``framework="cupy"``) or a torch tensor
  (``framework="torch"``, the same memory through DLPack) backed by one ``ncclMemAlloc``;
  ``ncclMemFree`` runs when the last array using it is garbage collected.
* :func:`nccl_allocator` -- a CuPy allocator: ``with cupy.cuda.using_allocator(
  ncclpy.nccl_allocator()):`` makes every CuPy allocation in the block NCCL memory.

NCCL's memory is cuMem memory with the granularity NCCL needs, so its address is aligned for
``ncclCommWindowRegister``.
"""
from __future__ import annotations

import ctypes
import logging
import math
from typing import Any, Callable, Optional, Sequence, Union

from ..errors import ArgumentError, ArgumentTypeError, as_int

__all__ = ["nccl_empty", "nccl_allocator", "NcclMemory"]

log = logging.getLogger(__name__)


class NcclMemory:
    """One ``ncclMemAlloc`` block (``ptr``, ``nbytes`` on ``device``); freed once, when it is
    garbage collected or :meth:`free` is called."""

    def __init__(self, nbytes: int, device: int) -> None:
        from .cuda import cuda
        from .lib import get_lib, require_version
        lib = get_lib()
        require_version("ncclMemAlloc", lib.version, lib.path)
        self.nbytes, self.device = int(nbytes), int(device)
        p = ctypes.c_void_p(0)
        with cuda().device(self.device):
            lib.check(lib.ncclMemAlloc(ctypes.byref(p), max(self.nbytes, 1)), "ncclMemAlloc")
        self.ptr = int(p.value or 0)
        self._lib = lib

    def free(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        from .cuda import cuda
        try:
            with cuda().device(self.device):
                code = self._lib.ncclMemFree(ptr)
            if code:
                log.warning("ncclMemFree(%#x) failed: %s", ptr, self._lib.error_string(code))
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone
            log.debug("ncclMemFree(%#x) failed", ptr, exc_info=True)

    def __del__(self) -> None:
        self.free()


def _not_on_cpu(what: str) -> None:
    """These make CuPy / torch GPU memory: refused in one line on the CPU backend, whose
    communicators take host memory (its own ``ncclMemAlloc`` is ``comm.mem_alloc``)."""
    from .lib import cpu_backend
    if cpu_backend():
        from ..errors import UnsupportedError
        raise UnsupportedError(f"{what}: makes CuPy/torch arrays in NCCL's GPU memory, and this "
                               f"process runs on the CPU backend (no GPU); allocate with "
                               f"comm.mem_alloc (host memory, a Buffer of device 'cpu') or use "
                               f"numpy arrays")


def _device(device: Optional[int]) -> int:
    if device is None:
        from .cuda import cuda
        return int(cuda().get_device())
    return as_int("device", device, 0)


def nccl_empty(shape: Union[int, Sequence[int]], dtype: Any = "float32", *,
               device: Optional[int] = None, framework: str = "cupy") -> Any:
    """An uninitialised array of ``shape`` and ``dtype`` in NCCL memory on ``device``
    (default: the current one): a ``cupy.ndarray``, or with ``framework="torch"`` a
    ``torch.Tensor`` sharing the same memory."""
    if framework not in ("cupy", "torch"):
        raise ArgumentError(f"nccl_empty: framework: expected 'cupy' or 'torch', got "
                            f"{framework!r}")
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
    if not isinstance(dims, (list, tuple)):
        raise ArgumentTypeError(f"nccl_empty: shape: expected an int or a sequence of ints, "
                                f"got {type(shape).__name__}")
    dims = tuple(as_int(f"nccl_empty: shape[{i}]", d, 0) for i, d in enumerate(dims))
    _not_on_cpu("nccl_empty")
    import cupy
    from ..semantics.dtypes import dtype_name, logical
    name = dtype_name(dtype)
    np_dtype = None
    if framework == "cupy":
        import numpy
        try:
            np_dtype = numpy.dtype(name)
        except TypeError:
            raise ArgumentError(f"nccl_empty: dtype {name} has no CuPy (numpy) dtype; use "
                                f"framework='torch'") from None
    dev = _device(device)
    nbytes = math.prod(dims) * logical(name).itemsize
    mem = NcclMemory(nbytes, dev)
    with cupy.cuda.Device(dev):
        um = cupy.cuda.UnownedMemory(mem.ptr, mem.nbytes, mem, dev)
        mp = cupy.cuda.MemoryPointer(um, 0)
        if np_dtype is not None:
            return cupy.ndarray(dims, dtype=np_dtype, memptr=mp)
        raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=mp)
    import torch
    tname = _TORCH_NAMES.get(name, name)
    return torch.from_dlpack(raw).view(getattr(torch, tname)).reshape(dims)


_TORCH_NAMES = {"float8_e4m3": "float8_e4m3fn"}


def nccl_allocator(device: Optional[int] = None) -> Callable[[int], Any]:
    """A CuPy allocator (``cupy.cuda.set_allocator`` / ``using_allocator``) handing out NCCL
    memory on ``device`` (default: CuPy's current device at each allocation)."""
    fixed = None if device is None else as_int("device", device, 0)
    _not_on_cpu("nccl_allocator")

    def alloc(nbytes: int) -> Any:
        import cupy
        dev = cupy.cuda.Device().id if fixed is None else fixed
        mem = NcclMemory(nbytes, dev)
        um = cupy.cuda.UnownedMemory(mem.ptr, mem.nbytes, mem, dev)
        return cupy.cuda.MemoryPointer(um, 0)
    return alloc
