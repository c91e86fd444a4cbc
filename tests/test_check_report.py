"""What ``ncclpy check`` prints: the progress line (on a terminal's stderr only), the
collective x dtype matrix, the cases that did not pass with their reasons, the summary, all
within 100 columns; the full rows behind ``-v``; the JSON the same either way.  Also: the
gloo check runs where CuPy is not installed at all."""
from __future__ import annotations

import importlib.util
import io
import os
import pty
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest

from check_runs import module_runs, proc
from ncclpy.check import overview as O
from ncclpy.check import report as R

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)
#: a small gloo run (the report's layout; what the CPU backend adds: test_check_exact.py)
SMALL = ["-n", "2", "--collectives", "all_reduce,broadcast,gather,barrier", "--dtypes",
         "bool,float32,complex64,uint64", "--sizes", "0,7", "--backend", "gloo"]


def _env(**kw: str) -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT"):
        e.pop(k, None)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    e.update(kw)
    return e


def check(*args: str, **env: str):
    """``ncclpy check ARGS``: the run, when called."""
    return proc([sys.executable, "-m", "ncclpy", "check", *args], _env(**env), 200)


def _progress_run(env: dict) -> tuple:
    """SMALL with stderr a terminal (a pty) and stdout a pipe: the run and its stderr."""
    master, slave = pty.openpty()
    got = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            got.extend(chunk)
    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        p = subprocess.run([sys.executable, "-m", "ncclpy", "check", *SMALL], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=slave, text=True,
                           timeout=200)
    finally:
        os.close(slave)
    t.join(timeout=30)
    os.close(master)
    return p, got.decode(errors="replace")


def _without_cupy(backend: str, d: Path) -> subprocess.CompletedProcess:
    """The check run by an isolated Python (no site) that sees this venv's site-packages
    through links, without cupy*, cuda* and nvidia* (see test_check_runs_without_cupy)."""
    import site
    sp = next(Path(x) for x in site.getsitepackages() if (Path(x) / "torch").is_dir())
    view = d / "site"
    view.mkdir()
    for e in sp.iterdir():
        if not e.name.startswith(("cupy", "cuda", "nvidia", "__editable__")) and \
                not e.name.endswith(".pth"):
            (view / e.name).symlink_to(e.resolve())
    code = ("import sys; sys.path[:0] = [%r, %r]\n"
            "import importlib.util as u; assert u.find_spec('cupy') is None\n"
            "from ncclpy.cli import main\n"
            "rc = main(['check', '--collectives', 'all_reduce,all_gather,barrier', '--dtypes',"
            " 'float32,int8', '--sizes', '0,7', '-n', '2', '--backend', %r])\n"
            "assert 'cupy' not in sys.modules\n"
            "sys.exit(rc)\n") % (str(ROOT), str(view), backend)
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=d,
                          capture_output=True, text=True, timeout=200)


def _cpu_backend_unavailable() -> str:
    from ncclpy.check.cpu_side import unavailable
    return unavailable()


