"""The fast path: a repeated eager call makes one NCCL call and two CUDA calls, nothing else.

Each communicator method tries its fast path first (``comm._hot``, made here per blocking
communicator).  A call is *hot* when it was seen before with the same objects: the entry is
found by the identity of the buffer objects and the plain arguments (name, ``id(sendbuf)``,
``id(recvbuf)``, op/root/peer), then checked by reading again everything its plan depends on
-- each buffer's key (:mod:`ncclpy.buffers.key`: pointer, count, dtype, device, layout), the
stream handle (``stream=None``: the current stream of the first buffer's framework, as
:func:`ncclpy.comm.streams.default_stream_of` resolves it), and that an int argument is still
an int (``1.0`` and ``True`` equal ``1``; the general path refuses them) -- so a reused id, a
re-pointed tensor or another current stream is a miss, never a stale plan, and the fast path
refuses exactly what the general path refuses.  An entry planned while another thread
cleared the cache (``force_fallback``) is used once and not kept.  A miss resolves the call
(:class:`~ncclpy.comm.resolver.Resolver`, every check) and keeps an entry when the call is one final
NCCL call; anything else (a group, checked mode, scratch, copies, a PreMulSum op, several NCCL
calls, a nonblocking communicator, NVTX ranges asked for) takes the general path
(:func:`ncclpy.comm.execute.issue`).

A hot call, with the defaults (watchdog and flight recorder on): the recorder's ring slot, the
API lock with the in-call marker (``life.hot``, what an abort and the watchdog see), the NCCL
call (CuPy's bound method, or the ctypes function), the record of a pooled event on the stream
and the capture query (``cudaStreamIsCapturing``: the two CUDA runtime calls), the Work, and
one append to its tracker (the watchdog, or the reaper: they release what completed, off the
caller's thread).  The capture query is the price of never querying a captured call's event
during its capture, which invalidates the capture (:func:`ncclpy.comm.work.captures`; a
tracker asking instead could meet a stream already destroyed: it crashed, on an H200,
2026-11-26).  No ``cudaGetDevice``, no event creation once the pool holds what is in flight,
no event query (docs/reference/concepts/streams.rst and graphs.rst say what this means).  The
entries are dropped with the resolver's cache (context change, close, abort, split).

A Ctrl-C may arrive wherever CPython checks for signals (tests/interrupt_util.py): the API
lock is taken inside the ``try`` whose handler gives it back if this call holds it (the fast
path never holds it re-entrantly), the in-call marker is set and cleared with nothing
interruptible between it and the lock, and once the NCCL call may have been made the Work
reaches its tracker whatever is interrupted (:func:`_fault`, :func:`_interrupted`).  Torch tensors'
storages are kept with the Work, and a call on a stream other than torch's current one records them
with torch's caching allocator (:func:`ncclpy.comm.streams.torch_keep`).
"""
from __future__ import annotations

import logging
import sys
import weakref
from functools import partial
from operator import attrgetter
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from ..buffers import buffer as _buffers
from .._nccl import cuda as _cudamod
from .._nccl.dispatch import CUPY_METHODS, cupy_status
from .._nccl.group import OPEN
from ..buffers.buffer import type_kind
from ..buffers.key import _KEYERS, keyer
from ..errors import NcclError
from .execute import _aborted, issue
from ..debug.recorder import interrupted
from .lifecycle import ABORTED, ABORTING, USABLE
from .streams import cai_stream, stream_handle, torch_keep, torch_record, torch_stream
from .work import Work, captures, event_pool, new_work, record_event

__all__ = ["make_hot", "Entry", "MAX_ENTRIES", "entry_of"]

#: entries kept per communicator (all dropped when full)
MAX_ENTRIES = 256
_PLAIN = frozenset((str, int, type(None)))
_P2P = frozenset(("send", "recv"))
_getframe = sys._getframe
log = logging.getLogger(__name__)
_new = object.__new__


