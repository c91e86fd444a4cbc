"""``ncclpy check`` on an exact reference (issue 51, item 1): where the reduction-order model
predicts the call, the case's reference is its prediction, bit for bit, for any input.

The parts without processes: the input kinds (verifiable, normal, revealing) and ``--inputs``;
each case's reference (NCCL's order for the CPU backend's configuration; on a GPU the pins and
NCCL's log, :mod:`ncclpy.check.nccl_log`, on log lines written with NCCL's own format strings;
rank order with the reason elsewhere); comparisons that name the element and the fold; rank 0's
choice and the record, the summary, the header.  Real runs (few, small): the default run
without a GPU is ncclpy's CPU backend labelled as such, exact against NCCL's order; an
injected corruption names the element and the predicted order; ``--backend gloo`` as before.
The GPU side is tests/gpu/test_check_gpu.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ncclpy.order.ncclenv import forget_params

from check_runs import module_runs, proc
from check_util import cmp, parts
from order_logs_util import call_line, comm_block, info, write_logs
from ncclpy.semantics import numerics as nm
from ncclpy.check import cases as C
from ncclpy.check import compare as K
from ncclpy.check import exact as X
from ncclpy.check import nccl_log as L
from ncclpy.check import refheader as H
from ncclpy.check import refs as RF
from ncclpy.check import report as R
from ncclpy.check import runner as Rn
from ncclpy.check.inputs import block_input, from_wire, to_wire
from ncclpy.order.topology import default_trees, format_expr

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "ncclpy" / "check" / "schema.json").read_text())
pytestmark = pytest.mark.timeout(240)
#: NCCL_ALGO=Ring, NCCL_PROTO=Simple on one channel: the issue's done criterion
ONE_RING = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1",
            "NCCL_MAX_NCHANNELS": "1"}


def _case(coll="all_reduce", dtype="float32", op="sum", count=12, inputs="verifiable", **kw):
    return C.Case(coll, dtype, op, kw.pop("scalar", None), count, str(count),
                  kw.pop("root", 0 if coll == "reduce" else None), kw.pop("in_place", False),
                  "", inputs)


def _ctx(backend="cpu", n=3, rank=0, **kw):
    return {"backend": backend, "n": n, "rank": rank, "comm": None, **kw}


# -- input kinds ---------------------------------------------------------------------------
def test_input_kinds_join_the_matrix_for_float_sums_only():
    cases, skipped = C.build_matrix(3, backend="cpu", sizes="7")
    kinds = {(c.collective, c.dtype, c.op, c.inputs) for c in cases}
    assert ("all_reduce", "float32", "sum", "reveal") in kinds
    assert ("reduce_scatter", "complex64", "sum", "normal") in kinds
    assert not {k for k in kinds if k[3] != "verifiable" and (k[2] != "sum" or k[1] in
                                                                ("int8", "bool", "uint64"))}
    assert not skipped
    key = _case(inputs="normal").key
    assert key == "all_reduce/float32/sum/12/-/oop/normal" and _case().key.endswith("/oop")
    # gloo's default is verifiable only (today's run); explicit --inputs adds the others there
    gloo, _ = C.build_matrix(3, backend="gloo", sizes="7")
    assert {c.inputs for c in gloo} == {"verifiable"}
    g2, _ = C.build_matrix(3, backend="gloo", sizes="7", inputs=["normal"])
    assert g2 and {(c.op, c.inputs) for c in g2} == {("sum", "normal")}
    # revealing inputs cannot be made for one rank: said, as a skipped kind
    one, sk = C.build_matrix(1, backend="cpu", sizes="7", collectives=["all_reduce"],
                             dtypes=["float32"])
    assert {c.inputs for c in one} == {"verifiable", "normal"}
    assert sk == [{"collective": "all_reduce", "dtype": "float32", "op": "sum", "inputs": "reveal",
                   "reason": "revealing inputs: nranks: revealing inputs need 2 or more ranks, "
                             "got 1"}]
    assert C.parse_inputs(" Reveal,verifiable ") == ("verifiable", "reveal")
    for bad, want in ((",", "no input kind given"), ("normal,x", "'x' is not an input kind")):
        with pytest.raises(ValueError, match=f"--inputs: {want}"):
            C.parse_inputs(bad)
    with pytest.raises(ValueError, match="--inputs: 'uniform' is not one of"):
        C.build_matrix(2, backend="cpu", inputs=["uniform"])
    assert not C.exact_claim(_case(inputs="normal"), 3) and C.exact_claim(_case(), 3)


def test_inputs_are_seeded_per_rank_and_revealing_ones_laid_out_per_block():
    a = block_input("normal", "bfloat16", 9, op="sum", world_size=3, seed=5, rank=1, tag="t")
    b = block_input("normal", "bfloat16", 9, op="sum", world_size=3, seed=5, rank=1, tag="t")
    c = block_input("normal", "bfloat16", 9, op="sum", world_size=3, seed=5, rank=2, tag="t")
    assert a.dtype == np.uint16 and np.array_equal(a, b) and not np.array_equal(a, c)
    vals = nm.decode(a, "bfloat16")
    assert np.all(np.abs(vals) < 6) and np.unique(vals).size > 5       # normals, not a pattern
    # reduce_scatter: each rank's block b is the revealing pattern of its own elements 0..k-1
    case = _case("reduce_scatter", "float32", count=5, inputs="reveal")
    ins = Rn.case_inputs(case, 3, seed=0)
    from ncclpy.order.reveal import reveal_plan, revealing_inputs
    want = revealing_inputs(reveal_plan("float32", 3), 5)
    for r in range(3):
        assert np.array_equal(ins[r].reshape(3, 5), np.stack([want[r]] * 3))
    # complex values travel as their float pairs, bits unchanged, both ways
    z = block_input("normal", "complex32", 4, op="sum", world_size=2, seed=1, rank=0, tag="z")
    assert z.shape == (4, 2) and to_wire(z, "complex32").shape == (8,)
    assert np.array_equal(from_wire(to_wire(z, "complex32"), "complex32"), z)
    q = np.array([1 + 2j, -3.5j], np.complex64)
    assert np.array_equal(to_wire(q, "complex64"), np.array([1, 2, 0, -3.5], np.float32))


# -- each case's reference ------------------------------------------------------------------
def test_the_done_example_is_the_cpu_backends_reference(monkeypatch):
    """3 ranks, all_reduce of 12 float32, 2^30 / -2^30 / 1 in every element, Ring/Simple on one
    channel: NCCL's one-channel ring gives 0 in elements 0-7 and 1 in 8-11 (rank order: 1)."""
    for k, v in ONE_RING.items():
        monkeypatch.setenv(k, v)
    ex = X.for_case(_ctx(), _case())
    assert ex.kind == X.NCCL_ORDER and ex.config.startswith(
        "all_reduce ring/simple, 3 ranks, 12 float32, sum, 1 channel, NCCL ")
    assert "the CPU backend's configuration: NCCL_ALGO pins Ring" in ex.config
    ins = [np.full(12, v, np.float32) for v in (2.0 ** 30, -2.0 ** 30, 1.0)]
    got = X.expected(ex, _case(), ins, 1, None)
    assert got.tolist() == [0.0] * 8 + [1.0] * 4
    assert Rn.reference_outputs(_case(), ins, 3)[1].tolist() == [1.0] * 12


