"""The observe path's judging and reporting on the CPU (ncclpy/order/observe_rank.py,
observe.py): NCCL's logs written with its own format strings, outputs made by the model (what
NCCL gives if the model is right) or changed (what a wrong model would meet).  The GPU half,
running NCCL itself, is tests/gpu/test_order_gpu.py."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from order_logs_util import call_line, comm_block, write_logs
from ncclpy.order.config import OrderConfig
from ncclpy.order.matrix import Case, Group, Job, proof_matrix
from ncclpy.order.model import predict
from ncclpy.order.observe import aggregate
from ncclpy.order.observe_rank import _judge_case, case_inputs
from ncclpy.order.topology import default_trees, format_expr
from ncclpy.order.logs import CallLine

N = 4
RINGS = [[0, 3, 1, 2], [0, 1, 2, 3]]
TREES = default_trees(N, 2)


def _logs(tmp_path, extra0=(), head=("NCCL version 2.28.9+cuda13.0",), rings=RINGS):
    per_rank = [comm_block(r, N, 2, rings, TREES) for r in range(N)]
    per_rank[0] += list(extra0)
    write_logs(str(tmp_path), per_rank, head=head)
    return str(tmp_path)


def _truth(case: Case, algo: str, proto: str, rings=RINGS):
    """What NCCL gives if the model is right: the model's own outputs."""
    cfg = OrderConfig.make(case.collective, N, case.count, dtype=case.dtype, algo=algo,
                           proto=proto, root=case.root, channels=2, rings=rings, trees=TREES)
    pred = predict(cfg)
    inputs = case_inputs(case, N)
    return pred, inputs, pred.outputs(inputs)


def _line(pred, case, algo="RING", proto="LL"):
    es = {"float32": 4, "bfloat16": 2, "float16": 2}[case.dtype]
    func = {"all_reduce": "AllReduce", "reduce_scatter": "ReduceScatter",
            "reduce": "Reduce"}[case.collective]
    return CallLine(case.collective, case.count * es, algo.lower(), proto.lower(),
                    pred.split.channel_lo, pred.split.channel_hi), \
        call_line(func, case.count * es, algo, proto, pred.split.channel_lo,
                  pred.split.channel_hi)


@pytest.mark.parametrize("case, algo", [
    (Case("all_reduce", "float32", 5000), "ring"),
    (Case("all_reduce", "bfloat16", 67), "tree"),
    (Case("reduce_scatter", "float32", 300), "ring"),
    (Case("reduce", "float16", 67, root=2), "ring"),
    (Case("all_reduce", "float32", 999, inputs="random"), "ring")])
def test_the_model_own_outputs_are_predicted_on_every_rank(tmp_path, case, algo):
    pred, inputs, outs = _truth(case, algo, "ll")
    line, text = _line(pred, case, algo.upper())
    job_dir = _logs(tmp_path, [text])
    for r in range(N):
        rec = _judge_case(job_dir, 0, case, line, [o for o in [outs[r]] * (
            2 if case.inputs == "reveal" else 1)] if outs[r] is not None else [
            np.zeros(case.count)], inputs, r, N)
        want = "NO_OUTPUT" if (case.collective == "reduce" and r != case.root) else "PREDICTED"
        assert rec["verdict"] == want, rec


def test_a_different_fold_is_a_mismatch_that_names_the_fold_nccl_used(tmp_path):
    case = Case("all_reduce", "float32", 64)
    # NCCL "used" ring 0,1,2,3 on channel 0; the logs say 0,3,1,2: the model mispredicts
    other = [[0, 1, 2, 3], RINGS[1]]
    pred_true, inputs, outs = _truth(case, "ring", "simple", rings=other)
    pred, _, _ = _truth(case, "ring", "simple")
    line, text = _line(pred, case, "RING", "SIMPLE")
    job_dir = _logs(tmp_path, [text])
    rec = _judge_case(job_dir, 0, case, line, [outs[0], outs[0]], inputs, 0, N)
    assert rec["verdict"] == "MISMATCH", rec
    assert rec["differing"] > 0 and rec["first"]
    first = rec["first"][0]
    e = first["element"]
    used = pred_true.order_map(0).expr(e)
    assert first["predicted_order"] == list(pred.order_map(0).expr(e))
    norm = tuple(sorted(used[:2])) + tuple(used[2:])     # an add cannot order its operands
    assert f"left fold {format_expr(norm)}" in first["observed_orders"], first
    assert "channel 1 ring from position 1" in first["observed_orders"]


