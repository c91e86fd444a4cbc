"""``ncclpy check`` on CPU: torch.distributed's gloo backend against the reference, in real
processes (2, 3 and 4 ranks).  The harness's parts, in process, are
tests/test_check_harness.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from check_runs import module_runs, proc
from ncclpy.check import cases as C

ROOT = Path(__file__).resolve().parents[1]
#: the real runs' tests share ``runs`` (below): on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("test_check_gloo")


def _torch():
    """torch, for the tests that run it or whose ranks run torch's gloo; the harness's own
    parts (merging, inputs, references, refusals before a rank starts) run without it."""
    return pytest.importorskip("torch")


def _env(extra: dict | None = None) -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT"):
        e.pop(k, None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra or {})
    return e


def _cmd(args: tuple, launcher: bool = False) -> list:
    """``ncclpy check ARGS --backend gloo`` (this file checks the gloo run, which a machine
    without a GPU no longer picks by itself: ``--backend auto`` is the CPU backend there)
    unless ARGS name a backend; ``launcher``: under ``ncclpy run -n N``."""
    if "--backend" not in args:
        args = (*args, "--backend", "gloo")
    cmd = [sys.executable, "-m", "ncclpy"]
    if launcher:
        n = args[args.index("-n") + 1]
        return cmd + ["run", "-n", n, "-m", "ncclpy", "check", *args]
    return cmd + ["check", *args]


def run_check(*args: str) -> subprocess.CompletedProcess:
    """``ncclpy check ARGS`` (see :func:`_cmd`), at once (the runs without ranks)."""
    return proc(_cmd(args), _env(), 240.0)()


# -- real runs ------------------------------------------------------------------------------
INJ = ["-n", "2", "--collectives", "reduce_scatter,broadcast", "--dtypes", "float32,int8",
       "--sizes", "0,5"]
INJ_SPECS = ["reduce_scatter:1", "reduce_scatter:*:torch:invert",
             "reduce_scatter:0:reference:bit", "reduce_scatter:1:reference:sign"]
#: the divergence cell (gloo's bool sum); its clean run is the full 2-rank matrix's
DIV = ("-n", "2", "--collectives", "all_reduce", "--dtypes", "bool", "--ops", "sum",
       "--sizes", "7")
ONE = ("-n", "2", "--collectives", "broadcast", "--dtypes", "int8", "--sizes", "3")
#: the runs each test reads (check_runs.py): started together, each once
NEEDS = {"test_full_gloo_matrix[2]": ["full-2"], "test_full_gloo_matrix[3]": ["full-3"],
         "test_full_gloo_matrix[4]": ["full-4"],
         **{f"test_injected_corruption_is_a_mismatch[{s}]": [f"inj-{i}"]
            for i, s in enumerate(INJ_SPECS)},
         "test_corrupted_torch_output_in_a_divergence_cell_is_a_mismatch": ["full-2", "div"],
         "test_inject_needs_the_side_it_corrupts": ["inject-ncclpy", "inject-scramble"],
         "test_json_to_stdout_keeps_the_table_on_stderr": ["json-stdout"],
         "test_run_timeout_stops_the_ranks": ["run-timeout"],
         "test_runs_under_the_launcher_with_rank_env": ["launcher"],
         "test_runs_under_torchrun": ["torchrun"],
         "test_gloo_avg_divergence_model_matches_real_gloo": ["avg"]}


def _table(d: Path) -> dict:
    """Every real run of this file: name -> its run (those given a JSON name write d/NAME)."""
    def check(js: str, *args: str, env: dict | None = None, launcher: bool = False):
        more = ("--json", str(d / f"{js}.json")) if js else ()
        return proc(_cmd((*args, *more), launcher), _env(env), 240.0)
    inj = "NCCLPY_CHECK_INJECT"
    t = {f"full-{n}": check(f"full-{n}", "-n", str(n), "-q") for n in (2, 3, 4)}
    t.update({f"inj-{i}": check(f"inj-{i}", *INJ, env={inj: s}) for i, s in enumerate(INJ_SPECS)})
    t["div"] = check("div", *DIV, env={inj: "all_reduce:0:torch:sign"})
    t["inject-ncclpy"] = check("", *ONE, env={inj: "broadcast:0:ncclpy"})
    t["inject-scramble"] = check("", *ONE, env={inj: "broadcast:0:torch:scramble"})
    t["json-stdout"] = check("", "-n", "2", "--collectives", "broadcast,barrier", "--dtypes",
                             "int8", "--sizes", "3", "--json", "-")
    t["run-timeout"] = check("", "-n", "2", "--run-timeout", "3")   # the matrix needs ~10 s
    t["launcher"] = check("", "-n", "2", "--collectives", "all_to_all,send_recv,barrier",
                          "--dtypes", "float16", "--sizes", "3", launcher=True)
    e = _env()
    e.pop("NCCLPY_DEVICE", None)
    t["torchrun"] = proc([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--standalone", "-m", "ncclpy", "check", "--backend", "gloo",
                          "--collectives", "all_reduce,scatter,barrier", "--dtypes", "float32",
                          "--sizes", "5"], e, 120)
    t["avg"] = partial(_run_avg_script, d, _env())
    return t


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's real runs, started together as the module's tests begin (each a parent
    and its ranks, each rank importing torch): a test reads its run's output as if it had
    started it; the full 2-rank matrix also holds the divergence cell's clean run."""
    needs = NEEDS if importlib.util.find_spec("torch") else {}   # else: the tests skip
    d = tmp_path_factory.mktemp("check_gloo")
    yield from module_runs(request, _table(d), needs, d)


