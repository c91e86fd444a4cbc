"""NCCL's effective parameters through its parameter API (NCCL 2.30.4): names and values as
NCCL itself resolved them (environment, ``nccl.conf`` files, defaults), not as ncclpy guesses.

The calls answer without a GPU and before any communicator exists; NCCL registers most of its
parameters while it creates the first communicator, so a dict read after init has more keys.
By default NCCL lists only the documented parameters (``NCCL_PARAM_DUMP_ALL=true``: all).  The
pointers NCCL returns are valid until the next call on the same thread: each is copied at once.
"""
from __future__ import annotations

import ctypes
import difflib
from typing import Any, Dict, List, Optional

from ..errors import ArgumentError, ArgumentTypeError
from .functions import PARAM_API, PARAM_GETTERS

__all__ = ["nccl_params", "nccl_param", "param_keys", "dump_params", "PARAM_KINDS",
           "has_param_api"]

#: the typed reads :func:`nccl_param` offers ("str": ``ncclParamGetStr``)
PARAM_KINDS = ("str", "raw", *PARAM_GETTERS)
_RAW_MAX = 4096


def _lib(lib: Any = None) -> Any:
    if lib is None:
        from .lib import get_lib
        lib = get_lib()
    return lib


def has_param_api(lib: Any = None) -> bool:
    """Whether the loaded NCCL has the parameter API (>= 2.30.4 and exporting it)."""
    lib = _lib(lib)
    return lib.version >= PARAM_API and lib.has("ncclParamGetAllParameterKeys")


def param_keys(lib: Any = None) -> List[str]:
    """``ncclParamGetAllParameterKeys``: the registered parameter names, in NCCL's order."""
    lib = _lib(lib)
    table = ctypes.POINTER(ctypes.c_char_p)()
    n = ctypes.c_int(0)
    lib.check(lib.fn("ncclParamGetAllParameterKeys")(ctypes.byref(table), ctypes.byref(n)),
              "ncclParamGetAllParameterKeys")
    return [table[i].decode(errors="replace") for i in range(n.value) if table[i]]


def _get(lib: Any, key: str) -> Optional[str]:
    value = ctypes.c_char_p()
    n = ctypes.c_int(0)
    code = lib.fn("ncclParamGetParameter")(key.encode(), ctypes.byref(value), ctypes.byref(n))
    if code:
        return None
    if not value.value and n.value <= 0:
        return ""
    raw = ctypes.string_at(value, n.value) if n.value > 0 else value.value
    return raw.decode(errors="replace")


def _check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise ArgumentTypeError(f"NCCL parameter name: expected a str, got {type(key).__name__}")
    if not key or "\x00" in key:
        raise ArgumentError(f"NCCL parameter name {key!r} is empty or contains NUL")
    return key


def _unknown(lib: Any, key: str) -> ArgumentError:
    keys = param_keys(lib)
    near = difflib.get_close_matches(key, keys, n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else \
        f"; NCCL knows {len(keys)} now (more after the first communicator's init, all with " \
        f"NCCL_PARAM_DUMP_ALL=true)"
    return ArgumentError(f"NCCL has no parameter {key!r}{hint}")


def nccl_params(keys: Optional[List[str]] = None, lib: Any = None) -> Dict[str, str]:
    """``{name: value}`` of NCCL's parameters as strings (``ncclParamGetParameter``), every
    registered one or only ``keys`` (an unknown key raises ArgumentError naming it)."""
    lib = _lib(lib)
    names = param_keys(lib) if keys is None else [_check_key(k) for k in keys]
    out: Dict[str, str] = {}
    for k in names:
        v = _get(lib, k)
        if v is None:
            if keys is not None:
                raise _unknown(lib, k)
            continue                   # unregistered between the two calls: not listed
        out[k] = v
    return out


def nccl_param(key: str, kind: str = "str", lib: Any = None) -> Any:
    """One parameter read through its handle (``ncclParamBind`` then ``ncclParamGet<kind>``):
    ``kind`` "str" (a ``const char*`` parameter), one of i8/i16/i32/i64/u8/u16/u32/u64 (an
    integer parameter of exactly that C type: NCCL refuses any other read), or "raw" (the
    value's bytes, ``ncclParamGet``, any type)."""
    lib = _lib(lib)
    _check_key(key)
    if kind not in PARAM_KINDS:
        raise ArgumentError(f"kind={kind!r} is not a parameter type; expected one of "
                            f"{', '.join(PARAM_KINDS)}")
    h = ctypes.c_void_p()
    if lib.fn("ncclParamBind")(ctypes.byref(h), key.encode()):
        lib.mark_seen()
        raise _unknown(lib, key)
    if kind == "raw":
        buf = ctypes.create_string_buffer(_RAW_MAX)
        n = ctypes.c_int(0)
        lib.check(lib.fn("ncclParamGet")(h, buf, _RAW_MAX, ctypes.byref(n)),
                  f"ncclParamGet({key})")
        return buf.raw[:max(n.value, 0)]
    if kind == "str":
        s = ctypes.c_char_p()
        code = lib.fn("ncclParamGetStr")(h, ctypes.byref(s))
        if not code:
            return "" if s.value is None else s.value.decode(errors="replace")
        name = "ncclParamGetStr"
    else:
        name, ctype = PARAM_GETTERS[kind]
        out = ctype()
        code = lib.fn(name)(h, ctypes.byref(out))
        if not code:
            return int(out.value)
    if code == 4:                      # ncclInvalidArgument: the parameter has another type
        lib.mark_seen()
        raise ArgumentError(f"NCCL parameter {key} cannot be read as kind={kind!r} ({name} "
                            f"returned ncclInvalidArgument): NCCL's typed reads need the "
                            f"parameter's own C type; read it as text with "
                            f"nccl_params([{key!r}]) or as bytes with kind='raw'")
    raise lib.error(code, f"{name}({key})")


def dump_params(lib: Any = None) -> None:
    """``ncclParamDumpAll``: NCCL writes every parameter with its type, source and default to
    its own log (stdout, or ``NCCL_DEBUG_FILE``)."""
    lib = _lib(lib)
    lib.fn("ncclParamDumpAll")()