def test_two_runs_that_differ_are_a_mismatch(tmp_path):
    case = Case("all_reduce", "float32", 16)
    pred, inputs, outs = _truth(case, "ring", "ll")
    line, text = _line(pred, case)
    job_dir = _logs(tmp_path, [text])
    other = outs[0].copy()
    other[3] += 1
    rec = _judge_case(job_dir, 0, case, line, [outs[0], other], inputs, 0, N)
    assert rec["verdict"] == "MISMATCH" and "two runs" in rec["reason"]


@pytest.mark.parametrize("change, reason", [
    ("range", "the model recomputes channels 0..0, NCCL logged 0..1"),
    ("nvls", "NCCL chose NVLS, not Ring or Tree"),
    ("symmetric", "symmetric kernel"),
    ("tuner", "a tuner plugin is loaded"),
    ("version", "NCCL 2.21.5 is not a version"),
    ("no line", "missing log lines: rank 0's per-call"),
    ("other call", "rank 0's call line says reduce of 64 bytes")])
def test_what_the_model_cannot_follow_is_cannot_predict_with_the_reason(tmp_path, change,
                                                                         reason):
    case = Case("all_reduce", "float32", 16)
    pred, inputs, outs = _truth(case, "ring", "ll")
    line, text = _line(pred, case)
    head = ["NCCL version 2.28.9+cuda13.0"]
    if change == "range":
        line = CallLine("all_reduce", 64, "ring", "ll", 0, 1)
    elif change == "nvls":
        line = CallLine("all_reduce", 64, "nvls", "simple", 0, 15)
    elif change == "symmetric":
        line = CallLine("all_reduce", 64, "symmetric", "", -1, -1, True, "AllReduce_AGxLL_R")
    elif change == "tuner":
        head.append("TUNER/Plugin: Using example (v5)")
    elif change == "version":
        head = ["NCCL version 2.21.5+cuda12.4"]
    elif change == "no line":
        line = None
    elif change == "other call":
        line = CallLine("reduce", 64, "ring", "ll", 0, 0)
    job_dir = _logs(tmp_path, [text], head=head)
    rec = _judge_case(job_dir, 0, case, line, [outs[0], outs[0]], inputs, 0, N)
    assert rec["verdict"] == "CANNOT_PREDICT", rec
    assert reason in rec["reason"], rec["reason"]


def test_missing_tree_lines_are_cannot_predict(tmp_path):
    case = Case("all_reduce", "float32", 16)
    pred, inputs, outs = _truth(case, "tree", "ll")
    line, text = _line(pred, case, "TREE")
    per_rank = [[m for m in comm_block(r, N, 2, RINGS, TREES) if not m.startswith("Trees")]
                for r in range(N)]
    per_rank[0].append(text)
    write_logs(str(tmp_path), per_rank)
    rec = _judge_case(str(tmp_path), 0, case, line, [outs[0], outs[0]], inputs, 1, N)
    assert rec["verdict"] == "CANNOT_PREDICT" and "'Trees' line" in rec["reason"]


def _records(job_dir, job, verdicts, digests=None):
    g = job.groups[0]
    for r in range(job.nranks):
        with open(os.path.join(job_dir, f"rank{r}.jsonl"), "w") as f:
            for i, case in enumerate(g.cases):
                v = verdicts[r][i]
                if v is None:
                    continue
                f.write(json.dumps({"rank": r, "case": case.name(), "algo": g.algo,
                                    "proto": g.proto, "verdict": v,
                                    "digest": (digests or {}).get((r, i), "d")}) + "\n")


