"""NCCL's environment as NCCL reads it: its configuration files under the process environment,
and numeric variables (NCCL_PARAM) read once per process with ``strtoll``.

* ``ncclGetEnv`` first loads, once per process, ``$NCCL_CONF_FILE`` (else ``~/.nccl.conf``) and
  then ``/etc/nccl.conf``: each ``NAME=value`` line is ``setenv(NAME, value, 0)``, so the
  process environment wins, then the first file (src/misc/param.cc:27-69 at v2.28.9-1).
* ``NCCL_PARAM`` values are read at their first use and cached for the process
  (src/include/param.h:19-28; ncclLoadParam, param.cc:71-90): ``strtoll(str, nullptr, 0)``
  (``4x`` reads 4, ``0x10`` 16, ``010`` 8); an empty string is unset; a value strtoll flags
  with errno (out of range) gives the default.  -2 is most parameters' "unset" (the default of
  NCCL_MIN/MAX_NCHANNELS and NCCL_*BUFFSIZE: connect.cc:325-326, init.cc:711).

:func:`nccl_environ` is the environment NCCL sees; :func:`param` one variable's value.
"""
from __future__ import annotations

import os
import pwd
from typing import Dict, Mapping, MutableMapping, Optional, Tuple

__all__ = ["c_strtoll", "nccl_environ", "param", "forget_params", "INT64"]

_HEX = "0123456789abcdefABCDEF"
INT64 = (-(1 << 63), (1 << 63) - 1)
#: NCCL_PARAM values read in this process (name -> value, note), as NCCL's per-process cache
_CACHE: Dict[str, Tuple[int, str]] = {}


def c_strtoll(text: str) -> Tuple[int, str]:
    """What NCCL's ncclLoadParam (misc/param.cc:76-93: ``strtoll(str, nullptr, 0)``) reads from
    ``text``, and '' or why a user would not mean it (trailing characters, no digits)."""
    t = text.lstrip()
    sign = -1 if t[:1] == "-" else 1
    t = t[1:] if t[:1] in "+-" else t
    if t[:2].lower() == "0x" and t[2:3] and t[2:3] in _HEX:
        base, t = 16, t[2:]
    elif t[:1] == "0":
        base = 8
    else:
        base = 10
    digits = "0123456789abcdef"[:base]
    n = 0
    while n < len(t) and t[n].lower() in digits:
        n += 1
    value = sign * int(t[:n], base) if n else 0
    if not n:
        return value, "no digits"
    if t[n:].strip():
        return value, f"it stops at {t[n:]!r}"
    return value, ""


def _conf_lines(path: str) -> Dict[str, str]:
    """setEnvFile (param.cc:27-52): ``NAME=value`` lines, '#' lines skipped, names and values
    cut at 1023 characters; an unreadable file is nothing."""
    out: Dict[str, str] = {}
    try:
        with open(path, "r", errors="replace") as f:
            lines = f.read().split("\n")
    except OSError:
        return out
    for line in lines:
        if not line or line[0] == "#" or "=" not in line:
            continue
        name, value = line.split("=", 1)
        out.setdefault(name[:1023], value[:1023])
    return out


def nccl_environ(env: Optional[Mapping[str, str]] = None) -> Mapping[str, str]:
    """The environment ncclGetEnv reads: ``env`` (default the process's) with the NCCL
    configuration files' variables under it (initEnvFunc, param.cc:54-69)."""
    base = dict(os.environ if env is None else env)
    user = base.get("NCCL_CONF_FILE")
    files = [user] if user else []
    if not user:
        try:
            files.append(os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".nccl.conf"))
        except (KeyError, OSError):
            pass
    files.append("/etc/nccl.conf")
    for path in files:
        for name, value in _conf_lines(path).items():
            base.setdefault(name, value)
    return base


def param(env: Mapping[str, str], name: str, default: int, *,
          cache: Optional[MutableMapping[str, Tuple[int, str]]] = None) -> Tuple[int, str]:
    """(value, note) of the NCCL_PARAM ``name`` in ``env``: ``default`` when unset, empty or
    out of int64's range (errno: NCCL uses the default); the note says what a user would not
    expect ('' when nothing).  With ``cache`` (the process's: :data:`_CACHE`), the first
    reading of ``name`` is kept and returned ever after, as NCCL's is."""
    if cache is not None and name in cache:
        return cache[name]
    text = env.get(name)
    got: Tuple[int, str] = (default, "")
    if text:
        val, why = c_strtoll(text)
        if not INT64[0] <= val <= INT64[1]:
            got = (default, f"{name}={text}: out of range for strtoll, NCCL uses the default "
                            f"{default}")
        else:
            got = (val, f"{name}={text}: NCCL reads it with strtoll as {val} ({why})"
                   if why else "")
    if cache is not None:
        cache[name] = got
    return got


def forget_params() -> None:
    """Forget the process's cached NCCL_PARAM readings (for tests: NCCL never forgets)."""
    _CACHE.clear()
