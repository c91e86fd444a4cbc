"""Bit-exact numerics for every NCCL data type, in numpy.

numpy has no bfloat16 or float8, so those travel as their unsigned-integer view (``uint16`` /
``uint8``) together with a dtype name.  This module converts between such bit patterns and
float64 without losing a bit, rounds float64 values to every NCCL float format with
round-to-nearest-even (one rounding, from the exact value), measures distances in ULPs, and
builds the verifiable inputs ``ncclpy check`` uses.

Conversions (:func:`encode`) follow torch's conventions by default, which the tests check
against torch element by element:

* float16 / float32: IEEE round-to-nearest-even, overflow to +-inf.
* bfloat16: round-to-nearest-even, overflow to +-inf, NaN -> a quiet NaN of the same sign.
* float8_e4m3 (torch's ``float8_e4m3fn``: no infinities, one NaN code 0x7F per sign): finite
  overflow *and* +-inf saturate to +-448 (torch >= 2.x, like CUDA's ``__NV_SATFINITE``), NaN ->
  0x7F | sign.
* float8_e5m2: IEEE-like round-to-nearest-even, overflow to +-inf, NaN -> 0x7F | sign.

``saturate=True`` gives CUDA's ``__NV_SATFINITE`` for both float8 formats (overflow and inf ->
the largest finite value), which is what NCCL's float8 reduction kernels use; the reference
(:mod:`ncclpy.reference`) rounds with it.

torch converts float64 to bfloat16/float16/float8 *through float32* (two roundings); ``encode``
rounds once from the exact value.  The two agree for every float32-representable source and
for the verifiable inputs; ``via_float32=True`` reproduces torch's double rounding.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .dtypes import DTYPES, LOGICAL, dtype_name
from ..errors import ArgumentError

__all__ = ["FloatFormat", "FORMATS", "encode", "decode", "round_to", "ulp_distance", "max_ulp",
           "as_bits", "from_bits", "is_nan_bits", "mantissa_bits", "verifiable_values",
           "verifiable_input", "rng_for", "EXACT_SCALE_EXP", "exact_plan"]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: ``mbits`` stored mantissa bits, ``ebits`` exponent bits.

    ``finite_top``: the format has no infinity and uses the top exponent for numbers
    (float8_e4m3fn), with only the all-ones pattern as NaN.
    """

    name: str
    ebits: int
    mbits: int
    finite_top: bool = False

    @property
    def nbits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def max_finite(self) -> float:
        if self.finite_top:  # e4m3fn: top exponent usable, mantissa all-ones is NaN
            emax = (1 << self.ebits) - 1 - self.bias
            return (2.0 - 2.0 ** (1 - self.mbits)) * 2.0 ** emax
        emax = (1 << self.ebits) - 2 - self.bias
        return (2.0 - 2.0 ** -self.mbits) * 2.0 ** emax

    @property
    def max_finite_bits(self) -> int:
        if self.finite_top:
            return (1 << (self.ebits + self.mbits)) - 2
        return (((1 << self.ebits) - 2) << self.mbits) | ((1 << self.mbits) - 1)

    @property
    def inf_bits(self) -> Optional[int]:
        return None if self.finite_top else ((1 << self.ebits) - 1) << self.mbits

    @property
    def nan_bits(self) -> int:
        """The positive NaN pattern encode() produces."""
        if self.finite_top:
            return (1 << (self.ebits + self.mbits)) - 1
        if self.nbits == 8:  # e5m2: torch writes 0x7F
            return (1 << (self.ebits + self.mbits)) - 1
        return (((1 << self.ebits) - 1) << self.mbits) | (1 << (self.mbits - 1))

    @property
    def uint(self) -> str:
        return f"uint{self.nbits}"


FORMATS = {
    "float16": FloatFormat("float16", 5, 10),
    "float32": FloatFormat("float32", 8, 23),
    "float64": FloatFormat("float64", 11, 52),
    "bfloat16": FloatFormat("bfloat16", 8, 7),
    "float8_e4m3": FloatFormat("float8_e4m3", 4, 3, finite_top=True),
    "float8_e5m2": FloatFormat("float8_e5m2", 5, 2),
}

#: verifiable float inputs are integers times 2**EXACT_SCALE_EXP (a shared exponent)
EXACT_SCALE_EXP = -2


