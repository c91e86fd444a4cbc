"""The CPU benchmark of the whole call (issue 37): ``python -m bench.host_overhead`` runs end to
end (table, JSON), times the complete ``comm.all_reduce`` of a real Communicator with the defaults
on the null boundary against the floor, counts each path's CUDA calls on the caller's thread
(one: the record), prices them only with GPU-measured costs, and ``--breakdown`` splits the call
into its steps; ``bench.overhead``'s prepared mode parses and maps every collective onto
``comm.prepare`` as the ncclpy backend calls it eagerly.  No timing is asserted: the figures and
targets live in docs/performance.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ncclpy.buffers.buffer import Buffer
from ncclpy.comm.prepared import PreparedCall, bind_call
from ncclpy.comm.resolver import Resolver
from ncclpy.errors import ArgumentError
from ncclpy.plan.types import PlanContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_host_overhead_times_the_whole_call_and_writes_its_json(tmp_path):
    pytest.importorskip("cupy")
    js = tmp_path / "h.json"
    cp = _run("bench.host_overhead", "--repeats", "3", "--batch", "200", "--breakdown",
              "--json", str(js))
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(js.read_text())
    assert doc["schema"] == "ncclpy-host-overhead/2" and doc["floor_ns"] > 0
    paths = [r["path"] for r in doc["results"]]
    assert paths == ["eager", "eager_none", "eager_bare", "prepared", "prepared_bare"]
    for r in doc["results"]:
        assert 0 < r["min_ns"] <= r["median_ns"] <= r["p90_ns"]
        assert r["over_floor_ns"] < r["median_ns"]     # paired per round, below the median
        calls = dict(r["cuda_calls"])
        assert calls.pop("event_record") == 1.0, r      # the two CUDA calls of the budget:
        assert calls.pop("capture_status") == 1.0, r    # the record and the capture query
        if r["path"] == "eager_none":
            assert calls.pop("current_stream") == 1.0  # CuPy's thread-local, not CUDA
        assert calls == {}, r
        assert ("target_ns" in r) == (r["path"] in ("eager", "prepared"))
    b = doc["breakdown"]
    assert set(b["steps_ns"]) == {"nccl_call", "record", "lock_marker", "recorder",
                                  "work_tracker", "lookup_glue"}
    assert b["recorder"] and b["watchdog"] and b["whole_ns"] > 0
    out = cp.stdout
    assert out.splitlines()[0].startswith("# ncclpy host overhead (CPU, null boundary)")
    assert "# breakdown of one eager all_reduce" in out
    if doc["costs"] is None:      # no GPU figures in the repository: no prediction, said so
        assert "# GPU prediction: none -- no GPU-measured CUDA call costs" in out
        assert all("gpu" not in r for r in doc["results"])


def test_host_overhead_bad_arguments_exit_2():
    cp = _run("bench.host_overhead", "--repeats", "0")
    assert cp.returncode == 2 and "--repeats: expected an integer >= 1, got 0" in cp.stderr


def test_host_overhead_says_it_needs_cupy():
    code = ("import sys; sys.modules['cupy'] = None; "
            "from bench.host_overhead import main; sys.exit(main(['--repeats', '1']))")
    cp = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 2, cp.stderr
    assert cp.stderr.startswith("python -m bench.host_overhead: needs CuPy (the CUDA extra: "
                                "pip install 'ncclpy[cu13]'"), cp.stderr
    assert "Traceback" not in cp.stderr


def test_the_gpu_prediction_prices_each_counted_call(tmp_path):
    from bench.host_overhead import load_costs, predict
    costs = {"costs_ns": {"cudaEventRecord": 1500.0, "cudaGetDevice": 40.0}}
    got = predict(700.0, {"event_record": 1.0, "get_device": 0.5, "mystery": 2.0}, costs)
    assert got == {"predicted_ns": 2220.0, "cuda_ns": 1520.0,
                   "priced": {"event_record": 1500.0, "get_device": 20.0},
                   "unpriced": ["mystery"]}
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"schema": "something-else", "costs_ns": {}}))
    with pytest.raises(ValueError, match="not a bench.cuda_costs result"):
        load_costs(str(f))
    assert load_costs(str(tmp_path / "absent.json")) is None


def test_stats_median_and_p90():
    from bench.host_overhead import stats
    s = stats([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    assert (s["min_ns"], s["median_ns"], s["p90_ns"]) == (1.0, 5.5, 10.0)
    assert stats([2.0]) == {"min_ns": 2.0, "median_ns": 2.0, "p90_ns": 2.0}


# -- bench/overhead.py: the prepared mode ------------------------------------------------------
def test_overhead_prepared_mode_parses():
    from bench import overhead
    cfg = overhead.parse_args(["--modes", "eager,prepared", "--device", "cuda"])
    assert cfg.modes == ["eager", "prepared"]
    assert overhead.parse_args(["--device", "cuda"]).modes == ["eager", "prepared", "graph",
                                                                 "capture"]
    with pytest.raises(ArgumentError, match="prepared"):
        overhead.parse_args(["--modes", "eager,warp", "--device", "cuda"])


@pytest.mark.parametrize("collective", ["all_reduce", "reduce", "broadcast", "all_gather",
                                        "reduce_scatter", "all_to_all", "gather", "scatter",
                                        "send_recv"])
def test_overhead_prepare_args_match_the_eager_call(collective):
    """``prepare_args`` gives ``comm.prepare`` the arguments the ncclpy backend passes to the
    eager method, and they plan (on buffers laid out as the bench lays them out)."""
    from bench import overhead
    from bench.backends import layout
    from bench.backends.ncclpy import call_args
    world, rank, root = 2, 0, 0
    lay = layout(collective, 8, world, rank)
    base = 0x7F00_0000_0000

    def buf(off, n):
        return Buffer(base + 4 * off, n, "float32", 0)
    a = {"send": buf(0, lay.send), "recv": buf(1 << 20, lay.recv),
         "whole": buf(2 << 20, lay.whole),
         "ip_send": buf((2 << 20) + lay.ip_send[0], lay.ip_send[1]),
         "ip_recv": buf((2 << 20) + lay.ip_recv[0], lay.ip_recv[1])}
    in_place = collective != "send_recv"     # the eager bench's in-place send_recv overlaps
    s, r = call_args(collective, a, in_place, rank, root)
    args, kwargs = overhead.prepare_args(collective, s, r, root, rank, world)
    name, pa, pb, params = bind_call(collective, args, kwargs)
    assert (name, pa, pb) == (collective, s, r)
    if collective in ("all_reduce", "reduce_scatter"):
        assert params == ("sum",)
    elif collective == "reduce":
        assert params == (root, "sum")
    elif collective == "send_recv":
        assert params == (1, 1)
    res = Resolver(PlanContext(rank, world, 0, 23203))
    pc = PreparedCall(res, name, pa, pb, params, stream=0x51)
    assert pc.bind().plan.collective == collective


def test_overhead_prepare_args_unknown():
    from bench import overhead
    with pytest.raises(ValueError, match="barrier"):
        overhead.prepare_args("barrier", None, None, 0, 0, 2)


def test_overhead_derive_covers_the_prepared_mode():
    from bench.overhead import derive
    rows = [{"backend": b, "size": 8, "mode": m, "median_us": v}
            for b, m, v in (("ncclpy", "prepared", 9.5), ("cupy", "prepared", 9.0),
                            ("ncclpy", "eager", 10.0), ("cupy", "eager", 9.0))]
    d = {(x["mode"]): x for x in derive(rows)}
    assert d["prepared"]["minus_cupy_us"] == pytest.approx(0.5)
    assert d["eager"]["minus_cupy_us"] == pytest.approx(1.0)


# -- bench/overhead.py: no captured graph outlives its mode ------------------------------------
def test_overhead_drops_every_captured_graph_before_teardown(monkeypatch):
    """NCCL's communicator destroy waits until every CUDA graph that captured its calls is
    destroyed, so a graph still referenced at teardown hangs the run (seen on an H100 with all
    three backends, 2026-11-25).  Stand-in backend, store and rendezvous (no GPU): teardown
    checks through weak references that no graph the run captured is still alive."""
    import gc
    import weakref

    from bench import overhead

    class Graph:
        pass

    seen = {"captured": [], "alive_at_teardown": None, "released": 0}

    class StandIn:                      # the bench backend interface, recording
        name = label = "standin"
        defaults = stream_form = ""

        def settings(self):
            return {}

        def setup(self, *a, **k):
            pass

        def alloc(self, collective, total, dtype):
            return object()

        def run(self, *a):
            pass

        def sync(self):
            pass

        def capture(self, fn):
            fn()
            g = Graph()
            seen["captured"].append(weakref.ref(g))
            return g

        def replay(self, g):
            pass

        def release(self, g):
            seen["released"] += 1

        def device_info(self):
            return {}

        def nccl_version(self):
            return 0

        def teardown(self):
            gc.collect()
            seen["alive_at_teardown"] = sum(r() is not None for r in seen["captured"])

    class Coord:
        def __init__(self, *a):
            pass

        def barrier(self):
            pass

    class Store:
        def close(self):
            pass

    monkeypatch.setattr(overhead, "_rendezvous", lambda: (0, 1, 0, 0, None))
    monkeypatch.setattr(overhead, "_make_store", lambda info, timeout: Store())
    monkeypatch.setattr(overhead, "Coord", Coord)
    monkeypatch.setattr(overhead, "_pick_device", lambda *a: 0)
    monkeypatch.setattr(overhead, "get_backend", lambda name, table=None: StandIn())
    monkeypatch.setattr(overhead, "_versions", lambda backends: {})
    monkeypatch.setattr(overhead, "_shared", lambda device: None)
    cfg = overhead.parse_args(["--device", "cuda", "--backend", "ncclpy", "--calls", "7",
                               "--graph-calls", "7", "--batch", "3", "--warmup", "1",
                               "--sizes", "8", "--modes", "eager,capture,graph"])
    doc = overhead.run_rank(cfg)
    assert [r["mode"] for r in doc["results"]] == ["eager", "graph", "capture"]
    assert len(seen["captured"]) == 1 + 3          # graph: one; capture: ceil(7/3) graphs
    assert seen["released"] == len(seen["captured"])
    assert seen["alive_at_teardown"] == 0