NEEDS = {"test_default_report_is_a_matrix_and_a_list_within_100_columns": ["default", "-v"],
         "test_failures_are_listed_with_reasons_and_quiet_drops_the_matrix": ["failures"],
         "test_progress_line_on_a_terminal_stderr": ["progress"],
         "test_check_runs_without_cupy[gloo]": ["no-cupy-gloo"],
         "test_check_runs_without_cupy[auto]": ["no-cupy-auto"]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's real runs (check_runs.py), started together as the first of their tests
    begins: each test reads its run's output (and JSON) as if it had started the run."""
    d = tmp_path_factory.mktemp("check_report")
    t = {"default": check(*SMALL, "--json", str(d / "default.json")),
         "-v": check(*SMALL, "--json", str(d / "-v.json"), "-v"),
         "failures": check("-n", "2", "--collectives", "reduce_scatter,broadcast", "--dtypes",
                           "int8", "--sizes", "0,5", "--ops", "sum", "-q", "--backend", "gloo",
                           NCCLPY_CHECK_INJECT="reduce_scatter:1"),
         "progress": partial(_progress_run, _env())}
    for b in ("gloo", "auto"):
        t[f"no-cupy-{b}"] = partial(_without_cupy, b, tmp_path_factory.mktemp(f"no-cupy-{b}"))
    needs = dict(NEEDS)
    if importlib.util.find_spec("torch") is None:        # those tests skip
        needs = {k: v for k, v in needs.items() if "cupy" not in k}
    elif _cpu_backend_unavailable():
        needs.pop("test_check_runs_without_cupy[auto]")
    yield from module_runs(request, t, needs, d)


def _rec(coll, dtype, status, op=None, reason="", **case):
    c = {"collective": coll, "dtype": dtype, "op": op, "scalar": None, "count": 7,
         "size_label": "7", "root": None, "in_place": False, "variant": ""}
    c.update(case)
    return {"case": c, "status": status, "reason": reason}


# -- the parts --------------------------------------------------------------------------------
def test_matrix_cell_is_the_most_serious_case():
    recs = [_rec("all_reduce", "bool", "pass", "max"), _rec("all_reduce", "bool",
                                                            "torch divergence", "sum", "why"),
            _rec("all_reduce", "float32", "pass", "sum"), _rec("all_reduce", "float32", "error",
                                                               "sum", "boom"),
            _rec("broadcast", "float32", "pass"), _rec("broadcast", "bool", "within ULP"),
            _rec("barrier", None, "pass")]
    skips = [{"collective": "broadcast", "dtype": "uint64", "op": None, "reason": "gloo"},
             {"collective": "all_reduce", "dtype": "bool", "op": "avg", "reason": "no"}]
    lines = O.matrix_lines(recs, skips)
    assert all(len(ln) <= R.WIDTH for ln in lines)
    head = next(ln for ln in lines if ln.strip().startswith("u64") or "f32" in ln)
    assert head.split() == ["u64", "f32", "bool"]              # matrix order of the dtypes
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines
            if ln.split() and ln.split()[0] in ("all_reduce", "broadcast", "barrier")}
    assert rows["all_reduce"] == ["-", "X", "d"]              # error beats pass; d beats s
    assert rows["broadcast"] == ["s", ".", "~"]
    assert rows["barrier"][0] == "."
    assert any(ln.startswith("legend: . passed bit for bit") for ln in lines)


def test_problem_list_groups_cases_with_their_reasons():
    long = "torch != reference on rank(s) [1] " + "because " * 20
    recs = [_rec("reduce", "int8", "fail", "sum", long, root=1, in_place=True),
            _rec("reduce", "int8", "fail", "sum", long, root=0),
            _rec("all_reduce", "bool", "torch divergence", "sum", "gloo adds bytes"),
            _rec("all_to_all", "int8", "pass", variant="uneven"),
            _rec("all_reduce", "float16", "unsupported", "avg", "torch refuses")]
    lines = O.problem_lines(recs, [{"collective": "all_reduce", "dtype": "float8_e4m3",
                                    "op": "sum", "reason": "needs sm90"}], "nccl")
    assert all(len(ln) <= R.WIDTH for ln in lines)
    text = " ".join(" ".join(lines).split())
    assert "failed: 2 cases" in text
    assert "X reduce int8 sum (2 cases: 7 r1 ip, 7 r0 oop): torch != reference on rank(s) [1]" \
        in text
    assert "d all_reduce bool sum (1 case: 7 oop): gloo adds bytes" in text
    assert "u all_reduce float16 avg (1 case: 7 oop): torch refuses" in text
    assert "s all_reduce float8_e4m3 sum: needs sm90" in text and "all_to_all" not in text
    assert O.problem_lines(recs[3:4], [], "gloo") == []


def test_summary_lines_fit_and_count_right():
    counts = {"cases": 1, "passed": 0, "failed": 1, "within_ulp": 0, "torch_divergence": 1,
              "unsupported": 0, "skipped": 1, "ncclpy_cases": 1}
    a, b = R.summary_lines(counts, 1.25, "nccl", 1)
    assert a == "ncclpy check: 1 case on 1 rank (nccl) in 1.2 s: 0 passed bit for bit, 1 failed"
    assert b == "  1 torch divergence, 0 within ULP tolerance, 0 unsupported, 1 combination skipped"
    # ncclpy did not run (no GPU): the summary never reads as if it had
    gloo = dict(counts, failed=0, passed_torch_only=1, ncclpy_cases=0)
    lines = R.summary_lines(gloo, 1.25, "gloo", 2, "no CUDA driver")
    assert lines[0] == "ncclpy check: 1 case on 2 ranks (gloo) in 1.2 s: ncclpy NOT run"
    assert lines[1] == "  torch (gloo) vs numpy reference only: 1 passed bit for bit, 0 failed"
    assert lines[2] == "  ncclpy needs a GPU: no CUDA driver"
    assert "passed bit for bit" not in lines[0]
    big = dict(counts, cases=99999, passed=99999, torch_divergence=99999, skipped=9999,
               within_ulp=99999, unsupported=99999, failed=99999)
    assert all(len(ln) <= R.WIDTH for ln in R.summary_lines(big, 9999.9, "gloo", 4096))


