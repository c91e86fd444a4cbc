"""The CPU engine: NCCL's semantics on host memory, for ``ncclpy.init(device="cpu")`` and for the
CPU tests of ncclpy's own logic (one engine: what users run is what the suite tests).

It replaces the two objects at ncclpy's native boundary: the libnccl binding
(:class:`ncclpy.cpu.nccl.CpuNccl`, entered through C function pointers bound with ncclpy's own
ctypes declarations: :mod:`ncclpy.cpu.abi`) and the CUDA runtime
(:class:`ncclpy.cpu.runtime.CpuRuntime`).  "Device memory" is host memory at real addresses;
streams are ordered queues; events complete when what was queued before them has run.  A
collective runs when every rank's call has reached the head of its stream; a reduction folds in
NCCL's order for the configuration its communicator runs (:mod:`ncclpy.cpu.folds`,
:mod:`ncclpy.cpu.algo`), the rest moves bytes.  Ranks in one process are threads (the tests);
ranks in several processes meet through :mod:`ncclpy.cpu.transport` (shared memory), which
overrides :meth:`Engine._advance`.  The engine's state and streams are
:class:`ncclpy.cpu.core.EngineCore`, below everything that uses it; the result codes are
:mod:`ncclpy.cpu.codes` (both re-exported here, where they always were).

Each behaviour NCCL defines (refusals, ncclInProgress, collective or local, synchronous or not,
what abort frees) cites the NCCL source it models in ncclpy/cpu/RULES.md.  It records every
call (``calls``) and every violation of NCCL's rules that ncclpy must never commit
(``violations``, each also logged): a call on a freed or aborted handle, a second
``ncclCommAbort``, a finalize or destroy after an abort, two threads inside NCCL on one
communicator, an ``ncclCommAbort`` while another thread is inside a call, ranks that disagree on
a collective (function, datatype, count, root, op), buffers that overlap other than in place, a
PreMulSum op destroyed, of another communicator or of another datatype (RULES.md E5, E8, E9,
P6, P7).

It cannot fail or slow a call on purpose and never poses as a GPU: the tests' fault injection
(a call made slow or failing, an async error) and their GPU-posing runtime (buffers exporting
``__cuda_array_interface__``) are a layer over it in tests/ (tests/nccl_standin.py), which
subclasses :class:`Engine` (``nccl_type``, ``runtime_type``) and fills the hooks that are no-ops
here (CpuNccl's ``_injected_failure``, ``_injected_delay``, ``_injected_async_error``;
CpuRuntime's ``device_array``).

It is not NCCL: no GPU, no NCCL kernels, no performance claim.
"""
from __future__ import annotations

from .codes import (_BY_ENUM, _OPS, IN_PROGRESS, INTERNAL, INVALID_ARG, INVALID_USAGE, REMOTE,
                    SUCCESS, SYSTEM, UNHANDLED_CUDA)
from .core import EngineCore, Graph, _Comm, _Item, _Mem, _Op, _World
from .nccl import CpuNccl
from .runtime import CpuRuntime

__all__ = ["Engine", "EngineCore", "Graph", "SUCCESS", "UNHANDLED_CUDA", "SYSTEM", "INTERNAL",
           "INVALID_ARG", "INVALID_USAGE", "REMOTE", "IN_PROGRESS", "_BY_ENUM", "_OPS", "_Comm",
           "_Item", "_Mem", "_Op", "_World"]


class Engine(EngineCore):
    """The engine: :class:`~ncclpy.cpu.core.EngineCore` with ncclpy's libnccl
    (:class:`ncclpy.cpu.nccl.CpuNccl`) and CUDA runtime (:class:`ncclpy.cpu.runtime.CpuRuntime`);
    a subclass names its own ``nccl_type`` / ``runtime_type``."""

    nccl_type = CpuNccl
    runtime_type = CpuRuntime
