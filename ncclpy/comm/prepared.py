"""Prepared calls: validate and plan a call once, then issue it with nothing but its C calls.

``ar = comm.prepare("all_reduce", x, op="sum")`` parses and plans the call at once (every check
of the eager call; errors surface here), and ``ar()`` / ``ar(stream=s)`` then issues the same
NCCL call(s) and records the Work: no parsing, no planning, no cache lookup.  It works inside
``comm.group()`` (planned again, once, for a call made in a group, where send/recv to self is
allowed) and while a stream captures a CUDA graph, and refuses clearly once the communicator is
closed, finalized or aborted.

What a prepared call fixes: the pointers, counts, dtypes and devices read at prepare time (it
keeps the buffers, and for torch tensors and CuPy arrays their memory, alive while it lives;
re-pointing a tensor in place afterwards with ``set_``/``resize_`` is not seen: prepare again),
and the op/root/peer.  What it does not: the stream (``stream=`` at prepare time fixes a
default; otherwise every call uses the current stream of the buffers' framework, like the eager
call), the group state, and the communicator's planning context (after ``force_fallback``
changes, the next call re-plans from the same buffers, every check again).

:class:`PreparedCall` is the GPU-less part (it needs a :class:`~ncclpy.comm.resolver.Resolver`
only), so its per-call cost is measured on a CPU; :class:`Prepared` binds it to a
communicator.
"""
from __future__ import annotations

import sys

from typing import Any, Dict, Optional, Tuple

from ..errors import ArgumentError, ArgumentTypeError
from .._nccl.group import OPEN, group_depth
from .execute import issue
from .hot import entry_of
from .lifecycle import USABLE
from .resolver import Resolved, Resolver, first_buffer
from .streams import as_stream_handle, default_stream_of, stream_handle, torch_record
from .work import Work

_getframe = sys._getframe

__all__ = ["PreparedCall", "Prepared", "bind_call", "SIGNATURES"]

_REQUIRED = object()

#: call -> (buffer argument names, ((other argument, default), ...)), as the communicator's
#: methods take them
SIGNATURES: Dict[str, Tuple[Tuple[str, ...], Tuple[Tuple[str, Any], ...]]] = {
    "all_reduce": (("sendbuf", "recvbuf"), (("op", "sum"),)),
    "reduce": (("sendbuf", "recvbuf"), (("root", 0), ("op", "sum"))),
    "broadcast": (("sendbuf", "recvbuf"), (("root", 0),)),
    "all_gather": (("sendbuf", "recvbuf"), ()),
    "reduce_scatter": (("sendbuf", "recvbuf"), (("op", "sum"),)),
    "all_to_all": (("sendbuf", "recvbuf"), (("send_counts", None), ("recv_counts", None))),
    "gather": (("sendbuf", "recvbuf"), (("root", 0),)),
    "scatter": (("sendbuf", "recvbuf"), (("root", 0),)),
    "send_recv": (("sendbuf", "recvbuf"), (("send_peer", _REQUIRED), ("recv_peer", _REQUIRED))),
    "send": (("buf",), (("peer", _REQUIRED),)),
    "recv": (("buf",), (("peer", _REQUIRED),)),
}


def _call_name(name: Any) -> str:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"prepare: the call must be named by a string, got "
                                f"{type(name).__name__}")
    if name in SIGNATURES:
        return name
    if name == "barrier":
        raise ArgumentError("prepare: barrier blocks the host until every rank arrives; call "
                            "comm.barrier() instead")
    bare = name.strip().lower().removeprefix("nccl")
    if bare in ("send", "recv"):   # ncclSend / ncclRecv: the one call, not the registry's
        return bare                # send_recv test (which both names mean there)
    from ..semantics import registry
    try:
        coll = registry.get(name)
    except Exception:
        coll = None
    if coll is None or coll.name not in SIGNATURES:
        raise ArgumentError(f"prepare: unknown call {name!r}; expected one of "
                            f"{', '.join(SIGNATURES)}")
    return coll.name