def test_no_prediction_keeps_the_rank_order_reference_with_the_reason(monkeypatch):
    for k in ONE_RING:
        monkeypatch.delenv(k, raising=False)
    ctx = _ctx()
    assert X.for_case(ctx, _case(op=None, coll="broadcast", root=0)).reason == \
        "data movement: no arithmetic"
    assert X.for_case(ctx, _case(dtype="int32")).reason == \
        "integer arithmetic: every order gives the same bits"
    assert X.for_case(ctx, _case(count=0)).reason == "no element to fold"
    assert X.for_case(_ctx("gloo"), _case()).reason == "gloo: not NCCL (ncclpy does not run)"
    # CPU: a configuration NCCL refuses (nothing enabled) is no prediction
    monkeypatch.setenv("NCCL_PROTO", "^LL,LL128,Simple")
    ex = X.for_case(_ctx(), _case(coll="reduce"))
    assert ex.kind == X.RANK_ORDER and ex.reason.startswith(
        "order-free bound: Error : no algorithm/protocol available for function Reduce")
    # GPU: nothing pinned, then no log read
    monkeypatch.delenv("NCCL_PROTO")
    g = X.for_case(_ctx("nccl"), _case())
    assert g.reason.startswith("order-free bound: NCCL_ALGO does not pin one algorithm for "
                               "all_reduce"), g
    for k, v in ONE_RING.items():
        monkeypatch.setenv(k, v)
    g = X.for_case(_ctx("nccl"), _case(count=13))
    assert g.reason == ("order-free bound: missing log lines: NCCL's log of ncclpy's "
                        "communicator was not read")


