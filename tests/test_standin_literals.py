"""Every collective and send/recv on four thread-ranks through ncclpy and the STAND-IN
(tests/nccl_standin.py), against values computed BY HAND and written here, and
:mod:`ncclpy.reference` against the same literals.  The CPU engine computes its reductions
with the reference (ncclpy/cpu/reduce.py) and ``ncclpy check`` compares the CPU backend with the
reference: if both were wrong the same way, only literals written by a person can tell
(issue 40, part 3).  The cross-process engine's literals: tests/cpu_backend_jobs.py
``collectives``."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

import ncclpy
from ncclpy.semantics import reference as R
from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator

from nccl_standin import DevArray, run_ranks, standin

N = 4
UID = bytes(range(128))
F32, I32, I8 = np.float32, np.int32, np.int8
X = [[1, 2], [3, 4], [5, 6], [7, 8]]                      # rank r: [2r+1, 2r+2]
Y = [[1, 2, 3, 4, 5, 6, 7, 8], [2, 4, 6, 8, 10, 12, 14, 16],  # rank r: (r+1) * [1..8]
     [3, 6, 9, 12, 15, 18, 21, 24], [4, 8, 12, 16, 20, 24, 28, 32]]
A2A = [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]  # element d to d
SC = [[11, 12, 13, 14, 15, 16, 17, 18], None, None, None]   # scatter: the root's input only
Out = List[Optional[List[float]]]


def _dev(values: Any, r: int, dt: Any) -> DevArray:
    return DevArray(np.asarray(values, dtype=dt), device=r)


def _reduce_to(root: int, op: str) -> Callable[..., Any]:
    def call(c: Communicator, r: int, x: DevArray) -> Any:
        out = _dev([-1] * len(x.a), r, x.a.dtype)
        c.reduce(x, out, root=root, op=op).wait()
        if r != root:
            assert out.a.tolist() == [-1] * len(x.a), "a non-root's recvbuff was written"
            return None
        return out.a
    return call


def _gather_to(root: int) -> Callable[..., Any]:
    def call(c: Communicator, r: int, x: DevArray) -> Any:
        out = _dev(np.zeros(N * len(x.a)), r, x.a.dtype) if r == root else None
        c.gather(x, out, root=root).wait()
        return None if out is None else out.a
    return call


def _scatter_from(root: int) -> Callable[..., Any]:
    def call(c: Communicator, r: int, x: Optional[DevArray]) -> Any:
        out = _dev([0, 0], r, F32)
        c.scatter(x if r == root else None, out, root=root).wait()
        return out.a
    return call


def _out_of_place(method: str, size: Callable[[int], int], **kw: Any) -> Callable[..., Any]:
    def call(c: Communicator, r: int, x: DevArray) -> Any:
        out = _dev(np.zeros(size(len(x.a))), r, x.a.dtype)
        getattr(c, method)(x, out, **kw).wait()
        return out.a
    return call


def _in_place(method: str, **kw: Any) -> Callable[..., Any]:
    def call(c: Communicator, r: int, x: DevArray) -> Any:
        getattr(c, method)(x, **kw).wait()
        return x.a
    return call


def _ring(c: Communicator, r: int, x: DevArray) -> Any:
    out = _dev([0, 0], r, x.a.dtype)
    c.send_recv(x, out, (r + 1) % N, (r - 1) % N).wait()
    return out.a


#: name -> (dtype, inputs by rank, ncclpy's call on rank r, the reference's call, the
#: hand-computed outputs by rank; None: the rank has no output)
CASES: Dict[str, Tuple[Any, list, Callable[..., Any], Callable[[list], list], Out]] = {
    "all_reduce sum": (F32, X, _in_place("all_reduce"), lambda i: R.all_reduce(i),
                       [[16, 20]] * 4),                        # 1+3+5+7, 2+4+6+8
    "all_reduce prod": (F32, X, _in_place("all_reduce", op="prod"),
                        lambda i: R.all_reduce(i, op="prod"), [[105, 384]] * 4),
    "all_reduce max": (F32, X, _in_place("all_reduce", op="max"),
                       lambda i: R.all_reduce(i, op="max"), [[7, 8]] * 4),
    "all_reduce min": (F32, X, _in_place("all_reduce", op="min"),
                       lambda i: R.all_reduce(i, op="min"), [[1, 2]] * 4),
    "all_reduce avg": (F32, X, _in_place("all_reduce", op="avg"),
                       lambda i: R.all_reduce(i, op="avg"), [[4, 5]] * 4),   # 16/4, 20/4
    "all_reduce premul_sum(0.5)": (F32, X, _in_place("all_reduce", op=ncclpy.premul_sum(0.5)),
                                   lambda i: R.all_reduce(i, op=ncclpy.premul_sum(0.5)),
                                   [[8, 10]] * 4),
    "all_reduce int8 wraps": (I8, [[100, -100]] * 4, _in_place("all_reduce"),
                              lambda i: R.all_reduce(i), [[-112, 112]] * 4),  # +-400 mod 256
    "all_reduce int32 avg truncates": (I32, [[1, -1], [2, -2], [3, -3], [4, -4]],
                                       _in_place("all_reduce", op="avg"),
                                       lambda i: R.all_reduce(i, op="avg"),
                                       [[2, -2]] * 4),                 # 10/4, -10/4 -> 2, -2
    "reduce max to 2": (F32, X, _reduce_to(2, "max"), lambda i: R.reduce(i, op="max", root=2),
                        [None, None, [7, 8], None]),
    "broadcast from 3": (F32, X, _in_place("broadcast", root=3),
                         lambda i: R.broadcast(i, root=3), [[7, 8]] * 4),
    "all_gather": (F32, X, _out_of_place("all_gather", lambda k: N * k),
                   lambda i: R.all_gather(i), [[1, 2, 3, 4, 5, 6, 7, 8]] * 4),
    "reduce_scatter sum": (F32, Y, _out_of_place("reduce_scatter", lambda k: k // N),
                           lambda i: R.reduce_scatter(i),
                           [[10, 20], [30, 40], [50, 60], [70, 80]]),   # 10 * [1..8]
    "all_to_all": (I32, A2A, _out_of_place("all_to_all", lambda k: k),
                   lambda i: R.all_to_all(i),
                   [[0, 10, 20, 30], [1, 11, 21, 31], [2, 12, 22, 32], [3, 13, 23, 33]]),
    "gather to 1": (F32, X, _gather_to(1), lambda i: R.gather(i, root=1),
                    [None, [1, 2, 3, 4, 5, 6, 7, 8], None, None]),
    "scatter from 0": (F32, SC, _scatter_from(0), lambda i: R.scatter(i, root=0),
                       [[11, 12], [13, 14], [15, 16], [17, 18]]),
    "send_recv ring": (F32, X, _ring, lambda i: R.send_recv(i),
                       [[7, 8], [1, 2], [3, 4], [5, 6]]),           # from rank r-1
}


def _listed(outs: list) -> Out:
    return [None if o is None else np.asarray(o).tolist() for o in outs]


@pytest.fixture(scope="module")
def standin_outputs() -> Dict[str, Out]:
    """Every case on four thread-ranks, one communicator each, in one stand-in."""
    def rank(r: int) -> Dict[str, Any]:
        c = Communicator(N, r, UID, r, Config(blocking=True))
        got = {}
        for name, (dt, ins, call, _ref, _want) in CASES.items():
            x = None if ins[r] is None else _dev(ins[r], r, dt)
            res = call(c, r, x)
            got[name] = None if res is None else res.copy()
        c.close()
        return got
    with standin():
        per_rank = run_ranks(N, rank, timeout=120)
    return {name: _listed([per_rank[r][name] for r in range(N)]) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_the_standin_gives_the_hand_computed_values(standin_outputs, name):
    assert standin_outputs[name] == CASES[name][4]


@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_gives_the_same_hand_computed_values(name):
    dt, ins, _call, ref, want = CASES[name]
    got = ref([None if v is None else np.asarray(v, dtype=dt) for v in ins])
    assert _listed(got) == want
