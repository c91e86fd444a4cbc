"""``Work``: the handle every communicator call returns, built on a pooled CUDA event.

The event is recorded on the call's stream right after the NCCL work was enqueued (for calls
made inside ``group()``: right after the outermost group end), then the stream is asked whether
it captures: the two CUDA runtime calls a steady-state call makes besides NCCL's own.
``wait()`` blocks the host on it, ``wait(stream)`` makes another stream wait for it (no host
block), ``is_completed()`` queries it.

Who releases what (docs/reference/concepts/streams.rst): every Work goes to a tracker -- the
communicator's watchdog, or the process's reaper (:mod:`ncclpy.debug.reaper`) when the watchdog
is off -- which queries it from its own thread (in the thread-local stream-capture mode) and,
once it completed, drops the buffers and scratch the call kept alive and gives the event back
to its device's pool.  So the memory a call uses stays referenced until the GPU ran the call,
whether or not the caller keeps the Work (an allocator cannot reuse memory NCCL still uses),
and the caller's thread never queries other calls' events.  A host wait or ``is_completed()``
True releases at once.

Events are not created per call: each device has a pool that grows to what is in flight
(a tracker releases at its tick, so that is every call of the last tick), and events are
created only when the pool is empty.  Re-recording an event later is safe: whatever already
waited on it (``wait(stream)``) captured its state at that moment.

Graphs (docs/reference/concepts/graphs.rst): the record is made whether or not the stream is
capturing, then the call asks (:func:`captures`).  A call made while its stream captured a CUDA
graph has its Work marked captured before a tracker sees it: its event is never queried (a
query during the capture invalidates it), never pooled again (a ``wait(other_stream)`` inside
the capture is a graph edge to it; destroyed at the communicator's close), and ``wait()`` and
``is_completed()`` refuse with a precise error.  The trackers query events only, under the
release lock, and never a stream (a stream may be destroyed once its calls are issued).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from itertools import repeat
from operator import attrgetter
from typing import Any, Dict, List, Optional

from .._nccl.cuda import CAPTURE_MODE_RELAXED, LEGACY_STREAMS, CapturedEventError, cuda
from ..errors import NcclpyError, NcclTimeoutError

__all__ = ["Work", "EventPool", "event_pool", "new_work", "record_event", "release_done", "take",
           "captures"]

log = logging.getLogger(__name__)

#: free events kept per device at most (the pool holds what was in flight at once; beyond
#: this bound, given-back events are destroyed)
_POOL_MAX = 1 << 16


class EventPool:
    """Free ``cudaEventDisableTiming`` events of one device (raw ``cudaEvent_t`` ints).
    ``free`` is a plain list: the call path pops from it, trackers append to it (both atomic
    under the GIL)."""

    __slots__ = ("device", "free", "created")

    def __init__(self, device: int) -> None:
        self.device = device
        self.free: List[int] = []
        self.created = 0

    def take(self, cu: Any) -> int:
        """A free event, or a new one (made with the pool's device current) when none is."""
        try:
            return self.free.pop()
        except IndexError:
            return self.new(cu)

    def new(self, cu: Any) -> int:
        """A new event of the pool's device (the device made current for the creation)."""
        prev = cu.get_device()
        if prev != self.device:
            cu.set_device(self.device)
        try:
            ev = cu.event_create()
        finally:
            if prev != self.device:
                cu.set_device(prev)
        self.created += 1
        return ev

    def give(self, ev: int) -> None:
        """Hand ``ev`` back (destroyed when the pool is full)."""
        if len(self.free) < _POOL_MAX:
            self.free.append(ev)
        else:
            _destroy(ev)

    def __len__(self) -> int:
        return len(self.free)


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


def record_event(cu: Any, pool: EventPool, stream: int) -> int:
    """Take an event of ``pool`` and record it on ``stream``: one ``cudaEventRecord``.  A
    record on a legacy or per-thread default stream that fails (another device current: CUDA
    documents a failure, ``cudaErrorInvalidResourceHandle``) is made again with the event's
    device current; any other failure gives the event back and raises."""
    free = pool.free
    try:
        ev = free[-1]           # (no check between the two: no other thread, no interrupt)
        del free[-1]
    except IndexError:
        ev = pool.new(cu)
    try:
        cu.event_record(ev, stream)
    except BaseException as e:
        if stream in LEGACY_STREAMS and isinstance(e, Exception):   # (400 expected; any
            try:
                _record_on(cu, pool.device, ev, stream)
                return ev
            except BaseException:
                pool.give(ev)
                raise
        pool.give(ev)
        raise
    return ev


def _record_on(cu: Any, device: int, ev: int, stream: int) -> None:
    prev = cu.get_device()
    cu.set_device(device)
    try:
        cu.event_record(ev, stream)
    finally:
        cu.set_device(prev)


def new_work(comm: Any, device: int, stream: int, plan: Any, keep: Any, event: int) -> "Work":
    """A recorded Work, made without ``__init__``'s frame (the call path's constructor)."""
    w = _new(Work)
    w._comm, w._device, w._stream, w._event, w.plan, w._keep = \
        comm, device, stream, event, plan, keep
    w._owned = w._done = False
    w._error = w._rec = None
    return w


def captures(cu: Any, stream: int, device: int, current: bool = False) -> bool:
    """Whether ``stream`` is capturing a CUDA graph, asked by the call itself right after it
    recorded its event (the stream is alive then; ``cudaStreamIsCapturing``).  A captured
    call's Work is marked captured before any tracker sees it, so its event is never queried
    while the capture is under way: such a query invalidates the capture whatever the
    querying thread's capture mode (tests/gpu/probe_capture_events.py on an H200, CUDA 13.0,
    2026-11-26: 907 for the query, then cudaErrorStreamCaptureInvalidated at the end; a
    watchdog's query broke torch.cuda.graph's capture).  The legacy default stream (0, 1)
    cannot be captured: not asked.  The per-thread default stream (2) is the current device's:
    asked with ``device`` current (``current``: the caller knows it is -- its record on stream
    2 succeeded, which CUDA refuses with another device current -- so no cudaGetDevice).  An
    error (an invalidated capture: CuPy raises) counts as capturing: the event is then never
    queried."""
    if stream == 0 or stream == 1:
        return False
    try:
        if stream == 2 and not current:
            prev = cu.get_device()
            if prev != device:
                cu.set_device(device)
                try:
                    return bool(cu.capture_status(stream))
                finally:
                    cu.set_device(prev)
        return bool(cu.capture_status(stream))
    except Exception:  # noqa: BLE001 - said above
        return True


_new = object.__new__
_popleft = collections.deque.popleft
_stream_of = attrgetter("_stream")
_owned_of = attrgetter("_owned")
_error_of = attrgetter("_error")
_event_of = attrgetter("_event")


class Work:
    """Completion handle of one communicator call, returned as soon as it is enqueued.

    ``wait()`` blocks the host (bounded by the communicator's timeout: NcclTimeoutError, or
    the watchdog's CommAbortedError); ``wait(stream)`` orders ``stream`` after the call
    (``cudaStreamWaitEvent``, no host block); ``is_completed()`` never blocks.  It keeps the
    call's buffers and scratch alive until completion is seen (by its tracker, or a host
    wait).  A call made inside ``group()`` is recorded at the outermost group end (wait after
    the block).  A call made while its stream captures a CUDA graph runs at each replay, and
    its Work follows none of them: do not host-wait on it (synchronize the stream after
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
        self._owned = False     # True: captured into a graph (the event is its own now)
        self._done = False      # completion seen: the event went back to the pool
        self._keep = keep
        self._error: Optional[BaseException] = None
        self.plan = plan
        self._rec: Optional[list] = None   # its flight-recorder entry (ncclpy.debug.recorder)

    # -- set up by the executor ---------------------------------------------------------
    def _record(self) -> None:
        """Take a pooled event and record it on the call's stream (:func:`record_event`), ask
        whether the stream captures (:func:`captures`: a captured call's Work is marked so
        before a tracker sees it), then hand the Work to its tracker (``comm._watch``) -- all
        with the communicator's API lock held, so a tracker gets each communicator's Works in
        record order."""
        cu = cuda()
        self._event = record_event(cu, event_pool(self._device), self._stream)
        self._track(cu)

    def _track(self, cu: Any = None) -> None:
        """Ask whether the stream captures, then hand the recorded Work to its tracker (the
        last step: ``+=`` is not a call, so nothing interrupts between it and the return)."""
        if captures(cu or cuda(), self._stream, self._device):
            self._captured()
        comm = self._comm
        if comm is not None:
            watch = comm._watch
            if watch is not None:
                watch += (self,)

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

    def _captured(self) -> None:
        """Its event says the call was captured into a CUDA graph: mark it (once), count it on
        the communicator (close says so if finalize then waits on graphs) and keep the event
        out of the pool (destroyed at close: a graph edge may still name it)."""
        with _release_lock:
            if self._owned or self._done:
                return
            self._owned = True
        self._keep = ()
        comm = self._comm
        if comm is not None:
            comm._captured_calls = getattr(comm, "_captured_calls", 0) + 1
            if self._event is not None:     # its event is destroyed at close, and the Work
                comm._captured_events.append(self)   # told (Work.closed_captured)

    def _reap(self, raising: bool = False) -> bool:
        """A tracker's look (the watchdog's or the reaper's thread, in the thread-local
        capture mode): True once nothing is left to watch -- completed (released here),
        failed, captured into a graph, or an event query that fails (its error reaches
        whoever waits on the Work; ``raising``: raised instead, the Work stays held)."""
        if self._done or self._owned:
            return True
        ev = self._event
        if ev is None:              # failed before its record, or a group not ended yet
            return self._error is not None
        # (an error with an event -- an abort that waited for the call, a nonblocking
        # communicator's async error -- still has its buffers kept until the GPU is done with
        # them: NCCL's kernel runs until ncclCommAbort ends it, and an allocator would reuse
        # the memory at once)
        comm = self._comm
        if comm is not None and comm._nonblocking and self._error is None:
            try:
                self._check_comm()  # a nonblocking communicator's async error, or verdict
            except Exception as e:  # noqa: BLE001 - whoever waits gets it; the Work stays
                self._error = e
        try:
            with _release_lock:     # a caller's completion may give the event back meanwhile
                if self._done or self._owned:
                    return True
                done = cuda().event_query(ev)
        except CapturedEventError:
            self._captured()
            return True
        except Exception:  # noqa: BLE001 - failed: whoever waits on it gets the error
            if raising:
                raise
            return True
        if done:
            self._completed()
        return done

    def _closed_captured(self, why: str) -> Optional[int]:
        """Its communicator is closed or aborted: the event of this captured call is taken
        (the caller destroys it) and a later ``wait(stream)`` raises why, instead of waiting
        on a destroyed event."""
        with _release_lock:
            ev, self._event = self._event, None
            if self._error is None:
                name = getattr(self.plan, "collective", "call")
                self._error = NcclpyError(
                    f"this {name} was captured into a CUDA graph and its communicator is "
                    f"{why}: its event is destroyed, there is nothing to wait on (a graph of "
                    f"a closed communicator must not be launched again)")
        return ev

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
                h = as_stream_handle(stream)
                with _release_lock:    # not an event the tracker released, nor one a
                    ev = self._event       # close destroyed, meanwhile
                    if not self._done and ev is not None:
                        cuda().stream_wait_event(h, ev)
            return
        if ev is not None:
            if not self._first_query(ev, "wait()"):
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
        if self._first_query(ev, "is_completed()"):
            self._completed()
            return True
        return False

    def _first_query(self, ev: int, what: str) -> bool:
        """The caller's first query of the event.  The stream is never asked: it may be
        destroyed once the call was issued (a stream made for one step and dropped); the
        query is made in the relaxed capture mode, which no capture -- this thread's
        included -- prohibits, and the event was recorded outside any capture (a call made
        in one is marked captured by the call itself and never queried), so the query
        neither fails nor invalidates a capture; a call captured all the same is learned
        from the query (cudaErrorCapturedEvent)."""
        return self._query(ev, what)

    def _captured_error(self, what: str) -> NcclpyError:
        name = getattr(self.plan, "collective", "the call")
        return NcclpyError(
            f"{what}: this {name} was captured into a CUDA graph (its stream {self._stream:#x} "
            f"was capturing), so it runs at each replay, and its Work follows none of them: "
            f"launch the graph, then synchronize its stream (graph.launch(s); s.synchronize())"
            f"; inside the same capture, work.wait(other_stream) orders another stream after "
            f"it")

    def _query(self, ev: int, what: str = "wait()") -> bool:
        """Query the event unless its tracker already saw completion (under the release lock:
        a released event may be re-recorded by another call at once), in the relaxed capture
        mode (never prohibited by, nor invalidating, a capture: "the local thread is not
        prohibited from potentially unsafe API calls", cudaStreamCaptureModeRelaxed)."""
        cu = cuda()
        prev = cu.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            with _release_lock:
                if self._done:
                    return True
                return cu.event_query(ev)
        except CapturedEventError:
            self._captured()
            raise self._captured_error(what) from None
        finally:
            if prev is not None:
                cu.exchange_capture_mode(prev)

    def _check_comm(self) -> None:
        comm = self._comm
        if comm is not None:
            comm._raise_async_error()     # the watchdog's CommAbortedError included

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "completed" if self._done
                 else "pending group end" if self._event is None else "recorded")
        name = getattr(self.plan, "collective", "?")
        return f"<ncclpy.Work {name} stream={self._stream:#x} {state}>"