class Entry:
    """One hot call: its resolved call, the NCCL call ready to make (``call()``: CuPy's
    bound method or the ctypes function with every argument and the stream bound), the
    stream handle, what its buffers' keys were, and whether it is point-to-point (the
    recorder numbers collectives only)."""

    __slots__ = ("r", "plan", "call", "method", "fn", "args", "s", "ka", "key_a", "kb",
                 "key_b", "wa", "wb", "default", "p2p", "ints", "mem", "x")

    def __init__(self, r: Any, method: Any, fn: Any, args: Tuple[Any, ...], ka: Any,
                 key_a: Hashable, kb: Any, key_b: Hashable, default: Any,
                 ints: Tuple[int, ...] = (), mem: Any = None) -> None:
        self.r, self.plan, self.s = r, r.plan, r.stream
        self.method, self.fn, self.args = method, fn, args
        self.call = partial(method, *args, r.stream) if method is not None else \
            partial(fn, *args, stream=r.stream)
        self.ka, self.key_a, self.kb, self.key_b = ka, key_a, kb, key_b
        self.wa = self.wb = _NOBODY      # the same object, unchangeable: see _same()
        self.default = default
        self.p2p = r.plan.collective in _P2P
        self.ints = ints        # the params that were ints: a hit checks they still are
        self.mem = mem          # torch tensors: their storages kept, the allocator told
        self.x = bool(ints) or mem is not None      # either: one test on the common path


def _NOBODY() -> None:       # a weak reference to nothing: the key is read again
    return None


