"""The CPU backend in one process (world size 1, a real store, a real subprocess: installing the
backend is for the whole process): what a user meets outside the collectives -- NCCL's memory
(``comm.mem_alloc``), a GPU asked for in a CPU process, CuPy-only helpers, functions newer than
the NCCL the engine models -- each works or is refused in one line that says what to do."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)

#: one rank on the CPU backend; each probe prints one JSON line: [label, outcome]
PROG = """
    import ctypes, json, os, sys
    import numpy as np
    import ncclpy

    def say(label, fn):
        try:
            out = ["ok", fn()]
        except Exception as e:
            out = [type(e).__name__, str(e)]
        os.write(1, (json.dumps([label, out]) + "\\n").encode())

    comm = ncclpy.init(device="cpu", rank=0, world_size=1, master_addr="127.0.0.1",
                       master_port=int(sys.argv[1]), timeout=60)
    say("repr", lambda: repr(comm))
    b = comm.mem_alloc(4, "float32")
    say("mem_alloc device", lambda: b.device)
    host = np.ctypeslib.as_array((ctypes.c_float * 4).from_address(b.ptr))
    host[:] = [1.0, 2.0, 3.0, 4.0]

    def reduce_it():
        comm.all_reduce(b, op="prod").wait()     # in place on NCCL's memory: x**1 per element
        comm.all_reduce(b, op="sum").wait()
        return host.tolist()
    say("all_reduce on mem_alloc", reduce_it)
    say("mem_free", lambda: comm.mem_free(b))
    say("init device=0", lambda: ncclpy.init("g", device=0, rank=0, world_size=1))
    os.environ["NCCLPY_DEVICE"] = "1"
    say("init NCCLPY_DEVICE=1", lambda: ncclpy.init("g", rank=0, world_size=1))
    say("nccl_empty", lambda: ncclpy.nccl_empty(8))
    say("nccl_allocator", lambda: ncclpy.nccl_allocator())
    say("grow_unique_id", lambda: comm.grow_unique_id())
    comm.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    prog = tmp_path_factory.mktemp("one") / "one.py"
    prog.write_text(textwrap.dedent(PROG))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLPY_", "RANK", "WORLD"))}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, str(prog), str(_free_port())], env=env,
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return dict(json.loads(line) for line in r.stdout.splitlines() if line.startswith("["))


def test_the_communicator_says_it_runs_on_the_cpu_backend(probes):
    assert probes["repr"] == ["ok", "<ncclpy.Communicator 'default' rank 0/1 cpu:0 (CPU backend, "
                                    "open)>"]


def test_ncclpy_memory_is_host_memory_the_communicator_takes(probes):
    assert probes["mem_alloc device"] == ["ok", -1]              # DEVICE_HOST: 'cpu'
    assert probes["all_reduce on mem_alloc"] == ["ok", [1.0, 2.0, 3.0, 4.0]]
    assert probes["mem_free"] == ["ok", None]


@pytest.mark.parametrize("label, src", [("init device=0", "device=0"),
                                        ("init NCCLPY_DEVICE=1", "NCCLPY_DEVICE='1'")])
def test_a_gpu_asked_for_in_a_cpu_process_is_refused_in_one_line(probes, label, src):
    kind, msg = probes[label]
    assert kind == "ArgumentError" and "\n" not in msg, probes[label]
    assert msg.startswith(f"ncclpy.init: {src}: this process runs on the CPU backend"), msg
    assert "either on the GPU or on the CPU backend, not both" in msg


@pytest.mark.parametrize("what", ["nccl_empty", "nccl_allocator"])
def test_cupy_memory_helpers_are_refused_naming_what_works(probes, what):
    kind, msg = probes[what]
    assert kind == "UnsupportedError" and "\n" not in msg, probes[what]
    assert msg.startswith(f"{what}: makes CuPy/torch arrays in NCCL's GPU memory") and \
        "comm.mem_alloc" in msg, msg


def test_a_function_newer_than_the_modelled_nccl_names_the_cpu_backend(probes):
    kind, msg = probes["grow_unique_id"]
    assert kind == "VersionError", probes["grow_unique_id"]
    assert msg == ("ncclCommGetUniqueId needs NCCL >= 2.29.2, and ncclpy's CPU backend models "
                   "NCCL 2.28.9, which lacks it: the CPU backend cannot run ncclCommGetUniqueId "
                   "(on a GPU, NCCL >= 2.29.2 does)"), msg
    assert "upgrade" not in msg