def _fmt(dtype: Any) -> FloatFormat:
    name = dtype_name(dtype)
    try:
        return FORMATS[name]
    except KeyError:
        raise ArgumentError(f"dtype: expected a float format ({', '.join(FORMATS)}), "
                            f"got {name!r}") from None


def mantissa_bits(dtype: Any) -> int:
    """Precision p (stored mantissa bits + 1) of a float dtype."""
    return _fmt(dtype).mbits + 1


# -- decode ---------------------------------------------------------------------------------
def _decode_scalar(bits: int, f: FloatFormat) -> float:
    sign = -1.0 if bits >> (f.nbits - 1) else 1.0
    e = (bits >> f.mbits) & ((1 << f.ebits) - 1)
    m = bits & ((1 << f.mbits) - 1)
    top = (1 << f.ebits) - 1
    if f.finite_top:
        if e == top and m == (1 << f.mbits) - 1:
            return float("nan")
    elif e == top:
        return sign * float("inf") if m == 0 else float("nan")
    if e == 0:
        return sign * m * 2.0 ** (f.emin - f.mbits)
    return sign * (1.0 + m * 2.0 ** -f.mbits) * 2.0 ** (e - f.bias)


@functools.lru_cache(maxsize=None)
def _table(name: str) -> np.ndarray:
    f = FORMATS[name]
    return np.array([_decode_scalar(b, f) for b in range(1 << f.nbits)], dtype=np.float64)


