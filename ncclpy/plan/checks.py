"""Argument checks shared by the planners: buffers, dtypes, ops, ranks, sizes.

Every check raises an ncclpy error whose message starts with the collective's name, names the
argument, what was given and what was expected.  Nothing here touches a GPU.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..buffers import buffer as _buffers
from ..buffers.buffer import DEVICE_HOST, DEVICE_UNKNOWN, HOST_HINT, BufferSpec, as_buffer
from ..semantics.dtypes import DType, Logical, LOGICAL, nccl_dtype
from ..errors import (U64_MAX, ArgumentError, ArgumentTypeError, NcclpyError, UnsupportedError,
                      as_int)
from ..semantics.ops import NCCL_OPS, RedOp, effective_op
from ..semantics.scalars import encode_scalar
from .types import PREMUL_OP, NcclCall, Plan, PlanContext, PremulSpec, Step

_ADDRESS_END = U64_MAX + 1

__all__ = ["Wire", "check_ctx", "buf", "buf_list", "wire", "reduction", "rank_arg",
           "same_dtype", "expect_count", "divisible", "overlaps", "adjacent", "counts_arg",
           "self_overlap", "cross_overlap", "make_plan", "one_call", "is_list", "same_list",
           "region", "sub", "disjoint_outputs"]


def check_ctx(ctx: PlanContext, coll: str) -> None:
    """The context itself must be sane (a wrong one would plan wrong calls)."""
    if not isinstance(ctx, PlanContext):
        raise ArgumentTypeError(f"{coll}: ctx must be a PlanContext, got {type(ctx).__name__}")
    if ctx.world_size < 1 or not 0 <= ctx.rank < ctx.world_size:
        raise ArgumentError(f"{coll}: PlanContext rank {ctx.rank} / world_size "
                            f"{ctx.world_size} is inconsistent; expected world_size >= 1 and "
                            f"0 <= rank < world_size")


def buf(ctx: PlanContext, coll: str, name: str, b: Any, *, output: bool = False) -> BufferSpec:
    """Parse (if needed) and check one buffer: device memory on the communicator's device,
    contiguous, a known dtype, writable when it is an output."""
    if type(b) is BufferSpec:
        spec = b
    else:
        if isinstance(b, (list, tuple)):
            raise ArgumentTypeError(f"{coll}: {name} must be one buffer here, got a "
                                    f"{type(b).__name__} of {len(b)}")
        spec = b if isinstance(b, BufferSpec) else as_buffer(b, f"{coll}: {name}")
    if spec.dtype not in LOGICAL:
        raise UnsupportedError(f"{coll}: {name} has dtype {spec.dtype!r}; expected one of "
                               f"{', '.join(LOGICAL)}")
    count, ptr, device = spec.count, spec.ptr, spec.device
    if count < 0 or ptr < 0:
        raise ArgumentError(f"{coll}: {name} has count {count} / ptr {ptr}; "
                            f"expected non-negative values")
    if count and not ptr:
        raise ArgumentError(f"{coll}: {name} has {count} elements but a NULL pointer")
    if ptr + count * LOGICAL[spec.dtype].itemsize > _ADDRESS_END:
        raise ArgumentError(f"{coll}: {name} at ptr {ptr:#x} with {count} elements ends past the "
                            f"64-bit address space; expected a pointer and count that fit 64 "
                            f"bits (ctypes would wrap them silently)")
    if device != DEVICE_UNKNOWN and device != ctx.device:
        if device != DEVICE_HOST:
            raise ArgumentError(f"{coll}: {name} is on device {device} but the communicator "
                                f"is on device {ctx.device}; expected a buffer on device "
                                f"{ctx.device}")
        if not _buffers._host:          # host memory mode: host memory is what it wants
            raise ArgumentError(f"{coll}: {name} is in host memory (device -1); NCCL needs "
                                f"device memory on device {ctx.device}{HOST_HINT}")
    if not spec.contiguous:
        raise ArgumentError(f"{coll}: {name} is not contiguous (shape {spec.shape}); NCCL "
                            f"needs one contiguous block")
    if output and spec.readonly:
        raise ArgumentError(f"{coll}: {name} is read-only but is written by this call; "
                            f"expected a writable buffer")
    return spec


def buf_list(ctx: PlanContext, coll: str, name: str, bs: Sequence[Any], *,
             output: bool = False) -> List[BufferSpec]:
    """A list form: exactly world_size buffers, each checked."""
    if len(bs) != ctx.world_size:
        raise ArgumentError(f"{coll}: {name} is a list of {len(bs)} buffers; expected one per "
                            f"rank, world_size ({ctx.world_size})")
    return [buf(ctx, coll, f"{name}[{i}]", b, output=output) for i, b in enumerate(bs)]


@dataclass(frozen=True)
class Wire:
    """How a logical dtype travels: NCCL type, elements per logical element, bytes each."""

    logical: Logical
    dtype: DType

    def __post_init__(self) -> None:
        # plain attributes, not properties: a Wire is memoised and read by every cold call
        object.__setattr__(self, "factor", self.logical.factor)   # NCCL elements per element
        object.__setattr__(self, "nccl", self.dtype.nccl)         # the ncclDataType_t
        object.__setattr__(self, "itemsize", self.logical.itemsize)  # bytes per element

    def count(self, elements: int) -> int:
        """NCCL count for ``elements`` logical elements."""
        return elements * self.factor


#: (logical dtype, NCCL version) -> Wire; and (type(op), op, dtype, version) -> reduction.
#: Both are pure functions of their (hashable, value-compared) keys; failures are never
#: stored, so a bad dtype or op is checked, and refused, on every call.
_WIRES: Dict[Tuple[str, int], Wire] = {}
_REDUCTIONS: Dict[Tuple[Any, ...], Tuple[Any, Optional[PremulSpec], RedOp]] = {}
_OP_TYPES = (str, int)   # exact types whose equality is their value (not bool, float)
_MEMO_MAX = 1024


def _remember(memo: Dict[Any, Any], key: Any, value: Any) -> None:
    if len(memo) >= _MEMO_MAX:
        memo.clear()
    memo[key] = value


def wire(ctx: PlanContext, coll: str, dtype: str) -> Wire:
    """The wire type of ``dtype``, gated on the context's NCCL version."""
    key = (dtype, ctx.nccl_version)
    w = _WIRES.get(key)
    if w is None:
        try:
            d = nccl_dtype(dtype, ctx.nccl_version, ctx.version_note)
        except NcclpyError as e:
            raise type(e)(f"{coll}: {e}") from None
        w = Wire(LOGICAL[dtype], d)
        _remember(_WIRES, key, w)
    return w


