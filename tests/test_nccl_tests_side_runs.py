"""CPU tests of ``python -m bench.nccl_tests_side``'s runs, with stand-ins for the MPI launcher and
nccl-tests (tests/nccl_tests_fakes.py) beside the bench on its CPU backend (the ratios then mean
nothing, and the output says so): the whole pipeline, a program failing at every run, a hung
program stopped at its bound (and its ranks gone, even out of its process group), an
interruption that keeps what completed, a device fault after a stopped run, wrong elements
that nccl-tests reports by exiting non-zero, and the environment nccl-tests' JSON dumps."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import nccl_tests_run as R
from bench import nccl_tests_side as SD
from nccl_tests_fakes import ROOT, run_side, side_argv
from ncclpy.selftest import report as RP, runner as RN, stages as S
from sigint_util import popen_kwargs

pytestmark = pytest.mark.timeout(300)


def _gone(pids: list) -> bool:
    return not R.alive(pids)


def test_nccl_tests_failing_at_every_run_is_failed_with_its_own_words(tmp_path):
    p, doc, out = run_side(tmp_path, "--rounds", "1", "--collectives", "all_reduce",
                           "--modes", "eager", FAKE_NT_FAIL="1", FAKE_NT_VERSION="1")
    assert p.returncode == 1, p.stderr
    assert doc["status"] == "failed"           # a failure, not a missing prerequisite
    assert doc["reason"] == ("nccl-tests failed at every run; first: nccl-tests all_reduce eager "
                             "round 1: exit status 2; no JSON (FileNotFoundError): vm: Test CUDA "
                             "failure util.cu:674 'CUDA driver version is insufficient for CUDA "
                             "runtime version'")
    assert "CUDA driver version is insufficient" in p.stderr      # the end of its output
    nt = [r for r in doc["runs"] if r["tool"] == "nccl-tests"]
    assert "util.cu:674" in nt[0]["output_tail"]
    assert "```" in (out / SD.MD_NAME).read_text()
    assert doc["nccl_tests"]["version_line"] == {"version": "2.19.6", "headers": 22809,
                                                 "library": 22809}
    # the selftest's stage records it as failed, with that reason (the ledger keeps failures)
    res = _stage_verdict(doc, tmp_path)
    assert (res.status, res.reason) == ("failed", doc["reason"])


def test_a_hang_stops_that_program_in_that_mode_only_and_its_ranks_are_gone(tmp_path):
    """(``--run-timeout 12``: the cputime runs' bound is half of it, 6 s, which the CPU
    backend's real bench must fit in on a loaded 2-core machine; 2 s did not.)"""
    pids = tmp_path / "pids"
    t0 = time.monotonic()
    p, doc, _ = run_side(tmp_path, "--rounds", "2", "--collectives", "all_reduce", "--modes",
                         "eager,cputime", "--run-timeout", "12", FAKE_NT_HANG=str(pids),
                         FAKE_NT_HANG_ON="-C", FAKE_NT_SETSID="1")
    assert time.monotonic() - t0 < 150                        # not the stand-in's 120 s
    nt = {(r["round"], r["mode"]): r for r in doc["runs"] if r["tool"] == "nccl-tests"}
    assert nt[(1, "cputime")]["rc"] is None
    assert nt[(1, "cputime")]["error"].startswith("stopped at its bound")
    assert nt[(2, "eager")]["error"] == "" and nt[(2, "eager")]["rc"] == 0   # started again
    assert nt[(2, "cputime")]["error"] == ("not started: nccl-tests all_reduce cputime was "
                                           "stopped at its bound in round 1")
    assert [r["error"] for r in doc["runs"] if r["tool"] == "ncclpy"] == ["", "", "", ""]
    assert doc["status"] == "partial" and p.returncode == 1, p.stderr
    assert doc["setup"]["rounds_done"] == 2
    # the hung ranks left the launcher's process group (setsid): gone all the same, and
    # before the next run started (nothing is said to have outlived the stop)
    ranks = [int(x) for x in pids.read_text().split()]
    assert len(ranks) == 2 and _gone(ranks)
    assert "outlived" not in nt[(1, "cputime")]


def test_sigint_mid_round_keeps_the_figures_of_the_runs_that_completed(tmp_path):
    pids = tmp_path / "pids"
    p = subprocess.Popen(side_argv(tmp_path, "--rounds", "1", "--collectives", "all_reduce",
                                   "--modes", "eager,cputime"),
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                        "FAKE_NT_HANG": str(pids), "FAKE_NT_HANG_ON": "-C"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **popen_kwargs())
    deadline = time.monotonic() + 120
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    assert p.returncode == 130
    doc = json.loads((tmp_path / "out" / SD.JSON_NAME).read_text())
    assert (doc["status"], doc["reason"]) == ("interrupted", "SIGINT during the runs")
    runs = [(r["mode"], r["tool"], r["error"]) for r in doc["runs"]]
    assert runs == [("eager", "nccl-tests", ""), ("eager", "ncclpy", ""),
                    ("cputime", "nccl-tests", "interrupted")]
    eager = doc["collectives"]["all_reduce"]["rows"]["eager"]
    assert [r["size"] for r in eager] == [8, 16, 32, 64]
    assert all(r["nt_time"] and r["nc_time"] and r["rounds"] == 1 for r in eager)
    assert "| 64 B |" in doc["markdown"] and "- status: interrupted" in doc["markdown"]
    assert _gone([int(x) for x in pids.read_text().split()])   # both stand-in ranks ended


def test_a_device_fault_after_a_stopped_run_ends_the_rounds_and_names_the_stop(tmp_path):
    pids = tmp_path / "pids"
    p, doc, _ = run_side(tmp_path, "--rounds", "2", "--collectives", "all_reduce", "--modes",
                         "eager,cputime", "--run-timeout", "12", FAKE_NT_HANG=str(pids),
                         FAKE_NT_HANG_ON="-C", FAKE_NT_FAULT_AFTER=str(pids))
    assert p.returncode == 1 and doc["status"] == "failed", p.stderr
    assert doc["reason"] == (
        "device faulted after stopping nccl-tests all_reduce cputime (round 1) at its bound: "
        "vm: Test CUDA failure common.cu:1067 'an illegal memory access was encountered' (in "
        "nccl-tests all_reduce eager (round 2)'s output); no run was started after it")
    # round 2 runs ncclpy first; after nccl-tests' fault nothing more was started
    assert [(r["round"], r["mode"], r["tool"]) for r in doc["runs"]][4:] == [
        (2, "eager", "ncclpy"), (2, "eager", "nccl-tests")]
    assert doc["setup"]["rounds_done"] == 1
    assert doc["setup"]["rounds_note"] == "round 2 was cut short"


def _side_obj(tmp_path: Path) -> SD.Side:
    ns = SimpleNamespace(budget=100.0, nproc=2, device="cuda", rounds=2, iters=20, warmup=5,
                         check=1, graph=10, modes=["eager"], collectives=["all_reduce"],
                         minbytes="8", maxbytes="256M", small="64K", out=str(tmp_path))
    return SD.Side(ns, {})


def _rec(tool: str, rnd: int, rc, mode: str = "eager") -> dict:
    return {"round": rnd, "tool": tool, "collective": "all_reduce", "mode": mode, "rc": rc,
            "error": "" if rc == 0 else "x"}


def test_a_failure_after_a_stopped_run_is_laid_at_the_stop_not_at_the_other_program(tmp_path):
    side = _side_obj(tmp_path)
    side._watch(_rec("nccl-tests", 1, None), "")               # stopped at its bound
    assert side.halt == ""                                     # a stop alone ends nothing
    side._watch(_rec("ncclpy", 1, 0), "")
    assert side.halt == ""
    side._watch(_rec("ncclpy", 2, 1), "RuntimeError: NCCL error: unhandled cuda error\n")
    assert side.halt == ("ncclpy all_reduce eager (round 2) failed after nccl-tests all_reduce "
                         "eager (round 1) was stopped at its bound: RuntimeError: NCCL error: "
                         "unhandled cuda error; no run was started after it (a rank killed "
                         "with a kernel in flight can fault every process of the MPS server)")
    side = _side_obj(tmp_path)                                 # a fault with no stop before
    side._watch(_rec("ncclpy", 1, 1), "cudaErrorIllegalAddress: an illegal memory access was "
                                      "encountered\n")
    assert side.halt.startswith("device fault in ncclpy all_reduce eager (round 1): "
                                "cudaErrorIllegalAddress")


def test_wrong_elements_keep_the_runs_figures_and_fail_the_stage(tmp_path):
    p, doc, out = run_side(tmp_path, "--rounds", "1", "--collectives", "all_reduce",
                           "--modes", "eager", FAKE_NT_WRONG="3")
    nt = [r for r in doc["runs"] if r["tool"] == "nccl-tests"]
    assert nt[0]["rc"] == 1 and nt[0]["out_of_bounds"] == 2
    assert nt[0]["error"] == ("exit status 1: wrong elements (6 elements; 2 results out of "
                              "bounds)")
    s = doc["collectives"]["all_reduce"]["summary"]
    assert s["wrong"] == 6.0 and s["out_of_bounds"] == 2      # 3 out of place + 3 in place
    rows = doc["collectives"]["all_reduce"]["rows"]["eager"]
    assert rows[0]["nt_wrong"] == 6.0 and all(r["nt_time"] for r in rows)   # figures kept
    assert "#wrong 6 (2 results out of bounds)" in doc["markdown"]
    res = _stage_verdict(doc, tmp_path)
    assert (res.status, res.reason) == ("failed", "6 wrong elements (2 results out of bounds)")


def test_the_environment_in_a_json_is_redacted_also_when_the_file_was_cut_short(tmp_path):
    env = ["NCCL_DEBUG=INFO", "AWS_SECRET_ACCESS_KEY=s3cr3t", "HOME=/root", "NCCL_IB_KEY=k"]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"version": 3, "env": env, "nccl_version": 22809}))
    doc, why = R.redact_json(str(whole))
    assert why == "" and doc["env"] == ["NCCL_DEBUG=INFO", "NCCL_IB_KEY=<redacted>"]
    assert json.loads(whole.read_text())["env"] == doc["env"]
    cut = tmp_path / "cut.json"
    text = json.dumps({"version": 3, "env": env, "nccl_version": 22809, "results": [1, 2]})
    cut.write_text(text[:text.index('"results"') + 15])      # killed while writing results
    assert R.redact_json(str(cut)) == (None, "no JSON (JSONDecodeError)")
    assert "s3cr3t" not in cut.read_text() and "NCCL_DEBUG=INFO" in cut.read_text()
    inside = tmp_path / "inside.json"
    inside.write_text(text[:text.index("s3cr3t") + 3])       # cut inside the list itself
    R.redact_json(str(inside))
    assert inside.read_text() == '{"version": 3, '