def test_aggregate_takes_the_worst_verdict_and_sees_ranks_that_differ(tmp_path):
    cases = (Case("all_reduce", "float32", 8), Case("all_reduce", "float32", 9),
             Case("reduce", "float32", 9, root=1), Case("all_reduce", "float32", 10))
    job = Job(2, 1, (Group("ring", "ll", cases),))
    _records(str(tmp_path), job,
             [["PREDICTED", "PREDICTED", "NO_OUTPUT", "PREDICTED"],
              ["PREDICTED", "MISMATCH", "PREDICTED", None]],
             digests={(1, 0): "other"})
    rows = aggregate(job, str(tmp_path), "rank 1 died")
    assert [r["verdict"] for r in rows] == ["RANKS_DIFFER", "MISMATCH", "PREDICTED", "NOT_RUN"]
    assert rows[3]["reason"] == "rank 1 died"


def test_the_proof_matrix_covers_what_the_issue_asks():
    jobs = proof_matrix()
    assert sorted((j.nranks, j.channels) for j in jobs) == [(3, 1), (3, 2), (4, 1), (4, 2)]
    for j in jobs:
        assert {(g.algo, g.proto) for g in j.groups} == {
            (a, p) for a in ("ring", "tree") for p in ("ll", "ll128", "simple")}
        for g in j.groups:
            colls = {c.collective for c in g.cases}
            assert colls == ({"all_reduce", "reduce_scatter", "reduce"} if g.algo == "ring"
                             else {"all_reduce"})
            assert {c.dtype for c in g.cases} >= {"float32", "bfloat16", "float16"}
            assert set(range(1, 68)) & {c.count for c in g.cases} >= {1, 2, 3, 5, 8, 67}
    assert sum(j.calls() for j in jobs) < 1600


class _Done:
    def wait(self):
        return None


def test_a_job_pairs_each_case_with_rank_0s_log_lines(tmp_path, monkeypatch):
    """_run_group on every rank with a stand-in for NCCL: rank 0's "NCCL" logs each call as
    enqueue.cc:741 does (the barriers too), outputs are what NCCL gives if the model is right;
    every case of every rank must come out PREDICTED, paired with its own call line."""
    from ncclpy.order import observe_rank as OR
    job_dir = str(tmp_path)
    write_logs(job_dir, [comm_block(r, N, 2, RINGS, TREES) for r in range(N)])
    log0 = os.path.join(job_dir, "nccl.gpu-host.5000.log")
    group = Group("ring", "ll", (Case("all_reduce", "float32", 40),
                                 Case("reduce_scatter", "float32", 9),
                                 Case("all_reduce", "bfloat16", 4099, inputs="random"),
                                 Case("reduce", "float32", 7, root=3)))

    def log_call(func, nbytes, lo, hi):
        from order_logs_util import info
        with open(log0, "a") as f:
            f.write(info(call_line(func, nbytes, "RING", "LL", lo, hi), pid=5000) + "\n")

    class Comm:
        def __init__(self, rank):
            self.rank = rank

        def barrier(self):
            if self.rank == 0:
                log_call("AllReduce", 4, 0, 0)
            return _Done()

    def fake_run_case(comm, case, inputs, rank, nranks):
        pred, _, outs = _truth(case, "ring", "ll")
        es = 2 if case.dtype == "bfloat16" else 4
        func = {"all_reduce": "AllReduce", "reduce_scatter": "ReduceScatter",
                "reduce": "Reduce"}[case.collective]
        runs = 2 if case.inputs == "reveal" else 1
        if rank == 0:
            for _ in range(runs):
                log_call(func, case.count * es, pred.split.channel_lo, pred.split.channel_hi)
        out = outs[rank] if outs[rank] is not None else np.zeros(case.count, np.float32)
        return [out] * runs

    monkeypatch.setattr(OR, "_run_case", fake_run_case)
    job = Job(N, 2, (group,))
    for r in range(N):
        with open(os.path.join(job_dir, f"rank{r}.jsonl"), "w") as res:
            OR._run_group(Comm(r), group, 0, job, job_dir, r, res)
    rows = aggregate(job, job_dir)
    assert [r["verdict"] for r in rows] == ["PREDICTED"] * 4, rows


