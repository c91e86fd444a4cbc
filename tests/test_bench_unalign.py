"""nccl-tests' ``-u N`` (misaligned buffers) on ``python -m bench`` (issue 50, item 2).

nccl-tests 2.19.6 (src/common.cu, ``TimeTest`` and ``AllocateBuffs``) pads each buffer and
moves every send and receive pointer by ``N * wordSize(type)`` for the warm-up, the timing and
the check; in place uses the moved receive buffer at its in-place offsets.  Here: the pointers
the backends hand out are moved by exactly that (every collective's layout, several dtypes),
the allocations are what ``-R`` registers, fill and output touch only the moved buffers, the
check catches a library that ignored the move, and whole runs on the CPU backend and gloo
check clean with ``-u 1`` and ``-u 3``."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

from ncclpy.semantics import registry
from ncclpy.semantics.dtypes import DTYPES

from bench.backends import Backend, layout
from bench.backends.ncclpy import NcclpyBackend
from bench.backends.ncclpy_cpu import NcclpyCpuBackend
from bench.cli import parse_args
from bench.sweep import Coord, SweepConfig, _Rank
from bench_jobs import Commands, Job, start_jobs

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("bench_unalign")]

KEYS = ("send", "recv", "whole", "ip_send", "ip_recv")
DTYPE_NAMES = ("int8", "float16", "float32", "float64", "bfloat16")


def _cpu_backend(world: int, rank: int, unalign: int) -> NcclpyCpuBackend:
    import ncclpy
    b = NcclpyCpuBackend()
    b.ncclpy, b.world, b.rank, b.unalign = ncclpy, world, rank, unalign
    return b


def _torch_backend(world: int, rank: int, unalign: int) -> Backend:
    torch = pytest.importorskip("torch")
    from bench.backends.torch_dist import TorchBackend
    b = TorchBackend()
    b.torch, b.tdevice, b.cuda = torch, torch.device("cpu"), False
    b.world, b.rank, b.unalign = world, rank, unalign
    return b


def _ptr(arr: Any) -> int:
    return int(arr.data_ptr()) if hasattr(arr, "data_ptr") else int(arr.ctypes.data)


def _size(arr: Any) -> int:
    return int(arr.numel()) if hasattr(arr, "numel") else int(arr.size)


# ------------------------------------------------------------------------ the moved pointers
@pytest.mark.parametrize("make", [_cpu_backend, _torch_backend], ids=["ncclpy-cpu", "torch"])
@pytest.mark.parametrize("unalign", [1, 3])
def test_every_buffer_starts_unalign_elements_into_its_allocation(make, unalign):
    for coll in registry.names():
        for dtype in DTYPE_NAMES:
            item = DTYPES[dtype].itemsize
            for rank in (0, 2):
                b = make(3, rank, unalign)
                bufs = b.alloc(coll, 96, dtype)
                lay = layout(coll, 96, 3, rank)
                what = (coll, dtype, rank)
                for k, n in (("send", lay.send), ("recv", lay.recv), ("whole", lay.whole)):
                    base, buf = bufs.base[k], getattr(bufs, k)
                    assert _size(base) == n + unalign and _size(buf) == n, what
                    assert _ptr(buf) - _ptr(base) == unalign * item, (what, k)
                # in place: the in-place offsets inside the moved whole buffer
                for k, (off, n) in (("ip_send", lay.ip_send), ("ip_recv", lay.ip_recv)):
                    buf = getattr(bufs, k)
                    assert _size(buf) == n, (what, k)
                    assert _ptr(buf) - _ptr(bufs.base["whole"]) == (unalign + off) * item, what
                if isinstance(b, NcclpyCpuBackend):   # what ncclpy is handed: the moved ones
                    for k in KEYS:
                        arg = bufs.extra["args"][k]
                        got = arg.ptr if DTYPES[dtype].numpy is None else _ptr(arg)
                        assert got == _ptr(getattr(bufs, k)), (what, k)


@pytest.mark.parametrize("make", [_cpu_backend, _torch_backend], ids=["ncclpy-cpu", "torch"])
def test_without_u_the_buffers_are_the_allocations(make):
    b = make(2, 1, 0)
    bufs = b.alloc("all_gather", 64, "float32")
    assert all(getattr(bufs, k) is bufs.base[k] for k in ("send", "recv", "whole"))
    assert _ptr(bufs.ip_send) - _ptr(bufs.whole) == 32 * 4       # rank 1's block


def test_fill_and_output_touch_only_the_moved_buffers():
    """The padding in front of each buffer (nccl-tests' too) is never written nor read."""
    b = _torch_backend(2, 1, 3)
    bufs = b.alloc("all_gather", 64, "float32")
    for k in ("send", "recv", "whole"):
        bufs.base[k].fill_(-7.0)
    host = np.arange(1, 33, dtype=np.float32)          # 32 elements a rank, rank 1 of 2
    b.fill(bufs, host, False)
    assert np.array_equal(b.download(bufs.send), host)
    assert not b.output(bufs, False).any() and len(b.output(bufs, False)) == 64
    b.fill(bufs, host, True)
    whole = b.download(bufs.whole)
    assert np.array_equal(whole[32:], host) and not whole[:32].any()
    assert np.array_equal(b.output(bufs, True), whole)
    for k in ("send", "recv", "whole"):
        assert (bufs.base[k][:3] == -7.0).all(), k


class _HostNcclpy(NcclpyBackend):
    """ncclpy's GPU backend class on numpy arrays and a recording communicator: its own
    ``alloc`` (-R registration) and ``free`` run without a GPU."""

    empty = NcclpyCpuBackend.empty

    def __init__(self) -> None:
        super().__init__()
        self.log: List[Any] = []
        log = self.log

        class Comm:
            def register(self, arr):
                log.append(("register", arr))
                return type("Reg", (), {"handle": 1, "arr": arr})()

            def deregister(self, reg):
                log.append(("deregister", reg.arr))
        self.comm = Comm()

    def sync(self) -> None:
        pass


def test_R_registers_the_allocations_the_moved_buffers_lie_in():
    """-R 1 registers each allocation (nccl-tests registers its buffers before -u moves them,
    common.cu), so every moved pointer is inside a registration; free undoes all of them."""
    b = _HostNcclpy()
    b.world, b.rank, b.unalign, b.register = 2, 0, 3, 1
    bufs = b.alloc("reduce_scatter", 64, "float32")
    regs = [arr for what, arr in b.log if what == "register"]
    assert [id(a) for a in regs] == [id(bufs.base[k]) for k in ("send", "recv", "whole")]
    for k in KEYS:
        buf = getattr(bufs, k)
        assert any(_ptr(r) <= _ptr(buf) and _ptr(buf) + buf.nbytes <= _ptr(r) + r.nbytes
                   for r in regs), k
    assert b.registered_seen == [3, 3]
    b.free(bufs)
    assert [id(arr) for what, arr in b.log if what == "deregister"] == [id(a) for a in
                                                                        reversed(regs)]


# ------------------------------------------------------------------------ the check still holds
class _HostAllReduce(Backend):
    """A one-rank all_reduce on numpy (the result is the input); ``ignore_u``: the library is
    handed the allocation's start instead of the moved pointer, as a backend that dropped -u."""

    name = label = "host"

    def __init__(self, ignore_u: bool) -> None:
        super().__init__()
        self.ignore_u = ignore_u

    empty = NcclpyCpuBackend.empty
    zero = NcclpyCpuBackend.zero
    upload = NcclpyCpuBackend.upload
    download = NcclpyCpuBackend.download

    def run(self, collective, bufs, op, root, in_place) -> None:
        if in_place:
            return
        n = bufs.layout.recv
        dst = bufs.base["recv"][:n] if self.ignore_u else bufs.recv
        dst[...] = bufs.send


@pytest.mark.parametrize("ignore_u, wrong", [(False, 0), (True, None)])
def test_the_check_reads_the_moved_buffers(ignore_u, wrong):
    cfg = SweepConfig(collectives=["all_reduce"], sizes=[1024], iters=1, check=1, unalign=3)
    b = _HostAllReduce(ignore_u)
    b.unalign = 3
    state = _Rank(cfg, "all_reduce", 0, 1, Coord(None, 0, 1, 10.0), [b])
    bufs = b.alloc("all_reduce", 256, "float32")
    side = state.bench_time(b, bufs, "sum", -1, False)
    if wrong is None:
        assert side.wrong and side.wrong > 0
    else:
        assert side.wrong == wrong


def test_u_parses_into_the_config():
    assert parse_args(["all_reduce", "--device", "cpu", "-u", "3"]).unalign == 3
    assert parse_args(["all_reduce", "--device", "cpu", "--unalign", "1"]).unalign == 1
    assert parse_args(["all_reduce", "--device", "cpu"]).unalign == 0


# ------------------------------------------------------------------------ end to end
def _tables(out: str) -> Dict[str, List[List[str]]]:
    """Each collective's table rows (by nccl-tests' program name)."""
    tables: Dict[str, List[List[str]]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"# Collective test starting: (\w+)_perf", line)
        if m:
            cur = tables.setdefault(m.group(1), [])
        elif cur is not None and re.match(r"^\s+\d+\s+\d+\s", line):
            cur.append(line.split())
    return tables


_BACKENDS, _UNALIGNS = ["ncclpy", "torch"], ["1", "3"]


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The six end-to-end runs below (2 ranks each, three of them on gloo), started together
    in the background while the in-process tests above run (tests/bench_jobs.py)."""
    def make(commands: Commands) -> Dict[str, Job]:
        def clean(backend: str, unalign: str):
            return commands.module(
                "bench", "all", "--backend", backend, "--device", "cpu", "--nproc", "2",
                "-u", unalign, "-b", "8", "-e", "64", "-f", "4", "-n", "1", "-w", "1",
                "-c", "1", "-d", "float,bfloat16,int8", "-q", timeout=240)

        def wrong(backend: str, js: Path):
            return commands.module(
                "bench", "all_gather", "--backend", backend, "--device", "cpu", "--nproc",
                "2", "-u", "3", "-b", "256", "-e", "256", "-n", "1", "-w", "1", "-c", "1",
                "-q", "-J", str(js), "--test-corrupt", "1:2", timeout=240), js

        jobs = {f"clean {b} {u}": Job(lambda b=b, u=u: clean(b, u),
                                      ["test_every_collective_checks_clean_with_u"])
                for b in _BACKENDS for u in _UNALIGNS}
        for b in _BACKENDS:
            js = tmp_path_factory.mktemp("wrong") / "r.json"
            jobs[f"wrong {b}"] = Job(lambda b=b, js=js: wrong(b, js),
                                     ["test_a_wrong_output_is_still_caught_with_u"])
        return jobs
    yield from start_jobs(request, make)


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("unalign", _UNALIGNS)
def test_every_collective_checks_clean_with_u(backend, unalign, runs):
    cp = runs[f"clean {backend} {unalign}"]
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    out = cp.stdout
    n = len(registry.names())
    assert out.count(f" graph: 0 unalign: {unalign}\n") == n, out[:2000]
    assert out.count("# Out of bounds values : 0 OK") == n and "skipped" not in out
    tables = _tables(out)
    assert set(tables) == {registry.get(c).tests_name for c in registry.names()}
    unchecked_in_place = {"send_recv"} | ({"all_to_all"} if backend == "torch" else set())
    for name, rows in tables.items():
        assert len(rows) == 3 * 2, (name, rows)      # 3 dtypes x sizes 8, 32
        for r in rows:
            assert r[8] == "0", (name, r)
            assert r[12] == ("N/A" if name in {registry.get(c).tests_name
                                               for c in unchecked_in_place} else "0"), (name, r)


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_wrong_output_is_still_caught_with_u(backend, runs):
    cp, js = runs[f"wrong {backend}"]
    assert cp.returncode == 1, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "# Out of bounds values : 2 FAILED" in cp.stdout
    rows = _tables(cp.stdout)["all_gather"]
    assert len(rows) == 1 and rows[0][8] == rows[0][12] == "2", rows
    res = json.loads(js.read_text())["results"][0]
    assert res["out_of_place"]["nwrong"] == res["in_place"]["nwrong"] == 2

