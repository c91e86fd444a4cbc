"""ncclpy: a thin, fast, honest Python layer over NVIDIA NCCL.

``import ncclpy`` needs neither a GPU, CuPy, NCCL nor torch: heavy pieces load on first use.
Every exception ncclpy raises is reachable from here (all derive from :class:`NcclpyError`).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (loaded lazily on first attribute access)
_LAZY = {
    # errors
    **{n: "ncclpy.errors" for n in (
        "NcclpyError", "ArgumentError", "ArgumentTypeError", "UnsupportedError", "VersionError",
        "MissingDependencyError", "RendezvousError", "LaunchError", "ProcessRaisedException",
        "StoreError", "StoreTimeout", "StoreConnectionError", "StoreAuthError",
        "StoreProtocolError", "StoreRequestError", "NcclError", "CallMismatchError",
        "CallCheckTimeout", "CommAbortedError", "NcclTimeoutError", "NcclUnhandledCudaError",
        "NcclSystemError", "NcclInternalError", "NcclInvalidArgument", "NcclInvalidUsage",
        "NcclRemoteError", "NcclInProgress", "EnvironmentMismatchError", "NotLaunchedError",
        "CannotPredict", "PinError")},
    "CudaUnavailableError": "ncclpy.errors",
    # ops and dtypes
    **{n: "ncclpy.ops" for n in ("RedOp", "SUM", "PROD", "MAX", "MIN", "AVG", "premul_sum")},
    # store
    "StoreServer": "ncclpy.store", "StoreLimits": "ncclpy.store", "TCPStore": "ncclpy.store",
    "barrier": "ncclpy.store",
    # rendezvous and launch
    "RendezvousInfo": "ncclpy.rendezvous", "resolve": "ncclpy.rendezvous",
    "Bootstrap": "ncclpy.bootstrap", "bootstrap": "ncclpy.bootstrap",
    "spawn": "ncclpy.launch.spawn",
    # communicator
    "init": "ncclpy.comm", "Communicator": "ncclpy.comm", "Config": "ncclpy.comm",
    "Work": "ncclpy.comm.work", "group": "ncclpy.comm", "CollConfig": "ncclpy.comm",
    "nccl_params": "ncclpy._nccl.params", "nccl_param": "ncclpy._nccl.params",
    "set_encryption": "ncclpy._nccl.encryption",
    "Window": "ncclpy.comm.window", "grow_join": "ncclpy.comm.startup",
    "nccl_empty": "ncclpy._nccl.memory", "nccl_allocator": "ncclpy._nccl.memory",
    "Buffer": "ncclpy.buffers",
}

# public names that are their module itself: ``ncclpy.bootstrap`` is the module (callable: it
# calls ``ncclpy.bootstrap.bootstrap``), so ``ncclpy.bootstrap.bootstrap`` and
# ``ncclpy.bootstrap(...)`` both work, whether or not ``import ncclpy.bootstrap`` ran first
_MODULES = frozenset({"bootstrap"})

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ncclpy' has no attribute {name!r}")
    module = importlib.import_module(mod)
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
