"""CPU tests of nccl-tests' build for the side-by-side comparison (bench.nccl_tests_build: the
carry folder, finding CUDA and ncclpy's libnccl, unpacking, the make line, a failed make said
with the end of its log, a build reused) with stand-ins for nvcc, make and the wheels; and of the
selftest's ``nccl-tests`` stage: selected only by --stage, its command, its result read from the
runner's JSON (never "passed" when it could not run), its line in the paste block and its
tables in report.md."""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench import nccl_tests_build as B
from ncclpy.selftest import report as R, runner as RN
from ncclpy.selftest import stages as S

ROOT = Path(__file__).resolve().parents[1]


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _carry(tmp_path: Path, makefile: str = "all:\n") -> Path:
    """A carry folder: a tarball of a tree with src/Makefile, and an MPI wheel with mpi.h and
    an executable mpiexec (the stand-in's layout is MPICH's: mpich-5.0.2.data/data/...)."""
    carry = tmp_path / "carry"
    carry.mkdir()
    with tarfile.open(carry / B.TARBALL, "w:gz") as tar:
        for name, text in (("nccl-tests-2.19.6/src/Makefile", makefile),
                           ("nccl-tests-2.19.6/README.md", "x")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with zipfile.ZipFile(carry / "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl", "w") as z:
        for name, mode in (("mpich-5.0.2.data/data/include/mpi.h", 0o644),
                           ("mpich-5.0.2.data/data/bin/mpiexec", 0o755)):
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            z.writestr(info, "#!/bin/sh\n")
    return carry


def _cuda(tmp_path: Path) -> Path:
    home = tmp_path / "cuda"
    _exe(home / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, "
                                "V13.0.88'\n")
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "lib64").mkdir()
    (home / "lib64" / "libcudart.so.13").write_text("")
    return home


def _nccl(tmp_path: Path) -> B.Nccl:
    lib = tmp_path / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_text("")
    (tmp_path / "nccl" / "include").mkdir()
    (tmp_path / "nccl" / "include" / "nccl.h").write_text("#define NCCL_VERSION_CODE 22809\n")
    return B.Nccl(str(lib), str(tmp_path / "nccl" / "include"), 22809)


# -- the build -------------------------------------------------------------------------------

def test_carry_folder_missing_or_incomplete_says_how_to_prepare_it(tmp_path):
    with pytest.raises(B.NotRunnable, match=r"no carry folder .*/none: prepare it on a machine "
                                            r"with network \(python -m bench.nccl_tests_build "
                                            r"prepare --dest wheels/nccl-tests\)"):
        B.find_carried(str(tmp_path / "none"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / B.TARBALL).write_text("")
    with pytest.raises(B.NotRunnable, match=r"lacks mpich-5.0.2-\*.whl: prepare it"):
        B.find_carried(str(tmp_path / "half"))
    got = B.find_carried(str(_carry(tmp_path)))
    assert got["source"].endswith(B.TARBALL) and got["mpi_wheel"].endswith(".whl")


def test_no_nvcc_is_not_runnable_naming_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "_site_nvcc", lambda: [])
    with pytest.raises(B.NotRunnable) as e:
        B.find_cuda({"PATH": str(tmp_path)}, defaults=(str(tmp_path / "no-cuda"),))
    assert str(e.value).startswith(f"no CUDA toolkit with nvcc, cuda_runtime.h and libcudart "
                                   f"(nvcc on PATH: none; looked in {tmp_path / 'no-cuda'})")
    home = _cuda(tmp_path)
    # an nvcc wrapper on PATH whose folder is no toolkit (/usr/local/bin/nvcc): looked through
    _exe(tmp_path / "wrap" / "bin" / "nvcc", f"#!/bin/sh\nexec {home}/bin/nvcc \"$@\"\n")
    got = B.find_cuda({"PATH": str(tmp_path / "wrap" / "bin")}, defaults=(str(home),))
    assert got == B.Cuda(str(home), str(home / "bin" / "nvcc"), str(home / "lib64"), "13.0")


def test_ncclpys_libnccl_is_asked_in_a_child_and_needs_its_headers(tmp_path):
    nccl = _nccl(tmp_path)
    py = _exe(tmp_path / "py", f"#!/bin/sh\necho '{{\"path\": \"{nccl.library}\", "
                               f"\"version\": 22809}}'\n")
    assert B.find_nccl(str(py)) == nccl
    bad = _exe(tmp_path / "bad", "#!/bin/sh\necho 'MissingDependencyError: no CuPy' >&2\n"
                                 "exit 1\n")
    with pytest.raises(B.NotRunnable, match=r"ncclpy cannot load libnccl here \(exit 1\): "
                                            r"MissingDependencyError: no CuPy"):
        B.find_nccl(str(bad))
    os.remove(tmp_path / "nccl" / "include" / "nccl.h")
    with pytest.raises(B.NotRunnable, match="no nccl.h beside the libnccl ncclpy loads"):
        B.find_nccl(str(py))


