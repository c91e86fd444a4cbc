"""The CPU engine gives NCCL's bits (issue 51, item 2): its all_reduce, reduce_scatter and
reduce fold in the order NCCL's Ring/Tree kernels fold for the configuration the communicator
read at init (ncclpy/cpu/folds.py, ncclpy/cpu/algo.py), on thread-ranks of one process (the
stand-in, tests/nccl_standin.py) and, in tests/test_cpu_nccl_order_procs.py, across processes.

Literals are computed by hand from NCCL's loops (src/device/all_reduce.h:32-64 at v2.28.9-1):
3 ranks, 12 float32 elements, one channel: the last loop's chunk is alignUp(divUp(12, 3), 4) = 4
elements, chunk c folds ring positions c+1, c+2, c; rank 0 = 2^30, rank 1 = -2^30, rank 2 = 1.
float32 has 24 bits: 2^30 + 1 rounds to 2^30, -2^30 + 1 to -2^30."""
from __future__ import annotations

import os

import threading
from typing import Any, Callable, List

import numpy as np
import pytest

import ncclpy
from ncclpy.semantics import numerics as nm
from ncclpy.semantics import reference as R
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator
from ncclpy.cpu.algo import comm_choice, nccl_type_name
from ncclpy.cpu.folds import reduce_outputs
from ncclpy.order import Pins, PinError, predict
from ncclpy.order.ncclenv import forget_params
from ncclpy.semantics.ops import RedOp

from nccl_standin import DevArray, run_ranks, standin

UID = bytes(range(128))
BIG = 2.0 ** 30
ONE_RING = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1",
            "NCCL_MAX_NCHANNELS": "1"}
_ORDER_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
              "NCCL_MIN_NRINGS", "NCCL_MAX_NRINGS", "NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE",
              "NCCL_LL128_BUFFSIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Nothing of the order-relevant environment but what a test sets, and NCCL_PARAMs read
    afresh (NCCL reads them once per process: this process runs many tests)."""
    for var in _ORDER_ENV + ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_CONF_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_CONF_FILE", "/nonexistent/nccl.conf")   # no ~/.nccl.conf here
    forget_params()
    yield
    forget_params()


def _pin(monkeypatch, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _on_ranks(n: int, body: Callable[[Communicator, int], Any], blocking: bool = True) -> List:
    """``body(comm, rank)`` on ``n`` thread-ranks of one stand-in, a communicator each (made
    with the environment as it is now); each rank's result."""
    def rank(r: int) -> Any:
        c = Communicator(n, r, UID, r, Config(blocking=blocking))
        try:
            return body(c, r)
        finally:
            try:
                c.close()
            except ncclpy.NcclError:                 # its async error (a refused call)
                c.abort()
    with standin() as eng:
        _ENGINE[0] = eng
        return run_ranks(n, rank, timeout=120)


#: the stand-in of the running ``_on_ranks`` (for comm_choice, which takes the engine)
_ENGINE: List[Any] = [None]


def _all_reduce(values: List[float], count: int = 12, op: Any = "sum") -> Callable:
    def body(c: Communicator, r: int) -> List[float]:
        x = DevArray(np.full(count, values[r], np.float32), device=r)
        c.all_reduce(x, op=op).wait()
        return x.a.tolist()
    return body


# -- the issue's example and hand-computed literals ------------------------------------------
def test_the_issues_example_ring_simple_one_channel(monkeypatch):
    _pin(monkeypatch, ONE_RING)
    got = _on_ranks(3, _all_reduce([BIG, -BIG, 1.0]))
    assert got == [[0.0] * 8 + [1.0] * 4] * 3
    ins = [np.full(12, v, np.float32) for v in (BIG, -BIG, 1.0)]
    assert R.all_reduce(ins)[0].tolist() == [1.0] * 12      # rank order: what it gave before


