"""``ncclpy check``'s arguments, checked before anything starts (real subprocesses): every
mistake is one line naming the flag as typed, exit status 2, no traceback; ``--ops`` selects
the reducing collectives only; the ``--json`` file's directory is checked first."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_runs import module_runs, proc
from ncclpy.check import cases as C

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _run(*args: str, timeout: float = 90):
    """``ncclpy check ARGS``: the run, when called."""
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT"):
        e.pop(k, None)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    return proc([sys.executable, "-m", "ncclpy", "check", *args], e, timeout)


def check(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return _run(*args, timeout=timeout)()


# each: the arguments (with a one-case filter, so that a value that is wrongly accepted ends
# quickly instead of running the whole matrix) and the start of the one error line
BAD = [
    (["-n", "0"], "-n: expected a number of ranks >= 1, got 0"),
    (["--nprocs", "0"], "--nprocs: expected a number of ranks >= 1, got 0"),
    (["--nproc", "-3"], "--nproc: expected a number of ranks >= 1, got -3"),
    (["-n", "two"], "-n: expected a number of ranks >= 1, got 'two'"),
    (["--dtypes", "float33"], "--dtypes: dtype 'float33' is not a dtype ncclpy knows; expected "
                              "one of int8, uint8"),
    (["--dtypes", ","], "--dtypes: no dtype given; expected a comma list of int8"),
    (["--roots", "abc"], "--roots: 'abc' is not a rank; expected a comma list of ranks in 0..1"),
    (["--roots", "0,2"], "--roots: 2 is not a rank of this run; expected ranks in 0..1"),
    (["--collectives", "allgather,foo"], "--collectives: collective 'foo' is unknown"),
    (["--ops", "band"], "--ops: 'band' is not an op of ncclpy check; expected one of sum, prod"),
    (["--sizes", "1parsec"], "--sizes: '1parsec' is not a size"),
    (["--size", "7,x"], "--size: 'x' is not a size"),
    (["--premul-scalar", "nan"], "--premul-scalar: expected a finite number, got 'nan'"),
    (["--premul-scalar", "inf"], "--premul-scalar: expected a finite number, got 'inf'"),
    (["--premul-scalar=-inf"], "--premul-scalar: expected a finite number, got '-inf'"),
    (["--premul-scalar", "two"], "--premul-scalar: expected a finite number, got 'two'"),
    (["--timeout", "0"], "--timeout: expected seconds > 0, got '0'"),
    (["--timeout", "soon"], "--timeout: expected seconds > 0, got 'soon'"),
    (["--run-timeout", "-1"], "--run-timeout: expected seconds >= 0, got '-1'"),
    (["--seed", "x"], "--seed: expected an integer, got 'x'"),
    (["--inplace", "maybe"], "--inplace: invalid choice: 'maybe'"),
    (["--json", "/nonexistent-ncclpy-dir/sub/x.json"],
     "--json: cannot write '/nonexistent-ncclpy-dir/sub/x.json': directory "
     "'/nonexistent-ncclpy-dir/sub' does not exist"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--dtypes"], "--dtypes: expected one argument"),
    (["--inputs", "normal,cauchy"], "--inputs: 'cauchy' is not an input kind; expected a comma "
                                    "list of verifiable, normal, reveal"),
    (["--inputs", ","], "--inputs: no input kind given in ','; expected a comma list of "
                        "verifiable, normal, reveal"),
    (["--inputs"], "--inputs: expected one argument"),
]


def _filtered(args: list) -> list:
    filt = []
    if not any(a.startswith("--collectives") for a in args):
        filt += ["--collectives", "broadcast"]
    if not any(a.startswith("--size") for a in args):
        filt += ["--sizes", "3"]
    return [*args, *filt]


BAD_IDS = [" ".join(a) for a, _ in BAD]
#: the gloo summary's run (--json: d/gloo-summary.json) and the runs each test reads
GLOO_SUMMARY = ("-n", "2", "--backend", "gloo", "--collectives", "broadcast", "--dtypes",
                "float32", "--sizes", "3", "--json")
NEEDS = {**{f"test_argument_error_is_one_line_naming_the_flag[{i}]": [f"bad-{i}"]
            for i in BAD_IDS},
         "test_counts_are_spelled_right_for_one": ["one-rank"],
         "test_require_ncclpy_is_met_by_the_cpu_backend_and_contradicts_gloo": ["require"],
         "test_gloo_summary_says_ncclpy_did_not_run": ["gloo-summary"]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's runs (check_runs.py), started together as the first of their tests
    begins, two at a time: the argument errors (a Python each, no rank) and the three small
    real runs; each test reads its run's output as if it had started it."""
    from ncclpy.check.cpu_side import unavailable
    from ncclpy.info import no_gpu_reason
    d = tmp_path_factory.mktemp("check_args")
    t = {f"bad-{i}": _run(*_filtered(a)) for i, (a, _) in zip(BAD_IDS, BAD)}
    t["one-rank"] = _run("-n", "1", "--collectives", "broadcast", "--dtypes", "int8",
                         "--sizes", "3", "--backend", "gloo")
    t["require"] = _run("--require-ncclpy", "-n", "2", "--collectives", "broadcast",
                        "--dtypes", "i8", "--sizes", "3")
    t["gloo-summary"] = _run(*GLOO_SUMMARY, str(d / "gloo-summary.json"))
    needs = dict(NEEDS)
    gpu = not no_gpu_reason()
    if gpu or unavailable() or importlib.util.find_spec("torch") is None:
        needs.pop("test_require_ncclpy_is_met_by_the_cpu_backend_and_contradicts_gloo")
    if gpu:
        needs.pop("test_gloo_summary_says_ncclpy_did_not_run")
    yield from module_runs(request, t, needs, d)


