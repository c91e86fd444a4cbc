"""GPU tests of the communicator: several ranks (on one GPU if need be) via ncclpy.spawn.

One spawn per world size runs the whole collective x dtype x op matrix inside
(``_gpu_matrix.matrix``); the other features share a few spawns.  Each rank writes one JSON
line per check; the parent collects the failures of every rank into one message.
Skipped with the reason where CUDA, CuPy or NCCL is absent.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Dict, List, Tuple

import pytest

from gpu_util import cuda_reason, requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common as G  # noqa: E402
import _gpu_features as F  # noqa: E402
import _gpu_matrix as M  # noqa: E402

SPAWN_TIMEOUT = 300.0


def _spawn(fn, n: int, outdir: str, monkeypatch) -> Tuple[List[Dict], List[str], str]:
    """Run ``fn(rank, outdir)`` on ``n`` ranks; (records, failure lines, launch error text)."""
    import ncclpy
    # children are started with the 'spawn' method: make this directory importable there too
    root = os.path.dirname(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (HERE, os.path.dirname(HERE), root, os.environ.get("PYTHONPATH", "")) if p))
    launch_error = ""
    try:
        ncclpy.spawn(fn, n, args=(outdir,), timeout=SPAWN_TIMEOUT)
    except Exception as e:  # reported together with what the ranks recorded
        launch_error = f"{type(e).__name__}: {e}"
    records, failures = [], []
    for path in sorted(glob.glob(os.path.join(outdir, "rank*.jsonl"))):
        rank = os.path.basename(path)[4:-6]
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                rec["rank"] = rank
                records.append(rec)
                if not rec["ok"]:
                    failures.append(f"rank {rank} {rec['name']}:\n{rec.get('error', '')}")
    return records, failures, launch_error


def _report(failures: List[str], launch_error: str, limit: int = 25) -> str:
    head = f"{len(failures)} failed checks" + (f"; launch: {launch_error}" if launch_error else "")
    return head + "\n\n" + "\n\n".join(failures[:limit])


def _assert_clean(records, failures, launch_error, min_checks: int) -> None:
    assert not failures and not launch_error, _report(failures, launch_error)
    names = {r["name"] for r in records if not r["name"].startswith("_")}
    assert len(names) >= min_checks, f"only {len(names)} checks ran: {sorted(names)[:20]}"


@requires_gpu
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collective_matrix(world_size, tmp_path, monkeypatch):
    """Every collective x dtype x op, in and out of place, lists, uneven all_to_all, the
    send/recv fallback paths, zero-size buffers, groups and barrier, at this world size."""
    records, failures, err = _spawn(M.matrix, world_size, str(tmp_path), monkeypatch)
    _assert_clean(records, failures, err, min_checks=len(G.ALL_DTYPES) * 50)
    ranks = {r["rank"] for r in records}
    assert len(ranks) == world_size


@pytest.fixture(scope="module")
def misc_run(tmp_path_factory):
    if cuda_reason():
        pytest.skip(cuda_reason())
    mp = pytest.MonkeyPatch()
    try:
        out = str(tmp_path_factory.mktemp("misc"))
        return _spawn(F.misc, 2, out, mp)
    finally:
        mp.undo()


def _feature(run, name: str) -> None:
    records, failures, err = run
    mine = [r for r in records if r["name"] == name]
    bad = [f for f in failures if f.split(":", 1)[0].endswith(" " + name)]
    assert mine, f"check {name!r} never ran; " + _report(failures, err)
    assert not bad, _report(bad, err)
    assert all(r["ok"] for r in mine) and len(mine) == 2, mine


@requires_gpu
def test_work_on_a_side_stream(misc_run):
    """Work.is_completed is False while the stream is held, wait(stream) orders another
    stream after it without blocking the host, wait() blocks the host."""
    _feature(misc_run, "work_side_stream")


@requires_gpu
def test_stream_arguments(misc_run):
    """stream= as a CuPy stream, a raw handle, a __cuda_stream__ object; default = current."""
    _feature(misc_run, "stream_kinds")


@requires_gpu
def test_raw_pointers(misc_run):
    """ncclpy.Buffer(ptr, count, dtype, device) for plain device pointers."""
    _feature(misc_run, "raw_pointers")


@requires_gpu
def test_premul_sum_bf16_raw(misc_run):
    """premul_sum(0.5) on bf16 gives n (the scalar converted to bf16), not zeros."""
    _feature(misc_run, "premul_bf16_raw")


@requires_gpu
def test_large_all_reduce_256MiB(misc_run):
    """A 256 MiB float32 all_reduce, checked element by element on the device."""
    _feature(misc_run, "large_256MiB")


@requires_gpu
def test_cuda_graph_replays_all_reduce(misc_run):
    """An all_reduce captured in a CUDA graph gives the right sums on three replays."""
    _feature(misc_run, "cuda_graph")


@requires_gpu
def test_register_and_mem_alloc(misc_run):
    """ncclMemAlloc'd Buffer, ncclCommRegister/Deregister, ncclMemFree, close() frees rest."""
    _feature(misc_run, "register_mem_alloc")


@requires_gpu
def test_ctypes_communicator_and_split(misc_run):
    """A communicator made by ncclCommInitRankConfig (Config()) runs the collectives through
    ctypes, and splits through ncclCommSplit."""
    _feature(misc_run, "ctypes_comm")


@requires_gpu
def test_nonblocking_communicator(misc_run):
    """Config(blocking=False, comm_name, CTA limits): init, calls, group, finalize, close."""
    _feature(misc_run, "nonblocking_comm")


@requires_gpu
def test_lifecycle(misc_run):
    """Context manager, idempotent close, calls after close refused, abort."""
    _feature(misc_run, "lifecycle")


@requires_gpu
@pytest.mark.slow
def test_split_into_halves(tmp_path, monkeypatch):
    """4 ranks split into two halves that reduce independently; NOCOLOR returns None."""
    records, failures, err = _spawn(F.split, 4, str(tmp_path), monkeypatch)
    _assert_clean(records, failures, err, min_checks=2)


@requires_gpu
@pytest.mark.slow
def test_torch_tensors(tmp_path, monkeypatch):
    """torch tensors (float32, int64, complex64, bool, float8), bf16 premul_sum, torch streams."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    records, failures, err = _spawn(F.torch_worker, 2, str(tmp_path), monkeypatch)
    _assert_clean(records, failures, err, min_checks=3)