def test_tree_folds_its_own_order_which_differs_from_rings(monkeypatch):
    # inputs 1, 2^30, -2^30.  Ring: chunk 0 folds (2^30 + -2^30) + 1 = 1, chunk 1
    # (-2^30 + 1) + 2^30 = 0, chunk 2 (1 + 2^30) + -2^30 = 0.  Tree (one rank per node: the
    # double binary tree of 3 ranks, channel 0: 0 <- 1 <- 2): 0 + (2 + 1) = 1 + 0 = 1 everywhere.
    vals = [1.0, BIG, -BIG]
    _pin(monkeypatch, ONE_RING)
    assert _on_ranks(3, _all_reduce(vals))[0] == [1.0] * 4 + [0.0] * 8
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    got = _on_ranks(3, _all_reduce(vals))
    assert got == [[1.0] * 12] * 3
    cfg = Pins.from_env().cpu_choice("all_reduce").config("all_reduce", 3, 12)
    assert cfg.algo == "tree"
    ins = [np.full(12, v, np.float32) for v in vals]
    assert predict(cfg).outputs(ins)[0].tolist() == got[0]


def test_reduce_scatter_and_reduce_fold_each_block_from_the_next_rank(monkeypatch):
    # the block of rank r (reduce: the root's output) folds ring positions r+1, r+2, ..., r
    # (reduce_scatter.h:33-54, reduce.h:32-52): r=0: (-2^30 + 1) + 2^30 = 0; r=1:
    # (1 + 2^30) + -2^30 = 0; r=2: (2^30 + -2^30) + 1 = 1.  Rank order gives 1 in all.
    _pin(monkeypatch, ONE_RING)
    vals = [BIG, -BIG, 1.0]

    def body(c: Communicator, r: int) -> dict:
        out = {}
        y = DevArray(np.zeros(4, np.float32), device=r)
        c.reduce_scatter(DevArray(np.full(12, vals[r], np.float32), device=r), y).wait()
        out["rs"] = y.a.tolist()
        for root in range(3):
            y = DevArray(np.full(4, -1, np.float32), device=r)
            c.reduce(DevArray(np.full(4, vals[r], np.float32), device=r), y, root=root).wait()
            out[root] = y.a.tolist()
        return out
    got = _on_ranks(3, body)
    want = {0: [0.0] * 4, 1: [0.0] * 4, 2: [1.0] * 4}
    for r in range(3):
        assert got[r]["rs"] == want[r]
        for root in range(3):
            assert got[r][root] == (want[root] if r == root else [-1.0] * 4)