@pytest.mark.parametrize("args, want", BAD, ids=BAD_IDS)
def test_argument_error_is_one_line_naming_the_flag(request, runs, args, want):
    p = runs[f"bad-{request.node.callspec.id}"]       # ARGS and a one-case filter
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout == ""                            # nothing started
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"ncclpy check: error: {want}"), p.stderr
    assert p.stderr.rstrip().endswith("(see 'ncclpy check -h')")


def test_json_into_a_directory_is_refused_before_the_run(tmp_path):
    p = check("--json", str(tmp_path), "--collectives", "barrier")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (f"ncclpy check: error: --json: {str(tmp_path)!r} is a directory; "
                        f"expected a file name (see 'ncclpy check -h')\n")


def test_json_path_check_leaves_nothing_behind(tmp_path):
    from ncclpy.check.cli import check_output_path
    target = tmp_path / "new.json"
    assert check_output_path(str(target)) == "" and not target.exists()
    target.write_text("keep")
    assert check_output_path(str(target)) == "" and target.read_text() == "keep"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):       # root ignores the mode bits
            pytest.skip("this user can write into a read-only directory (root)")
        assert "Permission denied" in check_output_path(str(ro / "x.json"))
    finally:
        ro.chmod(0o700)


def _listed(*args: str) -> list:
    p = check("--list", "-n", "2", *args)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()[:-1]


def test_ops_select_the_reducing_collectives_only():
    """``--ops premul_sum`` checks premul_sum: no broadcast/all_gather/... cases ride along."""
    keys = _listed("--ops", "sum,premul_sum", "--backend", "gloo")
    colls = {k.split("/")[0] for k in keys}
    assert colls == {"all_reduce", "reduce", "reduce_scatter"}, colls
    assert {k.split("/")[2] for k in keys} == {"sum"}          # gloo refuses premul_sum
    cases, skipped = C.build_matrix(2, backend="nccl", ops=["premul_sum"], sizes="7")
    assert {c.collective for c in cases} == {"all_reduce", "reduce", "reduce_scatter"}
    assert {c.op for c in cases} == {"premul_sum"}
    # a collective named explicitly runs, once per case whatever the op list
    plain = _listed("--collectives", "broadcast,all_reduce", "--sizes", "3")
    with_ops = _listed("--collectives", "broadcast,all_reduce", "--sizes", "3", "--ops",
                       "sum,prod,max")
    bc = [k for k in plain if k.startswith("broadcast/")]
    assert bc and bc == [k for k in with_ops if k.startswith("broadcast/")]


