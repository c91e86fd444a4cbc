"""``CollConfig``: one collective call's options, marshalled to an ``ncclCollConfig_t``.

NCCL 2.31 added an ``ncclXxxConfig`` variant of every collective that takes a trailing
``const ncclCollConfig_t*``: which algorithm(s) this call may use, CTA limits and policy, a
profiler tag, and (2.32) a CUDA event NCCL records when the collective's kernel has launched.
``comm.all_reduce(x, config=CollConfig(algorithm="ring"))`` calls ``ncclAllReduceConfig``.
NCCL requires the same config on every rank and checks it only locally; checked mode compares
:meth:`CollConfig.describe` across ranks.  Unset fields (None) keep NCCL's initializer values.
"""
from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

from ..errors import ArgumentError, ArgumentTypeError, VersionError
from ..semantics.ops import format_version
from .config import (CONFIG_MAGIC, CONFIG_UNDEF_INT, MAX_CGA_CLUSTER_SIZE, _is_bool, as_index,
                     cta_policy_value)

__all__ = ["CollConfig", "CollConfigStruct", "COLL_CONFIG_VERSION", "COLL_CONFIG_FROM",
           "LAUNCH_EVENT_FROM", "ALGORITHMS", "coll_struct_size"]

COLL_CONFIG_VERSION = 23200        # the layout below: ncclCollConfig_v23200
COLL_CONFIG_FROM = 23100           # first NCCL with ncclCollConfig_t and nccl*Config
LAUNCH_EVENT_FROM = 23200          # launchCompletionEvent
#: NCCL's algorithm names (NCCL_ALGO's vocabulary), case-insensitive
ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
_ALGO_LOWER = {a.lower(): a for a in ALGORITHMS}


class CollConfigStruct(ctypes.Structure):
    """``ncclCollConfig_t`` as nccl.h of NCCL 2.32 declares it."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("ext", ctypes.c_void_p),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("algSelection", ctypes.c_char_p),
        ("forceAlgSelection", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("userProfilerTag", ctypes.c_uint64),
        ("launchCompletionEvent", ctypes.c_void_p),
    ]


def coll_struct_size(nccl_version: Optional[int]) -> int:
    """The versioned ``size``: NCCL 2.31's struct ends at ``userProfilerTag``."""
    full = ctypes.sizeof(CollConfigStruct)
    if nccl_version is None or nccl_version >= LAUNCH_EVENT_FROM:
        return full
    return CollConfigStruct.launchCompletionEvent.offset


