"""The seed tutorials' examples E1-E35 as data: inputs, call, and the result each tutorial shows.

One table, :data:`EXAMPLES`, so the reference's unit tests, ``examples/`` and anything else can
prove they reproduce exactly what ``shared/seeds`` prints.  Each :class:`SeedExample` gives the
per-rank inputs (``inputs()``), the registry collective and keyword arguments for
:mod:`ncclpy.reference` (``reference_outputs()`` runs it), and ``expected``: per rank, the
array the tutorial shows (None where it shows nothing / the buffer is undefined).  ``view`` maps a
raw reference output to the layout the tutorial prints (e.g. a torch list of n tensors stacked, or a
``(1, 5)`` block shown as ``(5,)``).

Two entries are not plain data:

* E29 (barrier): inputs are arrival times (rank r sleeps r seconds); expected is the earliest
  time every rank may leave (2 s for 3 ranks).
* E33 (bandwidth benchmark): no result to compare; ``busbw_003`` is the tutorial's bandwidth
  formula.  It equals nccl-tests' bus bandwidth ``size/t * 2(n-1)/n`` (registry
  ``busbw_factor``) in bytes per second; the tutorial then divides by 1024**3 (GiB/s, not GB/s)
  and times a single un-averaged call that includes a barrier.

E34 uses random inputs (``torch.randn``); its expected value is a function of the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np

__all__ = ["SeedExample", "EXAMPLES", "get", "ids", "busbw_003", "E33_NOTE"]

Array = np.ndarray
Expected = Union[List[Optional[Array]], Callable[[List[Optional[Array]]], List[Optional[Array]]]]


@dataclass(frozen=True)
class SeedExample:
    """One example: ``make_input(rank, world_size)`` -> that rank's input (None: no input)."""

    key: str                  #: unique name, e.g. "E6-2x5"
    id: str                   #: the README's id, e.g. "E6" (several keys may share one)
    seed: str                 #: "000 §2.1" etc.
    title: str
    collective: str           #: registry name
    world_size: int
    make_input: Callable[[int, int], Any]
    kwargs: Dict[str, Any]    #: for the reference: op, root, in_place, axis, pairs, dtype ...
    expected: Expected
    view: Optional[Callable[[Array], Array]] = None
    torch_form: str = ""      #: the torch call the tutorial makes
    note: str = ""
    dtype: str = "float32"
    extra: Dict[str, Any] = field(default_factory=dict)

    def inputs(self) -> List[Any]:
        """Per-rank inputs."""
        return [self.make_input(r, self.world_size) for r in range(self.world_size)]

    def expected_outputs(self, inputs: Optional[List[Any]] = None) -> List[Any]:
        """Per-rank results the tutorial shows."""
        if callable(self.expected):
            return self.expected(self.inputs() if inputs is None else inputs)
        return list(self.expected)

    def reference_outputs(self, inputs: Optional[List[Any]] = None) -> List[Any]:
        """Per-rank outputs of :mod:`ncclpy.reference`, mapped through ``view``."""
        from ..semantics import registry
        ins = self.inputs() if inputs is None else inputs
        kw = dict(self.kwargs)
        kw.setdefault("dtype", self.dtype)
        if self.collective == "barrier":
            return registry.get("barrier").ref(arrivals=ins, world_size=self.world_size)
        outs = registry.get(self.collective).ref(ins, world_size=self.world_size, **kw)
        v = self.view or (lambda a: a)
        return [None if o is None else v(o) for o in outs]


def _f(*shape: int, value: Any = 0.0) -> Array:
    return np.full(shape, value, dtype=np.float32)


def _cols(rows: int, ncols: int, base: float) -> Array:
    """(rows, ncols) with column j = base + j."""
    return np.tile(np.arange(ncols, dtype=np.float32) + np.float32(base), (rows, 1))


def _rows(nrows: int, ncols: int, base: float) -> Array:
    """(nrows, ncols) with row i = base + i."""
    return np.repeat((np.arange(nrows, dtype=np.float32) + np.float32(base))[:, None], ncols,
                     axis=1)


def _every(n: int, a: Array) -> List[Array]:
    return [a.copy() for _ in range(n)]


def _only(n: int, r: int, a: Array, others: Optional[Callable[[int], Any]] = None) -> list:
    return [a if i == r else (others(i) if others else None) for i in range(n)]


_GATHER_ROWS = _rows(4, 5, 0)
_COL_8 = np.tile(np.array([0, 1, 10, 11, 20, 21, 30, 31], dtype=np.float32), (5, 1))
_to5 = (lambda a: a.reshape(5))