def reduction(ctx: PlanContext, coll: str, op: Any, w: Wire) -> Tuple[Any, Optional[PremulSpec],
                                                                       RedOp]:
    """(op argument for the NCCL call, premul spec or None, effective RedOp)."""
    t = type(op)
    key = None
    one = ctx.world_size == 1       # NCCL refuses some (dtype, op) pairs on one rank only
    if t is RedOp:          # by the scalar's exact bits: -0.0 == 0.0 but scales differently
        sc = op.scalar
        if sc is None or type(sc) is int:
            key = (t, op.name, type(sc), sc, w.logical.name, ctx.nccl_version, one)
        elif type(sc) is float:
            key = (t, op.name, struct.pack("<d", sc), w.logical.name, ctx.nccl_version, one)
    elif t in _OP_TYPES:
        key = (t, op, w.logical.name, ctx.nccl_version, one)
    if key is not None:
        hit = _REDUCTIONS.get(key)
        if hit is not None:
            return hit
    try:
        o = effective_op(op, w.logical.name, ctx.nccl_version, ctx.world_size, ctx.version_note)
    except NcclpyError as e:
        raise type(e)(f"{coll}: {e}") from None
    if o.name == "premul_sum":
        try:
            scalar = encode_scalar(o.scalar, w.dtype.name)
        except NcclpyError as e:
            raise type(e)(f"{coll}: {e}") from None
        out: Tuple[Any, Optional[PremulSpec], RedOp] = (PREMUL_OP, PremulSpec(scalar, w.nccl), o)
    else:
        out = (NCCL_OPS[o.name], None, o)
    if key is not None:
        _remember(_REDUCTIONS, key, out)
    return out


def rank_arg(ctx: PlanContext, coll: str, name: str, value: Any) -> int:
    """A root or peer: an int in [0, world_size)."""
    r = as_int(f"{coll}: {name}", value)
    if not 0 <= r < ctx.world_size:
        raise ArgumentError(f"{coll}: {name} {r} is out of range; expected 0 <= {name} < "
                            f"world_size ({ctx.world_size}), i.e. 0..{ctx.world_size - 1}")
    return r


def same_dtype(coll: str, a_name: str, a: BufferSpec, b_name: str, b: BufferSpec) -> None:
    if a.dtype != b.dtype:
        raise ArgumentError(f"{coll}: dtype mismatch: {a_name} is {a.dtype} but {b_name} is "
                            f"{b.dtype}; expected the same dtype")


def expect_count(coll: str, name: str, got: int, want: int, rule: str) -> None:
    """``got == want`` or an error saying which rule gave ``want`` (``rule`` shows the
    arithmetic, e.g. "world_size(4) * sendbuf count(3) = 12"; ``{want}`` in it is filled in
    only when the check fails)."""
    if got != want:
        raise ArgumentError(f"{coll}: {name} has {got} elements; expected "
                            f"{rule.replace('{want}', str(want))}")


def divisible(coll: str, name: str, count: int, n: int, why: str) -> int:
    if count % n:
        raise ArgumentError(f"{coll}: {name} has {count} elements, not divisible by "
                            f"world_size ({n}); {why}")
    return count // n