def _summary(out: str) -> str:
    """The summary (its lines, joined)."""
    lines = out.splitlines()
    at = [i for i, ln in enumerate(lines) if " cases on " in ln]
    assert at, out
    return " ".join(ln.strip() for ln in lines[at[-1]:])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_full_gloo_matrix(n, runs):
    """The whole default CPU matrix (every collective, dtype gloo runs, op, size incl. 1 MiB,
    root 0 and n-1, in/out of place), bit for bit against the reference."""
    _torch()
    p = runs[f"full-{n}"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = _summary(p.stdout)
    assert " 0 failed" in s and "(gloo)" in s and "0 within ULP" in s
    assert "ncclpy NOT run torch (gloo) vs numpy reference only:" in s
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "ncclpy" / "check" / "schema.json").read_text())
    doc = runs.json(f"full-{n}")
    jsonschema.validate(doc, schema)      # the documented schema
    want, skipped = C.build_matrix(n, backend="gloo")
    assert doc["exit_code"] == 0 and doc["summary"]["failed"] == 0
    assert doc["summary"]["cases"] == len(want) and doc["summary"]["skipped"] == len(skipped)
    assert doc["summary"]["unsupported"] == 0 and doc["summary"]["within_ulp"] == 0
    assert doc["header"]["backend"] == "gloo" and doc["header"]["world_size"] == n
    assert {c["case"]["collective"] for c in doc["cases"]} == set(C.COLLECTIVES)
    big = [c for c in doc["cases"] if c["case"]["size_label"] == "1MiB"]
    assert {c["case"]["collective"] for c in big} == set(C.COLLECTIVES) - {"barrier"}
    assert {c["case"]["root"] for c in doc["cases"] if c["case"]["collective"] == "scatter"} \
        == {0, n - 1}
    for c in doc["cases"]:
        assert c["status"] in ("pass", "torch divergence"), c
        if c["status"] == "pass" and c["case"]["collective"] != "barrier":
            assert c["torch_ref"] is not False and c["max_ulp"] == 0
        if c["status"] == "torch divergence":     # gloo's bool byte sums, predicted exactly
            assert (c["case"]["dtype"], c["case"]["op"]) == ("bool", "sum")
            assert c["torch_ref"] is False
            assert all(r["t_pred"]["equal"] is not False for r in c["ranks"])
            assert any(r["t_pred"]["equal"] and r["p_ref"]["equal"] is False
                       for r in c["ranks"])
    assert "ncclpy column: needs GPU" in p.stdout


