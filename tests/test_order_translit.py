"""The reduction-order model against a transliteration of NCCL's code (tests/order_translit.py:
every rank's device loop over FIFO connections with symbolic values; host split, channel tuning
and chunking ported separately).  The two share no code; they must agree on every element of
every rank's output, on thousands of random configurations: world sizes 2-8, each channel its
own random ring or tree, 1-4 channels, every protocol, element sizes 1-8 bytes, small buffers
so that counts cross loop boundaries, and counts that span several channels."""
from __future__ import annotations

import random
from typing import List, Tuple

import numpy as np
import pytest

import order_translit as T
from ncclpy.order.config import OrderConfig
from ncclpy.order.model import predict
from ncclpy.order.split import DEFAULT_MAX_THREADS, default_thresholds

BATCHES = 20
PER_BATCH = 100
_DTYPES = {1: "float8_e4m3", 2: "bfloat16", 4: "float32", 8: "float64"}
_FUNC = {"all_reduce": "AllReduce", "reduce_scatter": "ReduceScatter", "reduce": "Reduce"}


def random_tree(rng: random.Random, n: int) -> Tuple[Tuple[int, Tuple[int, ...]], ...]:
    """A random tree over n ranks: the root folds at most 2 children, others at most 3."""
    order = list(range(n))
    rng.shuffle(order)
    up = {order[0]: -1}
    downs = {r: [] for r in range(n)}
    for v in order[1:]:
        cands = [p for p in up if len(downs[p]) < (2 if up[p] == -1 else 3)]
        p = rng.choice(cands)
        up[v] = p
        downs[p].append(v)
    return tuple((up[r], tuple(downs[r])) for r in range(n))


