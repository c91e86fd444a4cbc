"""``python -m bench --device cpu``: ncclpy's CPU backend (``--backend ncclpy``) beside torch's
gloo, its figures said to be CPU figures (not NCCL's) in the header and the JSON; what makes no
sense on CPU refused in one line; ``python -m bench.cpu_backend`` (docs/performance.md)."""
from __future__ import annotations

import json
from typing import Dict

import pytest

from bench_jobs import Commands, Job, start_jobs

from ncclpy.errors import ArgumentError

from bench.cli import parse_args

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_cpu_backend")]

_REFUSED = [
    (["--nproc", "0"], "--nproc 0: 0 < 1"),
    (["--nproc", "two"], "--nproc two: 'two' is not an integer"),
    (["--sizes", "1M,8"], "--sizes 1M,8: expected increasing sizes"),
    (["--sizes", "8,1Q"], "--sizes: expected a size such as 8"),
    (["-n", "0"], "-n: expected an integer >= 1, got 0"),
    (["-J", "/nonexistent-ncclpy/x.json"], "-J: cannot write"),
]
_CORRUPT = [
    ("2:4", 4),            # only a rank other than 0 is wrong: still counted
    ("1:2,2:5", 7),        # two ranks, different counts: their sum (a max would say 5)
    ("0:1,1:3,2:6", 10),   # every rank
]


