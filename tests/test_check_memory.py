"""``ncclpy check`` refuses sizes that cannot fit in memory before any rank starts: one line
naming the flag and value as typed, the need per rank and in total against what the machine
has, exit status 2 (issue 38, item 6).  The rule (:mod:`ncclpy.check.memory`) is a lower
bound: a real run needs at least that much (measured here), so nothing that fits is refused;
its GPU half is computed without a GPU from the GPU's size."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_runs import module_runs, proc
from ncclpy.check import cases as C
from ncclpy.check import memory as M

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)
GiB = 1 << 30


def _env() -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "NCCLPY_CHECK_INJECT"):
        e.pop(k, None)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    return e


def _run(*args: str, env: dict = None):
    """``ncclpy check ARGS``: the run, when called."""
    return proc([sys.executable, "-m", "ncclpy", "check", *args], env or _env(), 200)


def _check(*args: str, env: dict = None) -> subprocess.CompletedProcess:
    return _run(*args, env=env)()


def _peak(size: str, env: dict):
    """A 2-rank run's (all_gather of float32 at ``size``) peak RSS of one process, in bytes,
    as a Python that started it reads it: the run, when called."""
    code = ("import resource, subprocess, sys\n"
            "p = subprocess.run([sys.executable, '-m', 'ncclpy', 'check', '-n', '2', "
            "'--collectives', 'all_gather', '--dtypes', 'float32', '--inplace', 'no', "
            f"'-q', '--sizes', {size!r}], capture_output=True, text=True)\n"
            "assert p.returncode == 0, p.stdout + p.stderr\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n")
    return proc([sys.executable, "-c", code], env, 200)


REFUSED = [
    (["--sizes", "1000GiB"], "--sizes 1000GiB: all_to_all of complex128 at 1000GiB "
                             "(67108864000 elements) per block needs at least "),
    (["--size=1,1000GiB", "--collectives", "all_gather", "--dtypes", "float64"],
     "--size 1,1000GiB: all_gather of float64 at 1000GiB (134217728000 elements) per block "
     "needs at least 3.9 TiB of host memory per rank, 7.8 TiB for the 2 ranks on this "
     "machine; this machine has "),
    (["-n", "3", "--sizes", "200000000000", "--collectives", "broadcast", "--dtypes", "int8"],
     "--sizes 200000000000: broadcast of int8 at 200000000000 elements per block needs at "
     "least 558.8 GiB of host memory per rank, 1.6 TiB for the 3 ranks on this machine; "),
]
REFUSED_IDS = ["1000GiB", "typed-size=", "elements"]
NEEDS = {**{f"test_a_size_that_cannot_fit_is_refused_before_any_rank_starts[{i}]": [i]
            for i in REFUSED_IDS},
         "test_the_rule_is_a_lower_bound_of_what_a_run_uses": ["peak-64MiB", "peak-4"]}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """This file's runs (check_runs.py), started together as the first of their tests begins:
    the two 2-rank runs of the lower bound's test (the slow ones) run while the refusals are
    checked; each test reads its run's output as if it had started it."""
    d = tmp_path_factory.mktemp("check_memory")
    t = {i: _run(*args, "--json", str(d / f"{i}.json")) for i, (args, _) in
         zip(REFUSED_IDS, REFUSED)}
    t.update({f"peak-{size}": _peak(size, _env()) for size in ("64MiB", "4")})
    yield from module_runs(request, t, NEEDS, d)


@pytest.mark.parametrize("args, head", REFUSED, ids=REFUSED_IDS)
def test_a_size_that_cannot_fit_is_refused_before_any_rank_starts(request, runs, args, head):
    name = request.node.callspec.id                  # its run: ARGS --json d/NAME.json
    out = runs.where / f"{name}.json"
    p = runs[name]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"ncclpy check: error: {head}"), p.stderr
    assert "(RAM available" in p.stderr or "memory.max" in p.stderr, p.stderr
    assert p.stderr.rstrip().endswith("expected smaller sizes (see 'ncclpy check -h')")
    assert not out.exists()                       # no rank ever ran (a rank writes the JSON)


