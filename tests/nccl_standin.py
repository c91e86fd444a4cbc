"""The CPU engine (ncclpy/cpu, the product's ``ncclpy.init(device="cpu")``) posing as a GPU for
CPU tests of ncclpy's own logic: ``with standin(...)`` installs it in place of libnccl and the
CUDA runtime for the block; :class:`DevArray` is host memory exported as
``__cuda_array_interface__`` (the GPU call path, unchanged); :func:`run_ranks` runs ranks as
threads.  It never makes a GPU test pass: GPU tests stay in tests/gpu and run against the real
library.

What the product must not do lives here, as a layer over the product's engine (one engine: what
users run is what the suite tests): :class:`StandIn` is :class:`ncclpy.cpu.engine.Engine` with
fault injection (``eng.fail``, ``eng.slow``, ``eng.async_fail``, filling
:class:`ncclpy.cpu.nccl.CpuNccl`'s ``_injected_*`` hooks, which are no-ops in the product) and a
runtime posing as a GPU (:class:`StandInCuda`: buffers are :class:`DevArray`, and a per-stream
``synchronize``).
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ncclpy._nccl import cuda as _cuda
from ncclpy._nccl import lib as _lib
from ncclpy.cpu.engine import (_BY_ENUM, _OPS, IN_PROGRESS, INTERNAL, INVALID_ARG,  # noqa: F401
                               INVALID_USAGE, REMOTE, SUCCESS, SYSTEM, UNHANDLED_CUDA, Engine,
                               Graph, _Comm, _Item, _Mem, _Op, _World)
from ncclpy.cpu.nccl import CpuNccl
from ncclpy.cpu.runtime import CpuCudaError, CpuRuntime, _captured  # noqa: F401
from wait_util import wait_until

__all__ = ["StandIn", "standin", "check_violations", "DevArray", "run_ranks", "Graph"]

#: the engine's error as the tests knew it
StandInCudaError = CpuCudaError


# -- the tests' layer over the engine ------------------------------------------------------------
class DevArray:
    """A numpy array posing as device memory: ``__cuda_array_interface__`` v3 with a real host
    address, and ``.device``."""

    def __init__(self, arr: np.ndarray, device: int = 0, stream: Optional[int] = None) -> None:
        self.a = np.ascontiguousarray(arr)
        self.device = device
        self._stream = stream

    @property
    def __cuda_array_interface__(self) -> dict:
        d = {"shape": self.a.shape, "typestr": self.a.dtype.str,
             "data": (self.a.ctypes.data if self.a.size else 0, False), "version": 3,
             "strides": None}
        if self._stream is not None:
            d["stream"] = self._stream
        return d

    @property
    def ptr(self) -> int:
        return self.a.ctypes.data


class StandInNccl(CpuNccl):
    """The engine's libnccl with the tests' fault injection: :class:`StandIn`'s ``fail``,
    ``slow`` and ``async_fail`` fill CpuNccl's hooks."""

    e: "StandIn"

    def _injected_failure(self, name: str) -> Optional[int]:
        """``eng.fail[name]``: the call returns that code once, without running."""
        code = self.e.fail.pop(name, None)
        if code is not None:
            self.last_text = f"stand-in: {name} made to fail".encode()
        return code

    def _injected_delay(self, name: str, c: Optional[_Comm]) -> Optional[int]:
        """``eng.slow[name]``: the call blocks that many seconds before it runs, as one stuck
        inside NCCL would; the communicator's abort flag ends the wait with 3 (RULES.md B8)."""
        slow = self.e.slow.get(name)
        if slow:
            end = time.monotonic() + slow
            while time.monotonic() < end and not (c is not None and c.abort_flag):
                time.sleep(0.005)
            if c is not None and c.abort_flag and name != "ncclCommAbort":
                return INTERNAL
        return None

    def _injected_async_error(self, h: int) -> Optional[int]:
        """``eng.async_fail[h]``: what ncclCommGetAsyncError reports on handle ``h``."""
        return self.e.async_fail.get(h)


