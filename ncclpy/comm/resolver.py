"""The resolver: a communicator call -> the exact NCCL calls, with a cache that is never stale.

A :class:`Resolver` is what a communicator owns to turn ``all_reduce(x, op="sum")`` and the like
into NCCL calls.  It needs no GPU and no communicator: only the :class:`PlanContext` (rank,
world size, device, NCCL version, ``force_fallback``) and the communicator's mode, so its cost is
measured and tested on a CPU (``bench/host_overhead.py``, ``tests/test_resolver.py``).

A call is resolved into a :class:`Resolved`: the plan and, when the plan is nothing but NCCL
calls (no scratch, no copies, no PreMulSum op to create), the final C arguments of each call
before ``comm`` and ``stream``, and the stream.  The first time a call is seen (a miss), its
buffers are parsed and it is planned in full, every check included.  The result is kept under a
key made of everything that decides it:

* the call's name, its stream handle, and whether it is made inside a user group;
* each buffer's key (:mod:`ncclpy.buffers.key`): the values its pointer, count, dtype, device and
  layout come from, read again on every call, never the object's identity;
* the other arguments (op, root, peer, counts), only when they are of a type whose equality is
  its value (str, int, None, RedOp with its scalar's exact bits, lists of ints).

What the key does not hold -- the context and the mode -- clears the cache when it changes
(:meth:`Resolver.set_context`, :meth:`Resolver.clear`; the communicator calls them on
``force_fallback``, close, abort, finalize and split).  Anything without a cheap key (DLPack-only
objects, numpy scalars as roots, ...) is resolved in full on every call.  Errors are never
cached: a bad call is refused, by the planner, every time.

A first buffer that exports ``__cuda_array_interface__`` (and is not a CuPy or torch object) has
its export read once per call: the default stream, its key and, on a miss, its parse
(:func:`ncclpy.buffers.buffer.from_cai`, every check) all come from that one dict.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from ..semantics import registry as _registry
from ..buffers.buffer import as_buffer, from_cai
from ..buffers.key import _KEYERS, Uncacheable, _cai, cai_key, keyer
from .execute import group_depth
from ..semantics.ops import RedOp
from ..plan import collectives as _c
from ..plan.collconfig import check_config_arg, with_config
from ..plan.types import NcclCall, Plan, PlanContext
from .streams import cai_stream, cupy_stream, default_stream_of, stream_handle

__all__ = ["Resolver", "Resolved", "PLANNERS", "first_buffer"]

def _planners() -> Dict[str, Tuple[Callable[..., Plan], Tuple[str, ...]]]:
    """Every collective of the registry (its planner; buffers named as the communicator's
    methods name them), plus the two point-to-point calls, which are not collectives."""
    table = {c.name: (c.planner_fn, ("sendbuf", "recvbuf") if c.data else ("barrier buffer",))
             for c in _registry.COLLECTIVES.values()}
    table["send"] = (_c.plan_send, ("buf",))
    table["recv"] = (_c.plan_recv, ("buf",))
    return table


#: call name -> (planner, buffer argument names); the planner takes (ctx, *buffers, *params)
PLANNERS: Dict[str, Tuple[Callable[..., Plan], Tuple[str, ...]]] = _planners()

_PLAIN = frozenset((str, int, type(None)))


class Resolved:
    """One resolved call.

    ``calls``: ``((fn, args), ...)`` with every argument final (``nccl<fn>(*args, comm,
    stream)``), or None when the plan needs the full executor (scratch, copies, PreMulSum);
    ``group``: wrap the calls in ncclGroupStart/End; ``stream``: the raw ``cudaStream_t``;
    ``in_group``: resolved for a call made inside a user group; ``plan``: the plan.
    """

    __slots__ = ("plan", "calls", "group", "stream", "in_group")

    def __init__(self, plan: Plan, stream: int, in_group: bool) -> None:
        self.plan = plan
        self.group = plan.group
        self.stream = stream
        self.in_group = in_group
        self.calls: Optional[Tuple[Tuple[str, Tuple[Any, ...]], ...]] = None
        if plan.premul is not None or plan.scratch_bytes:
            return                              # an op to create, scratch: the full executor
        calls = []
        for c in plan.steps:
            if type(c) is not NcclCall:         # a device copy: the full executor
                return
            args = c.args
            for v in args:
                if type(v) is not int:          # not all final already (the common case)
                    args = _final(args)
                    if args is None:            # a placeholder (Scratch, PREMUL_OP)
                        return
                    break
            calls.append((c.fn, args))
        self.calls = tuple(calls)

    def __repr__(self) -> str:
        return (f"<Resolved {self.plan.collective} stream={self.stream:#x} "
                f"calls={self.calls!r}>")


def _final(args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
    """``args`` as the C call takes them (None -> NULL), or None if one is a placeholder."""
    if any(v is not None and type(v) is not int for v in args):
        return None
    return tuple(0 if v is None else v for v in args)


def first_buffer(a: Any, b: Any) -> Any:
    """The call's first buffer object (the first of a list), which picks the default stream."""
    for x in (a, b):
        if x is None:
            continue
        if type(x) is list or type(x) is tuple:
            for y in x:
                if y is not None:
                    return y
            continue
        return x
    return None