def _gpu_logs(tmp_path, n=3, channels=2, extra0=()):
    """Every rank's file: torch's communicator first, then ncclpy's (another pointer)."""
    rings = [list(range(n)), [0] + list(range(n - 1, 0, -1))]
    trees = default_trees(n, channels)
    per = []
    for r in range(n):
        torch = [m.replace("0x55d0c0de", "0x77aa0000") for m in
                 comm_block(r, n, channels, [list(range(n))] * channels, trees)]
        mine = comm_block(r, n, channels, rings[:channels], trees,
                          max_threads={("ring", "simple"): 512})
        per.append(torch + mine + (list(extra0) if r == 0 else []))
    paths = write_logs(str(tmp_path), per)
    return [(p, 0x55d0c0de0000 + r) for r, p in enumerate(paths)], rings


def test_a_gpu_prediction_uses_the_pins_and_the_log_of_ncclpys_communicator(tmp_path,
                                                                           monkeypatch):
    files, rings = _gpu_logs(tmp_path)
    init = L.read_init(files)
    assert init.problem == "" and init.channels == 2 and init.version == 22809
    assert init.rings == tuple(tuple(r) for r in rings)           # ncclpy's, not torch's
    assert init.max_threads[("ring", "simple")] == 512
    for k, v in dict(ONE_RING, NCCL_MIN_NCHANNELS="2", NCCL_MAX_NCHANNELS="2").items():
        monkeypatch.setenv(k, v)
    ex = X.for_case(_ctx("nccl", nccl_init=init), _case(count=4100))
    assert ex.kind == X.NCCL_ORDER and ex.pred.config.rings == init.rings, ex
    assert ex.expect[:4] == ("all_reduce", 4100 * 4, "ring", "simple")
    # the pins and the log disagree on the channels: no prediction (a process started so)
    monkeypatch.setenv("NCCL_MIN_NCHANNELS", "4")
    forget_params()
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "4")
    ex = X.for_case(_ctx("nccl", nccl_init=init), _case(count=4101))
    assert ex.reason == "order-free bound: NCCL_MIN/MAX_NCHANNELS pin 4 channels, NCCL logged 2"
    # a missing file, a missing block
    assert L.read_init([files[0], (None, 1), files[2]]).problem == \
        "missing log lines: no NCCL debug file of rank 1"
    bad = L.read_init([files[0], (files[1][0], 0xdead), files[2]]).problem
    assert bad.startswith("missing log lines: no 'Init START' block of ncclpy's communicator "
                          "(comm 0xdead) in rank 1's log")


def test_rank_zeros_call_lines_confirm_the_predicted_call(tmp_path):
    files, _ = _gpu_logs(tmp_path)
    tail = L.CallTail(files[0][0])
    tail.skip()
    assert tail.calls() == []
    with open(files[0][0], "a") as f:      # torch's call, then ncclpy's, as NCCL prints them
        f.write(info(call_line("AllReduce", 48, "RING", "SIMPLE", 0, 0), pid=5000) + "\n")
    tail.skip()
    with open(files[0][0], "a") as f:
        f.write(info(call_line("AllReduce", 48, "RING", "SIMPLE", 0, 1), pid=5000) + "\n" +
                info("half a li", pid=5000))
    rows = L.call_rows(tail.calls())
    assert rows == [["all_reduce", 48, "ring", "simple", 0, 1, False, ""]]
    expect = ["all_reduce", 48, "ring", "simple", 0, 1]
    assert L.call_problem(rows, expect) == ""
    assert L.call_problem(rows, expect[:4] + [0, 0]) == (
        "NCCL logged ring/simple on channels 0..1, the model computes ring/simple on channels "
        "0..0")
    assert L.call_problem([], expect).startswith(
        "missing log lines: rank 0 logged no 'all_reduce: 48 Bytes -> Algo' line")
    assert L.call_problem(rows * 2, expect) == "rank 0 logged 2 'all_reduce: 48 Bytes' lines " \
                                              "for one call"
    sym = [["all_reduce", 48, "symmetric", "", -1, -1, True, "AllReduce_AGxLL_R"]]
    assert "symmetric kernel (AllReduce_AGxLL_R)" in L.call_problem(sym, expect)
    env, kept = L.log_env({"NCCL_DEBUG": "WARN"}, "/d")
    assert kept == ["NCCL_DEBUG=WARN"] and env == {
        "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING,ENV", "NCCL_DEBUG_FILE": "/d/nccl.%h.%p.log"}
    assert L.log_path(str(tmp_path / "nccl.%h.%p.log"), 5001) == files[1][0]
    assert L.log_path(str(tmp_path / "nccl.%h.%p.log"), 1) is None


