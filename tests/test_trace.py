"""The flight recorder, its dumps and their schema, ``ncclpy trace``'s analysis, the status
table's encoding, the ranks' agreement check and NVTX ranges (issue 23), on CPU.

Communicators run on thread-ranks over the STAND-IN for libnccl and CUDA
(tests/nccl_standin.py); the agreement check runs in real processes on a real store.  Whole
jobs (launcher, processes, signals, ``ncclpy status``) are in tests/test_forensics.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ncclpy import errors
from ncclpy.comm import Communicator
from ncclpy.debug import recorder as R
from ncclpy.debug import status as S
from ncclpy.debug.trace import analyze, load
from nccl_standin import DevArray, run_ranks, standin

UID = bytes(range(128))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "ncclpy", "debug", "trace_schema.json")


def _lines(path: str) -> list:
    with open(path) as f:
        return [json.loads(x) for x in f]


def _validate(path: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.load(open(SCHEMA))
    for d in _lines(path):
        jsonschema.validate(d, schema)


def _play(r: int, n: int, d: str, skip_last: bool = False) -> str:
    c = Communicator(n, r, UID, r)
    x = DevArray(np.ones(4, np.float32), device=r)
    c.all_reduce(x).wait()                                        # LINE A
    c.broadcast(x, root=0).wait()                                 # LINE B
    if r == 0:
        c.send(x, 1).wait()                                       # LINE C
    elif r == 1:
        c.recv(x, 0).wait()                                       # LINE D
    if not (skip_last and r == n - 1):
        a, b = DevArray(np.ones(2, np.float32), r), DevArray(np.zeros(2 * n, np.float32), r)
        w = c.all_gather(a, b)                                    # LINE E
        if not skip_last:
            w.wait()
    p = c.dump_trace(d)
    if skip_last:
        c.abort()
    else:
        c.close()
    return p


def _line(tag: str) -> int:
    with open(__file__) as f:
        return next(i for i, t in enumerate(f, 1) if t.rstrip().endswith(f"# LINE {tag}"))


def test_every_call_is_recorded_with_its_site_and_completion(tmp_path):
    with standin() as eng:
        paths = run_ranks(3, _play, 3, str(tmp_path) + "/")
    assert eng.violations == []
    head, *calls, end = _lines(paths[0])
    assert head["kind"] == "header" and head["rank"] == 0 and head["world_size"] == 3
    assert head["recorded"] == 4 and head["collectives"] == 3 and head["dropped"] == 0
    assert end == {"kind": "end", "entries": 4}
    assert [c["coll"] for c in calls] == ["all_reduce", "broadcast", "send", "all_gather"]
    assert [c["cseq"] for c in calls] == [0, 1, -1, 2]
    assert [c["state"] for c in calls] == ["completed"] * 4
    me = os.path.abspath(__file__)
    assert [c["site"] for c in calls] == [f"{me}:{_line(t)}:_play" for t in "ABCE"]
    assert calls[2]["p2p"] == [["send", 1, 4, "float32"]] and calls[2]["peer"] == 1
    assert calls[0]["op"] == "SUM" and calls[1]["root"] == 0
    assert all(c["t_issue"] <= c["t_done"] for c in calls)
    for p in paths:
        _validate(p)
    code = analyze(load([str(tmp_path)])[0])
    assert len(code) == 1 and code[0].ok and code[0].ranks == [0, 1, 2], code[0].findings


def test_the_ring_keeps_the_last_n_and_counts_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "2")
    with standin():
        paths = run_ranks(2, _play, 2, str(tmp_path) + "/")
    head, *calls, _ = _lines(paths[0])
    assert head["capacity"] == 2 and head["recorded"] == 4 and head["dropped"] == 2
    assert [c["seq"] for c in calls] == [2, 3]


def test_an_unfinished_call_and_an_abort_are_in_the_dump(tmp_path):
    with standin():
        run_ranks(3, _play, 3, str(tmp_path) + "/", True)
    reports = analyze(load([str(tmp_path)])[0])
    f = reports[0].findings[0]
    assert f.kind == "never_issued" and f.ranks == [2], f
    assert "collective #2 (all_gather" in f.lines[0]
    assert any("rank 2 never issued it; its last call: #1 broadcast" in ln and
               f"test_trace.py:{_line('B')}:_play" in ln for ln in f.lines), f.lines


def test_buffer_0_is_off_and_bad_settings_fail_before_nccl(monkeypatch):
    monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "0")
    with standin():
        c = Communicator(1, 0, UID, 0)
        assert c._recorder is None
        with pytest.raises(errors.NcclpyError, match="flight recorder of communicator "
                                                     "'default' is off"):
            c.dump_trace()
        c.close()
    for var, val, msg in (("NCCLPY_TRACE_BUFFER", "lots", "expected a number of calls"),
                          ("NCCLPY_TRACE_SIGNAL", "SIGNOPE", "expected a signal name"),
                          ("NCCLPY_NVTX", "maybe", "expected 1/0")):
        monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "10")
        monkeypatch.setenv(var, val)
        with standin() as eng:
            with pytest.raises(errors.ArgumentError, match=f"{var}: {msg}"):
                Communicator(1, 0, UID, 0)
            assert not [x for x in eng.calls if "Init" in x[0]], eng.calls
        monkeypatch.delenv(var)


def test_dump_trace_names_a_bad_path(tmp_path):
    with standin():
        c = Communicator(1, 0, UID, 0)
        with pytest.raises(errors.ArgumentError, match="dump_trace: path .*cannot write"):
            c.dump_trace(str(tmp_path / "no" / "such" / "file.jsonl"))
        with pytest.raises(errors.ArgumentTypeError, match="dump_trace: path: expected"):
            c.dump_trace(3)
        p = c.dump_trace(str(tmp_path / "one.jsonl"))
        assert p == str(tmp_path / "one.jsonl") and _lines(p)[0]["reason"] == \
            "comm.dump_trace()"
        c.close()


def test_a_wait_timeout_dumps_and_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLPY_TRACE_DIR", str(tmp_path))

    def body(r: int, n: int):
        c = Communicator(n, r, UID, r)
        if r == 0:            # rank 1 never joins the all_reduce
            x = DevArray(np.ones(4, np.float32), device=r)
            with pytest.raises(errors.NcclTimeoutError) as ei:
                c.all_reduce(x).wait(timeout=0.3)
            c.abort()
            return str(ei.value)
        c.abort()
        return ""
    with standin():
        msg = run_ranks(2, body, 2)[0]
    path = msg.split("flight-recorder dump: ")[1].split()[0]
    assert os.path.dirname(path) == str(tmp_path) and os.path.exists(path), msg
    head, call, _ = _lines(path)
    assert head["reason"] == "Work.wait timeout (all_reduce)" and call["state"] == "issued"


def test_the_dump_signal_dumps_every_live_recorder(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLPY_TRACE_DIR", str(tmp_path))
    old = signal.getsignal(signal.SIGUSR1)
    try:
        with standin():
            c = Communicator(1, 0, bytes(range(1, 129)), 0)   # a dump file of its own
            assert R.installed_signal() == signal.SIGUSR1
            c.all_reduce(DevArray(np.ones(2, np.float32), device=0)).wait()
            os.kill(os.getpid(), signal.SIGUSR1)
            mine = tmp_path / R.dump_file_name(c.name, c._recorder.comm_id, 0)
            head = _lines(str(mine))[0]
            c.close()
            assert c._recorder not in R._live         # closed: no more dumps of it
        assert head["reason"] == "signal SIGUSR1" and head["recorded"] == 1
    finally:
        signal.signal(signal.SIGUSR1, old)
        R._signal_installed = None


def test_nvtx_ranges_name_each_call(monkeypatch):
    monkeypatch.setenv("NCCLPY_NVTX", "1")
    monkeypatch.setenv("NCCLPY_TRACE_BUFFER", "0")
    with standin():
        c = Communicator(1, 0, UID, 0)
        assert c._recorder is not None and c._recorder.capacity == 0
        got = []
        c._recorder.nvtx = type(c._recorder.nvtx)(got.append, lambda: got.append("pop"))
        c.all_reduce(DevArray(np.ones(4, np.float32), device=0)).wait()
        c.close()
    assert got == ["ncclpy all_reduce #0 float32 16B", "pop"]


def test_trace_reads_a_cut_short_dump_and_marks_differing_fields(tmp_path):
    def call(seq, coll="all_reduce", count=8, root=None, state="issued"):
        return {"kind": "call", "seq": seq, "cseq": seq, "coll": coll, "nccl": "AllReduce"
                if coll == "all_reduce" else "Broadcast", "count": count, "dtype": "float32",
                "op": "SUM" if coll == "all_reduce" else None, "root": root,
                "in_place": True, "p2p": [], "site": f"job.py:{10 + seq}:main",
                "t_issue": 1.0, "t_done": None, "state": state}
    for r in range(3):
        head = {"kind": "header", "schema": R.SCHEMA, "comm": "c", "comm_id": "ab", "rank": r,
                "world_size": 3, "time": 2.0}
        calls = [call(0, state="completed"), call(1, count=9 if r == 1 else 8)]
        text = "\n".join(json.dumps(x) for x in [head] + calls)
        if r == 2:
            text += '\n{"kind": "call", "seq": 2, "co'     # cut short mid-line
        else:
            text += '\n{"kind": "end", "entries": 2}\n'
        (tmp_path / f"ncclpy-trace-c-ab-rank{r}.jsonl").write_text(text)
    rep = analyze(load([str(tmp_path)])[0])[0]
    kinds = [f.kind for f in rep.findings]
    assert kinds == ["truncated", "differs"], rep.findings
    assert "line 4 is cut short" in rep.findings[0].lines[0]
    diff = rep.findings[1]
    assert diff.ranks == [1] and "(in count)" in diff.lines[0]
    assert any("*count=9*" in ln and "job.py:11:main" in ln for ln in diff.lines), diff.lines


def test_status_values_round_trip_and_laggards_come_first():
    p = S.Progress(7, 12, 10, 3.25, 10, "all_reduce", "x.py:3:f")
    assert S.decode(S.encode(p)) == p
    assert S.decode(b"5:9") == S.Progress(beat=5, issued=9)
    long = S.Progress(1, 1, 1, 0, 0, "a", "/" + "d" * 400 + ":1:f")
    assert len(S.decode(S.encode(long)).site) == 160
    rows = [S.RankRow(0, 0.4, False, S.Progress(3, 5, 5)),
            S.RankRow(1, 0.4, False, S.Progress(3, 4, 3, 9.0, 0, "all_reduce", "a.py:1:m")),
            S.RankRow(2, None, False, S.Progress()),
            S.RankRow(3, 0.1, True, S.Progress(3, 5, 5))]
    lines = S.format_rows({"comm": "c", "world": 4}, rows)
    assert [ln.split()[0] for ln in lines[2:]] == ["2", "1", "0", "3"], lines
    assert "never" in lines[2] and "9.0s" in lines[3] and "#3 all_reduce at a.py:1:m" in \
        lines[3] and "closed" in lines[5]



def test_a_rank_blocked_inside_nccl_is_shown_blocked_with_its_call_and_line():
    """A call still inside its NCCL launch (a send whose recv never came) has no Work yet: the
    table shows it as the next call, BLOCKED, with how long; the value round-trips."""
    p = S.Progress(4, 2, 2, 6.5, 0, "send", "job.py:57:play", blocked=True)
    assert S.encode(p).split(b":")[6] == b"!send" and S.decode(S.encode(p)) == p
    assert S.decode(S.encode(S.Progress(call="send"))).blocked is False
    rows = [S.RankRow(0, 0.2, False, p), S.RankRow(1, 0.2, False, S.Progress(4, 2, 2))]
    line = S.format_rows({"comm": "c", "world": 2}, rows)[2:]
    blocked = next(ln for ln in line if ln.split()[0] == "0")
    assert blocked.split()[1:4] == ["2", "2", "6.5s"], blocked
    assert blocked.endswith("#2 send BLOCKED inside NCCL on the host at job.py:57:play"), blocked
    assert S.RankRow(0, 0.2, False, p).to_json()["blocked"] is True


def test_status_lists_silent_ranks_published_verdicts_and_blind_or_refused_watchdogs():
    """Read from a real table: a rank silent past the communicator's limit is listed (no one
    acts on it unless a call waits on it), a rank that aborted shows its published verdict, and
    a watchdog's failed ticks, refused and late heartbeats are shown; the value round-trips."""
    from ncclpy.debug.verdicts import Published
    from ncclpy.store import StoreServer, TCPStore
    from ncclpy.store import tablewire as W
    p = S.Progress(7, 3, 3, late=2, refused=1, blind=4, call="all_reduce", site="a.py:1:m")
    assert S.decode(S.encode(p)) == p
    srv = StoreServer("127.0.0.1", 0).start()
    try:
        c = TCPStore("127.0.0.1", srv.port, timeout=5)
        S.register(c, "c", "g", 3, silence=0.5)
        c.beat("g", 0, 3, 1.0, S.encode(p))
        c.beat("g", 1, 3, 1.0, S.encode(S.Progress(7, 3, 3)))
        verdict = Published(2, "peer_silent", (1,), "no heartbeat for more than 3 s")
        c.beat("g", 2, 3, 1.0, S.encode(S.Progress(7, 3, 2)) + b"\n" + verdict.encode(),
               flags=W.BEAT_CLOSE | W.BEAT_ABORT)
        time.sleep(1.2)
        c.beat("g", 0, 3, 1.0, S.encode(p))
        (snap,) = S.snapshot(c)
    finally:
        srv.close()
    rows = {r.rank: r for r in snap["rows"]}
    assert rows[2].aborted == ("peer_silent: no heartbeat for more than 3 s (suspected: "
                               "rank(s) 1)") and rows[2].closed and rows[2].progress.done == 2
    text = S.format_snapshot([snap])
    # rank 1's age is 1.2 s or more (more on a loaded machine); rank 0 beat just before
    assert re.search(r"silent for more than 0\.5 s: rank 1 \(\d+\.\d s\)", text), text
    assert "rank 0 (" not in text
    assert "rank 2 aborted: peer_silent: no heartbeat for more than 3 s" in text
    assert ("rank 0's watchdog: 4 tick(s) failed (blind meanwhile), 1 heartbeat(s) refused by "
            "the store, 2 heartbeat(s) late (store slow)") in text
    row2 = next(ln for ln in text.splitlines() if ln.split()[:1] == ["2"])
    assert "aborted" in row2.split()


