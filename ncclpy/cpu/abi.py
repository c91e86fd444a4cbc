"""STAND-IN's C boundary: each stand-in NCCL function is reached through a real C function
pointer called with ncclpy's own ctypes declarations (:data:`ncclpy._nccl.functions.FUNCTIONS`).

:class:`CpuCDLL` plays ``ctypes.CDLL`` for :class:`ncclpy._nccl.lib.NcclLib`: its
attribute ``ncclX`` is a foreign function object at the address of a C callback
(``CFUNCTYPE`` with the declared restype and argtypes) that runs the stand-in's ``_ncclX``.
``NcclLib.fn`` sets ``restype`` and ``argtypes`` on it exactly as on the real libnccl, so every
argument ncclpy passes is converted by ctypes (``from_param``) as for the real call: an int
where a typed pointer is declared, or a Structure where ``c_void_p`` is, raises
``ctypes.ArgumentError`` on CPU as it would on a GPU.  The stand-in then sees what C sees: ints
(or None) for ``c_void_p`` and integers, ``LP_*`` pointer objects for typed pointers
(``out[0] = value``), a ``UniqueId`` copy for the by-value id.

A Python exception inside a callback cannot cross C (ctypes would print it and return
garbage): it is kept, the call returns ncclInternalError, and :meth:`CpuCDLL.raise_pending`
(called by ``standin()`` on exit) re-raises the first one, so a stand-in bug never passes as
success.  It never makes a GPU test pass.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable, Dict, List

from ncclpy._nccl.functions import FUNCTIONS

__all__ = ["CpuCDLL", "INTERNAL_ERROR"]

log = logging.getLogger(__name__)

INTERNAL_ERROR = 3


class CpuCDLL:
    """``ctypes.CDLL`` of the stand-in libnccl (``impls``: an object with ``_ncclX`` methods,
    ``enter(name, impl, args)``: the bookkeeping wrapper every call goes through)."""

    def __init__(self, impls: Any, enter: Callable[[str, Callable, tuple], Any]) -> None:
        self._impls = impls
        self._enter = enter
        self._keep: Dict[str, Any] = {}          # callbacks must outlive their pointers
        self._texts: Dict[bytes, Any] = {}       # char* results stay valid, as NCCL's do
        self._lock = threading.Lock()
        self.errors: List[BaseException] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("nccl") or name not in FUNCTIONS:
            raise AttributeError(name)
        impl = getattr(self._impls, "_" + name, None)
        if impl is None:
            raise AttributeError(f"stand-in libnccl does not export {name}")
        with self._lock:
            cb = self._keep.get(name)
            if cb is None:
                cb = self._keep[name] = self._callback(name, impl)
        restype, argtypes, _ = FUNCTIONS[name]
        f = ctypes.CFUNCTYPE(restype, *argtypes)(ctypes.cast(cb, ctypes.c_void_p).value)
        f.__name__ = name
        return f                                  # NcclLib.fn sets restype/argtypes again

    def _callback(self, name: str, impl: Callable) -> Any:
        restype, argtypes, _ = FUNCTIONS[name]
        text = restype is ctypes.c_char_p        # char*: returned as an address C keeps
        proto = ctypes.CFUNCTYPE(ctypes.c_void_p if text else restype, *argtypes)

        def thunk(*cargs: Any) -> Any:
            try:
                r = self._enter(name, impl, cargs)
            except BaseException as e:  # noqa: B902 - cannot cross C; re-raised on exit
                log.error("CPU engine: %s raised %s: %s", name, type(e).__name__, e,
                          exc_info=True)
                if len(self.errors) < 100:      # bounded: a product process runs long
                    self.errors.append(e)
                return None if restype is None else (0 if text else INTERNAL_ERROR)
            if text:
                return self._text(r)
            return r
        return proto(thunk)

    def _text(self, value: Any) -> int:
        if not value:
            return 0
        b = bytes(value)
        with self._lock:
            buf = self._texts.get(b)
            if buf is None:
                buf = self._texts[b] = ctypes.create_string_buffer(b)
        return ctypes.addressof(buf)

    def raise_pending(self) -> None:
        """Re-raise the first exception a stand-in function raised (a stand-in bug)."""
        if self.errors:
            e = self.errors[0]
            self.errors.clear()
            raise AssertionError(f"the stand-in raised inside a C call: {e!r}") from e