@pytest.mark.parametrize("spec", INJ_SPECS)
def test_injected_corruption_is_a_mismatch(spec, runs):
    """Corrupting torch's output, or the reference the harness compares with, in different ways:
    each is a mismatch with exit status 1 (size 0 has no byte to corrupt and passes)."""
    _torch()
    name = f"inj-{INJ_SPECS.index(spec)}"
    p = runs[name]
    assert p.returncode == 1, p.stdout + p.stderr
    doc = runs.json(name)
    side, how = (spec.split(":") + ["torch", "bit"])[2:4]
    bad = [c for c in doc["cases"] if c["status"] == "fail"]
    assert bad and all(c["case"]["collective"] == "reduce_scatter" and c["case"]["count"] == 5
                       and c["injected"] == f"{side}:{how}" and c["torch_ref"] is False
                       for c in bad)
    assert len(bad) == len([c for c in doc["cases"] if c["case"]["collective"] ==
                            "reduce_scatter" and c["case"]["count"] == 5])
    assert all(c["status"] == "pass" for c in doc["cases"]
               if c["case"]["collective"] == "broadcast" or c["case"]["count"] == 0)
    ranks = "[0, 1]" if ":*:" in spec else f"[{spec.split(':')[1]}]"
    text = " ".join(p.stdout.split())             # the list of failures wraps at 100 columns
    assert f"torch != reference on rank(s) {ranks}" in text
    assert f"corrupted on purpose by NCCLPY_CHECK_INJECT: {side}:{how}" in text
    assert doc["summary"]["failed"] == len(bad) and doc["exit_code"] == 1


def test_corrupted_torch_output_in_a_divergence_cell_is_a_mismatch(runs):
    """A documented divergence excuses only torch's predicted wrong output, nothing else.
    The clean cell is the full 2-rank matrix's case of the same key (the same inputs: they
    depend on the seed, the case and the rank only), which that run found a divergence."""
    _torch()
    clean = runs["full-2"]
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    cell, _ = C.build_matrix(2, backend="gloo", collectives=["all_reduce"], dtypes=["bool"],
                             ops=["sum"], sizes="7")
    keys = {c.key for c in cell}
    assert [c["status"] for c in runs.json("full-2")["cases"] if c["key"] in keys] == \
        ["torch divergence"]
    p = runs["div"]
    assert p.returncode == 1, p.stdout + p.stderr
    (c,) = runs.json("div")["cases"]
    assert c["status"] == "fail" and "prediction" in c["reason"]


def test_inject_needs_the_side_it_corrupts(runs):
    _torch()
    p, q = runs.results("inject-ncclpy", "inject-scramble")
    assert p.returncode == 2 and "no ncclpy column" in p.stderr, p.stdout + p.stderr
    assert q.returncode == 2 and "NCCLPY_CHECK_INJECT" in q.stderr, q.stdout + q.stderr


def test_zero_cases_is_an_error():
    p = run_check("-n", "2", "--collectives", "gather", "--dtypes", "complex64")
    assert p.returncode == 2 and "no case to run" in p.stderr, p.stdout + p.stderr
    p = run_check("-n", "2", "--collectives", "broadcast", "--dtypes", "uint64")
    assert p.returncode == 2 and "see --list-skips" in p.stderr


def test_json_to_stdout_keeps_the_table_on_stderr(runs):
    _torch()
    p = runs["json-stdout"]
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)                 # nothing else on stdout
    assert doc["exit_code"] == 0 and doc["summary"]["passed_torch_only"] == \
        doc["summary"]["cases"] > 0
    assert doc["summary"]["passed"] == 0 and doc["summary"]["ncclpy_cases"] == 0   # gloo only
    assert doc["compared"] == "torch (gloo) vs numpy reference only; ncclpy did not run"
    assert "by collective and dtype:" in p.stderr and " cases on 2 ranks" in p.stderr