def decode(bits: Any, dtype: Any) -> np.ndarray:
    """float64 values of the bit patterns ``bits`` (unsigned ints) of float ``dtype``; exact."""
    name = dtype_name(dtype)
    f = _fmt(name)
    b = np.asarray(bits)
    if b.dtype.kind not in "ui":
        raise ArgumentError(f"bits: expected an integer array of {f.uint} patterns, got dtype "
                            f"{b.dtype}")
    b = b.astype(f.uint, copy=False)
    if name == "float64":
        return b.view(np.float64).copy()
    if name == "float32":
        return b.view(np.float32).astype(np.float64)
    if name == "float16":
        return b.view(np.float16).astype(np.float64)
    if name == "bfloat16":
        with np.errstate(invalid="ignore"):
            return (b.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return _table(name)[b]


def _bf16_from_f32(x32: np.ndarray) -> np.ndarray:
    """bfloat16 patterns of float32 values: the classic round-to-nearest-even bit trick."""
    b = np.ascontiguousarray(x32).view(np.uint32)
    r = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = np.isnan(x32)
    r = np.where(nan, (b >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0), r)
    return r.astype(np.uint16)


# -- round / encode -------------------------------------------------------------------------
def _round_generic(x: np.ndarray, f: FloatFormat, saturate: bool) -> np.ndarray:
    """Bit patterns of ``x`` (float64) rounded once, to nearest even, to format ``f``."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros(x.shape, dtype=np.uint64)
    sign = (np.signbit(x)).astype(np.uint64) << np.uint64(f.nbits - 1)
    a = np.abs(x)
    nan = np.isnan(x)
    inf = np.isinf(x)
    fin = ~(nan | inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        af = np.where(fin, a, 0.0)
        _, e2 = np.frexp(af)                         # af = m * 2**e2, m in [0.5, 1)
        t = np.maximum(e2.astype(np.int64) - 1, f.emin)   # exponent of the target binade
        q = np.ldexp(1.0, (t - f.mbits).astype(np.int32))  # quantum there
        r = np.rint(af / q)                          # exact division, RNE to an integer
        val = r * q                                  # the rounded magnitude (exact)
        over = val > f.max_finite
        # encode val: normal if >= 2**emin, else subnormal (r counts quanta of 2**(emin-mbits))
        _, ev = np.frexp(val)
        ev = ev.astype(np.int64) - 1
        normal = val >= 2.0 ** f.emin
        ev_c = np.where(normal, ev, f.emin)
        mant = np.where(normal, np.rint(val / np.ldexp(1.0, (ev_c - f.mbits).astype(np.int32)))
                        - (1 << f.mbits), np.rint(val / 2.0 ** (f.emin - f.mbits)))
        mant = np.where(np.isfinite(mant), mant, 0).astype(np.uint64)
        expf = np.where(normal, ev_c + f.bias, 0)
        expf = np.clip(expf, 0, (1 << f.ebits) - 1).astype(np.uint64)
    body = (expf << np.uint64(f.mbits)) | mant
    if saturate or f.finite_top:
        ovf = np.uint64(f.max_finite_bits)
    else:
        ovf = np.uint64(f.inf_bits)
    if f.finite_top and not saturate:
        # torch's float8_e4m3fn conversion saturates finite overflow and infinities
        ovf = np.uint64(f.max_finite_bits)
    body = np.where(over, ovf, body)
    inf_code = np.uint64(f.max_finite_bits if (saturate or f.finite_top) else f.inf_bits)
    out = np.where(fin, body, np.where(inf, inf_code, np.uint64(f.nan_bits)))
    out = out | sign
    return out.astype(f.uint)


def round_to(values: Any, dtype: Any, *, saturate: Optional[bool] = None,
             via_float32: bool = False) -> np.ndarray:
    """Alias of :func:`encode` (values -> bit patterns of ``dtype``)."""
    return encode(values, dtype, saturate=saturate, via_float32=via_float32)


def encode(values: Any, dtype: Any, *, saturate: Optional[bool] = None,
           via_float32: bool = False) -> np.ndarray:
    """Bit patterns (numpy unsigned-int view) of ``values`` rounded to ``dtype``.

    Float dtypes: round-to-nearest-even once from the exact value of ``values`` (any real
    numpy dtype); see the module docstring for overflow, inf and NaN.  ``saturate``: None keeps
    torch's convention, True gives CUDA's ``__NV_SATFINITE`` (float8 only; float16/bfloat16
    then saturate too).  Integer and bool dtypes: the value cast to the type (wrapping) and
    viewed as unsigned.
    """
    name = dtype_name(dtype)
    lg = LOGICAL[name]
    v = np.asarray(values)
    if name == "bool":
        return (v != 0).astype(np.uint8)
    if name.startswith("complex"):
        raise ArgumentError(f"dtype {name!r}: encode the real pairs with the component dtype "
                            f"{lg.wire.name!r} (e.g. via numpy's .view)")
    w = DTYPES[name]
    if w.kind != "float":
        if v.dtype.kind == "f":
            v = np.trunc(v)
            return v.astype(np.int64 if w.kind == "int" else np.uint64).astype(name).view(w.view)
        return v.astype(name).view(w.view)
    f = FORMATS[name]
    with np.errstate(invalid="ignore", over="ignore"):
        if name == "bfloat16" and not saturate:
            if v.dtype == np.float32 or v.dtype == np.float16:
                return _bf16_from_f32(v.astype(np.float32))
            x32 = v.astype(np.float32)
            same = (x32.astype(v.dtype) == v) | np.isnan(v)
            if via_float32 or bool(np.all(same)):
                return _bf16_from_f32(x32)
        x = v.astype(np.float64) if v.dtype != np.float64 else v
        if via_float32 and name not in ("float64", "float32"):
            x = x.astype(np.float32).astype(np.float64)
    if name == "float64":
        return np.ascontiguousarray(x).view(np.uint64).copy()
    if name == "float32" and not saturate:
        with np.errstate(over="ignore"):
            return x.astype(np.float32).view(np.uint32)
    if name == "float16" and not saturate:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    return _round_generic(x, f, bool(saturate))


def as_bits(arr: Any, dtype: Optional[Any] = None) -> np.ndarray:
    """The unsigned-int view of a numpy array of logical ``dtype`` (bf16/fp8 arrays must already
    be their uint view; complex -> the view of the float pairs; bool -> uint8)."""
    a = np.ascontiguousarray(arr)
    name = dtype_name(dtype if dtype is not None else a.dtype)
    lg = LOGICAL[name]
    view = lg.wire.view
    if name.startswith("complex"):
        if a.dtype.kind == "c":
            return a.view(view)
        return a.astype(lg.wire.name, copy=False).view(view) if a.dtype.kind == "f" \
            else a.view(view)
    if name in ("bfloat16", "float8_e4m3", "float8_e5m2"):
        if a.dtype.kind == "f":
            return encode(a, name)
        return a.astype(view, copy=False) if a.dtype.itemsize != lg.wire.itemsize else a.view(view)
    if name == "bool":
        return (a != 0).astype(np.uint8) if a.dtype != np.bool_ else a.view(np.uint8)
    if a.dtype != np.dtype(name):
        a = a.astype(name)
    return a.view(view)


def from_bits(bits: Any, dtype: Any) -> np.ndarray:
    """A numpy array of logical ``dtype`` from its wire bits (bf16/fp8 stay uint views)."""
    b = np.ascontiguousarray(bits)
    name = dtype_name(dtype)
    if name == "bool":
        return b.astype(np.uint8).view(np.bool_)
    if name in ("bfloat16", "float8_e4m3", "float8_e5m2"):
        return b.astype(DTYPES[name].view, copy=False)
    if name == "complex32":
        return b.view(np.float16)
    return b.view(name)


def is_nan_bits(bits: Any, dtype: Any) -> np.ndarray:
    """Boolean mask of NaN patterns."""
    return np.isnan(decode(bits, dtype))


# -- ULPs -----------------------------------------------------------------------------------
def _ordered_key(bits: np.ndarray, nbits: int) -> np.ndarray:
    """Monotone map of float bit patterns to signed integers (as Python-int-safe float128-free
    int64 for <= 32 bits, object for 64 bits)."""
    if nbits <= 32:
        b = bits.astype(np.int64)
        sign = np.int64(1) << np.int64(nbits - 1)
        mag = b & (sign - 1)
        return np.where(b & sign, -mag, mag)
    b = bits.astype(np.uint64)
    sign = np.uint64(1) << np.uint64(63)
    mag = (b & (sign - np.uint64(1))).astype(object)
    neg = (b & sign) != 0
    return np.where(neg, -mag, mag)


def ulp_distance(a_bits: Any, b_bits: Any, dtype: Any) -> np.ndarray:
    """Element-wise distance in units in the last place between two bit-pattern arrays.

    Floats: the difference of a monotone integer mapping of the patterns (+0 and -0 both map to
    0, so they are 0 ULPs apart although their bytes differ); NaN against a number is inf, NaN
    against NaN is 0.  Integers (and bool): the absolute difference of the values.  Returns
    float64 (exact below 2**53).
    """
    name = dtype_name(dtype)
    lg = LOGICAL[name]
    wire = lg.wire
    a = np.asarray(a_bits).astype(wire.view, copy=False).ravel()
    b = np.asarray(b_bits).astype(wire.view, copy=False).ravel()
    if a.shape != b.shape:
        raise ArgumentError(f"ulp_distance: shapes differ ({a.shape} vs {b.shape})")
    if wire.kind != "float":
        va = a.view(wire.name) if name != "bool" else a
        vb = b.view(wire.name) if name != "bool" else b
        if wire.itemsize == 8:
            d = np.abs(va.astype(object) - vb.astype(object))
            return d.astype(np.float64)
        return np.abs(va.astype(np.int64) - vb.astype(np.int64)).astype(np.float64)
    f = FORMATS[wire.name]
    ka, kb = _ordered_key(a, f.nbits), _ordered_key(b, f.nbits)
    d = np.abs(ka - kb)
    d = d.astype(np.float64)
    na, nb = is_nan_bits(a, wire.name), is_nan_bits(b, wire.name)
    d = np.where(na & nb, 0.0, np.where(na | nb, np.inf, d))
    return d


def max_ulp(a_bits: Any, b_bits: Any, dtype: Any) -> float:
    """The largest :func:`ulp_distance` (0.0 for empty arrays)."""
    d = ulp_distance(a_bits, b_bits, dtype)
    return float(d.max()) if d.size else 0.0


# -- verifiable inputs ----------------------------------------------------------------------
def rng_for(seed: int, rank: int, tag: str = "") -> np.random.Generator:
    """A numpy Generator determined by (seed, rank, tag) alone (same on every process)."""
    h = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(rank), h])


def _random_bits(rng: np.random.Generator, count: int, view: str) -> np.ndarray:
    """``count`` uniformly random bit patterns of unsigned dtype ``view``."""
    itemsize = np.dtype(view).itemsize
    return np.frombuffer(rng.bytes(count * itemsize), dtype=view).copy()


#: the most positive (and negative) units a slot plan adds up per element
_MAX_SLOTS = 16


def _pow2_exp(x: float) -> Optional[int]:
    """e with |x| == 2**e, or None when |x| is not a power of two (or is 0, inf, NaN)."""
    if x == 0 or not math.isfinite(x):
        return None
    m, e = math.frexp(abs(x))
    return e - 1 if m == 0.5 else None


def _sum_plan(fname: str, n: int, scale_exp: int) -> Optional[tuple]:
    """How to draw integer units m (values ``m * 2**EXACT_SCALE_EXP``) whose terms
    ``m * 2**scale_exp`` and *every* partial sum of them, in any order, are exact in ``fname``:

    * ("indep", K): each rank draws m in [-K, K] on its own (K * n <= 2**p);
    * ("slots", P): more ranks than 2**p (float8): per element P positive and P negative slots
      are dealt to ranks by a generator every rank shares, so partial sums stay in [-P, P];
    * None: 2**scale_exp is below the format's smallest quantum (then only a unit plan works).
    """
    f = _fmt(fname)
    if scale_exp < f.emin - f.mbits:
        return None
    p = f.mbits + 1
    # the largest |units| whose value stays finite (capped: float64 has room for any count)
    room = 1 << 62 if f.max_finite >= 2.0 ** (62 + scale_exp) else \
        int(math.ldexp(f.max_finite, -scale_exp))
    k = min((1 << p) // max(1, n), 1000, room // max(1, n))
    if k >= 1:
        return ("indep", k)
    slots = min(1 << p, _MAX_SLOTS, room)
    return ("slots", slots) if slots >= 1 else None


def exact_plan(dtype: Any, op: Optional[str], world_size: int,
               scalar: Optional[float] = None) -> tuple:
    """The input plan :func:`verifiable_input` uses for a float ``dtype`` (see
    :func:`verifiable_values`): ``("indep", K)``, ``("slots", P)``, ``("unit", 2)``,
    ``("prod", choices)``, ``("minmax", K)``, or ``("inexact", why)`` where no plan makes the
    result exact (a non-finite premul_sum scalar)."""
    fname = LOGICAL[dtype_name(dtype)].wire.name
    n = max(1, int(world_size))
    if op in ("sum", None):
        return _sum_plan(fname, n, EXACT_SCALE_EXP) or ("unit", 2)
    if op == "avg":
        e = _pow2_exp(1.0 / n) if n & (n - 1) == 0 else None
        plan = _sum_plan(fname, n, EXACT_SCALE_EXP + e) if e is not None else None
        return plan or ("unit", 2)
    if op == "premul_sum":
        s = 0.0 if scalar is None else float(scalar)
        if not math.isfinite(s):
            return ("inexact", f"premul_sum scalar {s!r} is not finite")
        e = 0 if s == 0 else _pow2_exp(s)
        plan = _sum_plan(fname, n, EXACT_SCALE_EXP + e) if e is not None else None
        return plan or ("unit", 2)
    if op == "prod":
        return ("prod", (-2.0, -1.0, -0.5, 0.5, 1.0, 2.0) if n <= 8 else (-1.0, 1.0))
    if op in ("min", "max"):
        k = min((1 << mantissa_bits(fname)) - 1, 10 ** 6)
        if fname.startswith("float8"):
            k = min(k, 15 if fname == "float8_e4m3" else 7)
        return ("minmax", k)
    raise ArgumentError(f"op: expected sum, prod, min, max, avg, premul_sum or None, got {op!r}")


def _slot_units(shared: np.random.Generator, count: int, n: int, rank: int, k: int,
                distinct: bool) -> np.ndarray:
    """Integer units of ``rank``: +1 per positive slot and -1 per negative slot dealt to it.

    ``distinct``: the k slots of one sign go to k different ranks (each active with
    probability 3/4), so a rank gets -1, 0 or 1; otherwise each slot picks any rank or none."""
    m = np.zeros(count, dtype=np.int64)
    for sign in (1, -1):
        if distinct:
            kk = min(k, n)
            first = shared.integers(0, n, size=count)
            active = shared.random((kk, count)) < 0.75
            for j in range(kk):
                m += sign * (((first + j) % n == rank) & active[j])
        else:
            for _ in range(k):
                m += sign * (shared.integers(0, 2 * n, size=count) == rank)
    return m


def verifiable_values(dtype: Any, count: int, *, op: Optional[str], world_size: int,
                      rng: np.random.Generator, scalar: Optional[float] = None,
                      rank: int = 0, shared: Optional[np.random.Generator] = None
                      ) -> np.ndarray:
    """float64 values (floats) or wire bits (ints/bool) whose reduction is exact in ``dtype``.

    Floats are integers times ``2**EXACT_SCALE_EXP`` (nccl-tests' idea: a shared exponent and
    integer mantissas), chosen by :func:`exact_plan` so that every term and every partial
    result, in *any* reduction order, is exactly representable, so NCCL's order cannot matter:

    * sum, avg over a power-of-two n, premul_sum by a power of two: integers in [-K, K] with
      K * n <= 2**p and no overflow ("indep"); with more ranks than 2**p (float8), P positive and
      P negative units dealt per element to ranks ("slots", partial sums within [-P, P]);
    * avg over other n and premul_sum by any other scalar ("unit"): each premultiplied term is
      +-p or 0 for one p = round(2**-2 * s), and per element at most two ranks hold +1 and two
      -1, so every partial sum is in {-2p, ..., 2p}: exact whatever s is;
    * prod: {+-1/2, +-1, +-2} (world_size <= 8), else {+-1};
    * min / max: any integers in [-(2**p - 1), 2**p - 1] (capped at 10**6; no -0, no NaN);
    * None (data movement): like sum (random bits are made by the caller if wanted).

    The "slots" and "unit" plans need ``shared`` (a generator every rank seeds alike) and
    ``rank``; :func:`verifiable_input` passes them.  Integer dtypes get uniformly random bits
    (wrapping sums and products are order-independent); bool gets 0/1.
    """
    name = dtype_name(dtype)
    w = LOGICAL[name].wire
    if name == "bool":
        return rng.integers(0, 2, size=count, dtype=np.uint8)
    if w.kind != "float":
        return _random_bits(rng, count, w.view)
    n = max(1, int(world_size))
    plan = exact_plan(w.name, op, n, scalar)
    kind = plan[0]
    if kind in ("slots", "unit") and n > 1:
        if shared is None:
            raise ArgumentError(f"verifiable_values: {op} over {n} ranks of {w.name} needs the "
                                f"shared generator (use verifiable_input)")
        m = _slot_units(shared, count, n, int(rank), plan[1], distinct=kind == "unit")
    elif kind in ("slots", "unit", "inexact"):
        m = rng.integers(-1, 2, size=count)
    elif kind == "prod":
        choices = np.array(plan[1])
        return choices[rng.integers(0, len(choices), size=count)]
    else:  # "indep", "minmax"
        m = rng.integers(-plan[1], plan[1] + 1, size=count)
    return m.astype(np.float64) * 2.0 ** EXACT_SCALE_EXP


def verifiable_input(dtype: Any, count: int, *, op: Optional[str], world_size: int,
                     seed: int, rank: int, tag: str = "", random_bits: bool = False,
                     scalar: Optional[float] = None) -> np.ndarray:
    """One rank's input as a numpy array of logical ``dtype`` (bf16/fp8 as uint views, complex
    as complex arrays, complex32 as float16 pairs of shape (count, 2)), seeded by
    (seed, rank, tag).

    ``random_bits``: uniformly random bit patterns instead (for data-movement collectives: NaN
    payloads, -0 and subnormals must travel untouched).  Bool stays 0/1.  ``scalar``: the
    premul_sum factor (it decides the plan, see :func:`exact_plan`).
    """
    name = dtype_name(dtype)
    lg = LOGICAL[name]
    rng = rng_for(seed, rank, f"{tag}|{name}|{op}|{count}")
    wcount = count * lg.factor
    w = lg.wire
    if name != "bool" and (random_bits or w.kind != "float"):
        bits = _random_bits(rng, wcount, w.view)
    elif name == "bool":
        bits = rng.integers(0, 2, size=wcount, dtype=np.uint8)
    else:
        shared = rng_for(seed, 0, f"{tag}|{name}|{op}|{count}|shared")
        vals = verifiable_values(w.name, wcount, op=op, world_size=world_size, rng=rng,
                                 scalar=scalar, rank=rank, shared=shared)
        bits = encode(vals, w.name)
    return _bits_to_logical(bits, name, count)


def _bits_to_logical(bits: np.ndarray, name: str, count: int) -> np.ndarray:
    if name == "complex32":
        return bits.view(np.float16).reshape(count, 2)
    return from_bits(bits, name)


def values_of(arr: Any, dtype: Any) -> np.ndarray:
    """float64 values of a logical array (bf16/fp8 uint views decoded), for display."""
    name = dtype_name(dtype)
    if name in ("bfloat16", "float8_e4m3", "float8_e5m2"):
        return decode(arr, name)
    return np.asarray(arr)


__all__.append("values_of")