def test_two_channels_split_the_elements_and_change_the_result(monkeypatch):
    monkeypatch.setenv("NCCL_MIN_NCHANNELS", "2")
    count = 16384                # small counts use one channel (NCCL's tuning does too)
    rng = np.random.default_rng(7)
    ins = [(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(np.float32)
           for _ in range(3)]
    got = _on_ranks(3, lambda c, r: _reduced(c, r, "all_reduce", ins[r], "sum"))
    choice = Pins.from_env().cpu_choice("all_reduce")
    assert choice.channels == 2
    two = predict(choice.config("all_reduce", 3, count)).outputs(ins)[0]
    one = predict(Pins.from_env({}).cpu_choice("all_reduce").config("all_reduce", 3,
                                                                      count)).outputs(ins)[0]
    assert all(g.tobytes() == two.tobytes() for g in got)
    assert two.tobytes() != one.tobytes()          # the channel count shows in the bits


def test_nothing_pinned_is_ring_simple_one_channel(monkeypatch):
    got = _on_ranks(3, lambda c, r: (comm_choice(_ENGINE[0], c, "all_reduce"),
                                     _all_reduce([BIG, -BIG, 1.0])(c, r)))
    choice, values = got[0]
    assert (choice.algo, choice.proto, choice.channels, choice.buffsizes) == \
        ("ring", "simple", 1, ())
    assert "the CPU backend's choice" in choice.why and "default" in choice.why
    assert values == [0.0] * 8 + [1.0] * 4


# -- random inputs: the model's bits ---------------------------------------------------------
def _reduced(c: Communicator, r: int, kind: str, x: np.ndarray, op: Any,
             root: int = 0) -> np.ndarray:
    n = c.world_size
    count = x.size // (n if kind == "reduce_scatter" else 1)
    y = DevArray(np.full(count, 7, x.dtype), device=r)
    xin = DevArray(x.copy(), device=r)
    if kind == "all_reduce":
        c.all_reduce(xin, y, op=op).wait()
    elif kind == "reduce_scatter":
        c.reduce_scatter(xin, y, op=op).wait()
    else:
        c.reduce(xin, y, root=root, op=op).wait()
    return y.a.copy()


@pytest.mark.parametrize("n", [3, 4, 5])
def test_random_normals_are_the_models_bits(monkeypatch, n):
    """float32 sum, prod, avg and premul_sum; float64 sum: every collective equals the
    model's prediction for the default configuration, and differs from rank order somewhere
    (the test sees the order)."""
    rng = np.random.default_rng(100 + n)
    cases = [("all_reduce", "float32", "sum", 1000), ("all_reduce", "float32", "prod", 64),
             ("all_reduce", "float32", "avg", 1000), ("reduce_scatter", "float32", "sum", 333),
             ("reduce", "float32", "sum", 999), ("all_reduce", "float64", "sum", 1000),
             ("all_reduce", "float32", ncclpy.premul_sum(0.37), 1000)]
    data = []
    for kind, dt, op, count in cases:
        total = count * (n if kind == "reduce_scatter" else 1)
        data.append([(rng.standard_normal(total) * 10.0 ** rng.integers(-4, 5, total)).astype(dt)
                     for _ in range(n)])

    def body(c: Communicator, r: int) -> list:
        return [_reduced(c, r, kind, ins[r], op, root=1)
                for (kind, _dt, op, _count), ins in zip(cases, data)]
    got = _on_ranks(n, body)
    choice = Pins.from_env({}).cpu_choice("all_reduce")
    for (kind, dt, op, count), ins, k in zip(cases, data, range(len(cases))):
        name = getattr(op, "name", op)
        scalar = getattr(op, "scalar", None) if name == "premul_sum" else None
        cfg = choice.config(kind, n, count, dtype=dt, op=name, scalar=scalar, root=1)
        want = predict(cfg).outputs(ins)
        rank_order = getattr(R, kind)(ins, op=op, root=1)
        ranks = [1] if kind == "reduce" else range(n)    # (root n-1 would be rank order)
        for r in ranks:
            assert got[r][k].tobytes() == want[r].tobytes(), (kind, dt, name, r)
        assert any(got[r][k].tobytes() != rank_order[r].tobytes() for r in ranks), \
            (kind, dt, name)


def test_each_ranks_own_premul_scalar_then_sum_in_nccls_order(monkeypatch):
    n, count = 4, 500
    rng = np.random.default_rng(3)
    ins = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    scalars = [0.5, 1.25, -3.0, 0.1]
    got = _on_ranks(n, lambda c, r: _reduced(c, r, "all_reduce", ins[r],
                                             ncclpy.premul_sum(scalars[r])))
    leaves = [R.reduce_arrays([x], ncclpy.premul_sum(s), "float32", 1)
              for x, s in zip(ins, scalars)]
    want = predict(Pins.from_env({}).cpu_choice("all_reduce").config(
        "all_reduce", n, count)).outputs(leaves)[0]
    assert all(g.tobytes() == want.tobytes() for g in got)
    assert R.reduce_arrays(leaves, "sum", "float32").tobytes() != want.tobytes()


# -- every float type, op, algorithm, channel count: the engine's fold is the model's --------
def _random(dtype: str, size: int, rng: np.random.Generator) -> np.ndarray:
    vals = rng.standard_normal(size) * 2.0 ** rng.integers(-6, 7, size)
    if dtype in ("float32", "float64", "float16"):
        return vals.astype(dtype)
    return nm.encode(vals, dtype, saturate=True)      # bfloat16/float8: their bits, as logical


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "float8_e4m3",
                                   "float8_e5m2"])