# -- comparisons on one rank -----------------------------------------------------------------
def test_a_disagreement_names_the_element_the_predicted_and_the_observed_fold(monkeypatch):
    for k, v in ONE_RING.items():
        monkeypatch.setenv(k, v)
    case = _case(count=24, inputs="reveal")
    ex = X.for_case(_ctx(), case)
    ins = Rn.case_inputs(case, 3, seed=0)
    rank_order = Rn.reference_outputs(case, ins, 3)[0]          # ((0 + 1) + 2) everywhere
    want = X.expected(ex, case, ins, 0, None)
    c = X.compare_claimed(rank_order, want, case)
    assert c.equal is False and c.ndiff > 0
    text = X.disagreement(ex, case, ins, rank_order, 0, "ncclpy")
    e = c.first_diff
    fold = format_expr(ex.pred.order_map(0).expr(e))
    assert text.startswith(f"rank 0 element {e}: predicted 0x"), text
    assert f" from {fold}, ncclpy gave 0x" in text
    assert "; its bits fit channel 0 ring from position 0, left fold (0 + 1) + 2 (" in text
    assert text.endswith(" of 24 values differ)")
    assert X.compare_claimed(want, want, case).equal is True
    assert X.disagreement(ex, case, ins, want, 0, "ncclpy") == ""
    # what the model does not claim: a NaN's payload, the sign of a zero min/max
    nan = np.array([np.nan, 1], np.float32)
    other = nan.copy()
    other.view(np.uint32)[0] ^= 1
    assert X.compare_claimed(other, nan, case).equal is True
    mx = _case(op="max", count=2)
    assert X.compare_claimed(np.float32([0.0, 1]), np.float32([-0.0, 1]), mx).equal is True
    assert X.compare_claimed(np.float32([0.0, 1]), np.float32([-0.0, 1]), case).equal is False


def test_the_order_free_bound_judges_other_orders_and_nothing_else():
    case = _case("reduce_scatter", count=50, inputs="normal")
    ins = Rn.case_inputs(case, 4, seed=3)
    blocks = [a.reshape(4, 50)[2].astype(np.float32) for a in ins]
    fwd = ((blocks[0] + blocks[1]) + blocks[2]) + blocks[3]
    rev = ((blocks[3] + blocks[2]) + blocks[1]) + blocks[0]
    assert X.bound_holds(case, ins, fwd, 2) and X.bound_holds(case, ins, rev, 2)
    off = fwd.copy()
    off[7] += 1e-3
    assert X.bound_holds(case, ins, off, 2) is False
    assert X.bound_holds(_case(), ins, fwd, 2) is None            # verifiable: not a bound
    assert X.bound_holds(_case("reduce", inputs="normal", root=1), ins, fwd, 0) is None


# -- rank 0: the choice, the record, the summary ----------------------------------------------
def _p(n, **kw):
    return parts(n, ref_kind=X.NCCL_ORDER, ref_config="all_reduce ring/simple (cfg)",
                 ref_version=22809, **kw)


