"""Every seed example E1-E35 (shared/seeds/README.md) as inputs -> reference outputs."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ncclpy import reference as R
from ncclpy import registry
from ncclpy.check import seed_examples as S

DATA = [e for e in S.EXAMPLES if not e.extra.get("benchmark") and e.collective != "barrier"]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def test_every_readme_id_is_covered():
    assert S.ids() == [f"E{i}" for i in range(1, 36)]
    readme = Path(__file__).resolve().parents[1].parent / "shared" / "seeds" / "README.md"
    if readme.exists():   # the table there lists E1..E35 (ranges like E18–E21 included)
        text = readme.read_text(encoding="utf-8")
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
