"""What the binding gate proves against nccl.h: every struct and constant ncclpy writes.

The functions are :data:`ncclpy._nccl.functions.FUNCTIONS`; this module lists the rest.  The
gate (``tests/test_binding_gate.py``) compiles a program against the installed ``nccl.h`` and
checks, for each entry of :data:`STRUCTS`, ``sizeof`` and every field's offset and size, and the
bytes of NCCL's initializer macro against the struct ncclpy writes by default (the fields ncclpy
writes differently on purpose are named: the versioned ``size`` and ``version``); for each entry
of :data:`CONSTANTS`, that the C expression equals ncclpy's value.  A ``ctypes.Structure`` in
:mod:`ncclpy._nccl` missing here fails the gate.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

from ..semantics.dtypes import C_NAMES, DTYPES
from ..errors import NCCL_RESULT_NAMES
from ..semantics.ops import NCCL_OPS
from . import collconfig, config, encryption, flags, group, lib
from .functions import UNIQUE_ID_BYTES, UniqueId, WaitSignalDescStruct

__all__ = ["StructEntry", "STRUCTS", "CONSTANTS"]


class StructEntry(NamedTuple):
    """One struct: its ctypes class, NCCL's initializer macro (None: none), how ncclpy makes
    its default instance, and the fields it writes differently from the macro on purpose."""

    ctype: type
    initializer: Optional[str]
    ours: Optional[Callable[[], object]]
    differs: Tuple[str, ...] = ()


STRUCTS: Dict[str, StructEntry] = {
    "ncclConfig_t": StructEntry(config.NcclConfigStruct, "NCCL_CONFIG_INITIALIZER",
                                lambda: config.Config().to_struct(), ("size", "version")),
    "ncclCollConfig_t": StructEntry(collconfig.CollConfigStruct, "NCCL_COLLCONFIG_INITIALIZER",
                                    lambda: collconfig.CollConfig().to_struct(),
                                    ("size", "version")),
    "ncclSimInfo_t": StructEntry(group.SimInfoStruct, "NCCL_SIM_INFO_INITIALIZER",
                                 group.sim_info, ("size", "version")),
    "ncclEncryptionConfig_t": StructEntry(encryption.EncryptionConfigStruct,
                                          "NCCL_ENCRYPTION_CONFIG_INITIALIZER",
                                          lambda: encryption.encryption_struct(None),
                                          ("size", "version")),
    "ncclUniqueId": StructEntry(UniqueId, None, None),
    "ncclWaitSignalDesc_t": StructEntry(WaitSignalDescStruct, None, None),
}

_NAMED_RESULTS = {name: code for code, name in NCCL_RESULT_NAMES.items()}

#: C expression -> the value ncclpy writes or compares with
CONSTANTS: Dict[str, int] = {
    "NCCL_API_MAGIC": config.CONFIG_MAGIC,
    "NCCL_CONFIG_UNDEF_INT": config.CONFIG_UNDEF_INT,
    "NCCL_SPLIT_NOCOLOR": lib.NCCL_SPLIT_NOCOLOR,
    "NCCL_UNIQUE_ID_BYTES": UNIQUE_ID_BYTES,
    "ncclScalarHostImmediate": lib.SCALAR_HOST_IMMEDIATE,
    "NCCL_CTA_POLICY_DEFAULT": config.CTA_POLICY_DEFAULT,
    "NCCL_CTA_POLICY_EFFICIENCY": config.CTA_POLICY_EFFICIENCY,
    "NCCL_CTA_POLICY_ZERO": config.CTA_POLICY_ZERO,
    "ncclHostCftEnable": config.HOST_CFT_MODES["enable"],
    "ncclHostCftDisable": config.HOST_CFT_MODES["disable"],
    "ncclHostCftFallback": config.HOST_CFT_MODES["fallback"],
    "ncclHostCftDefault": config.CONFIG_UNDEF_INT,
    "ncclNvlsHostModeDefault": config.CONFIG_UNDEF_INT,
    "ncclNvlsHostModeEnable": config.NVLS_HOST_MODES["enable"],
    "ncclNvlsHostModeDisableTransport": config.NVLS_HOST_MODES["disable_transport"],
    "ncclNvlsHostModeDisableSymmetricMultimem":
        config.NVLS_HOST_MODES["disable_symmetric_multimem"],
    "ncclNvlsHostModeDisable": config.NVLS_HOST_MODES["disable"],
    "NCCL_ENCRYPTION_MODE_NONE": encryption.ENCRYPTION_MODE_NONE,
    "NCCL_ENCRYPTION_MODE_PSK": encryption.ENCRYPTION_MODE_PSK,
    "NCCL_WIN_DEFAULT": flags.WIN_DEFAULT,
    "NCCL_WIN_COLL_SYMMETRIC": flags.WIN_COLL_SYMMETRIC,
    "NCCL_WIN_STRICT_ORDERING": flags.WIN_STRICT_ORDERING,
    "NCCL_WIN_GIN_ONLY": flags.WIN_GIN_ONLY,
    "NCCL_WIN_REQUIRED_ALIGNMENT": flags.WIN_REQUIRED_ALIGNMENT,
    "NCCL_SHRINK_DEFAULT": flags.SHRINK_DEFAULT,
    "NCCL_SHRINK_ABORT": flags.SHRINK_ABORT,
    "NCCL_REVOKE_DEFAULT": flags.REVOKE_DEFAULT,
    "NCCL_SUSPEND_MEM": flags.SUSPEND_MEM,
    "ncclStatGpuMemSuspend": flags.MEM_STATS["suspendable_bytes"],
    "ncclStatGpuMemSuspended": flags.MEM_STATS["suspended"],
    "ncclStatGpuMemPersist": flags.MEM_STATS["persistent_bytes"],
    "ncclStatGpuMemTotal": flags.MEM_STATS["total_bytes"],
    "ncclNumResults": max(NCCL_RESULT_NAMES) + 1,
    "ncclNumOps": len(NCCL_OPS),
    "ncclNumTypes": len(DTYPES),
    **_NAMED_RESULTS,
    **{f"nccl{name.capitalize()}": code for name, code in NCCL_OPS.items()},
    **{C_NAMES[name]: d.nccl for name, d in DTYPES.items()},
}
