"""Stand-ins for an MPI launcher and nccl-tests' programs, for testing bench.nccl_tests_side on a
machine without a GPU (what they print and write is theirs, never nccl-tests' figures).

``python tests/nccl_tests_fakes.py mpiexec -n 1 PROG ARGS : -n 1 PROG ARGS``: runs each block
at once with ``PMI_RANK`` set to its index (as MPICH's hydra does), exits with the worst status.

``python tests/nccl_tests_fakes.py perf ARGS``: nccl-tests' flags (-b -e -f -n -w -c -G -C -J);
rank 0 writes a JSON of nccl-tests' layout (util.cu's writer, version 3: ``results`` with
``out_of_place.time`` or, under -C 1, ``cpu_time``).  Its environment steers it:
``FAKE_NT_FAIL=1`` prints nccl-tests' message for a machine without a usable GPU and exits 2;
``FAKE_NT_HANG=FILE`` appends its pid to FILE and sleeps 120 s (a hung program), only when its
arguments hold ``FAKE_NT_HANG_ON`` where that is set (``-C``: only the cputime runs), in a
session of its own with ``FAKE_NT_SETSID=1`` (as a launcher's ranks may be: out of the
launcher's process group); ``FAKE_NT_FAULT_AFTER=FILE`` prints a CUDA fault that reaches every
process on the GPU and exits 1 once FILE exists (a device wrecked by a stopped run);
``FAKE_NT_WRONG=N`` finds N wrong elements at the first size, out of place and in place, and
exits 1 after writing its JSON (common.cu's run() on wrong elements); ``FAKE_NT_VERSION=1``
prints the ``# nccl-tests version`` header line; ``FAKE_NT_NCCL`` is the ``nccl_version`` it
reports (default 0, what the bench's CPU backend reports).

:func:`fake_programs` and :func:`run_side` put them to work for the tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]


def _bytes(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def mpiexec(argv: List[str]) -> int:
    blocks, cur = [], []
    for a in argv:
        if a == ":":
            blocks.append(cur)
            cur = []
        else:
            cur.append(a)
    blocks.append(cur)
    procs = []
    for rank, b in enumerate(blocks):
        assert b[:2] == ["-n", "1"], b
        procs.append(subprocess.Popen(b[2:], env=dict(os.environ, PMI_RANK=str(rank))))
    return max(p.wait(60) for p in procs)


def perf(argv: List[str]) -> int:
    opts: Dict[str, str] = {}
    it = iter(argv)
    for a in it:
        opts[a] = next(it)
    if os.environ.get("FAKE_NT_HANG") and os.environ.get("FAKE_NT_HANG_ON", "") in ("", *argv):
        if os.environ.get("FAKE_NT_SETSID"):
            os.setsid()
        with open(os.environ["FAKE_NT_HANG"], "a") as f:     # where it says its pid
            f.write(f"{os.getpid()}\n")
        time.sleep(120)
    after = os.environ.get("FAKE_NT_FAULT_AFTER")
    if after and os.path.exists(after):
        print("vm: Test CUDA failure common.cu:1067 'an illegal memory access was "
              "encountered'", flush=True)
        return 1
    if os.environ.get("FAKE_NT_VERSION"):
        print("# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library=22809")
    if os.environ.get("FAKE_NT_FAIL"):             # after the header, as nccl-tests
        print("vm: Test CUDA failure util.cu:674 'CUDA driver version is insufficient for CUDA "
              "runtime version'\n .. vm pid 1: Test failure common.cu:1454", flush=True)
        return 2
    if os.environ.get("PMI_RANK", "0") != "0":
        return 0
    cputime = opts.get("-C", "0") == "1"
    checked = int(opts.get("-c", "1")) > 0
    wrong = int(os.environ.get("FAKE_NT_WRONG", "0")) if checked else 0
    results = []
    size, top = _bytes(opts["-b"]), _bytes(opts["-e"])
    while size <= top:
        t = 10.0 + size / 1e3
        bw = size / t / 1e3
        side = {("cpu_time" if cputime else "time"): 5.0 if cputime else t, "alg_bw": bw,
                "bus_bw": bw, "nwrong": float(wrong if not results else 0) if checked else None}
        results.append({"size": size, "count": size // 4, "type": "float", "redop": "sum",
                        "root": "    -1", "out_of_place": side, "in_place": dict(side),
                        "actual_iterations": int(opts["-n"]), "experiment_name": ""})
        size *= int(opts.get("-f", "2"))
    doc = {"version": 3, "args": [sys.argv[0], *argv],
           "env": [f"{k}={v}" for k, v in sorted(os.environ.items())],
           "nccl_version": int(os.environ.get("FAKE_NT_NCCL", "0")),
           "config": {"graph": int(opts.get("-G", "0")), "devices": [
               {"rank": 0, "device": int(os.environ.get("NCCL_TESTS_DEVICE", "-1")),
                "device_info": "fake GPU"}]},
           "results": results, "out_of_bounds": {"count": 2 if wrong else 0,
                                                  "okay": not wrong}}
    with open(opts["-J"], "x") as f:
        json.dump(doc, f)
    return 1 if wrong else 0


def fake_programs(tmp_path: Path) -> Path:
    """mpiexec in tmp/bin, all_reduce_perf and sendrecv_perf in tmp/nt: the stand-ins."""
    for d, names, kind in (("bin", ("mpiexec",), "mpiexec"),
                           ("nt", ("all_reduce_perf", "sendrecv_perf"), "perf")):
        (tmp_path / d).mkdir(exist_ok=True)
        for n in names:
            p = tmp_path / d / n
            p.write_text(f"#!/bin/sh\nexec {sys.executable} {__file__} {kind} \"$@\"\n")
            p.chmod(0o755)
    return tmp_path / "nt"


def side_argv(tmp_path: Path, *args: str) -> List[str]:
    """``python -m bench.nccl_tests_side`` with the stand-ins, on cpu, a tiny sweep."""
    return [sys.executable, "-m", "bench.nccl_tests_side", "--out", str(tmp_path / "out"),
            "--nccl-tests", str(fake_programs(tmp_path)), "--mpirun",
            str(tmp_path / "bin" / "mpiexec"), "--device", "cpu", "-b", "8", "-e", "64",
            "--small", "32", "-n", "2", "-w", "0", "--budget", "200", *args]


def run_side(tmp_path: Path, *args: str, **env: str
             ) -> Tuple["subprocess.CompletedProcess[str]", Dict[str, Any], Path]:
    """(the finished call, its JSON, its --out folder)."""
    p = subprocess.run(side_argv(tmp_path, *args), cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    out = tmp_path / "out"
    return p, json.loads((out / "nccl-tests-side.json").read_text()), out


if __name__ == "__main__":
    sys.exit(mpiexec(sys.argv[2:]) if sys.argv[1] == "mpiexec" else perf(sys.argv[2:]))
