"""The description of one NCCL call that the reduction-order model needs: :class:`OrderConfig`.

Everything NCCL decides at init (its version, the channels, each channel's ring and tree, the
buffer sizes, the tuning table) and at the call (collective, algorithm, protocol, count, dtype,
op).  ``OrderConfig.make`` fills what is not given with NCCL's defaults for one rank per node,
checks every field and says in one line what is wrong (ValueError naming the field).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Sequence, Tuple

from ..semantics.dtypes import DTYPES
from .split import (ALGOS, COLLECTIVES, DEFAULT_BUFFSIZES, DEFAULT_MAX_THREADS, PROTOS,
                    default_thresholds)
from .topology import Tree, check_tree, default_trees, parse_ring
from .versions import parse_version

__all__ = ["OrderConfig", "OPS", "DEFAULT_VERSION", "ALIASES"]

#: the version the model assumes when none is given: the one on ncclpy's GPU machines
DEFAULT_VERSION = 22809
OPS = ("sum", "prod", "min", "max", "avg", "premul_sum")
#: NCCL's own names (NCCL_ALGO / NCCL_PROTO values, log words), without case, "-" or "_"
ALIASES = {"ring": "ring", "tree": "tree", "ll": "ll", "ll128": "ll128", "simple": "simple",
           "allreduce": "all_reduce", "reducescatter": "reduce_scatter", "reduce": "reduce"}


def _name(value: Any, allowed: Sequence[str], what: str) -> str:
    key = ALIASES.get(str(value).strip().lower().replace("-", "").replace("_", ""))
    if key not in allowed:
        raise ValueError(f"{what}: expected one of {', '.join(allowed)}, got {value!r}")
    return key


@dataclass(frozen=True)
class OrderConfig:
    """One Ring/Tree reduction call on one communicator.

    ``count`` is NCCL's count (reduce_scatter: each rank's output).  ``rings[c]``: channel c's
    ring as ranks in ring order; ``trees[c]``: per rank ``(up, downs)``.  ``comm_channels`` is
    comm->nChannels (what NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS pins); ``task_channels``, when
    given, replaces the tuned channel count (a tuner plugin's choice).  ``max_threads`` and
    ``thresholds`` are NCCL's tuning tables keyed by (algo, proto); ``buffsizes`` by proto.
    """

    collective: str
    nranks: int
    count: int
    dtype: str = "float32"
    algo: str = "ring"
    proto: str = "simple"
    op: str = "sum"
    scalar: Optional[float] = None
    root: int = 0
    version: int = DEFAULT_VERSION
    comm_channels: int = 1
    rings: Tuple[Tuple[int, ...], ...] = ()
    trees: Tuple[Tree, ...] = ()
    buffsizes: Tuple[Tuple[str, int], ...] = ()
    max_threads: Tuple[Tuple[Tuple[str, str], int], ...] = ()
    thresholds: Tuple[Tuple[Tuple[str, str], int], ...] = ()
    task_channels: Optional[int] = None
    notes: Tuple[str, ...] = field(default=(), compare=False)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def make(cls, collective: str, nranks: int, count: int, *, dtype: str = "float32",
             algo: str = "ring", proto: str = "simple", op: str = "sum",
             scalar: Optional[float] = None, root: int = 0, version: Any = DEFAULT_VERSION,
             channels: int = 1, ring: Optional[Sequence[int]] = None,
             rings: Optional[Sequence[Sequence[int]]] = None,
             trees: Optional[Sequence[Tree]] = None,
             buffsizes: Optional[Dict[str, int]] = None,
             max_threads: Optional[Dict[Tuple[str, str], int]] = None,
             thresholds: Optional[Dict[Tuple[str, str], int]] = None,
             task_channels: Optional[int] = None) -> "OrderConfig":
        """A checked config; defaults: every channel's ring ``ring`` (else 0..n-1, what one
        search channel copied gives), the double binary trees of one rank per node
        (:func:`ncclpy.order.topology.default_trees`), NCCL's buffer sizes, thread counts and
        thresholds.  ValueError naming the field for anything NCCL would not have."""
        coll = _name(collective, COLLECTIVES, "collective")
        a = _name(algo, ALGOS, "algo")
        p = _name(proto, PROTOS, "proto")
        n = _int(nranks, "nranks", 1)
        c = _int(count, "count", 1)
        k = _int(channels, "channels", 1)
        try:
            v = version if isinstance(version, int) else parse_version(str(version))
        except ValueError as e:
            raise ValueError(f"version: {e}") from None
        most = 64 if v >= 22501 else 32          # MAXCHANNELS: 32 up to 2.24.3, 64 from 2.25.1
        if k > most:
            raise ValueError(f"channels: NCCL {v // 10000}.{v // 100 % 100}.{v % 100} has at "
                             f"most {most} channels (MAXCHANNELS), got {k}")
        if str(dtype) not in DTYPES:
            raise ValueError(f"dtype: expected one of NCCL's types "
                             f"({', '.join(DTYPES)}), got {dtype!r}")
        o = str(op).strip().lower()
        if o not in OPS:
            raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
        if o == "premul_sum" and scalar is None:
            raise ValueError("scalar: premul_sum needs its scalar")
        if o != "premul_sum" and scalar is not None:
            raise ValueError(f"scalar: only premul_sum takes a scalar (op is {o})")
        if o == "premul_sum":
            from ..semantics.reference import premul_scalar_bits
            try:
                premul_scalar_bits(str(dtype), scalar)
            except Exception as e:  # noqa: BLE001 - ncclpy's own refusal, said as the field's
                raise ValueError(f"scalar: {e}") from None
        r = _int(root, "root", 0)
        if r >= n:
            raise ValueError(f"root: expected a rank 0..{n - 1}, got {r}")
        if rings is not None:
            ring_list = tuple(_ring(x, n, f"rings[{i}]") for i, x in enumerate(rings))
            if len(ring_list) < k:
                raise ValueError(f"rings: {k} channels need {k} rings, got {len(ring_list)}")
        else:
            base = _ring(ring if ring is not None else range(n), n, "ring")
            ring_list = tuple(base for _ in range(k))
        if trees is not None:
            tree_list = tuple(_tree(t, n, f"trees[{i}]") for i, t in enumerate(trees))
            if len(tree_list) < k:
                raise ValueError(f"trees: {k} channels need {k} trees, got {len(tree_list)}")
        else:
            tree_list = default_trees(n, k)
        bs = dict(DEFAULT_BUFFSIZES)
        for key, val in (buffsizes or {}).items():
            bs[_name(key, PROTOS, "buffsizes")] = _int(val, f"buffsizes[{key}]", 1)
        mt = dict(DEFAULT_MAX_THREADS)
        mt.update({(_name(x, ALGOS, "max_threads"), _name(y, PROTOS, "max_threads")):
                   _int(val, "max_threads", 1) for (x, y), val in (max_threads or {}).items()})
        th = default_thresholds(n)
        th.update({(_name(x, ALGOS, "thresholds"), _name(y, PROTOS, "thresholds")):
                   _int(val, "thresholds", 0) for (x, y), val in (thresholds or {}).items()})
        tc = None if task_channels is None else _int(task_channels, "task_channels", 1)
        return cls(coll, n, c, str(dtype), a, p, o, None if scalar is None else float(scalar),
                   r, v, k, ring_list, tree_list, tuple(sorted(bs.items())),
                   tuple(sorted(mt.items())), tuple(sorted(th.items())), tc)

    def with_(self, **changes: Any) -> "OrderConfig":
        """A copy with fields replaced (no re-checking: for the model's own variations)."""
        return replace(self, **changes)

    # -- views ------------------------------------------------------------------------------
    @property
    def elem_size(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def buffsize(self) -> int:
        return dict(self.buffsizes)[self.proto]

    @property
    def nthreads(self) -> int:
        return dict(self.max_threads)[(self.algo, self.proto)]

    @property
    def threshold(self) -> int:
        return dict(self.thresholds)[(self.algo, self.proto)]

    @property
    def output_count(self) -> int:
        """Elements of each output (all ranks' for all_reduce; reduce_scatter's per rank)."""
        return self.count

    def describe(self) -> str:
        """``all_reduce ring/simple, 4 ranks, 1024 float32, sum, 2 channels, NCCL 2.28.9``."""
        from .versions import format_version
        op = f"premul_sum({self.scalar:g})" if self.op == "premul_sum" else self.op
        root = f", root {self.root}" if self.collective == "reduce" else ""
        return (f"{self.collective} {self.algo}/{self.proto}, {self.nranks} ranks, "
                f"{self.count} {self.dtype}, {op}{root}, {self.comm_channels} channel"
                f"{'s' if self.comm_channels != 1 else ''}, NCCL {format_version(self.version)}")


def _int(value: Any, what: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, bool) or float(value) != int(value):
                raise ValueError
            value = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: expected an integer >= {lo}, got {value!r}") from None
    if value < lo:
        raise ValueError(f"{what}: expected an integer >= {lo}, got {value}")
    return int(value)


def _ring(ring: Sequence[int], n: int, what: str) -> Tuple[int, ...]:
    try:
        return parse_ring(ring, n)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None


def _tree(tree: Sequence[Any], n: int, what: str) -> Tree:
    try:
        t = tuple((int(up), tuple(int(d) for d in downs)) for up, downs in tree)
        if len(t) != n:
            raise ValueError(f"expected one (up, downs) per rank ({n}), got {len(t)}")
        check_tree(t)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None
    return t
