"""NCCL's effective parameters through its parameter API (NCCL 2.30.4): names and values as
NCCL itself resolved them (environment, ``nccl.conf`` files, defaults), not as ncclpy guesses.

The calls answer without a GPU and before any communicator exists.  They see NCCL's parameter
*registry*: the parameters defined with NCCL's new parameter system (NCCL 2.30: NCCL_DEBUG and
its relatives), registered when libnccl loads; the many NCCL_* variables NCCL still reads the
older way (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...) are not in it.  By default NCCL lists only the
published parameters (``NCCL_PARAM_DUMP_ALL=true``: the private ones too; any registered one can
be read by name).  NCCL's text for a value is not always a value: an empty string for a string
parameter that is not set, ``<unknown>`` for a value its option list has no name for (NCCL_DEBUG's
default, no output); :func:`param_rows` says what each is.  The pointers NCCL returns are valid
until the next call on the same thread: each is copied at once.
"""
from __future__ import annotations

import ctypes
import difflib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..errors import ArgumentError, ArgumentTypeError
from .functions import PARAM_API, PARAM_GETTERS

__all__ = ["nccl_params", "nccl_param", "param_keys", "dump_params", "PARAM_KINDS",
           "has_param_api", "ParamRow", "param_rows", "private_keys", "NOT_SET", "UNNAMED"]

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
        f"; NCCL's parameter registry lists {len(keys)} (NCCL_PARAM_DUMP_ALL=true: the private " \
        f"ones too); NCCL_* variables NCCL reads outside its registry cannot be read this way"
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


# -- what each value is ------------------------------------------------------------------------
#: NCCL's text for a value its option list has no name for (``oneOfToString``)
UNNAMED = "<unknown>"
#: what a report shows for a parameter whose variable is not set and that NCCL gives no value
NOT_SET = "not set"
_DUMP_LINE = re.compile(r"^\s+Current value=(.*) set_by=(\S+) default=(.*)$")


@dataclass(frozen=True)
class ParamRow:
    """One parameter: NCCL's text for it, the variable as NCCL's environment has it, and what
    a report shows (``shown``; ``value`` None where NCCL has no value to give)."""

    key: str
    nccl_text: str              # ncclParamGetParameter's text, as NCCL gives it
    env: Optional[str]          # the variable in the process environment (None: not set)
    set_by: Optional[str]       # NCCL's "Default" or "EnvPlugin" (None: NCCL did not say)
    value: Optional[str]        # the value, None where NCCL has none to give
    shown: str                  # the value as a report prints it


def _getenv(key: str) -> Optional[str]:
    """The variable as NCCL reads it: the C environment (NCCL applies nccl.conf files with
    setenv, which ``os.environ`` does not see)."""
    try:
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_char_p
        v = libc.getenv(key.encode())
        return None if v is None else v.decode(errors="replace")
    except (OSError, AttributeError):
        return os.environ.get(key)


def _set_by(lib: Any) -> Dict[str, str]:
    """``{key: set_by}`` from ``ncclParamDumpAll``'s text (NCCL prints it on stdout: file
    descriptor 1 is pointed at a temporary file for the call); {} where that fails."""
    try:
        libc = ctypes.CDLL(None)
        sys.stdout.flush()
        libc.fflush(None)
        saved = os.dup(1)
    except (OSError, AttributeError, ValueError):
        return {}
    try:
        with tempfile.TemporaryFile() as f:
            os.dup2(f.fileno(), 1)
            try:
                lib.fn("ncclParamDumpAll")()
                libc.fflush(None)
            finally:
                os.dup2(saved, 1)
            f.seek(0)
            text = f.read().decode(errors="replace")
    finally:
        os.close(saved)
    out, key = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace():
            key = line.split(" ", 1)[0]
        m = _DUMP_LINE.match(line)
        if m and key:
            out[key] = m.group(2)
    return out


def _row(key: str, text: str, env: Optional[str], set_by: Optional[str]) -> ParamRow:
    refused = (f"{key}={env!r} in the environment is not a value NCCL accepts"
               if env is not None and set_by == "Default" else "")   # NCCL fell back
    if text == UNNAMED or (text == "" and not (env is not None and set_by == "EnvPlugin")):
        value: Optional[str] = None
        shown = f"NCCL's default - {refused}" if refused else NOT_SET
    else:
        value = text
        shown = repr(text) if text != text.strip() or not text else text
        if refused:
            shown += f" (NCCL's default - {refused})"
    return ParamRow(key, text, env, set_by, value, shown)


def param_rows(lib: Any = None) -> List[ParamRow]:
    """Every listed parameter (:func:`param_keys`) as a :class:`ParamRow`: ``not set`` where the
    variable is unset and NCCL gives no value (an empty string, or ``<unknown>`` for a
    default its option list cannot name), a value with outer spaces quoted, and where the
    variable is set but NCCL fell back to its default (a value it refused), that said.

    Reading NCCL's sources of values prints NCCL's dump into a temporary file through file
    descriptor 1: meant for a command line, not for a process whose threads write stdout."""
    lib = _lib(lib)
    values = nccl_params(lib=lib)
    set_by = _set_by(lib)
    return [_row(k, v, _getenv(k), set_by.get(k)) for k, v in values.items()]


def private_keys(lib: Any = None) -> Optional[List[str]]:
    """The registered parameters NCCL lists only with ``NCCL_PARAM_DUMP_ALL=true`` (NCCL reads
    that variable at each listing: it is set for one listing, then restored), or None where
    the listing has them already (the variable is set).  Changes the process environment for
    a moment: meant for a command line, not for a process with running communicators."""
    lib = _lib(lib)
    now = param_keys(lib)
    if "NCCL_PARAM_DUMP_ALL" in now:          # itself private: listed only when it is on
        return None
    name, old = "NCCL_PARAM_DUMP_ALL", os.environ.get("NCCL_PARAM_DUMP_ALL")
    os.environ[name] = "TRUE"
    try:
        every = param_keys(lib)
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
    return [k for k in every if k not in now]