AGREE = r"""
import json, os, sys
from ncclpy.store import TCPStore
from ncclpy.debug.agree import check_agreement
rank, port = int(sys.argv[1]), int(sys.argv[2])
s = TCPStore("127.0.0.1", port, timeout=30)
try:
    cmp = check_agreement(s, rank, 3, "t/agree", 20.0)
    print(json.dumps({"ok": True, "notes": cmp.notes}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "msg": str(e)}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("var,val,fatal", [("NCCL_PROTO", "Simple", True),
                                           ("NCCL_P2P_DISABLE", "1", True),
                                           ("NCCL_DEBUG", "INFO", False)])
def test_the_ranks_agree_on_what_they_run(var, val, fatal):
    from ncclpy.store import StoreServer
    srv = StoreServer("127.0.0.1", 0).start()
    try:
        ps = []
        for r in range(3):
            env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
            env.update(PYTHONPATH=ROOT)
            env.pop("NCCLPY_STORE_TOKEN", None)
            if r == 1:
                env[var] = val
            ps.append(subprocess.Popen([sys.executable, "-c", AGREE, str(r), str(srv.port)],
                                       env=env, stdout=subprocess.PIPE, text=True))
        # the last line: NCCL_DEBUG=INFO makes NCCL log to stdout (its parameter API too)
        outs = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in ps]
        served = srv.served
    finally:
        srv.close()
    for o in outs:
        if fatal:
            assert o.get("error") == "EnvironmentMismatchError", o
            assert f'env {var}: ranks 0, 2: (unset); rank 1: "{val}"' in o["msg"], o
        else:
            # the variable, and NCCL's own value of the parameter (its parameter API)
            assert o["ok"] and o["notes"][0] == f'env {var}: ranks 0, 2: (unset); rank 1: ' \
                                                f'"{val}"', o
            assert o["notes"][1:] == [f'param {var}: ranks 0, 2: "<unknown>"; rank 1: '
                                      f'"{val}"'], o
    assert served < 60, served          # O(N): two votes, then N sets, N gets, one report


def test_agreeing_ranks_cost_two_votes_each():
    import threading
    from ncclpy.debug.agree import check_agreement
    from ncclpy.store import StoreServer, TCPStore
    srv = StoreServer("127.0.0.1", 0).start()
    try:
        before = srv.served
        stores = [TCPStore("127.0.0.1", srv.port, timeout=10) for _ in range(4)]
        ts = [threading.Thread(target=check_agreement, args=(stores[r], r, 4, "a", 10.0))
              for r in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert srv.served - before == 2 * 4 and srv.num_keys == 0
    finally:
        srv.close()


@pytest.mark.timeout(120)
def test_info_all_ranks_prints_the_comparison_on_rank_0():
    from ncclpy.rendezvous import free_port
    port = free_port()
    ps = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("NCCL_", "NCCLPY_", "MASTER_"))}
        env.update(PYTHONPATH=ROOT, NCCLPY_RANK=str(r), NCCLPY_WORLD_SIZE="2",
                   NCCLPY_MASTER_ADDR="127.0.0.1", NCCLPY_MASTER_PORT=str(port))
        if r == 1:
            env["NCCL_ALGO"] = "Ring"
        ps.append(subprocess.Popen([sys.executable, "-m", "ncclpy", "info", "--all-ranks"],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True))
    outs = [p.communicate(timeout=90) for p in ps]
    assert [p.returncode for p in ps] == [1, 1], outs
    assert outs[0][0].splitlines()[:3] == [
        "ncclpy info --all-ranks: 2 ranks compared",
        "the ranks differ in what changes NCCL's behaviour (1):",
        '  - env NCCL_ALGO: rank 0: (unset); rank 1: "Ring"'], outs[0]
    assert outs[1][0] == "", outs[1]
    ok = subprocess.run([sys.executable, "-m", "ncclpy", "run", "-n", "2", "-m", "ncclpy",
                         "info", "--all-ranks"], env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=90)
    assert ok.returncode == 0 and "[rank 0] all 2 ranks run the same NCCL with the same " \
        "settings" in ok.stdout, (ok.stdout, ok.stderr)


def test_nvtx_asked_for_but_missing_is_refused_before_nccl(monkeypatch):
    import cupy.cuda
    monkeypatch.setenv("NCCLPY_NVTX", "1")
    monkeypatch.setitem(sys.modules, "cupy.cuda.nvtx", None)
    monkeypatch.delattr(cupy.cuda, "nvtx", raising=False)
    with standin() as eng:
        with pytest.raises(errors.UnsupportedError, match="NCCLPY_NVTX=1: NVTX ranges need "
                                                          "CuPy's NVTX binding"):
            Communicator(1, 0, UID, 0)
        assert not [x for x in eng.calls if "Init" in x[0]], eng.calls