def bind_call(name: Any, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Tuple[str, Any, Any, Tuple[Any, ...]]:
    """``(name, a, b, params)`` from a call's arguments as the communicator's method takes
    them (positional or by name); ``b`` is None for one-buffer calls."""
    name = _call_name(name)
    bufs, others = SIGNATURES[name]
    names = list(bufs) + [n for n, _ in others]
    if len(args) > len(names):
        raise ArgumentTypeError(f"prepare({name!r}): takes at most {len(names)} arguments "
                                f"({', '.join(names)}), got {len(args)}")
    got: Dict[str, Any] = dict(zip(names, args))
    for k, v in kwargs.items():
        if k == "config":
            raise ArgumentTypeError(f"prepare({name!r}): a prepared call takes no config=; "
                                    f"call comm.{name}(..., config=...) directly (its resolver "
                                    f"cache plans a repeated configured call once)")
        if k not in names:
            raise ArgumentTypeError(f"prepare({name!r}): unexpected argument {k!r}; expected "
                                    f"{', '.join(names)} (and stream=)")
        if k in got:
            raise ArgumentTypeError(f"prepare({name!r}): {k!r} given twice")
        got[k] = v
    params = []
    for n, default in others:
        v = got.get(n, default)
        if v is _REQUIRED:
            raise ArgumentTypeError(f"prepare({name!r}): missing argument {n!r}")
        params.append(v)
    a = got.get(bufs[0])
    b = got.get(bufs[1]) if len(bufs) > 1 else None
    return name, a, b, tuple(params)


class PreparedCall:
    """A call parsed and planned once (GPU-less: needs only a Resolver); :meth:`bind` gives
    the :class:`Resolved` call for a stream and the current group state."""

    __slots__ = ("name", "_resolver", "_specs", "_params", "_stream", "_stream_obj", "_first",
                 "_plans", "_entries", "_gen")

    def __init__(self, resolver: Resolver, name: str, a: Any, b: Any = None,
                 params: Tuple[Any, ...] = (), stream: Any = None) -> None:
        self.name = name
        self._resolver = resolver
        self._stream: Optional[int] = None if stream is None else stream_handle(stream)
        #: the stream object itself: its handle stays valid while the call may use it (a
        #: dropped CuPy or torch stream is destroyed, and its handle recycled)
        self._stream_obj = stream
        self._first = first_buffer(a, b)
        self._specs = resolver.parse(name, a, b)
        self._params = params
        self._gen = resolver.generation
        in_group = group_depth() > 0
        self._plans = {in_group: resolver.plan(name, self._specs, params, in_group)}
        self._entries: Dict[Tuple[int, bool], Resolved] = {}

    @property
    def fixed_stream(self) -> bool:
        """Whether the stream was fixed by ``prepare(..., stream=s)``."""
        return self._stream is not None

    @property
    def specs(self) -> Tuple[Any, ...]:
        """The parsed buffers the call was planned on."""
        return self._specs

    def bind(self, stream: Any = None) -> Resolved:
        """The call resolved for ``stream`` (None: the prepared default, else the buffers'
        current stream) in this thread's group state."""
        if self._gen != self._resolver.generation:   # the context changed: plan again
            self._plans.clear()
            self._entries.clear()
            self._gen = self._resolver.generation
        if stream is None:
            s = self._stream
            if s is None:
                s = default_stream_of(self._first, self._resolver.ctx.device)
        else:
            s = stream if type(stream) is int and stream >= 0 else as_stream_handle(stream)
        in_group = group_depth() > 0
        r = self._entries.get((s, in_group))
        if r is None:
            r = self._entry(s, in_group)
        return r

    def _entry(self, s: int, in_group: bool) -> Resolved:
        plan = self._plans.get(in_group)
        if plan is None:
            plan = self._plans[in_group] = self._resolver.plan(self.name, self._specs,
                                                               self._params, in_group)
        if len(self._entries) >= 64:
            self._entries.clear()
        r = self._entries[(s, in_group)] = Resolved(plan, s, in_group)
        return r


def _torch_cuda(specs: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """The torch CUDA tensors among the parsed buffers ``specs``."""
    out = []
    for spec in specs:
        for sp in spec if isinstance(spec, list) else (spec,):
            obj = getattr(sp, "obj", None)
            if getattr(sp, "framework", None) == "torch" and getattr(obj, "is_cuda", False):
                out.append(obj)
    return tuple(out)


def _memory_owners(specs: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """What keeps each buffer's memory alive even if its object is re-pointed later."""
    out = []
    for spec in specs:
        for sp in spec if isinstance(spec, list) else (spec,):
            if sp is None:
                continue
            try:
                if sp.framework == "torch":
                    out.append(sp.obj.untyped_storage())
                elif sp.framework == "cupy" and sp.obj is not None:
                    out.append(sp.obj.data)
            except Exception:  # pragma: no cover - an exotic tensor: the object itself stays
                pass
    return tuple(out)


class Prepared:
    """A prepared call on a communicator: ``p()`` / ``p(stream=s)`` -> Work.

    Made by :meth:`ncclpy.Communicator.prepare`.  It fixes the buffers (pointers, counts,
    dtypes), op/root/peer; not the stream (default: the one given to ``prepare``, else the
    buffers' current stream at each call) nor the group state.  Each call issues the same NCCL
    call(s) as the eager method; it may be captured into a CUDA graph.  After the communicator
    is closed, finalized or aborted, calling it raises what the eager methods raise then (the
    watchdog's CommAbortedError with its reason after a watchdog abort, else NcclpyError).
    """

    __slots__ = ("_comm", "_call", "_keep", "_fast", "_gen", "_fire", "_ents", "_egen",
                 "_torch", "__weakref__")

    def __init__(self, comm: Any, name: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 stream: Any = None) -> None:
        name, a, b, params = bind_call(name, args, kwargs)
        self._call = PreparedCall(comm._resolver, name, a, b, params, stream)
        self._keep = (a, b, _memory_owners(self._call.specs))
        self._comm = comm
        self._fast: Any = None           # the fast path's entry for the prepared stream
        self._gen = -1                   # the resolver's generation it was made under
        hot = comm._hot
        self._fire = None if hot is None else hot.fire
        self._ents: Dict[Any, Any] = {}  # Resolved -> its fast-path entry (made once)
        self._egen = -1
        #: its torch CUDA tensors: recorded with torch's allocator at each call
        #: (streams.torch_record)
        self._torch = _torch_cuda(self._call.specs)

    @property
    def name(self) -> str:
        """The call prepared, e.g. ``"all_reduce"``."""
        return self._call.name

    def __call__(self, *, stream: Any = None) -> Work:
        """Issue the prepared NCCL call(s) on ``stream`` (see the module docstring)."""
        comm = self._comm
        life = comm._life
        if life.state is not USABLE:   # the eager methods' refusal: the watchdog's error too
            raise life.refusal(f"prepared {self.name}")
        e = self._fast                 # its stream fixed by prepare(), no group, same plan
        if e is not None and stream is None and not OPEN[0] and comm._checker is None and \
                self._gen == comm._resolver.generation:
            w = self._fire(e, self._keep, _getframe(1))
            if self._torch:
                torch_record(self._torch, w)
            return w
        gen = comm._resolver.generation     # before bind: an entry is never newer than it
        r = self._call.bind(stream)
        if comm._checker is None and not r.in_group and self._fire is not None and \
                not OPEN[0]:            # (another thread's group: the general path refuses)
            ents = self._ents
            if self._egen != gen:
                ents.clear()
                self._egen = gen
            e = ents.get(r)
            if e is None:
                e = entry_of(comm, r)  # the fast path (ncclpy.comm.hot), made once
                if e is not None:
                    if len(ents) >= 64:
                        ents.clear()
                    ents[r] = e
            if e is not None:
                if stream is None and self._call.fixed_stream:
                    self._fast, self._gen = e, gen
                w = self._fire(e, self._keep, _getframe(1))
                if self._torch:
                    torch_record(self._torch, w)
                return w
        w = issue(comm, r, self._keep)
        if self._torch:
            torch_record(self._torch, w)
        return w

    def __repr__(self) -> str:
        return f"<ncclpy.Prepared {self.name} on {self._comm!r}>"
