"""Symmetric memory windows (NCCL >= 2.27): ``comm.register_window(buf)`` -> :class:`Window`.

A window registers the same-sized (2.30: any-sized) buffer on every rank with
``ncclCommWindowRegister``, collectively: every rank calls it, in the same order.  Collectives
whose buffers lie in a window registered with ``symmetric=True`` (``NCCL_WIN_COLL_SYMMETRIC``)
may take NCCL's symmetric kernels; one-sided RMA (:mod:`ncclpy.comm.rma`) writes into a peer's
window.  The buffer must be cuMem memory NCCL can map (``ncclMemAlloc``: ``comm.mem_alloc``,
:func:`ncclpy.nccl_empty`), its address a multiple of 4096 bytes into its allocation.

NCCL registers nothing -- and says success -- where the communicator has no symmetric support
(e.g. ranks that share a GPU); the Window then has ``handle`` 0 and ``registered`` False, and
says so rather than pretend.

One lifecycle per window, under its own lock: ``open`` -> ``closed`` by :meth:`Window.close`
(idempotent; the context manager's exit), or ``lost`` when the communicator is aborted (NCCL
freed the window with it: nothing touches the handle again).  ``comm.close()`` deregisters
its open windows first, so a window never outlives its communicator's handle.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Dict, List

from .._nccl.cuda import cuda
from .._nccl.flags import (WIN_COLL_SYMMETRIC, WIN_FLAG_VERSIONS, WIN_REQUIRED_ALIGNMENT,
                           WIN_STRICT_ORDERING, WIN_GIN_ONLY)
from .._nccl.group import group_depth
from .._nccl.lib import NCCL_IN_PROGRESS, format_version, require_version
from ..errors import (ArgumentError, ArgumentTypeError, NcclpyError, UnsupportedError,
                      VersionError)
from .lifecycle import CLOSING

__all__ = ["Window", "CommWindows", "window_flags", "OPEN", "CLOSED", "LOST"]

log = logging.getLogger(__name__)

OPEN, CLOSED, LOST = "open", "closed", "lost"


def window_flags(version: int, symmetric: Any = True, strict_ordering: Any = False,
                 gin_only: Any = False) -> int:
    """The ``winFlags`` for the keywords, each refused precisely where the loaded NCCL
    (``version``) predates it."""
    flags = 0
    for bit, value in ((WIN_COLL_SYMMETRIC, symmetric), (WIN_STRICT_ORDERING, strict_ordering),
                       (WIN_GIN_ONLY, gin_only)):
        kw, need = WIN_FLAG_VERSIONS[bit]
        if not isinstance(value, bool):
            raise ArgumentTypeError(f"register_window: {kw}: expected True or False, got "
                                    f"{type(value).__name__} {value!r}")
        if value:
            if version < need:
                raise VersionError(f"register_window: {kw}=True needs NCCL >= "
                                   f"{format_version(need)}; the loaded NCCL is "
                                   f"{format_version(version)}")
            flags |= bit
    return flags


class Window:
    """A registered window: ``ptr`` and ``nbytes`` of this rank's buffer, NCCL's ``handle``
    (0 when NCCL registered nothing), ``flags``, ``state`` (open, closed, lost).  Pass it to
    ``comm.put_signal`` as the peer's window; close it (or leave the ``with`` block) on every
    rank before the communicator."""

    def __init__(self, comm: Any, handle: int, ptr: int, nbytes: int, flags: int,
                 buf: Any) -> None:
        self._comm = comm
        self.handle = int(handle or 0)
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.flags = int(flags)
        self._buf = buf                 # the user's object: its memory outlives the window
        self._lock = threading.Lock()
        self.state = OPEN

    @property
    def registered(self) -> bool:
        """Whether NCCL registered anything (False where the communicator has no symmetric
        support, e.g. ranks sharing a GPU)."""
        return self.handle != 0

    @property
    def closed(self) -> bool:
        """True once closed or lost."""
        return self.state != OPEN

    @property
    def symmetric(self) -> bool:
        """Registered with NCCL_WIN_COLL_SYMMETRIC (``symmetric=True``)."""
        return bool(self.flags & WIN_COLL_SYMMETRIC)

    def user_ptr(self) -> int:
        """``ncclWinGetUserPtr`` (NCCL >= 2.29): the address this rank registered."""
        comm = self._comm
        require_version("ncclWinGetUserPtr", comm._lib.version, comm._lib.path)
        with self._lock:
            self._check_open("user_ptr")
            if not self.handle:
                raise NcclpyError("Window.user_ptr: NCCL registered no window here (this "
                                  "communicator has no symmetric support); nothing to ask")
            out = ctypes.c_void_p(0)
            lib = comm._lib
            code = comm._nccl("ncclWinGetUserPtr", lib.ncclWinGetUserPtr, comm._handle,
                              self.handle, ctypes.byref(out))
            lib.check(code, "ncclWinGetUserPtr", comm._handle)
            return int(out.value or 0)

    def close(self) -> None:
        """``ncclCommWindowDeregister`` (every rank, like the registration); idempotent; a
        no-op once the communicator was aborted or closed (NCCL freed the window then)."""
        self._comm._close_window(self)

    deregister = close

    def _check_open(self, what: str) -> None:
        if self.state != OPEN:
            why = ("its communicator was aborted (NCCL freed the window with it)"
                   if self.state == LOST else "it was closed")
            raise NcclpyError(f"Window.{what}: the window is {self.state}: {why}")

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        reg = f"handle={self.handle:#x}" if self.handle else "not registered by NCCL"
        return (f"<ncclpy.Window {self.state} ptr={self.ptr:#x} nbytes={self.nbytes} "
                f"flags={self.flags:#x} {reg}>")


class CommWindows:
    """``register_window`` and the windows' part of close and abort (a Communicator mixin;
    uses ``_lib``, ``_handle``, ``_device``, ``_windows``, ``_life``, ``_nccl``)."""

    _lib: Any
    _handle: int
    _device: int
    _windows: Dict[int, Window]
    _slots: List[Any]           # *win slots NCCL may still write (kept until it has)
    _life: Any
    _nccl: Any
    _nonblocking: bool
    _wait_ready: Any
    _check_usable: Any

    def register_window(self, buf: Any, *, symmetric: bool = True,
                        strict_ordering: bool = False, gin_only: bool = False) -> Window:
        """``ncclCommWindowRegister`` ``buf`` (collective: every rank, same order; never
        inside a group, and on a nonblocking communicator it waits until NCCL registered it)
        -> :class:`Window`, a context manager.  ``symmetric``: NCCL_WIN_COLL_SYMMETRIC
        (collectives on it may take the symmetric kernels); ``strict_ordering`` (2.29.7):
        NCCL_WIN_STRICT_ORDERING; ``gin_only`` (2.32): NCCL_WIN_GIN_ONLY.  NCCL >= 2.27."""
        self._check_usable("register_window")
        lib = self._lib
        require_version("ncclCommWindowRegister", lib.version, lib.path)
        flags = window_flags(lib.version, symmetric, strict_ordering, gin_only)
        if isinstance(buf, (list, tuple)):
            raise ArgumentTypeError("register_window: buf: expected one buffer, got a "
                                    f"{type(buf).__name__}")
        from ..buffers.buffer import as_buffer
        from ..semantics.dtypes import logical
        spec = as_buffer(buf, "buf", self._device)
        nbytes = int(spec.count) * logical(spec.dtype).itemsize
        if nbytes <= 0:
            raise ArgumentError("register_window: buf: expected a non-empty buffer, got 0 "
                                "bytes")
        if spec.device not in (self._device, -2):
            raise ArgumentError(f"register_window: buf: expected memory on this "
                                f"communicator's device {self._device}, got device "
                                f"{spec.device}")
        if spec.ptr % WIN_REQUIRED_ALIGNMENT:
            raise ArgumentError(f"register_window: buf: expected an address aligned to "
                                f"{WIN_REQUIRED_ALIGNMENT} bytes (NCCL_WIN_REQUIRED_ALIGNMENT), "
                                f"got {spec.ptr:#x} ({spec.ptr % WIN_REQUIRED_ALIGNMENT} past "
                                f"a multiple); allocate it with comm.mem_alloc or "
                                f"ncclpy.nccl_empty")
        if group_depth():
            raise UnsupportedError("register_window: called inside a group (comm.group() or "
                                   "ncclGroupStart); NCCL registers a window at the group's "
                                   "end and writes its handle only then: register it before "
                                   "or after the group")
        win = ctypes.c_void_p(0)
        # NCCL writes *win when its registration task has run: at once on a blocking
        # communicator; on a nonblocking one later, while the call already said ncclSuccess
        # (dev_runtime.cc: NCCLCHECK lets ncclGroupEndInternal's ncclInProgress through), so
        # the slot lives with the communicator until then, and is read only after the wait
        self._slots.append(win)
        with self._life.api:      # the call and its wait: no other thread's call between
            with cuda().device(self._device):
                code = self._nccl("ncclCommWindowRegister", lib.ncclCommWindowRegister,
                                  self._handle, spec.ptr, nbytes, ctypes.byref(win), flags)
            if code not in (0, NCCL_IN_PROGRESS):
                self._slots.remove(win)      # the task was refused before it was queued
                err = lib.error(code, "ncclCommWindowRegister", self._handle)
                from ..cpu.backend import installed
                hint = "" if installed() else (   # host memory there; its refusal says why
                    "; a window needs cuMem memory NCCL can map (comm.mem_alloc, "
                    "ncclpy.nccl_empty), registered by every rank in the same order")
                raise type(err)(err.code, "ncclCommWindowRegister",
                                f"{err.last_error}{hint}") from None
            if code == NCCL_IN_PROGRESS or self._nonblocking:
                self._wait_ready("ncclCommWindowRegister")   # raises: the slot stays kept
        if win.value:             # (0: NCCL may still write it -- a group opened outside
            self._slots.remove(win)   # ncclpy, say -- so it is kept with the communicator)
        w = Window(self, win.value or 0, spec.ptr, nbytes, flags, buf)
        if not w.registered:
            log.info("register_window: NCCL registered no window on %s (no symmetric support "
                     "on this communicator); collectives on it run the regular kernels",
                     self._life.owner)
        self._windows[id(w)] = w
        return w

    def windows(self) -> List[Window]:
        """The open windows, oldest first."""
        return [w for w in self._windows.values() if w.state == OPEN]

    def _close_window(self, w: Window, states: tuple = ()) -> None:
        with w._lock:
            if w.state != OPEN:
                return
            if self._life.state in ("aborting", "aborted", "closed"):
                w.state = LOST          # freed with the communicator: never touched again
                self._windows.pop(id(w), None)
                return
            w.state = CLOSED            # no second deregister, even if this one fails
            self._windows.pop(id(w), None)
            if not w.handle:
                return
            revoked = self._life.state == "revoked"
            lib = self._lib
            try:
                with cuda().device(self._device):
                    code = self._nccl("ncclCommWindowDeregister",
                                      lib.ncclCommWindowDeregister, self._handle, w.handle,
                                      states=states + (("revoked",) if revoked else ()))
                lib.check(code, "ncclCommWindowDeregister", self._handle)
            except Exception as e:  # noqa: BLE001 - see below
                if not revoked:
                    raise
                # a revoked communicator (the ``with`` block is usually unwinding its
                # CommAbortedError, which must not be replaced): said, not raised
                log.warning("Window.close on the revoked communicator %s: %s",
                            self._life.owner, e)

    def _close_windows(self) -> None:
        """close(): deregister the open windows, newest first, before the handle goes."""
        for w in reversed(list(self._windows.values())):
            try:
                self._close_window(w, (CLOSING,))
            except Exception as e:  # noqa: BLE001 - close goes on; the window is closed
                log.warning("close: ncclCommWindowDeregister(%r) failed: %s", w, e)

    def _lose_windows(self) -> None:
        """abort: NCCL freed every window with the communicator."""
        for w in list(self._windows.values()):
            with w._lock:
                w.state = LOST
        self._windows.clear()
