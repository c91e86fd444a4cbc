"""The one registry of collectives.

Each collective is described once: its semantics, per-rank element counts (in nccl-tests'
conventions, where ``total`` is the element count of the "size" column), the bus-bandwidth
factor nccl-tests uses, the planner that turns user arguments into NCCL calls, the numpy
reference, and the torch.distributed call it corresponds to.  The communicator, ``ncclpy check``
and the bench all read it; adding a collective is adding one entry here.

Planner and reference are named by dotted path and resolved on first use so this module stays
import-light and free of cycles.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Tuple

__all__ = ["Collective", "COLLECTIVES", "get", "names", "iter_collectives"]


@functools.lru_cache(maxsize=None)
def _resolve(path: str) -> Callable:
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


@dataclass(frozen=True)
class Collective:
    """One collective (or point-to-point pattern)."""

    name: str                 #: ncclpy / torch-style name, e.g. "all_reduce"
    nccl: str                 #: NCCL function it maps to natively, e.g. "AllReduce"
    tests_name: str           #: nccl-tests binary stem, e.g. "all_reduce" (all_reduce_perf)
    summary: str              #: one-line semantics
    reduces: bool             #: takes a reduction op
    rooted: bool              #: takes a root
    send_elems: Callable[[int, int], int]   #: (total, nranks) -> elements in this rank's input
    recv_elems: Callable[[int, int], int]   #: (total, nranks) -> elements in this rank's output
    param_count: Callable[[int, int], int]  #: (total, nranks) -> the count passed to NCCL
    busbw_factor: Callable[[int], float]    #: nranks -> busbw / algbw (nccl-tests)
    planner: str              #: "module:function" building a Plan
    reference: str            #: "module:function" computing outputs with numpy
    torch_call: str           #: torch.distributed function used by check/bench
    in_place: str             #: how in-place is arranged (NCCL's rule)
    data: bool = True         #: False for barrier (no payload)

    @property
    def planner_fn(self) -> Callable:
        """This collective's planner function (imported once)."""
        return _resolve(self.planner)

    def plan(self, *args, **kwargs):
        """Run this collective's planner."""
        return _resolve(self.planner)(*args, **kwargs)

    def ref(self, *args, **kwargs):
        """Run this collective's numpy reference."""
        return _resolve(self.reference)(*args, **kwargs)

    def divisor(self, nranks: int) -> int:
        """``total`` must be a multiple of this for the nccl-tests size convention."""
        return nranks if self.param_count is _part else 1

    def sizes(self, total: int, nranks: int, itemsize: int) -> Tuple[int, int]:
        """(send bytes, recv bytes) for one rank, the larger side for rooted collectives."""
        return self.send_elems(total, nranks) * itemsize, self.recv_elems(total, nranks) * itemsize

    def bandwidths(self, nbytes: int, seconds: float, nranks: int) -> Tuple[float, float]:
        """(algbw, busbw) in GB/s (1e9 bytes) for ``nbytes`` (the size column) in ``seconds``."""
        if seconds <= 0:
            return 0.0, 0.0
        alg = nbytes / seconds / 1e9
        return alg, alg * self.busbw_factor(nranks)


def _same(total: int, n: int) -> int:
    return total


def _part(total: int, n: int) -> int:
    return total // n