class StandInCuda(CpuRuntime):
    """The engine's CUDA runtime posing as a GPU: its arrays are :class:`DevArray` (device
    memory to ncclpy, the GPU call path), and a test may wait for one stream."""

    def device_array(self, arr: np.ndarray, device: int) -> Any:
        return DevArray(arr, device)

    def synchronize(self, stream: int, timeout: float = 10.0) -> None:
        """Wait until everything queued on ``stream`` ran."""
        deadline = time.monotonic() + timeout
        key = self.e.skey(stream)
        while True:
            with self.e.lock:
                self.e.progress()
                if not any(not it.done for it in self.e.streams[key]):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {stream} did not drain")
            time.sleep(0.001)


class StandIn(Engine):
    """The engine as the tests run it: :class:`StandInNccl` and :class:`StandInCuda`, and the
    faults a test injects (each empty unless the test fills it)."""

    nccl_type = StandInNccl
    runtime_type = StandInCuda

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.slow: Dict[str, float] = {}         # NCCL call -> seconds it blocks
        self.fail: Dict[str, int] = {}           # NCCL call -> code it returns (once)
        self.async_fail: Dict[int, int] = {}     # handle -> async error to report


def check_violations(found: Sequence[str], expected: Sequence[str] = ()) -> None:
    """Raise AssertionError unless ``found`` (an engine's ``violations``) is exactly
    ``expected``: one violation per pattern (``re.search``), in any order, and nothing else."""
    left = list(found)
    for pat in expected:
        hit = next((v for v in left if re.search(pat, v)), None)
        if hit is None:
            raise AssertionError(f"the stand-in recorded no violation matching {pat!r}; "
                                 f"it recorded {list(found)}")
        left.remove(hit)
    if left:
        raise AssertionError(f"ncclpy broke NCCL's rules (stand-in violations): {left}")


@contextlib.contextmanager
def standin(expect_violations: Sequence[str] = (), **kw: Any) -> Iterator[StandIn]:
    """The stand-in in place of libnccl and CUDA for the block (see the module docstring).

    A block that ends normally must leave ``eng.violations`` exactly ``expect_violations``
    (patterns, :func:`check_violations`; empty unless a test provokes a violation on
    purpose): the stand-in forgives nothing, so no test can pass while ncclpy breaks a rule."""
    if isinstance(expect_violations, str):
        raise TypeError("expect_violations: a sequence of patterns, not one string")
    eng = StandIn(**kw)
    from ncclpy.comm import work
    from ncclpy.debug.reaper import reaper
    pools = dict(work._pools)
    work._pools.clear()
    try:
        with _lib.use_lib(eng.nccl), _cuda.use(eng.cuda):
            yield eng
        eng.nccl.cdll.raise_pending()      # a stand-in function raised inside a C call
        check_violations(list(eng.violations), expect_violations)
    finally:
        work._pools.clear()
        work._pools.update(pools)
        for q, pend in list(reaper().lanes):   # the block's Works: their events are gone
            q.clear()
            pend.clear()


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
              devices: Optional[List[int]] = None) -> List[Any]:
    """Run ``fn(rank, *args)`` on ``n`` threads (each on its own stand-in device unless
    ``devices`` says otherwise); their return values, re-raising the first exception."""
    eng_cuda = _cuda.cuda()
    out: List[Any] = [None] * n
    errs: List[Optional[BaseException]] = [None] * n

    def body(r: int) -> None:
        try:
            eng_cuda.set_device(devices[r] if devices else r)
            out[r] = fn(r, *args)
        except BaseException as e:  # noqa: B902 - re-raised in the caller
            errs[r] = e
    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank thread did not finish within {timeout} s")
    for e in errs:
        if e is not None:
            raise e
    return out


def inside(eng: StandIn, comm: Any, name: str) -> bool:
    """Whether a thread is inside NCCL's ``name`` on ``comm``'s handle now (the engine's
    record of the calls in progress)."""
    with eng.lock:
        c = eng.comms.get(comm._handle)
        return c is not None and name in c.busy.values()


def wait_inside(eng: StandIn, comm: Any, name: str) -> None:
    """Return once a thread is inside NCCL's ``name`` on ``comm``'s handle: a test's next step
    then happens during that call for certain (a bound on a hang only)."""
    wait_until(lambda: inside(eng, comm, name), f"a thread inside {name}")


def wait_called(eng: StandIn, comm: Any, name: str) -> None:
    """Return once NCCL's ``name`` was called on ``comm``'s handle (a bound on a hang only)."""
    wait_until(lambda: any(n == name and h == comm._handle for n, h, _ in list(eng.calls)),
               f"a call of {name}")
