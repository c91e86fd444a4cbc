"""A native boundary whose CUDA and NCCL calls cost nothing, for timing ncclpy's own Python.

``python -m bench.host_overhead`` times the whole ``comm.all_reduce(...)`` of a real
:class:`ncclpy.Communicator` -- resolver, lifecycle, recorder, Work, tracker, watchdog thread
-- on a CPU.  What it stands on here:

* :class:`NullCuda`, in place of CuPy's CUDA runtime (:func:`ncclpy._nccl.cuda.use`): every
  call the call path makes is a C builtin that does nothing (``cudaEventRecord`` is
  ``operator.is_``), events are numbers, every event is complete, the current stream is
  :data:`STREAM`.  :meth:`NullCuda.counting` wraps each call with a counter instead (a
  separate, untimed pass) so the CUDA calls per call are known.
* :class:`NullNccl`, in place of CuPy's ``NcclCommunicator``: ``allReduce(send, recv, count,
  dtype, op, stream)`` and its siblings are a no-op with raw CuPy's shape.  The floor the
  bench subtracts is the same no-op called the way a raw CuPy user calls it.
* :class:`NullLib`, what the communicator needs of libnccl to be set up (its version, its
  functions for the dispatch table: no-ops returning ncclSuccess).

:func:`make_comm` builds a Communicator over these -- rank 0 of 2 -- with ncclpy's defaults
(flight recorder on, the watchdog thread on with a real in-process store, as ``ncclpy.init``
has rank 0 host it) or with both off.  Nothing here touches a GPU or libnccl.
"""
from __future__ import annotations

import collections
import itertools
import operator
from types import SimpleNamespace
from typing import Any, Callable, Dict, Optional

__all__ = ["NullCuda", "NullNccl", "NullLib", "make_comm", "stop", "counts_per_call", "STREAM",
           "CUDA_CALLS"]

#: the raw stream handle every timed call runs on (and the null runtime's current stream)
STREAM = 0x5EED
#: the CUDA runtime calls of the call path's boundary (ncclpy/_nccl/cuda.py)
CUDA_CALLS = ("get_device", "set_device", "stream_is_capturing", "capture_status",
              "event_create", "event_record", "event_query", "event_destroy", "stream_wait_event",
              "exchange_capture_mode", "memcpy_async", "current_stream")


class NullCuda:
    """``ncclpy._nccl.cuda``'s runtime object with every call a C no-op (see the module
    docstring)."""

    name = "null"

    def __init__(self) -> None:
        self.event_create = itertools.count(1).__next__          # events are numbers
        self.event_record = operator.is_                         # (event, stream) -> nothing
        self.event_query = bool                                  # every event complete
        self.event_destroy = id
        self.stream_wait_event = operator.is_
        self.get_device = int                                    # device 0 is current
        self.set_device = id
        self.stream_is_capturing = callable                      # never: False for ints
        self.capture_status = {}.get                             # never: None (falsy)
        self.exchange_capture_mode = int
        self.current_stream = {0: STREAM}.get
        self.memcpy_async = _nothing                             # (not on the timed path)
        self.counts: Optional[collections.Counter] = None

    def device_count(self) -> int:
        return 8

    def thread_capture_mode_local(self) -> bool:
        return True

    def counting(self, where: Callable[[], bool] = lambda: True) -> collections.Counter:
        """Wrap every boundary call with a counter of the calls made where ``where()`` is
        true (e.g. on the caller's thread); slower: for the untimed counting pass."""
        counts: collections.Counter = collections.Counter()
        for name in CUDA_CALLS:
            f = getattr(self, name)

            def counted(*a: Any, _f: Callable = f, _n: str = name) -> Any:
                if where():
                    counts[_n] += 1
                return _f(*a)
            setattr(self, name, counted)
        self.counts = counts
        return counts


class NullNccl:
    """CuPy's ``NcclCommunicator`` with every collective a no-op of the same shape."""

    comm = 0xC0
    calls = 0

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        pass

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
               root: int, stream: int) -> None:
        pass

    def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        pass

    def reduceScatter(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                      stream: int) -> None:
        pass

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  stream: int) -> None:
        pass

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        pass

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        pass

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class NullLib:
    """What :meth:`ncclpy.Communicator._setup` and the call path read of libnccl."""

    path = "(null: no libnccl)"
    cupy_nccl = SimpleNamespace(NcclError=type("NcclError", (Exception,), {}))

    def __init__(self, version: int = 22809) -> None:
        self.version = version

    def fn(self, name: str) -> Callable[..., int]:
        return _zero

    def check(self, code: int, *a: Any, **k: Any) -> int:
        return code

    def error(self, code: int, name: str, handle: Any = None) -> Exception:
        return RuntimeError(f"{name} failed: {code}")

    def ncclCommAbort(self, handle: int) -> int:
        return 0

    def ncclCommDestroy(self, handle: int) -> int:
        return 0


def _zero(*args: Any) -> int:
    return 0


def _nothing(*args: Any) -> None:
    return None


def make_comm(defaults: bool, store: Any = None) -> Any:
    """A Communicator (rank 0 of 2, device 0) over the null boundary: ``defaults`` True: the
    flight recorder at its default size and the watchdog thread over ``store`` (a TCPStore
    whose server this process hosts); False: neither."""
    from ncclpy.comm import Communicator
    from ncclpy.debug.recorder import DEFAULT_BUFFER, for_comm
    c = Communicator.__new__(Communicator)
    c._setup(NullLib(), 0xC0, NullNccl(), 0, 2, 0, None, 300.0, None, False)
    c.name = "bench"
    if defaults:
        c._recorder = for_comm(c, "bench", DEFAULT_BUFFER, None)
        from ncclpy.debug.watchdog import Watchdog
        c._watchdog = Watchdog(c, store).start()
    return c


def stop(comm: Any) -> None:
    """Stop the communicator's watchdog (the bench ends; no NCCL to close)."""
    wd = getattr(comm, "_watchdog", None)
    if wd is not None:
        comm._watchdog = None
        wd.stop(closed=True)


def counts_per_call(counts: Dict[str, int], calls: int) -> Dict[str, float]:
    """Each boundary call's count per call, leaving out what was never made."""
    return {k: v / calls for k, v in sorted(counts.items()) if v}
