"""Creating communicators and their dispatch tables (used by :mod:`ncclpy.comm`).

The dispatch table maps each NCCL function a plan may name (``AllReduce``, ..., ``GroupEnd``) to
a callable ``(*args, stream)`` built once per communicator: CuPy's bound method where CuPy wraps
the call and created the communicator, otherwise the ctypes function of the same libnccl with the
raw ``ncclComm_t``.  Both raise ncclpy's NcclError subclass with ``ncclGetLastError``'s text,
including for the codes CuPy cannot represent (ncclInProgress, ncclTimeout: CuPy 14 raises a
bare ``KeyError(7)`` / ``KeyError(8)`` for them), and both wait for a nonblocking communicator
whose call returned ncclInProgress.  Group start/end always go through ctypes.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import ArgumentError, ArgumentTypeError, VersionError, as_int
from .functions import NCCL_FUNCTIONS
from .cuda import cuda, cupy_stream_for
from .lib import NCCL_IN_PROGRESS, CudaUnavailableError

__all__ = ["CUPY_METHODS", "CUPY_UNREPRESENTABLE", "build_dispatch", "lib_group", "int_arg",
           "uid_bytes", "uid_list", "require_device", "cupy_init", "cupy_stream_for", "cupy_status",
           "call_cupy"]

#: NCCL function (plan name) -> CuPy NcclCommunicator method with the same C-order arguments
CUPY_METHODS = {"AllReduce": "allReduce", "Reduce": "reduce", "Broadcast": "broadcast",
                "ReduceScatter": "reduceScatter", "AllGather": "allGather", "Send": "send",
                "Recv": "recv"}


def _depth() -> int:
    from .group import group_state
    return group_state().depth


def _ctypes_call(comm: Any, lib: Any, handle: int, name: str) -> Callable[..., None]:
    try:
        f = lib.fn(name)
    except VersionError as e:
        msg = str(e)

        def unavailable(*args: Any, stream: int) -> None:
            raise VersionError(msg)
        return unavailable
    if name.endswith("Config"):     # nccl<Coll>Config(..., comm, stream, config)
        return _config_call(comm, lib, handle, name, f)

    def call(*args: Any, stream: int) -> None:
        code = f(*args, handle, stream)
        if code:
            if code != NCCL_IN_PROGRESS:
                raise lib.error(code, name, handle)
            if _depth() == 0:          # nonblocking communicator: wait before the next call
                comm._wait_ready(name)
    return call


def _config_call(comm: Any, lib: Any, handle: int, name: str,
                 f: Callable[..., int]) -> Callable[..., None]:
    """A per-collective-config call: the plan's last argument (the ``ncclCollConfig_t``
    address) goes after comm and stream, where NCCL takes it."""
    def call(*args: Any, stream: int) -> None:
        code = f(*args[:-1], handle, stream, args[-1])
        if code:
            if code != NCCL_IN_PROGRESS:
                raise lib.error(code, name, handle)
            if _depth() == 0:
                comm._wait_ready(name)
    return call


#: ncclResult_t codes CuPy 14 cannot put in its NcclError: its message table stops at 6, so
#: ``NcclError(7)`` (ncclInProgress) and ``NcclError(8)`` (ncclTimeout) raise ``KeyError(code)``
CUPY_UNREPRESENTABLE = (7, 8)


def cupy_status(exc: BaseException, lib: Any) -> Optional[int]:
    """The ncclResult_t a CuPy NCCL call failed with, or None if ``exc`` is not such a failure.

    CuPy raises its NcclError for codes 1-6 and, for 7 and 8, the KeyError its NcclError
    constructor raises on the missing message (a bare ``KeyError(7)``).
    """
    if isinstance(exc, lib.cupy_nccl.NcclError):
        return int(exc.status)
    if type(exc) is KeyError and len(exc.args) == 1 and exc.args[0] in CUPY_UNREPRESENTABLE:
        return int(exc.args[0])
    return None


def call_cupy(lib: Any, name: str, handle: Optional[int], fn: Callable[..., Any],
              *args: Any) -> Tuple[int, Any]:
    """``fn(*args)`` (a CuPy NCCL call) -> (0, result), or (ncclInProgress, None); any other
    NCCL failure raises ncclpy's NcclError subclass for it (codes 7/8 included)."""
    try:
        return 0, fn(*args)
    except (KeyError, lib.cupy_nccl.NcclError) as e:
        code = cupy_status(e, lib)
        if code is None:
            raise
        if code == NCCL_IN_PROGRESS:
            return code, None
        raise lib.error(code, name, handle) from None