def _fake_make(tmp_path: Path, body: str) -> dict:
    """PATH with a stand-in make (it logs its arguments, then runs ``body``) and g++."""
    _exe(tmp_path / "tools" / "make", "#!/bin/sh\necho \"make $*\"\n" + body)
    _exe(tmp_path / "tools" / "g++", "#!/bin/sh\n")
    return {"PATH": f"{tmp_path / 'tools'}:/usr/bin:/bin"}


def test_a_failed_make_is_a_build_failure_with_the_end_of_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "find_cuda", lambda env=None: B.Cuda(
        str(tmp_path), "/x/nvcc", str(_cuda(tmp_path) / "lib64"), "13.0"))
    nccl = _nccl(tmp_path)
    env = _fake_make(tmp_path, "echo \"nvcc fatal   : Unsupported gpu architecture "
                               "'compute_999'\"\nexit 2\n")
    out = tmp_path / "build"
    with pytest.raises(B.BuildFailed) as e:     # a failure, not a missing prerequisite
        B.build(str(_carry(tmp_path)), str(out), env=env, nccl=nccl, gencode="-gencode=x")
    msg = str(e.value)
    assert msg.startswith(f"building nccl-tests v2.19.6 failed (exit 2); the end of "
                          f"{out / 'build.log'}:\n$ make -C ")
    assert msg.endswith("nvcc fatal   : Unsupported gpu architecture 'compute_999'")
    log = (out / "build.log").read_text()
    assert f"MPI=1 MPI_HOME={out / 'mpi' / 'mpich-5.0.2.data' / 'data'} " in log
    assert f"NCCL_HOME={out / 'nccl_home'} " in log and "NVCC_GENCODE=-gencode=x" in log
    assert " CXXSTD=-std=c++17 " in log         # common.mk's own pick needs `which`
    assert log.split("\n")[1].endswith(f"{out / 'all_reduce_perf'} {out / 'sendrecv_perf'}")
    # NCCL_HOME is links: libnccl.so -> the wheel's libnccl.so.2, include -> its headers;
    # CUDA's libcudart.so.13 alone gets a libcudart.so beside it
    assert os.readlink(out / "nccl_home" / "lib" / "libnccl.so") == nccl.library
    assert os.readlink(out / "nccl_home" / "include") == nccl.include
    assert os.readlink(out / "nccl_home" / "lib" / "libcudart.so").endswith("libcudart.so.13")
    assert os.access(out / "mpi" / "mpich-5.0.2.data" / "data" / "bin" / "mpiexec", os.X_OK)


def test_a_build_writes_build_json_and_is_reused_against_the_same_libnccl(tmp_path,
                                                                          monkeypatch):
    home = _cuda(tmp_path)
    monkeypatch.setattr(B, "find_cuda", lambda env=None: B.Cuda(
        str(home), str(home / "bin" / "nvcc"), str(home / "lib64"), "13.0"))
    nccl = _nccl(tmp_path)
    env = _fake_make(tmp_path, "for t in \"$@\"; do :; done\n"
                               "for b in all_reduce_perf sendrecv_perf; do\n"
                               "  printf '#!/bin/sh\\n' > \"$(dirname \"$t\")/$b\"\n"
                               "  chmod +x \"$(dirname \"$t\")/$b\"\ndone\n")
    out = tmp_path / "build"
    info = B.build(str(_carry(tmp_path)), str(out), env=env, nccl=nccl, gencode="-g")
    assert not info.reused and info.nccl_version == 22809 and info.tag == "v2.19.6"
    assert info.binaries == {b: str(out / b) for b in B.BINARIES}
    assert info.mpiexec == str(out / "mpi" / "mpich-5.0.2.data" / "data" / "bin" / "mpiexec")
    assert info.ld_library_path[0] == str(Path(nccl.library).parent)
    assert json.loads((out / "build.json").read_text())["binaries"] == info.binaries
    again = B.build(str(tmp_path / "carry"), str(out), env=env, nccl=nccl, gencode="-g")
    assert again.reused and again.seconds == info.seconds


