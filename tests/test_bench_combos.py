"""The bench's ``--algo`` x ``--proto`` combinations, without processes: the flags (NCCL's
names, any case; precise one-line errors), which combinations NCCL refuses or ignores for which
collective, what the bits column predicts and why not, and SweepConfig carrying nccl-tests'
flags from NcclTestsFlags (tests/test_bench_bits_column.py: the column's verdicts)."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest

from ncclpy.errors import ArgumentError

from bench import bits as bitcol
from bench.cli import parse_args
from bench.combos import Combo, make_combos, parse_names, refusal
from bench.config import SweepConfig
from bench.nccl_tests_flags import NcclTestsFlags

pytestmark = pytest.mark.timeout(60)
ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
PROTOS = ("LL", "LL128", "Simple")


# ---------------------------------------------------------------------------- the flags
def test_names_are_nccls_in_any_case_in_the_order_given():
    assert parse_names("ring,TREE", ALGOS, "--algo") == ["Ring", "Tree"]
    assert parse_names(" Simple , ll128,LL ", PROTOS, "--proto") == ["Simple", "LL128", "LL"]
    assert parse_names("nvls_tree,collnet-direct,Pat", ALGOS, "--algo") == [
        "NVLSTree", "CollNetDirect", "PAT"]
    assert parse_names("ring,Ring,RING", ALGOS, "--algo") == ["Ring"]


@pytest.mark.parametrize("text, flag, words", [
    ("ring,hypercube", "--algo", "--algo: expected a comma-separated list of Tree, Ring, "
                                 "CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT (any case), "
                                 "got 'hypercube' in 'ring,hypercube'"),
    ("ll256", "--proto", "--proto: expected a comma-separated list of LL, LL128, Simple (any "
                         "case), got 'll256'"),
    ("ring,", "--algo", "--algo: expected a comma-separated list of Tree, Ring"),
    ("^nvls", "--algo", "--algo ^nvls: each combination pins one name; NCCL's ^ (disable) and "
                        "function: forms are not combinations"),
    ("allreduce:ring", "--algo", "--algo allreduce:ring: each combination pins one name"),
])
def test_a_name_nccl_lacks_is_one_precise_line(text, flag, words):
    names = ALGOS if flag == "--algo" else PROTOS
    with pytest.raises(ArgumentError) as e:
        parse_names(text, names, flag)
    assert str(e.value).startswith(words), str(e.value)
    assert "\n" not in str(e.value)


def test_the_combinations_are_every_algorithm_with_every_protocol():
    cfg = parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy", "--algo",
                      "ring,tree", "--proto", "ll,LL128,simple"])
    assert [c.label for c in cfg.combos] == ["ring/ll", "ring/ll128", "ring/simple", "tree/ll",
                                             "tree/ll128", "tree/simple"]
    assert cfg.combos[1].env() == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"}
    assert cfg.bits and cfg.repeat_bits == 0
    only = parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy", "--proto", "ll"])
    assert [(c.algo, c.proto, c.label) for c in only.combos] == [(None, "LL", "ll")]
    assert only.combos[0].env() == {"NCCL_PROTO": "LL"}
    plain = parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy"])
    assert plain.combos == [] and not plain.bits
    rep = parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy",
                      "--repeat-bits", "3"])
    assert rep.combos == [] and rep.repeat_bits == 3 and rep.bits
    assert make_combos([], []) == [Combo(None, None)]


def test_combination_flags_default_to_the_ncclpy_backend():
    cfg = parse_args(["all_reduce", "--device", "cpu", "--algo", "ring,tree"])
    assert cfg.backends == ["ncclpy"] and [c.label for c in cfg.combos] == ["ring", "tree"]
    assert parse_args(["all_reduce", "--device", "cpu"]).backends == ["torch"]


@pytest.mark.parametrize("argv, words", [
    (["--backend", "torch", "--algo", "ring"], "--algo ring: needs --backend ncclpy or cupy (a "
                                               "communicator made from NCCL's environment at "
                                               "init); torch.distributed's gloo runs no NCCL"),
    (["--backend", "ncclpy,torch", "--proto", "LL"], "--proto LL: needs --backend ncclpy or "
                                                     "cupy"),
    (["--backend", "gloo", "--repeat-bits", "2"], "--repeat-bits 2: needs --backend ncclpy or "
                                                  "cupy"),
    (["--backend", "ncclpy", "--algo", "ring,hypercube"], "--algo: expected a comma-separated"),
])
def test_what_cannot_pin_a_combination_is_refused(argv, words):
    with pytest.raises(ArgumentError) as e:
        parse_args(["all_reduce", "--device", "cpu", *argv])
    assert str(e.value).startswith(words), str(e.value)


def test_symmetric_windows_are_refused_with_combinations(monkeypatch):
    import bench.cli
    monkeypatch.setattr(bench.cli, "_no_gpu_reason", lambda: "")    # as if a GPU were here
    with pytest.raises(ArgumentError, match=r"^--algo ring: -R 2 registers symmetric windows, "
                                            r"and NCCL runs its symmetric kernels on them "
                                            r"whatever NCCL_ALGO and NCCL_PROTO say"):
        parse_args(["all_reduce", "--device", "cuda", "--backend", "ncclpy", "--algo", "ring",
                    "-R", "2"])


@pytest.mark.parametrize("value", ["1", "0", "two"])
def test_repeat_bits_takes_two_or_more(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy", "--repeat-bits",
                    value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--repeat-bits: expected an integer N >= 2" in err and f"{value!r}" in err
    assert err.count("\n") == 1, err


def test_sweep_config_holds_nccl_tests_flags_once():
    """SweepConfig is NcclTestsFlags plus the rest: one field list, parse_args fills it."""
    names = {f.name for f in dataclasses.fields(SweepConfig)}
    assert {f.name for f in dataclasses.fields(NcclTestsFlags)} <= names
    assert issubclass(SweepConfig, NcclTestsFlags)
    cfg = parse_args(["all_reduce", "--device", "cpu", "-N", "3", "-z", "2", "-C", "1",
                      "-S", "1", "-p", "1"])
    assert (cfg.run_cycles, cfg.blocking, cfg.report_cputime, cfg.report_timestamps,
            cfg.parallel_init, cfg.agg_iters) == (3, 2, True, True, 1, 1)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("coll", ["reduce_scatter", "reduce", "all_gather", "broadcast"])
def test_tree_has_no_kernel_but_for_all_reduce(coll):
    func = {"reduce_scatter": "ReduceScatter", "reduce": "Reduce", "all_gather": "AllGather",
            "broadcast": "Broadcast"}[coll]
    why = refusal(Combo("Tree", "Simple"), coll, 4, "cuda", {})
    assert why == (f"NCCL has no Tree kernel for {func} (src/graph/tuning.cc:273-277): with "
                   f"NCCL_ALGO=Tree NCCL_PROTO=Simple every call fails with \"no "
                   f"algorithm/protocol available\" (src/enqueue.cc:1845-1860)")
    assert refusal(Combo("Ring", "Simple"), coll, 4, "cuda", {}) is None
    assert refusal(Combo("Tree", "LL"), "all_reduce", 4, "cpu", {}) is None


@pytest.mark.parametrize("combo, coll, world, device, words", [
    (Combo("NVLS", "LL"), "all_reduce", 4, "cuda", "NCCL has NVLS kernels for Simple only "
                                                   "(src/graph/tuning.cc:280-282)"),
    (Combo("PAT", "Simple"), "all_reduce", 4, "cuda", "NCCL has no PAT kernel for AllReduce"),
    (Combo("NVLS", "Simple"), "all_reduce", 4, "cpu", "ncclpy's CPU backend models Ring and "
                                                      "Tree only: it would fold NVLS's calls "
                                                      "in Ring's order, not NCCL's"),
    (Combo("Ring", "LL"), "all_to_all", 4, "cuda", "NCCL runs all_to_all as send/recv, whose "
                                                   "protocol it picks by size "
                                                   "(src/enqueue.cc:821-835)"),
    (Combo("Ring", "Simple"), "send_recv", 2, "cpu", "NCCL runs send_recv as send/recv"),
    (Combo("Ring", "Simple"), "all_reduce", 1, "cpu", "one rank: NCCL copies the input "
                                                      "(ncclLaunchOneRank, src/enqueue.cc:"
                                                      "2569-2570)"),
])
def test_what_nccl_refuses_or_ignores_is_said(combo, coll, world, device, words):
    assert refusal(combo, coll, world, device, {}).startswith(words)


@pytest.mark.parametrize("combo, coll, device", [
    (Combo("NVLS", "Simple"), "all_reduce", "cuda"),    # NCCL may still refuse it at the call
    (Combo("Ring", "LL128"), "all_reduce", "cpu"),      # LL128 runs wherever it is named
    (Combo("Tree", "LL128"), "all_reduce", "cuda"),
    (Combo(None, "LL"), "reduce_scatter", "cpu"),       # NCCL_ALGO left alone: Ring runs
    (Combo("PAT", "Simple"), "all_gather", "cuda"),
])
def test_what_nccl_runs_is_not_refused(combo, coll, device):
    assert refusal(combo, coll, 4, device, {}) is None


def test_a_partial_combination_honours_the_users_environment():
    env = {"NCCL_ALGO": "Tree"}               # the user's own pin; --proto alone given
    assert refusal(Combo(None, "Simple"), "reduce_scatter", 4, "cpu", env).startswith(
        "NCCL has no enabled kernel for ReduceScatter")
    assert "NCCL refuses the environment at init: NCCL_ALGO=hypercube" in refusal(
        Combo(None, "LL"), "all_reduce", 4, "cpu", {"NCCL_ALGO": "hypercube"})


# ---------------------------------------------------------------------------- predictions
def _backend(algo="Ring", proto="Simple", version=22809):
    combo = Combo(algo, proto)
    return SimpleNamespace(combo=combo, nccl_env=combo.env(), bits_version=lambda: version)


def test_the_cpu_backend_is_predicted_from_its_pins():
    pred, why = bitcol.prediction(_backend("Tree", "LL"), "cpu", "all_reduce", 3, 12, "float32",
                                  "sum", 0)
    assert why == "" and pred.config.algo == "tree" and pred.config.proto == "ll"
    assert pred.config.nranks == 3 and pred.config.count == 12
    ins = [np.full(12, v, np.float32) for v in (2.0 ** 30, -2.0 ** 30, 1.0)]
    ring, _ = bitcol.prediction(_backend("Ring", "Simple"), "cpu", "all_reduce", 3, 12,
                                "float32", "sum", 0)
    # the example: NCCL's one-channel ring gives 0 in elements 0-7, 1 in 8-11
    assert ring.outputs(ins)[0].tolist() == [0.0] * 8 + [1.0] * 4


@pytest.mark.parametrize("coll, dtype, device, world, words", [
    ("all_gather", "float32", "cpu", 3, "not a reduction (its output copies inputs)"),
    ("all_reduce", "int32", "cpu", 3, "int32: every order of an integer sum gives the same "
                                      "bits"),
    ("all_reduce", "float32", "cuda", 4, bitcol.GPU_BEYOND_TWO),
    ("all_reduce", "float32", "cpu", 3, "is not a version whose source the model was checked "
                                        "against"),
])
def test_what_is_not_predicted_says_why(coll, dtype, device, world, words):
    b = _backend(version=21805 if "version" in words else 22809)
    pred, why = bitcol.prediction(b, device, coll, world, 12, dtype, "sum", 0)
    assert pred is None
    assert why.startswith(words) or words in why, why


def test_a_gpu_run_of_two_ranks_is_predicted_from_the_pinned_combination():
    pred, why = bitcol.prediction(_backend("Tree", "LL128"), "cuda", "all_reduce", 2, 64,
                                  "bfloat16", "avg", 0)
    assert why == "" and (pred.config.algo, pred.config.proto) == ("tree", "ll128")
    b = _backend(None, "Simple")                  # NCCL_ALGO not pinned: NCCL's tuning picks
    pred, why = bitcol.prediction(b, "cuda", "all_reduce", 2, 64, "float32", "sum", 0)
    assert pred is None and why.startswith("NCCL_ALGO does not pin one algorithm")


def test_environ_blocks_of_two_threads_restore_what_was_there_whatever_order_they_leave(
        monkeypatch):
    """Thread-ranks each wrap their init in environ(): the one who leaves last restores the
    value from before the first came (a save/restore per block left the first's value)."""
    import threading

    from bench import combos
    monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "7")
    inside, leave_first = threading.Barrier(2), threading.Event()
    seen = []

    def rank(first: bool) -> None:
        with combos.environ(NCCLPY_TRACE_BUFFER="0"):
            inside.wait(10)
            seen.append(os.environ["NCCLPY_TRACE_BUFFER"])
            if not first:
                assert leave_first.wait(10)
                seen.append(os.environ["NCCLPY_TRACE_BUFFER"])   # the other has left
        if first:
            leave_first.set()

    ts = [threading.Thread(target=rank, args=(f,)) for f in (True, False)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert seen == ["0", "0", "0"]
    assert os.environ["NCCLPY_TRACE_BUFFER"] == "7"
    assert not combos._ENV_HELD


def test_environ_waits_for_another_threads_other_value_then_refuses(monkeypatch):
    import threading

    from bench import combos
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setattr(combos, "ENV_WAIT_S", 0.2)
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with combos.environ(NCCL_ALGO="Ring"):
            held.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    with pytest.raises(RuntimeError, match="NCCL_ALGO: 'Tree' wanted, but another thread's "
                                           "block has held it at 'Ring'"):
        with combos.environ(NCCL_ALGO="Tree"):
            pass
    done.set()
    t.join(10)
    with combos.environ(NCCL_ALGO="Tree"):        # once it has left: runs under its own value
        assert os.environ["NCCL_ALGO"] == "Tree"
    assert "NCCL_ALGO" not in os.environ


def test_environ_nests_in_one_thread_and_a_failed_entry_holds_nothing(monkeypatch):
    from bench import combos
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with combos.environ(NCCL_ALGO="Ring", NCCL_PROTO="Simple"):
        with combos.environ(NCCL_ALGO="Tree"):          # the same thread: no wait
            assert os.environ["NCCL_ALGO"] == "Tree"
        assert os.environ["NCCL_ALGO"] == "Ring"
        assert combos.snapshot("NCCL_P") == {"NCCL_PROTO": "Simple"}
    assert os.environ["NCCL_ALGO"] == "Tree" and "NCCL_PROTO" not in os.environ
    with pytest.raises(ValueError):
        with combos.environ(NCCL_PROTO="LL", NCCL_ALGO="bad\0value"):
            pass
    assert "NCCL_PROTO" not in os.environ and not combos._ENV_HELD
    with combos.environ(NCCL_ALGO="Ring"):           # nothing left held: no wait
        assert os.environ["NCCL_ALGO"] == "Ring"