def test_the_whole_pipeline_on_cpu_with_stand_ins_is_complete_and_flagged(tmp_path):
    (tmp_path / "lib").mkdir()                  # the stand-in launcher's MPI lib folder
    p, doc, out = run_side(tmp_path, "--rounds", "2", "--modes", "eager,graph,cputime",
                           FAKE_NT_NCCL="22809", MY_API_TOKEN="hunter2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert doc["status"] == "complete" and doc["reason"] == ""
    assert doc["setup"]["rounds_done"] == 2 and doc["setup"]["modes"] == ["eager", "cputime"]
    assert doc["comparable"] is False
    assert doc["flags"] == [
        "cpu: the bench ran on ncclpy's CPU backend; the ratios mean nothing",
        "not nccl-tests: its output has no '# nccl-tests version' line",
        "different NCCL: nccl-tests 22809, ncclpy 0"]
    runs = [(r["round"], r["collective"], r["mode"], r["tool"]) for r in doc["runs"]]
    assert len(runs) == 16 and not any(r["error"] for r in doc["runs"])
    assert runs[:2] == [(1, "all_reduce", "eager", "nccl-tests"), (1, "all_reduce", "eager",
                                                                    "ncclpy")]
    assert runs[8:10] == [(2, "all_reduce", "eager", "ncclpy"), (2, "all_reduce", "eager",
                                                                 "nccl-tests")]
    for coll in ("all_reduce", "sendrecv"):
        rows = doc["collectives"][coll]["rows"]
        assert [r["size"] for r in rows["eager"]] == [8, 16, 32, 64]
        assert [r["size"] for r in rows["cputime"]] == [8, 16, 32]
        assert all(r["nt_time"] and r["nc_time"] and r["time_ratio"] for r in rows["eager"])
        assert all(r["rounds"] == 2 for r in rows["eager"])
        assert rows["eager"][0]["nt_cpu"] == 5.0 and rows["eager"][0]["nc_cpu"] > 0
        assert doc["collectives"][coll]["summary"]["wrong"] == 0
    # what the stand-in nccl-tests saw: its device, its JSON path, and (no build.json in
    # --nccl-tests DIR) the launcher's MPI lib folder on LD_LIBRARY_PATH
    nt_doc = json.loads((out / "runs" / "r1-sendrecv-eager-nccl-tests.json").read_text())
    assert "NCCL_TESTS_DEVICE=0" in nt_doc["env"]
    assert nt_doc["args"][-2:] == ["-J", str(out / "runs" / "r1-sendrecv-eager-nccl-tests.json")]
    ld = next(e for e in nt_doc["env"] if e.startswith("LD_LIBRARY_PATH="))
    assert ld.split("=", 1)[1].split(os.pathsep)[0] == str(tmp_path / "lib")
    assert doc["nccl_tests"]["ld_library_path"] == [str(tmp_path / "lib")]
    # the whole environment nccl-tests dumps is filtered before the file is kept
    assert not [f for f in out.rglob("*.json") if "hunter2" in f.read_text()]
    bench_doc = json.loads((out / "runs" / "r2-sendrecv-cputime-ncclpy.json").read_text())
    assert "cpu_time" in bench_doc["results"][0]["out_of_place"]
    md = (out / SD.MD_NAME).read_text()
    assert md == doc["markdown"] and md in p.stdout
    assert "- NOT COMPARABLE: cpu: the bench ran on ncclpy's CPU backend" in md
    assert "#### sendrecv: host cost of issuing one call (-C 1), eager, out of place" in md
    assert "- status: complete" in md and "medians of 2 round(s) (of 2)" in md


def _stage_verdict(doc: dict, tmp_path: Path):
    """The selftest's verdict on a stage that left ``doc`` as its side-by-side JSON (its
    command exited 1)."""
    st = S.by_name("nccl-tests")
    work = tmp_path / "work"
    (work / S.prefix(st)).mkdir(parents=True)
    (work / S.prefix(st) / S.SIDE_JSON).write_text(json.dumps(doc))
    res = RP.StageResult(st.name, st.title, commands=[{"rc": 1, "shell": "x", "seconds": 1.0}])
    RN.analyse(st, res, S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp_path)))
    return res
