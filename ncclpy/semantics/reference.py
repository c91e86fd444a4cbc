"""A numpy definition of every collective in :mod:`ncclpy.registry`, matching NCCL's
semantics.

Every function maps per-rank inputs to per-rank outputs: ``outputs[r]`` is what rank r's output
buffer holds after the call, or ``None`` where NCCL leaves it undefined or never writes it (each
docstring says which).  Arrays are numpy arrays of the *logical* dtype; bfloat16 and float8 travel
as their unsigned-integer view with ``dtype=`` naming them, complex32 as float16 pairs (a trailing
axis of 2, like ``torch.view_as_real``).  Common keywords: ``op``, ``root``, ``dtype``,
``world_size`` (default ``len(inputs)``), ``in_place``, ``send_counts``, and ``axis`` (the axis
blocks are cut along or joined on; 0 is NCCL's contiguous layout, 1 gives the "column" variants of
torch's list forms followed by ``torch.cat(dim=1)``).

Reductions (the contract :mod:`ncclpy.check` compares against):

* Order: a left fold in rank order, ``((x0 op x1) op x2) ...``, each step computed exactly and
  rounded once to the dtype (round-to-nearest-even; float8 saturating like NCCL's
  ``__NV_SATFINITE`` kernels).  NCCL's real order depends on the algorithm (ring, tree, NVLS) and
  the protocol, so a bitwise equality with NCCL is claimed only for inputs whose every partial
  result is exact (integers; floats built from small integer mantissas at a shared exponent, see
  :func:`ncclpy.semantics.numerics.verifiable_input`).  For other inputs compare with a ULP
  tolerance.
* Integers wrap (two's complement / unsigned modular arithmetic), as the C kernels do.
* MIN/MAX (NCCL ``FuncMinMax``, src/device/reduce_kernel.h): integers compare as their type;
  float/double use ``fminf``/``fmaxf``/``fmin``/``fmax``, half and bfloat16 ``__hmin``/``__hmax``
  (sm80+), float8 goes through half.  All of them return the number when one operand is NaN,
  which the reference does too.  Two cases are *not* pinned down and the reference makes no bit
  claim for them: a NaN against a NaN (CUDA may return a canonical NaN, the reference keeps the
  accumulator's payload) and a tie of +0 against -0 (the sign CUDA's min/max picks is not
  documented for every type; the reference keeps the accumulator).  ``ncclpy check``'s inputs
  never contain NaN or -0 for MIN/MAX (:func:`ncclpy.semantics.numerics.verifiable_values`).
* AVG: integers: the wrapped sum, then division by n truncating toward zero (NCCL's
  ``FuncSumPostDiv``).  Floats: ``ncclDevPreMulSum`` with ``1/n`` computed in double, converted to
  float, then to the dtype (``__float2half(float(1.0/n))`` etc.): each input is multiplied by that
  rounded scalar (rounded again), then the products are summed.  (This is what NCCL <= 2.32 does:
  its device code has SumPostDiv kernels for integers only.)
* PREMUL_SUM(s): the scalar is converted to the dtype exactly as ncclpy hands it to NCCL
  (:func:`ncclpy.semantics.scalars.encode_scalar`: floats narrower than float32 go through float32;
  integer dtypes take only an integral, in-range scalar and refuse others with the library's
  ArgumentError), each input is multiplied by it in the dtype, and the products are summed.
* bool (torch's mapping): the bytes are reduced as uint8 with SUM -> MAX and PROD -> MIN;
  AVG and PREMUL_SUM are refused.  Complex: reduced as the pairs of reals, SUM/AVG/PREMUL_SUM only.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from . import numerics as nm
from .dtypes import DTYPES, LOGICAL, dtype_name
from ..errors import ArgumentError, UnsupportedError
from .ops import RedOp, effective_op
from .scalars import encode_scalar

__all__ = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
           "gather", "scatter", "send_recv", "barrier", "reduce_arrays", "avg_scalar_bits",
           "premul_scalar_bits"]

Outputs = List[Optional[np.ndarray]]


# -- helpers --------------------------------------------------------------------------------
def _infer_dtype(inputs: Sequence[Any], dtype: Any) -> str:
    if dtype is not None:
        return dtype_name(dtype)
    for x in inputs:
        if x is not None:
            a = np.asarray(x)
            if a.dtype == np.uint16:
                raise ArgumentError("dtype: uint16 arrays are bit views (bfloat16?); pass dtype=")
            return dtype_name(a.dtype)
    raise ArgumentError("dtype: every input is None and no dtype= was given")


def _prep(inputs: Sequence[Any], dtype: Any, world_size: Optional[int],
          need: Optional[Sequence[int]] = None) -> tuple:
    """(list of numpy arrays or None, dtype name, n)."""
    if isinstance(inputs, np.ndarray) or not isinstance(inputs, Sequence):
        raise ArgumentError(f"inputs: expected a list with one array per rank, got "
                            f"{type(inputs).__name__}")
    n = len(inputs) if world_size is None else int(world_size)
    if n < 1 or len(inputs) != n:
        raise ArgumentError(f"inputs: expected {n} per-rank arrays (world_size), got "
                            f"{len(inputs)}")
    name = _infer_dtype(inputs, dtype)
    arrs = [None if x is None else np.ascontiguousarray(x) for x in inputs]
    for r in (range(n) if need is None else need):
        if arrs[r] is None:
            raise ArgumentError(f"inputs[{r}]: rank {r}'s input is required, got None")
    return arrs, name, n


def _check_root(root: int, n: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ArgumentError(f"root: expected a rank in 0..{n - 1}, got {root!r}")
    return int(root)


def _no_op(op: Any, what: str) -> None:
    if op is not None:
        raise ArgumentError(f"op: {what} takes no reduction, got {op!r}")


def _same_shapes(arrs: Sequence[Optional[np.ndarray]], what: str) -> tuple:
    shapes = {a.shape for a in arrs if a is not None}
    if len(shapes) > 1:
        raise ArgumentError(f"inputs: {what} needs the same shape on every rank, got "
                            f"{sorted(shapes)}")
    return next(iter(shapes)) if shapes else (0,)


def _wire(arr: np.ndarray, name: str) -> np.ndarray:
    """Flat wire bits (uint view) of a logical array."""
    return nm.as_bits(arr, name).reshape(-1)


def _logical(bits: np.ndarray, name: str, shape: tuple) -> np.ndarray:
    """A logical array of ``shape`` from flat wire bits."""
    if name == "complex32":
        return bits.view(np.float16).reshape(shape)
    return nm.from_bits(bits, name).reshape(shape)


def _split(a: np.ndarray, n: int, axis: int, what: str) -> List[np.ndarray]:
    if a.ndim == 0:
        raise ArgumentError(f"{what}: a 0-d input cannot be cut into {n} blocks")
    if a.shape[axis] % n:
        raise ArgumentError(f"{what}: the input's size along axis {axis} ({a.shape[axis]}) is "
                            f"not a multiple of world_size={n}")
    return [np.ascontiguousarray(b) for b in np.split(a, n, axis=axis)]


def _concat(blocks: Sequence[np.ndarray], axis: int) -> np.ndarray:
    if blocks[0].ndim == 0:
        return np.stack(blocks)
    return np.ascontiguousarray(np.concatenate(blocks, axis=axis))


# -- scalars --------------------------------------------------------------------------------
def _is_fp8(wire: str) -> bool:
    return wire.startswith("float8")


def avg_scalar_bits(wire: str, n: int) -> np.ndarray:
    """The bits of NCCL's AVG premultiplier 1/n for float wire type ``wire``: computed in double,
    converted to float, then to the type (float64 keeps the double)."""
    if wire == "float64":
        return nm.encode(np.array([1.0 / n]), wire)
    f32 = np.array([1.0 / n], dtype=np.float64).astype(np.float32)
    return nm.encode(f32, wire, saturate=True if _is_fp8(wire) else None)


def premul_scalar_bits(wire: str, scalar: float) -> np.ndarray:
    """The bits of the premul_sum scalar in wire type ``wire``: exactly the element ncclpy passes
    to ``ncclRedOpCreatePreMulSum`` (:func:`ncclpy.semantics.scalars.encode_scalar`, so the two
    agree by construction).  Raises the library's ArgumentError for a scalar it refuses (a
    non-integral or out-of-range value on an integer type, a finite value that overflows)."""
    w = DTYPES[wire]
    raw = encode_scalar(scalar, wire)
    return np.frombuffer(raw, dtype=np.dtype(w.view).newbyteorder("<")).astype(w.view)


def _scalar(wire: str, o: RedOp, scalar_bits: Optional[int]) -> np.ndarray:
    if scalar_bits is None:
        return premul_scalar_bits(wire, o.scalar)
    return np.array([int(scalar_bits)], dtype=np.uint64).astype(DTYPES[wire].view)


# -- the fold -------------------------------------------------------------------------------
def _trunc_div(acc: np.ndarray, wire: str, n: int) -> np.ndarray:
    """NCCL FuncSumPostDiv::divide: |x| // n with the sign kept (C truncation), on wrapped ints."""
    w = DTYPES[wire]
    u = acc.view(w.view)
    if w.kind == "uint":
        return (u // np.array(n, dtype=w.view)).view(wire)
    neg = acc < 0
    zero = np.zeros((), dtype=w.view)
    mag = np.where(neg, zero - u, u)
    q = mag // np.array(n, dtype=w.view)
    return np.where(neg, zero - q, q).astype(w.view).view(wire)


def _round_vals(v: np.ndarray, wire: str) -> np.ndarray:
    """Round float64 values to ``wire`` (one rounding) and return the bits."""
    return nm.encode(v, wire, saturate=True if _is_fp8(wire) else None)


def reduce_arrays(arrays: Sequence[np.ndarray], op: Any, dtype: Any,
                  world_size: Optional[int] = None, *,
                  scalar_bits: Optional[int] = None) -> np.ndarray:
    """Element-wise reduction of equally shaped logical arrays with NCCL's semantics (see the
    module docstring); the left fold in list order.  ``world_size`` (default ``len(arrays)``)
    is the n of AVG.  ``scalar_bits`` (premul_sum only): the raw wire bits NCCL is handed as
    the scalar instead of the encoded ``op.scalar`` (to model a caller passing other bytes,
    e.g. torch's bfloat16 PREMUL_SUM)."""
    name = dtype_name(dtype)
    lg = LOGICAL[name]
    o: RedOp = effective_op(op, name)
    n = len(arrays) if world_size is None else int(world_size)
    if not arrays:
        raise ArgumentError("reduce: no inputs")
    shape = _same_shapes(arrays, "a reduction")
    wire = lg.wire.name
    w = DTYPES[wire]
    bits = [_wire(a, name) for a in arrays]
    if name == "bool":
        bad = [r for r, b in enumerate(bits) if b.size and b.max() > 1]
        if bad:
            raise ArgumentError(f"inputs: bool inputs must hold bytes 0/1 (rank {bad[0]} does not)")
    if w.kind != "float":
        vals = [b.view(wire) for b in bits]
        if o.name == "premul_sum":
            s = _scalar(wire, o, scalar_bits).view(wire)[0]
            vals = [v * s for v in vals]
        acc = vals[0].copy()
        for v in vals[1:]:
            if o.name in ("sum", "avg", "premul_sum"):
                acc = acc + v
            elif o.name == "prod":
                acc = acc * v
            elif o.name == "max":
                acc = np.maximum(acc, v)
            elif o.name == "min":
                acc = np.minimum(acc, v)
            else:  # pragma: no cover - effective_op only returns the names above
                raise UnsupportedError(f"op {o!r}")
        if o.name == "avg":
            acc = _trunc_div(acc, wire, n)
        return _logical(acc.view(w.view), name, shape)

    # floats: exact value in float64, one rounding per step
    fvals = [nm.decode(b, wire) for b in bits]
    if o.name in ("avg", "premul_sum"):
        sb = avg_scalar_bits(wire, n) if o.name == "avg" else _scalar(wire, o, scalar_bits)
        s = nm.decode(sb, wire)[0]
        with np.errstate(all="ignore"):
            fvals = [nm.decode(_round_vals(v * s, wire), wire) for v in fvals]
    acc_bits = _round_vals(fvals[0], wire) if o.name in ("avg", "premul_sum") else bits[0]
    acc = nm.decode(acc_bits, wire)
    for v, vb in zip(fvals[1:], bits[1:]):
        with np.errstate(all="ignore"):
            if o.name in ("sum", "avg", "premul_sum"):
                acc_bits = _round_vals(acc + v, wire)
            elif o.name == "prod":
                acc_bits = _round_vals(acc * v, wire)
            elif o.name in ("max", "min"):
                better = (v > acc) if o.name == "max" else (v < acc)
                take = better | (np.isnan(acc) & ~np.isnan(v))
                acc_bits = np.where(take, vb, acc_bits)
            else:  # pragma: no cover
                raise UnsupportedError(f"op {o!r}")
        acc = nm.decode(acc_bits, wire)
    return _logical(np.asarray(acc_bits, dtype=w.view), name, shape)


# -- collectives ----------------------------------------------------------------------------
def all_reduce(inputs: Sequence[Any], *, op: Any = "sum", root: int = 0, dtype: Any = None,
               world_size: Optional[int] = None, in_place: bool = False,
               send_counts: Any = None) -> Outputs:
    """Every rank gets ``op`` over all inputs (same values in and out of place)."""
    arrs, name, n = _prep(inputs, dtype, world_size)
    res = reduce_arrays(arrs, op, name, n)
    return [res.copy() for _ in range(n)]


def reduce(inputs: Sequence[Any], *, op: Any = "sum", root: int = 0, dtype: Any = None,
           world_size: Optional[int] = None, in_place: bool = False,
           send_counts: Any = None) -> Outputs:
    """``root`` gets ``op`` over all inputs.  Other ranks' output buffers are never written by
    NCCL: out of place their output is ``None`` (whatever the caller had there); in place the
    buffer is the send buffer, so it still holds the rank's input (returned as a copy)."""
    arrs, name, n = _prep(inputs, dtype, world_size)
    root = _check_root(root, n)
    res = reduce_arrays(arrs, op, name, n)
    return [res if r == root else (arrs[r].copy() if in_place else None) for r in range(n)]


def broadcast(inputs: Sequence[Any], *, op: Any = None, root: int = 0, dtype: Any = None,
              world_size: Optional[int] = None, in_place: bool = False,
              send_counts: Any = None) -> Outputs:
    """Every rank gets ``root``'s input; other ranks' inputs are ignored and may be None."""
    _no_op(op, "broadcast")
    n0 = len(inputs) if world_size is None else world_size
    root = _check_root(root, n0)
    arrs, name, n = _prep(inputs, dtype, world_size, need=[root])
    return [arrs[root].copy() for _ in range(n)]


def all_gather(inputs: Sequence[Any], *, op: Any = None, root: int = 0, dtype: Any = None,
               world_size: Optional[int] = None, in_place: bool = False,
               send_counts: Any = None, axis: int = 0) -> Outputs:
    """Every rank gets all inputs joined in rank order along ``axis`` (NCCL: concatenated;
    in place, rank r's input already sits at block r of its output: same values)."""
    _no_op(op, "all_gather")
    arrs, name, n = _prep(inputs, dtype, world_size)
    _same_shapes(arrs, "all_gather")
    out = _concat(arrs, axis)
    return [out.copy() for _ in range(n)]


def reduce_scatter(inputs: Sequence[Any], *, op: Any = "sum", root: int = 0, dtype: Any = None,
                   world_size: Optional[int] = None, in_place: bool = False,
                   send_counts: Any = None, axis: int = 0) -> Outputs:
    """Rank r gets block r (of n equal blocks along ``axis``) of ``op`` over all inputs; in
    place the output is block r of the rank's own send buffer: same values."""
    arrs, name, n = _prep(inputs, dtype, world_size)
    _same_shapes(arrs, "reduce_scatter")
    blocks_per_rank = [_split(a, n, axis, "reduce_scatter") for a in arrs]
    return [reduce_arrays([blocks_per_rank[s][r] for s in range(n)], op, name, n)
            for r in range(n)]


def all_to_all(inputs: Sequence[Any], *, op: Any = None, root: int = 0, dtype: Any = None,
               world_size: Optional[int] = None, in_place: bool = False,
               send_counts: Any = None, axis: int = 0) -> Outputs:
    """Block d of rank s's input becomes block s of rank d's output.

    Even split: n equal blocks along ``axis``.  Uneven: ``send_counts[s][d]`` elements (along
    axis 0 of a 1-D input) go from rank s to rank d, blocks taken in order; rank d's output is
    the blocks it receives, in sender order (so recv_counts[d][s] == send_counts[s][d]).  In
    place gives the same values (NCCL has no in-place all-to-all; ncclpy stages it).
    """
    _no_op(op, "all_to_all")
    arrs, name, n = _prep(inputs, dtype, world_size)
    if send_counts is None:
        _same_shapes(arrs, "all_to_all")
        blocks = [_split(a, n, axis, "all_to_all") for a in arrs]
        return [_concat([blocks[s][d] for s in range(n)], axis) for d in range(n)]
    counts = [[int(c) for c in row] for row in send_counts]
    if len(counts) != n or any(len(row) != n for row in counts):
        raise ArgumentError(f"send_counts: expected an {n}x{n} table (send_counts[s][d]), got "
                            f"{send_counts!r}")
    if any(c < 0 for row in counts for c in row):
        raise ArgumentError(f"send_counts: counts must be >= 0, got {send_counts!r}")
    blocks = []
    for s, a in enumerate(arrs):
        if a.ndim != 1 and name != "complex32":
            a = a.reshape(-1)
        if a.shape[0] != sum(counts[s]):
            raise ArgumentError(f"inputs[{s}]: holds {a.shape[0]} elements but send_counts[{s}] "
                                f"adds up to {sum(counts[s])}")
        offs = np.cumsum([0] + counts[s])
        blocks.append([a[offs[d]:offs[d + 1]] for d in range(n)])
    return [np.ascontiguousarray(np.concatenate([blocks[s][d] for s in range(n)], axis=0))
            for d in range(n)]


def gather(inputs: Sequence[Any], *, op: Any = None, root: int = 0, dtype: Any = None,
           world_size: Optional[int] = None, in_place: bool = False, send_counts: Any = None,
           axis: int = 0) -> Outputs:
    """``root`` gets all inputs joined in rank order along ``axis``; the other ranks have no
    output (None: NCCL ignores their receive buffer)."""
    _no_op(op, "gather")
    arrs, name, n = _prep(inputs, dtype, world_size)
    root = _check_root(root, n)
    _same_shapes(arrs, "gather")
    return [_concat(arrs, axis) if r == root else None for r in range(n)]


def scatter(inputs: Sequence[Any], *, op: Any = None, root: int = 0, dtype: Any = None,
            world_size: Optional[int] = None, in_place: bool = False, send_counts: Any = None,
            axis: int = 0) -> Outputs:
    """Rank r gets block r (of n equal blocks along ``axis``) of ``root``'s input; the other
    ranks' inputs are ignored and may be None."""
    _no_op(op, "scatter")
    n0 = len(inputs) if world_size is None else world_size
    root = _check_root(root, n0)
    arrs, name, n = _prep(inputs, dtype, world_size, need=[root])
    return _split(arrs[root], n, axis, "scatter")


def send_recv(inputs: Sequence[Any], *, op: Any = None, root: int = 0, dtype: Any = None,
              world_size: Optional[int] = None, in_place: bool = False, send_counts: Any = None,
              shift: int = 1, pairs: Optional[Sequence[Sequence[int]]] = None) -> Outputs:
    """Point to point.  Default: a ring shift, rank r sends to (r+shift) % n and receives from
    (r-shift) % n, so ``outputs[r] = inputs[(r - shift) % n]``.

    ``pairs=[(src, dst), ...]``: only those transfers; a rank that receives nothing has output
    None, or, ``in_place`` (one buffer per rank used to send and to receive, as in
    ``dist.send(t)`` / ``dist.recv(t)``), its own input.  Ranks that only receive may pass None.
    """
    _no_op(op, "send_recv")
    if pairs is None:
        arrs, name, n = _prep(inputs, dtype, world_size)
        _same_shapes(arrs, "send_recv")
        return [arrs[(r - shift) % n].copy() for r in range(n)]
    n0 = len(inputs) if world_size is None else world_size
    srcs = sorted({int(s) for s, _ in pairs})
    arrs, name, n = _prep(inputs, dtype, world_size, need=srcs)
    out: Outputs = [arrs[r].copy() if (in_place and arrs[r] is not None) else None
                    for r in range(n)]
    seen = set()
    for s, d in pairs:
        s, d = int(s), int(d)
        if not (0 <= s < n0 and 0 <= d < n0) or s == d:
            raise ArgumentError(f"pairs: ({s}, {d}) is not a transfer between two ranks of "
                                f"0..{n0 - 1}")
        if d in seen:
            raise ArgumentError(f"pairs: rank {d} receives twice")
        seen.add(d)
        out[d] = arrs[s].copy()
    return out


def barrier(inputs: Optional[Sequence[Any]] = None, *, op: Any = None, root: int = 0,
            dtype: Any = None, world_size: Optional[int] = None, in_place: bool = False,
            send_counts: Any = None, arrivals: Optional[Sequence[float]] = None) -> list:
    """No rank leaves before every rank has entered.  No data moves: given each rank's arrival
    time (``arrivals``, or ``inputs`` as a list of numbers), returns the earliest time each rank
    may leave, ``max(arrivals)`` for every rank; without times, a list of None."""
    _no_op(op, "barrier")
    times = arrivals if arrivals is not None else inputs
    if times is None:
        if world_size is None:
            raise ArgumentError("barrier: give arrivals= (one time per rank) or world_size=")
        return [None] * int(world_size)
    t = [float(x) for x in times]
    if world_size is not None and len(t) != world_size:
        raise ArgumentError(f"arrivals: expected {world_size} times, got {len(t)}")
    latest = max(t) if t else 0.0
    return [latest] * len(t)