def test_missing_tuning_lines_or_a_missing_rank_are_cannot_predict(tmp_path):
    case = Case("all_reduce", "float32", 16)
    pred, inputs, outs = _truth(case, "ring", "ll")
    line, text = _line(pred, case)
    per_rank = [comm_block(r, N, 2, RINGS, TREES) for r in range(N)]
    per_rank[0] = [m for m in per_rank[0] if "Max NThreads" not in m] + [text]
    write_logs(str(tmp_path), per_rank)
    rec = _judge_case(str(tmp_path), 0, case, line, [outs[0]] * 2, inputs, 0, N)
    assert rec["verdict"] == "CANNOT_PREDICT" and "'Max NThreads'" in rec["reason"]
    os.remove(os.path.join(str(tmp_path), "nccl.gpu-host.5002.log"))
    rec = _judge_case(str(tmp_path), 0, case, line, [outs[0]] * 2, inputs, 0, N)
    assert rec["verdict"] == "CANNOT_PREDICT" and "the logs of rank 2" in rec["reason"]


def test_min_max_do_not_claim_the_sign_of_a_zero_where_both_meet():
    from ncclpy.order import judge
    for op in ("min", "max"):
        pred = predict(OrderConfig.make("all_reduce", 2, 2, op=op))
        xs = [np.array([-0.0, 1.0], np.float32), np.array([0.0, 2.0], np.float32)]
        got = pred.outputs(xs)[0]
        flipped = got.copy()
        flipped[0] = -flipped[0]
        assert judge(pred, xs, [flipped, None]).kind == "PREDICTED"
        wrong = got.copy()
        wrong[1] = 3.0
        assert judge(pred, xs, [wrong, None]).kind == "MISMATCH"


def test_a_configuration_nccl_refuses_is_error_and_the_next_one_runs(tmp_path, monkeypatch):
    """run_rank: NCCL refusing a group's calls (on every rank alike) records ERROR for that
    group's cases, aborts its communicator, and goes on with the next group."""
    import ncclpy
    from ncclpy.order import observe_rank as OR
    groups = (Group("tree", "ll128", (Case("all_reduce", "float32", 8),
                                      Case("all_reduce", "float32", 9))),
              Group("ring", "ll", (Case("all_reduce", "float32", 10),)))
    job = Job(2, 1, groups)
    events = []

    class Comm:
        def __init__(self, name):
            self.name = name

        def abort(self):
            events.append(("abort", self.name))

        def close(self):
            events.append(("close", self.name))

    def fake_group(comm, group, gi, job_, job_dir, rank, results):
        if group.algo == "tree":
            raise ncclpy.NcclInvalidUsage("ncclAllReduce failed: no algorithm")
        results.write(json.dumps({"rank": rank, "case": group.cases[0].name(), "digest": "d",
                                  "verdict": "PREDICTED", "algo": "ring",
                                  "proto": "ll"}) + "\n")

    monkeypatch.setattr(ncclpy, "init", lambda name: Comm(name))
    monkeypatch.setattr(OR, "_run_group", fake_group)
    for var in ("NCCL_ALGO", "NCCL_PROTO"):      # run_rank sets them: restored afterwards
        monkeypatch.setenv(var, "unset-by-the-test")
    for r in range(2):
        OR.run_rank(r, job, str(tmp_path))
    rows = aggregate(job, str(tmp_path))
    assert [r["verdict"] for r in rows] == ["ERROR", "ERROR", "PREDICTED"]
    assert "no algorithm" in rows[0]["reason"]
    assert ("abort", "order-0-tree-ll128") in events and ("close", "order-1-ring-ll") in events
