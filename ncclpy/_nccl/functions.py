"""ncclpy's ctypes declarations of NCCL's host API: one table, proven against nccl.h.

:data:`FUNCTIONS` maps each NCCL function ncclpy calls through ctypes to its return type,
argument types (C order) and the first NCCL version whose ``nccl.h`` declares it.  The binding
gate (``tests/test_binding_gate.py``) compiles every entry against the installed ``nccl.h`` and
proves the parameter count and, for each parameter and the return type, its size and ABI class;
an entry the gate cannot prove fails CI.  Structs and constants ncclpy writes are listed for
the gate in :mod:`ncclpy._nccl.abi`.
"""
from __future__ import annotations

import ctypes
from typing import Dict, Tuple

__all__ = ["FUNCTIONS", "UniqueId", "WaitSignalDescStruct", "nccl_version_code",
           "COLL_CONFIG_FUNCTIONS", "PARAM_GETTERS", "UNIQUE_ID_BYTES", "NCCL_FUNCTIONS"]

UNIQUE_ID_BYTES = 128


def nccl_version_code(major: int, minor: int, patch: int = 0) -> int:
    """NCCL's ``NCCL_VERSION(X, Y, Z)`` macro (the encoding changed after 2.8)."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed to ncclCommInitRankConfig by value."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]

    @classmethod
    def from_bytes(cls, data: bytes) -> "UniqueId":
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), bytes(data), UNIQUE_ID_BYTES)
        return uid

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), UNIQUE_ID_BYTES)


class WaitSignalDescStruct(ctypes.Structure):
    """``ncclWaitSignalDesc_t`` (2.29): wait for ``opCnt`` signals from ``peer`` on signal
    index ``sigIdx`` of context ``ctx``."""

    _fields_ = [("opCnt", ctypes.c_int), ("peer", ctypes.c_int), ("sigIdx", ctypes.c_int),
                ("ctx", ctypes.c_int)]


_R = ctypes.c_int            # ncclResult_t
_I = ctypes.c_int
_P = ctypes.c_void_p         # pointers, ncclComm_t, cudaStream_t, ncclParamHandle_t
_Z = ctypes.c_size_t
_S = ctypes.c_char_p         # const char*
_PI = ctypes.POINTER(ctypes.c_int)
_PP = ctypes.POINTER(ctypes.c_void_p)
_PS = ctypes.POINTER(ctypes.c_char_p)
_V = nccl_version_code

#: typed parameter getters (2.30.4): kind -> (function, ctypes type of *out)
PARAM_GETTERS: Dict[str, Tuple[str, object]] = {
    "i8": ("ncclParamGetI8", ctypes.c_int8), "i16": ("ncclParamGetI16", ctypes.c_int16),
    "i32": ("ncclParamGetI32", ctypes.c_int32), "i64": ("ncclParamGetI64", ctypes.c_int64),
    "u8": ("ncclParamGetU8", ctypes.c_uint8), "u16": ("ncclParamGetU16", ctypes.c_uint16),
    "u32": ("ncclParamGetU32", ctypes.c_uint32), "u64": ("ncclParamGetU64", ctypes.c_uint64),
}
PARAM_API = _V(2, 30, 4)
COLL_CONFIG_API = _V(2, 31, 0)

#: name -> (restype, argtypes, first NCCL version code that has it)
FUNCTIONS: Dict[str, Tuple[object, Tuple, int]] = {
    "ncclGetVersion": (_R, (_PI,), _V(2, 3, 4)),
    "ncclGetUniqueId": (_R, (ctypes.POINTER(UniqueId),), 0),
    "ncclGetErrorString": (ctypes.c_char_p, (_I,), 0),
    "ncclGetLastError": (ctypes.c_char_p, (_P,), _V(2, 13, 0)),
    "ncclCommInitRankConfig": (_R, (_PP, _I, UniqueId, _I, _P), _V(2, 14, 0)),
    "ncclCommInitRankScalable": (_R, (_PP, _I, _I, _I, _P, _P), _V(2, 23, 0)),
    "ncclCommFinalize": (_R, (_P,), _V(2, 14, 0)),
    "ncclCommDestroy": (_R, (_P,), 0),
    "ncclCommAbort": (_R, (_P,), _V(2, 4, 0)),
    "ncclCommGetAsyncError": (_R, (_P, _PI), _V(2, 4, 0)),
    "ncclCommCount": (_R, (_P, _PI), 0),
    "ncclCommCuDevice": (_R, (_P, _PI), 0),
    "ncclCommUserRank": (_R, (_P, _PI), 0),
    "ncclCommSplit": (_R, (_P, _I, _I, _PP, _P), _V(2, 18, 0)),
    "ncclRedOpCreatePreMulSum": (_R, (_PI, _P, _I, _I, _P), _V(2, 11, 0)),
    "ncclRedOpDestroy": (_R, (_I, _P), _V(2, 11, 0)),
    "ncclCommRegister": (_R, (_P, _P, _Z, _PP), _V(2, 19, 0)),
    "ncclCommDeregister": (_R, (_P, _P), _V(2, 19, 0)),
    "ncclMemAlloc": (_R, (_PP, _Z), _V(2, 19, 0)),
    "ncclMemFree": (_R, (_P,), _V(2, 19, 0)),
    "ncclGroupStart": (_R, (), _V(2, 0, 0)),
    "ncclGroupEnd": (_R, (), _V(2, 0, 0)),
    "ncclGroupSimulateEnd": (_R, (_P,), _V(2, 22, 0)),
    "ncclSetEncryption": (_R, (_P,), _V(2, 32, 0)),
    # symmetric windows, membership, memory (ncclpy.comm.window / membership / memory)
    "ncclCommWindowRegister": (_R, (_P, _P, _Z, _PP, _I), _V(2, 27, 3)),
    "ncclCommWindowDeregister": (_R, (_P, _P), _V(2, 27, 3)),
    "ncclWinGetUserPtr": (_R, (_P, _P, _PP), _V(2, 29, 2)),
    "ncclCommShrink": (_R, (_P, _PI, _I, _PP, _P, _I), _V(2, 27, 3)),
    "ncclCommRevoke": (_R, (_P, _I), _V(2, 28, 7)),
    "ncclCommGetUniqueId": (_R, (_P, ctypes.POINTER(UniqueId)), _V(2, 29, 2)),
    "ncclCommGrow": (_R, (_P, _I, ctypes.POINTER(UniqueId), _I, _PP, _P), _V(2, 29, 2)),
    "ncclCommSuspend": (_R, (_P, _I), _V(2, 29, 7)),
    "ncclCommResume": (_R, (_P,), _V(2, 29, 7)),
    "ncclCommMemStats": (_R, (_P, _I, ctypes.POINTER(ctypes.c_uint64)), _V(2, 29, 7)),
    # one-sided RMA (2.29): (C-order args..., comm, stream)
    "ncclPutSignal": (_R, (_P, _Z, _I, _I, _P, _Z, _I, _I, ctypes.c_uint, _P, _P),
                      _V(2, 29, 2)),
    "ncclSignal": (_R, (_I, _I, _I, ctypes.c_uint, _P, _P), _V(2, 29, 2)),
    # the ncclWaitSignalDesc_t array by address, as every struct pointer here (plans are data)
    "ncclWaitSignal": (_R, (_I, _P, _P, _P), _V(2, 29, 2)),
    # collectives: (C-order args..., comm, stream)
    "ncclAllReduce": (_R, (_P, _P, _Z, _I, _I, _P, _P), 0),
    "ncclReduce": (_R, (_P, _P, _Z, _I, _I, _I, _P, _P), 0),
    "ncclBroadcast": (_R, (_P, _P, _Z, _I, _I, _P, _P), _V(2, 2, 0)),
    "ncclReduceScatter": (_R, (_P, _P, _Z, _I, _I, _P, _P), 0),
    "ncclAllGather": (_R, (_P, _P, _Z, _I, _P, _P), 0),
    "ncclSend": (_R, (_P, _Z, _I, _I, _P, _P), _V(2, 7, 0)),
    "ncclRecv": (_R, (_P, _Z, _I, _I, _P, _P), _V(2, 7, 0)),
    "ncclAlltoAll": (_R, (_P, _P, _Z, _I, _P, _P), _V(2, 28, 0)),
    "ncclGather": (_R, (_P, _P, _Z, _I, _I, _P, _P), _V(2, 28, 0)),
    "ncclScatter": (_R, (_P, _P, _Z, _I, _I, _P, _P), _V(2, 28, 0)),
    # parameter API
    "ncclParamBind": (_R, (_PP, _S), PARAM_API),
    "ncclParamGetStr": (_R, (_P, _PS), PARAM_API),
    "ncclParamGet": (_R, (_P, _P, _I, _PI), PARAM_API),
    "ncclParamGetParameter": (_R, (_S, _PS, _PI), PARAM_API),
    "ncclParamGetAllParameterKeys": (_R, (ctypes.POINTER(_PS), _PI), PARAM_API),
    "ncclParamDumpAll": (None, (), PARAM_API),
}
for _kind, (_name, _ctype) in PARAM_GETTERS.items():
    FUNCTIONS[_name] = (_R, (_P, ctypes.POINTER(_ctype)), PARAM_API)

#: plan function -> its per-collective-config variant: the same C arguments, then comm,
#: stream and ``const ncclCollConfig_t*`` (NCCL 2.31)
COLL_CONFIG_FUNCTIONS: Dict[str, str] = {
    fn: fn + "Config" for fn in ("AllReduce", "Broadcast", "Reduce", "AllGather",
                                 "ReduceScatter", "AlltoAll", "Gather", "Scatter")}
for _fn, _cfn in COLL_CONFIG_FUNCTIONS.items():
    _rt, _args, _ = FUNCTIONS["nccl" + _fn]
    FUNCTIONS["nccl" + _cfn] = (_rt, _args + (_P,), COLL_CONFIG_API)
del _kind, _name, _ctype, _fn, _cfn, _rt, _args


#: NCCL functions a plan may name (without the ``nccl`` prefix) and their arguments' names, in
#: C order up to but excluding ``comm`` and ``stream`` (:class:`ncclpy.plan.types.NcclCall`;
#: the dispatch table is built from it).
NCCL_FUNCTIONS = {
    "AllReduce": ("sendbuff", "recvbuff", "count", "datatype", "op"),
    "Reduce": ("sendbuff", "recvbuff", "count", "datatype", "op", "root"),
    "Broadcast": ("sendbuff", "recvbuff", "count", "datatype", "root"),
    "ReduceScatter": ("sendbuff", "recvbuff", "recvcount", "datatype", "op"),
    "AllGather": ("sendbuff", "recvbuff", "sendcount", "datatype"),
    "AlltoAll": ("sendbuff", "recvbuff", "count", "datatype"),
    "Gather": ("sendbuff", "recvbuff", "count", "datatype", "root"),
    "Scatter": ("sendbuff", "recvbuff", "count", "datatype", "root"),
    "Send": ("sendbuff", "count", "datatype", "peer"),
    "Recv": ("recvbuff", "count", "datatype", "peer"),
    # one-sided RMA (NCCL 2.29; ncclpy.comm.rma)
    "PutSignal": ("localbuff", "count", "datatype", "peer", "peerWin", "peerWinOffset",
                  "sigIdx", "ctx", "flags"),
    "Signal": ("peer", "sigIdx", "ctx", "flags"),
    "WaitSignal": ("nDesc", "signalDescs"),
}
#: each collective's per-call-config variant (NCCL 2.31): the same arguments, then the
#: ``const ncclCollConfig_t*`` (which NCCL takes after comm and stream)
NCCL_FUNCTIONS.update({fn + "Config": NCCL_FUNCTIONS[fn] + ("config",) for fn in (
    "AllReduce", "Reduce", "Broadcast", "ReduceScatter", "AllGather", "AlltoAll", "Gather",
    "Scatter")})