def test_merge_judges_each_side_against_its_reference():
    ctx = {"n": 3, "backend": "cpu", "comm": object()}
    case = _case(inputs="normal")
    ok = K.merge(case, _p(3, n_nccl=cmp(True), n_ref=cmp(False, 3), t_ref=cmp(True),
                          n_t=cmp(False, 3)), ctx)
    assert (ok["status"], ok["reference"], ok["torch_reference"], ok["exact_nccl_order"]) == \
        ("pass", "nccl-order", "rank-order", True), ok
    assert ok["ncclpy_ref"] is True and ok["ncclpy_torch"] is None      # not each other
    assert ok["basis"] == "from NCCL's source, not yet checked on a GPU"
    assert ok["torch_reference_reason"] == "gloo: not NCCL"
    assert ok["ranks"][0]["n_rank_order"]["equal"] is False
    t_bound = dict(cmp(False, 9), bound_ok=True)
    w = K.merge(case, _p(3, n_nccl=cmp(True), t_ref=t_bound), ctx)
    assert w["status"] == "within ULP" and w["exact_nccl_order"] is True
    assert w["reason"] == ("ncclpy == NCCL's order bit for bit; torch within the order-free "
                           "bound of the rank-order reference (not claimed exact: normal "
                           "inputs, gloo: not NCCL)")
    out = K.merge(case, _p(3, n_nccl=cmp(True), t_ref=dict(cmp(False, 9), bound_ok=False)),
                  ctx)
    assert out["status"] == "fail" and "torch != reference on rank(s) [0, 1, 2]" in \
        out["reason"]
    diff = "rank 1 element 3: predicted 0x3f800000 from (1 + 2) + 0, ncclpy gave 0x0"
    bad = K.merge(case, _p(3, n_nccl=[cmp(True), cmp(False, 1), cmp(True)], t_ref=cmp(True),
                           n_nccl_diff=["", diff, ""]), ctx)
    assert bad["status"] == "fail" and bad["exact_nccl_order"] is False
    assert bad["reason"] == f"ncclpy != NCCL's order on rank(s) [1]: {diff}"
    # a rank without a prediction: the case keeps rank order, with that rank's reason
    mixed = _p(3, n_nccl=cmp(True), n_ref=cmp(True), t_ref=cmp(True))
    mixed[2].update(ref_kind=X.RANK_ORDER, ref_reason="order-free bound: why")
    r = K.merge(_case(), mixed, ctx)
    assert (r["reference"], r["reference_reason"], r["status"]) == \
        ("rank-order", "order-free bound: why", "pass") and "exact_nccl_order" not in r
    # a GPU run: rank 0's call lines must confirm the call, ncclpy's and torch's each
    gpu = {"n": 2, "backend": "nccl", "comm": object()}
    expect = ["all_reduce", 48, "ring", "simple", 0, 1]
    line = [["all_reduce", 48, "ring", "simple", 0, 1, False, ""]]
    g = _p(2, n_nccl=cmp(True), t_nccl=cmp(True), n_ref=cmp(False, 1), t_ref=cmp(False, 1),
           n_t=cmp(True), nccl_expect=[expect, expect], nccl_calls=[line, []],
           torch_nccl_calls=[line, []])
    rec = K.merge(_case(inputs="reveal"), g, gpu)
    assert (rec["status"], rec["reference"], rec["torch_reference"]) == \
        ("pass", "nccl-order", "nccl-order"), rec
    g[0]["torch_nccl_calls"] = [[["all_reduce", 48, "ring", "ll", 0, 1, False, ""]]]
    rec = K.merge(_case(inputs="reveal"), g, gpu)
    assert (rec["reference"], rec["torch_reference"]) == ("nccl-order", "rank-order"), rec
    g[0]["torch_nccl_calls"] = [line]
    g[0]["nccl_calls"] = []
    rec = K.merge(_case(inputs="reveal"), g, gpu)
    assert rec["reference"] == "rank-order" and rec["reference_reason"].startswith(
        "order-free bound: missing log lines: rank 0 logged no 'all_reduce: 48 Bytes")
    counts = R.summarize([ok, w, out, bad, r])
    assert (counts["nccl_order_cases"], counts["exact_nccl_order"]) == (4, 3)
    lines = R.summary_lines(counts, 1.0, "cpu vs gloo", 3, basis=ok["basis"])
    assert "  exact vs NCCL's order: 3 of 4 cases judged against the model's prediction" in lines
    assert "    (the prediction: from NCCL's source, not yet checked on a GPU)" in lines
    assert all(len(ln) <= R.WIDTH for ln in lines)
    assert RF.side_name("torch", X.NCCL_ORDER) == "torch != NCCL's order"


