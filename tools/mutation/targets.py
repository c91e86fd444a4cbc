"""What the mutation run covers: each module whose contract matters, the functions in it that
carry the contract (None: all), and the tests of its area that must kill its mutants."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["Target", "TARGETS"]


@dataclass(frozen=True)
class Target:
    """One module of the run: ``path`` (from the checkout's root), ``tests`` (pytest arguments),
    ``funcs`` (the contract's functions; None for every function), ``sample`` (mutants drawn,
    with a fixed seed, when the module has more: the run fits a 2-core machine)."""
    path: str
    tests: Tuple[str, ...]
    funcs: Optional[Tuple[str, ...]] = None
    sample: int = 40
    why: str = ""


TARGETS: Dict[str, Target] = {t[0]: t[1] for t in [
    ("reference", Target("ncclpy/semantics/reference.py",
                         ("tests/test_reference_contract.py", "tests/test_reference.py",
                          "tests/test_numerics.py"),
                         why="the oracle every result is judged against")),
    ("numerics", Target("ncclpy/semantics/numerics.py",
                        ("tests/test_numerics_contract.py", "tests/test_numerics.py",
                         "tests/test_reference.py"),
                        why="reduction order, ULP distances, tolerances")),
    ("dtypes", Target("ncclpy/semantics/dtypes.py",
                      ("tests/test_dtypes_contract.py", "tests/test_dtype_names.py",
                       "tests/test_dtypes_ops.py"),
                      why="names, aliases and NCCL enums of every dtype")),
    ("check_compare", Target("ncclpy/check/compare.py",
                             ("tests/test_check_verdicts.py", "tests/test_check_bits.py",
                              "tests/test_check_report.py"),
                             why="bit-for-bit comparison and the verdicts of ncclpy check")),
    ("store_ops", Target("ncclpy/store/ops.py",
                         ("tests/test_store_ops_contract.py", "tests/test_store.py",
                          "tests/test_store_contract.py", "tests/test_store_int64.py"),
                         funcs=("_wake", "_finish_waiter", "_unlink", "_cancel_waiter", "_park",
                                "_op_set", "_op_get", "_counter", "_op_add", "_op_arrive",
                                "_op_cas", "_op_delete", "_op_wait", "_op_num_keys", "_op_check",
                                "_parse_keys", "_key_ok", "_value_ok"),
                         why="what each store operation does on the server")),
    ("store_sync", Target("ncclpy/store/sync.py",
                          ("tests/test_store_sync_contract.py", "tests/test_store_contract.py",
                           "tests/test_store_barrier.py"),
                          why="barriers and waits on several keys")),
    ("store_auth_server", Target("ncclpy/store/ops.py",
                                 ("tests/test_store_auth_contract.py", "tests/test_store_auth.py"),
                                 funcs=("_op_auth", "_unauthenticated"),
                                 why="the server's side of the challenge-response")),
    ("store_auth_client", Target("ncclpy/store/transport.py",
                                 ("tests/test_store_auth_contract.py", "tests/test_store_auth.py"),
                                 funcs=("_handshake",),
                                 why="the client's side: it refuses a server without the token")),
    ("launcher", Target("ncclpy/launch/launcher.py",
                        ("tests/test_launcher_contract.py", "tests/test_launcher_stop.py"),
                        funcs=("_supervise", "_how", "_signal_group"),
                        why="fail-fast and the job's exit code")),
    ("watchdog_verdicts", Target("ncclpy/debug/verdicts.py",
                                 ("tests/test_verdicts_contract.py", "tests/test_watchdog.py"),
                                 why="who is dead, who is suspected, who decides")),
    ("resolver", Target("ncclpy/comm/resolver.py",
                        ("tests/test_resolver_contract.py", "tests/test_resolver.py",
                         "tests/test_call_path.py", "tests/test_prepared.py"),
                        why="re-planning when the context changes, inside groups too")),
    ("execute", Target("ncclpy/comm/execute.py",
                       ("tests/test_execute_contract.py", "tests/test_call_path.py",
                        "tests/test_call_path_lifecycle.py", "tests/test_fast_path.py",
                        "tests/test_interrupts.py", "tests/test_call_path_defects.py",
                        "tests/test_fast_path_pins.py"),
                       why="resource lifetimes of an issued call, groups")),
    ("hot", Target("ncclpy/comm/hot.py",
                   ("tests/test_fast_path.py", "tests/test_interrupts.py",
                    "tests/test_call_path_defects.py", "tests/test_fast_path_pins.py",
                    "tests/test_call_budget.py", "tests/test_prepared.py",
                    "tests/test_call_path_lifecycle.py"),
                   why="the fast path: a hit refuses what the general path refuses, an "
                       "interrupt leaves nothing held")),
    ("work", Target("ncclpy/comm/work.py",
                    ("tests/test_work_contract.py", "tests/test_fast_path.py",
                     "tests/test_call_path_defects.py", "tests/test_fast_path_pins.py",
                     "tests/test_interrupts.py", "tests/test_call_path_lifecycle.py",
                     "tests/test_tracker_leaks.py", "tests/test_call_path.py",
                     "tests/test_lifecycle_rules.py", "tests/test_execute_contract.py",
                     "tests/test_watchdog.py"),
                    funcs=("record_event", "captures", "Work._track", "Work._reap",
                           "Work._closed_captured", "Work._query", "Work.wait",
                           "Work.is_completed", "Work._captured", "Work._completed"),
                    why="who keeps a call's memory, and until when")),
    ("bench_verify", Target("bench/verify.py",
                            ("tests/test_bench_verify.py", "tests/test_bench.py"),
                            why="the bench's #wrong")),
    ("bench_periter", Target("bench/periter.py", ("tests/test_bench_periter.py",),
                             funcs=("IterStats.cv_pct", "percentile_index", "iter_stats",
                                    "report", "Recorder._mark", "Recorder.begin",
                                    "Recorder.end", "Recorder.close", "Recorder.seconds"),
                             why="nccl-tests' per-iteration statistics (-I, -K)")),
    ("nccl_tests_compare", Target("bench/nccl_tests_compare.py",
                                  ("tests/test_nccl_tests_side.py",),
                                  funcs=("parse_results", "out_of_bounds", "medians", "ratio",
                                         "explain_eager", "_target", "compare", "_verdict",
                                         "summarise", "status_of"),
                                  why="ncclpy's bench beside nccl-tests: the figures, ratios "
                                      "and verdicts against the targets")),
    ("bandwidth", Target("ncclpy/semantics/registry.py", ("tests/test_bandwidth.py",),
                         funcs=("Collective.bandwidths", "<lambda>", "_ring", "_part",
                                "_whole", "Collective.sizes", "Collective.divisor"),
                         why="algbw and busbw as nccl-tests defines them")),
    ("order_split", Target("ncclpy/order/split.py",
                           ("tests/test_order_literals.py", "tests/test_order_model.py",
                            "tests/test_order_translit.py::test_host_split_equals_"
                            "transliteration_on_every_port_and_any_world_size",
                            "tests/test_order_translit.py::test_host_split_edge_cases_equal_"
                            "transliteration"),
                           why="NCCL's channel tuning, split and chunks: where every fold "
                               "starts")),
    ("order_model", Target("ncclpy/order/model.py",
                           ("tests/test_order_literals.py", "tests/test_order_model.py",
                            "tests/test_order_pins.py"),
                           why="the fold of every output element, and its bits")),
    ("order_pins", Target("ncclpy/order/pins.py", ("tests/test_order_pins.py",),
                          why="NCCL_ALGO/NCCL_PROTO/channels as NCCL reads them, and what "
                              "the CPU backend runs")),
    ("order_reveal", Target("ncclpy/order/reveal.py",
                            ("tests/test_order_model.py", "tests/test_order_observe.py"),
                            why="inputs whose sum shows its order, and the decoder")),
]}
