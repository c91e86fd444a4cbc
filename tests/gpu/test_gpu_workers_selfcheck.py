"""CPU checks of the GPU tests' own arithmetic: every input and every partial reduction the
GPU matrix compares for equality is exactly representable in its dtype, whatever order NCCL
reduces in, and the bf16/fp8 codecs agree with torch's.  Runs without a GPU."""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common as W  # noqa: E402


def _exact(dt: W.DT, values) -> bool:
    try:
        return bool(np.array_equal(dt.decode(dt.encode(np.asarray(values))), np.asarray(values)))
    except AssertionError:
        return False


def _partials(dt: W.DT, op: str, xs):
    """Every partial result over every subset of ranks, as NCCL may form it."""
    n = len(xs)
    x = np.stack([np.asarray(v) for v in xs])
    if op == "avg":
        if dt.kind in ("int", "uint"):
            op, x = "sum", x
        else:
            x = x * (1.0 / n)       # NCCL pre-multiplies each input by 1/n (exact for n=1,2,4)
            op = "sum"
    if op == "premul_sum":
        x, op = x * W.PREMUL_SCALAR, "sum"
    for k in range(1, n + 1):
        for sub in itertools.combinations(range(n), k):
            part = x[list(sub)]
            yield {"sum": part.sum(0), "prod": part.prod(0), "max": part.max(0),
                   "min": part.min(0)}[op]


@pytest.mark.parametrize("name", W.ALL_DTYPES)
def test_inputs_and_partials_are_exact(name):
    dt = W.DT(name)
    for n in (1, 2, 3, 4):
        for op in W.OPS:
            if dt.kind == "bool" and op in ("avg", "premul_sum"):
                continue
            if dt.kind == "complex" and op in ("prod", "max", "min"):
                continue
            for salt in range(8):
                xs = [W.gen(dt, r, 37, op, salt) for r in range(n)]
                for x in xs:
                    assert _exact(dt, x), (name, op, n, salt)
                if dt.kind == "bool":
                    continue
                exact_needed = W.tolerance(dt, op, n) == 0.0
                want = W.expected_reduce(dt, op, xs)
                if exact_needed:
                    assert _exact(dt, want), (name, op, n, salt, want)
                    for part in _partials(dt, op, xs):
                        assert _exact(dt, part), (name, op, n, salt)
                if dt.kind in ("int", "uint"):
                    info = np.iinfo(np.dtype(name))
                    for part in _partials(dt, "sum" if op == "avg" else op, xs):
                        assert info.min <= part.min() and part.max() <= info.max


@pytest.mark.parametrize("name", W.ALL_DTYPES)
def test_data_movement_inputs_are_exact(name):
    dt = W.DT(name)
    for n in (1, 2, 3, 4):
        for s in range(n):
            for d in range(n):
                assert _exact(dt, W.a2a_data(dt, s, d, 11))
        assert _exact(dt, dt.sentinel(5))


def test_uneven_counts():
    for n in (1, 2, 3, 4):
        table = [[W.uneven_count(s, d) for d in range(n)] for s in range(n)]
        assert all(0 <= c <= 2 for row in table for c in row)
        if n == 1:
            assert table[0][0] > 0          # n=1 still moves data
        else:
            assert any(c == 0 for row in table for c in row), "no zero-count peer pair"
            assert len({tuple(row) for row in table}) > 1, "not uneven"


def test_codecs_match_torch():
    torch = pytest.importorskip("torch")
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for name, tdt in (("float8_e4m3", torch.float8_e4m3fn), ("float8_e5m2", torch.float8_e5m2)):
        ref = bits.view(tdt).to(torch.float64).numpy()
        ours = W.DT(name).decode(np.arange(256, dtype=np.uint8))
        both_nan = np.isnan(ref) & np.isnan(ours)
        assert np.array_equal(ref[~both_nan], ours[~both_nan]), name
    b16 = np.arange(0, 1 << 16, 7, dtype=np.uint16)
    ref = torch.from_numpy(b16.view(np.int16)).view(torch.bfloat16).to(torch.float64).numpy()
    with np.errstate(invalid="ignore"):   # NaN payloads
        ours = W.DT("bfloat16").decode(b16)
    keep = ~np.isnan(ref)
    assert np.array_equal(ref[keep], ours[keep])
    dt = W.DT("bfloat16")
    v = np.array([-2.0, -0.25, 0.0, 1.5, 3.0, 16.0])
    assert np.array_equal(dt.decode(dt.encode(v)), v)


def test_expected_values_by_hand():
    i8 = W.DT("int8")
    xs = [np.array([-3.0, 5.0, 7.0]), np.array([1.0, 0.0, -8.0])]
    assert W.expected_reduce(i8, "avg", xs).tolist() == [-1, 2, 0]   # C truncation
    b = W.DT("bool")
    xs = [np.array([True, False, True]), np.array([False, False, True])]
    assert W.expected_reduce(b, "sum", xs).tolist() == [True, False, True]
    assert W.expected_reduce(b, "prod", xs).tolist() == [False, False, True]
    f = W.DT("float32")
    assert W.expected_reduce(f, "premul_sum", [np.ones(2), np.ones(2)]).tolist() == [4.0, 4.0]