def random_case(rng: random.Random) -> dict:
    n = rng.randint(2, 8)
    coll = rng.choice(["all_reduce", "all_reduce", "reduce_scatter", "reduce"])
    algo = "tree" if coll == "all_reduce" and rng.random() < 0.35 else "ring"
    proto = rng.choice(["ll", "ll128", "simple"])
    es = rng.choice([1, 2, 4, 8])
    nch = rng.randint(1, 4)
    rings = []
    for _ in range(nch):
        r = list(range(n))
        rng.shuffle(r)
        rings.append(r)
    trees = [random_tree(rng, n) for _ in range(nch)]
    buff = {"simple": 4096 * rng.randint(1, 4), "ll": 256 * rng.randint(4, 16),
            "ll128": 16384 * rng.randint(1, 2)}[proto]
    version = rng.choice([22203, 22304, 22501, 22809, 22907, 23007])
    grain = T.GRAIN[proto]
    chunk = T.calc_coll_chunking(_FUNC[coll], algo, proto, buff, 1 << 30, 1, n) // es
    kind = rng.random()
    if kind < 0.4:
        count = rng.randint(1, 70)
    elif kind < 0.75:
        count = max(1, n * chunk * rng.randint(1, 3) + rng.randint(-2 * 16, 2 * 16))
    else:
        count = rng.randint(1, 6) * (16384 // es) + rng.randint(0, 2000)
    del grain
    return dict(coll=coll, n=n, algo=algo, proto=proto, es=es, nch=nch, rings=rings,
                trees=trees, buff=buff, version=version, count=count,
                root=rng.randrange(n))


def check_case(c: dict) -> List[str]:
    """Differences between the model and the transliteration for one case (empty: agree)."""
    n, es = c["n"], c["es"]
    nt = DEFAULT_MAX_THREADS[(c["algo"], c["proto"])]
    thr = default_thresholds(n)[(c["algo"], c["proto"])]
    outs, work, sy = T.simulate(_FUNC[c["coll"]], c["algo"], c["proto"], n, c["count"], es,
                                c["nch"], c["rings"], c["trees"], c["buff"], c["version"], nt,
                                thr, root=c["root"])
    cfg = OrderConfig.make(c["coll"], n, c["count"], dtype=_DTYPES[es], algo=c["algo"],
                           proto=c["proto"], root=c["root"], version=c["version"],
                           channels=c["nch"], rings=c["rings"], trees=c["trees"],
                           buffsizes={c["proto"]: c["buff"]})
    pred = predict(cfg)
    errs = []
    s = pred.split
    if (s.channel_lo, s.channel_hi, s.count_lo, s.count_mid, s.count_hi) != (
            work["channelLo"], work["channelHi"], work["countLo"], work["countMid"],
            work["countHi"]):
        errs.append(f"split {s} vs {work}")
    memo: dict = {}
    for r in range(n):
        m = pred.order_map(r)
        if (m is None) != (outs[r] is None):
            errs.append(f"rank {r}: model {'no ' if m is None else ''}output, "
                        f"transliteration {'none' if outs[r] is None else 'one'}")
            continue
        if m is None:
            continue
        base = r * c["count"] if c["coll"] == "reduce_scatter" else 0
        want_idx = np.arange(base, base + c["count"])
        wrong = np.flatnonzero(outs[r].idx != want_idx)
        if wrong.size:
            errs.append(f"rank {r} element {wrong[0]}: reads input element "
                        f"{outs[r].idx[wrong[0]]}, expected {want_idx[wrong[0]]}")
        keys = np.unique(outs[r].sid * (1 << 20) + m.group)
        for sid, g in zip(keys >> 20, keys & ((1 << 20) - 1)):
            if sy.canon(int(sid), memo) != T.canon_of_expr(m.exprs[int(g)]):
                e = int(np.flatnonzero((outs[r].sid == sid) & (m.group == g))[0])
                errs.append(f"rank {r} element {e}: model {m.exprs[int(g)]}, transliteration "
                            f"{sy.canon(int(sid), memo)}")
                break
    return errs


@pytest.mark.parametrize("batch", range(BATCHES))
def test_model_equals_transliteration(batch: int) -> None:
    rng = random.Random(1000 + batch)
    bad = []
    for _ in range(PER_BATCH):
        c = random_case(rng)
        errs = check_case(c)
        if errs:
            bad.append((c, errs[:3]))
    assert not bad, f"{len(bad)} of {PER_BATCH} cases differ; first: {bad[0]}"


def test_transliteration_sees_a_wrong_model() -> None:
    """The comparison can fail: a model told another ring, or another buffer size (so other
    chunks), disagrees with the transliteration of the real one."""
    c = dict(coll="all_reduce", n=4, algo="ring", proto="simple", es=4, nch=1,
             rings=[[0, 1, 2, 3]], trees=[random_tree(random.Random(0), 4)], buff=4096,
             version=22809, count=3000, root=0)
    assert check_case(c) == []
    real = dict(c)
    orig = OrderConfig.make
    for change in ({"rings": [[0, 2, 1, 3]]}, {"buffsizes": {"simple": 8192}}):
        def lying(*a, _change=change, **k):
            k.update(_change)
            return orig(*a, **k)
        OrderConfig.make = lying
        try:
            assert check_case(real), f"{change} went unnoticed"
        finally:
            OrderConfig.make = orig


def test_simple_and_ll_place_operands_differently() -> None:
    """The transliteration keeps each protocol's operand placement: Simple adds the local input
    first (acc = src[0]), LL/LL128 the received value first; the sums are the same folds."""
    placements = {}
    for proto in ("simple", "ll"):
        sy, net = T.Syms(), T.Net()
        nt = DEFAULT_MAX_THREADS[("ring", proto)]
        thr = default_thresholds(2)[("ring", proto)]
        work = T.schedule("AllReduce", "ring", proto, 2, 4, 4,
                          T.topo_nc("AllReduce", 2, 4, 4, 1, nt, thr), 1, 1 << 22, 22809, 1)
        ranks = [T.Rank(r, 2, sy, net, proto, 4, 4) for r in range(2)]
        gens = [T.ring_all_reduce(r, 0, T.setup_ring([0, 1], r.rank), work, proto, 4)
                for r in ranks]
        T.run_all(net, gens)
        node = sy.nodes[int(ranks[0].out.sid[0])]
        placements[proto] = (sy.nodes[node[1]][1], sy.nodes[node[2]][1])
    # element 0 is chunk 0: rank 1 sends, rank 0 (position 0) reduces its own input with it
    assert placements["simple"] == (0, 1)
    assert placements["ll"] == (1, 0)


def test_host_split_equals_transliteration_on_every_port_and_any_world_size():
    """The host half alone (channel tuning, split, chunks) on 20,000 random lone calls: every
    port, world sizes up to 64 (reduce_scatter's traffic per byte grows with them, so 2.22's
    rounded-down first channel can be empty and the split skips it), 1-8 channels."""
    from ncclpy.order.split import chunk_bytes, cbd_split, tuned_channels
    from ncclpy.order.versions import PORTS
    rng = random.Random(7)
    for _ in range(20000):
        port = rng.choice(PORTS)
        version = rng.choice(port.tags)
        coll = rng.choice(["all_reduce", "reduce_scatter", "reduce"])
        n = rng.choice([2, 3, 4, 7, 8, 16, 33, 40, 64])
        es = rng.choice([1, 2, 4, 8])
        proto = rng.choice(["ll", "ll128", "simple"])
        nch = rng.randint(1, 8)
        count = rng.choice([rng.randint(1, 100), rng.randint(1, 5000), rng.randint(1, 300000)])
        nt = rng.choice([256, 512, 640])
        thr = default_thresholds(n)[("ring", proto)]
        tc = tuned_channels(coll, "ring", proto, n, count, es, nch, nt, thr)
        assert tc == T.topo_nc(_FUNC[coll], n, count, es, nch, nt, thr)
        if rng.random() < 0.3:                  # a tuner plugin's choice (enqueue.cc:1973)
            tc = rng.randint(1, nch)
        cb = chunk_bytes(coll, "ring", proto, {"ll": 1 << 19, "ll128": 4915200,
                                               "simple": 1 << 22}[proto])
        s = cbd_split(port, coll, proto, n, count, es, tc, nch, {"lo": cb, "mid": cb, "hi": cb})
        w = T.schedule(_FUNC[coll], "ring", proto, n, count, es, tc, nch,
                       {"ll": 1 << 19, "ll128": 4915200, "simple": 1 << 22}[proto], version, 1)
        assert (s.channel_lo, s.channel_hi, s.count_lo, s.count_mid, s.count_hi) == (
            w["channelLo"], w["channelHi"], w["countLo"], w["countMid"], w["countHi"]), (
            port.name, coll, proto, n, count, es, tc, nch)
        assert s.parts[0].chunk == w["chunkGrainsLo"] * T.GRAIN[proto] // es


@pytest.mark.parametrize("version, coll, proto, n, count, es, tc, nch", [
    # 2.22.3's first channel rounded down to no cell (trafficPerCell 16*33 > 512): skipped,
    # and the plan then overflows the channels (enqueue.cc:616-620)
    (22203, "reduce_scatter", "ll128", 33, 5, 8, 3, 3),
    (22203, "reduce_scatter", "ll", 33, 30707, 4, 2, 4),
    # one channel: everything goes to "lo", never through the rounded-down cells
    (22203, "reduce_scatter", "ll128", 64, 1225, 1, 1, 1),
    (22203, "all_reduce", "simple", 4, 257, 1, 1, 1)])
def test_host_split_edge_cases_equal_transliteration(version, coll, proto, n, count, es, tc,
                                                      nch):
    from ncclpy.order.split import cbd_split
    from ncclpy.order.versions import port_for
    ch = {"lo": 512, "mid": 512, "hi": 512}
    s = cbd_split(port_for(version), coll, proto, n, count, es, tc, nch, ch)
    w = T.schedule(_FUNC[coll], "ring", proto, n, count, es, tc, nch, 1 << 22, version, 1)
    assert (s.channel_lo, s.channel_hi, s.count_lo, s.count_mid, s.count_hi) == (
        w["channelLo"], w["channelHi"], w["countLo"], w["countMid"], w["countHi"])