def test_run_timeout_stops_the_ranks(runs):
    _torch()
    p = runs["run-timeout"]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "timeout=3 s passed" in p.stderr


def test_runs_under_the_launcher_with_rank_env(runs):
    _torch()
    p = runs["launcher"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[rank 0]" in p.stdout and " 0 failed" in _summary(p.stdout)


def test_runs_under_torchrun(runs):
    _torch()
    p = runs["torchrun"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert " 0 failed" in _summary(p.stdout) and " cases on 2 ranks (gloo)" in p.stdout


def test_cli_listing_and_errors():
    p = run_check("--list-skips", "-n", "2")
    assert p.returncode == 0 and "PREMUL_SUM" in p.stdout and "uint64" in p.stdout
    p = run_check("--list", "-n", "3", "--collectives", "gather", "--dtypes", "int8",
                  "--sizes", "4")
    assert p.returncode == 0 and "gather/int8/-/4/0/oop" in p.stdout
    p = run_check("--ops", "band")
    assert p.returncode == 2 and "--ops" in p.stderr
    p = run_check("--timeout", "0")
    assert p.returncode == 2 and "--timeout" in p.stderr


def test_backend_nccl_needs_a_gpu():
    from ncclpy.check.cli import _gpu_available
    gpu, why = _gpu_available()
    if gpu:
        pytest.skip("a GPU is visible here: tests/gpu/test_check_gpu.py covers --backend nccl")
    p = run_check("--backend", "nccl", "-n", "2")
    assert p.returncode == 2 and "--backend nccl" in p.stderr and why in p.stderr


_GLOO_AVG_SCRIPT = r'''
import json, os, sys, socket
import numpy as np
import torch, torch.distributed as dist, torch.multiprocessing as mp
from ncclpy.semantics import numerics as nm
from ncclpy.check import cases as C, divergences as D, runner as Rn
from ncclpy import reference

# inputs where gloo's sum-then-divide differs from NCCL's premultiply-then-sum
INPUTS = {"float16": [[1025.0, 3.0]] * 3, "float32": [[7.0, 3.3]] * 3,
          "complex64": [[7.0 + 3.3j, 100.1 + 7.0j]] * 3}

def work(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    res = []
    for dt, vals in INPUTS.items():
        ins = [np.array(v, dtype=dt) for v in vals]
        for coll in ("all_reduce", "reduce"):
            case = C.Case(coll, dt, "avg", None, 2, root=0 if coll == "reduce" else None)
            got = Rn.run_case_torch(torch, dist, case, ins[rank], rank, 3, "cpu")
            if coll == "reduce" and rank != 0:
                continue
            pred = D.predicted_outputs(D.divergence("gloo", case), case, ins, 3, "gloo")[rank]
            ref = reference.all_reduce(ins, op="avg", dtype=dt)[rank]
            res.append([coll, dt, nm.as_bits(got, dt).tobytes() == nm.as_bits(pred, dt).tobytes(),
                        nm.as_bits(got, dt).tobytes() == nm.as_bits(ref, dt).tobytes()])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    # forked: the ranks share this process's torch, imported once instead of four times
    mp.start_processes(work, args=(port, sys.argv[1]), nprocs=3, start_method="fork")
'''


def _run_avg_script(d: Path, env: dict) -> subprocess.CompletedProcess:
    """The script above, its 3 ranks' verdicts in d/avg.json."""
    script = d / "avg.py"
    script.write_text(_GLOO_AVG_SCRIPT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, str(script), str(d / "avg.json")], env=env,
                          capture_output=True, text=True, timeout=120)


def test_gloo_avg_divergence_model_matches_real_gloo(runs):
    """On inputs where the two semantics differ, real gloo's AVG output is exactly the
    divergence model's prediction (and not the reference's)."""
    _torch()
    p = runs["avg"]
    assert p.returncode == 0, p.stdout + p.stderr
    rows = runs.json("avg")
    assert len(rows) == 6
    assert all(matches_pred for _, _, matches_pred, _ in rows), rows
    assert not any(matches_ref for _, _, _, matches_ref in rows), rows
