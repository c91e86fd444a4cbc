"""``ncclpy check`` and torch's versions and backends (issue 38, item 3): the header and JSON
record torch's version and the backend implementation torch really ran; the divergence and
refusal tables are keyed by the torch versions they were validated with, and a run on another
torch says so; ``--torch-backend`` is parsed and refused in one line.  CPU only; the GPU run of
``--torch-backend nccl,nccl-legacy`` is tests/gpu/test_check_gpu.py's."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_runs import module_runs, proc
from ncclpy.check import compare as K
from ncclpy.check import divergences as D
from ncclpy.check import torch_backends as TB



def _torch():
    """(torch, torch.distributed), for the tests that read torch's version or backends or run
    it; the tables and the argument checks run without it."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    return torch, dist

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "ncclpy" / "check" / "schema.json").read_text())
SMALL = ("--collectives", "all_reduce,barrier", "--dtypes", "bool,float32", "--sizes", "7",
         "-q", "--backend", "gloo")


def _env() -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT"):
        e.pop(k, None)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    return e


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncclpy", "check", *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=240)


def _job(mode: str, js: Path):
    """tests/torch_backends_job.py MODE JS SMALL: the run, when called."""
    return proc([sys.executable, str(ROOT / "tests" / "torch_backends_job.py"), mode, str(js),
                 *SMALL], _env(), 300)


