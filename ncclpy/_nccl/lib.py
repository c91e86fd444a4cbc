"""The loaded libnccl, bound with ctypes: the very copy CuPy loaded, never a second one.

CuPy (>= 14) loads NCCL through cuda-pathfinder from the nvidia-nccl-cu12/cu13 wheel when
``cupy.cuda.nccl`` is imported.  ncclpy imports that module first, then asks the dynamic loader
which file defines ``ncclGetVersion`` as CuPy's NCCL extension module resolves it (``dladdr``:
the libnccl CuPy really calls), picks that file among the libnccl copies mapped into this
process (``/proc/self/maps``, or ``dl_iterate_phdr`` where there is no procfs), and opens that
same path with ``RTLD_NOLOAD`` so the dynamic loader hands back the existing copy instead of
loading another.  Every binding is gated on the loaded NCCL's
version with a :class:`~ncclpy.errors.VersionError` that names the version it needs.

Nothing here runs at ``import ncclpy``: :func:`get_lib` loads on first use and raises
:class:`~ncclpy.errors.MissingDependencyError` (naming the pip extra) when CuPy or NCCL is absent.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import (CudaUnavailableError, MissingDependencyError, NcclError, NcclpyError,
                      VersionError, nccl_error_from_code)
from ..semantics.ops import format_version
from .functions import FUNCTIONS, UniqueId, nccl_version_code

__all__ = ["NcclLib", "CPU_BACKEND_PATH", "get_lib", "loaded_nccl_paths", "nccl_version_code",
           "FUNCTIONS", "UniqueId", "require_version", "CudaUnavailableError", "INSTALL_HINT",
           "NCCL_SUCCESS", "is_loaded", "use_lib", "cpu_backend", "NCCL_IN_PROGRESS",
           "NCCL_SPLIT_NOCOLOR", "SCALAR_HOST_IMMEDIATE"]

log = logging.getLogger(__name__)

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
NCCL_SPLIT_NOCOLOR = -1
SCALAR_HOST_IMMEDIATE = 1  # ncclScalarHostImmediate

INSTALL_HINT = ("install the CUDA extra that matches your driver: pip install 'ncclpy[cu13]' "
                "(CUDA 13) or pip install 'ncclpy[cu12]' (CUDA 12)")


#: how the CPU backend's engine names itself in ``lib.path`` (ncclpy.cpu.backend sets it)
CPU_BACKEND_PATH = "ncclpy CPU backend"


def require_version(name: str, loaded: int, path: str = "") -> None:
    """Raise VersionError if NCCL function ``name`` is newer than the ``loaded`` version code."""
    if name not in FUNCTIONS:
        raise KeyError(f"{name} is not an NCCL function ncclpy binds")
    need = FUNCTIONS[name][2]
    if need and loaded < need:
        if path.startswith(CPU_BACKEND_PATH):   # no wheel to upgrade: the engine models one NCCL
            raise VersionError(f"{name} needs NCCL >= {format_version(need)}, and ncclpy's CPU "
                               f"backend models NCCL {format_version(loaded)}, which lacks it: "
                               f"the CPU backend cannot run {name} (on a GPU, NCCL >= "
                               f"{format_version(need)} does)")
        where = f" ({path})" if path else ""
        raise VersionError(f"{name} needs NCCL >= {format_version(need)}; the loaded NCCL is "
                           f"{format_version(loaded)}{where}; upgrade the nvidia-nccl wheel "
                           f"(ncclpy[cu12] / ncclpy[cu13]) or the system NCCL")


_LIB_RE = re.compile(r"libnccl\.so(\.\d+)*$")


def _maps_paths() -> Optional[List[str]]:
    try:
        with open("/proc/self/maps", "r") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out: List[str] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)") or not path.startswith("/"):
            continue
        if _LIB_RE.search(os.path.basename(path)) and path not in out:
            out.append(path)
    return out


class _DlPhdrInfo(ctypes.Structure):
    _fields_ = [("dlpi_addr", ctypes.c_void_p), ("dlpi_name", ctypes.c_char_p)]


def _phdr_paths() -> List[str]:
    """Loaded objects via ``dl_iterate_phdr`` (libc), for systems without /proc."""
    libc = ctypes.CDLL(None)
    cb_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t,
                            ctypes.c_void_p)
    out: List[str] = []

    def cb(info, size, data):
        name = info.contents.dlpi_name
        if name:
            path = os.fsdecode(name)
            if _LIB_RE.search(os.path.basename(path)) and path not in out:
                out.append(path)
        return 0

    libc.dl_iterate_phdr.argtypes = [cb_t, ctypes.c_void_p]
    libc.dl_iterate_phdr.restype = ctypes.c_int
    libc.dl_iterate_phdr(cb_t(cb), None)
    return out


def loaded_nccl_paths(method: str = "auto") -> List[str]:
    """Paths of every libnccl mapped into this process, in load order.

    ``method``: "maps" (/proc/self/maps), "phdr" (dl_iterate_phdr) or "auto" (maps, else phdr).
    """
    if method in ("auto", "maps"):
        paths = _maps_paths()
        if paths is not None or method == "maps":
            return paths or []
    return _phdr_paths()


def _import_cupy_nccl():
    try:
        import cupy  # noqa: F401  (imported for its error, if any)
    except Exception as e:  # ImportError, or a broken CUDA install raising on import
        raise MissingDependencyError(
            f"ncclpy needs CuPy to load NCCL, and importing cupy failed ({type(e).__name__}: "
            f"{e}); {INSTALL_HINT}") from e
    try:
        from cupy.cuda import nccl
    except Exception as e:
        raise MissingDependencyError(
            f"CuPy is installed but cupy.cuda.nccl could not be imported ({type(e).__name__}: "
            f"{e}); {INSTALL_HINT}") from e
    if not getattr(nccl, "available", False):
        raise MissingDependencyError(
            "CuPy is installed but could not load libnccl (cupy.cuda.nccl.available is False); "
            f"the NCCL wheel is missing or does not match CuPy's CUDA: {INSTALL_HINT}")
    return nccl


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _cupy_linked_path(cupy_nccl) -> Optional[str]:
    """The file defining ``ncclGetVersion`` as CuPy's NCCL extension resolves it (None if that
    cannot be told, e.g. no ``dladdr``)."""
    import sys
    ext = sys.modules.get("cupy_backends.cuda.libs.nccl")
    path = getattr(ext, "__file__", None)
    if not path:
        return None
    try:
        h = ctypes.CDLL(path, mode=os.RTLD_NOW | getattr(os, "RTLD_NOLOAD", 0))
        libc = ctypes.CDLL(None)
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if not libc.dladdr(ctypes.cast(h.ncclGetVersion, ctypes.c_void_p), ctypes.byref(info)):
            return None
        return os.fsdecode(info.dli_fname) if info.dli_fname else None
    except (OSError, AttributeError):
        return None


def _pick(paths: List[str], want: Optional[str]) -> str:
    """The mapped path that is the same file as ``want`` (else the first one)."""
    for p in paths if want else ():
        try:
            if os.path.samefile(p, want):
                return p
        except OSError:
            continue
    return paths[0]


class NcclLib:
    """The process's libnccl: path, runtime version, and version-gated ctypes bindings."""

    def __init__(self) -> None:
        self.cupy_nccl = _import_cupy_nccl()
        paths = loaded_nccl_paths()
        if not paths:
            raise MissingDependencyError(
                "cupy.cuda.nccl imported but no libnccl.so is mapped into this process, so "
                f"ncclpy cannot bind the copy CuPy uses; {INSTALL_HINT}")
        cupy_path = _cupy_linked_path(self.cupy_nccl)
        self.path: str = _pick(paths, cupy_path)
        if len(paths) > 1:
            log.warning("several libnccl copies are loaded in this process: %s; ncclpy binds %s "
                        "(%s)", paths, self.path, "the one CuPy's NCCL module calls" if cupy_path
                        else "the first mapped: CuPy's could not be told")
        mode = os.RTLD_NOW | getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_GLOBAL
        try:
            self.cdll = ctypes.CDLL(self.path, mode=mode)
        except OSError as e:  # pragma: no cover - the path came from the loader itself
            raise MissingDependencyError(f"cannot reopen the loaded libnccl {self.path}: {e}; "
                                         f"{INSTALL_HINT}") from e
        self._fns: Dict[str, Callable] = {}
        self._seen_error = ""
        v = ctypes.c_int(0)
        res = self.fn("ncclGetVersion", check_version=False)(ctypes.byref(v))
        if res != NCCL_SUCCESS:  # pragma: no cover
            raise nccl_error_from_code(res, "ncclGetVersion")
        self.version: int = v.value
        try:
            self.cupy_version: int = int(self.cupy_nccl.get_version())
        except Exception:  # pragma: no cover
            self.cupy_version = -1
        if self.cupy_version not in (-1, self.version):  # pragma: no cover
            log.warning("CuPy reports NCCL %s but %s reports %s", self.cupy_version, self.path,
                        self.version)
        self.mark_seen()   # text left by whoever used NCCL before ncclpy is not ncclpy's
        log.debug("bound libnccl %s (NCCL %s)", self.path, format_version(self.version))

    # -- bindings -------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether the loaded NCCL is new enough for ``name`` and exports it."""
        try:
            self.fn(name)
        except (VersionError, KeyError):
            return False
        return True

    def fn(self, name: str, check_version: bool = True) -> Callable:
        """The ctypes function ``name`` with argtypes/restype set (VersionError if too old)."""
        f = self._fns.get(name)
        if f is not None:
            return f
        if check_version:
            require_version(name, self.version, self.path)
        restype, argtypes, need = FUNCTIONS[name]
        try:
            f = getattr(self.cdll, name)
        except AttributeError:
            raise VersionError(f"{self.path} (NCCL {format_version(self.version)}) does not "
                               f"export {name} (needs NCCL >= {format_version(need)})") from None
        f.restype = restype
        f.argtypes = list(argtypes)
        self._fns[name] = f
        return f

    def __getattr__(self, name: str):
        if name.startswith("nccl") and name in FUNCTIONS:
            return self.fn(name)
        raise AttributeError(name)

    # -- errors ---------------------------------------------------------------------------
    def error_string(self, code: int) -> str:
        s = self.fn("ncclGetErrorString")(int(code))
        return s.decode(errors="replace") if s else ""

    def last_error(self, comm: Optional[int] = None) -> str:
        """``ncclGetLastError(comm)`` text ('' where NCCL is too old or has none)."""
        if self.version < FUNCTIONS["ncclGetLastError"][2]:
            return ""
        try:
            s = self.fn("ncclGetLastError")(comm or None)
        except Exception:  # pragma: no cover
            return ""
        return s.decode(errors="replace") if s else ""

    def mark_seen(self) -> None:
        """Note NCCL's current last-error text as already seen (after a step that may leave
        text behind without failing, e.g. the repair ``ncclGroupEnd`` or a successful init)."""
        self._seen_error = self.last_error()

    def fresh_error_text(self, comm: Optional[int] = None) -> str:
        """``ncclGetLastError`` text if NCCL wrote it since the last look, else ''.

        NCCL keeps one process-wide last-error buffer and never clears it, so a failure that
        writes no text of its own would otherwise be reported with an earlier, unrelated one.
        (The same text written twice in a row cannot be told from a stale one and is dropped.)
        """
        text = self.last_error(comm)
        if text == self._seen_error:
            return ""
        self._seen_error = text
        return text

    def error(self, code: int, call: str, comm: Optional[int] = None) -> NcclError:
        """The NcclError for ``code`` from ``call``, with NCCL's text for this failure only
        (``ncclGetErrorString(code)`` where NCCL wrote none)."""
        text = self.fresh_error_text(comm) or self.error_string(code)
        return nccl_error_from_code(code, call, text)

    def check(self, code: int, call: str, comm: Optional[int] = None,
              in_progress_ok: bool = False) -> int:
        """Raise the NcclError subclass for ``code`` unless success (or in-progress if ok)."""
        if code == NCCL_SUCCESS or (in_progress_ok and code == NCCL_IN_PROGRESS):
            return code
        raise self.error(code, call, comm)

    # -- small wrappers -------------------------------------------------------------------
    def get_unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self.fn("ncclGetUniqueId")(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid.to_bytes()

    def async_error(self, comm: int) -> int:
        st = ctypes.c_int(0)
        self.check(self.fn("ncclCommGetAsyncError")(comm, ctypes.byref(st)),
                   "ncclCommGetAsyncError", comm)
        return st.value

    def comm_query(self, name: str, comm: int) -> int:
        """ncclCommCount / ncclCommUserRank / ncclCommCuDevice."""
        out = ctypes.c_int(-1)
        self.check(self.fn(name)(comm, ctypes.byref(out)), name, comm)
        return out.value

    def comm_init_rank_config(self, nranks: int, uid: bytes, rank: int,
                              config_struct) -> Tuple[int, int]:
        """ncclCommInitRankConfig -> (comm handle, result: 0 or ncclInProgress)."""
        h = ctypes.c_void_p(0)
        cfg = ctypes.addressof(config_struct) if config_struct is not None else None
        res = self.fn("ncclCommInitRankConfig")(ctypes.byref(h), int(nranks),
                                                UniqueId.from_bytes(uid), int(rank), cfg)
        if res not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            err = self.error(res, "ncclCommInitRankConfig", h.value)
            self.repair_group_depth()
            raise err
        return h.value or 0, res

    def comm_init_rank_scalable(self, nranks: int, uids: List[bytes], rank: int,
                                config_struct) -> Tuple[int, int]:
        """ncclCommInitRankScalable with ``len(uids)`` ids (NCCL 2.23) -> (handle, result)."""
        h = ctypes.c_void_p(0)
        ids = (UniqueId * len(uids))(*[UniqueId.from_bytes(u) for u in uids])
        cfg = ctypes.addressof(config_struct) if config_struct is not None else None
        res = self.fn("ncclCommInitRankScalable")(ctypes.byref(h), int(nranks), int(rank),
                                                  len(uids), ctypes.addressof(ids), cfg)
        if res not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            err = self.error(res, "ncclCommInitRankScalable", h.value)
            self.repair_group_depth()
            raise err
        return h.value or 0, res

    def repair_group_depth(self) -> int:
        """Close NCCL group levels a failed init left open; returns how many were closed.

        A failed ncclCommInitRank[Config] (e.g. a CUDA failure) can return with this thread's
        NCCL group depth still raised, which would silently defer every later call of the
        thread into a group.  Only done when ncclpy has no group open on this thread.
        """
        from .group import group_state
        if group_state().depth:
            return 0
        end = self.fn("ncclGroupEnd")
        closed = 0
        while closed < 16 and end() == NCCL_SUCCESS:  # ncclInvalidUsage: not in a group
            closed += 1
        self.mark_seen()   # the final ncclGroupEnd leaves "not in a group call" behind
        if closed:
            log.debug("closed %d NCCL group level(s) left open by a failed init", closed)
        return closed

    def __repr__(self) -> str:
        return f"NcclLib({self.path!r}, NCCL {format_version(self.version)})"


_lock = threading.Lock()
_lib: Optional[NcclLib] = None
#: the CPU engine when this process runs on the CPU backend (:func:`ncclpy.cpu.backend.install`
#: puts it here with its libnccl): "which backend is this process on" is asked at the bottom
#: (memory, the unique id, a rank's device label), so it lives with the library itself
_cpu_engine: Optional[Any] = None


def cpu_backend() -> bool:
    """Whether this process runs on the CPU backend (``ncclpy.init(device="cpu")``)."""
    return _cpu_engine is not None


def get_lib() -> NcclLib:
    """The process-wide :class:`NcclLib` (loaded on first call; thread-safe)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = NcclLib()
    return _lib


@contextlib.contextmanager
def use_lib(lib: "NcclLib") -> Iterator["NcclLib"]:
    """Put ``lib`` in place of the process's libnccl for the block (tests' stand-ins, with
    :func:`ncclpy._nccl.cuda.use`)."""
    global _lib
    with _lock:
        prev, _lib = _lib, lib
    try:
        yield lib
    finally:
        with _lock:
            _lib = prev


def is_loaded() -> bool:
    """Whether :func:`get_lib` already ran (for ``ncclpy info`` and tests)."""
    return _lib is not None
