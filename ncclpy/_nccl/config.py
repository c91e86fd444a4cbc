"""``Config``: NCCL communicator options, marshalled to an ``ncclConfig_t``.

Unset fields (``None``) keep NCCL's defaults: they are written as ``NCCL_CONFIG_UNDEF_INT``
(INT_MIN) or NULL, exactly what ``NCCL_CONFIG_INITIALIZER`` writes.  The struct ncclpy declares is
the NCCL 2.32 layout (fields up to ``nvlsHostMode``) with ``version = 23200``.  Its ``size`` is
the versioned size for the loaded NCCL: the end of the last field that NCCL's ``ncclConfig_t``
has.  NCCL copies ``min(size, its own sizeof)`` bytes, keeps its initializer's defaults for every
later field, and resets the fields newer than ``version``; so a newer NCCL reads exactly these
fields and an older one the prefix it knows.  A field the loaded NCCL does not know is refused
with a VersionError rather than silently ignored.
"""
from __future__ import annotations

import ctypes
import operator
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import ArgumentError, ArgumentTypeError, VersionError
from ..semantics.ops import format_version

__all__ = ["Config", "NcclConfigStruct", "CONFIG_FIELDS", "CONFIG_MAGIC", "CONFIG_VERSION",
           "CONFIG_UNDEF_INT", "BLOCKING_UNDEF_FROM", "MAX_CTAS_FILL", "COMM_BLOCKING_ENV_FROM",
           "nccl_env_int", "env_blocking", "effective_nonblocking", "init_struct",
           "CTA_POLICY_DEFAULT", "CTA_POLICY_EFFICIENCY", "CTA_POLICY_ZERO", "struct_size",
           "as_index", "cta_policy_value",
           "HOST_CFT_MODES", "NVLS_HOST_MODES"]

CONFIG_MAGIC = 0xCAFEBEEF          # NCCL_API_MAGIC
CONFIG_VERSION = 23200             # NCCL_VERSION(2, 32, 0): the layout declared below
CONFIG_UNDEF_INT = -(2 ** 31)      # NCCL_CONFIG_UNDEF_INT == INT_MIN
CTA_POLICY_DEFAULT = 0x00
CTA_POLICY_EFFICIENCY = 0x01
CTA_POLICY_ZERO = 0x02