def test_reduce_outputs_is_the_models_prediction_for_every_float_type(dtype):
    """ncclpy/cpu/folds.py (what the engine computes, in process and across processes) against
    :meth:`Prediction.outputs`, bit for bit, with the model's own avg and premul_sum (a
    scalar per op) beside the engine's leaves-then-sum; NaN and infinities included."""
    rng = np.random.default_rng(hash(dtype) % 2 ** 32)
    for trial in range(40):
        n = int(rng.integers(3, 7))
        kind = ("all_reduce", "reduce_scatter", "reduce")[trial % 3]
        algo = "tree" if kind == "all_reduce" and trial % 2 else "ring"
        env = {"NCCL_ALGO": algo, "NCCL_MIN_NCHANNELS": str(1 + trial % 3)}
        choice = Pins.from_env(env).cpu_choice(kind)
        count = int(rng.choice([1, 5, 31, 1000, 20000]))
        name = ("sum", "prod", "avg", "premul_sum")[trial % 4]
        ins = [_random(dtype, count * (n if kind == "reduce_scatter" else 1), rng)
               for _ in range(n)]
        if trial % 5 == 0:                         # a NaN and an infinity somewhere
            ins[1][0] = nm.encode([np.nan], dtype)[0] if ins[1].dtype.kind == "u" else np.nan
            ins[2][-1] = nm.encode([np.inf], dtype, saturate=False)[0] \
                if ins[2].dtype.kind == "u" else np.inf
        op: Any = ncclpy.premul_sum(0.75) if name == "premul_sum" else name
        root = int(rng.integers(0, n))
        sb = int(R.premul_scalar_bits(dtype, 0.75)[0]) if name == "premul_sum" else None
        got = reduce_outputs({"all_reduce": "AllReduce", "reduce_scatter": "ReduceScatter",
                              "reduce": "Reduce"}[kind], ins, RedOp("premul_sum", 0.75)
                             if sb is not None else op, [sb] * n, dtype, count, root, choice,
                             22809, list(range(n)) if kind != "reduce" else [root])
        cfg = choice.config(kind, n, count, dtype=dtype, op=name, root=root,
                            scalar=0.75 if name == "premul_sum" else None)
        want = predict(cfg).outputs(ins)
        for r, res in got.items():
            assert np.asarray(res).tobytes() == np.asarray(want[r]).tobytes(), \
                (trial, cfg.describe(), r)


def test_two_ranks_and_order_free_ops_keep_the_rank_order_fold():
    """An add of two commutes; integer sums wrap; min/max are order-free: the fast rank-order
    path (the reference's bits) stays there, whatever the configuration."""
    rng = np.random.default_rng(5)
    choice = Pins.from_env({"NCCL_ALGO": "Tree"}).cpu_choice("all_reduce")
    for n, dtype, op in ((2, "float32", "sum"), (4, "int32", "sum"), (4, "float32", "max"),
                         (5, "float64", "min"), (3, "int8", "prod"), (4, "int64", "avg")):
        ins = [(rng.standard_normal(50) * 100).astype(dtype) for _ in range(n)]
        got = reduce_outputs("AllReduce", ins, op, [None] * n, dtype, 50, 0, choice, 22809,
                             [0])[0]
        assert got.tobytes() == R.reduce_arrays(ins, op, dtype).tobytes(), (n, dtype, op)


# -- what NCCL refuses ---------------------------------------------------------------------------
def _init_error(n: int = 2, blocking: bool = True) -> List[str]:
    def rank(r: int) -> str:
        try:
            Communicator(n, r, UID, r, Config(blocking=blocking)).close()
            return "ok"
        except Exception as e:  # noqa: BLE001 - what each rank saw
            return f"{type(e).__name__}: {e}"
    with standin() as eng:
        _ENGINE[0] = eng
        return run_ranks(n, rank, timeout=60)