def _whole(total: int, n: int) -> int:
    return (total // n) * n


def _ring(n: int) -> float:
    return (n - 1) / n if n else 0.0


_P = "ncclpy.plan.collectives:"
_R = "ncclpy.reference:"

COLLECTIVES: Dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", "AllReduce", "all_reduce",
               "every rank gets op over all ranks' inputs, element-wise",
               True, False, _same, _same, _same, lambda n: 2 * (n - 1) / n if n else 0.0,
               _P + "plan_all_reduce", _R + "all_reduce", "all_reduce",
               "recvbuff == sendbuff"),
    Collective("reduce", "Reduce", "reduce",
               "root gets op over all ranks' inputs; other ranks' outputs are untouched",
               True, True, _same, _same, _same, lambda n: 1.0,
               _P + "plan_reduce", _R + "reduce", "reduce", "recvbuff == sendbuff"),
    Collective("broadcast", "Broadcast", "broadcast",
               "every rank gets root's input", False, True, _same, _same, _same,
               lambda n: 1.0, _P + "plan_broadcast", _R + "broadcast", "broadcast",
               "recvbuff == sendbuff"),
    Collective("all_gather", "AllGather", "all_gather",
               "every rank gets all inputs concatenated in rank order",
               False, False, _part, _whole, _part, _ring,
               _P + "plan_all_gather", _R + "all_gather", "all_gather_into_tensor",
               "sendbuff == recvbuff + rank*count"),
    Collective("reduce_scatter", "ReduceScatter", "reduce_scatter",
               "rank r gets block r of op over all ranks' inputs",
               True, False, _whole, _part, _part, _ring,
               _P + "plan_reduce_scatter", _R + "reduce_scatter", "reduce_scatter_tensor",
               "recvbuff == sendbuff + rank*recvcount"),
    Collective("all_to_all", "AlltoAll", "alltoall",
               "rank r's block d goes to rank d's block r", False, False, _whole, _whole, _part,
               _ring, _P + "plan_all_to_all", _R + "all_to_all", "all_to_all_single",
               "not supported by NCCL (ncclpy stages through scratch)"),
    Collective("gather", "Gather", "gather",
               "root gets all inputs concatenated in rank order", False, True, _part, _whole,
               _part, _ring, _P + "plan_gather", _R + "gather", "gather",
               "sendbuff == recvbuff + root*count on root"),
    Collective("scatter", "Scatter", "scatter",
               "rank r gets block r of root's input", False, True, _whole, _part, _part, _ring,
               _P + "plan_scatter", _R + "scatter", "scatter",
               "recvbuff == sendbuff + root*count on root"),
    Collective("send_recv", "Send", "sendrecv",
               "rank r sends to r+1 and receives from r-1 (a ring shift)", False, False,
               _same, _same, _same, lambda n: 1.0, _P + "plan_send_recv", _R + "send_recv",
               "send/recv", "not applicable"),
    Collective("barrier", "AllReduce", "",
               "no rank leaves before every rank has entered", False, False,
               lambda t, n: 0, lambda t, n: 0, lambda t, n: 0, lambda n: 0.0,
               _P + "plan_barrier", _R + "barrier", "barrier", "not applicable", data=False),
)}


#: NCCL functions an entry issues besides the one its ``nccl`` field names: send_recv is
#: nccl-tests' sendrecv test, an ncclSend and an ncclRecv in one group, so ncclRecv names it
#: as ncclSend does
_ALSO_NCCL = {"recv": "send_recv"}


def get(name: str) -> Collective:
    """The registry entry for ``name`` (also accepts nccl-tests stems and NCCL names, with or
    without their ``nccl`` prefix: ``all_reduce_perf``, ``AllGather``, ``ncclAllGather``;
    ``ncclSend`` and ``ncclRecv`` both name send_recv, the two calls of its group)."""
    key = name.strip().lower().replace("-", "_")
    if key in COLLECTIVES:
        return COLLECTIVES[key]
    bare = key[len("nccl"):] if key.startswith("nccl") else None
    also = _ALSO_NCCL.get(key if bare is None else bare)
    if also is not None:
        return COLLECTIVES[also]
    for c in COLLECTIVES.values():
        if key in (c.tests_name, c.nccl.lower(), c.tests_name + "_perf") or \
                (bare is not None and bare == c.nccl.lower()):
            return c
    from ..errors import ArgumentError
    raise ArgumentError(f"collective {name!r} is unknown; expected one of {', '.join(COLLECTIVES)} "
                        f"(or an nccl-tests stem such as all_reduce_perf, or an NCCL name such "
                        f"as ncclAllReduce)")


def names(data_only: bool = True) -> Tuple[str, ...]:
    """Registered collective names (by default those that move data)."""
    return tuple(n for n, c in COLLECTIVES.items() if c.data or not data_only)


def iter_collectives(data_only: bool = True) -> Iterator[Collective]:
    return (COLLECTIVES[n] for n in names(data_only))
