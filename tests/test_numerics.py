"""ncclpy.semantics.numerics: bit-exact conversions checked against torch, ULPs, verifiable
inputs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from ncclpy.semantics import numerics as nm
from ncclpy.errors import ArgumentError

SMALL = ("bfloat16", "float16", "float8_e4m3", "float8_e5m2")


def _torch():
    """torch, for the tests that compare with it (the others run without it)."""
    return pytest.importorskip("torch")


def _torch_types(name: str):
    """ncclpy name -> (torch dtype, torch int view of the same size)."""
    torch = _torch()
    return {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.int16),
            "float8_e4m3": (torch.float8_e4m3fn, torch.uint8),
            "float8_e5m2": (torch.float8_e5m2, torch.uint8)}[name]


def _torch_bits(x32: np.ndarray, name: str) -> np.ndarray:
    td, iv = _torch_types(name)
    out = _torch().from_numpy(np.ascontiguousarray(x32)).to(td).view(iv).numpy()
    return out.view(nm.FORMATS[name].uint)


def _specials() -> np.ndarray:
    vals = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 448.0, 449.0, 464.0, 464.0001, 470.0, 479.0,
            480.0, 1e4, 57344.0, 61439.0, 61440.0, 61441.0, 65504.0, 65519.0, 65520.0, 1e30,
            -1e30, 3.4e38, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.5, 2.0 ** -14,
            2.0 ** -16, 2.0 ** -17, 2.0 ** -24, 2.0 ** -25, 2.0 ** -133, 2.0 ** -134, 1e-45]
    return np.array(vals + [-v for v in vals], dtype=np.float32)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_encode_matches_torch_on_random_float32(name):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 32, size=300_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32), _specials()])
    mine, ref = nm.encode(x, name), _torch_bits(x, name)
    nan = np.isnan(x)
    assert np.array_equal(mine[~nan], ref[~nan])
    assert nm.is_nan_bits(mine[nan], name).all() and nm.is_nan_bits(ref[nan], name).all()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_ties_round_to_even_like_torch(name):
    """Every midpoint between two neighbouring values (the hard case of RNE), and values a hair
    either side of it."""
    f = nm.FORMATS[name]
    vals = np.unique(nm.decode(np.arange(1 << f.nbits, dtype=np.uint64).astype(f.uint), name))
    vals = vals[np.isfinite(vals)]
    mids = (vals[:-1] + vals[1:]) / 2
    x = mids.astype(np.float32)
    x = x[x.astype(np.float64) == mids]        # midpoints float32 can hold exactly
    near = np.concatenate([x, np.nextafter(x, np.float32(np.inf)),
                           np.nextafter(x, np.float32(-np.inf))])
    assert np.array_equal(nm.encode(near, name), _torch_bits(near, name))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_decode_every_pattern_like_torch(name):
    f = nm.FORMATS[name]
    bits = np.arange(1 << f.nbits, dtype=np.uint64).astype(f.uint)
    torch = _torch()
    td, iv = _torch_types(name)
    ref = torch.from_numpy(bits.view(np.int16) if f.nbits == 16 else bits).view(td) \
        .to(torch.float64).numpy()
    mine = nm.decode(bits, name)
    assert np.array_equal(np.isnan(mine), np.isnan(ref))
    ok = ~np.isnan(mine)
    assert np.array_equal(mine[ok], ref[ok])
    assert np.array_equal(np.signbit(mine[ok]), np.signbit(ref[ok]))  # -0 decodes to -0


@pytest.mark.parametrize("name", sorted(SMALL))
def test_roundtrip_is_lossless(name):
    f = nm.FORMATS[name]
    bits = np.arange(1 << f.nbits, dtype=np.uint64).astype(f.uint)
    vals = nm.decode(bits, name)
    ok = ~np.isnan(vals)
    assert np.array_equal(nm.encode(vals[ok], name), bits[ok])


def test_float64_sources_round_once_unless_via_float32():
    torch = _torch()
    # 1 + 2**-8 + 2**-40 is just above a bfloat16 midpoint: one rounding goes up; torch goes
    # through float32 first (lands exactly on the midpoint) and rounds to even (down)
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -40])
    assert nm.encode(x, "bfloat16")[0] == 0x3F81
    assert nm.encode(x, "bfloat16", via_float32=True)[0] == 0x3F80
    assert nm.encode(x, "bfloat16", via_float32=True)[0] == \
        _torch_bits(x.astype(np.float32), "bfloat16")[0]
    t = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert nm.encode(x, "bfloat16", via_float32=True)[0] == t[0]


def test_float8_overflow_conventions():
    x = np.array([470.0, 1e6, np.inf, -np.inf, 61440.0, np.nan])
    # torch: e4m3fn saturates (and maps inf to 448); e5m2 overflows to inf
    assert list(nm.encode(x[:4], "float8_e4m3")) == [0x7E, 0x7E, 0x7E, 0xFE]
    assert list(nm.encode(x[1:5], "float8_e5m2")) == [0x7C, 0x7C, 0xFC, 0x7C]
    # CUDA __NV_SATFINITE (what NCCL's fp8 kernels use): e5m2 clamps to 57344 too
    assert list(nm.encode(x[1:5], "float8_e5m2", saturate=True)) == [0x7B, 0x7B, 0xFB, 0x7B]
    assert nm.encode(x[5:], "float8_e4m3")[0] == 0x7F
    assert nm.FORMATS["float8_e4m3"].max_finite == 448.0
    assert nm.FORMATS["float8_e5m2"].max_finite == 57344.0
    assert nm.FORMATS["bfloat16"].max_finite == (2 - 2 ** -7) * 2.0 ** 127   # torch.finfo's


def test_native_types_and_integers():
    assert nm.encode(np.array([1.5]), "float32")[0] == np.float32(1.5).view(np.uint32)
    assert nm.encode(np.array([-1.5]), "float64")[0] == np.float64(-1.5).view(np.uint64)
    assert list(nm.encode(np.array([-1, 255, 256]), "uint8")) == [255, 255, 0]  # wraps
    assert list(nm.encode(np.array([-1]), "int32")) == [0xFFFFFFFF]
    assert list(nm.encode(np.array([0, 3, -1]), "bool")) == [0, 1, 1]
    with pytest.raises(ArgumentError):
        nm.decode(np.array([1.0]), "bfloat16")
    with pytest.raises(ArgumentError):
        nm.mantissa_bits("int8")


def test_ulp_distance():
    b = nm.encode(np.array([1.0, 1.0, 0.0, -0.0, 2.0 ** -149, np.nan, np.nan]), "float32")
    c = nm.encode(np.array([np.nextafter(np.float32(1), np.float32(2)), 1.0, -0.0, 2.0 ** -149,
                            -(2.0 ** -149), 1.0, np.nan]), "float32")
    d = nm.ulp_distance(b, c, "float32")
    assert list(d) == [1.0, 0.0, 0.0, 1.0, 2.0, np.inf, 0.0]
    # monotone over every bfloat16 pattern: sorted values give sorted keys
    allb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vals = nm.decode(allb, "bfloat16")
    ok = ~np.isnan(vals)
    order = np.argsort(vals[ok], kind="stable")
    keys = nm._ordered_key(allb[ok], 16)[order]
    assert np.all(np.diff(keys) >= 0)
    # integers: absolute difference, 64-bit safe
    big = np.array([0, 2 ** 64 - 1], dtype=np.uint64)
    assert list(nm.ulp_distance(big, big[::-1], "uint64")) == [float(2 ** 64 - 1)] * 2
    assert nm.max_ulp(np.array([], np.uint16), np.array([], np.uint16), "bfloat16") == 0.0
    f64 = nm.encode(np.array([1.0, -2.0]), "float64")
    assert list(nm.ulp_distance(f64, nm.encode(np.array([1.0, -2.0000000000000004]), "float64"),
                                "float64")) == [0.0, 1.0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3", "float8_e5m2",
                                   "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_verifiable_inputs_reduce_exactly_in_any_order(dtype, op, n):
    """Every order of the fold gives the same bits (so NCCL's order does not matter)."""
    from ncclpy.semantics.reference import reduce_arrays
    ins = [nm.verifiable_input(dtype, 64, op=op, world_size=n, seed=3, rank=r, tag="t")
           for r in range(n)]
    base = reduce_arrays(ins, op, dtype)
    perms = list(itertools.islice(itertools.permutations(range(n)), 6)) + [tuple(range(n))[::-1]]
    for p in perms:
        assert np.array_equal(nm.as_bits(reduce_arrays([ins[i] for i in p], op, dtype), dtype),
                              nm.as_bits(base, dtype))
    # and equal to the exact (float64, unrounded) result
    vals = np.stack([nm.decode(nm.as_bits(x, dtype), dtype) for x in ins])
    exact = {"sum": vals.sum(0), "prod": vals.prod(0), "min": vals.min(0), "max": vals.max(0)}[op]
    assert np.array_equal(nm.decode(nm.as_bits(base, dtype), dtype), exact)


def test_verifiable_input_is_deterministic_and_rank_dependent():
    a = nm.verifiable_input("bfloat16", 100, op="sum", world_size=4, seed=1, rank=0, tag="x")
    b = nm.verifiable_input("bfloat16", 100, op="sum", world_size=4, seed=1, rank=0, tag="x")
    c = nm.verifiable_input("bfloat16", 100, op="sum", world_size=4, seed=1, rank=1, tag="x")
    assert a.dtype == np.uint16 and np.array_equal(a, b) and not np.array_equal(a, c)
    vals = nm.decode(a, "bfloat16")
    assert np.all(vals == np.round(vals * 4) / 4)   # integers times 2**-2
    z = nm.verifiable_input("complex32", 5, op="sum", world_size=2, seed=1, rank=0)
    assert z.shape == (5, 2) and z.dtype == np.float16
    bits = nm.verifiable_input("float32", 1000, op=None, world_size=2, seed=1, rank=0,
                               random_bits=True)
    assert np.isnan(bits).any()   # data movement carries arbitrary patterns, NaNs included
    assert set(np.unique(nm.verifiable_input("bool", 50, op="sum", world_size=2, seed=1,
                                             rank=0))) <= {False, True}


# -- every claimed-exact input really gives an exact result, in any order ---------------------
def _two_sum_exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether the float64 sums a + b are exact (Knuth's TwoSum error term is 0)."""
    s = a + b
    bb = s - a
    return ((a - (s - bb)) + (b - bb)) == 0


def _representable(v: np.ndarray, wire: str) -> np.ndarray:
    return nm.decode(nm.encode(v, wire), wire) == v


def _terms(ins, dtype, op, scalar, n):
    """Per rank, the float64 values NCCL folds (premultiplied terms rounded once, exactly)."""
    from fractions import Fraction
    from ncclpy.semantics.dtypes import LOGICAL
    from ncclpy.semantics.reference import avg_scalar_bits, premul_scalar_bits
    wire = LOGICAL[dtype].wire.name
    vals = np.stack([nm.decode(nm.as_bits(x, dtype).reshape(-1), wire) for x in ins])
    if op in ("avg", "premul_sum"):
        sb = avg_scalar_bits(wire, n) if op == "avg" else premul_scalar_bits(wire, scalar)
        s = Fraction(float(nm.decode(sb, wire)[0]))
        exact = np.array([[float(Fraction(float(v)) * s) if Fraction(float(v)) * s ==
                           Fraction(float(float(Fraction(float(v)) * s))) else np.nan
                           for v in row] for row in vals])
        assert not np.isnan(exact).any(), "a product is not exact in float64"
        vals = nm.decode(nm.encode(exact, wire, saturate=True if "float8" in wire else None),
                         wire)
    return vals, wire


EXACT_OPS = [("sum", None), ("prod", None), ("min", None), ("max", None), ("avg", None),
             ("premul_sum", 2.0), ("premul_sum", 0.3), ("premul_sum", 2.0 ** -12)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3", "float8_e5m2", "float32",
                                   "float64", "complex32", "complex64", "complex128", "int8",
                                   "uint8", "int32", "uint32", "int64", "uint64", "bool"])
def test_claimed_exact_inputs_give_exactly_representable_results(dtype):
    """For every dtype x op x n in 1..16 that ``ncclpy check`` claims bit for bit: every term and
    every partial result in several fold orders is exactly representable in the dtype, and the
    reference's left fold equals that exact value (checked in float64 with TwoSum / in ints)."""
    from ncclpy.semantics import ops
    from ncclpy.check.cases import Case, exact_claim
    from ncclpy.semantics.dtypes import LOGICAL
    from ncclpy.semantics.reference import reduce_arrays
    lg = LOGICAL[dtype]
    checked = 0
    for op, scalar in EXACT_OPS:
        if lg.ops is not None and op not in lg.ops:
            continue
        if lg.wire.kind != "float" and op == "premul_sum" and scalar != 2.0:
            continue                                  # the library refuses those scalars
        if op == "premul_sum" and lg.wire.kind == "float":
            from ncclpy.semantics.scalars import encode_scalar
            try:
                encode_scalar(scalar, lg.wire.name)
            except ArgumentError as e:                # e.g. 2**-12 becomes 0 in float8_e4m3
                assert "underflows" in str(e), e
                continue                              # refused: ncclpy check skips it too
        rop = ops.premul_sum(scalar) if op == "premul_sum" else op
        for n in range(1, 17):
            case = Case("all_reduce", dtype, op, scalar, 48)
            assert exact_claim(case, n), (dtype, op, scalar, n)
            ins = [nm.verifiable_input(dtype, 48, op=op, world_size=n, seed=11, rank=r,
                                       tag="exact", scalar=scalar) for r in range(n)]
            got = nm.as_bits(reduce_arrays(ins, rop, dtype, n), dtype).reshape(-1)
            if lg.wire.kind != "float":
                _check_ints(ins, dtype, op, n, got)
                checked += 1
                continue
            vals, wire = _terms(ins, dtype, op, scalar, n)
            rng = np.random.default_rng(n)
            orders = [list(range(n)), list(range(n))[::-1], list(rng.permutation(n))]
            for order in orders:
                acc = vals[order[0]].copy()
                assert _representable(acc, wire).all()
                for r in order[1:]:
                    if op in ("sum", "avg", "premul_sum"):
                        assert _two_sum_exact(acc, vals[r]).all(), (dtype, op, n, order)
                        acc = acc + vals[r]
                    elif op == "prod":
                        acc = acc * vals[r]       # powers of two: exact in float64
                    else:
                        acc = np.minimum(acc, vals[r]) if op == "min" else \
                            np.maximum(acc, vals[r])
                    assert _representable(acc, wire).all(), (dtype, op, scalar, n, order)
                if order == orders[0]:
                    assert np.array_equal(nm.decode(got, wire), acc), (dtype, op, scalar, n)
            checked += 1
    assert checked >= 16 * 2


def _check_ints(ins, dtype, op, n, got):
    from ncclpy.semantics.dtypes import LOGICAL
    w = LOGICAL[dtype].wire
    bits = 8 * w.itemsize
    signed = w.kind == "int"
    vals = [[int(v) for v in nm.as_bits(x, dtype).reshape(-1).view(w.name if dtype != "bool"
                                                                  else np.uint8)] for x in ins]
    want = []
    for col in zip(*vals):
        if dtype == "bool":
            r = {"sum": max, "max": max, "prod": min, "min": min}[op](col)
        elif op in ("sum", "avg", "premul_sum"):
            t = sum(c * (2 if op == "premul_sum" else 1) for c in col)
            t = (t + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1)) if signed \
                else t % (1 << bits)
            if op == "avg":
                t = abs(t) // n * (1 if t >= 0 else -1)
            r = t
        elif op == "prod":
            t = 1
            for c in col:
                t *= c
            r = (t + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1)) if signed \
                else t % (1 << bits)
        else:
            r = min(col) if op == "min" else max(col)
        want.append(r % (1 << bits))
    assert [int(v) for v in got] == want, (dtype, op, n)
