"""ncclpy: a thin, fast, honest Python layer over NVIDIA NCCL.

``import ncclpy`` needs neither a GPU, CuPy, NCCL nor torch: heavy pieces load on first use.
Every exception ncclpy raises is reachable from here (all derive from :class:`NcclpyError`).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from ._version import __version__

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
    **{n: "ncclpy.semantics.ops"
       for n in ("RedOp", "SUM", "PROD", "MAX", "MIN", "AVG", "premul_sum")},
    # store
    "StoreServer": "ncclpy.store", "StoreLimits": "ncclpy.store", "TCPStore": "ncclpy.store",
    "barrier": "ncclpy.store",
    # rendezvous and launch
    "RendezvousInfo": "ncclpy.rendezvous", "resolve": "ncclpy.rendezvous",
    "Bootstrap": "ncclpy.rendezvous.bootstrap", "bootstrap": "ncclpy.rendezvous.bootstrap",
    "spawn": "ncclpy.launch.spawn",
    # communicator
    "init": "ncclpy.comm", "Communicator": "ncclpy.comm", "Config": "ncclpy.comm",
    "Work": "ncclpy.comm.work", "group": "ncclpy.comm", "CollConfig": "ncclpy.comm",
    "nccl_params": "ncclpy._nccl.params", "nccl_param": "ncclpy._nccl.params",
    "set_encryption": "ncclpy._nccl.encryption",
    "Window": "ncclpy.comm.window", "grow_join": "ncclpy.comm.startup",
    "nccl_empty": "ncclpy._nccl.memory", "nccl_allocator": "ncclpy._nccl.memory",
    "Buffer": "ncclpy.buffers.buffer",
}

# public names that are a module: where users import them -> where the module lives.
# ``import ncclpy.ops`` / ``from ncclpy.watchdog import ...`` / ``ncclpy.bootstrap.bootstrap``
# all reach the one module (no second copy, no shim file).  ``ncclpy.bootstrap`` is also
# callable: calling it calls ``ncclpy.bootstrap.bootstrap``, whether or not ``import
# ncclpy.bootstrap`` ran first.
_MODULES = {
    "bootstrap": "ncclpy.rendezvous.bootstrap",
    "ops": "ncclpy.semantics.ops",
    "dtypes": "ncclpy.semantics.dtypes",
    "registry": "ncclpy.semantics.registry",
    "reference": "ncclpy.semantics.reference",
    "watchdog": "ncclpy.debug.watchdog",
    "checked": "ncclpy.debug.checked",
}


class _ModuleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import ncclpy.<name>`` for the names of :data:`_MODULES`: hands out the module itself
    (its own ``__spec__`` kept), so ``sys.modules`` holds one module under both names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        pkg, _, name = fullname.rpartition(".")
        if pkg != __name__ or name not in _MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(_MODULES[spec.name.rpartition(".")[2]])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # the import system set the alias's spec on the module: give it its own back
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _ModuleAliases) for f in sys.meta_path):
    sys.meta_path.append(_ModuleAliases())

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name) or _MODULES.get(name)
    if mod is None:
        raise AttributeError(f"module 'ncclpy' has no attribute {name!r}")
    module = importlib.import_module(mod)
    if _MODULES.get(name) == mod:       # a public module: one module under both names
        sys.modules.setdefault(f"{__name__}.{name}", module)
        value = module
    else:
        value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))
