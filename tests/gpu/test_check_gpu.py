"""GPU: ``ncclpy check -n 2`` and ``-n 4`` on one GPU (``CUDA_VISIBLE_DEVICES=0``: several ranks
per GPU) pass bit for bit, torch.distributed's NCCL backend and ncclpy on the same libnccl,
except documented torch divergences (whose wrong output is predicted exactly) and a bounded set
of known torch refusals; every float reduction the model predicts (NCCL_ALGO=Ring,
NCCL_PROTO=Simple and 2 channels pinned, the rings and tuning table from NCCL's log) is judged
against the prediction and exact against it, on verifiable, random normal and order-revealing
inputs.  Skipped with the reason where CUDA, CuPy, NCCL or a CUDA build of torch is absent.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import requires_gpu

ROOT = Path(__file__).resolve().parents[2]
#: time bounds, innermost first: check's own --run-timeout stops its ranks and reports; then
#: the subprocess timeout; then the test's mark; all below the device tool's 600 s
FULL_RUN_S = 450
FULL_SUBPROCESS_S = 480
FULL_TEST_S = 520
SMALL_RUN_S = 200
SMALL_SUBPROCESS_S = 240
SMALL_TEST_S = 300
#: where ``python -m ncclpy.selftest`` collects the check JSON and output (see its stages)
ARTIFACTS_ENV = "NCCLPY_GPU_ARTIFACTS"


def _torch_cuda_reason() -> str:
    try:
        import torch
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA"
    if not torch.distributed.is_nccl_available():
        return "torch was built without NCCL"
    return ""


def _check(n: int, tmp_path: Path, *extra: str, inject: str = "",
           timeout: float = FULL_SUBPROCESS_S, run_timeout: float = FULL_RUN_S,
           keep: bool = False):
    """Run ``ncclpy check -n N --backend nccl`` on one GPU; (process, JSON document or None).
    ``keep``: copy the JSON and the output where NCCLPY_GPU_ARTIFACTS says, if it is set."""
    assert run_timeout < timeout
    js = tmp_path / f"check{n}.json"
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT", "NCCLPY_DEVICE"):
        env.pop(k, None)
    env["CUDA_VISIBLE_DEVICES"] = "0"                   # every rank on one GPU
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if inject:
        env["NCCLPY_CHECK_INJECT"] = inject
    cmd = [sys.executable, "-m", "ncclpy", "check", "--backend", "nccl", "-n", str(n), "-q",
           "--json", str(js), "--run-timeout", str(run_timeout), *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    doc = json.loads(js.read_text()) if js.exists() else None
    keep_dir = os.environ.get(ARTIFACTS_ENV)
    if keep and keep_dir and os.path.isdir(keep_dir):
        if js.exists():
            shutil.copyfile(js, os.path.join(keep_dir, f"check-n{n}.json"))
        with open(os.path.join(keep_dir, f"check-n{n}.log"), "w") as f:
            f.write(f"$ CUDA_VISIBLE_DEVICES=0 {' '.join(cmd)}\n# exit {p.returncode}\n"
                    f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n")
    return p, doc


def _refusal_domain(case: dict) -> bool:
    """Whether a known torch refusal, or a torch call the check knowingly does not make,
    covers this case's collective/dtype/op."""
    from ncclpy.check import divergences as D
    c = case["case"]
    return any(r.backend == "nccl" and D._has(r.collectives, c["collective"])
               and D._has(r.dtypes, c["dtype"]) and D._has(r.ops, c["op"])
               for r in D.KNOWN_REFUSALS + D.NOT_CALLED)