def _exact(x: Any) -> Hashable:
    t = type(x)
    if t is float:
        return struct.pack("<d", x)     # -0.0 vs 0.0, NaN payloads: distinct scalars
    if t in _PLAIN:
        return x
    raise Uncacheable(f"scalar of type {t.__name__}")


def _param_key(p: Any) -> Hashable:
    t = type(p)
    if t in _PLAIN:
        return p
    if t is RedOp:
        return (RedOp, p.name, _exact(p.scalar))
    if (t is list or t is tuple) and all(type(x) is int for x in p):
        return (list, *p)
    raise Uncacheable(f"argument of type {t.__name__}")


def _params_key(params: Tuple[Any, ...]) -> Tuple[Any, ...]:
    for p in params:
        if type(p) not in _PLAIN:
            return tuple(map(_param_key, params))
    return params


def _parse(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, (list, tuple)):
        return [as_buffer(o, f"{name}[{i}]") for i, o in enumerate(obj)]
    return as_buffer(obj, name)


class Resolver:
    """Turns calls into :class:`Resolved` ones for one communicator (see module docstring)."""

    def __init__(self, ctx: PlanContext, *, mode: Hashable = None, maxsize: int = 4096) -> None:
        if not isinstance(ctx, PlanContext):
            raise TypeError(f"ctx: expected a PlanContext, got {type(ctx).__name__}")
        self._maxsize = max(int(maxsize), 1)
        self._cache: Dict[Hashable, Resolved] = {}
        self._configured: Dict[Hashable, Resolved] = {}   # (plain Resolved, CollConfig)
        self._generation = 0
        self._ctx = ctx
        self._ctx_group = dataclasses.replace(ctx, in_group=True)
        self._mode = mode
        self._device = ctx.device
        self.misses = 0
        #: the communicator's fast-path entries (:mod:`ncclpy.comm.hot`), dropped with the rest
        self.hot: Dict[Hashable, Any] = {}

    # -- state ------------------------------------------------------------------------------
    @property
    def ctx(self) -> PlanContext:
        return self._ctx

    @property
    def mode(self) -> Hashable:
        """The communicator's mode (e.g. blocking/nonblocking), part of what a plan assumes."""
        return self._mode

    @property
    def generation(self) -> int:
        """Bumped by every clear: a prepared call resolved under an older one re-plans."""
        return self._generation

    def set_context(self, ctx: PlanContext, mode: Any = ...) -> None:
        """A new planning context (and mode, when given): every cached call is dropped."""
        if not isinstance(ctx, PlanContext):
            raise TypeError(f"ctx: expected a PlanContext, got {type(ctx).__name__}")
        self._ctx = ctx
        self._ctx_group = dataclasses.replace(ctx, in_group=True)
        self._device = ctx.device
        if mode is not ...:
            self._mode = mode
        self.clear()

    def clear(self) -> None:
        """Drop every cached call (close, abort, finalize, split, a new context)."""
        self._generation += 1
        self._cache.clear()
        self._configured.clear()
        self.hot.clear()

    def __len__(self) -> int:
        return len(self._cache)

    # -- resolving ----------------------------------------------------------------------------
    def resolve(self, name: str, stream: Any, a: Any, b: Any = None,
                params: Tuple[Any, ...] = (), config: Any = None) -> Resolved:
        """Resolve call ``name`` on buffers ``a``, ``b`` (None where absent) with the other
        arguments ``params`` in the planner's order, on ``stream`` (None: the default stream
        of the first buffer's framework); ``config``: a CollConfig (the nccl*Config calls)."""
        if config is not None:
            return self._resolve_config(name, stream, a, b, params, config)
        in_group = group_depth() > 0
        get = _KEYERS.get
        key_a = get(type(a)) or keyer(type(a))
        if key_a is _cai:   # a __cuda_array_interface__ producer: read its export once
            return self._resolve_cai(name, stream, a, b, params, in_group)
        try:
            if stream is None:
                first = a if a is not None and type(a) is not list and type(a) is not tuple \
                    else first_buffer(a, b)
                s = default_stream_of(first, self._device)
            else:
                s = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
        except Exception:   # a bad stream, or no default for a bad buffer: planning says first
            return self._full(None, name, stream, a, b, params, in_group, None)
        try:
            key = (name, s, in_group, key_a(a),
                   None if b is None else (get(type(b)) or keyer(type(b)))(b),
                   _params_key(params))
            r = self._cache.get(key)
        except Exception:   # Uncacheable, an unhashable part, an object that cannot be read
            key = r = None
        if r is None:
            r = self._full(key, name, stream, a, b, params, in_group, s)
        return r

    def _resolve_config(self, name: str, stream: Any, a: Any, b: Any, params: Tuple[Any, ...],
                        config: Any) -> Resolved:
        """:meth:`resolve` with a per-collective config: planned as without, then each call
        made its config variant (:func:`ncclpy.plan.collconfig.with_config`); cached under the
        plain call's key plus the config."""
        check_config_arg(config, name)
        misses = self.misses
        r = self.resolve(name, stream, a, b, params)
        key = (r, config)
        got = self._configured.get(key)
        if got is None:
            got = Resolved(with_config(r.plan, config, self._ctx.nccl_version), r.stream,
                           r.in_group)
            if self.misses == misses:     # the plain call was a cache hit: r is kept
                if len(self._configured) >= self._maxsize:
                    self._configured.clear()
                self._configured[key] = got
        return got

    def _resolve_cai(self, name: str, stream: Any, a: Any, b: Any, params: Tuple[Any, ...],
                     in_group: bool) -> Resolved:
        """:meth:`resolve` when ``a`` exports ``__cuda_array_interface__`` (type kind
        'other'): the export is read once and gives the default stream, ``a``'s key and, on
        a miss, ``a``'s parse (every check of :func:`ncclpy.buffers.buffer.from_cai`)."""
        try:
            cai = a.__cuda_array_interface__
            if type(cai) is not dict:
                raise Uncacheable("unusual __cuda_array_interface__")
            if stream is None:
                s = cai_stream(cai)
                if s is None:
                    s = cupy_stream(self._device)
            else:
                s = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
        except Exception:   # no export, an odd one, a bad stream: the general path says what
            return self._full(None, name, stream, a, b, params, in_group, None)
        get = _KEYERS.get
        try:
            key = (name, s, in_group, cai_key(a, cai),
                   None if b is None else (get(type(b)) or keyer(type(b)))(b),
                   _params_key(params))
            r = self._cache.get(key)
        except Exception:
            key = r = None
        if r is None:
            r = self._full(key, name, stream, a, b, params, in_group, s, cai)
        return r

    def _full(self, key: Any, name: str, stream: Any, a: Any, b: Any,
              params: Tuple[Any, ...], in_group: bool, s: Optional[int],
              cai: Optional[dict] = None) -> Resolved:
        """A miss: parse and plan in full (every check), then resolve the stream if that
        failed before, and keep the result under ``key`` (None: not kept).  ``cai``: ``a``'s
        ``__cuda_array_interface__`` export when the caller has read it already."""
        gen = self._generation
        self.misses += 1
        try:
            planner, names = PLANNERS[name]
        except KeyError:
            raise ValueError(f"unknown call {name!r}; expected one of "
                             f"{', '.join(PLANNERS)}") from None
        ctx = self._ctx_group if in_group else self._ctx
        sa = _parse(a, names[0]) if cai is None else from_cai(a, cai, names[0])
        if len(names) == 1:
            plan = planner(ctx, sa, *params)
        else:
            sb = None if b is None else _parse(b, names[1])
            # one parameter (op, root, peer): a plain call, cheaper than unpacking *params
            plan = planner(ctx, sa, sb, params[0]) if len(params) == 1 else \
                planner(ctx, sa, sb, *params)
        if s is None:
            s = default_stream_of(first_buffer(a, b), self._device) if stream is None \
                else stream_handle(stream)
        r = Resolved(plan, s, in_group)
        if key is not None and gen == self._generation:
            cache = self._cache
            if len(cache) >= self._maxsize:     # drop the oldest entry
                try:
                    del cache[next(iter(cache))]
                except (KeyError, RuntimeError, StopIteration):  # another thread got there
                    pass
            cache[key] = r
        return r

    def parse(self, name: str, a: Any, b: Any = None) -> Tuple[Any, ...]:
        """The call's buffers parsed (:func:`ncclpy.buffers.buffer.as_buffer`), named as the
        communicator's method names them."""
        try:
            names = PLANNERS[name][1]
        except KeyError:
            raise ValueError(f"unknown call {name!r}; expected one of "
                             f"{', '.join(PLANNERS)}") from None
        if len(names) == 1:
            return (_parse(a, names[0]),)
        return (_parse(a, names[0]), _parse(b, names[1]))

    def plan(self, name: str, specs: Tuple[Any, ...], params: Tuple[Any, ...] = (),
             in_group: bool = False) -> Plan:
        """Plan ``name`` on parsed ``specs`` with ``params`` (pure; every check)."""
        planner = PLANNERS[name][0]
        return planner(self._ctx_group if in_group else self._ctx, *specs, *params)