@pytest.mark.parametrize("env, text", [
    ({"NCCL_ALGO": "foo"}, 'Unrecognized element token "foo" when parsing "foo"'),
    ({"NCCL_ALGO": "ring;tree"}, 'All entries except the first must have a prefix: '
                                 '"ring;tree"'),
    # strtok_r skips a leading ";": the first entry then does not start the string
    ({"NCCL_ALGO": ";ring"}, 'All entries except the first must have a prefix: ";ring"'),
    ({"NCCL_PROTO": "allgather:LL;bcast:Simple"},
     'Unrecognized prefix token "bcast" when parsing "allgather:LL;bcast:Simple"'),
    # NCCL parses NCCL_PROTO first (tuning.cc:419-428): its WARN is the one said
    ({"NCCL_ALGO": "foo", "NCCL_PROTO": "bar"}, 'Unrecognized element token "bar" when '
                                                'parsing "bar"'),
])
def test_an_unparsable_algo_or_proto_fails_the_init(monkeypatch, env, text):
    _pin(monkeypatch, env)
    got = _init_error(2)
    for e in got:
        assert e.startswith("NcclInvalidUsage: ncclCommInitRankConfig failed: ncclInvalidUsage "
                            "(5)"), e
    assert any(e.endswith(": " + text) for e in got), got   # the last WARN is process-wide


def test_a_nonblocking_init_ends_in_the_same_refusal(monkeypatch):
    monkeypatch.setenv("NCCL_PROTO", "simple,ll129")
    got = _init_error(2, blocking=False)
    assert all(e.startswith("NcclInvalidUsage: ") and "ncclInvalidUsage (5)" in e for e in got), \
        got
    assert _ENGINE[0].nccl.last_text == b'Unrecognized element token "ll129" when parsing ' \
                                        b'"simple,ll129"'