@requires_gpu
@pytest.mark.timeout(FULL_TEST_S)
@pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.gpu_world(n)) for n in (2, 4)])
def test_check_on_one_gpu_is_bitwise(n, tmp_path):
    why = _torch_cuda_reason()
    if why:
        pytest.skip(why)
    p, doc = _check(n, tmp_path, "--inputs", "verifiable", keep=True)
    out = p.stdout[-6000:] + p.stderr[-3000:]
    assert doc is not None, out
    h = doc["header"]
    assert h["backend"] == "nccl" and "ncclpy_error" not in h, out
    # both sides on one libnccl (same real path, same version, one file mapped)
    lib = h["libnccl"]
    assert lib["same"] and not lib["problems"], lib
    assert lib["torch_libnccl"] == lib["ncclpy_libnccl"] and len(lib["all_libnccl"]) == 1, lib
    assert lib["torch_nccl_version"] == lib["ncclpy_nccl_version"], lib
    assert "torch libnccl:" in p.stdout and "ncclpy libnccl:" in p.stdout
    for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        assert any(s.startswith(k + "=") for s in h["pinned"] + h["kept"]), k
    assert p.returncode == 0 and doc["summary"]["failed"] == 0, out
    assert doc["summary"]["within_ulp"] == 0, out
    cases = doc["cases"]
    for c in cases:
        assert c["status"] in ("pass", "torch divergence", "unsupported"), c
        if c["status"] == "pass" and c["case"]["collective"] != "barrier":
            assert c["ncclpy_torch"] is not False and c["ncclpy_ref"] is True, c
        if c["status"] == "torch divergence":
            assert c["ncclpy_ref"] is True, c          # ncclpy itself must be right
            assert all(r["t_pred"]["equal"] is not False for r in c["ranks"]), c
    divs = {(c["case"]["dtype"], c["case"]["op"]) for c in cases
            if c["status"] == "torch divergence"}
    assert divs <= {("bfloat16", "premul_sum")}, divs
    # unsupported: only known torch refusals, within their domain, and a minority of the run
    uns = [c for c in cases if c["status"] == "unsupported"]
    assert all(_refusal_domain(c) for c in uns), [c["key"] for c in uns if not _refusal_domain(c)]
    assert len(uns) <= sum(_refusal_domain(c) for c in cases)
    assert len(uns) <= 0.3 * len(cases), len(uns)
    assert all(c["ncclpy_ref"] is not False for c in uns)
    cc = tuple(int(x) for x in h["compute_capability"].split("."))
    fp8_red = [s for s in doc["skipped"] if (s["dtype"] or "").startswith("float8") and s["op"]]
    assert bool(fp8_red) == (cc < (9, 0)), (cc, fp8_red)
    assert {c["case"]["collective"] for c in cases if c["status"] == "pass"} >= {
        "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
        "gather", "scatter", "send_recv", "barrier"}
    _every_predictable_case_exact(doc, out)


def _predictable(case: dict) -> bool:
    """A case the model must predict on the pinned GPU run: a float reduction of one element
    or more (complex types as their float pairs)."""
    from ncclpy.check import exact as X
    from ncclpy.check.cases import Case
    c = case["case"]
    return c["collective"] != "barrier" and not X.static_reason(Case(**c))


def _every_predictable_case_exact(doc: dict, out: str) -> None:
    """Every predictable case was judged against NCCL's order (no fallback: the log had every
    line, NCCL's call lines confirm the predicted algorithm, protocol and channels) and both
    sides gave the predicted bits; the summary counts them apart."""
    cases = doc["cases"]
    pred = [c for c in cases if _predictable(c) and c["status"] != "unsupported"]
    assert pred, out
    fell_back = [(c["key"], c.get("reference_reason")) for c in pred
                 if c.get("reference") != "nccl-order"]
    assert not fell_back, fell_back[:10]
    off = [(c["key"], c.get("nccl_order_diff"), c.get("reason")) for c in pred
           if not c.get("exact_nccl_order") and c["status"] != "torch divergence"]
    assert not off, off[:10]
    assert all(c["torch_reference"] == "nccl-order" for c in pred)
    assert all(c["basis"].startswith("from NCCL's source") for c in pred)
    h, s = doc["header"], doc["summary"]
    assert h["reference"]["short"] == {k: "ring/simple on 2 channels" for k in
                                       ("all_reduce", "reduce", "reduce_scatter")}, h["reference"]
    diverged = sum(c["status"] == "torch divergence" for c in pred)
    assert s["nccl_order_cases"] >= len(pred) and \
        s["exact_nccl_order"] >= len(pred) - diverged, s
    assert "exact vs NCCL's order: " in out