def overlaps(a_ptr: int, a_bytes: int, b_ptr: int, b_bytes: int) -> bool:
    """Whether two byte ranges share a byte (empty ranges never do)."""
    return a_bytes > 0 and b_bytes > 0 and a_ptr < b_ptr + b_bytes and b_ptr < a_ptr + a_bytes


def adjacent(specs: Sequence[BufferSpec]) -> bool:
    """Whether the buffers are consecutive equal-size views of one region, in rank order
    (all-empty lists count as adjacent: nothing moves)."""
    if not specs:
        return False
    first = specs[0]
    if all(s.count == 0 for s in specs):
        return True
    step = first.nbytes
    return all(s.count == first.count and s.device == first.device and
               s.ptr == first.ptr + i * step for i, s in enumerate(specs))


def self_overlap(intervals: Sequence[Tuple[int, int]]) -> bool:
    """Whether any two (ptr, nbytes) ranges share a byte."""
    iv = sorted((p, n) for p, n in intervals if n > 0)
    end = None
    for p, n in iv:
        if end is not None and p < end:
            return True
        end = p + n if end is None else max(end, p + n)
    return False


def cross_overlap(a: Sequence[Tuple[int, int]], b: Sequence[Tuple[int, int]]) -> bool:
    """Whether a range of ``a`` shares a byte with a range of ``b`` (sweep over starts)."""
    iv = sorted([(p, n, 0) for p, n in a if n > 0] + [(p, n, 1) for p, n in b if n > 0])
    max_end = [None, None]
    for p, n, k in iv:
        other = max_end[1 - k]
        if other is not None and other > p:
            return True
        max_end[k] = p + n if max_end[k] is None else max(max_end[k], p + n)
    return False


def counts_arg(ctx: PlanContext, coll: str, name: str, counts: Any) -> List[int]:
    """Per-rank element counts: a sequence of world_size non-negative ints."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        raise ArgumentTypeError(f"{coll}: {name} must be a sequence of {ctx.world_size} ints "
                                f"(one per rank), got {counts!r}")
    if len(counts) != ctx.world_size:
        raise ArgumentError(f"{coll}: {name} has {len(counts)} entries; expected one per rank, "
                            f"world_size ({ctx.world_size})")
    out = []
    for i, c in enumerate(counts):
        v = as_int(f"{coll}: {name}[{i}]", c, 0, U64_MAX)
        out.append(v)
    return out



def make_plan(coll: str, steps: Sequence[Step], *, group: bool = False, premul=None,
              scratch: int = 0, path: str = "native", nbytes: int = 0, **meta: Any) -> Plan:
    """A Plan; ``group`` only when there is an NCCL call to group; ``meta`` -> Plan.meta."""
    steps = tuple(steps)
    group = group and any(isinstance(s, NcclCall) for s in steps)
    return Plan(coll, steps, group, premul, scratch, path, nbytes, meta)


def one_call(coll: str, call: NcclCall, nbytes: int, meta: dict, premul=None,
             path: str = "native") -> Plan:
    """The Plan of exactly one NCCL call: ``make_plan`` without its generality, taking
    ``meta`` as a dict (the planners use :func:`~ncclpy.plan.types.one_call_plan`, which also
    builds the call)."""
    return Plan(coll, (call,), False, premul, 0, path, nbytes, meta)


def is_list(x: Any) -> bool:
    """Whether ``x`` is a list form (list or tuple of buffers)."""
    return isinstance(x, (list, tuple))


def same_list(coll: str, name: str, specs: Sequence[BufferSpec], ref: BufferSpec,
              ref_name: str) -> None:
    """Every entry of a list form has the dtype and count of ``ref``."""
    for i, b in enumerate(specs):
        same_dtype(coll, ref_name, ref, f"{name}[{i}]", b)
        expect_count(coll, f"{name}[{i}]", b.count, ref.count,
                     f"the count of {ref_name} ({ref.count})")


def disjoint_outputs(coll: str, name: str, specs: Sequence[BufferSpec]) -> None:
    """The buffers of an output list must not share bytes."""
    if self_overlap([(b.ptr, b.nbytes) for b in specs]):
        raise ArgumentError(f"{coll}: the buffers of {name} overlap each other; expected "
                            f"disjoint output buffers")


def region(specs: Sequence[BufferSpec]) -> BufferSpec:
    """Adjacent list entries as the one buffer they form."""
    f = specs[0]
    n = sum(b.count for b in specs)
    return BufferSpec(f.ptr, n, f.dtype, f.device, (n,), f.framework, True, None,
                      any(b.readonly for b in specs))


def sub(b: BufferSpec, start: int, count: int) -> BufferSpec:
    """Elements ``[start, start+count)`` of ``b`` as a buffer."""
    return BufferSpec(b.offset(start), count, b.dtype, b.device, (count,), b.framework, True)
