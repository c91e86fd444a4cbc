"""``Work``: the handle every communicator call returns, built on a pooled CUDA event.

The event is recorded on the call's stream right after the NCCL work was enqueued (for calls
made inside ``group()``: right after the outermost group end).  ``wait()`` blocks the host on
it, ``wait(stream)`` makes another stream wait for it (no host block), ``is_completed()`` queries
it.  The call's scratch memory and buffers stay referenced until the GPU ran the call, whether
or not the Work is kept: a Work dropped before completion hands them, with its event, to a list
that later calls sweep (:func:`sweep_dropped`), so an allocator cannot reuse memory NCCL still
uses.  For nonblocking communicators (and on every host wait) a Work also checks
``ncclCommGetAsyncError``.

Cheap: events are not created per call.  Each device has a pool of ``cudaEventDisableTiming``
events; a Work takes one when it records and gives it back once completion has been seen (a
host wait, ``is_completed()`` True, the watchdog, or the sweep of dropped Works).
Re-recording an event later is safe: whatever already waited on it (``wait(stream)``) captured
its state at that moment.  A call recorded while its stream is capturing a CUDA graph gets an
event of its own instead, destroyed with the Work: a plain record on a capturing stream is no
node of the graph and marks no replay, so such a Work refuses ``wait()`` and
``is_completed()`` with a precise error (``wait(other_stream)`` inside the capture is a graph
edge).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Dict, List, Optional

from .._nccl.cuda import CAPTURE_MODE_RELAXED, cuda
from ..errors import NcclpyError, NcclTimeoutError

__all__ = ["Work", "EventPool", "event_pool", "sweep_dropped"]

log = logging.getLogger(__name__)

_POOL_MAX = 256             # free events kept per device; more are destroyed


class EventPool:
    """Free ``cudaEventDisableTiming`` events of one device (raw ``cudaEvent_t`` ints)."""

    __slots__ = ("device", "_free", "created")

    def __init__(self, device: int) -> None:
        self.device = device
        self._free: List[int] = []
        self.created = 0

    def take(self, cu: Any) -> int:
        """A free event (a new one when none is free); the device must be current."""
        try:
            return self._free.pop()
        except IndexError:
            self.created += 1
            return cu.event_create()

    def give(self, ev: int) -> None:
        """Hand ``ev`` back (destroyed when the pool is full)."""
        if len(self._free) < _POOL_MAX:
            self._free.append(ev)
        else:
            _destroy(ev)

    def __len__(self) -> int:
        return len(self._free)


_pools: Dict[int, EventPool] = {}
_release_lock = threading.Lock()


def event_pool(device: int) -> EventPool:
    """The event pool of ``device`` (one per process and device)."""
    p = _pools.get(device)
    if p is None:
        p = _pools.setdefault(device, EventPool(device))
    return p


def _destroy(ev: int) -> None:
    try:
        cuda().event_destroy(ev)
    except Exception:  # pragma: no cover - context gone at interpreter exit
        pass


#: Works dropped before anyone saw them complete: (device, event, what they kept alive).  The
#: buffers and scratch a call uses stay referenced until the GPU is done with them, whether or
#: not the caller keeps its Work (torch's caching allocator and CuPy's pool would otherwise
#: hand the memory out again while NCCL still reads or writes it); the event goes back to the
#: pool only then.  Swept, oldest first, whenever a call records its event.
_dropped: "collections.deque[tuple]" = collections.deque()


def sweep_dropped(cu: Any = None, limit: int = 8) -> int:
    """Release what completed among the dropped Works (at most ``limit`` of them, oldest
    first, stopping at the first still running); returns how many are left.

    Its event queries run in the ``Relaxed`` stream-capture mode of the thread: another thread
    (or this one, on another stream) may be capturing a CUDA graph in the global mode
    (torch.cuda.graph's default), where a query from a thread in the global mode is prohibited
    and invalidates that capture.  A query that fails anyway proves nothing about the call:
    its buffers stay kept, and the sweep stops until a later one."""
    cu = cu or cuda()
    d = _dropped
    if not d:
        return 0
    prev = cu.exchange_capture_mode(CAPTURE_MODE_RELAXED)
    try:
        for _ in range(limit):
            try:
                dev, ev, keep = d[0]
            except IndexError:
                return 0
            try:
                done = cu.event_query(ev)
            except Exception as e:   # never "done": the GPU may still use the buffers
                log.debug("sweep_dropped: event query failed (%s); kept for later", e)
                d.rotate(-1)         # to the back: one bad entry never holds up the others
                break
            if not done:
                break
            try:
                d.popleft()
            except IndexError:       # pragma: no cover - swept by another thread
                return 0
            rec = keep[1]                                    # its flight-recorder entry
            if rec is not None and rec[6] == "issued":     # [5] t_done, [6] state (recorder.py)
                rec[5], rec[6] = time.time(), "completed"
            event_pool(dev).give(ev)
        return len(d)
    finally:
        if prev is not None:
            cu.exchange_capture_mode(prev)


class Work:
    """Completion handle of one communicator call, returned as soon as it is enqueued.

    ``wait()`` blocks the host (bounded by the communicator's timeout: NcclTimeoutError, or
    the watchdog's CommAbortedError); ``wait(stream)`` orders ``stream`` after the call
    (``cudaStreamWaitEvent``, no host block); ``is_completed()`` never blocks.  It keeps the
    call's buffers and scratch alive until completion is seen.  A call made inside
    ``group()`` is recorded at the outermost group end (wait after the block).  A call made
    while its stream captures a CUDA graph gets an event of its own, recorded into the graph:
    it marks no replay, so do not host-wait on that Work (synchronize the stream after
    launching the graph); ``wait(other_stream)`` within the same capture is a graph edge.
    """

    __slots__ = ("_comm", "_device", "_stream", "_event", "_owned", "_done", "_keep", "_error",
                 "plan", "_rec", "__weakref__")

    def __init__(self, comm: Any, device: int, stream: int, plan: Any = None,
                 keep: Any = ()) -> None:
        self._comm = comm
        self._device = device
        self._stream = stream
        self._event: Optional[int] = None
        self._owned = False     # True: the event is this Work's own (recorded in a capture)
        self._done = False      # completion seen: the event went back to the pool
        self._keep = keep
        self._error: Optional[BaseException] = None
        self.plan = plan
        self._rec: Optional[list] = None   # its flight-recorder entry (ncclpy.debug.recorder)

    # -- set up by the executor ---------------------------------------------------------
    def _record(self) -> None:
        """Take an event (pooled, or its own while the stream captures) and record it on the
        call's stream, with the call's device current."""
        cu = cuda()
        dev, stream = self._device, self._stream
        prev = cu.get_device()
        if prev != dev:
            cu.set_device(dev)
        try:
            try:
                capturing = cu.stream_is_capturing(stream)
            except Exception:  # an invalidated capture, or the legacy stream during one
                capturing = True
            if capturing:
                ev = cu.event_create()
                comm = self._comm
                if comm is not None:      # close() says so if finalize then waits on graphs
                    comm._captured_calls = getattr(comm, "_captured_calls", 0) + 1
            else:
                if _dropped:
                    sweep_dropped(cu)
                ev = event_pool(dev).take(cu)
            try:
                cu.event_record(ev, stream)
            except BaseException:
                if capturing:
                    _destroy(ev)
                else:
                    event_pool(dev).give(ev)
                raise
        finally:
            if prev != dev:
                cu.set_device(prev)
        self._owned = capturing
        self._event = ev

    def _settle(self, err: Optional[BaseException]) -> None:
        """At the outermost group end: record, or fail with the group's error."""
        if err is None:
            self._record()
        else:
            self._fail(err)

    def _adopt(self, other: "Work") -> None:
        """Take over ``other``'s recorded event (checked mode: the call was issued, deferred,
        as ``other`` at the group end); ``other`` is left empty."""
        if other._error is not None:
            self._fail(other._error)
            return
        with _release_lock:
            self._event, self._owned, self._done = other._event, other._owned, other._done
            self._keep = (self._keep, other._keep)
            other._event, other._keep, other._done = None, (), True

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._keep = ()
        e = self._rec
        if e is not None and e[6] == "issued":         # [5] t_done, [6] state, [7] error
            e[7], e[5], e[6] = f"{type(err).__name__}: {err}", time.time(), "failed"

    def _completed(self) -> None:
        """Completion seen: drop what was kept alive and give the pooled event back (once)."""
        self._keep = ()
        with _release_lock:
            first = not self._done
            self._done = True
            ev, owned = self._event, self._owned
        # after _done is set: a recorder entry attached meanwhile (execute._recorded sets
        # _rec, then reads _done) is stamped here or there, never missed
        e = self._rec
        if e is not None and e[6] == "issued":     # stamped in the flight recorder
            e[5], e[6] = time.time(), "completed"
        if not first:
            return
        if ev is not None and not owned:
            event_pool(self._device).give(ev)

    def __del__(self) -> None:
        ev = self._event
        if ev is None:
            return
        try:
            if self._owned:           # recorded in a capture: never pooled, never reused
                _destroy(ev)
            elif not self._done:      # dropped before anyone saw completion: keep its
                self._done = True     # buffers (and event) until the GPU is done with them
                _dropped.append((self._device, ev, (self._keep, self._rec)))
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # -- public -------------------------------------------------------------------------
    @property
    def stream(self) -> int:
        """The raw ``cudaStream_t`` the call was enqueued on."""
        return self._stream

    @property
    def event(self) -> Optional[int]:
        """The raw ``cudaEvent_t`` recorded after the call (None while the enclosing group is
        still open, and once completion has been seen: the event is then reused)."""
        return None if self._done else self._event

    def _ready_event(self) -> Optional[int]:
        """The event to wait on; None when completion was already seen."""
        if self._error is not None:
            raise self._error
        if self._done:
            return None
        if self._event is None:
            raise NcclpyError("this Work comes from a call made inside group(): its NCCL work "
                              "is launched when the outermost group ends; wait after the "
                              "'with group()' block")
        return self._event

    def wait(self, stream: Any = None, *, timeout: Optional[float] = None) -> None:
        """Host-block until done (``stream`` None), or make ``stream`` wait (no host block).

        The host wait is bounded: ``timeout`` seconds, default the communicator's timeout
        (``timeout=`` / ``$NCCLPY_TIMEOUT``); past it, NcclTimeoutError names the call.  It
        polls (a work already complete returns after one query), checking the communicator's
        async error and the watchdog's verdict, so a failed peer or an abort surfaces as an
        error instead of a hang.
        """
        if stream is None and self._owned:
            raise self._captured_error("wait()")
        ev = self._ready_event()
        if stream is not None:
            if ev is not None:     # done already: any stream is ordered after it
                from .streams import as_stream_handle
                cuda().stream_wait_event(as_stream_handle(stream), ev)
            return
        if ev is not None:
            if not self._query(ev):
                self._poll(ev, timeout)
            self._completed()
        self._check_comm()

    def _poll(self, ev: int, timeout: Optional[float]) -> None:
        comm = self._comm
        if timeout is None and comm is not None:
            timeout = getattr(comm, "_timeout", None)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        grace = getattr(comm, "_watchdog", None) is not None and timeout is not None
        while not self._query(ev):
            self._check_comm()
            if deadline is not None and time.monotonic() > deadline:
                if grace:       # the watchdog's verdict (it names the suspects) comes first
                    grace, deadline = False, deadline + 2.0
                    continue
                name = getattr(self.plan, "collective", "the call")
                rec, dump = getattr(comm, "_recorder", None), ""
                if rec is not None:
                    path = rec.try_dump(f"Work.wait timeout ({name})")
                    dump = f"; flight-recorder dump: {path}" if path else ""
                raise NcclTimeoutError(8, "Work.wait",
                                       f"{name} not complete after {timeout:g} s (stream "
                                       f"{self._stream:#x}); abort the communicator, its "
                                       f"peers may be gone or have skipped the call{dump}")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def is_completed(self) -> bool:
        """Whether the work is done (never blocks)."""
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        if self._owned:
            raise self._captured_error("is_completed()")
        ev = self._event
        if ev is None:
            return False
        if self._comm is not None and getattr(self._comm, "nonblocking", False):
            self._check_comm()
        if self._query(ev):
            self._completed()
            return True
        return False

    def _captured_error(self, what: str) -> NcclpyError:
        name = getattr(self.plan, "collective", "the call")
        return NcclpyError(
            f"{what}: this {name} was captured into a CUDA graph (its stream {self._stream:#x} "
            f"was capturing), so it runs at each replay, and its Work follows none of them: "
            f"launch the graph, then synchronize its stream (graph.launch(s); s.synchronize())"
            f"; inside the same capture, work.wait(other_stream) orders another stream after "
            f"it")

    @staticmethod
    def _query(ev: int) -> bool:
        return cuda().event_query(ev)

    def _check_comm(self) -> None:
        comm = self._comm
        if comm is not None:
            comm._raise_async_error()     # the watchdog's CommAbortedError included

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "completed" if self._done
                 else "pending group end" if self._event is None else "recorded")
        name = getattr(self.plan, "collective", "?")
        return f"<ncclpy.Work {name} stream={self._stream:#x} {state}>"
