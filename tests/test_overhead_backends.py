"""Issue 37's backends and tools on the CPU: both ncclpy flavours of ``bench.overhead`` made
for real on the stand-in of libnccl and CUDA (the defaults flavour with its watchdog and flight
recorder whatever ``NCCLPY_*`` says, the bare one with neither) and called the way the harness
calls them (a raw stream handle, in place, eager and prepared); the nccl4py backend's call;
``python -m bench.cuda_costs`` (no GPU: one line, exit 2; its loops on a stand-in runtime);
``bench/install_wheels.sh``; and the selftest's overhead stage commands and figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from module_run import ROOT, run_module

pytestmark = pytest.mark.timeout(300)


# -- ncclpy's two flavours, made and called on the stand-in ------------------------------------
def test_both_ncclpy_flavours_run_with_what_their_labels_say(monkeypatch):
    """One rank (a thread of this process: the flavours set the environment around their
    constructor, which a real run does in a process of its own per rank)."""
    from bench import overhead
    from bench.backends import Buffers, layout
    from bench.backends.ncclpy import NcclpyBareBackend, NcclpyDefaultsBackend
    from ncclpy.store import TCPStore
    from nccl_standin import DevArray, standin
    monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "5")     # a user's settings: not the defaults
    monkeypatch.setenv("NCCLPY_WATCHDOG", "0")
    store = TCPStore("127.0.0.1", 0, timeout=20, is_server=True)
    got = {}
    try:
        with standin() as eng:
            eng.cuda.set_device(0)
            for cls, uid in ((NcclpyDefaultsBackend, bytes([1]) * 128),
                             (NcclpyBareBackend, bytes([2]) * 128)):
                b = cls()
                b.rank, b.world, b.device, b.store = 0, 1, 0, store
                b.comm = b.open_comm(uid)
                b.stream_arg = eng.cuda.new_stream()      # what use_stream gives: an int
                whole = DevArray(np.arange(4, dtype=np.float32), device=0)
                bufs = b.adopt(Buffers("all_reduce", "float32", layout("all_reduce", 4, 1, 0),
                                       whole, whole, whole, whole, whole))
                assert bufs.extra["args"]["whole"] is whole
                before = len(eng.calls)
                b.run("all_reduce", bufs, "sum", 0, True)            # eager, in place
                overhead._prepared(b, "all_reduce", bufs, 0)()       # prepared, in place
                eng.cuda.synchronize(b.stream_arg)
                got[b.name] = {"settings": b.settings(), "out": whole.a.tolist(),
                               "env": os.environ.get("NCCLPY_TRACE_BUFFER"),
                               "calls": [c[0] for c in eng.calls[before:]]}
                b.close_comm(b.comm)
    finally:
        store.close()
    assert got["ncclpy"]["settings"] == {"watchdog": True, "flight_recorder_calls": 2000}
    assert got["ncclpy-bare"]["settings"] == {"watchdog": False, "flight_recorder_calls": 0}
    for name in ("ncclpy", "ncclpy-bare"):
        assert got[name]["calls"].count("ncclAllReduce") == 2, got[name]["calls"]
        assert got[name]["out"] == [0.0, 1.0, 2.0, 3.0]       # one rank: the sum is itself
        assert got[name]["env"] == "5"                        # the caller's variable given back
    assert os.environ["NCCLPY_WATCHDOG"] == "0"


# -- nccl4py ------------------------------------------------------------------------------------
def test_nccl4py_backend_calls_allreduce_in_place_on_the_raw_handle(monkeypatch):
    from bench.backends import Buffers, layout
    from bench.backends import nccl4py as N
    from ncclpy.errors import ArgumentError
    seen = []
    b = N.Nccl4pyBackend()
    b.comm = types.SimpleNamespace(allreduce=lambda s, r, op, stream=None: seen.append(
        (s, r, op, stream)))
    b._ops, b.stream_arg = {"sum": "SUM"}, 0x5EED
    lay = layout("all_reduce", 2, 2, 0)
    whole, send, recv = object(), object(), object()
    bufs = Buffers("all_reduce", "float32", lay, send, recv, whole, whole, whole)
    b.run("all_reduce", bufs, "sum", 0, True)
    b.run("all_reduce", bufs, "sum", 0, False)
    assert seen == [(whole, whole, "SUM", 0x5EED), (send, recv, "SUM", 0x5EED)]
    assert b.adopt(bufs) is bufs and b.stream_form.startswith("the raw handle (int)")
    with pytest.raises(ArgumentError, match="times all_reduce only, not broadcast"):
        b.run("broadcast", bufs, "sum", 0, True)
    assert b.unsupported("gather", "float32", "sum") == \
        "the nccl4py backend times all_reduce only"
    monkeypatch.setitem(sys.modules, "nccl", None)
    for k in [k for k in sys.modules if k.startswith("nccl.")]:
        monkeypatch.delitem(sys.modules, k)
    assert N.missing().startswith("ModuleNotFoundError: ")
    assert "error" in N.version_info()


# -- python -m bench.cuda_costs -----------------------------------------------------------------
def test_cuda_costs_without_a_gpu_is_one_line_and_exit_2():
    from gpu_util import cuda_reason
    if not cuda_reason():
        pytest.skip("a GPU is present: bench.cuda_costs measures")
    cp = run_module("bench.cuda_costs", "--json", "/tmp/never-written-cuda-costs.json")
    assert cp.returncode == 2 and cp.stdout == "", (cp.stdout, cp.stderr)
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith("python -m bench.cuda_costs: needs a CUDA GPU: it times CUDA "
                                "runtime calls, and none is usable here (")
    assert cp.stderr.rstrip().endswith("Nothing was measured.")
    assert not os.path.exists("/tmp/never-written-cuda-costs.json")
    for args, words in ((["--repeats", "0"], "--repeats: expected an integer >= 1, got 0"),
                        (["--json", "/nonexistent-ncclpy/c.json"], "--json: cannot write")):
        cp = run_module("bench.cuda_costs", *args)
        assert cp.returncode == 2 and cp.stderr.count("\n") == 1, cp.stderr
        assert cp.stderr.startswith(f"python -m bench.cuda_costs: error: {words}"), cp.stderr


class _Runtime:
    """CuPy's runtime functions bench.cuda_costs calls, counting calls and live events."""

    eventDisableTiming = 2

    def __init__(self):
        self.calls, self.live, self.next = {}, set(), 1

    def _n(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def eventCreateWithFlags(self, flag):
        assert flag == 2
        self._n("create")
        self.next += 1
        self.live.add(self.next)
        return self.next

    def eventDestroy(self, e):
        self._n("destroy")
        self.live.remove(e)

    def eventRecord(self, e, s):
        assert e in self.live and s == 77
        self._n("record")

    def eventQuery(self, e):
        assert e in self.live
        self._n("query")
        return 0

    def getDevice(self):
        self._n("get")
        return 0

    def setDevice(self, d):
        assert d == 0
        self._n("set")

    def streamIsCapturing(self, s):
        assert s == 77
        self._n("capturing")
        return 0


def test_cuda_costs_times_each_call_in_blocks_and_leaves_no_event_behind():
    import ctypes
    from bench import cuda_costs as C
    rt, drains, modes = _Runtime(), [], []

    def exchange(ref):              # the thread's mode: 1; exchange hands the old one back
        m = ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents
        old = modes[-1] if modes else 1
        modes.append(m.value)
        m.value = old
    detail, floor = C.measure(rt, 77, lambda d: types.SimpleNamespace(ptr=5), exchange, 0,
                              repeats=4, batch=3, warmup=2, drain=lambda: drains.append(1))
    assert list(detail) == [name for name, _ in C.CALLS]
    n = (4 + 2) * 3                                     # (timed + warm-up blocks) x batch
    for key in ("get", "set", "capturing", "query"):
        assert rt.calls[key] == n, key
    assert rt.calls["record"] == n + 1                  # + the queried event's one record
    assert rt.calls["create"] == 2 + 2 * n              # 2 fixed events, created and destroyed
    assert rt.calls["destroy"] == rt.calls["create"] and not rt.live
    assert modes[:2] == [0, 1] and set(modes[2:]) == {1}    # the thread keeps its own mode
    assert len(drains) >= 4 + 2
    for st in list(detail.values()) + [floor]:
        assert 0 <= st["min_ns"] <= st["p10_ns"] <= st["median_ns"] <= st["p90_ns"]
    doc = {"device": "GPU", "device_index": 0, "cuda_runtime": C.cuda_version(13000),
           "cuda_driver": C.cuda_version(12080), "cupy": "14.2.0", "repeats": 4, "batch": 3,
           "warmup": 2, "floor_ns": floor["median_ns"], "detail": detail, "not_measured": []}
    text = C.table(doc)
    assert "CUDA runtime 13.0, driver 12.8, CuPy 14.2.0" in text
    rows = [ln.split()[0] for ln in text.splitlines()[3:]]
    assert rows == [name for name, _ in C.CALLS]
    assert "not a CUDA call: CuPy's thread-local" in text
    detail2, _ = C.measure(_Runtime(), 77, lambda d: types.SimpleNamespace(ptr=5), None, 0,
                           repeats=1, batch=1, warmup=0, drain=lambda: None)
    assert "cuThreadExchangeStreamCaptureMode" not in detail2       # unreachable: left out


# -- bench/install_wheels.sh --------------------------------------------------------------------
def _script(*args, env=None):
    return subprocess.run(["bash", str(ROOT / "bench" / "install_wheels.sh"), *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_install_wheels_installs_nothing_when_nccl4py_imports_and_says_why_it_cannot(tmp_path):
    fake = tmp_path / "site" / "nccl" / "core"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("__version__ = '9.9'\n")
    cp = _script("--python", sys.executable, env={"PYTHONPATH": str(tmp_path / "site")})
    assert cp.returncode == 0 and "nccl4py already imports: 9.9" in cp.stdout, cp.stderr
    (fake / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    empty = tmp_path / "wheels"
    empty.mkdir()
    env = {"PYTHONPATH": str(tmp_path / "site")}
    cp = _script("--python", sys.executable, "--wheels", str(empty), env=env)
    assert cp.returncode == 1 and "nccl4py not installed: no " in cp.stderr, cp.stderr
    assert f"wheel for cp{sys.version_info[0]}{sys.version_info[1]}" in cp.stderr
    cp = _script("--python", sys.executable, "--wheels", str(tmp_path / "none"), "--optional",
                 env=env)
    assert cp.returncode == 0 and "runs without it (--optional)" in cp.stdout, cp.stderr
    cp = _script("--wheel", "x")
    assert cp.returncode == 2 and cp.stderr.startswith(
        "bench/install_wheels.sh: error: unknown argument '--wheel'"), cp.stderr


# -- the selftest's overhead stage ---------------------------------------------------------------
def test_the_overhead_stage_installs_nccl4py_then_runs_both_benchmarks():
    from ncclpy.selftest import stages as S
    st = S.by_name("overhead")
    ctx = S.Ctx(python="py", work="W", tmp="T")
    p = S.prefix(st)
    cmds = S.shard_commands(st, ctx)
    assert len(cmds) == 1 and [c.argv for c in cmds[0]] == [
        ("bash", "bench/install_wheels.sh", "--optional", "--python", "py"),
        ("py", "-m", "bench.overhead", "--nproc", "2", "--modes", "eager,prepared,graph,capture",
         "--breakdown", "-J", f"W/{p}.json"),
        ("py", "-m", "bench.cuda_costs", "--json", f"W/{p}.cuda-costs.json")]
    assert st.exclusive and st.timeout_s == 150 and st.min_s == 60
    # the bench's own defaults: every backend but nccl4py, which joins where installed
    from bench import overhead
    cfg = overhead.parse_args(["--device", "cuda", *st.args])
    assert cfg.modes == ["eager", "prepared", "graph", "capture"] and cfg.nproc == 2
    assert cfg.backends[:4] == ["ncclpy", "ncclpy-bare", "cupy", "torch"]


def test_the_overhead_stage_reports_both_flavours_and_the_cuda_costs(tmp_path):
    from bench.overhead_report import derive
    from ncclpy.selftest import parse as P
    from ncclpy.selftest import report as R
    from ncclpy.selftest import runner as RN
    from ncclpy.selftest import stages as S
    med = {"ncclpy": 9.5, "ncclpy-bare": 8.0, "cupy": 6.25, "torch": 14.0, "nccl4py": 7.0}
    res = [{"backend": b, "size": 8, "mode": m, "median_us": v + (1 if m == "graph" else 0)}
           for m in ("eager", "prepared", "graph", "capture") for b, v in med.items()]
    work = tmp_path / "w"
    work.mkdir()
    st = S.by_name("overhead")
    p = S.prefix(st)
    (work / f"{p}.json").write_text(json.dumps({"world_size": 2, "calls": 2000, "results": res,
                                                "derived": derive(res)}))
    o = P.overhead_figures(str(work / f"{p}.json"))
    e = o["modes"]["eager"]
    assert e["ncclpy_minus_cupy_us"] == pytest.approx(3.25)
    assert e["ncclpy-bare_minus_cupy_us"] == pytest.approx(1.75)
    assert e["ncclpy-bare_minus_nccl4py_us"] == pytest.approx(1.0)
    assert not [k for k in o["modes"]["graph"] if "minus" in k]     # none for graph replay
    costs = {"schema": "ncclpy-cuda-costs/1", "device": "H100", "cuda_runtime": "13.0",
             "cupy": "14.2.0", "costs_ns": {"cudaEventRecord": 1500.0, "cudaGetDevice": 90.0},
             "floor_ns": 30.0}
    ctx = S.Ctx(python="py", work=str(work), tmp=str(tmp_path))
    r = R.StageResult("overhead", st.title, timeout_s=150, seconds=60.0,
                      commands=[{"rc": 0}, {"rc": 0}, {"rc": 0}])
    RN.analyse(st, r, ctx)
    assert r.status == "failed" and r.reason == "bench.cuda_costs wrote no JSON"
    (work / f"{p}.cuda-costs.json").write_text(json.dumps(costs))
    r = R.StageResult("overhead", st.title, timeout_s=150, seconds=60.0,
                      commands=[{"rc": 0}, {"rc": 0}, {"rc": 0}])
    RN.analyse(st, r, ctx)
    assert r.status == "passed" and r.figures["cuda_costs"]["costs_ns"]["cudaGetDevice"] == 90.0
    assert f"{p}.cuda-costs.json" in r.files
    line = R._overhead_line(r.figures["overhead"])
    assert ("eager: ncclpy - cupy = 3.25 us, ncclpy-bare - cupy = 1.75 us (ncclpy 9.50, "
            "ncclpy-bare 8.00, cupy 6.25, torch 14.00, nccl4py 7.00)") in line
    assert "graph replay, the same kind of graph for all: ncclpy 10.50" in line
    assert "capture, one-off per captured call: ncclpy 9.50" in line
    assert P.cuda_costs_figures(str(tmp_path / "missing.json")) is None


# -- the sweep's ncclpy backend: send_recv in place ---------------------------------------------
def test_ncclpy_backend_times_send_recv_in_place_as_nccl_tests_does():
    """In place, nccl-tests' sendrecv sends and receives one buffer in a group; ncclpy's
    send_recv refuses overlapping buffers (a race), so the backend issues the grouped send and
    recv itself (a GPU run failed here: 2026-11-26).  Two ranks on the stand-in."""
    from bench.backends import Buffers, layout
    from bench.backends.ncclpy import NcclpyBareBackend
    from ncclpy.store import TCPStore
    from nccl_standin import DevArray, run_ranks, standin
    store = TCPStore("127.0.0.1", 0, timeout=20, is_server=True)
    uid = bytes([7]) * 128

    def rank(r: int):
        b = NcclpyBareBackend()
        b.rank, b.world, b.device, b.store = r, 2, r, store
        b.comm = b.open_comm(uid)
        b.stream_arg = eng.cuda.new_stream()
        send = DevArray(np.full(4, 10.0 + r, np.float32), device=r)
        recv = DevArray(np.zeros(4, np.float32), device=r)
        whole = DevArray(np.full(4, 20.0 + r, np.float32), device=r)
        bufs = b.adopt(Buffers("send_recv", "float32", layout("send_recv", 4, 2, r),
                               send, recv, whole, whole, whole))
        before = len([c for c in eng.calls if c[0] == "ncclGroupEnd"])
        b.run("send_recv", bufs, "none", -1, False)
        b.run("send_recv", bufs, "none", -1, True)
        eng.cuda.synchronize(b.stream_arg)
        ends = len([c for c in eng.calls if c[0] == "ncclGroupEnd"]) - before
        b.close_comm(b.comm)
        return recv.a.tolist(), whole.a.tolist(), ends
    try:
        with standin() as eng:
            got = run_ranks(2, rank)
        assert eng.violations == []
    finally:
        store.close()
    assert got[0][0] == [11.0] * 4 and got[1][0] == [10.0] * 4       # out of place: shifted
    assert {got[0][1][0], got[1][1][0]} <= {20.0, 21.0}               # in place: one buffer
    assert got[0][2] >= 2 and got[1][2] >= 2                        # both ran as groups