def take(q: Any, into: List[Any]) -> int:
    """Move everything in deque ``q`` to the end of list ``into``, oldest first, in C (each
    ``popleft`` is atomic: safe while the call path appends); how many."""
    k = len(q)
    if k:
        into.extend(map(_popleft, repeat(q, k)))
    return k


def release_done(pending: List[Any], raising: bool = False) -> int:
    """Release the Works at the front of ``pending`` (a list, oldest first) that completed,
    up to the first that has not, and delete them from it; how many were released.

    A tracker gets each communicator's Works in the order their events were recorded (the
    record and the append are made under the communicator's API lock), so along a run of
    Works on one stream completion is a prefix (stream order): a binary search finds its end
    with O(log n) event queries, and the prefix is released in one pass (``_done``, the
    events back to the pool, the recorder's entries stamped).  Anything else -- another kind
    of Work, a nonblocking communicator's (its async error is checked), one without an event,
    one captured into a graph -- gets its own :meth:`Work._reap` (``raising``: a failed query
    raises instead of letting the Work go).  One tracker's Works are one communicator's."""
    cu = cuda()
    done = 0
    n = len(pending)
    try:
        while done < n:
            w0 = pending[done]
            c = w0._comm if type(w0) is Work else None
            if c is None or w0._event is None or w0._owned or w0._done or \
                    w0._error is not None or c._nonblocking:
                if not w0._reap(raising):
                    break
                done += 1
                continue
            s = w0._stream
            rest = pending[done:]   # the run: plain Works of one stream, up to the first
            end = n                 # other (a captured Work's event is never queried)
            if list(map(_stream_of, rest)).count(s) != n - done or any(map(_owned_of, rest)) \
                    or any(map(_error_of, rest)) or None in list(map(_event_of, rest)) \
                    or set(map(type, rest)) != {Work}:
                end = done + 1      # (in C above; a walk only when the run ends early)
                while end < n:
                    w = pending[end]
                    if w._stream != s or w._owned or w._event is None or \
                            w._error is not None or type(w) is not Work:
                        break
                    end += 1
            lo, hi = done, end
            try:
                while lo < hi:
                    mid = (lo + hi) >> 1
                    w = pending[mid]
                    with _release_lock:     # never a query of an event given back meanwhile
                        ok = w._done or (not w._owned and cu.event_query(w._event))
                    if ok:
                        lo = mid + 1
                    else:
                        hi = mid
            except CapturedEventError:   # a capture on this stream: one Work at a time
                if not w0._reap(raising):
                    break
                done += 1
                continue
            if lo > done:
                _release_run(pending, done, lo)
                done = lo
            if lo < end:
                break
    finally:
        if done:
            del pending[:done]
    return done


def _release_run(run: List["Work"], start: int, end: int) -> None:
    """``run[start:end]`` completed: what :meth:`Work._completed` does, for all of them at
    once (one communicator's: one device's pool)."""
    now = time.time()
    evs = []
    with _release_lock:
        for i in range(start, end):
            w = run[i]
            if w._done or w._owned:
                continue
            w._done = True
            w._keep = ()
            evs.append(w._event)
            e = w._rec
            if e is not None and e[6] == "issued":     # [5] t_done, [6] state (recorder.py)
                e[5], e[6] = now, "completed"
    if evs:
        pool = event_pool(run[start]._device)
        if len(pool.free) + len(evs) <= _POOL_MAX:
            pool.free.extend(evs)
        else:
            for ev in evs:
                pool.give(ev)