NEEDS = {"test_header_and_json_record_torch_and_its_backend": ["header"],
         "test_a_torch_the_tables_were_not_validated_with_is_said_in_the_summary":
         ["unvalidated"],
         "test_two_torch_groups_are_each_checked_against_the_reference": ["two"]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's three 2-rank runs (check_runs.py), started together as the first of their
    tests begins: each test reads its run's output and JSON as if it had started the run."""
    d = tmp_path_factory.mktemp("check_torch_backends")
    t = {"header": proc([sys.executable, "-m", "ncclpy", "check", "-n", "2", *SMALL, "--json",
                         str(d / "header.json")], _env(), 240),
         "unvalidated": _job("unvalidated", d / "unvalidated.json"),
         "two": _job("two", d / "two.json")}
    yield from module_runs(request, t, NEEDS if importlib.util.find_spec("torch") else {}, d)


def _validate(doc: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, SCHEMA)


def _summary(out: str) -> list:
    lines = out.splitlines()
    at = [i for i, ln in enumerate(lines) if " cases on " in ln]
    assert at, out
    return lines[at[-1]:]


# -- the tables and the versions they were validated with -----------------------------------
def test_torch_minor():
    assert D.torch_minor("2.15.0+cu132") == "2.15"
    assert D.torch_minor("2.13.0+cpu") == "2.13"
    assert D.torch_minor("2.16.0a0+git123") == "2.16"


def test_tables_are_keyed_by_the_torch_they_were_validated_with():
    assert ("ProcessGroupNCCL", "2.11") in D.VALIDATED["nccl"]
    assert {("ProcessGroupGloo", "2.13"), ("ProcessGroupGloo", "2.15")} <= \
        set(D.VALIDATED["gloo"])
    ok = D.tables_status("2.11.0+cu130", "nccl", "ProcessGroupNCCL")
    assert ok["validated"] and ok["torch"] == "2.11"
    assert ok["note"] == "tables validated with torch 2.11; this is torch 2.11"
    # torch 2.15's "nccl" is a new implementation: the same version numbers would not do
    new = D.tables_status("2.15.0+cu132", "nccl", "ProcessGroupNCCL2")
    assert not new["validated"] and new["validated_with"] == ["ProcessGroupNCCL torch 2.11"]
    assert new["note"] == ("tables validated with torch 2.11 (ProcessGroupNCCL); this is torch "
                           "2.15 (ProcessGroupNCCL2): divergences listed as found, not as known")
    legacy = D.tables_status("2.15.0+cu132", "nccl", "ProcessGroupNCCL")
    assert not legacy["validated"]
    assert legacy["note"].endswith("this is torch 2.15: divergences listed as found, not as known")
    assert D.tables_status("2.13.0+cpu", "gloo", "ProcessGroupGloo")["validated"]
    assert D.tables_status("2.15.0+cu132", "gloo", "ProcessGroupGloo")["validated"]
    assert not D.tables_status("2.14.1", "gloo", "ProcessGroupGloo")["validated"]
    assert "no torch for backend ucc" in D.tables_status("2.15.0", "ucc", "X")["note"]


# -- header and JSON of a real run ----------------------------------------------------------
def test_header_and_json_record_torch_and_its_backend(runs):
    torch, dist = _torch()
    p = runs["header"]                              # -n 2 SMALL --json
    assert p.returncode == 0, p.stdout + p.stderr
    doc = runs.json("header")
    _validate(doc)
    h = doc["header"]
    assert h["torch"] == torch.__version__            # with the wheel's local tag
    [tb] = h["torch_backends"]
    pg = dist.ProcessGroupGloo.__name__
    assert tb["name"] == "gloo" and tb["implementation"] == pg
    # every torch this suite runs with (2.13, 2.15) is one the gloo tables were validated with
    assert tb["tables"] == D.tables_status(torch.__version__, "gloo", pg)
    assert tb["tables"]["validated"], tb
    assert f"  torch backend gloo: {pg}; {tb['tables']['note']}" in p.stdout
    assert "not as known" not in p.stdout
    assert {c["torch_backend"] for c in doc["cases"]} == {"gloo"}
    assert doc["by_torch_backend"] == {"gloo": doc["summary"]}


def test_a_torch_the_tables_were_not_validated_with_is_said_in_the_summary(runs):
    """The tables' record names torch 2.11 for gloo: the run still reports (the bool sum is
    still recognised), but the header, the list of divergences and the summary's last line
    say that they were found on this torch, not known."""
    torch, _ = _torch()
    p = runs["unvalidated"]
    assert p.returncode == 0, p.stdout + p.stderr
    doc = runs.json("unvalidated")
    _validate(doc)
    [tb] = doc["header"]["torch_backends"]
    minor = D.torch_minor(torch.__version__)
    note = (f"tables validated with torch 2.11; this is torch {minor}: divergences listed as "
            f"found, not as known")
    assert tb["tables"]["validated"] is False and tb["tables"]["note"] == note
    summary = _summary(p.stdout)
    assert summary[-1] == "  " + note, summary
    assert "torch divergences found (tables not validated with this torch" in p.stdout
    assert doc["summary"]["torch_divergence"] == 1 and doc["exit_code"] == 0
    assert all(len(ln) <= 100 for ln in p.stdout.splitlines()), p.stdout


def test_two_torch_groups_are_each_checked_against_the_reference(runs):
    """The path of ``--torch-backend a,b`` on CPU: two gloo groups, every case through each,
    one record per case and group, a report section and a summary per group."""
    _torch()
    p = runs["two"]
    assert p.returncode == 0, p.stdout + p.stderr
    doc = runs.json("two")
    _validate(doc)
    names = [tb["name"] for tb in doc["header"]["torch_backends"]]
    assert names == ["gloo", "gloo-again"]
    by = doc["by_torch_backend"]
    assert set(by) == set(names) and by["gloo"] == by["gloo-again"]
    assert by["gloo"]["torch_divergence"] == 1 and by["gloo"]["failed"] == 0
    assert doc["summary"]["cases"] == 2 * by["gloo"]["cases"]
    for b in names:
        recs = [c for c in doc["cases"] if c["torch_backend"] == b]
        assert len(recs) == by[b]["cases"]
        for c in recs:
            if c["status"] == "torch divergence":     # predicted on every rank, per group
                assert all("t_pred" in r for r in c["ranks"]), c
        barrier = [c for c in recs if c["case"]["collective"] == "barrier"]
        assert barrier and barrier[0]["status"] == "pass" and barrier[0]["torch_ref"] is True
    for b in names:
        assert f"== torch backend {b} (ProcessGroupGloo) vs ncclpy and the reference ==" \
            in p.stdout
        assert f"cases on 2 ranks ({b}) in " in p.stdout
    assert p.stdout.rstrip().endswith("torch backends gloo, gloo-again each against ncclpy "
                                      "and the reference: 0 failed in all")


def test_backend_parts_take_each_backends_verdicts_apart():
    eq, ne = K.Comparison(True).as_dict(), K.Comparison(False, 1.0, 1, 0).as_dict()
    parts = [{"rank": r, "n_ref": eq, "barrier": {"ncclpy": (0.0, 1.0)},
              "by_torch_backend": {"nccl": {"t_ref": eq, "barrier": {"torch": (0.0, 2.0)}},
                                   "nccl-legacy": {"t_ref": ne, "torch_exc": "E: x"}}}
             for r in range(2)]
    a = K.backend_parts(parts, "nccl")
    assert a[0] == {"rank": 0, "n_ref": eq, "t_ref": eq,
                    "barrier": {"ncclpy": (0.0, 1.0), "torch": (0.0, 2.0)}}
    b = K.backend_parts(parts, "nccl-legacy")
    assert b[1]["t_ref"] == ne and b[1]["torch_exc"] == "E: x" and "by_torch_backend" not in b[1]
    assert "by_torch_backend" in parts[0]                      # the gathered verdicts stay
    single = [{"rank": 0, "t_ref": eq}]
    assert K.backend_parts(single, "gloo") is not single and K.backend_parts(single, "x") == single


# -- --torch-backend ------------------------------------------------------------------------
def test_parse_torch_backends():
    assert TB.parse_torch_backends("nccl,nccl-legacy") == ["nccl", "nccl-legacy"]
    assert TB.parse_torch_backends(" NCCL-Legacy ,") == ["nccl-legacy"]
    for text, words in ((",", "no backend given in ','"),
                        ("gloo", "'gloo' is not one of torch's NCCL backends; expected a comma "
                                 "list of nccl, nccl-legacy, nccl2, nccl-lazy (the CPU check: "
                                 "--backend gloo)"),
                        ("nccl,NCCL", "'nccl' is given twice in 'nccl,NCCL'")):
        with pytest.raises(ValueError) as e:
            TB.parse_torch_backends(text)
        assert words in str(e.value)


def test_offered_backends_are_what_torch_can_create():
    """Read from torch's metadata without importing it, the same as torch's own answer."""
    torch, dist = _torch()
    version, offered = TB.offered_backends()
    assert version == torch.__version__
    assert offered == [b for b in TB.TORCH_NCCL_BACKENDS if dist.is_backend_available(b)]
    assert TB.refusal(["nccl"], None, []) == "torch is not installed (pip install torch)"
    assert TB.refusal(["nccl"], "2.13.0+cpu", []) == \
        "torch 2.13.0+cpu is a CPU build: it has no NCCL backend"
    assert TB.refusal(["nccl", "nccl-legacy"], "2.13.0+cu130", ["nccl"]) == (
        "torch 2.13.0+cu130 has no 'nccl-legacy' backend (torch 2.15 and newer have it); its "
        "NCCL backends: nccl")
    assert TB.refusal(["nccl", "nccl-legacy"], "2.15.0", ["nccl", "nccl-legacy"]) is None


def _one_line_error(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("text,words", [
    ("gloo", ("--torch-backend: 'gloo' is not one of torch's NCCL backends",)),
    ("nccl,nccl", ("--torch-backend: 'nccl' is given twice",)),
    (",", ("--torch-backend: no backend given",)),
    ("nccl;nccl-legacy", ("'nccl;nccl-legacy' is not one of torch's NCCL backends",))])
def test_torch_backend_refuses_bad_lists_in_one_line(text, words):
    _one_line_error(_check("-n", "2", "--list", "--torch-backend", text), *words)


@pytest.mark.parametrize("extra", [(), ("--backend", "gloo")])
def test_torch_backend_refuses_what_this_machine_cannot_run(extra):
    """A backend this torch lacks is named with the ones it has; one it has needs a GPU run:
    on this machine (no GPU, or --backend gloo) the gloo path is refused, never changed."""
    from gpu_util import cuda_reason
    from ncclpy.check.cpu_side import unavailable
    if not extra and not cuda_reason():
        pytest.skip("a GPU is visible here: tests/gpu/test_check_gpu.py runs --torch-backend")
    run = "gloo" if extra or unavailable() else "cpu"     # auto without a GPU: the CPU backend
    version, offered = TB.offered_backends()
    p = _check("-n", "2", "--list", "--torch-backend", "nccl,nccl-legacy", *extra)
    if run == "cpu":                # the run's own choice first: its torch side is gloo
        _one_line_error(p, "--torch-backend nccl,nccl-legacy: torch's NCCL backends run on a "
                           "GPU (--backend nccl); this run's backend is cpu (no GPU: ")
    elif "nccl-legacy" not in offered:
        why = TB.refusal(["nccl", "nccl-legacy"], version, offered)
        _one_line_error(p, f"--torch-backend nccl,nccl-legacy: {why}")
    else:
        _one_line_error(p, "--torch-backend nccl,nccl-legacy: torch's NCCL backends run on a "
                           "GPU (--backend nccl); this run's backend is gloo (")
    # without the flag, the same machine's run is as before
    q = _check("-n", "2", "--list", *extra)
    assert q.returncode == 0 and q.stdout.rstrip().endswith(f"({run})"), q.stdout + q.stderr