def test_the_header_says_which_reference_and_on_what_basis(monkeypatch):
    for k, v in ONE_RING.items():
        monkeypatch.setenv(k, v)
    h = {"reference": H.describe(_ctx())}
    assert h["reference"]["short"] == {k: "ring/simple on 1 channel" for k in
                                       C.FLOAT_REDUCTIONS}
    lines = H.header_lines(h)
    assert lines[0].startswith("  reference: NCCL's order, the model's prediction bit for bit "
                               "(from NCCL's source, not yet checked on a GPU)")
    assert lines[1] == ("  NCCL's order for all_reduce, reduce, reduce_scatter: ring/simple on "
                        "1 channel (why: the JSON's header.reference)")
    assert lines[2] == ("  torch is judged against rank-order (ncclpy.reference): "
                        "gloo is not NCCL")
    assert H.header_lines({"reference": H.describe(_ctx("gloo"))}) == [
        "  reference: rank order (ncclpy.reference); no exact reference: gloo is not "
        "NCCL and ncclpy does not run"]
    gpu = H.describe(_ctx("nccl"))
    assert set(gpu["short"].values()) == {"no prediction"}


# -- real runs -------------------------------------------------------------------------------
def _env(extra: dict | None = None) -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT", "NCCLPY_DEVICE", *ONE_RING):
        e.pop(k, None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra or {})
    return e


def _check(*args: str, env: dict | None = None):
    """``ncclpy check ARGS``: the run, when called."""
    return proc([sys.executable, "-m", "ncclpy", "check", *args], _env(env), 200)


def run_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return _check(*args, env=env)()


def _not_here() -> str:
    """Why the default run is not the CPU backend here ('' when it is)."""
    from ncclpy.check.cli import _gpu_available
    from ncclpy.check.cpu_side import unavailable
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if _gpu_available()[0]:
        return "a GPU is visible: --backend auto is nccl here"
    return unavailable()


def _runs_here():
    pytest.importorskip("torch")
    why = _not_here()
    if why:
        pytest.skip(why)


SMALL = ("-n", "3", "--collectives", "all_reduce,reduce_scatter,broadcast", "--dtypes",
         "f32,bf16,c64,i32", "--ops", "sum,max", "--sizes", "0,12,100")
