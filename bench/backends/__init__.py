"""The Backend interface the sweep drives, and the buffer layout every backend shares.

A backend owns one communicator and the device buffers of one rank.  The sweep calls, per size:
``alloc`` (send/recv buffers out of place, one buffer in place, laid out as NCCL and nccl-tests
lay them out), ``fill`` (this rank's verifiable input, recv zeroed), ``run`` (enqueue one
collective), ``sync`` (wait for the stream), ``output`` (this rank's result on the host).  Graph
capture and event timing are optional.  Host data is always numpy: the dtype's own numpy type, or
its unsigned-int view for bfloat16 and float8 (which numpy lacks).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Optional, Tuple

import numpy as np

from ncclpy.semantics import registry
from ncclpy.semantics.dtypes import DTYPES
from ncclpy.errors import ArgumentError

__all__ = ["Layout", "layout", "Buffers", "Backend", "get_backend", "host_dtype", "BACKEND_MODULES",
           "CPU_BACKEND_MODULES", "OVERHEAD_BACKEND_MODULES"]

#: the sweep's backends (``python -m bench``)
BACKEND_MODULES = {"ncclpy": f"{__name__}.ncclpy:NcclpyBackend",
                   "cupy": f"{__name__}.cupy_raw:CupyBackend",
                   "torch": f"{__name__}.torch_dist:TorchBackend"}
#: the sweep's backends with ``--device cpu``: ncclpy on its CPU backend
#: (``ncclpy.init(device="cpu")``) and torch on gloo; raw CuPy has no CPU form
CPU_BACKEND_MODULES = {"ncclpy": f"{__name__}.ncclpy_cpu:NcclpyCpuBackend",
                       "torch": f"{__name__}.torch_dist:TorchBackend"}
#: ``python -m bench.overhead``'s backends: ncclpy twice (its defaults as ``ncclpy.init`` runs
#: it, and with the watchdog and flight recorder off), the raw floor, torch and nccl4py
OVERHEAD_BACKEND_MODULES = {"ncclpy": f"{__name__}.ncclpy:NcclpyDefaultsBackend",
                            "ncclpy-bare": f"{__name__}.ncclpy:NcclpyBareBackend",
                            "cupy": f"{__name__}.cupy_raw:CupyBackend",
                            "torch": f"{__name__}.torch_dist:TorchBackend",
                            "nccl4py": f"{__name__}.nccl4py:Nccl4pyBackend"}


def host_dtype(name: str) -> np.dtype:
    """numpy dtype holding ``name`` on the host (uint view for bfloat16/float8)."""
    d = DTYPES[name]
    return np.dtype(d.numpy or d.view)


@dataclass(frozen=True)
class Layout:
    """Element counts of one rank for one size, in nccl-tests' conventions.

    ``count`` is the count passed to NCCL (the table's "count" column); ``send``/``recv`` the
    out-of-place buffer lengths; ``whole`` the in-place buffer and ``ip_send``/``ip_recv`` the
    (offset, length) of the send and receive sides inside it (NCCL's in-place rules: all_gather's
    input sits at ``rank*count`` of the output, reduce_scatter's output at ``rank*count`` of the
    input, and likewise gather/scatter).
    """

    total: int
    count: int
    send: int
    recv: int
    whole: int
    ip_send: Tuple[int, int]
    ip_recv: Tuple[int, int]

    def nbytes(self, itemsize: int) -> int:
        """The table's "size" column: max(send, recv) bytes."""
        return max(self.send, self.recv) * itemsize


def layout(collective: str, total: int, world: int, rank: int) -> Layout:
    """:class:`Layout` for ``total`` elements (size / itemsize) on ``rank`` of ``world``."""
    c = registry.get(collective)
    send, recv = c.send_elems(total, world), c.recv_elems(total, world)
    count = c.param_count(total, world)
    whole = max(send, recv)
    ip_send, ip_recv = (0, send), (0, recv)
    if send < recv:        # all_gather, gather: my block of the output is my input
        ip_send = (rank * send, send)
    elif recv < send:      # reduce_scatter, scatter: my block of the input is my output
        ip_recv = (rank * recv, recv)
    return Layout(total, count, send, recv, whole, ip_send, ip_recv)


@dataclass
class Buffers:
    """One rank's buffers for one (collective, size, dtype): backend-native arrays."""

    collective: str
    dtype: str
    layout: Layout
    send: Any
    recv: Any
    whole: Any
    ip_send: Any
    ip_recv: Any
    extra: Dict[str, Any] = field(default_factory=dict)
    #: the allocations behind send, recv and whole (keys of those names): with ``-u N`` each is
    #: N elements longer than its buffer, which starts N elements in; without, the buffer itself
    base: Dict[str, Any] = field(default_factory=dict)

    def pair(self, in_place: bool) -> Tuple[Any, Any]:
        """(send, recv) arrays for one placement."""
        return (self.ip_send, self.ip_recv) if in_place else (self.send, self.recv)


class Backend:
    """Base class: subclasses implement the array primitives and ``run``."""

    name = "base"
    #: shown in headers, e.g. "torch/gloo"
    label = "base"
    #: can capture its iterations into a CUDA graph
    supports_graphs = False
    #: can time with CUDA events
    supports_events = False
    #: what this backend runs with (bench.overhead's labels), e.g. "watchdog off"
    defaults = ""
    #: what its figures are, said in the sweep's header and JSON ("" where it is NCCL's own:
    #: e.g. ncclpy's CPU backend is not NCCL, torch's gloo is not NCCL)
    note = ""
    #: how ``run`` hands the stream to the library once :meth:`use_stream` was called
    stream_form = "its own"

    def __init__(self) -> None:
        self.rank = 0
        self.world = 1
        self.device: Optional[int] = None
        self.store = None

    # ---- life cycle ---------------------------------------------------------------------
    def setup(self, rank: int, world: int, device: Optional[int], store: Any, *,
              master_addr: str = "127.0.0.1", timeout: float = 300.0) -> None:
        """Create the communicator.  ``device`` is a CUDA ordinal or None for CPU; ``store`` is
        the harness's key-value store (rank 0 hosts it), for exchanging ids and ports."""
        self.rank, self.world, self.device, self.store = rank, world, device, store

    def teardown(self) -> None:
        """Destroy the communicator and free buffers."""

    def nccl_version(self) -> int:
        """Version code of the NCCL this backend calls (0 where none, e.g. gloo)."""
        return 0

    def bits_version(self) -> int:
        """The NCCL version whose order the bits column predicts (:meth:`nccl_version`; the
        CPU backend's: the version it models)."""
        return self.nccl_version()

    @property
    def series(self) -> str:
        """The backend, and its combination when it has one (``ncclpy ring/simple``): a
        table's rows, ratios and plot lines are per series."""
        return f"{self.name} {self.combo.label}" if self.combo is not None else self.name

    def device_info(self) -> Dict[str, str]:
        """``device_hex`` (PCI bus id) and ``device_info`` (name) of this rank's device."""
        return {"device_hex": "0000:00:00", "device_info": "cpu"}

    # ---- capabilities -------------------------------------------------------------------
    def unsupported(self, collective: str, dtype: str, op: str) -> Optional[str]:
        """Why this backend cannot run the case, or None."""
        return None

    def checks_in_place(self, collective: str) -> bool:
        """Whether the in-place result is defined (else #wrong is N/A, as nccl-tests does for
        in-place alltoall)."""
        return True

    def output_defined(self, collective: str, rank: int, root: int, in_place: bool) -> bool:
        """Whether this rank's output is specified by the library (the reference's own None
        entries aside); False skips its check."""
        return True

    def group(self) -> Optional[ContextManager[Any]]:
        """A context in which the calls ``run`` issues form one NCCL group (nccl-tests' ``-m``
        aggregation), or None where the library has none (the CLI refuses ``-m`` > 1 then)."""
        return None

    # ---- buffers ------------------------------------------------------------------------
    def empty(self, n: int, dtype: str) -> Any:
        """A zeroed device array of ``n`` elements of host_dtype(dtype)."""
        raise NotImplementedError

    def view(self, arr: Any, offset: int, n: int) -> Any:
        return arr[offset:offset + n]

    def alloc(self, collective: str, total: int, dtype: str) -> Buffers:
        """Zeroed buffers for one size, laid out as :func:`layout` says, the in-place sides
        views of ``whole``.  With ``-u N`` (:attr:`unalign`) each allocation is N elements
        longer and its buffer starts N elements in, as nccl-tests moves ``sendbuffs`` and
        ``recvbuffs`` by ``unalign * wordSize(type)`` for the whole ``TimeTest`` (common.cu;
        ``AllocateBuffs`` pads them by ``8 * unalign`` bytes); the in-place sides sit at their
        in-place offsets inside the moved ``whole``, as nccl-tests' inside its moved recv
        buffer.  ``bufs.base`` keeps the allocations (what ``-R`` registers)."""
        lay = layout(collective, total, self.world, self.rank)
        u = self.unalign
        sizes = {"send": max(lay.send, 0), "recv": max(lay.recv, 0), "whole": max(lay.whole, 0)}
        base = {k: self.empty(n + u, dtype) for k, n in sizes.items()}
        send, recv, whole = ((self.view(base[k], u, n) if u else base[k])
                             for k, n in sizes.items())
        return Buffers(collective, dtype, lay, send, recv, whole,
                       self.view(whole, *lay.ip_send), self.view(whole, *lay.ip_recv),
                       base=base)

    def zero(self, arr: Any) -> None:
        raise NotImplementedError

    def upload(self, arr: Any, host: np.ndarray) -> None:
        """Copy ``host`` (same length) into device ``arr``."""
        raise NotImplementedError

    def download(self, arr: Any) -> np.ndarray:
        """Host copy of device ``arr`` (after the stream is synchronised)."""
        raise NotImplementedError

    def fill(self, bufs: Buffers, host: Optional[np.ndarray], in_place: bool) -> None:
        """Zero the receive side and put ``host`` (this rank's input) on the send side."""
        if in_place:
            self.zero(bufs.whole)
        else:
            self.zero(bufs.recv)
        send, _ = bufs.pair(in_place)
        if host is not None:
            self.upload(send, host)
        self.sync()

    def output(self, bufs: Buffers, in_place: bool) -> np.ndarray:
        self.sync()
        return self.download(bufs.pair(in_place)[1])

    # ---- running ------------------------------------------------------------------------
    #: --algo/--proto: the combination (bench.combos.Combo) this communicator was made with,
    #: and the NCCL_* variables it was made under (what NCCL read at its init)
    combo: Any = None
    nccl_env: Optional[Dict[str, str]] = None
    #: -R: 0 none, 1 ncclCommRegister, 2 symmetric windows; --cta-policy (ncclpy backend)
    register: int = 0
    cta_policy: Optional[str] = None
    #: -u: elements every buffer's start is moved by (nccl-tests' unalign; :meth:`alloc`)
    unalign: int = 0

    def free(self, bufs: Buffers) -> None:
        """Release what ``alloc`` registered for ``bufs`` (before their memory goes)."""

    def mem_stats(self) -> Optional[Dict[str, int]]:
        """-M: NCCL's memory statistics of this rank's communicator (None: cannot tell)."""
        return None

    def predict(self, collective: str, bufs: Buffers, op: str, root: int) -> Optional[float]:
        """NCCL's estimate of the out-of-place call in microseconds (None: cannot tell)."""
        return None

    def run(self, collective: str, bufs: Buffers, op: str, root: int, in_place: bool) -> None:
        """Enqueue one collective (asynchronous where the backend is)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait until everything enqueued has completed."""

    def capture(self, fn: Callable[[], None]) -> Any:
        """Capture what ``fn`` enqueues into a CUDA graph; returns a handle for ``replay``."""
        raise ArgumentError(f"backend {self.label}: CUDA graphs are unsupported here")

    def replay(self, graph: Any) -> None:
        raise NotImplementedError

    def release(self, graph: Any) -> None:
        """Free what a captured graph holds (the caller then drops its last reference).  NCCL's
        communicator destroy waits until every graph that captured its calls is destroyed, so
        a graph kept alive until teardown hangs it (seen on a GPU with all three backends)."""

    def event_timer(self) -> Tuple[Callable[[], None], Callable[[], float]]:
        """(start, stop) where stop() returns seconds between them measured on the stream."""
        raise ArgumentError(f"backend {self.label}: CUDA event timing is unsupported here")

    def event_marks(self, n: int) -> Tuple[Callable[[int], None], Callable[[int, int], float]]:
        """``-I 1``'s marks (bench.periter): ``n`` CUDA events; (record, elapsed) where
        ``record(k)`` records event k on the stream and ``elapsed(j, k)`` waits for event k
        and returns the seconds from event j to event k."""
        raise ArgumentError(f"backend {self.label}: CUDA event timing is unsupported here")

    # ---- one stream and one set of buffers for every backend (bench.overhead) -----------------
    def use_stream(self, stream: Any) -> None:
        """Enqueue every later call on ``stream`` (a CuPy stream the caller owns and shares
        with the other backends), in the form :attr:`stream_form` says."""
        raise ArgumentError(f"backend {self.label}: a shared CUDA stream is unsupported here")

    def adopt(self, bufs: Buffers) -> Buffers:
        """This backend's native :class:`Buffers` over the memory of ``bufs`` (CuPy arrays the
        caller allocated once for every backend): no copy, the same device pointers."""
        raise ArgumentError(f"backend {self.label}: shared buffers are unsupported here")

    def settings(self) -> Dict[str, Any]:
        """What this backend's library actually runs with (reported beside its figures)."""
        return {}


def get_backend(name: str, table: Optional[Dict[str, str]] = None) -> Backend:
    """Instantiate a backend by name from ``table`` (default :data:`BACKEND_MODULES`); its
    module is imported only now."""
    table = BACKEND_MODULES if table is None else table
    try:
        mod, _, cls = table[name].partition(":")
    except KeyError:
        raise ArgumentError(f"backend {name!r} is unknown; expected one of "
                            f"{', '.join(table)}") from None
    return getattr(importlib.import_module(mod), cls)()
