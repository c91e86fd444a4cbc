"""Communicator parts beyond the calls: ``split`` and buffer registration / NCCL memory.

A mixin of :class:`ncclpy.comm.Communicator` (kept apart so each module stays one screenful of
concerns): ``split`` (ncclCommSplit, blocking or not), ``register``/``deregister``
(ncclCommRegister, one :class:`Registration` per call), ``mem_alloc``/``mem_free``
(ncclMemAlloc), and the per-call resources the executor asks for (scratch memory, PreMulSum
ops).  It uses the communicator's ``_lib``, ``_handle``, ``_device``, ``_nc``,
``_resolver``, ``_registrations`` and ``_allocations``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
from typing import Any, Dict, List, Optional, Tuple

from .._nccl.config import effective_nonblocking
from .._nccl.cuda import cuda
from .._nccl.dispatch import call_cupy, int_arg
from .._nccl.lib import (NCCL_IN_PROGRESS, NCCL_SPLIT_NOCOLOR, SCALAR_HOST_IMMEDIATE,
                        require_version)
from ..errors import (ArgumentError, ArgumentTypeError, NcclpyError, NcclTimeoutError,
                      UnsupportedError)
from .._nccl.group import group_depth

__all__ = ["CommExtras", "Registration"]

log = logging.getLogger(__name__)

#: ``ncclComm_t`` slots a nonblocking ncclCommSplit may still write (see Communicator.split)
_SPLIT_SLOTS: List[ctypes.c_void_p] = []
_REG_IDS = itertools.count(1)


@dataclasses.dataclass(frozen=True, eq=False)
class Registration:
    """A buffer registered with ``ncclCommRegister`` (pass it to ``deregister``).

    ``handle`` is NCCL's: NULL (0) when NCCL registered nothing (local registration off) and
    the same refcounted handle for a buffer registered twice, so each Registration is its own
    entry (``id``), and compares by identity.
    """

    handle: int
    ptr: int
    nbytes: int
    id: int = dataclasses.field(default_factory=lambda: next(_REG_IDS))

class CommExtras:
    """split, register/deregister and mem_alloc/mem_free of a Communicator."""

    _lib: Any
    _handle: int
    _device: int
    _nc: Any
    _config: Any
    _timeout: float
    _nonblocking: bool
    _resolver: Any
    _registrations: Any
    _allocations: Any
    _premul_ops: Any
    _closed: bool
    name: str
    _check_usable: Any
    _nccl: Any
    _wait_ready: Any
    _life: Any
    _settled: Any

    def nccl_params(self, keys: Optional[List[str]] = None) -> Dict[str, str]:
        """NCCL's effective parameters ``{name: value}`` as NCCL resolved them, read after
        this communicator's init (NCCL registers most while it makes the first one; the values
        are process-wide).  ``keys``: only these (ArgumentError naming an unknown one).  NCCL
        >= 2.30.4: ``ncclParamGetAllParameterKeys`` / ``ncclParamGetParameter``."""
        self._check_usable("nccl_params")
        from .._nccl.params import nccl_params
        require_version("ncclParamGetAllParameterKeys", self._lib.version, self._lib.path)
        return nccl_params(keys, lib=self._lib)

    def split(self, color: int, key: int) -> Optional[Any]:
        """ncclCommSplit: ranks with the same ``color`` form a new communicator, ordered by
        ``key``; ``color`` < 0 (NCCL_SPLIT_NOCOLOR) joins none and returns None.  The child
        inherits this communicator's config (blocking mode included).  Collective over this
        communicator; NCCL >= 2.18 (VersionError otherwise).  The child is an independent
        Communicator (no checked mode, no watchdog) that must be closed on its own; NCCL's
        nccl.h states no destruction order, and ncclpy recommends closing children before the
        parent (the safe order also with ``Config(split_share=True)``).  Allowed on a revoked
        communicator too (NCCL: management operations proceed once it is quiescent)."""
        states = ("revoked",) if self._life.state == "revoked" else ()
        if states:
            self._settled("split")
        else:
            self._check_usable("split")
        self._resolver.clear()
        color = int_arg("color", color, -(2 ** 31) + 1)
        key = int_arg("key", key, -(2 ** 31) + 1)
        if color < 0:
            color = NCCL_SPLIT_NOCOLOR
        lib = self._lib
        require_version("ncclCommSplit", lib.version, lib.path)
        name = f"{self.name}/split{color}"
        with cuda().device(self._device):
            if self._nc is not None and hasattr(self._nc, "commSplit"):
                code, child = self._nccl("ncclCommSplit", call_cupy, lib, "ncclCommSplit",
                                         self._handle, self._nc.commSplit, color, key,
                                         states=states)
                if code:  # pragma: no cover - a CuPy-made communicator is blocking
                    raise NcclpyError("ncclCommSplit (through CuPy) returned ncclInProgress on "
                                      "a blocking communicator")
                if child is None:
                    return None
                child_nb = effective_nonblocking(None, lib.version)
                return type(self)._wrap(lib, int(child.comm), child, self._device, None,
                                          child_nb, self._timeout, name)
            return self._split_ctypes(color, key, name, states)

    def _split_ctypes(self, color: int, key: int, name: str,
                      states: tuple = ()) -> Optional[Any]:
        """ncclCommSplit through ctypes (see :meth:`_new_child`)."""
        lib = self._lib
        handle, nonblocking = self._new_child(
            "ncclCommSplit", lambda slot: lib.ncclCommSplit(self._handle, color, key,
                                                            ctypes.byref(slot), None), states)
        if not handle:
            return None
        return type(self)._wrap(lib, handle, None, self._device, self._config,
                                  nonblocking, self._timeout, name)

    def _new_child(self, call: str, fn: Any, states: tuple = ()) -> Tuple[int, bool]:
        """``fn(slot)``, an NCCL call that writes a new communicator into ``*slot`` (split,
        shrink, grow), made while entered in the parent's lifecycle: (the child's handle, 0
        for none; whether it is nonblocking).  A nonblocking call returns ncclInProgress and
        NCCL writes ``*newcomm`` only when the child's init completes, so the handle is read
        after the parent is ready, and the slot outlives any wait that gives up (NCCL may
        still write it): it stays in ``_SPLIT_SLOTS`` until read.  The parent's API lock is
        held from the call to the end of its wait: no other thread's call meets NCCL's "in
        progress" in between."""
        with self._life.api:
            return self._new_child_waited(call, fn, states)

    def _new_child_waited(self, call: str, fn: Any, states: tuple) -> Tuple[int, bool]:
        lib = self._lib
        slot = ctypes.c_void_p(0)
        _SPLIT_SLOTS.append(slot)
        code = self._nccl(call, fn, slot, states=states)
        try:
            lib.check(code, call, self._handle, in_progress_ok=True)
        except BaseException:
            _SPLIT_SLOTS.remove(slot)   # failed outright: NCCL will not write it
            raise
        nonblocking = self._nonblocking or code == NCCL_IN_PROGRESS
        if nonblocking:
            try:
                self._wait_ready(call, *states)
            except BaseException as e:
                if slot.value:          # the child exists: abort it rather than leak it
                    _SPLIT_SLOTS.remove(slot)
                    child_code = lib.ncclCommAbort(slot.value)
                    log.warning("%s: aborted the child communicator after %s (ncclCommAbort "
                                "-> %s)", call, type(e).__name__, child_code)
                if isinstance(e, NcclTimeoutError):
                    raise NcclTimeoutError(e.code, call, f"{e.last_error}; the parent "
                                           f"should be aborted (comm.abort())") from None
                raise
        _SPLIT_SLOTS.remove(slot)
        return int(slot.value or 0), nonblocking

    def register(self, buf: Any) -> Registration:
        """ncclCommRegister ``buf`` (freed by ``deregister`` or ``close``); one Registration
        per call, even for a buffer registered twice."""
        self._check_usable("register")
        if isinstance(buf, (list, tuple)):
            raise ArgumentTypeError("register: expected one buffer, got a list")
        from ..buffers.buffer import as_buffer
        spec = as_buffer(buf, "buf")
        nbytes = int(spec.count) * _itemsize(spec.dtype)
        h = ctypes.c_void_p(0)
        self._lib.check(self._nccl("ncclCommRegister", self._lib.ncclCommRegister, self._handle,
                                   spec.ptr, nbytes, ctypes.byref(h)), "ncclCommRegister",
                        self._handle)
        reg = Registration(h.value or 0, int(spec.ptr), nbytes)
        self._registrations[reg.id] = reg
        return reg

    def deregister(self, reg: Any) -> None:
        """Undo ``register``: a Registration, or an NCCL handle (its latest registration)."""
        self._check_usable("deregister")
        if isinstance(reg, Registration):
            found = self._registrations.get(reg.id)
            found = found if found is reg else None
        else:
            found = next((r for r in reversed(list(self._registrations.values()))
                          if r.handle == reg and not isinstance(reg, bool)), None)
        if found is None:
            raise ArgumentError(f"deregister: {reg!r} is not a live registration of this "
                                f"communicator (already deregistered, or made by another)")
        del self._registrations[found.id]
        self._deregister(found)

    def _deregister(self, reg: Registration, states: tuple = ()) -> None:
        if reg.handle:   # NULL: NCCL registered nothing (local registration off)
            self._lib.check(self._nccl("ncclCommDeregister", self._lib.ncclCommDeregister,
                                       self._handle, reg.handle, states=states),
                            "ncclCommDeregister", self._handle)

    def mem_alloc(self, count: int, dtype: Any = "uint8") -> Any:
        """``ncclMemAlloc`` ``count`` elements of ``dtype`` on this device -> ncclpy.Buffer."""
        self._check_usable("mem_alloc")
        from ..buffers.buffer import Buffer
        from ..semantics.dtypes import dtype_name
        count = int_arg("count", count, 0)
        name = dtype_name(dtype)
        nbytes = count * _itemsize(name)
        p = ctypes.c_void_p(0)
        with cuda().device(self._device):
            self._lib.check(self._lib.ncclMemAlloc(ctypes.byref(p), max(nbytes, 1)),
                            "ncclMemAlloc")
        self._allocations[p.value] = nbytes
        from ..buffers.buffer import host_memory
        # the CPU backend's ncclMemAlloc is host memory: a Buffer of device 'cpu' (a CUDA
        # ordinal would make this communicator refuse its own allocation as GPU memory)
        return Buffer(p.value, count, name, "cpu" if host_memory() else self._device)

    def mem_free(self, buf: Any) -> None:
        """``ncclMemFree`` a buffer from ``mem_alloc`` (a Buffer or its pointer)."""
        ptr = int(getattr(buf, "ptr", buf))
        if ptr not in self._allocations:
            raise ArgumentError(f"mem_free: {buf!r} was not allocated by this communicator's "
                                f"mem_alloc")
        self._allocations.pop(ptr)
        with cuda().device(self._device):
            self._lib.check(self._lib.ncclMemFree(ptr), "ncclMemFree")


    # -- resources used by the executor ---------------------------------------------------
    def _alloc_scratch(self, nbytes: int, stream: int, what: str = "call") -> Tuple[Any, Any]:
        """(memory with ``.ptr``, ``free`` or None) for a plan's scratch.  Eager: CuPy's pool,
        in ``stream``'s order (freed when the Work lets go of it).  While ``stream`` captures
        a CUDA graph: stream-ordered (``cudaMallocAsync``, an allocation node of the graph,
        and ``free``, to be enqueued after the plan's last step, its free node): nothing is
        allocated from a pool inside the capture, which torch's default capture mode
        forbids."""
        cu = cuda()
        try:
            capturing = cu.stream_is_capturing(stream)
        except Exception:
            capturing = False
        if not capturing:
            return cu.alloc(nbytes, stream, self._device), None
        try:
            with cu.device(self._device):
                ptr = cu.malloc_async(nbytes, stream)
        except Exception as e:
            raise UnsupportedError(
                f"{what}: needs {nbytes} bytes of scratch and its stream is capturing a CUDA "
                f"graph; ncclpy allocates it stream-ordered inside the capture "
                f"(cudaMallocAsync), which failed here ({type(e).__name__}: {e}); make this "
                f"call outside the capture, or in a form that needs no scratch (one buffer "
                f"instead of a list, out of place)") from None
        return _Ptr(ptr), (lambda: cu.free_async(ptr, stream))

    def _premul_create(self, spec: Any) -> int:
        lib = self._lib
        scalar = ctypes.create_string_buffer(bytes(spec.scalar), max(len(spec.scalar), 8))
        op = ctypes.c_int(0)
        code = self._nccl("ncclRedOpCreatePreMulSum", lib.ncclRedOpCreatePreMulSum,
                          ctypes.byref(op), scalar, int(spec.datatype), SCALAR_HOST_IMMEDIATE,
                          self._handle)
        lib.check(code, "ncclRedOpCreatePreMulSum", self._handle, in_progress_ok=True)
        if code == NCCL_IN_PROGRESS and group_depth() == 0:
            self._wait_ready("ncclRedOpCreatePreMulSum")
        self._premul_ops.add(op.value)
        return op.value

    def _premul_destroy(self, op: int, states: tuple = ()) -> None:
        if op not in self._premul_ops or self._closed and not states:
            return
        self._premul_ops.discard(op)
        code = self._nccl("ncclRedOpDestroy", self._lib.ncclRedOpDestroy, op, self._handle,
                          states=states)
        self._lib.check(code, "ncclRedOpDestroy", self._handle, in_progress_ok=True)
        if code == NCCL_IN_PROGRESS and group_depth() == 0:
            self._wait_ready("ncclRedOpDestroy", *states)


class _Ptr:
    """Stream-ordered scratch: just its address (the graph's free node releases it)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _itemsize(dtype: Any) -> int:
    from ..semantics.dtypes import logical
    return logical(dtype).itemsize