def test_progress_draws_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    quiet = io.StringIO()
    p = O.Progress(3, quiet)
    p.update(3, 0, "all_reduce")
    p.clear()
    assert quiet.getvalue() == "" and not p.enabled
    tty = Tty()
    p = O.Progress(3, tty)
    p.update(3, 1, "broadcast")                  # the last case is always drawn
    p.clear()
    assert tty.getvalue().startswith("\r  3/3 cases, ") and "1 failure  (broadcast)" in \
        tty.getvalue() and tty.getvalue().endswith("\r\x1b[K")


# -- real runs --------------------------------------------------------------------------------
def test_default_report_is_a_matrix_and_a_list_within_100_columns(runs):
    p, v = runs.results("default", "-v")      # SMALL --json a.json; the same with -v
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert all(len(ln) <= R.WIDTH for ln in lines), max(lines, key=len)
    assert len(lines) < 40
    assert "by collective and dtype:" in lines and "ncclpy==torch" not in p.stdout
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.split()
            and ln.split()[0] in ("all_reduce", "broadcast", "gather", "barrier")}
    head = next(ln for ln in lines if ln.split()[:1] == ["u64"])
    assert head.split() == ["u64", "f32", "bool", "c64"]
    assert rows["all_reduce"] == ["s", ".", "d", "."]      # gloo: no uint64; bool sum diverges
    assert rows["gather"] == ["s", ".", ".", "s"]           # gloo: no complex gather
    assert rows["barrier"][0] == "."
    text = " ".join(p.stdout.split())
    assert "torch divergences (torch's documented wrong output; not failures): 1 case" in text
    assert "d all_reduce bool sum (1 case: 7 ip): gloo adds bool bytes" in text
    assert "\r" not in p.stdout + p.stderr and "cases, " not in p.stderr    # no progress line
    # -v: the same run with every row; the JSON's cases are the same
    assert v.returncode == 0, v.stderr
    assert "ncclpy==torch" in v.stdout and "by collective and dtype:" in v.stdout
    table = [ln for ln in v.stdout.splitlines() if ln.startswith(("all_reduce ", "broadcast "))
             and "needs GPU" in ln]
    a, b = runs.json("default"), runs.json("-v")
    assert len(table) == sum(c["case"]["collective"] in ("all_reduce", "broadcast")
                             for c in a["cases"])
    assert a["cases"] == b["cases"] and a["summary"] == b["summary"] and \
        set(a) == set(b) == {"header", "summary", "by_torch_backend", "exit_code", "problems",
                             "compared", "seconds", "cases", "skipped", "timing"}
    t = a["timing"]                    # where the time went, in the JSON and with -v
    assert t["cases"] == len(a["cases"]) and t["walk_s"] > 0 and t["verdict_batch"] >= 1
    assert set(t["phases_s"]) == {"inputs", "reference", "torch", "ncclpy", "compare", "sync"}
    assert sum(t["phases_s"].values()) <= t["walk_s"] + 0.01
    assert "ms per case on rank 0 (inputs" in " ".join(v.stdout.split())


def test_failures_are_listed_with_reasons_and_quiet_drops_the_matrix(runs):
    # reduce_scatter,broadcast int8 sizes 0,5, -q, NCCLPY_CHECK_INJECT=reduce_scatter:1
    p = runs["failures"]
    assert p.returncode == 1, p.stdout + p.stderr
    assert "by collective and dtype:" not in p.stdout
    assert all(len(ln) <= R.WIDTH for ln in p.stdout.splitlines())
    text = " ".join(p.stdout.split())
    assert ("X reduce_scatter int8 sum (2 cases: 5 oop, 5 ip): torch != reference on rank(s) [1] "
            "(corrupted on purpose by NCCLPY_CHECK_INJECT: torch:bit)") in text
    assert "failed: 2 cases" in text and ": 6 passed bit for bit, 2 failed" in text