@requires_gpu
@pytest.mark.timeout(SMALL_TEST_S)
@pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.gpu_world(n)) for n in (2, 4)])
def test_random_inputs_are_exact_against_nccls_order(n, tmp_path):
    """Seeded normals and order-revealing inputs (where every order gives different bits):
    ncclpy's and torch's all_reduce, reduce and reduce_scatter equal the model's prediction bit
    for bit in every predictable case, at sizes that cut the call into loops and chunks on both
    channels."""
    why = _torch_cuda_reason()
    if why:
        pytest.skip(why)
    p, doc = _check(n, tmp_path, "--inputs", "normal,reveal", "--collectives",
                    "all_reduce,reduce,reduce_scatter", "--sizes", "1,7,4100,65537,1MiB",
                    timeout=SMALL_SUBPROCESS_S, run_timeout=SMALL_RUN_S)
    out = p.stdout[-6000:] + p.stderr[-3000:]
    assert doc is not None, out
    assert doc["header"]["backend"] == "nccl" and "ncclpy_error" not in doc["header"], out
    assert {c["case"]["inputs"] for c in doc["cases"]} == {"normal", "reveal"}, out
    assert p.returncode == 0 and doc["summary"]["failed"] == 0, out
    assert doc["summary"]["within_ulp"] == 0, out
    _every_predictable_case_exact(doc, out)


@requires_gpu
@pytest.mark.timeout(SMALL_TEST_S)
@pytest.mark.gpu_world(2)
@pytest.mark.parametrize("spec,column", [("all_reduce:0", "ncclpy_torch"),
                                         ("all_reduce:1:ncclpy:bit", "ncclpy_ref"),
                                         ("all_reduce:*:reference:sign", "ncclpy_ref")])
def test_injected_corruption_fails_on_gpu(spec, column, tmp_path):
    why = _torch_cuda_reason()
    if why:
        pytest.skip(why)
    p, doc = _check(2, tmp_path, "--collectives", "all_reduce", "--dtypes", "float32",
                    "--sizes", "8", inject=spec, timeout=SMALL_SUBPROCESS_S,
                    run_timeout=SMALL_RUN_S)
    assert p.returncode == 1, p.stdout + p.stderr
    bad = [c for c in doc["cases"] if c["status"] == "fail"]
    assert bad and all(c[column] is False and c.get("injected") for c in bad), bad


@requires_gpu
@pytest.mark.timeout(SMALL_TEST_S)
@pytest.mark.gpu_world(2)
def test_check_on_symmetric_windows_is_bitwise(tmp_path):
    """--window: ncclpy's symmetric collectives on NCCL memory registered as windows, bit for
    bit against torch and the reference (NCCL >= 2.27)."""
    why = _torch_cuda_reason()
    if why:
        pytest.skip(why)
    p, doc = _check(2, tmp_path, "--window", "--collectives",
                    "all_reduce,all_gather,reduce_scatter,broadcast,gather",
                    "--dtypes", "float32,bfloat16,int32", "--sizes", "0,8,4100",
                    timeout=SMALL_SUBPROCESS_S, run_timeout=SMALL_RUN_S)
    out = p.stdout[-4000:] + p.stderr[-2000:]
    assert doc is not None, out
    h = doc["header"]
    if "needs NCCL >= 2.27" in h.get("ncclpy_error", ""):
        pytest.skip(h["ncclpy_error"])
    assert h["window"] is True and "ncclpy_error" not in h, out
    assert p.returncode == 0 and doc["summary"]["failed"] == 0, out
    assert "--window: ncclpy's all_reduce" in p.stdout, out
    done, asked = h["windows_registered"]
    assert asked > 0 and 0 <= done <= asked and f"NCCL registered {done} of the {asked}" \
        in p.stdout, out
    ran = {c["case"]["collective"] for c in doc["cases"] if c["status"] == "pass"}
    assert ran >= {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "gather"}, ran