def test_the_build_command_line_refuses_a_bad_gencode_in_one_line(capsys):
    assert B.main(["build", "--out", "/nonexistent/x", "--gencode", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gencode: expected a compute capability such as 90 or " \
                                    "9.0, got 'abc'" in err


# -- the selftest stage ----------------------------------------------------------------------

def test_the_stage_runs_only_on_request_alone_and_within_its_own_call():
    st = S.by_name("nccl-tests")
    assert st.on_request and st.exclusive and st.kind == "nccl-tests" and st.ranks == 2
    assert "nccl-tests" not in [s.name for s in S.select(None)]
    assert [s.name for s in S.select(["nccl-tests"])] == ["info", "nccl-tests"]
    assert "nccl-tests" in S.TIMED                      # the ledger records it, the debt lists it
    # the runner's own --budget (its bound less 30 s) fits even when info takes its whole bound
    assert st.timeout_s - 30 <= S.DEFAULT_BUDGET_S - S.RESERVE_S - S.by_name("info").timeout_s
    ctx = S.Ctx(python="py", work="/w", tmp="/t")
    [cmd] = S.commands(st, ctx)
    assert cmd.argv == ("py", "-m", "bench.nccl_tests_side", "--nproc", "2", "--rounds", "2",
                        "--carry", "wheels/nccl-tests", "--out", "/w/14-nccl-tests",
                        "--build-dir", "/t/nccl-tests-build", "--budget", "390", "--python",
                        "py")
    # the bound decide() gives it (the selftest's --budget less what ran before) shrinks it
    [cmd] = S.commands(st, ctx, 250.0)
    assert cmd.argv[cmd.argv.index("--budget") + 1] == "220"
    [cmd] = S.commands(st, ctx, 1000.0)                # never more than its own bound
    assert cmd.argv[cmd.argv.index("--budget") + 1] == "390"


def test_a_small_selftest_budget_reaches_the_runners_own_budget(tmp_path):
    from ncclpy.selftest import schedule as SC
    seen = tmp_path / "argv.txt"
    py = tmp_path / "py"                    # stands in for python: says what it was given
    py.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\n")
    py.chmod(0o755)
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    st = S.by_name("nccl-tests")
    [res], _ = SC.run_stages([st], S.Ctx(python=str(py), work=str(work), tmp=str(tmp)),
                             str(ROOT), 220.0, say=lambda s: None)
    # bound: min(420, 220 - RESERVE_S 25) = 195; the runner gets 30 s less
    assert res.timeout_s == pytest.approx(195.0, abs=1.0)
    argv = seen.read_text().split()
    assert argv[argv.index("--budget") + 1] == "165"
    assert res.status == "failed"           # the stand-in wrote no JSON: never passed


def _side_doc(status: str, reason: str = "", flags=(), wrong=0.0, rounds=3) -> dict:
    rows = {"eager": [{"size": 1 << 20, "target": "busbw", "verdict": "within 3%"}]}
    summary = {"busbw": {"sizes": 9, "met": 9, "worst": 0.985, "verdict": "met",
                         "rounds": rounds, "nt_spread": 0.012 if rounds > 1 else None},
               "graph_latency": {"sizes": 14, "met": 12, "worst": 1.07, "verdict": "missed",
                                 "rounds": rounds, "nt_spread": 0.03 if rounds > 1 else None},
               "eager_latency": {"same": 3, "host cost": 11}, "wrong": wrong}
    return {"schema": "ncclpy-nccl-tests-side/1", "status": status, "reason": reason,
            "flags": list(flags), "comparable": not flags,
            "setup": {"nproc": 2, "rounds_done": rounds, "rounds_planned": 3},
            "nccl_tests": {"gpu": "NVIDIA H200", "build_seconds": 52.0,
                           "version_line": {"version": "2.19.6", "headers": 22809,
                                            "library": 22809}},
            "versions": {"nccl-tests": 22809, "ncclpy": 22809},
            "collectives": {"all_reduce": {"rows": rows, "summary": summary}},
            "markdown": "### ncclpy bench beside nccl-tests 2.19.6\n\n| size | ... |\n"}


@pytest.mark.parametrize("doc,rc,status,reason", [
    (_side_doc("complete"), 0, "passed", ""),
    (_side_doc("not run", "no carry folder wheels/nccl-tests: prepare it"), 3, "not run",
     "no carry folder wheels/nccl-tests: prepare it"),
    (_side_doc("partial", "1 of 24 runs failed; first: ..."), 1, "failed",
     "partial: 1 of 24 runs failed; first: ..."),
    (_side_doc("failed", "building nccl-tests v2.19.6 failed (exit 2); the end of ..."), 1,
     "failed", "building nccl-tests v2.19.6 failed (exit 2); the end of ..."),
    (_side_doc("complete", flags=["different NCCL: nccl-tests 22809, ncclpy 23203"]), 0,
     "failed", "not comparable: different NCCL: nccl-tests 22809, ncclpy 23203"),
    (_side_doc("complete", wrong=4.0), 0, "failed", "4 wrong elements"),
    (None, 1, "failed", "exit status 1, no JSON written"),
])
def test_the_stage_result_comes_from_the_runners_json_and_is_never_passed_unrun(
        tmp_path, doc, rc, status, reason):
    st = S.by_name("nccl-tests")
    work = tmp_path / "work"
    (work / S.prefix(st)).mkdir(parents=True)
    (work / f"{S.prefix(st)}.log").write_text("$ python -m bench.nccl_tests_side\nnot run: x\n")
    if doc is not None:
        (work / S.prefix(st) / S.SIDE_JSON).write_text(json.dumps(doc))
    res = R.StageResult(st.name, st.title, commands=[{"rc": rc, "shell": "x", "seconds": 1.0}])
    RN.analyse(st, res, S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp_path)))
    assert (res.status, res.reason) == (status, reason)
    if doc is not None:
        assert res.figures["nccl_tests"]["summary"]["all_reduce"]["busbw"]["met"] == 9


