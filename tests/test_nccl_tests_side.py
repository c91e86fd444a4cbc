"""CPU tests of ``python -m bench.nccl_tests_side`` (nccl-tests 2.19.6 beside ncclpy's bench):
reading both programs' JSON (nccl-tests' own writer's fixture, a real bench run), medians over
rounds, ratios and verdicts at the sizes each target covers (a single round, a size without a
figure), the Markdown tables, the command lines, and the reasons it could not run.  The runs
themselves, with stand-ins for MPI and nccl-tests: tests/test_nccl_tests_side_runs.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import nccl_tests_build as B
from bench import nccl_tests_compare as C
from bench import nccl_tests_side as SD
from nccl_tests_fakes import fake_programs

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "nccl_tests_2.19.6" / "all_reduce_perf.json"
MiB, KiB = 1 << 20, 1 << 10


def _rec(size: int, time: float, busbw: float, key: str = "time", wrong=0.0) -> dict:
    side = {key: time, "alg_bw": busbw, "bus_bw": busbw, "nwrong": wrong}
    return {"size": size, "count": size // 4, "type": "float", "redop": "sum",
            "root": "    -1", "out_of_place": side, "in_place": dict(side),
            "actual_iterations": 20, "experiment_name": ""}


# -- reading ---------------------------------------------------------------------------------

def test_nccl_tests_own_json_is_read_through_results():
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE} (written by nccl-tests 2.19.6's util.cu) is not in this tree")
    doc = json.loads(FIXTURE.read_text())
    rows = C.parse_results(doc)
    assert sorted(rows) == [r["size"] for r in doc["results"]]
    first = doc["results"][0]
    assert rows[first["size"]]["time"] == first["out_of_place"]["time"]
    assert rows[first["size"]]["bus_bw"] == first["out_of_place"]["bus_bw"]
    assert rows[first["size"]]["cpu_time"] is None


def test_cpu_time_nan_and_broken_records_are_read_as_nccl_tests_writes_them():
    doc = {"results": [_rec(8, 5.5, 0.001, key="cpu_time"),
                       {"size": 16, "out_of_place": {"time": "nan", "alg_bw": "nan",
                                                     "bus_bw": "nan", "nwrong": None}},
                       _rec(8, 99.0, 9.0),          # a second series' row of 8 B: ignored
                       {"size": "x"}, {"out_of_place": {}}, "junk"]}
    rows = C.parse_results(doc)
    assert sorted(rows) == [8, 16]
    assert rows[8]["cpu_time"] == 5.5 and rows[8]["time"] is None and rows[8]["bus_bw"] == 0.001
    assert rows[16]["time"] is None and rows[16]["bus_bw"] is None
    assert C.parse_results({"results": "no"}) == {} == C.parse_results(None)


def test_medians_over_rounds_with_spread_and_summed_wrong_elements():
    r1 = C.parse_results({"results": [_rec(8, 10.0, 1.0), _rec(16, 20.0, 2.0, wrong=1.0)]})
    r2 = C.parse_results({"results": [_rec(8, 12.0, 3.0)]})
    r3 = C.parse_results({"results": [_rec(8, 30.0, 2.0), _rec(16, 22.0, 4.0)]})
    m = C.medians([r1, r2, r3])
    assert m[8]["time"] == 12.0 and m[8]["bus_bw"] == 2.0 and m[8]["n"] == 3
    assert m[8]["spread"] == pytest.approx(2.0)                # 30 / 10 - 1
    # 1 wrong element out of place and 1 in place (_rec puts it on both sides)
    assert m[16]["n"] == 2 and m[16]["time"] == 21.0 and m[16]["nwrong"] == 2.0


def test_wrong_elements_in_place_only_and_out_of_bounds_are_counted():
    rec = _rec(8, 10.0, 1.0)
    rec["in_place"]["nwrong"] = 5.0                            # out of place is clean
    rows = C.parse_results({"results": [rec]})
    assert rows[8]["nwrong"] == 0.0 and rows[8]["ip_nwrong"] == 5.0
    assert C.medians([rows])[8]["nwrong"] == 5.0               # never 0 when found in place
    s = C.summarise({"eager": C.compare(C.medians([rows]), C.medians([rows]), "eager")})
    assert s["wrong"] == 10.0                                  # both programs' rows
    assert C.out_of_bounds({"out_of_bounds": {"count": 3, "okay": False}}) == 3
    assert C.out_of_bounds({"results": []}) is None and C.out_of_bounds(None) is None


# -- verdicts --------------------------------------------------------------------------------

def _med(rows: dict, rounds: int = 2) -> dict:
    """Medians of ``rounds`` identical rounds (2: a spread of 0; 1: no spread at all)."""
    one = C.parse_results({"results": [_rec(s, t, b) for s, (t, b) in rows.items()]})
    return C.medians([one] * rounds)


def test_busbw_target_covers_1_MiB_and_up_in_eager_mode_within_3_percent():
    nt = _med({512 * KiB: (50.0, 10.0), MiB: (100.0, 10.0), 2 * MiB: (200.0, 10.0),
               4 * MiB: (400.0, 10.0)})
    nc = _med({512 * KiB: (80.0, 5.0), MiB: (103.0, 9.7), 2 * MiB: (210.0, 9.69),
               4 * MiB: (380.0, 10.5)})
    rows = {r["size"]: r for r in C.compare(nt, nc, "eager")}
    assert rows[512 * KiB]["target"] == "" and rows[512 * KiB]["verdict"] == ""
    assert rows[MiB]["verdict"] == "within 3%" and rows[MiB]["busbw_ratio"] == pytest.approx(0.97)
    assert rows[2 * MiB]["verdict"] == "OUTSIDE 3%" and rows[2 * MiB]["why"] == "busbw -3.1%"
    assert rows[4 * MiB]["verdict"] == "OUTSIDE 3%"           # faster by 5% is outside too
    s = C.summarise({"eager": list(rows.values())})
    assert s["busbw"] == {"sizes": 3, "met": 1, "measured": 3, "worst": pytest.approx(1.05),
                          "verdict": "missed", "rounds": 2, "nt_spread": 0.0}
    assert s["graph_latency"]["verdict"] == "not measured" and s["wrong"] == 0.0


def test_a_ratio_outside_its_band_from_one_round_is_not_a_verdict():
    nt = _med({MiB: (100.0, 10.0), 2 * MiB: (200.0, 10.0)}, rounds=1)
    nc = _med({MiB: (103.0, 9.9), 2 * MiB: (250.0, 8.0)}, rounds=1)
    rows = {r["size"]: r for r in C.compare(nt, nc, "eager")}
    assert rows[MiB]["verdict"] == "within 3%"                 # within stays within
    assert rows[2 * MiB]["verdict"] == "single round: not interpretable"
    assert rows[2 * MiB]["why"] == "busbw -20.0%, outside 3%; one round has no spread"
    s = C.summarise({"eager": list(rows.values())})["busbw"]
    assert s["verdict"] == "single round: not interpretable (1 of 2 sizes within)"
    assert s["rounds"] == 1 and s["nt_spread"] is None
    g = C.compare(_med({8: (20.0, 0.0)}, 1), _med({8: (30.0, 0.0)}, 1), "graph")
    assert g[0]["verdict"] == "single round: not interpretable"
    doc = {"date": "d", "status": "complete", "setup": {
        "nproc": 2, "device": "cuda", "rounds_done": 1, "rounds_planned": 2, "iters": 20,
        "warmup": 5, "check": 1, "graph": 10, "order": "o"},
        "collectives": {"all_reduce": {"rows": {"eager": list(rows.values())},
                                       "summary": C.summarise({"eager": list(rows.values())})}}}
    md = C.render(doc, "2.19.6")
    assert "medians of 1 round(s) (of 2) per size (fewer than 2: the spread over the rounds is " \
           "unknown, and a ratio outside its band is not a verdict)" in md
    assert "worst ratio 0.800; spread unknown: a single round)" in md


def test_a_covered_size_without_a_figure_is_incomplete_never_missed():
    nt = _med({MiB: (100.0, 10.0), 2 * MiB: (200.0, 10.0)})
    nc = _med({MiB: (130.0, 7.0)})                             # 2 MiB never measured
    rows = C.compare(nt, nc, "eager")
    s = C.summarise({"eager": rows})["busbw"]
    assert s["verdict"] == "incomplete (1 of 2 sizes measured)" and s["met"] == 0
    # a planned size neither program reached counts too
    plan = {"eager": C.planned_sizes("512K", "4M")}
    assert plan["eager"] == [512 * KiB, MiB, 2 * MiB, 4 * MiB]
    full = C.compare(nt, _med({MiB: (100.0, 10.0), 2 * MiB: (200.0, 10.0)}), "eager")
    assert C.summarise({"eager": full})["busbw"]["verdict"] == "met"
    assert C.summarise({"eager": full}, plan)["busbw"]["verdict"] == \
        "incomplete (2 of 3 sizes measured)"
    assert C.size_bytes("256M") == 256 * MiB and C.size_bytes("8") == 8


def test_latency_target_covers_64_KiB_and_down_in_graph_mode_within_5_percent():
    nt = _med({8: (20.0, 0.0004), 64 * KiB: (40.0, 1.6), 128 * KiB: (50.0, 2.6)})
    nc = _med({8: (20.9, 0.0004), 64 * KiB: (42.4, 1.5), 128 * KiB: (80.0, 1.6)})
    rows = {r["size"]: r for r in C.compare(nt, nc, "graph")}
    assert (rows[8]["target"], rows[8]["verdict"]) == ("latency", "within 5%")
    assert rows[64 * KiB]["verdict"] == "OUTSIDE 5%" and rows[64 * KiB]["why"] == "time +6.0%"
    assert rows[128 * KiB]["target"] == ""
    s = C.summarise({"graph": list(rows.values())})
    assert s["graph_latency"]["met"] == 1 and s["graph_latency"]["sizes"] == 2
    assert s["graph_latency"]["verdict"] == "missed"


@pytest.mark.parametrize("times,cpus,verdict,words", [
    ((20.0, 20.8), (6.0, 19.0), "same", "+4.0%: within 5%"),
    ((20.0, 28.0), (6.0, 27.0), "host cost", "host-bound (issuing is 96%"),
    ((20.0, 28.0), (6.0, 8.0), "not host cost", "the gap is on the GPU's side"),
    ((20.0, 28.0), (6.0, 26.0), "host cost", "covers the gap"),
    ((20.0, 30.0), (21.0, 28.0), "not host cost", "covers only part of the gap"),
    ((20.0, 15.0), (6.0, 6.0), "not host cost", "ncclpy is faster"),
    ((20.0, 28.0), (None, 6.0), "no figure", "no host cost measured (-C 1)"),
    ((None, 28.0), (6.0, 6.0), "no figure", "a time is missing"),
])
def test_eager_latency_differences_are_explained_by_the_host_cost_or_said_not_to_be(
        times, cpus, verdict, words):
    v, why = C.explain_eager(times[0], times[1], cpus[0], cpus[1])
    assert v == verdict and words in why


def test_compare_puts_the_host_cost_beside_eager_rows_and_markdown_shows_each_mode():
    nt = _med({8: (20.0, 0.0004), 2 * MiB: (200.0, 10.0)})
    nc = _med({8: (28.0, 0.0003), 2 * MiB: (201.0, 9.95)})
    host = (C.medians([C.parse_results({"results": [_rec(8, 6.0, 0.0, "cpu_time")]})]),
            C.medians([C.parse_results({"results": [_rec(8, 27.0, 0.0, "cpu_time")]})]))
    eager = C.compare(nt, nc, "eager", host)
    assert eager[0]["nt_cpu"] == 6.0 and eager[0]["nc_cpu"] == 27.0
    assert eager[0]["verdict"] == "host cost" and eager[1]["verdict"] == "within 3%"
    cpu = C.compare(host[0], host[1], "cputime")
    md = C.markdown("all_reduce", {"eager": eager, "cputime": cpu})
    assert "#### all_reduce: per call (eager), out of place: busbw within 3% at >= 1 MiB" in md
    assert ("| 2 MiB | 200.00 | 201.00 | 1.005 | 10.00 | 9.95 | 0.995 | within 3%: busbw "
            "-0.5% |") in md
    assert "| 8 B | 6.00 | 27.00 | 4.500 | +21.00 |" in md
    assert "graph" not in md                                  # no rows, no table


# -- command lines ---------------------------------------------------------------------------

def test_both_programs_get_the_same_flags_per_mode():
    kw = dict(minbytes="8", maxbytes="256M", small="64K", iters=20, warmup=5, check=1, graph=10)
    assert SD.mode_args("eager", **kw) == ["-b", "8", "-e", "256M", "-f", "2", "-n", "20", "-w",
                                           "5", "-c", "1"]
    assert SD.mode_args("graph", **kw)[-4:] == ["-c", "0", "-G", "10"]
    assert SD.mode_args("graph", **kw)[3] == "64K"
    assert SD.mode_args("cputime", **kw)[-4:] == ["-c", "0", "-C", "1"]
    args = SD.mode_args("graph", **kw)
    nt = SD.nccl_tests_argv("/m/mpiexec", "/b/all_reduce_perf", args, "/o/x.json",
                            [{"NCCL_TESTS_DEVICE": "0", "NCCL_HOSTID": "a"},
                             {"NCCL_TESTS_DEVICE": "0", "NCCL_HOSTID": "b"}])
    block = ["/b/all_reduce_perf", *args, "-J", "/o/x.json"]
    assert nt == ["/m/mpiexec", "-n", "1", "env", "NCCL_HOSTID=a", "NCCL_TESTS_DEVICE=0", *block,
                  ":", "-n", "1", "env", "NCCL_HOSTID=b", "NCCL_TESTS_DEVICE=0", *block]
    nc = SD.bench_argv("py", "send_recv", args, "/o/y.json", nproc=2, device="cuda")
    assert nc == ["py", "-m", "bench", "send_recv", "--backend", "ncclpy", "--device", "cuda",
                  "--nproc", "2", *args, "-J", "/o/y.json"]
    assert SD.COLLECTIVES == {"all_reduce": ("all_reduce_perf", "all_reduce"),
                              "sendrecv": ("sendrecv_perf", "send_recv")}


def test_each_rank_of_nccl_tests_gets_ncclpys_placement_on_one_gpu(monkeypatch):
    from ncclpy.launch import placement
    monkeypatch.setattr(placement, "visible_gpu_count", lambda env=None: 1)
    monkeypatch.setattr(placement, "loaded_nccl_version", lambda: 22809)
    per, _, line = SD.ranks_env(2, "cuda", {"PATH": os.environ.get("PATH", "")})
    assert [e["NCCL_TESTS_DEVICE"] for e in per] == ["0", "0"]
    assert per[0]["NCCL_HOSTID"] != per[1]["NCCL_HOSTID"]     # NCCL 2.28: hostid-socket
    assert {e["NCCL_NET"] for e in per} == {"Socket"} and "2 ranks" in line
    assert line.startswith("both programs: placement: ")     # placement.summary_line's form
    monkeypatch.setattr(placement, "loaded_nccl_version", lambda: 23203)
    per, _, _ = SD.ranks_env(2, "cuda", {"PATH": ""})
    assert {e["NCCL_MULTI_RANK_GPU_ENABLE"] for e in per} == {"1"}
    assert SD.ranks_env(2, "cpu", {})[0] == [{"NCCL_TESTS_DEVICE": "0"}] * 2


def test_the_nccl_tests_version_line_is_read_from_its_output():
    text = "x\n# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library=22809\n# Coll"
    assert C.version_line(text) == {"version": "2.19.6", "headers": 22809, "library": 22809}
    assert C.version_line("no header") is None


# -- could not run ---------------------------------------------------------------------------

@pytest.mark.parametrize("args,msg", [
    (["--collectives", "allreduce"], "--collectives: expected all_reduce and/or sendrecv, got "
                                     "allreduce"),
    (["--modes", "eager,lazy"], "--modes: expected eager, graph and/or cputime, got lazy"),
    (["--budget", "-1"], "--budget: expected seconds > 0, got -1.0"),
    (["--rounds", "0"], "--rounds: expected a number of rounds >= 1, got 0"),
    (["-e", "1GB"], "-e: expected a size in bytes such as 8, 64K or 256M, got '1GB'"),
])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, args, msg):
    assert SD.main(["--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err


def _not_run(tmp_path: Path, capsys, *args: str, env=None) -> tuple:
    out = tmp_path / "out"
    old = dict(os.environ)
    try:
        os.environ.update(env or {})
        rc = SD.main(["--out", str(out), "--device", "cpu", "--rounds", "1", *args])
    finally:
        os.environ.clear()
        os.environ.update(old)
    doc = json.loads((out / SD.JSON_NAME).read_text())
    return rc, doc, capsys.readouterr().err, (out / SD.MD_NAME).read_text()


def test_no_carried_source_is_not_run_with_how_to_prepare_it(tmp_path, capsys):
    rc, doc, err, md = _not_run(tmp_path, capsys, "--carry", str(tmp_path / "none"))
    assert rc == 3 and doc["status"] == "not run" and not doc["runs"]
    assert doc["reason"].startswith(f"no carry folder {tmp_path / 'none'}: prepare it on a "
                                    f"machine with network (python -m bench.nccl_tests_build "
                                    f"prepare")
    assert err.startswith("python -m bench.nccl_tests_side: not run: no carry folder")
    assert "- status: not run (no carry folder" in md


def test_missing_programs_or_launcher_are_not_run(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, doc, _, _ = _not_run(tmp_path, capsys, "--nccl-tests", str(empty))
    assert rc == 3 and doc["reason"] == (f"--nccl-tests {empty}: no executable "
                                         f"all_reduce_perf, sendrecv_perf")
    nt = fake_programs(tmp_path)
    rc, doc, _, _ = _not_run(tmp_path, capsys, "--nccl-tests", str(nt),
                             env={"PATH": str(tmp_path / "nowhere")})
    assert rc == 3 and doc["reason"].startswith("no MPI launcher: the build names none")


def test_no_usable_gpu_is_not_run_with_the_probes_reason(tmp_path, capsys):
    py = tmp_path / "py"
    py.write_text("#!/bin/sh\necho 'GPU-REASON:CUDARuntimeError: no CUDA driver'\n")
    py.chmod(0o755)
    out = tmp_path / "out"
    assert SD.main(["--out", str(out), "--python", str(py), "--carry", str(tmp_path)]) == 3
    doc = json.loads((out / SD.JSON_NAME).read_text())
    assert (doc["status"], doc["reason"]) == ("not run", "no usable CUDA GPU here: "
                                                         "CUDARuntimeError: no CUDA driver")
    assert "not run: no usable CUDA GPU here" in capsys.readouterr().err


def test_a_failed_build_is_a_failure_not_a_missing_prerequisite(tmp_path, capsys, monkeypatch):
    def build(*a, **k):
        raise B.BuildFailed("building nccl-tests v2.19.6 failed (exit 2); the end of "
                            "build.log:\nnvcc fatal : Unsupported gpu architecture")
    monkeypatch.setattr(B, "build", build)
    rc, doc, err, md = _not_run(tmp_path, capsys)
    assert rc == 1 and doc["status"] == "failed" and not doc["runs"]
    assert doc["reason"].startswith("building nccl-tests v2.19.6 failed (exit 2)")
    assert "failed: building nccl-tests" in err and "- status: failed (building" in md


def test_a_comparison_is_comparable_only_on_cuda_with_nccl_tests_2_19_6_and_one_nccl():
    from types import SimpleNamespace
    ns = SimpleNamespace(budget=10.0, nproc=2, device="cuda", rounds=1, iters=20, warmup=5,
                         check=1, graph=10, modes=["eager"], collectives=["all_reduce"],
                         minbytes="8", maxbytes="256M", small="64K", out="/nonexistent")
    side = SD.Side(ns, {})
    side.doc["nccl_tests"]["version_line"] = {"version": "2.19.6", "headers": 22809,
                                              "library": 22809}
    side.runs += [{"tool": "nccl-tests", "nccl_version": 22809},
                  {"tool": "ncclpy", "nccl_version": 22809}]
    side._flags()
    assert side.doc["comparable"] is True and side.doc["flags"] == []
    side.runs.append({"tool": "ncclpy", "nccl_version": 23203})
    side.doc["nccl_tests"]["version_line"]["version"] = "2.19.5"
    side._flags()
    assert side.doc["flags"] == ["nccl-tests 2.19.5, not 2.19.6",
                                 "different NCCL: nccl-tests 22809, ncclpy 23203"]
    assert side.doc["comparable"] is False


def test_programs_built_elsewhere_get_the_mpi_and_nccl_library_folders(tmp_path):
    from bench import nccl_tests_run as R
    (tmp_path / "mpi" / "bin").mkdir(parents=True)
    (tmp_path / "mpi" / "lib").mkdir()
    mpiexec = tmp_path / "mpi" / "bin" / "mpiexec"
    mpiexec.write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mpirun").symlink_to(mpiexec)          # found through the link
    assert R.library_dirs(str(tmp_path / "bin" / "mpirun"), "cpu", "py", {}) == \
        [str(tmp_path / "mpi" / "lib")]
    py = tmp_path / "py"
    py.write_text("#!/bin/sh\necho '{\"path\": \"/w/nvidia/nccl/lib/libnccl.so.2\", "
                  "\"version\": 22809}'\n")
    py.chmod(0o755)
    env = {"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path / "none")}
    got = R.library_dirs(str(mpiexec), "cuda", str(py), env)
    assert got[:2] == [str(tmp_path / "mpi" / "lib"), "/w/nvidia/nccl/lib"]
    py.write_text("#!/bin/sh\necho 'MissingDependencyError: no CuPy' >&2\nexit 1\n")
    with pytest.raises(B.NotRunnable, match="ncclpy cannot load libnccl here"):
        R.library_dirs(str(mpiexec), "cuda", str(py), env)


def test_eager_explanations_at_their_boundaries():
    # the extra host time covering exactly 80 % of the gap explains it
    assert C.explain_eager(10.0, 15.0, 10.0, 14.0)[0] == "host cost"
    # host-bound exactly at 90 % of ncclpy's call
    assert C.explain_eager(10.0, 20.0, 8.0, 18.0)[0] == "host cost"
    # a gap under 1 us that host time covers only in part is still ncclpy's extra cost
    v, why = C.explain_eager(10.0, 10.6, 9.9, 10.0)
    assert v == "not host cost" and "covers only part of the gap" in why, why


def test_eager_counts_per_explanation():
    rows = [{"target": "eager", "verdict": v} for v in ("same", "same", "host cost")]
    assert C.summarise({"eager": rows})["eager_latency"] == {"same": 2, "host cost": 1}


def test_status_names_the_program_that_failed_at_every_run_and_its_key_line():
    ok = {"tool": "nccl-tests", "collective": "all_reduce", "mode": "eager", "round": 1,
          "error": ""}
    bad = [{"tool": "ncclpy", "collective": "all_reduce", "mode": m, "round": 1,
            "error": "exit 1", "output_tail": "x\nRuntimeError: boom\n"} for m in
           ("eager", "graph")]
    status, why = C.status_of([ok] + bad)
    assert status == "failed", status
    assert why == ("ncclpy failed at every run; first: ncclpy all_reduce eager round 1: exit 1: "
                   "RuntimeError: boom"), why
    nt_bad = dict(bad[0], tool="nccl-tests", output_tail="", mode="graph")
    status, why = C.status_of([ok, nt_bad, dict(ok, tool="ncclpy")])
    assert status == "partial" and why == ("1 of 3 runs failed; first: nccl-tests all_reduce "
                                           "graph round 1: exit 1"), why
