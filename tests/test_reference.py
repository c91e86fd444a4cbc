"""ncclpy.reference against hand-computed results."""
from __future__ import annotations

import numpy as np
import pytest

import ncclpy
from ncclpy.semantics import numerics as nm
from ncclpy.semantics import reference as R
from ncclpy.semantics import registry
from ncclpy.errors import ArgumentError, UnsupportedError


def f32(*v):
    return np.array(v, dtype=np.float32)


def eq(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def test_registry_points_here():
    for c in registry.iter_collectives(data_only=False):
        assert callable(getattr(R, c.name)), c.name
        assert c.reference == f"ncclpy.reference:{c.name}"


# -- all_reduce and its ops -----------------------------------------------------------------
def test_all_reduce_ops_float32():
    ins = [f32(1, -2, 3), f32(4, 5, -6), f32(-7, 8, 9)]
    assert eq(R.all_reduce(ins, op="sum")[2], f32(-2, 11, 6))
    assert eq(R.all_reduce(ins, op="prod")[0], f32(-28, -80, -162))
    assert eq(R.all_reduce(ins, op="min")[1], f32(-7, -2, -6))
    assert eq(R.all_reduce(ins, op="max")[1], f32(4, 8, 9))
    assert eq(R.all_reduce(ins, op=ncclpy.premul_sum(2))[0], f32(-4, 22, 12))
    outs = R.all_reduce(ins, op="sum", in_place=True)
    assert len(outs) == 3 and all(eq(o, f32(-2, 11, 6)) for o in outs)
    assert outs[0] is not outs[1]  # independent arrays


def test_fold_is_left_to_right_with_rounding_each_step():
    # float16: (2048 + 1) rounds to 2048 (tie to even), then + 1 -> 2048 again;
    # exact arithmetic would give 2050
    ins = [np.array([2048], np.float16), np.array([1], np.float16), np.array([1], np.float16)]
    assert eq(R.all_reduce(ins, op="sum")[0], np.array([2048], np.float16))
    # a different order gives a different (also correctly rounded) answer
    assert eq(R.all_reduce(ins[::-1], op="sum")[0], np.array([2050], np.float16))


def test_integer_wraparound():
    assert eq(R.all_reduce([np.array([100, -128], np.int8), np.array([100, -1], np.int8)])[0],
              np.array([-56, 127], np.int8))
    assert eq(R.all_reduce([np.array([200], np.uint8), np.array([100], np.uint8)])[0],
              np.array([44], np.uint8))
    assert eq(R.all_reduce([np.array([2 ** 31 - 1], np.int32), np.array([1], np.int32)])[0],
              np.array([-2 ** 31], np.int32))
    big = np.array([2 ** 63 + 5], np.uint64)
    assert eq(R.all_reduce([big, big], op="prod")[0], np.array([25], np.uint64))
    assert eq(R.all_reduce([np.array([2 ** 62], np.int64), np.array([4], np.int64)],
                           op="prod")[0], np.array([0], np.int64))
    assert eq(R.all_reduce([np.array([-5], np.int64), np.array([3], np.int64)], op="min")[0],
              np.array([-5], np.int64))
    assert eq(R.all_reduce([np.array([2 ** 64 - 1], np.uint64), np.array([1], np.uint64)],
                           op="max")[0], np.array([2 ** 64 - 1], np.uint64))


def test_avg_integers_truncate_toward_zero_after_the_wrapped_sum():
    ins = [np.array([-7, 7, 127, -128, 5], np.int8), np.array([0, 0, 1, -128, -8], np.int8)]
    # sums: -7, 7, -128 (wrapped), 0 (wrapped), -3 -> /2 toward zero: -3, 3, -64, 0, -1
    assert eq(R.all_reduce(ins, op="avg")[0], np.array([-3, 3, -64, 0, -1], np.int8))
    three = [np.array([-7], np.int32)] + [np.array([0], np.int32)] * 2
    assert eq(R.all_reduce(three, op="avg")[0], np.array([-2], np.int32))  # not floor's -3
    u = [np.array([255], np.uint8), np.array([3], np.uint8)]   # 258 wraps to 2 -> 1
    assert eq(R.all_reduce(u, op="avg")[0], np.array([1], np.uint8))
    m = [np.array([-2 ** 63], np.int64), np.array([0], np.int64)]
    assert eq(R.all_reduce(m, op="avg")[0], np.array([-2 ** 62], np.int64))


def test_avg_floats_premultiply_by_the_rounded_reciprocal():
    # float16, n=3: s = f16(float(1/3)) = 1365/4096; 1025*s = 341.58 -> 341.5 (rounded);
    # 341.5*3 summed left to right: 683, then 1024.5 -> 1024 (tie to even).
    # The true mean is 1025 and sum-then-divide would give 1025 too.
    ins = [np.array([1025], np.float16)] * 3
    assert nm.encode(np.array([1 / 3], np.float32), "float16")[0] == 0x3555
    assert eq(R.all_reduce(ins, op="avg")[0], np.array([1024], np.float16))
    assert R.avg_scalar_bits("float16", 3)[0] == 0x3555
    # n a power of two: exact
    assert eq(R.all_reduce([f32(1, 3), f32(2, 5)], op="avg")[0], f32(1.5, 4))
    # float64 keeps the double 1/n
    assert nm.decode(R.avg_scalar_bits("float64", 3), "float64")[0] == 1.0 / 3
    # bfloat16 via its uint view; 1/3 -> 0x3EAB
    assert R.avg_scalar_bits("bfloat16", 3)[0] == 0x3EAB
    # float8: 1/3 -> e4m3 0.34375 (0x2B), e5m2 0.3125 (0x35)
    assert R.avg_scalar_bits("float8_e4m3", 3)[0] == 0x2B
    assert R.avg_scalar_bits("float8_e5m2", 3)[0] == 0x35


def test_premul_sum_scalar_is_rounded_to_the_dtype():
    # 0.1 in float16 is 0.0999755859375; 10 * that = 0.999755859375 -> rounds to 1.0 (tie even)
    ins = [np.array([10], np.float16)]
    out = R.all_reduce(ins, op=ncclpy.premul_sum(0.1))[0]
    assert eq(out, np.array([1.0], np.float16))
    # integers: an integral scalar multiplies, products wrap: 100*3 = 300 -> 44, twice -> 88
    assert eq(R.all_reduce([np.array([100], np.int8)] * 2, op=ncclpy.premul_sum(3))[0],
              np.array([88], np.int8))
    assert list(R.premul_scalar_bits("int32", -1.0)) == [0xFFFFFFFF]


def test_premul_scalar_is_the_library_encoding():
    """The reference encodes the scalar with the very function the library hands NCCL."""
    from ncclpy.semantics.scalars import encode_scalar
    # 1 + 2**-8 + 2**-40: one rounding from the double gives bfloat16 0x3F81, but the library
    # goes through float32 (1 + 2**-8 exactly: a tie) and rounds to even: 0x3F80
    x = 1 + 2.0 ** -8 + 2.0 ** -40
    assert nm.encode(np.array([x]), "bfloat16")[0] == 0x3F81          # the two roundings differ
    assert int.from_bytes(encode_scalar(x, "bfloat16"), "little") == 0x3F80
    assert R.premul_scalar_bits("bfloat16", x)[0] == 0x3F80
    one = nm.encode(np.array([1.0]), "bfloat16")
    assert R.all_reduce([one], op=ncclpy.premul_sum(x), dtype="bfloat16")[0][0] == 0x3F80
    # float16 too: a double just above a float16 tie that float32 rounds onto the tie
    y = 1 + 2.0 ** -11 + 2.0 ** -40
    assert nm.encode(np.array([y]), "float16")[0] == 0x3C01
    assert R.premul_scalar_bits("float16", y)[0] == 0x3C00
    for wire in ("float16", "bfloat16", "float32", "float64", "float8_e4m3", "float8_e5m2",
                 "int8", "uint8", "int32", "uint32", "int64", "uint64"):
        for v in (2.0, 3.0, 0.0, 1.0):
            raw = R.premul_scalar_bits(wire, v).tobytes()
            assert raw == encode_scalar(v, wire), (wire, v)


def test_integer_premul_scalar_is_refused_like_the_library():
    from ncclpy.semantics.scalars import encode_scalar
    for wire, bad in (("int8", 2.9), ("int32", -1.5), ("uint8", -1.0), ("int8", 128.0),
                      ("uint64", float("nan"))):
        with pytest.raises(ArgumentError) as lib_err:
            encode_scalar(bad, wire)
        with pytest.raises(ArgumentError) as ref_err:
            R.premul_scalar_bits(wire, bad)
        assert str(ref_err.value) == str(lib_err.value)
    with pytest.raises(ArgumentError, match="integral value"):
        R.all_reduce([np.array([100], np.int8)] * 2, op=ncclpy.premul_sum(2.9))
    with pytest.raises(ArgumentError, match="overflows float8_e4m3"):
        R.all_reduce([nm.encode(np.array([1.0]), "float8_e4m3")], dtype="float8_e4m3",
                     op=ncclpy.premul_sum(1000.0))


def test_premul_sum_raw_scalar_bits():
    """scalar_bits= models a caller handing NCCL other bytes (torch's bf16 PREMUL_SUM: the low
    16 bits of a float32 2.0 are 0, so every product is 0)."""
    x = nm.encode(np.array([1.5, -2.0, 3.0]), "bfloat16")
    out = R.reduce_arrays([x, x], ncclpy.premul_sum(2.0), "bfloat16", scalar_bits=0x0000)
    assert list(nm.decode(out, "bfloat16")) == [0.0, 0.0, 0.0]
    out = R.reduce_arrays([x, x], ncclpy.premul_sum(2.0), "bfloat16", scalar_bits=0x3F80)
    assert list(nm.decode(out, "bfloat16")) == [3.0, -4.0, 6.0]


def test_bfloat16_and_float8_travel_as_bit_views():
    a = nm.encode(np.array([1.0, 2.0, -0.5]), "bfloat16")
    b = nm.encode(np.array([3.0, 0.25, 0.5]), "bfloat16")
    out = R.all_reduce([a, b], op="sum", dtype="bfloat16")[0]
    assert out.dtype == np.uint16
    assert list(nm.decode(out, "bfloat16")) == [4.0, 2.25, 0.0]
    # bfloat16 has 8 significant bits: 256 + 1 -> 256
    big = nm.encode(np.array([256.0]), "bfloat16")
    one = nm.encode(np.array([1.0]), "bfloat16")
    assert nm.decode(R.all_reduce([big, one], dtype="bfloat16")[0], "bfloat16")[0] == 256.0
    # float8 e4m3 saturates at 448 like NCCL's __NV_SATFINITE kernels
    x = nm.encode(np.array([448.0]), "float8_e4m3")
    assert R.all_reduce([x, x], dtype="float8_e4m3")[0][0] == 0x7E
    y = nm.encode(np.array([57344.0]), "float8_e5m2")
    assert R.all_reduce([y, y], dtype="float8_e5m2")[0][0] == 0x7B
    with pytest.raises(ArgumentError, match="dtype"):
        R.all_reduce([a, b])          # a uint16 view without dtype= is refused


def test_min_max_nan_and_signed_zero():
    """What NCCL's fminf/fmaxf/__hmin/__hmax define: a NaN loses to a number.  A NaN against a
    NaN gives a NaN, and a +0/-0 tie gives a zero; their exact bits are not claimed."""
    nan = np.float32(np.nan)
    ins = [f32(nan, 1, 0.0, 5), f32(2, nan, -0.0, 5)]
    for op in ("min", "max"):
        out = R.all_reduce(ins, op=op)[0]
        assert list(out[:2]) == [2.0, 1.0] and out[3] == 5.0
        assert out[2] == 0.0                    # +0 or -0: the sign is not pinned down
    both = R.all_reduce([f32(nan), f32(nan)], op="max")[0]
    assert np.isnan(both[0])
    h = [nm.encode(np.array([np.nan, -3.0]), "bfloat16"), nm.encode(np.array([1.0, np.nan]),
                                                                      "bfloat16")]
    assert list(nm.decode(R.all_reduce(h, op="min", dtype="bfloat16")[0], "bfloat16")) == \
        [1.0, -3.0]


def test_check_inputs_for_min_max_avoid_the_unpinned_cases():
    for dtype in ("float16", "bfloat16", "float32", "float64", "float8_e4m3", "float8_e5m2"):
        for op in ("min", "max"):
            x = nm.verifiable_input(dtype, 4096, op=op, world_size=4, seed=1, rank=2, tag="t")
            v = nm.decode(nm.as_bits(x, dtype), dtype)
            assert not np.isnan(v).any() and not (np.signbit(v) & (v == 0)).any()


def test_bool_and_complex_mappings():
    t, f = True, False
    ins = [np.array([t, t, f, f]), np.array([t, f, t, f])]
    assert eq(R.all_reduce(ins, op="sum")[0], np.array([t, t, t, f]))    # SUM -> MAX (or)
    assert eq(R.all_reduce(ins, op="prod")[0], np.array([t, f, f, f]))   # PROD -> MIN (and)
    with pytest.raises(UnsupportedError):
        R.all_reduce(ins, op="avg")
    with pytest.raises(ArgumentError):
        R.all_reduce([np.array([2], np.uint8).view(np.bool_)] * 2, op="sum")
    z = [np.array([1 + 2j, -1j], np.complex64), np.array([3 - 1j, 2], np.complex64)]
    assert eq(R.all_reduce(z, op="sum")[0], np.array([4 + 1j, 2 - 1j], np.complex64))
    assert eq(R.all_reduce(z, op="avg")[0], np.array([2 + 0.5j, 1 - 0.5j], np.complex64))
    assert eq(R.all_reduce(z, op=ncclpy.premul_sum(2))[0],
              np.array([8 + 2j, 4 - 2j], np.complex64))
    for bad in ("prod", "min", "max"):
        with pytest.raises(UnsupportedError):
            R.all_reduce(z, op=bad)
    c32 = [np.array([[1, 2]], np.float16), np.array([[3, -4]], np.float16)]   # complex32 pairs
    assert eq(R.all_reduce(c32, op="sum", dtype="complex32")[0], np.array([[4, -2]], np.float16))


def test_bitwise_ops_are_refused():
    with pytest.raises(UnsupportedError, match="bitwise"):
        R.all_reduce([np.array([1], np.int32)] * 2, op="band")


# -- rooted and data movement ---------------------------------------------------------------
def test_reduce_root_and_untouched_ranks():
    ins = [f32(1, 2), f32(3, 4), f32(5, 6)]
    out = R.reduce(ins, root=1)
    assert out[0] is None and out[2] is None and eq(out[1], f32(9, 12))
    ip = R.reduce(ins, root=2, in_place=True)
    assert eq(ip[0], f32(1, 2)) and eq(ip[1], f32(3, 4)) and eq(ip[2], f32(9, 12))
    with pytest.raises(ArgumentError, match="root"):
        R.reduce(ins, root=3)


def test_broadcast_ignores_other_ranks():
    out = R.broadcast([None, f32(7, 8), None], root=1)
    assert all(eq(o, f32(7, 8)) for o in out)
    with pytest.raises(ArgumentError, match="inputs\\[0\\]"):
        R.broadcast([None, f32(1)], root=0)
    with pytest.raises(ArgumentError, match="takes no reduction"):
        R.broadcast([f32(1)], op="sum")


def test_all_gather_and_gather():
    ins = [f32(0, 1), f32(10, 11), f32(20, 21)]
    ag = R.all_gather(ins)
    assert all(eq(o, f32(0, 1, 10, 11, 20, 21)) for o in ag)
    g = R.gather(ins, root=2)
    assert g[0] is None and g[1] is None and eq(g[2], f32(0, 1, 10, 11, 20, 21))
    cols = [np.full((2, 1), r, np.float32) for r in range(3)]
    assert eq(R.all_gather(cols, axis=1)[0], np.array([[0, 1, 2], [0, 1, 2]], np.float32))
    assert eq(R.all_gather([np.float32(5), np.float32(6)])[0], f32(5, 6))   # 0-d inputs stack


def test_reduce_scatter_blocks():
    ins = [np.arange(6, dtype=np.int32), np.arange(6, dtype=np.int32) * 10]
    out = R.reduce_scatter(ins)
    assert eq(out[0], np.array([0, 11, 22], np.int32))
    assert eq(out[1], np.array([33, 44, 55], np.int32))
    with pytest.raises(ArgumentError, match="multiple of world_size"):
        R.reduce_scatter([np.arange(5, dtype=np.int32)] * 2)


def test_all_to_all_even_and_uneven():
    ins = [np.array([0, 1, 2, 3], np.int64), np.array([10, 11, 12, 13], np.int64)]
    out = R.all_to_all(ins)
    assert eq(out[0], np.array([0, 1, 10, 11], np.int64))
    assert eq(out[1], np.array([2, 3, 12, 13], np.int64))
    # uneven: rank 0 sends 1 to itself, 3 to rank 1; rank 1 sends 2 to rank 0, 0 to itself
    un = R.all_to_all([np.array([1, 2, 3, 4], np.int64), np.array([5, 6], np.int64)],
                      send_counts=[[1, 3], [2, 0]])
    assert eq(un[0], np.array([1, 5, 6], np.int64))
    assert eq(un[1], np.array([2, 3, 4], np.int64))
    with pytest.raises(ArgumentError, match="adds up"):
        R.all_to_all([np.arange(3), np.arange(2)], send_counts=[[1, 1], [1, 1]])
    with pytest.raises(ArgumentError, match="table"):
        R.all_to_all([np.arange(2), np.arange(2)], send_counts=[[1, 1]])


def test_scatter():
    out = R.scatter([None, np.arange(6, dtype=np.uint8)], root=1)
    assert eq(out[0], np.array([0, 1, 2], np.uint8)) and eq(out[1], np.array([3, 4, 5], np.uint8))


def test_send_recv_ring_and_pairs():
    ins = [f32(0), f32(1), f32(2)]
    assert [float(o[0]) for o in R.send_recv(ins)] == [2.0, 0.0, 1.0]
    assert [float(o[0]) for o in R.send_recv(ins, shift=2)] == [1.0, 2.0, 0.0]
    p = R.send_recv([f32(1), f32(0)], pairs=[(0, 1)])
    assert p[0] is None and eq(p[1], f32(1))
    p = R.send_recv([f32(1), None], pairs=[(0, 1)], in_place=True)
    assert eq(p[0], f32(1)) and eq(p[1], f32(1))
    with pytest.raises(ArgumentError, match="receives twice"):
        R.send_recv([f32(1), f32(2), f32(3)], pairs=[(0, 2), (1, 2)])


def test_barrier_semantics():
    assert R.barrier(arrivals=[0.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert R.barrier(world_size=2) == [None, None]
    with pytest.raises(ArgumentError):
        R.barrier()


def test_input_validation():
    with pytest.raises(ArgumentError, match="same shape"):
        R.all_reduce([f32(1), f32(1, 2)])
    with pytest.raises(ArgumentError, match="one array per rank"):
        R.all_reduce(f32(1, 2))
    with pytest.raises(ArgumentError, match="world_size"):
        R.all_reduce([f32(1)], world_size=2)