class NcclConfigStruct(ctypes.Structure):
    """``ncclConfig_t`` as nccl.h of NCCL 2.32 declares it (later NCCLs append fields)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
        ("nChannelsPerNetPeer", ctypes.c_int),
        ("nvlinkCentricSched", ctypes.c_int),
        ("graphUsageMode", ctypes.c_int),
        ("numRmaCtx", ctypes.c_int),
        ("maxP2pPeers", ctypes.c_int),
        ("graphStreamOrdering", ctypes.c_int),
        ("launchOrderImplicit", ctypes.c_int),
        ("numRmaSig", ctypes.c_int),
        ("rmaEagerInit", ctypes.c_int),
        ("hostCftMode", ctypes.c_int),
        ("nvlsHostMode", ctypes.c_int),
    ]


#: python field -> (C field, kind, first NCCL version that reads it): the version whose
#: ``ncclConfig_t`` has the field (an older NCCL copies only the prefix it knows and silently
#: drops the rest): 2.14 blocking; 2.17 CGA/CTAs/netName; 2.18 splitShare (with
#: ncclCommSplit); 2.26 trafficClass; 2.27 commName, collnet/CTA policy/shrinkShare/nvlsCTAs;
#: 2.28 nChannelsPerNetPeer/nvlinkCentricSched; 2.29 graphUsageMode/numRmaCtx; 2.30
#: maxP2pPeers; 2.30.5 graphStreamOrdering (NCCL's parseCommConfig resets it below a 2.30.5
#: config version); 2.31 launchOrderImplicit/numRmaSig/rmaEagerInit/hostCftMode; 2.32
#: nvlsHostMode.
CONFIG_FIELDS: Dict[str, Tuple[str, str, int]] = {
    "blocking": ("blocking", "bool", 21400),
    "cga_cluster_size": ("cgaClusterSize", "int", 21700),
    "min_ctas": ("minCTAs", "int", 21700),
    "max_ctas": ("maxCTAs", "int", 21700),
    "net_name": ("netName", "str", 21700),
    "split_share": ("splitShare", "bool", 21800),
    "traffic_class": ("trafficClass", "int", 22600),
    "comm_name": ("commName", "str", 22700),
    "collnet_enable": ("collnetEnable", "bool", 22700),
    "cta_policy": ("CTAPolicy", "int", 22700),
    "shrink_share": ("shrinkShare", "bool", 22700),
    "nvls_ctas": ("nvlsCTAs", "int", 22700),
    "n_channels_per_net_peer": ("nChannelsPerNetPeer", "int", 22800),
    "nvlink_centric_sched": ("nvlinkCentricSched", "bool", 22800),
    "graph_usage_mode": ("graphUsageMode", "int", 22900),
    "num_rma_ctx": ("numRmaCtx", "int", 22900),
    "max_p2p_peers": ("maxP2pPeers", "int", 23000),
    "graph_stream_ordering": ("graphStreamOrdering", "bool", 23005),
    "launch_order_implicit": ("launchOrderImplicit", "bool", 23100),
    "num_rma_sig": ("numRmaSig", "int", 23100),
    "rma_eager_init": ("rmaEagerInit", "bool", 23100),
    "host_cft_mode": ("hostCftMode", "int", 23100),
    "nvls_host_mode": ("nvlsHostMode", "int", 23200),
}

#: ``ncclHostCftMode_t`` (NCCL 2.31): name -> value (unset: ncclHostCftDefault == UNDEF_INT)
HOST_CFT_MODES = {"enable": 1, "disable": 2, "fallback": 3}
#: ``ncclNvlsHostMode_t`` (NCCL 2.32): name -> value; the two component flags may be OR-ed
NVLS_HOST_MODES = {"enable": 0, "disable_transport": 1, "disable_symmetric_multimem": 2,
                   "disable": 2 ** 31 - 1}
_GRAPH_USAGE_MODES = (0, 1, 2)

#: NCCL 2.14-2.16 accept only 0 or 1 in ``blocking`` (no "unset"): ncclpy writes 1 there
BLOCKING_UNDEF_FROM = 21700
#: What ncclpy writes for ``maxCTAs`` when only ``min_ctas`` is given: NCCL compares
#: ``minCTAs > maxCTAs`` before it fills its defaults (INT_MIN < anything), so min alone is
#: always ncclInvalidArgument.  NCCL's channel limit (MAXCHANNELS, its own default): 64 from
#: 2.25, 32 before (NCCL 2.17-2.24 warn about a larger maxCTAs).
MAX_CTAS_FILL = 64
MAX_CTAS_FILL_BEFORE_2_25 = 32
MAX_CTAS_64_FROM = 22500

_CTA_POLICIES = {"default": CTA_POLICY_DEFAULT, "efficiency": CTA_POLICY_EFFICIENCY,
                 "zero": CTA_POLICY_ZERO}
#: NCCL_MAX_CGA_CLUSTER_SIZE (init.cc): NCCL clamps a larger cgaClusterSize to it
MAX_CGA_CLUSTER_SIZE = 8
_POSITIVE = {"min_ctas", "max_ctas", "nvls_ctas", "n_channels_per_net_peer", "max_p2p_peers"}
_NON_NEGATIVE = {"num_rma_ctx", "num_rma_sig"}


def struct_size(nccl_version: Optional[int]) -> int:
    """The versioned ``size`` ncclpy writes: the end of the last field the ``ncclConfig_t`` of
    NCCL ``nccl_version`` has (the whole 2.32 struct when the version is not known or newer),
    rounded up to the struct's alignment as the C compiler rounds ``sizeof``."""
    full = ctypes.sizeof(NcclConfigStruct)
    if nccl_version is None:
        return full
    end = NcclConfigStruct.version.offset + ctypes.sizeof(ctypes.c_uint)
    for _name, (cname, _kind, need) in CONFIG_FIELDS.items():
        if need <= nccl_version:
            f = getattr(NcclConfigStruct, cname)
            end = max(end, f.offset + f.size)
    align = ctypes.alignment(NcclConfigStruct)
    return min(full, -(-end // align) * align)


def _is_bool(value: Any) -> bool:
    """A Python or NumPy boolean (``numpy.bool_``; ``numpy.bool`` in NumPy 2)."""
    t = type(value)
    return t is bool or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))