def test_progress_line_on_a_terminal_stderr(runs):
    """stderr a terminal (a pty): the progress line is drawn in place and erased; stdout (a
    pipe here) holds the report alone."""
    p, err = runs["progress"]
    assert p.returncode == 0, p.stdout + err
    from ncclpy.check import cases as C
    n = len(C.build_matrix(2, backend="gloo", collectives=SMALL[3].split(","),
                           dtypes=SMALL[5].split(","), sizes=SMALL[7])[0])
    assert f"\r  {n}/{n} cases, " in err and " 0 failures  (barrier)" in err, repr(err[-500:])
    assert err.rstrip("\n").endswith("\r\x1b[K") or err.endswith("\r\x1b[K"), repr(err[-200:])
    assert "\r" not in p.stdout and "by collective and dtype:" in p.stdout


@pytest.mark.parametrize("backend", ["gloo", "auto"])
def test_check_runs_without_cupy(backend, runs):
    """``pip install -e .`` + torch (no CUDA extra): the check runs where CuPy, CUDA and the
    NCCL wheels are not installed: ``--backend gloo`` torch alone, ``auto`` (no GPU) ncclpy on
    its CPU backend, which needs none of them.  The subprocess sees this venv's site-packages
    through links, without cupy*, cuda* and nvidia* (isolated mode, no site: nothing else on its
    path); the spawned ranks inherit that path."""
    pytest.importorskip("torch")
    if backend == "auto" and _cpu_backend_unavailable():
        pytest.skip(_cpu_backend_unavailable())
    p = runs[f"no-cupy-{backend}"]             # _without_cupy(backend)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from ncclpy.check import cases as C
    run = "gloo" if backend == "gloo" else "cpu"
    n = len(C.build_matrix(2, backend=run, collectives=["all_reduce", "all_gather", "barrier"],
                           dtypes=["float32", "int8"], sizes="0,7")[0])
    assert " 0 failed" in p.stdout
    if backend == "gloo":
        assert "ncclpy column: needs GPU (CuPy is not installed)" in p.stdout
        assert f"ncclpy check: {n} cases on 2 ranks (gloo)" in p.stdout
    else:
        assert "  CPU backend: NCCL's semantics and order, not NCCL" in p.stdout, p.stdout
        assert f"ncclpy check: {n} cases on 2 ranks (cpu vs gloo)" in p.stdout


def test_gpu_run_header_fits_and_names_both_libraries(capsys):
    """The header of a GPU run (no GPU needed to print it): device, both libnccl paths, the
    pins; within 100 columns; the skip rows and the "==" note only with -v."""
    from ncclpy.check import session as S
    lib = {"torch_libnccl": "/opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
           "ncclpy_libnccl": "/opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
           "torch_nccl_version": "2.28.3", "ncclpy_nccl_version": "2.28.3", "same": True,
           "problems": [], "torch_found_by": "the symbol torch's NCCL calls resolves to it"}
    ctx = {"header": {"world_size": 4, "torch": "2.13.0+cu130", "backend": "nccl", "seed": 1,
                      "timeout_s": 300.0, "placement": None, "device": "NVIDIA H100 80GB HBM3",
                      "compute_capability": "9.0", "libnccl": lib,
                      "pinned": ["NCCL_ALGO=Ring", "NCCL_PROTO=Simple", "NCCL_MIN_NCHANNELS=2",
                                 "NCCL_MAX_NCHANNELS=2", "NCCL_NVLS_ENABLE=0"],
                      "kept": [], "nccl_env": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
                                               "NCCL_MIN_NCHANNELS": "2",
                                               "NCCL_MAX_NCHANNELS": "2",
                                               "NCCL_NVLS_ENABLE": "0"}}}
    skipped = [{"collective": "all_reduce", "dtype": "int8", "op": "premul_sum",
                "reason": "ncclpy refuses this scalar for int8"}]
    for verbose in (False, True):
        cfg = {"verbose": verbose}
        S._print_header(S.Output(cfg), cfg, ctx, 1234, skipped)
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[0] == ("ncclpy check: 4 ranks, torch 2.13.0+cu130, backend nccl, seed 1, "
                            "timeout 300 s per collective")
        assert lines[1] == "  1234 cases, 1 combination skipped"
        assert any(ln.startswith("  torch libnccl:  /opt/venv/") for ln in lines)
        assert any(ln.startswith("  ncclpy libnccl: /opt/venv/") for ln in lines)
        assert "  same libnccl on both sides: yes" in lines
        assert ("ncclpy==torch" in out) == verbose == ("skipped: ncclpy refuses" in out)
        if not verbose:
            assert all(len(ln) <= R.WIDTH for ln in lines), max(lines, key=len)
