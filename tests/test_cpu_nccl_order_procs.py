"""The CPU backend gives NCCL's bits across processes (issue 51, item 2): ranks spawned with
``ncclpy.spawn`` on ``ncclpy.init(device="cpu")`` (the multi-process transport,
ncclpy/cpu/transport.py) fold all_reduce, reduce_scatter and reduce in the order NCCL would
for the configuration each communicator read at init, and refuse what NCCL refuses, with
NCCL's text.  Rank bodies: tests/cpu_order_jobs.py; the in-process engine's tests:
tests/test_cpu_nccl_order.py."""
from __future__ import annotations

import json
from typing import Dict, List

import numpy as np
import pytest

import ncclpy
from ncclpy.semantics import reference as R
from ncclpy.order import Pins, predict

import cpu_order_jobs as J

pytestmark = pytest.mark.timeout(300)

_ORDER_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
              "NCCL_MIN_NRINGS", "NCCL_MAX_NRINGS", "NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE",
              "NCCL_LL128_BUFFSIZE")
NO_ALGO = ("NcclInvalidUsage: nccl{fn} failed: ncclInvalidUsage (5): Error : no "
           "algorithm/protocol available for function {fn} with datatype ncclFloat32. "
           "NCCL_ALGO was set to Tree.")


def _run(monkeypatch, tmp_path, n: int, env: Dict[str, str]) -> List[dict]:
    for var in _ORDER_ENV:                       # the children inherit this process's
        monkeypatch.delenv(var, raising=False)
    ncclpy.spawn(J.order_job, n, args=(str(tmp_path),), env=env, timeout=240)
    out = [json.load(open(tmp_path / f"{r}.json")) for r in range(n)]
    assert [o["violations"] for o in out] == [[]] * n, "NCCL rules broken"
    return out


def _check_random(out: List[dict], env: Dict[str, str], n: int) -> None:
    """Every rank's random-normal outputs are the model's bits for the configuration ``env``
    pins (and, for each call, some element differs from rank order: the order is seen)."""
    pins = Pins.from_env(env)
    for k, (name, kind, op, count) in enumerate(J.RANDOM):
        ins = J.inputs(n, count * (n if kind == "reduce_scatter" else 1), seed=k)
        want = predict(pins.cpu_choice(kind).config(kind, n, count, op=op, root=1)).outputs(ins)
        rank_order = getattr(R, kind)(ins, op=op, root=1)
        for r in range(n):
            got = np.frombuffer(bytes.fromhex(out[r][name]), np.float32)
            if kind == "reduce" and r != 1:
                assert (got == -1).all(), (name, r)        # a non-root's output untouched
                continue
            assert got.tobytes() == want[r].tobytes(), (name, r)
        assert any(want[r].tobytes() != rank_order[r].tobytes()
                   for r in ([1] if kind == "reduce" else range(n))), name


def test_the_issues_example_and_random_normals_ring_simple_one_channel(monkeypatch, tmp_path):
    env = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1",
           "NCCL_MAX_NCHANNELS": "1"}
    out = _run(monkeypatch, tmp_path, 3, env)
    for o in out:
        assert o["choice"] == ["ring", "simple", 1]
        # NCCL's one-channel ring (hand-computed: tests/test_cpu_nccl_order.py); rank order
        # would give 1 in all twelve
        assert o["example"] == [0.0] * 8 + [1.0] * 4
        assert o["reduce_scatter sum refused"] == o["reduce sum refused"] == "ok"
        assert o["broadcast"] == o["send_recv"] == "ok"
    _check_random(out, env, 3)


def test_tree_folds_its_own_order_and_refuses_what_has_no_tree(monkeypatch, tmp_path):
    out = _run(monkeypatch, tmp_path, 3, {"NCCL_ALGO": "Tree"})
    ins = [np.full(12, v, np.float32) for v in J.EXAMPLE]
    tree = predict(Pins.from_env({"NCCL_ALGO": "Tree"}).cpu_choice("all_reduce").config(
        "all_reduce", 3, 12)).outputs(ins)[0].tolist()
    assert tree == [0.0] * 12          # 0 + (2 + 1): 2^30 + (1 + -2^30) = 2^30 - 2^30 = 0
    for o in out:
        assert o["choice"] == ["tree", "simple", 1]
        assert o["example"] == tree
        assert o["reduce_scatter sum refused"] == NO_ALGO.format(fn="ReduceScatter")
        assert o["reduce sum refused"] == NO_ALGO.format(fn="Reduce")
        assert o["broadcast"] == NO_ALGO.format(fn="Broadcast")
        assert o["send_recv"] == "ok"


@pytest.mark.parametrize("n, env, choice", [
    (4, {}, ["ring", "simple", 1]),                         # nothing pinned: the default
    (5, {"NCCL_MIN_NCHANNELS": "2"}, ["ring", "simple", 2]),
])
def test_random_normals_are_the_models_bits(monkeypatch, tmp_path, n, env, choice):
    out = _run(monkeypatch, tmp_path, n, env)
    assert [o["choice"] for o in out] == [choice] * n
    _check_random(out, env, n)


def test_an_algorithm_nccl_cannot_parse_fails_every_ranks_init(monkeypatch, tmp_path):
    out = _run(monkeypatch, tmp_path, 2, {"NCCL_ALGO": "ring,treee"})
    assert [o["init"] for o in out] == [
        "NcclInvalidUsage: ncclCommInitRank failed: ncclInvalidUsage (5): Unrecognized "
        'element token "treee" when parsing "ring,treee"'] * 2