def as_index(label: str, value: Any, expected: str) -> int:
    """``value`` as an int (Python or NumPy integer, never a bool), else ArgumentTypeError
    "LABEL: expected EXPECTED, got TYPE VALUE" (Config's and CollConfig's one int rule)."""
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ArgumentTypeError(f"{label}: expected {expected}, got {type(value).__name__} "
                            f"{value!r}")


def cta_policy_value(label: str, value: Any) -> Any:
    """A CTA policy name ("default", "efficiency", "zero") as NCCL's value; anything else is
    returned for the int check."""
    if not isinstance(value, str):
        return value
    key = value.strip().lower()
    if key not in _CTA_POLICIES:
        raise ArgumentError(f"{label}: {value!r} is not a CTA policy; expected one of "
                            f"{', '.join(_CTA_POLICIES)} or 0/1/2")
    return _CTA_POLICIES[key]


@dataclass
class Config:
    """NCCL communicator options; ``None`` keeps NCCL's default (and its NCCL_* env override).

    ``blocking=False`` makes a nonblocking communicator: ncclpy then polls
    ``ncclCommGetAsyncError`` after init and after each call, with the communicator's timeout.
    ``cta_policy`` takes 0/1/2 or "default"/"efficiency"/"zero".  Any Config makes ncclpy create
    the communicator with ``ncclCommInitRankConfig`` (NCCL >= 2.14); a set field the loaded
    NCCL does not read raises VersionError (:data:`CONFIG_FIELDS` has each field's version).
    Split children inherit the parent's config.
    """

    blocking: Optional[bool] = None
    cga_cluster_size: Optional[int] = None
    min_ctas: Optional[int] = None
    max_ctas: Optional[int] = None
    net_name: Optional[str] = None
    split_share: Optional[bool] = None
    traffic_class: Optional[int] = None
    comm_name: Optional[str] = None
    collnet_enable: Optional[bool] = None
    cta_policy: Optional[Any] = None
    shrink_share: Optional[bool] = None
    nvls_ctas: Optional[int] = None
    n_channels_per_net_peer: Optional[int] = None
    nvlink_centric_sched: Optional[bool] = None
    graph_usage_mode: Optional[int] = None
    num_rma_ctx: Optional[int] = None
    max_p2p_peers: Optional[int] = None
    graph_stream_ordering: Optional[bool] = None
    launch_order_implicit: Optional[bool] = None
    num_rma_sig: Optional[int] = None
    rma_eager_init: Optional[bool] = None
    host_cft_mode: Optional[Any] = None
    nvls_host_mode: Optional[Any] = None

    def __setattr__(self, name: str, value: Any) -> None:
        """Every assignment is checked, in ``__init__`` and after it (``c.blocking = "x"``
        fails here, naming the field, not later inside NCCL's init)."""
        if name not in CONFIG_FIELDS:
            raise AttributeError(f"Config has no field {name!r}; expected one of "
                                 f"{', '.join(CONFIG_FIELDS)}")
        value = self._check(name, value)
        lo = value if name == "min_ctas" else self.__dict__.get("min_ctas")
        hi = value if name == "max_ctas" else self.__dict__.get("max_ctas")
        if lo is not None and hi is not None and lo > hi:
            raise ArgumentError(f"Config: min_ctas={lo} is larger than max_ctas={hi}; "
                                f"expected min_ctas <= max_ctas")
        mode = value if name == "graph_usage_mode" else self.__dict__.get("graph_usage_mode")
        order = value if name == "graph_stream_ordering" else \
            self.__dict__.get("graph_stream_ordering")
        if mode == 2 and order is False:
            raise ArgumentError("Config: graph_stream_ordering=False is not supported with "
                                "graph_usage_mode=2 (graph mixing); NCCL would fall back to "
                                "stream ordering with only a warning; expected "
                                "graph_stream_ordering True or None, or graph_usage_mode 0/1")
        object.__setattr__(self, name, value)

    @staticmethod
    def _check(name: str, value: Any) -> Any:
        if value is None:
            return None
        kind = CONFIG_FIELDS[name][1]
        if name in ("host_cft_mode", "nvls_host_mode"):
            return _named_mode(name, value)
        if name == "cta_policy" and isinstance(value, str):
            return cta_policy_value("Config.cta_policy", value)
        if kind == "str":
            if not isinstance(value, str):
                raise ArgumentTypeError(f"Config.{name}: expected a str or None, got "
                                        f"{type(value).__name__} {value!r}")
            if "\x00" in value:
                raise ArgumentError(f"Config.{name}: {value!r} contains a NUL character")
            return value
        if kind == "bool":      # one rule: Python and NumPy booleans, never 0/1 or "yes"
            if _is_bool(value):
                return bool(value)
            raise ArgumentTypeError(f"Config.{name}: expected True, False or None, got "
                                    f"{type(value).__name__} {value!r}")
        value = as_index(f"Config.{name}", value, "an int or None")
        if not CONFIG_UNDEF_INT < value < 2 ** 31:
            raise ArgumentError(f"Config.{name}: {value} does not fit a C int (INT_MIN is "
                                f"reserved for 'unset': use None)")
        if name in _POSITIVE and value <= 0:
            raise ArgumentError(f"Config.{name}: expected a positive int, got {value}")
        if name in _NON_NEGATIVE and value < 0:
            raise ArgumentError(f"Config.{name}: expected an int >= 0, got {value}")
        if name == "graph_usage_mode" and value not in _GRAPH_USAGE_MODES:
            raise ArgumentError(f"Config.graph_usage_mode: expected 0, 1 or 2, got {value}")
        if name == "cga_cluster_size" and not 0 <= value <= MAX_CGA_CLUSTER_SIZE:
            raise ArgumentError(f"Config.cga_cluster_size: expected 0..{MAX_CGA_CLUSTER_SIZE} "
                                f"(NCCL clamps a larger value to {MAX_CGA_CLUSTER_SIZE} with only "
                                f"a warning), got {value}")
        if name == "traffic_class" and not 0 <= value <= 255:
            raise ArgumentError(f"Config.traffic_class: expected 0..255 (the network's traffic "
                                f"class byte), got {value}")
        if name == "cta_policy" and value not in _CTA_POLICIES.values():
            raise ArgumentError(f"Config.cta_policy: {value} is not a CTA policy; expected 0 "
                                f"(default), 1 (efficiency) or 2 (zero)")
        return value

    @property
    def nonblocking(self) -> bool:
        """``blocking is False`` (the environment's NCCL_COMM_BLOCKING may still override)."""
        return self.blocking is False

    def set_fields(self) -> Dict[str, Any]:
        """The fields given a value (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def check_version(self, nccl_version: int) -> None:
        """VersionError naming the first set field the loaded NCCL does not read."""
        for name, value in self.set_fields().items():
            need = CONFIG_FIELDS[name][2]
            if nccl_version < need:
                raise VersionError(f"Config.{name}={value!r} needs NCCL >= "
                                   f"{format_version(need)}; the loaded NCCL is "
                                   f"{format_version(nccl_version)}")

    def to_struct(self, nccl_version: Optional[int] = None) -> NcclConfigStruct:
        """The ``ncclConfig_t`` for this config (checked against ``nccl_version`` if given).

        Two fields are written even when unset, where NCCL would otherwise refuse the config:
        ``blocking`` is 1 on NCCL 2.14-2.16 (no "unset" there), and ``maxCTAs`` is
        ``max(64, min_ctas)`` (32 before NCCL 2.25) when only ``min_ctas`` is given (NCCL
        checks min <= max before filling its defaults).  The struct keeps the encoded strings
        alive (ctypes stores them in ``_objects``).
        """
        if nccl_version is not None:
            self.check_version(nccl_version)
        s = NcclConfigStruct()
        s.size = struct_size(nccl_version)
        s.magic = CONFIG_MAGIC
        s.version = CONFIG_VERSION
        for name, (cname, kind, _need) in CONFIG_FIELDS.items():
            value = getattr(self, name)
            if kind == "str":
                setattr(s, cname, None if value is None else value.encode())
            else:
                setattr(s, cname, CONFIG_UNDEF_INT if value is None else int(value))
        if self.blocking is None and nccl_version is not None \
                and nccl_version < BLOCKING_UNDEF_FROM:
            s.blocking = 1           # NCCL's default, written out for 2.14-2.16
        if self.min_ctas is not None and self.max_ctas is None:
            fill = (MAX_CTAS_FILL_BEFORE_2_25 if nccl_version is not None
                    and nccl_version < MAX_CTAS_64_FROM else MAX_CTAS_FILL)
            s.maxCTAs = max(fill, self.min_ctas)
        return s


def _named_mode(name: str, value: Any) -> int:
    """``host_cft_mode`` / ``nvls_host_mode``: a name of NCCL's enum or its value."""
    table = HOST_CFT_MODES if name == "host_cft_mode" else NVLS_HOST_MODES
    allowed = set(table.values())
    if name == "nvls_host_mode":
        allowed |= {1 | 2}
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in table:
            raise ArgumentError(f"Config.{name}: {value!r} is not a mode; expected one of "
                                f"{', '.join(table)} or its value")
        return table[key]
    v = as_index(f"Config.{name}", value, "a mode name or int")
    if v not in allowed:
        names = ", ".join(f"{k} ({n})" for k, n in table.items())
        raise ArgumentError(f"Config.{name}: {v} is not a mode; expected one of {names}"
                            + (" or 3 (both component flags)" if name == "nvls_host_mode"
                               else ""))
    return v