def test_counts_are_spelled_right_for_one(runs):
    """"1 case on 1 rank", "1 combination", never "1 ranks" / "1 combinations"."""
    g = ("--backend", "gloo")
    p = check("--list", "-n", "1", "--collectives", "broadcast", "--dtypes", "int8",
              "--sizes", "3", *g)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "1 case on 1 rank (gloo)", p.stdout
    p = check("--list-skips", "-n", "2", "--collectives", "gather", "--dtypes", "complex64", *g)
    assert p.stdout.splitlines()[-1] == "1 combination skipped on gloo", p.stdout
    p = check("-n", "1", "--collectives", "gather", "--dtypes", "complex64", *g)
    assert p.returncode == 2
    assert "can run on 1 rank (1 combination skipped; see --list-skips)" in p.stderr, p.stderr
    p = runs["one-rank"]                # -n 1 --collectives broadcast --dtypes int8 --sizes 3, *g
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ncclpy check: 1 rank, " in p.stdout and "  1 case, 0 combinations skipped" in p.stdout
    assert "ncclpy check: 1 case on 1 rank (gloo)" in p.stdout
    for bad in ("1 ranks", "1 cases", "1 combinations", "1 torch divergences"):
        assert bad not in p.stdout + p.stderr


def test_check_modules_import_no_circle():
    """No import cycle among ncclpy.check's modules (function-level imports included):
    session imports runner, never the reverse."""
    import ast
    pkg = ROOT / "ncclpy" / "check"
    mods = {f.stem for f in pkg.glob("*.py") if f.stem != "__init__"}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((pkg / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "ncclpy.check."):
                deps.add(node.module.split(".")[2])
        graph[m] = deps & mods
    assert "session" in graph["cli"] and "runner" in graph["session"]

    def reach(start, seen):
        for d in graph[start]:
            if d not in seen:
                seen.add(d)
                reach(d, seen)
        return seen
    cycles = sorted(m for m in mods if m in reach(m, set()))
    assert not cycles, {m: sorted(graph[m]) for m in cycles}


def test_require_ncclpy_is_met_by_the_cpu_backend_and_contradicts_gloo(runs):
    """Without a GPU, ``--backend auto`` runs ncclpy on its CPU backend, which meets
    ``--require-ncclpy``; with ``--backend gloo`` the flag is a contradiction (exit 2)."""
    from ncclpy.check.cpu_side import unavailable
    from ncclpy.info import no_gpu_reason
    if not no_gpu_reason():
        pytest.skip("a GPU is usable here: --backend auto is nccl")
    if unavailable():
        pytest.skip(unavailable())
    pytest.importorskip("torch")
    p = runs["require"]        # --require-ncclpy -n 2 --collectives broadcast --dtypes i8 ...
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert " cases on 2 ranks (cpu vs gloo) " in p.stdout and " 0 failed" in p.stdout, p.stdout
    p = check("--require-ncclpy", "--backend", "gloo", "--collectives", "broadcast")
    assert p.returncode == 2 and "--require-ncclpy with --backend gloo" in p.stderr


def test_gloo_summary_says_ncclpy_did_not_run(runs):
    """``--backend gloo`` (today's run without a GPU) passes (torch matches the reference) but
    never claims ncclpy passed: the summary and the JSON count torch's cases apart."""
    from ncclpy.info import no_gpu_reason
    why = no_gpu_reason()
    if not why:
        pytest.skip("a GPU is usable here: ncclpy runs")
    out = runs.where / "gloo-summary.json"
    p = runs["gloo-summary"]                    # GLOO_SUMMARY out
    assert p.returncode == 0, p.stderr[-2000:]
    tail = p.stdout.splitlines()[-4:]
    assert tail[0].endswith("ncclpy NOT run"), tail
    assert tail[1].startswith("  torch (gloo) vs numpy reference only: ") and \
        "passed bit for bit, 0 failed" in tail[1]
    assert tail[2].startswith("  ncclpy needs a GPU: ")
    import json
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["passed"] == 0 and s["ncclpy_cases"] == 0 and s["passed_torch_only"] == s["cases"]
    assert s["nccl_order_cases"] == 0 and s["exact_nccl_order"] == 0
    assert "ncclpy did not run" in doc["compared"]
    assert doc["header"]["reference"]["exact"].startswith("none: gloo is not NCCL")
    assert {c["reference"] for c in doc["cases"]} == {"rank-order"}
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads((ROOT / "ncclpy" / "check" / "schema.json").read_text()))