def test_the_paste_block_and_report_carry_the_verdicts_and_the_tables(tmp_path):
    st = S.by_name("nccl-tests")
    work = tmp_path / "work"
    (work / S.prefix(st)).mkdir(parents=True)
    (work / S.prefix(st) / S.SIDE_JSON).write_text(json.dumps(_side_doc("complete")))
    res = R.StageResult(st.name, st.title, commands=[{"rc": 0, "shell": "x", "seconds": 1.0}])
    RN.analyse(st, res, S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp_path)))
    rec = R.RunRecord("2026-11-30 10:00", "cmd", 480, [res])
    block = R.paste_block(rec)
    assert ("- nccl-tests 2.19.6 beside ncclpy's bench, 2 ranks on NVIDIA H200, NCCL 22809, "
            "medians of 3 of 3 rounds, built in 52 s") in block
    assert ("  - all_reduce: busbw >= 1 MiB within 3%: met (9/9, worst ratio 0.985, "
            "nccl-tests' spread 1.2%); graph latency <= 64 KiB within 5%: missed (12/14, worst "
            "ratio 1.070, nccl-tests' spread 3.0%); eager <= 64 KiB: same 3, host cost 11; "
            "#wrong 0") in block
    # "passed" says what passed: the comparison, not the targets
    assert ("| nccl-tests | passed: comparison completed; targets: all_reduce busbw met, graph "
            "latency missed |") in block
    assert "nccl-tests: passed: comparison completed; targets: all_reduce busbw met" in \
        R.stage_line(res)
    assert "### ncclpy bench beside nccl-tests 2.19.6\n\n| size | ... |" in R.report_md(rec)
    res.status, res.reason = "not run", "no nvcc"
    assert "| nccl-tests | not run: no nvcc |" in R.paste_block(rec)
    assert R.exit_code(rec) == 1


def test_one_round_says_the_spread_is_unknown_in_the_paste_block(tmp_path):
    st = S.by_name("nccl-tests")
    work = tmp_path / "work"
    (work / S.prefix(st)).mkdir(parents=True)
    (work / S.prefix(st) / S.SIDE_JSON).write_text(json.dumps(_side_doc("complete", rounds=1)))
    res = R.StageResult(st.name, st.title, commands=[{"rc": 0, "shell": "x", "seconds": 1.0}])
    RN.analyse(st, res, S.Ctx(python=sys.executable, work=str(work), tmp=str(tmp_path)))
    block = R.paste_block(R.RunRecord("2026-11-30 10:00", "cmd", 480, [res]))
    assert ("medians of 1 of 3 rounds, built in 52 s; fewer than 2 rounds: the spread is "
            "unknown, a ratio outside its band is not a verdict") in block
    assert "met (9/9, worst ratio 0.985, spread unknown (one round))" in block


def test_a_failed_comparison_is_recorded_in_the_ledger_a_missing_prerequisite_is_not(
        tmp_path):
    from ncclpy.selftest.record import results_of_run
    st = S.by_name("nccl-tests")
    res = R.StageResult(st.name, st.title, status="failed", reason="nccl-tests failed at "
                        "every run; first: ...", seconds=30.0)
    rec = R.RunRecord("2026-11-30 10:00", "cmd", 480, [res])
    got = results_of_run(rec, str(tmp_path))["stage:nccl-tests"]
    assert (got["outcome"], got["reason"]) == ("failed", res.reason)
    res.status = "not run"
    assert "stage:nccl-tests" not in results_of_run(rec, str(tmp_path))