def _same(obj: Any, key: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` when its key can never change while it lives -- a
    C-contiguous ``cupy.ndarray``, whose pointer, size, dtype, strides and device are
    read-only (only its shape can be set, in place, which keeps it contiguous and its plan
    the same): finding it again is then the whole check.  Anything else (a torch tensor can be
    re-pointed with ``set_``, an export can change): :func:`_NOBODY`."""
    if key is None or type(key) is not tuple or len(key) != 5 or key[0] is not type(obj) or \
            type_kind(type(obj)) != "cupy":
        return _NOBODY
    try:
        return weakref.ref(obj)
    except TypeError:
        return _NOBODY


def _cupy_current(device: int) -> int:
    return _cudamod.cuda().current_stream(device)


def _default_getter(a: Any, key_a: Any) -> Optional[Callable[[int], int]]:
    """How ``stream=None`` is resolved for a first buffer like ``a`` (as
    :func:`ncclpy.comm.streams.default_stream_of` does): CuPy's or torch's current stream,
    or the stream a ``__cuda_array_interface__`` export names -- part of its key, so an
    export that names another stream is a miss; in host memory mode, the CPU runtime's
    current stream for every buffer (a torch CPU tensor, a numpy array).  None: not on the
    fast path."""
    if _buffers._host:
        return _cupy_current
    kind = type_kind(type(a))
    if kind == "spec":                  # a BufferSpec: its framework's (as default_stream)
        obj, fw = getattr(a, "obj", None), str(getattr(a, "framework", "") or "").lower()
        if fw == "torch" or type_kind(type(obj)) == "torch":
            return torch_stream
        if obj is None or type_kind(type(obj)) == "cupy":   # (framework "cupy": its obj)
            return _cupy_current
        return None                     # an export that may name its stream: resolved
    if kind in ("cupy", "raw", "cupy-cai"):
        return _cupy_current
    if kind == "torch":
        return torch_stream
    if kind == "other" and type(key_a) is tuple and len(key_a) == 8:   # bufkey.cai_key
        named = cai_stream({"stream": key_a[6]})
        if named is None:
            return _cupy_current
        return lambda device, s=named: s
    return None


#: stream type -> how its handle is read on the fast path (decided once per type)
_HANDLES: Dict[type, Callable[[Any], int]] = {}


def _handle_of(t: type) -> Callable[[Any], int]:
    """The handle reader of stream type ``t``: CuPy's ``.ptr`` and torch's ``.cuda_stream``
    read directly, anything else through :func:`ncclpy.comm.streams.stream_handle` (a value
    that differs from the entry's is a miss, resolved with every check)."""
    mod = t.__module__.split(".")[0]
    f: Callable[[Any], int] = stream_handle
    if mod == "cupy" and hasattr(t, "ptr"):
        f = attrgetter("ptr")
    elif mod == "torch" and hasattr(t, "cuda_stream"):
        f = attrgetter("cuda_stream")
    if len(_HANDLES) < 256:
        _HANDLES[t] = f
    return f


def make_hot(comm: Any) -> Optional[Callable[..., Any]]:
    """``comm``'s fast path: ``hot(name, a, b, params, stream)`` -> Work, or None (take the
    general path).  None for a nonblocking communicator (its calls may return
    ncclInProgress and wait)."""
    if comm._nonblocking:
        return None
    life = comm._life
    api = life.api
    resolver = comm._resolver
    cache: Dict[Hashable, Entry] = resolver.hot
    dev = comm._device
    pool = event_pool(dev)
    free = pool.free
    lib = comm._lib

    def hot(name: str, a: Any, b: Any, params: Tuple[Any, ...], stream: Any) -> Any:
        if life.state is not USABLE or comm._checker is not None or OPEN[0]:
            return None                     # (a group open on any thread: the general path)
        key = (name, id(a), id(b), params)
        try:
            e = cache[key]
            if stream is None:
                s = e.default(dev)
            elif type(stream) is int:
                s = stream
            else:
                s = (_HANDLES.get(type(stream)) or _handle_of(type(stream)))(stream)
            hit = s == e.s and (e.wa() is a or e.ka(a) == e.key_a) and \
                (b is None or e.wb() is b or e.kb(b) == e.key_b)
            if e.x:                         # 1.0 and True equal 1: an int must be an int
                for i in e.ints:
                    if type(params[i]) is not int:
                        hit = False
        except Exception:   # noqa: BLE001 - not seen (KeyError), an odd object: resolve it
            hit = False
        if not hit:
            e = _miss(key, name, a, b, params, stream)
            if e is None or type(e) is not Entry:
                return e                    # the general path's Work, or None
        if e.x and e.mem is not None:       # torch: the storages too, the allocator told
            return _torch_call(fire, e, a, b, _getframe(2))
        keep = (a, b)
        rec = comm._recorder
        ent = None
        if rec is not None:                 # (appended below: see Recorder.entry_at)
            ent = rec.entry_at(e.r, _getframe(2), e.p2p)
        w = ev = None
        made = False
        try:
            if ent is not None:
                rec.ring.append(ent)
            try:
                api.acquire()               # (given back first thing in ``finally``)
                life.hot = e                # before the state check: an abort sees it
                if life.state is not USABLE or life.holder is not None:
                    life.hot = None         # (a holder is another thread's: this one's
                    if life.state is USABLE:    # group takes the general path)
                        raise life.foreign_group(e.plan.collective)
                    raise life.refusal(e.plan.collective)
                life.hot_n += 1
                made = True                 # (no check since the marker: made => ours)
                e.call()                    # the NCCL call
                try:
                    ev = free[-1]           # (no check between the two: no other thread,
                    del free[-1]            # no interrupt)
                except IndexError:          # the pool is empty: a new event
                    ev = _record_slow(pool, e.s)
                    cur = False
                else:
                    try:
                        _cudamod._backend.event_record(ev, e.s)  # the first CUDA call
                        cur = True          # (on stream 2: only with its device current)
                    except Exception:   # noqa: BLE001 - another device current, a failure
                        free.append(ev)     # back first, then a record made with care
                        ev = None
                        ev = _record_slow(pool, e.s)
                        cur = False
                w = _new(Work)
                w._comm = comm
                w._device = dev
                w._stream = e.s
                w._event = ev
                w.plan = e.plan
                w._keep = keep
                w._rec = ent
                w._owned = w._done = False
                w._error = None
                s = e.s                     # the second CUDA call: captures(), inlined
                if s > 2 or s == 2 and cur:     # (0, 1: the legacy stream, never captures)
                    try:
                        if _cudamod._backend.capture_status(s):
                            w._captured()   # before a tracker sees it: never queried
                    except Exception:   # noqa: BLE001 - an invalidated capture: captured
                        w._captured()
                elif s == 2 and captures(_cudamod._backend, s, dev):
                    w._captured()
                life.hot = None             # (then nothing interrupts before the append:
                comm._watch.append(w)       # cleared means handed over) to its tracker
            except BaseException as x:  # noqa: B902 - under the lock if this call took it
                if made:                    # the marker is this call's: cleared with no
                    tracked = life.hot is None   # check between; a Work NCCL may use is
                    life.hot = None              # handed over (_interrupted)
                    if not tracked:
                        w = _interrupted(comm, lib, life, rec, ent, e, keep, x, w, ev, pool)
                raise
            finally:
                try:
                    api.release()           # (a C call first: nothing interrupts before it)
                except RuntimeError:        # never taken: interrupted while it waited
                    pass
        except BaseException as x:  # noqa: B902 - the abort's error, NCCL's, an interrupt
            _fault(comm, lib, life, rec, ent, e, x, w, made)
            raise
        if life.state is not USABLE:
            _after_abort(life, w, e.plan.collective)
        return w

    def fire(e: Entry, keep: Any, frame: Any) -> Any:
        """Issue entry ``e`` (a prepared call's) keeping ``keep`` alive until the GPU ran it;
        ``frame``: the user's.  What :func:`hot` does once it found its entry (the same
        lines: one Python frame fewer for the eager call); interrupt-safe (see
        :func:`_fault`)."""
        rec = comm._recorder
        ent = None
        if rec is not None:                 # (appended below: see Recorder.entry_at)
            ent = rec.entry_at(e.r, frame, e.p2p)
        w = ev = None
        made = False
        try:
            if ent is not None:
                rec.ring.append(ent)
            try:
                api.acquire()               # (given back first thing in ``finally``)
                life.hot = e                # before the state check: an abort sees it
                if life.state is not USABLE or life.holder is not None:
                    life.hot = None         # (a holder is another thread's: this one's
                    if life.state is USABLE:    # group takes the general path)
                        raise life.foreign_group(e.plan.collective)
                    raise life.refusal(e.plan.collective)
                life.hot_n += 1
                made = True                 # (no check since the marker: made => ours)
                e.call()                    # the NCCL call
                try:
                    ev = free[-1]           # (no check between the two: no other thread,
                    del free[-1]            # no interrupt)
                except IndexError:          # the pool is empty: a new event
                    ev = _record_slow(pool, e.s)
                    cur = False
                else:
                    try:
                        _cudamod._backend.event_record(ev, e.s)  # the first CUDA call
                        cur = True          # (on stream 2: only with its device current)
                    except Exception:   # noqa: BLE001 - another device current, a failure
                        free.append(ev)     # back first, then a record made with care
                        ev = None
                        ev = _record_slow(pool, e.s)
                        cur = False
                w = _new(Work)
                w._comm = comm
                w._device = dev
                w._stream = e.s
                w._event = ev
                w.plan = e.plan
                w._keep = keep
                w._rec = ent
                w._owned = w._done = False
                w._error = None
                s = e.s                     # the second CUDA call: captures(), inlined
                if s > 2 or s == 2 and cur:     # (0, 1: the legacy stream, never captures)
                    try:
                        if _cudamod._backend.capture_status(s):
                            w._captured()   # before a tracker sees it: never queried
                    except Exception:   # noqa: BLE001 - an invalidated capture: captured
                        w._captured()
                elif s == 2 and captures(_cudamod._backend, s, dev):
                    w._captured()
                life.hot = None             # (then nothing interrupts before the append:
                comm._watch.append(w)       # cleared means handed over) to its tracker
            except BaseException as x:  # noqa: B902 - under the lock if this call took it
                if made:                    # the marker is this call's: cleared with no
                    tracked = life.hot is None   # check between; a Work NCCL may use is
                    life.hot = None              # handed over (_interrupted)
                    if not tracked:
                        w = _interrupted(comm, lib, life, rec, ent, e, keep, x, w, ev, pool)
                raise
            finally:
                try:
                    api.release()           # (a C call first: nothing interrupts before it)
                except RuntimeError:        # never taken: interrupted while it waited
                    pass
        except BaseException as x:  # noqa: B902 - the abort's error, NCCL's, an interrupt
            _fault(comm, lib, life, rec, ent, e, x, w, made)
            raise
        if life.state is not USABLE:
            _after_abort(life, w, e.plan.collective)
        return w

    def _miss(key: Hashable, name: str, a: Any, b: Any, params: Tuple[Any, ...],
              stream: Any) -> Any:
        gen = resolver.generation
        r = resolver.resolve(name, stream, a, b, params)
        e = _entry(comm, r, a, b, params, stream)
        if e is None:
            return issue(comm, r, (a, b, None))
        if resolver.generation == gen:      # not planned before a clear (force_fallback,
            if len(cache) >= MAX_ENTRIES:   # another thread): kept, else used once
                cache.clear()
            cache[key] = e
            if resolver.generation != gen:  # cleared meanwhile: gone with the others
                cache.pop(key, None)
        return e

    hot.fire = fire                         # type: ignore[attr-defined]
    return hot


def _torch_call(fire: Callable[..., Any], e: Entry, a: Any, b: Any, frame: Any) -> Any:
    """A fast call on torch tensors: their storages kept with the Work, and the tensors
    recorded with torch's caching allocator on the call's stream (streams.torch_record)."""
    keep = torch_keep(a, b)
    w = fire(e, keep, frame)
    torch_record(keep, w)
    return w


def entry_of(comm: Any, r: Any) -> Optional[Entry]:
    """The entry of resolved call ``r`` without buffer keys (a prepared call's: its buffers
    were fixed when it was prepared), or None when it must take the general path."""
    if comm._hot is None:
        return None
    calls = r.calls
    if calls is None or len(calls) != 1 or r.group or r.in_group:
        return None
    rec = comm._recorder
    if rec is not None and rec.nvtx is not None:   # NCCLPY_NVTX=1: ranges around each call
        return None
    fn, args = calls[0]
    nc = comm._nc
    method = getattr(nc, CUPY_METHODS[fn]) if nc is not None and fn in CUPY_METHODS else None
    return Entry(r, method, comm._dispatch[fn], args, None, None, None, None, None)


def _entry(comm: Any, r: Any, a: Any, b: Any, params: Tuple[Any, ...],
           stream: Any) -> Optional[Entry]:
    """The hot entry of resolved call ``r``, or None when it must take the general path."""
    calls = r.calls
    if calls is None or len(calls) != 1 or r.group or r.in_group:
        return None
    rec = comm._recorder
    if rec is not None and rec.nvtx is not None:   # NCCLPY_NVTX=1: ranges around each call
        return None
    for p in params:
        if type(p) not in _PLAIN:
            return None
    ints = tuple(i for i, p in enumerate(params) if type(p) is int)
    try:
        ka = _KEYERS.get(type(a)) or keyer(type(a))
        key_a = ka(a)
        kb = None if b is None else (_KEYERS.get(type(b)) or keyer(type(b)))
        key_b = None if b is None else kb(b)
    except Exception:  # noqa: BLE001 - Uncacheable, or an object that cannot be read
        return None
    default = _default_getter(a, key_a)
    if stream is None and default is None:
        return None
    fn, args = calls[0]
    nc = comm._nc
    method = getattr(nc, CUPY_METHODS[fn]) if nc is not None and fn in CUPY_METHODS else None
    mem = True if type_kind(type(a)) == "torch" or (
        b is not None and type_kind(type(b)) == "torch") else None
    e = Entry(r, method, comm._dispatch[fn], args, ka, key_a, kb, key_b, default, ints, mem)
    e.wa = _same(a, key_a)
    if b is not None:
        e.wb = _same(b, key_b)
    return e


def _failed(comm: Any, lib: Any, life: Any, e: Entry, x: BaseException) -> BaseException:
    """The error a call that never reached NCCL, or whose NCCL call failed, raises: the
    refusal as it is; CuPy's NcclError (or its KeyError for codes 7/8) as ncclpy's NcclError;
    the abort's CommAbortedError when the watchdog aborted the communicator while the call
    was inside NCCL."""
    err = x
    if e.method is not None and isinstance(x, Exception):
        code = cupy_status(x, lib)
        if code is not None:
            err = lib.error(code, "nccl" + e.r.calls[0][0], comm._handle)
    if isinstance(err, Exception):
        err = _aborted((comm,), err)
    if err is not x and err.__cause__ is None:
        err.__cause__ = x
    return err


def _nccl_failed(lib: Any, e: Entry, x: BaseException) -> bool:
    """Whether ``x`` is the NCCL call's own failure (nothing was enqueued)."""
    if isinstance(x, NcclError):
        return True
    return e.method is not None and isinstance(x, Exception) and cupy_status(x, lib) is not None


def _fault(comm: Any, lib: Any, life: Any, rec: Any, ent: Any, e: Entry, x: BaseException,
           w: Any, made: bool) -> None:
    """An exception in a fast call (``x``: a refusal, NCCL's error, an interrupt anywhere),
    after the API lock was given back and a Work NCCL may use handed over: the recorder's
    entry failed unless a Work took it, an abort waiting for the call woken.  NCCL's error
    is raised here, said as ncclpy's; anything else the caller re-raises as it is."""
    if not made:
        w = None
    err = _failed(comm, lib, life, e, x) if w is None else x
    if ent is not None and (w is None or w._rec is not ent):
        rec.fail(ent, err)                  # never reached NCCL (a tracked Work stamps it)
    if life.state is not USABLE:
        life.hot_left()
    if err is not x:
        raise err from err.__cause__        # (CuPy's error, or NCCL's under the abort's)


def _interrupted(comm: Any, lib: Any, life: Any, rec: Any, ent: Any, e: Entry, keep: Any,
                 x: BaseException, w: Any, ev: Optional[int], pool: Any) -> Any:
    """An exception inside the API lock, after the state check (the in-call marker is
    already clear).  The NCCL call's own failure: nothing was enqueued, None.  Anything else
    -- an interrupt, a signal handler's error, a failed event record -- may come after NCCL
    enqueued the op: its Work is made (what was not done yet: the event recorded again, which
    is harmless, the capture asked) and handed to the tracker, so the buffers stay kept until
    the GPU ran the op; that Work (the caller still gets ``x``)."""
    if w is None and ev is None and _nccl_failed(lib, e, x):
        return None
    cu = _cudamod.cuda()
    dev = pool.device
    if w is None:
        try:
            if ev is None:
                ev = record_event(cu, pool, e.s)
            else:
                try:
                    cu.event_record(ev, e.s)
                except Exception:  # noqa: BLE001 - another device current: made again
                    pool.free.append(ev)
                    ev = None
                    ev = record_event(cu, pool, e.s)
        except Exception as err:  # noqa: BLE001 - no event: nothing to wait on
            log.warning("a %s interrupted after its NCCL call: its event could not be "
                        "recorded (%s); its buffers are let go", e.plan.collective, err)
            return None
        w = new_work(comm, dev, e.s, e.plan, keep, ev)
        w._rec = ent
    if ent is not None:
        interrupted(ent, x)
    if captures(cu, e.s, dev):
        w._captured()
    watch = comm._watch
    watch += (w,)
    return w


def _record_slow(pool: Any, stream: int) -> int:
    """The record when the fast one could not: no free event (a new one is made), or the
    event's device is not current for a default stream (:func:`record_event` retries; the
    caller put the event back in the pool first)."""
    return record_event(_cudamod.cuda(), pool, stream)


def _after_abort(life: Any, w: Any, name: str) -> None:
    """An abort began while the call was inside NCCL (it waited for it): the call raises
    the abort's error; its buffers stay kept by the Work's tracker until the GPU is done
    (as :func:`ncclpy.comm.execute.issue` does)."""
    life.hot_left()
    if life.deferred and life.state in (ABORTING, ABORTED):
        err = life.refusal(name)
        w._error = err                  # still held by its tracker until the GPU is done
        raise err