def _cupy_call(comm: Any, lib: Any, handle: int, method: Any, name: str) -> Callable[..., None]:
    def call(*args: Any, stream: int) -> None:
        try:
            method(*args, stream)
        except (KeyError, lib.cupy_nccl.NcclError) as e:
            code = cupy_status(e, lib)
            if code is None:
                raise
            if code != NCCL_IN_PROGRESS:
                raise lib.error(code, name, handle) from None
            if _depth() == 0:          # nonblocking communicator: wait before the next call
                comm._wait_ready(name)
    return call


def lib_group(lib: Any, name: str) -> Callable[[], int]:
    """ncclGroupStart/ncclGroupEnd through ctypes: returns 0 or ncclInProgress, raises else."""
    f = lib.fn(name)

    def call() -> int:
        return lib.check(f(), name, None, in_progress_ok=True)
    return call


def build_dispatch(comm: Any, lib: Any, handle: int, nc: Any) -> Dict[str, Callable]:
    """The table for one communicator (``nc``: CuPy's NcclCommunicator or None)."""
    table: Dict[str, Callable] = {}
    for fn in NCCL_FUNCTIONS:
        if nc is not None and fn in CUPY_METHODS:
            table[fn] = _cupy_call(comm, lib, handle, getattr(nc, CUPY_METHODS[fn]), "nccl" + fn)
        else:
            table[fn] = _ctypes_call(comm, lib, handle, "nccl" + fn)
    # Group calls always go through ctypes (the same libnccl, so the same thread-local group
    # state as CuPy's): a group may hold a nonblocking communicator's calls, and then
    # ncclGroupEnd returns ncclInProgress, which CuPy cannot represent.
    table["GroupStart"] = lib_group(lib, "ncclGroupStart")
    table["GroupEnd"] = lib_group(lib, "ncclGroupEnd")
    return table


# -- creation helpers ---------------------------------------------------------------------

def int_arg(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (ArgumentTypeError / ArgumentError otherwise)."""
    return as_int(name, value, minimum)


def uid_list(uid: Any) -> List[bytes]:
    """One uid (bytes, CuPy's forms), or several for ncclCommInitRankScalable: a list or
    tuple of 128-byte ids (the same ids in the same order on every rank)."""
    if isinstance(uid, (list, tuple)) and uid and all(
            isinstance(u, (bytes, bytearray, memoryview)) for u in uid):
        return [uid_bytes(u) for u in uid]
    return [uid_bytes(uid)]


def uid_bytes(uid: Any) -> bytes:
    """The 128-byte uid from bytes (CuPy >= 14) or a tuple of C chars (CuPy <= 13)."""
    if isinstance(uid, (bytes, bytearray, memoryview)):
        b = bytes(uid)
    elif isinstance(uid, (tuple, list)):
        try:
            b = bytes((int(x) + 256) % 256 for x in uid)
        except (TypeError, ValueError):
            raise ArgumentTypeError("uid: a tuple uid must hold ints (CuPy <= 13 form)") from None
    else:
        raise ArgumentTypeError(f"uid: expected the 128-byte NCCL unique id (bytes, or CuPy<=13's "
                                f"tuple of ints), got {type(uid).__name__}")
    if len(b) != 128:
        raise ArgumentError(f"uid: expected 128 bytes (ncclUniqueId), got {len(b)}")
    return b


def require_device(device: int) -> None:
    """Clear errors before NCCL sees a device that cannot work."""
    try:
        n = cuda().device_count()
    except Exception as e:
        raise CudaUnavailableError(
            f"Communicator(device={device}): no usable CUDA device ({type(e).__name__}: {e}); "
            f"NCCL communicators need an NVIDIA GPU with a working driver") from None
    if device >= n:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ArgumentError(f"device: {device} is out of range; {n} CUDA device(s) visible"
                            + (f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""))


def cupy_init(cnccl: Any, world_size: int, uid: bytes, rank: int) -> Any:
    """``NcclCommunicator(ndev, uid, rank)``: bytes on CuPy >= 14, a tuple of C chars before."""
    try:
        return cnccl.NcclCommunicator(world_size, uid, rank)
    except TypeError:
        signed = tuple(b - 256 if b > 127 else b for b in uid)
        return cnccl.NcclCommunicator(world_size, signed, rank)
