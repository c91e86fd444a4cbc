"""``ncclpy plan`` (no GPU): the NCCL calls it prints are the communicator's own plans (the same
resolver), in C order with named pointers; its mistakes are one line naming the flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ncclpy.comm.resolver import Resolver
from ncclpy.plan import explain as X
from ncclpy.plan.types import NcclCall, PlanContext

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "ncclpy", "plan", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


CASES = [("all_reduce", {"op": "avg"}), ("reduce", {"root": 1, "op": "max"}),
         ("broadcast", {"root": 2, "in_place": True}), ("all_gather", {}),
         ("all_gather", {"in_place": True}), ("reduce_scatter", {"op": "premul_sum:0.5"}),
         ("all_to_all", {}), ("all_to_all", {"in_place": True}), ("gather", {"root": 1}),
         ("scatter", {"root": 2, "in_place": True}), ("send_recv", {})]


@pytest.mark.parametrize("version", [22700, 23203])
@pytest.mark.parametrize("coll, kw", CASES, ids=[f"{c}-{'-'.join(k)}" for c, k in CASES])
def test_each_rank_gets_the_plan_the_communicator_would_issue(coll, kw, version):
    n, count = 3, 5
    got = X.rank_plans(coll, n, count, "bfloat16", nccl_version=version, **kw)
    assert [rp.rank for rp in got] == [0, 1, 2]
    for rp in got:
        ctx = PlanContext(rp.rank, n, 0, version)
        a, b = X._buffers(coll, rp.rank, n, count, "bfloat16", kw.get("root", 0),
                          kw.get("in_place", False))
        op = kw.get("op", "sum")
        if op.startswith("premul_sum:"):
            from ncclpy.semantics.ops import premul_sum
            op = premul_sum(float(op.split(":")[1]))
        params = X._params(coll, rp.rank, n, op, kw.get("root", 0))
        want = Resolver(ctx).resolve(coll, 0, a, b, params).plan      # the communicator's path
        assert rp.plan.steps == want.steps and rp.plan.path == want.path
        assert rp.plan.scratch_bytes == want.scratch_bytes and rp.plan.group == want.group
        assert any(isinstance(s, NcclCall) for s in rp.plan.steps)


def test_the_text_names_every_argument_in_c_order():
    cp = plan_cli("all_gather", "--count", "1M", "--dtype", "bf16", "-n", "4", "--rank", "2",
                  "--nccl-version", "2.28.9")
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[0].startswith("ncclpy plan: all_gather of 1048576 elements, bfloat16, 4 ranks; "
                               "NCCL 2.28.9 (--nccl-version)")
    assert lines[1:] == ["rank 2: all_gather, path native, 1 NCCL call",
                         "  ncclAllGather(sendbuff=sendbuf+0x0, recvbuff=recvbuf+0x0, "
                         "sendcount=1048576, datatype=ncclBfloat16 (9), comm, stream)"]


def test_list_json_and_the_older_nccl_path(tmp_path):
    cp = plan_cli("gather", "-n", "3", "--count", "8", "--nccl-version", "2.27.0", "--list")
    assert cp.returncode == 0, cp.stderr
    rows = [ln.split("\t") for ln in cp.stdout.splitlines()]
    assert rows[0] == ["0", "0", "cudaMemcpyAsync(dst=recvbuf+0x0, src=sendbuf+0x0, 32 bytes, "
                                 "DeviceToDevice, stream)"]
    assert ["0", "2", "ncclRecv(recvbuff=recvbuf+0x20, count=8, datatype=ncclFloat32 (7), "
                      "peer=1, comm, stream)"] in rows
    assert ["2", "1", "ncclSend(sendbuff=sendbuf+0x0, count=8, datatype=ncclFloat32 (7), "
                      "peer=0, comm, stream)"] in rows
    out = tmp_path / "p.json"
    cp = plan_cli("reduce", "--op", "premul_sum:2", "--dtype", "float16", "--json", str(out))
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(out.read_text())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    steps = doc["ranks"][0]["steps"]
    assert steps[0].startswith("ncclRedOpCreatePreMulSum(&op, scalar=0x0040")
    assert steps[-1] == "ncclRedOpDestroy(op, comm)"


@pytest.mark.parametrize("args, words", [
    (["all_reduce", "--root", "x"], "--root: invalid int value: 'x'"),
    (["reduce", "-n", "2", "--root", "5"], "--root: 5 is not a rank of a world of 2"),
    (["gather", "--dtype", "float33"], "--dtype: dtype 'float33' is not a dtype ncclpy knows"),
    (["all_reduce", "--count", "1.5M"], "--count: expected a number of elements"),
    (["all_reduce", "--nccl-version", "two"], "--nccl-version: expected an NCCL version"),
    (["all_reduce", "--op", "premul_sum:inf"], "--op: premul_sum scalar: expected a finite"),
    (["all_reduce", "--rank", "2"], "--rank: 2 is not a rank of a world of 2"),
    (["all_reduce", "-n", "0"], "-n: expected a number of ranks >= 1, got 0"),
    (["foo"], "collective 'foo' is unknown"),
    (["all_reduce", "--json", "/nonexistent-ncclpy/x.json"], "--json: cannot write"),
])
def test_mistakes_are_one_line_naming_the_flag(args, words):
    cp = plan_cli(*args)
    assert cp.returncode == 2 and cp.stdout == "", cp.stdout
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith(f"ncclpy plan: error: {words}"), cp.stderr


# -- what the header, the refusals and the names say (issue 38, item 11) -----------------------

def test_a_barrier_is_headed_with_what_it_plans(tmp_path):
    cp = plan_cli("barrier")
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[0].startswith("ncclpy plan: barrier (a 1-element float32 all_reduce), 2 ranks; ")
    assert "1048576" not in cp.stdout and "count=1, datatype=ncclFloat32 (7)" in lines[2]
    cp = plan_cli("barrier", "--count", "1M", "--dtype", "i8")     # said, not silently dropped
    assert cp.returncode == 0
    assert cp.stderr == ("ncclpy plan: note: --count, --dtype do not apply to a barrier (a "
                         "1-element float32 all_reduce)\n")
    assert cp.stdout.splitlines()[0].startswith("ncclpy plan: barrier (a 1-element float32 ")
    out = tmp_path / "b.json"
    assert plan_cli("barrier", "--json", str(out)).returncode == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["count"], cfg["dtype"], cfg["op"]) == (1, "float32", "sum")


def test_the_header_counts_and_names_what_is_planned():
    cp = plan_cli("all_reduce", "--count", "1", "--dtype", "f16")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("ncclpy plan: all_reduce of 1 element, float16, 2 ranks; ")


@pytest.mark.parametrize("args, words", [
    (["all_reduce", "--dtype", "e4m3", "--nccl-version", "2.10.0"],
     "all_reduce: dtype 'float8_e4m3' needs NCCL >= 2.24.0; the planned NCCL is 2.10.0 "
     "(--nccl-version)"),
    (["all_reduce", "--op", "avg", "--nccl-version", "2.9.0"],
     "all_reduce: op avg needs NCCL >= 2.10.0; the planned NCCL is 2.9.0 (--nccl-version)"),
    (["all_reduce", "--op", "premul_sum"],
     "--op: 'premul_sum' needs its scalar: write premul_sum:X with a number X (e.g. "
     "premul_sum:0.5)"),
    (["all_reduce", "--op", "foo"],
     "--op: unknown reduction 'foo'; expected sum, prod, max, min, avg or premul_sum:X"),
    (["all_reduce", "--op", "premul_sum:x"], "--op: 'premul_sum:x': expected premul_sum:X"),
    (["ncclAllGatherz"], "collective 'ncclAllGatherz' is unknown; expected one of all_reduce"),
])
def test_refusals_speak_of_the_plan_and_the_cli(args, words):
    cp = plan_cli(*args)
    assert cp.returncode == 2 and cp.stdout == "", cp.stdout
    assert cp.stderr.count("\n") == 1 and cp.stderr.startswith(f"ncclpy plan: error: {words}"), \
        cp.stderr
    assert "loaded NCCL" not in cp.stderr and "ncclpy.premul_sum" not in cp.stderr


def test_the_library_still_names_the_loaded_nccl():
    from ncclpy import errors
    from ncclpy.semantics.dtypes import nccl_dtype
    from ncclpy.semantics.ops import effective_op
    with pytest.raises(errors.UnsupportedError, match="needs NCCL >= 2.24.0; the loaded NCCL is "
                                                      "2.10.0$"):
        nccl_dtype("float8_e4m3", 21000)
    with pytest.raises(errors.UnsupportedError, match="the loaded NCCL is 2.9.0$"):
        effective_op("avg", "float32", 20900)
    with pytest.raises(errors.UnsupportedError, match="the planned NCCL is 2.10.0$"):
        X.rank_plans("all_reduce", 2, 4, "e4m3", nccl_version=21000)


@pytest.mark.parametrize("nccl_name, coll", [
    ("ncclAllGather", "all_gather"), ("ncclAllReduce", "all_reduce"),
    ("ncclAlltoAll", "all_to_all"), ("NCCLREDUCESCATTER", "reduce_scatter"),
    ("ncclBroadcast", "broadcast"), ("AllGather", "all_gather"),
    ("all_gather_perf", "all_gather"), ("ncclSend", "send_recv")])
def test_nccl_names_work_as_the_help_says(nccl_name, coll):
    from ncclpy.semantics import registry
    assert registry.get(nccl_name).name == coll
    assert X.rank_plans(nccl_name, 2, 4)[0].plan.collective == coll
    cp = plan_cli(nccl_name, "--count", "4", "--list")
    assert cp.returncode == 0 and cp.stdout == plan_cli(coll, "--count", "4", "--list").stdout