def _refusals(c: Communicator, r: int) -> dict:
    n = c.world_size
    x = DevArray(np.ones(2 * n, np.float32), device=r)
    y = DevArray(np.zeros(2, np.float32), device=r)
    calls = {"all_reduce": lambda: c.all_reduce(x),
             "reduce_scatter": lambda: c.reduce_scatter(x, y),
             "reduce": lambda: c.reduce(y, root=0),
             "broadcast": lambda: c.broadcast(x, root=0),
             "broadcast uint8": lambda: c.broadcast(DevArray(np.ones(3, np.uint8), device=r),
                                                    root=0),
             "all_gather": lambda: c.all_gather(y, x),
             "all_to_all": lambda: c.all_to_all(x, DevArray(np.zeros(2 * n, np.float32),
                                                            device=r)),
             "send_recv": lambda: c.send_recv(y, DevArray(np.zeros(2, np.float32), device=r),
                                              (r + 1) % n, (r - 1) % n)}
    out = {}
    for name, call in calls.items():
        try:
            call().wait()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - what the rank saw
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_a_call_with_no_algorithm_fails_with_nccls_text(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")          # Tree: all_reduce only (tuning.cc:273-277)
    got = _on_ranks(3, _refusals)
    head = "NcclInvalidUsage: nccl{} failed: ncclInvalidUsage (5): "
    text = ("Error : no algorithm/protocol available for function {} with datatype {}. "
            "NCCL_ALGO was set to Tree.")
    for out in got:
        assert out["all_reduce"] == "ok" and out["all_to_all"] == "ok" and \
            out["send_recv"] == "ok", out
    for name, fn in (("reduce_scatter", "ReduceScatter"), ("reduce", "Reduce"),
                     ("broadcast", "Broadcast"), ("broadcast uint8", "Broadcast"),
                     ("all_gather", "AllGather")):
        said = [out[name] for out in got]
        assert all(e.startswith(head.format(fn)) for e in said), said
    # the WARN is process-wide (ncclGetLastError), which thread-ranks race for: the last one
    # written here (each process's own: tests/test_cpu_nccl_order_procs.py); a uint8 call
    # names its type "Unknown" (ncclDatatypeToString has no ncclUint8 case)
    assert _ENGINE[0].nccl.last_text.decode() == text.format("AllGather", "ncclFloat32")
    assert nccl_type_name(1) == "Unknown" and nccl_type_name(7) == "ncclFloat32"


def test_the_refusal_reads_the_environment_when_the_call_is_planned(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")          # read at init: Tree only

    def unset_then_call(c, r):
        os.environ.pop("NCCL_ALGO", None)            # gone by the call (enqueue.cc:1844-1860)
        return _refusals(c, r)["reduce_scatter"]
    got = _on_ranks(2, unset_then_call)
    assert all(e.startswith("NcclInternalError: ncclReduceScatter failed: ncclInternalError "
                            "(3)") for e in got), got
    assert _ENGINE[0].nccl.last_text.decode() == (   # the last refused call: no "was set"
        "Error : no algorithm/protocol available for function AllGather with datatype "
        "ncclFloat32.")


def test_every_protocol_disabled_is_refused_and_one_left_runs(monkeypatch):
    monkeypatch.setenv("NCCL_PROTO", "^Simple,LL,LL128")
    got = _on_ranks(2, lambda c, r: _refusals(c, r)["all_reduce"])
    assert all(e.startswith("NcclInvalidUsage: ncclAllReduce failed: ncclInvalidUsage (5)")
               for e in got), got
    assert _ENGINE[0].nccl.last_text.decode() == (
        "Error : no algorithm/protocol available for function AllGather with datatype "
        "ncclFloat32. NCCL_PROTO was set to ^Simple,LL,LL128.")   # the last call refused
    monkeypatch.setenv("NCCL_PROTO", "^Simple,LL")   # "^": LL128 is enabled, not left at 2
    got = _on_ranks(2, lambda c, r: (comm_choice(_ENGINE[0], c, "all_reduce").proto,
                                     _refusals(c, r)["all_reduce"]))
    assert got == [("ll128", "ok")] * 2


def test_a_one_rank_communicator_never_chooses_an_algorithm(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")          # ncclLaunchOneRank: no topoGetAlgoInfo
    out = _on_ranks(1, _refusals)[0]
    assert set(out.values()) == {"ok"}, out
    monkeypatch.setenv("NCCL_ALGO", "foo")           # nor parses NCCL_ALGO (tuning.cc:247)
    assert _init_error(1) == ["ok"]


def test_nvls_and_collnet_are_not_the_cpus_and_pat_runs_in_rings_order(monkeypatch):
    """The CPU backend's machine has neither NVLS nor CollNet: NCCL, pinned to them alone,
    finds nothing to run; PAT (reduce_scatter, all_gather) runs, in Ring's order."""
    monkeypatch.setenv("NCCL_ALGO", "NVLS,CollNetDirect")
    got = _on_ranks(2, lambda c, r: _refusals(c, r)["all_reduce"])
    assert all(e.startswith("NcclInvalidUsage: ncclAllReduce failed: ncclInvalidUsage (5)")
               for e in got), got
    monkeypatch.setenv("NCCL_ALGO", "PAT")
    vals = [BIG, -BIG, 1.0]

    def body(c: Communicator, r: int) -> tuple:
        y = DevArray(np.zeros(4, np.float32), device=r)
        c.reduce_scatter(DevArray(np.full(12, vals[r], np.float32), device=r), y).wait()
        return comm_choice(_ENGINE[0], c, "reduce_scatter"), y.a.tolist()
    got = _on_ranks(3, body)
    assert got[0][0].algo == "ring" and "not NCCL's bits" in got[0][0].why
    assert [v for _c, v in got] == [[0.0] * 4, [0.0] * 4, [1.0] * 4]   # Ring's (see above)


def test_inside_a_group_the_group_end_fails_and_drops_the_groups_work(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")

    def body(c: Communicator, r: int) -> tuple:
        x = DevArray(np.full(3, r + 1.0, np.float32), device=r)
        y = DevArray(np.zeros(1, np.float32), device=r)
        err = ""
        try:
            with c.group():
                c.all_reduce(x)                      # runs with Tree alone, but is dropped
                c.reduce_scatter(DevArray(np.ones(3, np.float32), device=r), y)
        except Exception as e:  # noqa: BLE001 - what the group's end said
            err = f"{type(e).__name__}: {e}"
        c.all_reduce(x).wait()                       # the communicator still works
        return err, x.a.tolist()
    got = _on_ranks(3, body)
    head = "NcclInvalidUsage: ncclGroupEnd failed: ncclInvalidUsage (5): "
    for err, values in got:
        assert err.startswith(head), err
        assert values == [6.0] * 3                   # 1+2+3 once: the grouped one never ran
    assert _ENGINE[0].nccl.last_text.decode() == (
        "Error : no algorithm/protocol available for function ReduceScatter with datatype "
        "ncclFloat32. NCCL_ALGO was set to Tree.")


def test_a_simulated_group_plans_too_and_fails_its_end(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")          # ncclGroupSimulateEnd: groupLaunch plans

    def body(c: Communicator, r: int) -> str:
        try:
            with c.group(simulate=True):
                c.broadcast(DevArray(np.ones(2, np.float32), device=r), root=0)
        except Exception as e:  # noqa: BLE001 - what the group's end said
            return f"{type(e).__name__}: {e}"
        return "ok"
    got = _on_ranks(2, body)
    assert all(e.startswith("NcclInvalidUsage: ncclGroupSimulateEnd failed: ncclInvalidUsage "
                            "(5)") for e in got), got


def test_a_nonblocking_communicator_reports_it_as_its_async_error(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")

    def body(c: Communicator, r: int) -> str:
        x = DevArray(np.ones(2, np.float32), device=r)
        try:
            c.broadcast(x, root=0).wait()
            return "ok"
        except Exception as e:  # noqa: BLE001 - what the wait said
            return f"{type(e).__name__}: {e}"
    got = _on_ranks(2, body, blocking=False)
    for e in got:
        assert e.startswith("NcclInvalidUsage") and "ncclInvalidUsage (5)" in e, e


# -- the environment is read at init -------------------------------------------------------------
def test_a_communicator_keeps_what_its_init_read_and_a_child_reads_its_own(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    vals = [1.0, BIG, -BIG]

    def body(c: Communicator, r: int) -> tuple:
        eng = _ENGINE[0]
        before = comm_choice(eng, c, "all_reduce").algo
        _BARRIER[0].wait()
        if r == 0:
            monkeypatch.setenv("NCCL_ALGO", "Ring")
        _BARRIER[0].wait()
        after = comm_choice(eng, c, "all_reduce").algo
        tree = _all_reduce(vals)(c, r)
        child = c.split(0, r)
        try:
            child_algo = comm_choice(eng, child, "all_reduce").algo
            ring = _all_reduce(vals)(child, r)
        finally:
            child.close()
        return before, after, tree, child_algo, ring
    _BARRIER[0] = threading.Barrier(3)          # the ranks' threads share os.environ
    got = _on_ranks(3, body)
    for before, after, tree, child_algo, ring in got:
        assert (before, after, child_algo) == ("tree", "tree", "ring")
        assert tree == [1.0] * 12 and ring == [1.0] * 4 + [0.0] * 8


_BARRIER: List[Any] = [None]


def test_order_choice_says_what_a_communicator_runs_and_refuses_in_one_line(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")

    def body(c: Communicator, r: int) -> list:
        eng = _ENGINE[0]
        out = [comm_choice(eng, c.handle, "all_reduce")]
        for args in (("reduce_scatter",), ("alltoall",), ("all_reduce", "float13")):
            try:
                comm_choice(eng, c, *args)
            except (PinError, ValueError) as e:
                out.append(f"{type(e).__name__}: {e}")
        return out
    choice, rs, coll, dt = _on_ranks(2, body)[0]
    assert (choice.algo, choice.proto, choice.channels) == ("tree", "simple", 1)
    assert choice.why.startswith("NCCL_ALGO pins Tree")
    assert rs == ("PinError: Error : no algorithm/protocol available for function "
                  "ReduceScatter with datatype ncclFloat32. NCCL_ALGO was set to Tree.")
    assert coll.startswith("ValueError: collective: expected one of") and "'alltoall'" in coll
    assert dt.startswith("ValueError: dtype: expected one of") and "'float13'" in dt
