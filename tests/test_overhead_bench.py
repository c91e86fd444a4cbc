"""``python -m bench.overhead`` of issue 37 on the CPU: the new backends on its command line
(``ncclpy`` with its defaults, ``ncclpy-bare``, the optional ``nccl4py`` refused in one line
where it is missing), the pure summary (rounds, turns, derived figures, the sections and their
labels), the harness's round robin on one shared stream and one set of buffers (stand-in
backends), both ncclpy flavours made for real on the CPU stand-in of libnccl and CUDA, the
nccl4py backend's call, ``bench.cuda_costs`` (no GPU: one line, exit 2; its measuring loop on a
stand-in runtime), ``bench/install_wheels.sh`` and the selftest stage.  No timing is
asserted: there is no GPU here."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from ncclpy.errors import ArgumentError

from module_run import ROOT

pytestmark = pytest.mark.timeout(300)


def _cfg(*args):
    from bench import overhead
    return overhead.parse_args(["--device", "cuda", *args])


def _hide_nccl4py(monkeypatch):
    """Make ``import nccl.core`` fail, as where nccl4py is not installed."""
    for k in [k for k in sys.modules if k == "nccl" or k.startswith("nccl.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "nccl", None)


# -- the command line --------------------------------------------------------------------------
def test_default_backends_are_both_ncclpy_flavours_and_nccl4py_only_where_installed(
        monkeypatch):
    from bench.backends import nccl4py
    _hide_nccl4py(monkeypatch)
    cfg = _cfg()
    assert cfg.backends == ["ncclpy", "ncclpy-bare", "cupy", "torch"]
    assert cfg.modes == ["eager", "prepared", "graph", "capture"]
    assert len(cfg.notes) == 1 and cfg.notes[0].startswith("nccl4py: not installed here (")
    assert "pip install nccl4py==0.6.0" in cfg.notes[0]
    monkeypatch.setattr(nccl4py, "missing", lambda: None)
    cfg = _cfg()
    assert cfg.backends == ["ncclpy", "ncclpy-bare", "cupy", "torch", "nccl4py"]
    assert cfg.notes == []
    # a collective nccl4py does not time: left out of the default, refused when asked for
    assert "nccl4py" not in _cfg("--collective", "broadcast").backends
    with pytest.raises(ArgumentError, match=r"^--backends: nccl4py times all_reduce only; got "
                                            r"--collective broadcast$"):
        _cfg("--collective", "broadcast", "--backends", "nccl4py")


def test_backends_as_typed_in_order_once_with_aliases():
    assert _cfg("--backends", "cupy,ncclpy-bare,ncclpy,cupy").backends == \
        ["cupy", "ncclpy-bare", "ncclpy"]
    assert _cfg("--backend", "ncclpy_bare,cupy_raw,torch_dist").backends == \
        ["ncclpy-bare", "cupy", "torch"]
    assert _cfg("--modes", "capture,eager").modes == ["eager", "capture"]
    cpu = _cfg("--device", "cpu", "--backends", "ncclpy")          # the last --device wins
    assert (cpu.device, cpu.backends, cpu.modes) == ("cpu", ["torch"], ["eager"])


@pytest.mark.parametrize("args, words", [
    (["--backends", "ncclpy,nccl"], "--backends: expected a comma-separated list of ncclpy, "
                                    "ncclpy-bare, cupy, torch, nccl4py; got 'nccl'"),
    (["--backend", "bare"], "--backend: expected a comma-separated list of ncclpy, "),
    (["--repeats", "0"], "--repeats: expected >= 1, got 0"),
    (["--graph-calls", "0"], "--graph-calls: expected >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: expected >= 0, got -1"),
    (["--modes", "eager,replay"], "--modes: expected a comma-separated list of eager, prepared, "
                                  "graph, capture; got 'eager,replay'"),
])
def test_bad_arguments_are_named_as_typed(args, words):
    with pytest.raises(ArgumentError) as ei:
        _cfg(*args)
    assert str(ei.value).startswith(words), str(ei.value)


def test_nccl4py_missing_is_refused_in_one_line_saying_how_to_install_it():
    code = ("import sys; sys.modules['nccl'] = None\n"
            "from bench.overhead import main\n"
            "sys.exit(main(['--backends', 'ncclpy,nccl4py', '--device', 'cuda']))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 2 and cp.stdout == "", (cp.stdout, cp.stderr)
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith("python -m bench.overhead: error: --backends: nccl4py is not "
                                "installed here ("), cp.stderr
    assert "pip install nccl4py==0.6.0" in cp.stderr and "bench/install_wheels.sh" in cp.stderr


# -- the pure summary --------------------------------------------------------------------------
def test_calls_are_split_over_rounds_and_the_order_rotates():
    from bench.overhead_report import rotation, split_calls
    assert split_calls(2000, 5) == [400] * 5
    assert split_calls(7, 3) == [3, 2, 2] and sum(split_calls(7, 3)) == 7
    assert split_calls(2, 5) == [1, 1]                  # never an empty round
    with pytest.raises(ValueError):
        split_calls(0, 5)
    names = ["ncclpy", "ncclpy-bare", "cupy", "torch"]
    orders = [rotation(names, r) for r in range(4)]
    assert orders[1] == ["ncclpy-bare", "cupy", "torch", "ncclpy"]
    assert [o[0] for o in orders] == names              # each backend leads one round
    assert rotation(names, 4) == names and rotation([], 3) == []


def _rows(meds):
    return [{"backend": b, "label": b, "size": size, "mode": mode, "median_us": v,
             "p10_us": v, "p90_us": v, "calls": 10}
            for (b, size, mode), v in meds.items()]


_MEDS = {("ncclpy", 8, "eager"): 10.0, ("ncclpy-bare", 8, "eager"): 8.5,
         ("cupy", 8, "eager"): 7.0, ("torch", 8, "eager"): 20.0, ("nccl4py", 8, "eager"): 9.0,
         ("ncclpy", 8, "prepared"): 8.0, ("ncclpy-bare", 8, "prepared"): 7.5,
         ("cupy", 8, "prepared"): 7.0,
         ("ncclpy", 8, "graph"): 5.0, ("cupy", 8, "graph"): 4.0,
         ("ncclpy", 8, "capture"): 30.0, ("cupy", 8, "capture"): 20.0}


def test_derived_figures_per_flavour_and_per_call_mode_only():
    from bench.overhead_report import derive
    d = {(x["backend"], x["mode"]): x for x in derive(_rows(_MEDS))}
    assert set(d) == {("ncclpy", "eager"), ("ncclpy-bare", "eager"), ("ncclpy", "prepared"),
                      ("ncclpy-bare", "prepared")}                  # no graph, no capture
    e = d[("ncclpy", "eager")]
    assert (e["minus_cupy_us"], e["minus_torch_us"], e["minus_nccl4py_us"]) == (3.0, -10.0, 1.0)
    assert d[("ncclpy-bare", "eager")]["minus_cupy_us"] == pytest.approx(1.5)
    p = d[("ncclpy-bare", "prepared")]
    assert p["minus_cupy_us"] == pytest.approx(0.5) and "minus_torch_us" not in p
    assert [(x["backend"], x["mode"]) for x in derive(_rows(_MEDS))] == [
        ("ncclpy", "eager"), ("ncclpy-bare", "eager"), ("ncclpy", "prepared"),
        ("ncclpy-bare", "prepared")]


def test_the_table_has_its_sections_and_says_what_each_backend_ran_with():
    from bench.overhead_report import derive, render
    res = _rows(_MEDS)
    doc = {"collective": "all_reduce", "world_size": 2, "results": res, "derived": derive(res),
           "method": {"rounds": 5, "warmup": 100, "stream": "STREAM", "buffers": "BUFFERS"},
           "backends": [{"name": "ncclpy", "defaults": "watchdog on",
                         "settings": {"watchdog": True, "flight_recorder_calls": 2000}},
                        {"name": "ncclpy-bare", "defaults": "watchdog off", "settings": {}}],
           "notes": ["nccl4py: not installed here"]}
    text = render(doc)
    lines = text.splitlines()
    assert "# stream: STREAM" in lines and "# buffers: BUFFERS" in lines
    assert "# ncclpy: watchdog on [watchdog True, flight_recorder_calls 2000]" in lines
    assert "# ncclpy-bare: watchdog off" in lines and "# nccl4py: not installed here" in lines
    head = next(ln for ln in lines if ln.split()[:2] == ["mode", "size"]).split()
    assert head == ["mode", "size", "ncclpy", "ncclpy-bare", "cupy", "torch", "nccl4py",
                    "ncclpy-cupy", "ncclpy-torch", "ncclpy-nccl4py", "ncclpy-bare-cupy",
                    "ncclpy-bare-torch", "ncclpy-bare-nccl4py"]
    eager = next(ln for ln in lines if ln.split()[:2] == ["eager", "8"]).split()
    assert eager[2:] == ["10.00", "8.50", "7.00", "20.00", "9.00", "3.00", "-10.00", "1.00",
                         "1.50", "-11.50", "-0.50"]
    prepared = next(ln for ln in lines if ln.split()[:2] == ["prepared", "8"]).split()
    assert prepared[2:7] == ["8.00", "7.50", "7.00", "-", "-"]
    g = lines.index(next(ln for ln in lines if ln.startswith("## graph replay")))
    assert "no ncclpy - cupy figure" in lines[g] and "barrier before each replay" in lines[g]
    assert lines[g + 1].split() == ["size", "ncclpy", "ncclpy-bare", "cupy", "torch", "nccl4py"]
    assert lines[g + 2].split() == ["8", "5.00", "-", "4.00", "-", "-"]
    c = lines.index(next(ln for ln in lines if ln.startswith("## one-off")))
    assert "not compared with the eager target" in lines[c] and c > g
    assert lines[c + 2].split() == ["8", "30.00", "-", "20.00", "-", "-"]
    # a run of the eager mode alone has no graph or one-off section
    only = [r for r in res if r["mode"] == "eager"]
    assert "## " + "graph" not in render({**doc, "results": only, "derived": derive(only)})


# -- the harness: round robin on one stream and one set of buffers -----------------------------
class _Shared:
    def __init__(self):
        self.stream = types.SimpleNamespace(ptr=0x5EED)
        self.allocs = []

    def alloc(self, collective, total, dtype, world, rank):
        from bench.backends import Buffers, layout
        lay = layout(collective, total, world, rank)
        b = Buffers(collective, dtype, lay, "send", "recv", "whole", "whole", "whole")
        self.allocs.append(b)
        return b


def _stand_in_run(monkeypatch, names, *args):
    """run_rank with recording stand-in backends; returns (doc, the event log, backends)."""
    from bench import overhead
    log, made = [], []

    class B:
        defaults = "stand-in"
        stream_form = "raw"

        def __init__(self, name):
            self.name = self.label = name
            self.rank, self.world = 0, 1
            self.comm = types.SimpleNamespace(prepare=self._prepare)

        def _prepare(self, coll, *a, stream=None, **kw):
            log.append(("prepare", self.name, coll, a, stream, kw))
            return lambda: log.append(("call", self.name, "prepared"))

        def setup(self, rank, world, device, store, **kw):
            log.append(("setup", self.name, device))

        def use_stream(self, stream):
            self.stream_arg = stream.ptr
            log.append(("stream", self.name, stream.ptr))

        def adopt(self, bufs):
            self.bufs = bufs
            bufs.extra["args"] = {k: getattr(bufs, k) for k in
                                  ("send", "recv", "whole", "ip_send", "ip_recv")}
            return bufs

        def run(self, coll, bufs, op, root, in_place):
            log.append(("call", self.name, "eager"))

        def sync(self):
            pass

        def capture(self, fn):
            fn()
            return ("graph", self.name)

        def replay(self, g):
            log.append(("call", self.name, "replay"))

        def release(self, g):
            log.append(("release", self.name))

        def device_info(self):
            return {}

        def nccl_version(self):
            return 0

        def settings(self):
            return {"name": self.name}

        def teardown(self):
            log.append(("teardown", self.name))

    class Coord:
        def __init__(self, *a):
            pass

        def barrier(self):
            log.append(("barrier",))

    shared = _Shared()

    def get(name, table=None):
        made.append(B(name))
        return made[-1]
    monkeypatch.setattr(overhead, "_rendezvous", lambda: (0, 1, 0, 0, None))
    monkeypatch.setattr(overhead, "_make_store", lambda info, timeout: types.SimpleNamespace(
        close=lambda: None))
    monkeypatch.setattr(overhead, "Coord", Coord)
    monkeypatch.setattr(overhead, "_pick_device", lambda *a: 0)
    monkeypatch.setattr(overhead, "get_backend", get)
    monkeypatch.setattr(overhead, "_versions", lambda backends: {})
    monkeypatch.setattr(overhead, "_shared", lambda device: shared)
    cfg = overhead.parse_args(["--device", "cuda", "--backends", ",".join(names), "--sizes",
                               "8", *args])
    return overhead.run_rank(cfg), log, made, shared


def test_backends_take_turns_on_one_stream_and_one_set_of_buffers(monkeypatch, capsys):
    names = ["ncclpy", "ncclpy-bare", "cupy"]
    doc, log, made, shared = _stand_in_run(monkeypatch, names, "--modes", "eager,prepared",
                                           "--calls", "6", "--repeats", "3", "--warmup", "2",
                                           "--batch", "4")
    assert [e for e in log if e[0] == "stream"] == [("stream", n, 0x5EED) for n in names]
    assert len(shared.allocs) == 1 and all(b.bufs is shared.allocs[0] for b in made)
    # eager: 2 warm-up calls each, then 3 rounds of 2 timed calls, the order rotated per round
    calls = [e[1] for e in log if e[:1] == ("call",) and e[2] == "eager"]
    warm, timed = calls[:6], calls[6:]
    assert warm == ["ncclpy", "ncclpy", "ncclpy-bare", "ncclpy-bare", "cupy", "cupy"]
    assert timed[:6] == ["ncclpy"] * 2 + ["ncclpy-bare"] * 2 + ["cupy"] * 2
    assert timed[6:12] == ["ncclpy-bare"] * 2 + ["cupy"] * 2 + ["ncclpy"] * 2
    assert timed[12:18] == ["cupy"] * 2 + ["ncclpy"] * 2 + ["ncclpy-bare"] * 2
    # prepared: both flavours prepare the in-place call on the stream's raw handle; cupy,
    # which has no prepared call, makes its eager call in that mode
    preps = [e for e in log if e[0] == "prepare"]
    assert [(e[1], e[2], e[3], e[4], e[5]) for e in preps] == [
        (n, "all_reduce", ("whole", None), 0x5EED, {"op": "sum"}) for n in names[:2]]
    assert len([e for e in log if e[1:] == ("cupy", "eager")]) == 2 * (2 + 6)
    rows = {(r["backend"], r["mode"]): r for r in doc["results"]}
    for r in rows.values():
        assert r["calls"] == 6 and r["rounds"] == 3 and len(r["round_medians_us"]) == 3
        assert r["section"] == "per_call"
    assert {(d["backend"], d["mode"]) for d in doc["derived"]} == {
        (n, m) for n in names[:2] for m in ("eager", "prepared")}
    assert [b["name"] for b in doc["backends"]] == names
    assert doc["backends"][0]["settings"] == {"name": "ncclpy"}
    assert doc["method"]["rounds"] == 3 and "raw handle" in doc["method"]["stream"]
    out = capsys.readouterr().out
    assert "## per call: median us" in out and "ncclpy-bare-cupy" in out


def test_graph_replays_each_follow_a_barrier_and_capture_is_its_own_section(monkeypatch):
    doc, log, made, _ = _stand_in_run(monkeypatch, ["ncclpy", "cupy"], "--modes",
                                      "graph,capture", "--graph-calls", "4", "--repeats", "2",
                                      "--warmup", "1", "--batch", "2")
    replays = [i for i, e in enumerate(log) if e[2:] == ("replay",)]
    # 1 warm-up replay per backend, then 4 timed each: a barrier right before every timed one
    timed = replays[2:2 + 8]
    assert len(timed) == 8 and all(log[i - 1] == ("barrier",) for i in timed)
    assert [log[i][1] for i in timed] == ["ncclpy"] * 2 + ["cupy"] * 2 + ["cupy"] * 2 + \
        ["ncclpy"] * 2
    # every graph released before teardown
    first_teardown = next(i for i, e in enumerate(log) if e[0] == "teardown")
    releases = [i for i, e in enumerate(log) if e[0] == "release"]
    assert len(releases) == 2 + 2 * 2 and max(releases) < first_teardown
    sections = {(r["backend"], r["mode"]): r["section"] for r in doc["results"]}
    assert sections == {("ncclpy", "graph"): "graph_replay", ("cupy", "graph"): "graph_replay",
                        ("ncclpy", "capture"): "one_off", ("cupy", "capture"): "one_off"}
    assert doc["derived"] == []