def _e28_input(r: int, n: int) -> Array:
    base = np.array([(r + 1) * 1, (r + 1) * 2], dtype=np.float32)
    return np.stack([base ** (j + 1) for j in range(n)])


def _e34_input(r: int, n: int) -> Array:
    return np.random.default_rng([34, r]).standard_normal(4).astype(np.float32)


def busbw_003(size_bytes: float, duration_s: float, world_size: int) -> float:
    """Seed 003's all_reduce "bandwidth" in bytes/s: ``size*2*(n-1) / (n*duration)``."""
    sent_bytes = size_bytes * 2 * (world_size - 1)
    total_duration = world_size * duration_s
    return sent_bytes / total_duration


E33_NOTE = ("003 divides size*2(n-1) by n*duration: numerically nccl-tests' bus bandwidth "
            "(algbw * 2(n-1)/n) in bytes/s, but printed in GiB/s (/1024**3, ~7% below GB/s) and "
            "timed over one call plus a barrier instead of an average of many")

EXAMPLES: List[SeedExample] = [
    SeedExample("E1", "E1", "000 §2.1", "row gather to rank 0", "gather", 4,
                lambda r, n: _f(1, 5, value=r), {"root": 0},
                _only(4, 0, _GATHER_ROWS), torch_form="dist.gather + torch.cat(dim=0)"),
    SeedExample("E2", "E2", "000 §2.2", "column gather, cat on dim 1", "gather", 4,
                lambda r, n: _cols(5, 2, 10 * r), {"root": 0, "axis": 1},
                _only(4, 0, _COL_8), torch_form="dist.gather + torch.cat(dim=1)"),
    SeedExample("E3", "E3", "000 §3.1", "row all_gather", "all_gather", 4,
                lambda r, n: _f(1, 5, value=r), {}, _every(4, _GATHER_ROWS),
                torch_form="dist.all_gather + torch.cat(dim=0)"),
    SeedExample("E4", "E4", "000 §3.2", "column all_gather", "all_gather", 4,
                lambda r, n: _cols(5, 2, 10 * r), {"axis": 1}, _every(4, _COL_8),
                torch_form="dist.all_gather + torch.cat(dim=1)"),
    SeedExample("E5", "E5", "000 §4", "reduce SUM to rank 0", "reduce", 4,
                lambda r, n: _f(1, 5, value=r), {"op": "sum", "root": 0, "in_place": True},
                _only(4, 0, _f(1, 5, value=6), lambda i: _f(1, 5, value=i)),
                torch_form="dist.reduce(tensor, dst=0)",
                note="non-root ranks keep their input (NCCL never writes them)"),
    SeedExample("E6-1x5", "E6", "000 §5", "all_reduce SUM, shape (1,5)", "all_reduce", 4,
                lambda r, n: _f(1, 5, value=r), {"op": "sum", "in_place": True},
                _every(4, _f(1, 5, value=6)), torch_form="dist.all_reduce"),
    SeedExample("E6-2x5", "E6", "000 §5", "all_reduce SUM, shape (2,5)", "all_reduce", 4,
                lambda r, n: _f(2, 5, value=r), {"op": "sum", "in_place": True},
                _every(4, _f(2, 5, value=6)), torch_form="dist.all_reduce"),
    SeedExample("E7", "E7", "000 §6", "scatter from 0", "scatter", 4,
                lambda r, n: _rows(4, 5, 0) if r == 0 else None, {"root": 0},
                [_f(5, value=r) for r in range(4)], view=_to5,
                torch_form="dist.scatter(recv[5], scatter_list=rows)"),
    SeedExample("E8", "E8", "000 §7.1", "reduce_scatter, list of n chunks (1,5)",
                "reduce_scatter", 4, lambda r, n: _rows(4, 5, 10 * r), {"op": "sum"},
                [_f(1, 5, value=60 + 4 * r) for r in range(4)],
                torch_form="dist.reduce_scatter(out, list of (1,5))"),
    SeedExample("E9", "E9", "000 §7.2", "reduce_scatter_tensor, one (n,5) input",
                "reduce_scatter", 4, lambda r, n: _rows(4, 5, 10 * r), {"op": "sum"},
                [_f(1, 5, value=60 + 4 * r) for r in range(4)],
                torch_form="dist.reduce_scatter_tensor"),
    SeedExample("E10", "E10", "000 §7.3", "column reduce_scatter, chunks (5,1)",
                "reduce_scatter", 4, lambda r, n: _cols(5, 4, 10 * r),
                {"op": "sum", "axis": 1}, [_f(5, 1, value=60 + 4 * r) for r in range(4)],
                torch_form="dist.reduce_scatter(out(5,1), torch.split(data, 1, dim=1))"),
    SeedExample("E11", "E11", "000 §8.1", "all_to_all_single, even split", "all_to_all", 4,
                lambda r, n: _rows(4, 2, 10 * r), {},
                [np.repeat(np.array([r, 10 + r, 20 + r, 30 + r], np.float32)[:, None], 2, axis=1)
                 for r in range(4)], torch_form="dist.all_to_all_single"),
    SeedExample("E12", "E12", "000 §8.2", "all_to_all with lists, columns", "all_to_all", 4,
                lambda r, n: _cols(5, 4, 10 * r), {"axis": 1},
                [np.tile(np.array([r, 10 + r, 20 + r, 30 + r], np.float32), (5, 1))
                 for r in range(4)], torch_form="dist.all_to_all(list of (5,1)) + cat(dim=1)"),
    SeedExample("E13", "E13", "000 §9", "broadcast from 0", "broadcast", 4,
                lambda r, n: _f(5, 2, value=1.0 if r == 0 else 0.0),
                {"root": 0, "in_place": True}, _every(4, _f(5, 2, value=1.0)),
                torch_form="dist.broadcast"),
    SeedExample("E14", "E14", "001 §1", "blocking send/recv", "send_recv", 2,
                lambda r, n: _f(1, value=1.0 if r == 0 else 0.0),
                {"pairs": [(0, 1)], "in_place": True}, _every(2, _f(1, value=1.0)),
                torch_form="dist.send / dist.recv", note="backend gloo in the tutorial"),
    SeedExample("E15", "E15", "001 §1", "isend/irecv + wait", "send_recv", 2,
                lambda r, n: _f(1, value=1.0 if r == 0 else 0.0),
                {"pairs": [(0, 1)], "in_place": True}, _every(2, _f(1, value=1.0)),
                torch_form="dist.isend / dist.irecv + wait"),
    SeedExample("E16", "E16", "001 §2", "broadcast", "broadcast", 4,
                lambda r, n: _f(1, value=2.0 if r == 0 else 1.0),
                {"root": 0, "in_place": True}, _every(4, _f(1, value=2.0)),
                torch_form="dist.broadcast"),
    SeedExample("E17", "E17", "001 §2", "scatter of [1],[2],[3],[4]", "scatter", 4,
                lambda r, n: np.arange(1, 5, dtype=np.float32) if r == 0 else None,
                {"root": 0}, [_f(1, value=r + 1) for r in range(4)],
                torch_form="dist.scatter(t, scatter_list=[[1],[2],[3],[4]])"),
    SeedExample("E18", "E18", "001 §2", "reduce of ones(1)", "reduce", 4,
                lambda r, n: _f(1, value=1.0), {"op": "sum", "root": 0},
                _only(4, 0, _f(1, value=4.0)), torch_form="dist.reduce(t, dst=0)",
                note="gloo: non-root buffers are undefined after reduce"),
    SeedExample("E19", "E19", "001 §2", "all_reduce of ones(1)", "all_reduce", 4,
                lambda r, n: _f(1, value=1.0), {"op": "sum"}, _every(4, _f(1, value=4.0)),
                torch_form="dist.all_reduce"),
    SeedExample("E20", "E20", "001 §2", "gather of ones(1)", "gather", 4,
                lambda r, n: _f(1, value=1.0), {"root": 0}, _only(4, 0, _f(4, value=1.0)),
                torch_form="dist.gather(t, gather_list, dst=0)"),
    SeedExample("E21", "E21", "001 §2", "all_gather of ones(1)", "all_gather", 4,
                lambda r, n: _f(1, value=1.0), {}, _every(4, _f(4, value=1.0)),
                torch_form="dist.all_gather"),
    SeedExample("E22", "E22", "002 §7.2", "broadcast, n=3", "broadcast", 3,
                lambda r, n: (np.arange(1, 6, dtype=np.float32) if r == 0 else _f(5)),
                {"root": 0, "in_place": True},
                _every(3, np.arange(1, 6, dtype=np.float32)), torch_form="dist.broadcast"),
    SeedExample("E23", "E23", "002 §7.3", "reduce, n=3", "reduce", 3,
                lambda r, n: _f(5, value=r + 1), {"op": "sum", "root": 0, "in_place": True},
                [_f(5, value=6), _f(5, value=2), _f(5, value=3)], torch_form="dist.reduce",
                note="ranks 1 and 2 unchanged (NCCL backend)"),
    SeedExample("E24", "E24", "002 §7.4", "all_reduce, n=3", "all_reduce", 3,
                lambda r, n: _f(5, value=r + 1), {"op": "sum"}, _every(3, _f(5, value=6)),
                torch_form="dist.all_reduce"),
    SeedExample("E25", "E25", "002 §7.5", "gather, n=3", "gather", 3,
                lambda r, n: _f(5, value=r + 1), {"root": 0},
                _only(3, 0, _rows(3, 5, 1)), view=lambda a: a.reshape(3, 5),
                torch_form="dist.gather -> list of 3 tensors (stacked here)"),
    SeedExample("E26", "E26", "002 §7.6", "all_gather, n=3", "all_gather", 3,
                lambda r, n: _f(5, value=r + 1), {}, _every(3, _rows(3, 5, 1)),
                view=lambda a: a.reshape(3, 5),
                torch_form="dist.all_gather -> list of 3 tensors (stacked here)"),
    SeedExample("E27", "E27", "002 §7.7", "scatter, n=3", "scatter", 3,
                lambda r, n: _rows(3, 5, 1) if r == 0 else None, {"root": 0},
                [_f(5, value=r + 1) for r in range(3)], view=_to5,
                torch_form="dist.scatter(t, scatter_list)"),
    SeedExample("E28", "E28", "002 §7.8", "reduce_scatter, n=3", "reduce_scatter", 3,
                _e28_input, {"op": "sum"},
                [np.array(v, np.float32) for v in ([6, 12], [14, 56], [36, 288])],
                view=lambda a: a.reshape(2),
                torch_form="dist.reduce_scatter(out[2], [chunk_j])"),
    SeedExample("E29", "E29", "002 §7.9", "barrier: rank r sleeps r s", "barrier", 3,
                lambda r, n: float(r), {}, [2.0, 2.0, 2.0], dtype="float64",
                torch_form="time.sleep(rank); dist.barrier()",
                note="inputs are arrival times; expected: earliest leave time of each rank"),
    SeedExample("E30", "E30", "003", "all_reduce of [0,1,2,3]+r", "all_reduce", 4,
                lambda r, n: np.arange(4, dtype=np.float32) + r, {"op": "sum", "in_place": True},
                _every(4, np.array([6, 10, 14, 18], np.float32)), torch_form="dist.all_reduce"),
    SeedExample("E31", "E31", "003", "reduce_scatter_tensor of arange(n)+r", "reduce_scatter", 4,
                lambda r, n: np.arange(n, dtype=np.float32) + r, {"op": "sum"},
                [np.array([6 + 4 * r], np.float32) for r in range(4)],
                torch_form="dist.reduce_scatter_tensor"),
    SeedExample("E32", "E32", "003", "all_gather_into_tensor of E31's output", "all_gather", 4,
                lambda r, n: np.array([6 + 4 * r], np.float32), {},
                _every(4, np.array([6, 10, 14, 18], np.float32)),
                torch_form="dist.all_gather_into_tensor"),
    SeedExample("E33", "E33", "003", "all_reduce bandwidth benchmark", "all_reduce", 4,
                lambda r, n: np.random.default_rng([33, r]).standard_normal(8).astype(np.float32),
                {"op": "sum"}, [None, None, None, None],
                torch_form="warm-up, synchronize, barrier, time one all_reduce",
                note=E33_NOTE, extra={"benchmark": True}),
    SeedExample("E34", "E34", "004", "all_gather of randn(4), n=6", "all_gather", 6,
                _e34_input, {}, lambda ins: [np.stack(ins)] * len(ins),
                view=lambda a: a.reshape(6, 4),
                torch_form="dist.all_gather(list, randn(4)) over 2 nodes x 3"),
    SeedExample("E35", "E35", "004", "all_reduce of [2,3]+2r, n=6", "all_reduce", 6,
                lambda r, n: np.array([2, 3], np.int64) + 2 * r, {"op": "sum", "in_place": True},
                _every(6, np.array([42, 48], np.int64)), dtype="int64",
                torch_form="torch.distributed.all_reduce(tensor) (int64)"),
]

_BY_KEY = {e.key: e for e in EXAMPLES}


def get(key_or_id: str) -> Union[SeedExample, List[SeedExample]]:
    """The example with that key; for an id shared by several keys (E6), the list of them."""
    if key_or_id in _BY_KEY:
        return _BY_KEY[key_or_id]
    found = [e for e in EXAMPLES if e.id == key_or_id]
    if not found:
        raise KeyError(f"no seed example {key_or_id!r}; known: {', '.join(_BY_KEY)}")
    return found[0] if len(found) == 1 else found


def ids() -> List[str]:
    """The README ids covered, in order (E1..E35)."""
    out: List[str] = []
    for e in EXAMPLES:
        if e.id not in out:
            out.append(e.id)
    return out