#: First NCCL that reads ``NCCL_COMM_BLOCKING`` (with ncclCommInitRankConfig)
COMM_BLOCKING_ENV_FROM = 21400
_STRTOLL0 = re.compile(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
_INT64_MAX = 2 ** 63 - 1


def nccl_env_int(value: Optional[str]) -> Optional[int]:
    """An NCCL integer parameter as NCCL reads it from the environment, None when unset.

    NCCL's loader takes ``strtoll(value, NULL, 0)`` of a non-empty value and falls back to the
    default only on ``errno`` (overflow): so "0x10" is 16, "012" is 10, "7abc" is 7, and a value
    with no digits at all (e.g. "off") is 0.
    """
    if not value:
        return None
    m = _STRTOLL0.match(value)
    if m is None:
        return 0
    sign, digits = m.groups()
    base = 16 if digits[:2] in ("0x", "0X") else 8 if digits.startswith("0") else 10
    v = int(digits, base)
    v = -v if sign == "-" else v
    if not -_INT64_MAX - 1 <= v <= _INT64_MAX:
        return None
    return v


def env_blocking(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """What ``NCCL_COMM_BLOCKING`` forces: True (1), False (0), or None (unset or another
    value, which NCCL ignores)."""
    env = os.environ if environ is None else environ
    v = nccl_env_int(env.get("NCCL_COMM_BLOCKING"))
    return {0: False, 1: True}.get(v) if v is not None else None


def effective_nonblocking(config: Optional[Config], nccl_version: int,
                          environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether NCCL will make the communicator nonblocking, so ncclpy must poll it.

    ``NCCL_COMM_BLOCKING`` overrides the config (NCCL's env override runs after it):
    1 makes every communicator blocking, 0 nonblocking.  A communicator NCCL made blocking but
    ncclpy treats as nonblocking only costs a poll that answers at once (older NCCLs honour
    only the 1), never a misuse; the reverse would fail the next call.
    """
    forced = env_blocking(environ) if nccl_version >= COMM_BLOCKING_ENV_FROM else None
    if forced is not None:
        return not forced
    return config is not None and config.nonblocking


def init_struct(config: Optional[Config], nccl_version: int,
                environ: Optional[Mapping[str, str]] = None) -> Optional[NcclConfigStruct]:
    """The ``ncclConfig_t`` to create a communicator with ``ncclCommInitRankConfig``, or None
    to create it through CuPy's ``ncclCommInitRank``.

    A config always needs the ctypes path; so does a nonblocking mode from the environment
    (NCCL_COMM_BLOCKING=0), whose ncclInProgress CuPy cannot hand back.
    """
    if config is None and not effective_nonblocking(None, nccl_version, environ):
        return None
    return (config or Config()).to_struct(nccl_version)
