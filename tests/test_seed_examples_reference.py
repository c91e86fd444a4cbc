"""Every seed example E1-E35 (shared/seeds/README.md) as inputs -> reference outputs.

The seed tutorials are read where ``tests/seed_util.py`` finds them: ``$NCCLPY_SEEDS``, the
workspace's ``../shared/seeds``, else the committed snapshot ``tests/seeds`` (kept identical to
the workspace copy by a test), so these tests run on every clone and never turn into no-ops;
``NCCLPY_SEEDS=none`` uses the snapshot alone.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from ncclpy.semantics import reference as R
from ncclpy.semantics import registry
from ncclpy.check import seed_examples as S

DATA = [e for e in S.EXAMPLES if not e.extra.get("benchmark") and e.collective != "barrier"]
from seed_util import SNAPSHOT, seeds_dir, workspace_seeds  # noqa: E402


def seed_text(prefix: str) -> str:
    (path,) = sorted(p for p in seeds_dir().glob(f"{prefix}_*.txt"))
    return path.read_text(encoding="utf-8")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def test_every_readme_id_is_covered():
    assert S.ids() == [f"E{i}" for i in range(1, 36)]
    # the README's table lists E1..E35 (ranges like E18–E21 included)
    text = (seeds_dir() / "README.md").read_text(encoding="utf-8")
    ids = set()
    for lo, hi in re.findall(r"\|\s*E(\d+)(?:[–-]E(\d+))?\s*\|", text):
        ids.update(range(int(lo), int(hi or lo) + 1))
    assert ids == set(range(1, 36))


@pytest.mark.parametrize("ex", DATA, ids=[e.key for e in DATA])
def test_reference_reproduces_the_tutorial(ex):
    ins = ex.inputs()
    got = ex.reference_outputs(ins)
    want = ex.expected_outputs(ins)
    assert len(got) == ex.world_size == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert _same(g, w), f"{ex.key} rank {r}: reference {g!r}, tutorial shows {w!r}"


def test_examples_use_registry_collectives():
    for e in S.EXAMPLES:
        assert registry.get(e.collective).name == e.collective


def test_get_by_key_and_id():
    assert S.get("E5").collective == "reduce"
    e6 = S.get("E6")
    assert isinstance(e6, list) and {e.key for e in e6} == {"E6-1x5", "E6-2x5"}
    with pytest.raises(KeyError):
        S.get("E99")


def test_e5_e23_non_roots_keep_their_input_in_place():
    e5 = S.get("E5")
    out = e5.reference_outputs()
    assert [float(o[0, 0]) for o in out] == [6.0, 1.0, 2.0, 3.0]
    # out of place the non-root buffers are undefined
    raw = R.reduce(e5.inputs(), root=0)
    assert raw[1] is None and raw[3] is None


def test_e29_barrier_semantics():
    e29 = S.get("E29")
    arrivals = e29.inputs()
    assert arrivals == [0.0, 1.0, 2.0]
    leave = e29.reference_outputs()
    assert leave == [2.0, 2.0, 2.0] == e29.expected_outputs()
    # nobody leaves before the last arrival, whatever the order of arrival
    assert R.barrier(arrivals=[2.0, 0.0, 1.0]) == [2.0] * 3


def test_e33_bandwidth_formula_is_busbw_in_other_units():
    ar = registry.get("all_reduce")
    for n in (2, 3, 4, 8):
        for size, t in ((4 * 2 ** 20, 1e-3), (1 << 30, 0.0123)):
            algbw, busbw = ar.bandwidths(size, t, n)                 # GB/s (1e9)
            assert busbw == pytest.approx(algbw * ar.busbw_factor(n))
            tut = S.busbw_003(size, t, n)                            # bytes/s
            assert tut == pytest.approx(busbw * 1e9, rel=1e-12)
            # the tutorial prints round(bw / 1024**3): GiB/s, ~7% below nccl-tests' GB/s
            assert tut / 1024 ** 3 == pytest.approx(busbw * 1e9 / 2 ** 30)
            assert tut / 1024 ** 3 < busbw
    assert "GiB" in S.get("E33").note


def test_e33_formula_is_the_tutorials_own_code():
    """Run seed 003's bandwidth lines themselves (copied from the text at test time) and compare
    with busbw_003; the tutorial prints the figure divided by 1024**3 but labels it GB/s."""
    text = seed_text("003")
    wanted = ("size_bytes =", "sent_bytes =", "total_duration =", "bandwidth =")
    code = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(wanted)]
    assert [c.split("=")[0].strip() for c in code] == [w[:-2] for w in wanted], code
    assert "round(bandwidth / 1024**3)} GB/s" in text

    class Data:   # the tensor of the benchmark: only its size matters
        def __init__(self, numel: int) -> None:
            self.n = numel

        def element_size(self) -> int:
            return 4

        def numel(self) -> int:
            return self.n

    for numel, duration, world_size in ((2 ** 20, 1e-3, 4), (2 ** 28, 0.0417, 8), (10, 1.0, 2)):
        scope = {"data": Data(numel), "duration": duration, "world_size": world_size}
        exec("\n".join(code), {}, scope)                              # noqa: S102
        assert scope["bandwidth"] == S.busbw_003(4 * numel, duration, world_size)


def test_e33_benchmark_all_reduce_is_bitwise_identical_everywhere():
    """The data 003 times: every rank ends with the same bits, the left-fold float32 sum."""
    e33 = S.get("E33")
    ins = e33.inputs()
    out = e33.reference_outputs(ins)
    acc = ins[0].copy()
    for x in ins[1:]:
        acc = (acc + x).astype(np.float32)
    assert all(o.dtype == np.float32 and o.tobytes() == acc.tobytes() for o in out)
    assert e33.expected_outputs(ins) == [None] * 4          # the tutorial shows no result


def _tensors(s: str) -> list:
    return [np.array([float(v) for v in t.split(",")], np.float32)
            for t in re.findall(r"tensor\(\[([^\]]*)\]", s)]


def test_e34_reproduces_seed_004s_printed_all_gather():
    """Seed 004 prints each of the 6 ranks' randn(4) and every rank's gathered list: the
    reference all_gather of the printed inputs gives exactly the printed lists, in rank order."""
    text = seed_text("004")
    # two nodes of 3, node 1's output first: the script prints LOCAL_RANK as "rank", so the
    # second group of three is ranks 3 + local
    section = text[:text.index("## all\\_reduce")]
    found = re.findall(r"weight=(tensor\([^)]*\)), rank=(\d+)", section)
    assert len(found) == 6
    weights = {3 * (i // 3) + int(r): _tensors(t)[0] for i, (t, r) in enumerate(found)}
    assert sorted(weights) == list(range(6))
    ins = [weights[r] for r in range(6)]
    shown = [_tensors(line) for line in text.splitlines() if line.startswith("after gather=")]
    assert len(shown) == 6 and all(len(g) == 6 for g in shown)
    e34 = S.get("E34")
    out = e34.reference_outputs(ins)
    assert len(out) == 6
    for o, g in zip(out, shown):
        assert o.shape == (6, 4) and np.array_equal(o, np.stack(g))
    assert [np.array_equal(o, np.stack(ins)) for o in e34.expected_outputs(ins)] == [True] * 6


def test_e34_randn_all_gather_shape_and_order():
    e34 = S.get("E34")
    ins = e34.inputs()
    out = e34.reference_outputs(ins)
    assert len(out) == 6
    for o in out:
        assert o.shape == (6, 4) and o.dtype == np.float32
        for r in range(6):
            assert np.array_equal(o[r], ins[r])        # rank order, bits untouched
    assert not np.array_equal(ins[0], ins[1])


def test_e35_int64_sum_is_42_48():
    out = S.get("E35").reference_outputs()
    assert all(o.dtype == np.int64 and list(o) == [42, 48] for o in out)


def test_e35_matches_seed_004s_printed_tensors():
    text = seed_text("004")
    init = {int(r): [int(v) for v in t.split(",")] for t, r in
            re.findall(r"initial tensor=tensor\(\[([^\]]*)\][^)]*\), rank=(\d+)", text)}
    after = {int(r): [int(v) for v in t.split(",")] for t, r in
             re.findall(r"after all_reduce tensor=tensor\(\[([^\]]*)\][^)]*\), rank=(\d+)",
                        text)}
    assert sorted(init) == sorted(after) == list(range(6))
    e35 = S.get("E35")
    assert [list(x) for x in e35.inputs()] == [init[r] for r in range(6)]
    assert [list(o) for o in e35.reference_outputs()] == [after[r] for r in range(6)]


def test_seed_snapshot_matches_the_workspace():
    """tests/seeds is a byte-for-byte copy of the workspace's shared/seeds, file for file."""
    ws = workspace_seeds()
    snap = sorted(p.name for p in SNAPSHOT.iterdir() if p.is_file())
    assert "README.md" in snap and len([n for n in snap if n.endswith(".txt")]) >= 5, snap
    if ws is None:
        pytest.skip("no workspace copy of shared/seeds here (or NCCLPY_SEEDS=none) to compare "
                    "the snapshot with; the snapshot itself is used")
    assert sorted(p.name for p in ws.iterdir() if p.is_file()) == snap
    for name in snap:
        assert (ws / name).read_bytes() == (SNAPSHOT / name).read_bytes(), name

