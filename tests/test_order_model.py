"""The reduction-order model's own contracts (ncclpy/order): the vectorized per-element folds
against a plain element-by-element reference on random configurations, the revealing inputs'
encoder/decoder round trip, the arithmetic of every op, every refusal, and the CLI-free API."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ncclpy.semantics import numerics as nm
from ncclpy.semantics.ops import premul_sum
from ncclpy.order import (CannotPredict, OrderConfig, judge, observed_masks, predict,
                          reveal_plan, revealing_inputs, signature)
from ncclpy.order.reveal import consistent_left_folds
from ncclpy.order.split import align_up, cbd_split, chunk_bytes, tuned_channels
from ncclpy.order.topology import normalize_ring, tree_expr
from ncclpy.order.versions import PORTS, port_for
from ncclpy.semantics.reference import reduce_arrays


def _fold_of(cfg: OrderConfig, rank: int, e: int):
    """A plain, element-at-a-time reading of NCCL's loops (no numpy, no shared helpers but the
    split): which fold element ``e`` of ``rank``'s output gets."""
    port = port_for(cfg.version)
    nc = tuned_channels(cfg.collective, cfg.algo, cfg.proto, cfg.nranks, cfg.count,
                        cfg.elem_size, cfg.comm_channels, cfg.nthreads, cfg.threshold)
    cb = chunk_bytes(cfg.collective, cfg.algo, cfg.proto, cfg.buffsize)
    split = cbd_split(port, cfg.collective, cfg.proto, cfg.nranks, cfg.count, cfg.elem_size,
                      nc, cfg.comm_channels, {"lo": cb, "mid": cb, "hi": cb})
    part = next(p for p in split.parts if p.offset <= e < p.offset + p.count)
    if cfg.algo == "tree":
        return tree_expr(cfg.trees[part.channel])
    ring = normalize_ring(cfg.rings[part.channel])
    n = cfg.nranks
    if cfg.collective in ("reduce_scatter", "reduce"):
        me = rank if cfg.collective == "reduce_scatter" else cfg.root
        start = ring.index(me) + 1
    else:
        o = e - part.offset
        loop = n * part.chunk
        first = o // loop * loop
        rem = part.count - first
        k = part.chunk if rem >= loop else align_up(-(-rem // n), 16 // cfg.elem_size)
        start = (o - first) // k + 1
    return tuple(ring[(start + i) % n] for i in range(n))


def _random_config(rng: random.Random) -> OrderConfig:
    n = rng.randint(1, 7)
    coll = rng.choice(["all_reduce", "reduce_scatter", "reduce"])
    algo = "tree" if coll == "all_reduce" and rng.random() < 0.3 else "ring"
    proto = rng.choice(["ll", "ll128", "simple"])
    dtype = rng.choice(["float32", "bfloat16", "float16", "float64", "float8_e5m2", "int32"])
    k = rng.randint(1, 3)
    rings = [rng.sample(range(n), n) for _ in range(k)]
    buff = {"simple": 4096 * rng.randint(1, 3), "ll": 1024 * rng.randint(1, 3),
            "ll128": 16384}[proto]
    count = rng.choice([rng.randint(1, 80), rng.randint(100, 9000), rng.randint(9000, 40000)])
    return OrderConfig.make(coll, n, count, dtype=dtype, algo=algo, proto=proto,
                            root=rng.randrange(n), version=rng.choice([22809, 23007]),
                            channels=k, rings=rings, buffsizes={proto: buff})


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_folds_equal_the_element_by_element_reading(seed):
    rng = random.Random(seed)
    for _ in range(60):
        cfg = _random_config(rng)
        pred = predict(cfg)
        for r in range(cfg.nranks):
            m = pred.order_map(r)
            if m is None:
                assert cfg.collective == "reduce" and r != cfg.root
                continue
            picks = rng.sample(range(cfg.count), min(cfg.count, 40)) + [0, cfg.count - 1]
            for e in picks:
                want = _fold_of(cfg, r, e) if cfg.nranks > 1 else 0
                assert m.expr(e) == want, (cfg.describe(), r, e)


@pytest.mark.parametrize("seed", range(3))
def test_vectorized_bits_equal_folding_each_element_alone(seed):
    rng = random.Random(100 + seed)
    for _ in range(12):
        cfg = _random_config(rng)
        pred = predict(cfg)
        nr = np.random.default_rng(seed)
        n_in = cfg.count * (cfg.nranks if cfg.collective == "reduce_scatter" else 1)
        xs = [nm.from_bits(nm.encode(nr.standard_normal(n_in) * 100, cfg.dtype), cfg.dtype)
              for _ in range(cfg.nranks)]
        outs = pred.outputs(xs)
        for r, out in enumerate(outs):
            if out is None:
                continue
            off = r * cfg.count if cfg.collective == "reduce_scatter" else 0
            for e in rng.sample(range(cfg.count), min(cfg.count, 10)):
                expr = pred.order_map(r).expr(e)

                def ev(x):
                    if isinstance(x, int):
                        return xs[x][off + e:off + e + 1]
                    return reduce_arrays([ev(i) for i in x], "sum", cfg.dtype)
                assert nm.as_bits(ev(expr), cfg.dtype)[0] == nm.as_bits(out, cfg.dtype)[e]


def test_the_issue_example_three_ranks_twelve_elements():
    """3 ranks, 12 float32, inputs 2^30, -2^30, 1: one-channel Ring gives 0 in 8, 1 in 4 (a
    left fold in rank order gives 1 in all 12)."""
    cfg = OrderConfig.make("all_reduce", 3, 12)
    x = [np.full(12, 2.0 ** 30, np.float32), np.full(12, -2.0 ** 30, np.float32),
         np.ones(12, np.float32)]
    out = predict(cfg).outputs(x)[0]
    assert out.tolist() == [0.0] * 8 + [1.0] * 4
    assert reduce_arrays(x, "sum", "float32").tolist() == [1.0] * 12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64",
                                   "float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_revealing_inputs_round_trip_through_every_left_fold(dtype, n):
    """Encoder -> numeric fold -> decoder gives the symbolic signature, and the decoder finds
    the fold (up to its first two ranks) among every left fold."""
    plan = reveal_plan(dtype, n)
    count = 3 * len(plan.pairs) * max(1, n - 2)
    xs = revealing_inputs(plan, count)
    rng = random.Random(n)
    perms = list(itertools.permutations(range(n)))
    for perm in rng.sample(perms, min(len(perms), 6)):
        out = reduce_arrays([x for x in (xs[r] for r in perm)], "sum", dtype)
        masks = observed_masks(plan, out)
        for e in range(count):
            assert masks[e] == signature(perm, *plan.layout(e))
        folds = consistent_left_folds(plan, list(range(count)), masks)
        norm = tuple(sorted(perm[:2])) + perm[2:]
        assert norm in folds
        if plan.cap >= n - 2:                  # every rank tells its place: one fold
            assert folds == [norm]


def test_revealing_inputs_see_a_tree_and_the_decoder_says_no_left_fold_fits():
    plan = reveal_plan("float32", 4)
    xs = revealing_inputs(plan, 60)
    # (x0 + (x1 + x2)) + x3 is the left fold ((1 + 2) + 0) + 3 (an add cannot tell its
    # operands apart); (x0 + x1) + (x2 + x3) is no left fold
    expr = ((0, 1), (2, 3))
    vals = reduce_arrays([reduce_arrays([xs[0], xs[1]], "sum", "float32"),
                          reduce_arrays([xs[2], xs[3]], "sum", "float32")], "sum", "float32")
    masks = observed_masks(plan, vals)
    assert all(masks[e] == signature(expr, *plan.layout(e)) for e in range(60))
    assert consistent_left_folds(plan, list(range(60)), masks) == []


def test_an_output_no_fold_gives_decodes_to_minus_one():
    plan = reveal_plan("float32", 4)
    masks = observed_masks(plan, np.array([2.0 ** 27, -1.0, 0.5, np.nan], np.float32))
    assert masks.tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize("op, scalar", [("prod", None), ("min", None), ("max", None),
                                        ("avg", None), ("premul_sum", 0.375)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_every_op_folds_in_the_predicted_order(op, scalar, dtype):
    if op == "premul_sum" and dtype == "int32":
        with pytest.raises(ValueError, match="scalar: premul_sum scalar 0.375 on integer"):
            OrderConfig.make("all_reduce", 3, 40, dtype=dtype, op=op, scalar=scalar)
        scalar = 3.0
    cfg = OrderConfig.make("all_reduce", 3, 40, dtype=dtype, op=op, scalar=scalar)
    pred = predict(cfg)
    nr = np.random.default_rng(1)
    xs = [nm.from_bits(nm.encode(nr.standard_normal(40) * 3 + 1, dtype), dtype)
          for _ in range(3)]
    out = pred.outputs(xs)[0]
    m = pred.order_map(0)
    red = op if op in ("prod", "min", "max") else "sum"
    for e in range(40):
        order = m.expr(e)
        if op == "premul_sum" or (op == "avg" and dtype != "int32"):
            o = op if op == "avg" else premul_sum(scalar)
            leaves = [reduce_arrays([xs[r][e:e + 1]], o, dtype, world_size=3) for r in order]
            want = reduce_arrays(leaves, "sum", dtype)
        else:
            want = reduce_arrays([xs[r][e:e + 1] for r in order],
                                 "avg" if op == "avg" else red, dtype, world_size=3)
        assert nm.as_bits(want, dtype)[0] == nm.as_bits(out, dtype)[e], (op, dtype, e)


def test_integer_sums_do_not_depend_on_the_order_but_floats_do():
    xs = [np.array([2 ** 31 - 1, 5], np.int32), np.array([1, -7], np.int32),
          np.array([-3, 9], np.int32)]
    a = predict(OrderConfig.make("all_reduce", 3, 2, dtype="int32")).outputs(xs)[0]
    b = predict(OrderConfig.make("all_reduce", 3, 2, dtype="int32", ring=[0, 2, 1])).outputs(
        xs)[0]
    assert a.tolist() == b.tolist() == reduce_arrays(xs, "sum", "int32").tolist()


@pytest.mark.parametrize("kwargs, reason", [
    (dict(version="2.21.5"), "2.21.5 is not a version"),
    (dict(version="2.31.0"), "2.31.0 is not a version"),
    (dict(collective="reduce_scatter", algo="tree"), "no Tree kernel for reduce_scatter"),
    (dict(collective="reduce", algo="tree"), "no Tree kernel for reduce"),
    (dict(buffsizes={"simple": 512}), "gives no chunk"),
    (dict(buffsizes={"simple": 1 << 40}), "21-bit chunkGrains"),
])
def test_refusals_say_why(kwargs, reason):
    args = dict(collective="all_reduce", nranks=4, count=100)
    args.update(kwargs)
    cfg = OrderConfig.make(args.pop("collective"), args.pop("nranks"), args.pop("count"),
                           **args)
    with pytest.raises(CannotPredict, match=reason):
        predict(cfg)


@pytest.mark.parametrize("kwargs, field", [
    (dict(nranks=0), "nranks"), (dict(count=0), "count"), (dict(algo="nvls"), "algo"),
    (dict(proto="ll64"), "proto"), (dict(dtype="int16"), "dtype"), (dict(op="band"), "op"),
    (dict(root=4), "root"), (dict(ring=[0, 1, 1, 2]), "ring"), (dict(channels=65), "channels"),
    (dict(op="premul_sum"), "scalar"), (dict(rings=[[0, 1, 2, 3]], channels=2), "rings"),
    (dict(trees=[((-1, (1, 2, 3)), (0, ()), (0, ()), (0, ()))]), "trees[0]"),
])
def test_bad_configs_name_the_field(kwargs, field):
    args = dict(collective="all_reduce", nranks=4, count=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{field.replace('[', '.').replace(']', '.')}"):
        OrderConfig.make(args.pop("collective"), args.pop("nranks"), args.pop("count"), **args)


def test_one_rank_copies_its_input_and_premul_multiplies_it():
    x = [np.array([1.5, -2.0, 3.25], np.float32)]
    assert predict(OrderConfig.make("all_reduce", 1, 3)).outputs(x)[0].tolist() == \
        [1.5, -2.0, 3.25]
    out = predict(OrderConfig.make("all_reduce", 1, 3, op="premul_sum", scalar=2.0)).outputs(x)
    assert out[0].tolist() == [3.0, -4.0, 6.5]


def test_judge_compares_nans_as_a_class_and_lists_the_first_differences():
    cfg = OrderConfig.make("all_reduce", 2, 4)
    pred = predict(cfg)
    xs = [np.array([np.nan, 1, 2, 3], np.float32), np.array([1, 1, 1, 1], np.float32)]
    good = pred.outputs(xs)[0]
    other_nan = good.copy().view(np.uint32)
    other_nan[0] = 0x7FC00001
    assert judge(pred, xs, [other_nan.view(np.float32), None]).kind == "PREDICTED"
    bad = good.copy()
    bad[2] += 1
    v = judge(pred, xs, [bad, None])
    assert v.kind == "MISMATCH" and v.differing == 1 and v.first[0].element == 2


def test_each_port_is_one_range_of_tags():
    seen = [v for p in PORTS for v in p.tags]
    assert len(seen) == len(set(seen)) == 21
    assert port_for(22809).name == "2.26-2.28" and port_for(23007).name == "2.29-2.30"
    with pytest.raises(CannotPredict, match="2.22.3, 2.23.4"):
        port_for(22105)


def test_split_refuses_an_empty_call_and_pins_the_2_22_single_channel_case():
    port = port_for(22809)
    with pytest.raises(ValueError, match="count: expected >= 1, got 0"):
        cbd_split(port, "all_reduce", "simple", 2, 0, 4, 1, 1, {"lo": 512, "mid": 512,
                                                                "hi": 512})
    # 2.22.3, one channel: everything goes to "lo" (enqueue.cc: channelId+1 == nMaxChannels),
    # never through the first channel's rounded-down cells (5 floats = 2 cells of 16 bytes)
    s = cbd_split(port_for(22203), "all_reduce", "simple", 4, 5, 4, 1, 1,
                  {"lo": 2048, "mid": 2048, "hi": 2048})
    assert (s.channel_lo, s.channel_hi, s.count_lo, s.count_hi) == (0, 0, 5, 0)
    assert s.describe() == "channels 0..0: 5 elements, chunk of 512"


def test_default_thread_thresholds_are_ncclss():
    """graph/tuning.cc:542-547: LL 8, LL128 8, Simple 64; Ring/LL times nRanks."""
    from ncclpy.order.split import default_thresholds
    assert default_thresholds(5) == {("tree", "ll"): 8, ("tree", "ll128"): 8,
                                     ("tree", "simple"): 64, ("ring", "ll"): 40,
                                     ("ring", "ll128"): 8, ("ring", "simple"): 64}


def test_order_maps_runs_default_rank_and_outputs_for_some_ranks():
    from ncclpy.order.model import OrderMap
    assert OrderMap((0,), np.zeros(0, np.int32)).runs() == []
    cfg = OrderConfig.make("reduce_scatter", 3, 4, ring=[0, 2, 1])
    pred = predict(cfg)
    assert pred.order_map() is pred.order_map(0)
    xs = [np.arange(12, dtype=np.float32) * (r + 1) for r in range(3)]
    some = pred.outputs(xs, ranks=[2])
    assert some[0] is None and some[1] is None and some[2] is not None
    assert some[2].tolist() == pred.outputs(xs)[2].tolist()


def test_the_chunk_grains_field_holds_at_most_2_21_minus_1_grains():
    """chunkGrains is 21 bits (device.h:297): a Simple ring all_reduce chunk of 2^21 grains
    (NCCL_BUFFSIZE 2^31) overflows it; one grain less does not."""
    ok = OrderConfig.make("all_reduce", 2, 8, buffsizes={"simple": (1 << 31) - 1024})
    assert predict(ok).split.parts[0].chunk == ((1 << 30) - 512) // 4
    with pytest.raises(CannotPredict, match="21-bit chunkGrains"):
        predict(OrderConfig.make("all_reduce", 2, 8, buffsizes={"simple": 1 << 31}))


def test_reveal_plans_and_layouts_are_pinned():
    """The plan's constants (module docstring: M = 2^(b+cap+p+1), smalls 2^b ... ) and which
    ranks get the smalls: they rotate over the periods of the pairs."""
    got = {(d, n): (p.cap, p.b, p.m) for d in ("float32", "float16", "float8_e4m3")
           for n in (3, 8) for p in [reveal_plan(d, n)]}
    assert got == {("float32", 3): (1, 0, 26), ("float32", 8): (6, 0, 31),
                   ("float16", 3): (1, 0, 13), ("float16", 8): (6, -4, 14),
                   ("float8_e4m3", 3): (1, 0, 6), ("float8_e4m3", 8): (4, -2, 7)}
    plan = reveal_plan("float8_e5m2", 8)              # cap 3 of the 6 others
    assert plan.layout(0) == ((0, 1), (2, 3, 4))
    assert plan.layout(28) == ((0, 1), (3, 4, 5))     # the next period: rotated by one
    assert plan.layout(29) == ((0, 2), (3, 4, 5))
    # a value holding a power above the smalls (2^(b+cap)) is no fold's result
    top = np.array([2.0 ** (plan.b + plan.cap)], np.float64)
    assert observed_masks(plan, nm.from_bits(nm.encode(top, plan.dtype), plan.dtype))[0] == -1


def test_the_overflow_branch_of_the_split_is_reached_and_ported():
    """enqueue.cc:616-620: int8, 2 ranks, 131073 elements, 4 channels: cellsPerChannel's
    rounding leaves one cell over, so the last channel takes it."""
    s = predict(OrderConfig.make("all_reduce", 2, 131073, dtype="int8", channels=4)).split
    assert [p.count for p in s.parts] == [32768, 32768, 32768, 32769]
    assert (s.count_lo, s.count_mid, s.count_hi) == (32768, 32768, 32769)


def test_a_prediction_equals_another_of_its_config_whether_its_maps_were_built_or_not():
    """The maps are a cache built on first use: they never make two predictions of one
    configuration differ, in equality or in print."""
    cfg = OrderConfig.make("all_reduce", 3, 40)
    a, b = predict(cfg), predict(cfg)
    assert a.maps is not None and a == b and b == predict(cfg)
    assert repr(a) == repr(b) and "maps" not in repr(a)      # nor what they print
    assert a != predict(OrderConfig.make("all_reduce", 3, 41))