def _jobs(commands: Commands, mktemp) -> Dict[str, Job]:
    """Every command the tests below run, by name (tests/bench_jobs.py)."""
    from gpu_util import cuda_reason
    run = commands.module
    jobs: Dict[str, Job] = {}
    jobs["cupy refused"] = Job(         # the test skips where a GPU is present
        lambda: run("bench", "all_reduce", "--backend", "cupy", "--device", "cpu", timeout=60),
        ["test_no_gpu_and_no_device_flag_never_gives_cpu_figures_by_accident"],
        lambda: bool(cuda_reason()))
    jobs["both"] = Job(lambda js=mktemp("both") / "r.json": (run(
        "bench", "all_reduce", "--device", "cpu", "--backend", "ncclpy,gloo", "--nproc", "2",
        "-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-q", "-d", "float,bfloat16", "-J",
        str(js), timeout=240), js), ["test_cpu_backend_and_gloo_in_one_run_say_what_they_are"])
    jobs["script"] = Job(lambda tmp=mktemp("script"): (run(
        "bench.cpu_backend", "--nproc", "2", "--sizes", "8,64K", "-n", "2", "-w", "1", "-J",
        str(tmp / "cpu.json"), timeout=240), tmp),
        ["test_cpu_backend_script_one_run_per_world_size"])
    for i, (args, _) in enumerate(_REFUSED):
        jobs[f"refused {i}"] = Job(lambda args=args: run("bench.cpu_backend", *args, timeout=60),
                                   ["test_cpu_backend_script_refuses_in_one_line"])
    jobs["ncclpy run --cpu"] = Job(lambda: run(
        "ncclpy", "run", "--cpu", "-n", "2", "-m", "bench", "all_reduce", "-b", "8", "-e", "1K",
        "-f", "32", "-n", "2", "-q", timeout=240),
        ["test_under_ncclpy_run_cpu_the_sweep_measures_the_cpu_backend"])
    for corrupt, _ in _CORRUPT:
        jobs[f"corrupt {corrupt}"] = Job(lambda corrupt=corrupt,
                                         js=mktemp("corrupt") / "r.json": (run(
            "bench", "all_reduce", "--device", "cpu", "--backend", "ncclpy", "--nproc", "3",
            "-b", "256", "-e", "256", "-n", "1", "-w", "1", "-c", "1", "-q", "-J", str(js),
            "--test-corrupt", corrupt, timeout=240), js),
            ["test_wrong_elements_of_every_rank_are_summed"])
    return jobs


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The module's bench runs (real ranks, gloo and the CPU backend), started together in the
    background while its in-process tests run; each test reads its own."""
    yield from start_jobs(request, lambda commands: _jobs(commands, tmp_path_factory.mktemp))


def test_device_cpu_takes_ncclpy_and_torch():
    cfg = parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy,torch-gloo"])
    assert cfg.backends == ["ncclpy", "torch"] and cfg.device == "cpu"
    assert parse_args(["all_reduce", "--device", "cpu"]).backends == ["torch"]   # as before
    assert parse_args(["all_reduce", "--device", "cpu", "--backend", "ncclpy", "-m", "2"]
                      ).agg_iters == 2        # ncclpy's groups work on the CPU backend


@pytest.mark.parametrize("argv, words", [
    (["--backend", "cupy", "--device", "cpu"],
     "--backend cupy: cupy needs a GPU (raw CuPy NCCL has no CPU form); with --device cpu "
     "expected ncclpy or torch"),
    (["--backend", "ncclpy,cupy", "--device", "cpu"], "--backend ncclpy,cupy: cupy needs a GPU"),
    (["--backend", "torch", "--device", "cpu", "--algo", "ring"],
     "--algo ring: needs --backend ncclpy or cupy (a communicator made from NCCL's "
     "environment at init); torch.distributed's gloo runs no NCCL"),
    (["--backend", "ncclpy", "--device", "cpu", "--predict"], "--predict: adds NCCL's estimate"),
    (["--backend", "ncclpy", "--device", "cpu", "-R", "2"], "-R 2: registers buffers with NCCL"),
    (["--backend", "ncclpy", "--device", "cpu", "-M", "1"], "-M 1: reports NCCL's memory"),
    (["--backend", "ncclpy", "--device", "cpu", "-x", "zero"],
     "-x zero: sets NCCL's CTA policy"),
    (["--backend", "ncclpy", "--device", "cpu", "-G", "2"], "-G: CUDA graphs are unsupported"),
    (["--backend", "ncclpy", "--device", "cpu", "--timer", "events"],
     "--timer events: CUDA events are unsupported"),
])
def test_what_makes_no_sense_on_cpu_is_refused(argv, words):
    with pytest.raises(ArgumentError) as e:
        parse_args(["all_reduce", *argv])
    assert str(e.value).startswith(words), str(e.value)
    assert "\n" not in str(e.value)


def test_no_gpu_and_no_device_flag_never_gives_cpu_figures_by_accident(runs):
    from gpu_util import cuda_reason
    if not cuda_reason():
        pytest.skip("a GPU is present: --backend ncclpy runs on it")
    with pytest.raises(ArgumentError, match=r"^--backend ncclpy: no usable GPU here \(.*\); "
                                            r"--device cpu runs ncclpy's CPU backend"):
        parse_args(["all_reduce", "--backend", "ncclpy"])
    cp = runs["cupy refused"]
    assert cp.returncode == 2 and cp.stdout == "" and cp.stderr.count("\n") == 1
    assert cp.stderr.startswith("python -m bench: error: --backend cupy: cupy needs a GPU")


def test_cpu_backend_and_gloo_in_one_run_say_what_they_are(runs):
    """A real run, 2 ranks: both backends measured and checked (#wrong 0), the header and the
    JSON say these are CPU-backend and gloo figures, not NCCL's (nccl-library 0)."""
    cp, js = runs["both"]
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    out = cp.stdout.splitlines()
    assert out[0].endswith("backend=ncclpy/cpu-backend,torch/gloo nccl-library=0"), out[0]
    assert out[1].startswith("# ncclpy/cpu-backend: ncclpy ran on its CPU backend "
                             "(ncclpy.init(device='cpu')")
    assert "these are CPU-backend figures, not NCCL figures; no NCCL and no GPU ran" in out[1]
    assert out[2].startswith("# torch/gloo: torch.distributed's gloo on CPU tensors: gloo "
                             "figures, not NCCL figures")
    assert "ncclpy CPU backend" in cp.stdout and "# Out of bounds values : 0 OK" in cp.stdout
    rows = [ln for ln in out if ln and not ln.startswith("#") and len(ln.split()) == 14]
    assert {ln.split()[-1] for ln in rows} == {"ncclpy", "torch"}
    assert {ln.split()[2] for ln in rows} == {"float", "bfloat16"}
    assert "# Ratios ncclpy / torch" in cp.stdout
    doc = json.loads(js.read_text())
    assert doc["nccl_version"] == 0 and doc["ncclpy"]["device"] == "cpu"
    cpu = doc["ncclpy"]["cpu_backend"]
    assert cpu["ran"] is True and cpu["nccl"] is False and cpu["gpu"] is False
    assert cpu["models_nccl"] == "2.28.9" and "not NCCL figures" in cpu["note"]
    assert set(doc["ncclpy"]["notes"]) == {"ncclpy/cpu-backend", "torch/gloo"}
    assert [b["label"] for b in doc["ncclpy"]["backends"]] == ["ncclpy/cpu-backend",
                                                              "torch/gloo"]
    assert all(r["out_of_place"]["nwrong"] == 0 for r in doc["ncclpy"]["results"])
    assert {r["series"] for r in doc["ncclpy"]["results"]} == {"ncclpy", "torch"}
    assert {r["experiment_name"] for r in doc["results"]} == {""}      # nccl-tests': ncclpy's
    jsonschema = pytest.importorskip("jsonschema")
    from module_run import ROOT
    jsonschema.validate(doc, json.loads((ROOT / "bench" / "schema.json").read_text()))


def test_cpu_backend_script_one_run_per_world_size(runs):
    """bench.cpu_backend: the sweep at exactly the sizes given, per world size, then a
    summary; its JSON keeps the machine and says the figures are not NCCL's."""
    cp, tmp_path = runs["script"]
    js = tmp_path / "cpu.json"
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert cp.stdout.startswith("# python -m bench.cpu_backend: ncclpy's CPU backend vs "
                                "torch's gloo; CPU figures, not NCCL figures")
    assert "# 2 processes: all_reduce float32 sum" in cp.stdout
    doc = json.loads(js.read_text())
    assert doc["sizes"] == [8, 65536] and doc["machine"]["cores"] >= 1
    rows = doc["runs"]["2"]["rows"]
    assert [(r["backend"], r["size"]) for r in rows] == [
        ("ncclpy/cpu-backend", 8), ("torch/gloo", 8), ("ncclpy/cpu-backend", 65536),
        ("torch/gloo", 65536)]
    assert all(r["out_of_place"]["wrong"] == 0 and r["out_of_place"]["time_us"] > 0
               for r in rows)
    assert doc["runs"]["2"]["cpu_backend"]["nccl"] is False
    sweep = json.loads((tmp_path / "cpu.n2.sweep.json").read_text())   # kept beside -J
    assert sweep["ncclpy"]["cpu_backend"]["ran"] is True and sweep["nccl_version"] == 0


@pytest.mark.parametrize("args, words", _REFUSED)
def test_cpu_backend_script_refuses_in_one_line(args, words, runs):
    cp = runs[f"refused {_REFUSED.index((args, words))}"]
    assert cp.returncode == 2 and cp.stdout == "", (cp.stdout, cp.stderr)
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith(f"python -m bench.cpu_backend: error: {words}"), cp.stderr


def test_ncclpy_device_cpu_in_the_environment_means_the_cpu_backend(monkeypatch):
    """Under ``ncclpy run --cpu`` (NCCLPY_DEVICE=cpu) the default device is cpu and the default
    backend ncclpy (its CPU backend), whether or not a GPU is visible; refusals name it."""
    import bench.cli
    monkeypatch.setattr(bench.cli, "_gpu_visible", lambda: True)    # even with a GPU
    monkeypatch.setenv("NCCLPY_DEVICE", "cpu")
    cfg = parse_args(["all_reduce"])
    assert cfg.device == "cpu" and cfg.backends == ["ncclpy"]
    assert parse_args(["all_reduce", "--backend", "ncclpy,gloo"]).backends == ["ncclpy", "torch"]
    with pytest.raises(ArgumentError, match=r"^--backend cupy: cupy needs a GPU \(raw CuPy NCCL "
                                            r"has no CPU form\); with NCCLPY_DEVICE=cpu"):
        parse_args(["all_reduce", "--backend", "cupy"])
    monkeypatch.delenv("NCCLPY_DEVICE")
    assert parse_args(["all_reduce"]).device == "cuda"


def test_under_ncclpy_run_cpu_the_sweep_measures_the_cpu_backend(runs):
    cp = runs["ncclpy run --cpu"]
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "[rank 0] # ncclpy bench " in cp.stdout
    assert "backend=ncclpy/cpu-backend nccl-library=0" in cp.stdout
    assert "[rank 0] # Out of bounds values : 0 OK" in cp.stdout


# -- #wrong is every rank's count, summed -----------------------------------------------------
def test_the_corruption_hook_names_ranks():
    assert parse_args(["all_reduce", "--test-corrupt", "3"]).test_corrupt == {0: 3}
    assert parse_args(["all_reduce", "--test-corrupt", "1:2,2:5"]).test_corrupt == {1: 2, 2: 5}
    assert parse_args(["all_reduce"]).test_corrupt == {}


@pytest.mark.parametrize("corrupt, wrong", _CORRUPT)
def test_wrong_elements_of_every_rank_are_summed(corrupt, wrong, runs):
    """The #wrong column and the JSON's nwrong count the wrong elements of every rank's checked
    output, as nccl-tests' does (a sum over the ranks), out of place and in place."""
    cp, js = runs[f"corrupt {corrupt}"]
    assert cp.returncode == 1, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "# Out of bounds values : 2 FAILED" in cp.stdout
    rows = [ln.split() for ln in cp.stdout.splitlines() if ln and not ln.startswith("#")]
    assert len(rows) == 1 and rows[0][8] == rows[0][12] == str(wrong), rows
    doc = json.loads(js.read_text())
    res = doc["results"][0]
    assert res["out_of_place"]["nwrong"] == res["in_place"]["nwrong"] == wrong