def _nccl_legacy_reason() -> str:
    """'' when torch can run both of its NCCL backends here, else why not."""
    why = _torch_cuda_reason()
    if why:
        return why
    from ncclpy.check import torch_backends as TB
    version, offered = TB.offered_backends()
    if "nccl-legacy" not in offered:
        return (f"torch {version} has no nccl-legacy backend (torch 2.15 and newer have it; "
                f"its NCCL backends: {', '.join(offered)})")
    return ""


@requires_gpu
@pytest.mark.timeout(SMALL_TEST_S)
@pytest.mark.gpu_world(2)
def test_check_compares_each_torch_nccl_backend(tmp_path):
    """``--torch-backend nccl,nccl-legacy`` (torch >= 2.15: "nccl" is a new implementation,
    "nccl-legacy" the previous one): every case through both, each against ncclpy and the
    reference; the header names the implementation torch really ran and whether the tables
    were validated with it; the previous implementation passes as the tables say."""
    why = _nccl_legacy_reason()
    if why:
        pytest.skip(why)
    import torch.distributed as dist
    from ncclpy.check import divergences as D
    p, doc = _check(2, tmp_path, "--torch-backend", "nccl,nccl-legacy", "--dtypes",
                    "float32,bfloat16,int32", "--sizes", "0,7,4100",
                    timeout=SMALL_SUBPROCESS_S, run_timeout=SMALL_RUN_S)
    out = p.stdout[-6000:] + p.stderr[-3000:]
    assert doc is not None, out
    h = doc["header"]
    assert "ncclpy_error" not in h and h["libnccl"]["same"], out
    tbs = {t["name"]: t for t in h["torch_backends"]}
    assert list(tbs) == ["nccl", "nccl-legacy"], tbs
    assert tbs["nccl-legacy"]["implementation"] == "ProcessGroupNCCL", tbs
    # which class "nccl" is depends on the torch build's default (pytorch#191272 added the
    # new one behind TORCH_DIST_USE_NCCL2=1, #192281 made it the default): only the variable,
    # when set, says which; the header must name what ran
    assert tbs["nccl"]["implementation"] in ("ProcessGroupNCCL", "ProcessGroupNCCL2"), tbs
    forced = os.environ.get("TORCH_DIST_USE_NCCL2")
    if forced in ("0", "1") and hasattr(dist, "ProcessGroupNCCL2"):
        assert tbs["nccl"]["implementation"] == ("ProcessGroupNCCL2" if forced == "1" else
                                                 "ProcessGroupNCCL"), tbs
    for name, t in tbs.items():
        assert t["tables"] == D.tables_status(h["torch"], "nccl", t["implementation"]), t
        assert f"torch backend {name}: {t['implementation']}; " in p.stdout, out
        if not t["tables"]["validated"]:
            assert t["tables"]["note"].endswith("divergences listed as found, not as known")
    by = doc["by_torch_backend"]
    assert set(by) == set(tbs) and by["nccl"]["cases"] == by["nccl-legacy"]["cases"] > 0, by
    for name in tbs:
        recs = [c for c in doc["cases"] if c["torch_backend"] == name]
        assert len(recs) == by[name]["cases"] and by[name]["ncclpy_cases"] == len(recs), name
        # ncclpy itself is right in every record, whichever torch it is compared with
        assert all(c["ncclpy_ref"] is not False for c in recs), \
            [c["key"] for c in recs if c["ncclpy_ref"] is False]
        for c in recs:
            if c["status"] == "fail":          # a failure can only be torch's
                assert "ncclpy != reference" not in c.get("reason", ""), c
    legacy = by["nccl-legacy"]
    assert legacy["failed"] == 0 and legacy["within_ulp"] == 0, out
    assert (p.returncode == 0) == (doc["summary"]["failed"] == 0 and not doc["problems"]), out
    assert "torch backends nccl, nccl-legacy each against ncclpy and the reference:" in p.stdout
