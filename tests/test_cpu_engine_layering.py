"""One engine, and what only the tests may do kept in tests/: the product's CPU engine
(``ncclpy.cpu``, as ``ncclpy.init(device="cpu")`` builds it) has no fault injection and no
GPU-posing mode, only no-op hooks; the tests' layer (tests/nccl_standin.py) fills them on top of
the same engine."""
from __future__ import annotations

import ctypes
import importlib
import inspect
import pkgutil
import time

import numpy as np

import ncclpy.cpu
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator
from ncclpy.cpu.backend import DEVICE_COUNT, MODELLED_VERSION
from ncclpy.cpu.engine import Engine
from ncclpy.cpu.nccl import CpuNccl
from ncclpy.cpu.proc_nccl import ProcNccl
from ncclpy.cpu.runtime import CpuRuntime
from ncclpy.cpu.transport import ProcEngine

from nccl_standin import DevArray, StandIn, StandInCuda, StandInNccl, standin

UID = bytes(range(128))
REMOTE = 6                                   # ncclRemoteError
HOOKS = ("_injected_failure", "_injected_delay", "_injected_async_error")


def _product_engines() -> list:
    """The engines the product builds: ProcEngine as backend.install() makes it, and the base."""
    return [ProcEngine(ndev=DEVICE_COUNT, version=MODELLED_VERSION), Engine()]


def test_the_product_package_has_no_gpu_pose():
    for info in pkgutil.iter_modules(ncclpy.cpu.__path__, "ncclpy.cpu."):
        mod = importlib.import_module(info.name)
        assert not hasattr(mod, "DevArray"), info.name
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and obj.__module__ == info.name:
                assert "__cuda_array_interface__" not in vars(obj), (info.name, name)
    for attr in ("host_buffers", "synchronize"):
        assert not hasattr(CpuRuntime, attr), attr


def test_the_product_engine_has_no_fault_injection_and_no_op_hooks(monkeypatch):
    made = []
    init = CpuNccl.__init__

    def counted(self, eng):
        made.append(type(self))
        init(self, eng)
    monkeypatch.setattr(CpuNccl, "__init__", counted)
    proc, base = _product_engines()
    assert made == [ProcNccl, CpuNccl]                  # each engine's libnccl made once
    assert (type(proc.nccl), type(proc.cuda)) == (ProcNccl, CpuRuntime)
    assert (type(base.nccl), type(base.cuda)) == (CpuNccl, CpuRuntime)
    for eng in (proc, base):
        for attr in ("slow", "fail", "async_fail"):
            assert not hasattr(eng, attr), (type(eng).__name__, attr)
        assert eng.nccl._injected_failure("ncclAllReduce") is None
        assert eng.nccl._injected_delay("ncclAllReduce", None) is None
        assert eng.nccl._injected_async_error(0x1000) is None
    for hook in HOOKS:                                  # no product class fills them
        assert getattr(ProcNccl, hook) is getattr(CpuNccl, hook), hook


def test_the_products_buffers_are_plain_host_arrays():
    for eng in _product_engines():
        z = eng.cuda.zeros_float32(3, 0)
        assert type(z) is np.ndarray and z.dtype == np.float32 and z.tolist() == [0.0] * 3


def test_the_tests_layer_injects_on_top_of_the_same_engine():
    with standin() as eng:
        assert type(eng) is StandIn and isinstance(eng, Engine)
        assert type(eng.nccl) is StandInNccl and isinstance(eng.nccl, CpuNccl)
        assert type(eng.cuda) is StandInCuda and isinstance(eng.cuda, CpuRuntime)
        assert isinstance(eng.cuda.zeros_float32(2, 1), DevArray)
        v = ctypes.c_int(0)
        get_version = eng.nccl.fn("ncclGetVersion")
        eng.fail["ncclGetVersion"] = REMOTE
        assert get_version(ctypes.byref(v)) == REMOTE and v.value == 0    # not run
        assert get_version(ctypes.byref(v)) == 0 and v.value == eng.version   # once only
        eng.slow["ncclGetVersion"] = 0.2
        t0 = time.monotonic()
        assert get_version(ctypes.byref(v)) == 0
        assert time.monotonic() - t0 >= 0.2
        del eng.slow["ncclGetVersion"]
        c = Communicator(1, 0, UID, 0, Config(blocking=True))
        eng.async_fail[c._handle] = REMOTE
        assert eng.nccl.async_error(c._handle) == REMOTE
        del eng.async_fail[c._handle]
        assert eng.nccl.async_error(c._handle) == 0
        c.close()