NEEDS = {"test_without_a_gpu_the_default_run_is_the_cpu_backend_exact_against_nccls_order":
         ["small"], "test_an_injected_corruption_names_the_element_and_the_predicted_order":
         ["inject"], "test_the_cpu_backend_is_the_default_under_a_launcher_too": ["launcher"]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's three real runs (check_runs.py), started together as the first of their
    tests begins: each test reads its run's output and JSON as if it had started it."""
    d = tmp_path_factory.mktemp("check_exact")
    t = {"small": _check(*SMALL, "--json", str(d / "small.json"), env=ONE_RING),
         "inject": _check("-n", "3", "--collectives", "all_reduce", "--dtypes", "f32", "--ops",
                          "sum", "--sizes", "24", "--inputs", "reveal", "--json",
                          str(d / "inject.json"),
                          env=dict(ONE_RING, NCCLPY_CHECK_INJECT="all_reduce:1:ncclpy:invert")),
         "launcher": proc([sys.executable, "-m", "ncclpy", "run", "-n", "2", "-m", "ncclpy",
                           "check", "--collectives", "reduce", "--dtypes", "f32", "--sizes",
                           "5", "--ops", "sum", "-q"], _launcher_env(), 200)}
    yield from module_runs(request, t, {} if _not_here() else NEEDS, d)


def test_without_a_gpu_the_default_run_is_the_cpu_backend_exact_against_nccls_order(runs):
    _runs_here()
    p = runs["small"]                           # SMALL, with ONE_RING in its environment
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = runs.json("small")
    import jsonschema
    jsonschema.validate(doc, SCHEMA)
    h, s = doc["header"], doc["summary"]
    assert h["backend"] == "cpu" and h["ncclpy_backend"]["label"] == \
        "CPU backend: NCCL's semantics and order, not NCCL"
    assert "\n  CPU backend: NCCL's semantics and order, not NCCL\n" in p.stdout
    assert h["reference"]["short"] == {k: "ring/simple on 1 channel"
                                       for k in C.FLOAT_REDUCTIONS}
    assert "NCCL_ALGO pins Ring" in h["reference"]["config"]["all_reduce"]
    want, _ = C.build_matrix(3, backend="cpu", collectives=SMALL[3].split(","),
                             dtypes=["float32", "bfloat16", "complex64", "int32"],
                             ops=["sum", "max"], sizes="0,12,100")
    assert s["cases"] == len(want) and s["failed"] == 0
    for c in doc["cases"]:
        cs = c["case"]
        if cs["collective"] == "barrier":
            continue
        predictable = cs["op"] and cs["dtype"] != "int32" and cs["count"] > 0 and \
            cs["collective"] != "broadcast"
        assert c["reference"] == ("nccl-order" if predictable else "rank-order"), c
        if predictable:
            assert c["exact_nccl_order"] is True and c["ncclpy_ref"] is True, c
            assert c["reference_config"].startswith(f"{cs['collective']} ring/simple, 3 ranks")
        else:
            assert c["reference_reason"] in ("data movement: no arithmetic", "no element to fold",
                                             "integer arithmetic: every order gives the same "
                                             "bits"), c
    odd = [c for c in doc["cases"] if c["case"]["inputs"] != "verifiable"]
    assert {c["case"]["inputs"] for c in odd} == {"normal", "reveal"}
    assert s["exact_nccl_order"] == s["nccl_order_cases"] == sum(
        c.get("reference") == "nccl-order" for c in doc["cases"]) > 40
    assert f"exact vs NCCL's order: {s['exact_nccl_order']} of {s['nccl_order_cases']} cases" \
        in p.stdout
    assert " cases on 3 ranks (cpu vs gloo) " in p.stdout


def test_an_injected_corruption_names_the_element_and_the_predicted_order(runs):
    _runs_here()
    p = runs["inject"]          # all_reduce of 24 f32 (reveal), rank 1's ncclpy output inverted
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    doc = runs.json("inject")
    for c in doc["cases"]:
        assert c["status"] == "fail" and c["reference"] == "nccl-order", c
        assert c["exact_nccl_order"] is False and c["injected"] == "ncclpy:invert"
        d = c["nccl_order_diff"]
        assert d.startswith("rank 1 element 0: predicted 0x") and ", ncclpy gave 0x" in d, d
        assert " from (" in d and "its bits fit no candidate fold" in d, d
        assert c["reason"].startswith(f"ncclpy != NCCL's order on rank(s) [1]: {d}")
    text = " ".join(p.stdout.split())
    assert "ncclpy != NCCL's order on rank(s) [1]: rank 1 element 0: predicted 0x" in text


def test_backend_gloo_is_todays_run():
    """``--backend gloo``: torch alone against the rank-order reference, verifiable inputs,
    no exact reference (listing only: the gloo runs are tests/test_check_gloo.py)."""
    p = run_check("--backend", "gloo", "-n", "3", "--list", "--collectives", "all_reduce",
                  "--dtypes", "f32", "--sizes", "7")
    assert p.returncode == 0, p.stderr
    keys = p.stdout.splitlines()[:-1]
    want, _ = C.build_matrix(3, backend="gloo", collectives=["all_reduce"],
                             dtypes=["float32"], sizes="7")
    assert keys == [c.key for c in want] and not any(k.endswith(("/normal", "/reveal"))
                                                     for k in keys)
    q = run_check("-n", "3", "--list", "--collectives", "all_reduce", "--dtypes", "f32",
                  "--sizes", "7", "--backend", "cpu")
    assert any(k.endswith("/reveal") for k in q.stdout.splitlines())


def _launcher_env() -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT", "NCCLPY_DEVICE"):
        e.pop(k, None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def test_the_cpu_backend_is_the_default_under_a_launcher_too(runs):
    _runs_here()
    p = runs["launcher"]    # ncclpy run -n 2 -m ncclpy check (reduce f32 5 sum, -q)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " cases on 2 ranks (cpu vs gloo) " in p.stdout and " 0 failed" in p.stdout