def _check_algorithm(text: Any) -> Optional[str]:
    """NCCL_ALGO's grammar: ``[func:][^]name[,name...]`` segments joined by ``;``."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise ArgumentTypeError(f"CollConfig.algorithm: expected a str or None, got "
                                f"{type(text).__name__} {text!r}")
    if not text.strip() or "\x00" in text:
        raise ArgumentError(f"CollConfig.algorithm: {text!r} is empty or contains NUL; expected "
                            f"algorithm names such as 'ring' or '^nvls,tree' (None: NCCL picks)")
    for seg in text.split(";"):
        seg = seg.strip()
        if ":" in seg:
            seg = seg.split(":", 1)[1]
        seg = seg.strip().lstrip("^")
        for name in seg.split(","):
            if name.strip().lower() not in _ALGO_LOWER:
                raise ArgumentError(f"CollConfig.algorithm: {name.strip()!r} in {text!r} is not "
                                    f"an NCCL algorithm; expected names from "
                                    f"{', '.join(ALGORITHMS)} (NCCL_ALGO's syntax)")
    return text


def _event_handle(ev: Any) -> int:
    """A ``cudaEvent_t`` from an int, a CuPy Event (``.ptr``) or a torch Event
    (``.cuda_event``)."""
    for attr in ("ptr", "cuda_event"):
        if hasattr(ev, attr):
            ev = getattr(ev, attr)
            break
    if _is_bool(ev):
        raise ArgumentTypeError("CollConfig.launch_completion_event: expected a CUDA event, "
                                f"got {ev!r}")
    try:
        h = operator.index(ev)
    except TypeError:
        raise ArgumentTypeError(f"CollConfig.launch_completion_event: expected a CuPy or torch "
                                f"CUDA event or a cudaEvent_t int, got {type(ev).__name__}"
                                ) from None
    if not 0 < h < 2 ** 64:
        raise ArgumentError(f"CollConfig.launch_completion_event: {h:#x} is not an event handle")
    return h


def _int(name: str, v: Any, lo: int, hi: int) -> Optional[int]:
    if v is None:
        return None
    v = as_index(f"CollConfig.{name}", v, "an int or None")
    if not lo <= v <= hi:
        raise ArgumentError(f"CollConfig.{name}: expected {lo}..{hi}, got {v}")
    return v


@dataclass(frozen=True)
class CollConfig:
    """Options of one collective call (``ncclCollConfig_t``, NCCL >= 2.31); None: NCCL's
    default.  ``algorithm``: NCCL_ALGO's syntax (``"ring"``, ``"^nvls"``); ``force_algorithm``
    (NCCL's default True): an unsatisfiable selection is an error rather than ignored;
    ``profiler_tag``: an opaque 63-bit value for profiler plugins; ``launch_completion_event``
    (NCCL >= 2.32): a CuPy/torch event (created without timing) NCCL records at kernel launch.
    Hashable: part of the resolver's cache key."""

    algorithm: Optional[str] = None
    force_algorithm: Optional[bool] = None
    min_ctas: Optional[int] = None
    max_ctas: Optional[int] = None
    nvls_ctas: Optional[int] = None
    cga_cluster_size: Optional[int] = None
    cta_policy: Optional[Any] = None
    profiler_tag: Optional[int] = None
    launch_completion_event: Optional[Any] = field(default=None, compare=False)
    _event: int = field(default=0, init=False, repr=False)
    _structs: Dict[int, CollConfigStruct] = field(default_factory=dict, init=False, repr=False,
                                                  compare=False, hash=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "algorithm", _check_algorithm(self.algorithm))
        fa = self.force_algorithm
        if fa is not None and not _is_bool(fa):
            raise ArgumentTypeError(f"CollConfig.force_algorithm: expected True, False or None, "
                                    f"got {type(fa).__name__} {fa!r}")
        put(self, "force_algorithm", None if fa is None else bool(fa))
        for name in ("min_ctas", "max_ctas", "nvls_ctas"):
            put(self, name, _int(name, getattr(self, name), 1, 2 ** 31 - 1))
        if self.min_ctas is not None and self.max_ctas is not None \
                and self.min_ctas > self.max_ctas:
            raise ArgumentError(f"CollConfig: min_ctas={self.min_ctas} is larger than "
                                f"max_ctas={self.max_ctas}; expected min_ctas <= max_ctas")
        put(self, "cga_cluster_size", _int("cga_cluster_size", self.cga_cluster_size, 0,
                                           MAX_CGA_CLUSTER_SIZE))
        pol = cta_policy_value("CollConfig.cta_policy", self.cta_policy)
        put(self, "cta_policy", _int("cta_policy", pol, 0, 2))
        put(self, "profiler_tag", _int("profiler_tag", self.profiler_tag, 0, 2 ** 63 - 1))
        ev = self.launch_completion_event
        put(self, "_event", 0 if ev is None else _event_handle(ev))

    def set_fields(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.init and getattr(self, f.name) is not None}

    def describe(self) -> Dict[str, Any]:
        """What must be equal on every rank (JSON-able): the set fields, the event only as
        present (each rank's own event is rank-local)."""
        out = {k: v for k, v in self.set_fields().items() if k != "launch_completion_event"}
        if self._event:
            out["launch_completion_event"] = True
        return out

    def check_version(self, nccl_version: int) -> None:
        if nccl_version < COLL_CONFIG_FROM:
            raise VersionError(f"config=CollConfig(...) needs NCCL >= "
                               f"{format_version(COLL_CONFIG_FROM)} (ncclCollConfig_t and the "
                               f"nccl*Config calls); the loaded NCCL is "
                               f"{format_version(nccl_version)}")
        if self._event and nccl_version < LAUNCH_EVENT_FROM:
            raise VersionError(f"CollConfig.launch_completion_event needs NCCL >= "
                               f"{format_version(LAUNCH_EVENT_FROM)}; the loaded NCCL is "
                               f"{format_version(nccl_version)}")

    def to_struct(self, nccl_version: Optional[int] = None) -> CollConfigStruct:
        """The ``ncclCollConfig_t`` (kept by this object: NCCL reads it during the call)."""
        key = 0 if nccl_version is None else nccl_version
        s = self._structs.get(key)
        if s is not None:
            return s
        if nccl_version is not None:
            self.check_version(nccl_version)
        s = CollConfigStruct()
        s.size = coll_struct_size(nccl_version)
        s.magic = CONFIG_MAGIC
        s.version = COLL_CONFIG_VERSION
        s.ext = None
        for name, cname in (("min_ctas", "minCTAs"), ("max_ctas", "maxCTAs"),
                            ("nvls_ctas", "nvlsCTAs"), ("cga_cluster_size", "cgaClusterSize"),
                            ("cta_policy", "CTAPolicy")):
            v = getattr(self, name)
            setattr(s, cname, CONFIG_UNDEF_INT if v is None else v)
        s.algSelection = None if self.algorithm is None else self.algorithm.encode()
        s.forceAlgSelection = 1 if self.force_algorithm is None else int(self.force_algorithm)
        s.userProfilerTag = self.profiler_tag or 0
        s.launchCompletionEvent = self._event or None
        self._structs[key] = s
        return s

    def pointer(self, nccl_version: int) -> int:
        """The struct's address for the call's trailing argument."""
        return ctypes.addressof(self.to_struct(nccl_version))