def test_under_a_launcher_the_refusal_follows_the_announcement():
    e = dict(_env(), RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
             MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    p = _check("--sizes", "1000GiB", "--collectives", "all_reduce", "--dtypes", "int8",
               env=e)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ncclpy check: running as rank 0 of 2")
    # one rank on this host (LOCAL_WORLD_SIZE=1): no total for several ranks
    assert lines[1].startswith("ncclpy check: error: --sizes 1000GiB: all_reduce of int8 at "
                               "1000GiB (1073741824000 elements) per block needs at least "
                               "2.9 TiB of host memory per rank; this machine has "), lines[1]


def test_the_rule_per_collective():
    def case(coll, count, root=None, variant=""):
        return C.Case(coll, "float32", "sum" if coll in ("all_reduce", "reduce",
                                                         "reduce_scatter") else None,
                      None, count, str(count), root, False, variant)
    n = 4
    # (host bytes, GPU bytes) = (4 * (2*in + out), 4 * max(in, out))
    assert M.case_bytes(case("all_reduce", 10), n, 0) == (120, 40)
    assert M.case_bytes(case("all_gather", 10), n, 1) == (4 * (20 + 40), 160)
    assert M.case_bytes(case("reduce_scatter", 10), n, 2) == (4 * (80 + 10), 160)
    assert M.case_bytes(case("gather", 10, root=1), n, 1) == (4 * (20 + 40), 160)
    assert M.case_bytes(case("gather", 10, root=1), n, 0) == (80, 40)
    assert M.case_bytes(case("all_to_all", 10), n, 3) == (4 * (80 + 40), 160)
    assert M.case_bytes(C.Case("barrier", None), n, 0) == (0, 0)
    un = case("all_to_all", 10, variant="uneven")
    counts = C.uneven_counts(10, n)
    send, recv = sum(counts[1]), sum(counts[s][1] for s in range(n))
    assert M.case_bytes(un, n, 1) == (4 * (2 * send + recv), 4 * max(send, recv))


def test_the_rule_against_given_host_and_gpu_sizes_without_a_gpu():
    cases, _ = C.build_matrix(2, backend="nccl", collectives=["all_reduce"], dtypes=["float32"],
                              ops=["sum"], sizes="1GiB")
    # per rank: host 3 GiB (2*in + out), GPU 1 GiB
    kw = dict(host_ranks=2, gpus=1)
    assert M.shortfall(cases, 2, "nccl", "--sizes", "1GiB", host_bytes=6 * GiB,
                       gpu_bytes=2 * GiB, **kw) == ""                  # exactly fits
    assert M.shortfall(cases, 2, "nccl", "--sizes", "1GiB", host_bytes=6 * GiB,
                       gpu_bytes=2 * GiB - 1, **kw) == (
        "--sizes 1GiB: all_reduce of float32 at 1GiB (268435456 elements) per block needs at "
        "least 1.0 GiB of GPU memory per rank, 2.0 GiB for the 2 ranks sharing a GPU; the "
        "smallest GPU here has 2.0 GiB: expected smaller sizes")
    # one GPU each: 1 GiB per GPU fits; the host is then checked
    assert M.shortfall(cases, 2, "nccl", "--sizes", "1GiB", host_bytes=6 * GiB - 1,
                       gpu_bytes=GiB, host_ranks=2, gpus=2).startswith(
        "--sizes 1GiB: all_reduce of float32 at 1GiB (268435456 elements) per block needs at "
        "least 3.0 GiB of host memory per rank, 6.0 GiB for the 2 ranks on this machine; "
        "this machine has 6.0 GiB")
    # the gloo (CPU) path never looks at a GPU
    assert M.shortfall(cases, 2, "gloo", "--sizes", "1GiB", host_bytes=6 * GiB,
                       gpu_bytes=1, **kw) == ""
    assert M.shortfall(cases, 2, "nccl", "--sizes", "1GiB", host_bytes=None,
                       gpu_bytes=None, **kw) == ""                     # nothing known


def test_the_rule_is_a_lower_bound_of_what_a_run_uses(runs):
    """A real 2-rank run's peak RSS per rank grows by at least the rule's host need (the same
    run at 4 elements is the baseline; the two run at once, each measured by its own parent)."""
    def peak(size: str) -> int:
        p = runs[f"peak-{size}"]                  # _peak(size)
        assert p.returncode == 0, p.stdout + p.stderr
        return int(p.stdout.split()[-1])
    runs.start("peak-64MiB", "peak-4")
    cases, _ = C.build_matrix(2, backend="gloo", collectives=["all_gather"], dtypes=["float32"],
                              sizes="64MiB", in_place=[False])
    need = M.largest_need(cases, 2, 1, gpu=False)
    assert need is not None and need.per_rank == 4 * (2 * 16 * 2 ** 20 + 32 * 2 ** 20)
    assert peak("64MiB") - peak("4") >= need.per_rank


def test_host_memory_reads_this_machine():
    have, what = M.host_memory()
    assert have is not None and have > 0 and what.startswith(" (")
    assert M.human_bytes(512) == "512 B" and M.human_bytes(3 * GiB // 2) == "1.5 GiB"


def test_a_gpu_size_refusal_names_gpu_memory():
    """With a GPU (the nccl path): the GPU's size is read without CUDA in this process, and
    a size beyond it is refused naming GPU memory."""
    from ncclpy.launch.placement import visible_gpu_count
    if visible_gpu_count() < 1 or M.gpu_memory() is None:
        pytest.skip("no GPU visible: the GPU rule is tested above with given sizes")
    p = _check("--backend", "nccl", "--sizes", "1000GiB", "--collectives", "all_reduce",
               "--dtypes", "float32")
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert "of GPU memory per rank" in p.stderr and "the smallest GPU here has" in p.stderr
