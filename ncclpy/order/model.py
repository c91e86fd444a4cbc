"""The reduction-order model: which fold NCCL computes for every output element of one Ring or
Tree call, and the bits that fold gives for given inputs.

:func:`predict` turns an :class:`~ncclpy.order.config.OrderConfig` into a :class:`Prediction`
or raises :class:`~ncclpy.order.versions.CannotPredict` with the reason.  The per-element work
is vectorized (numpy over element indices); the rules are NCCL's device loops at v2.28.9-1
(identical through v2.30.7-1, :mod:`ncclpy.order.versions`):

* Ring all_reduce (src/device/all_reduce.h:13-83): a channel's part is cut into loops of
  ``nranks*chunkCount``; the last, shorter loop uses ``alignUp(divUp(rem, nranks),
  16/sizeof(T))`` per chunk (:36).  Chunk c of a loop is sent first by ring position c+1
  (step 0, :43: chunk = ringIx-1), reduced at positions c+2 ... (:50-55: chunk ringIx-j at
  step j) and finished at position c (:60-64), then only copied (:67-81): it folds positions
  c+1, c+2, ..., c+n.
* reduce_scatter (reduce_scatter.h:33-54): the block for rank r is sent first by the rank
  after r in the ring (``ringRanks[nranks-1]`` is the sender's previous rank, i.e. the
  destination is one step behind) and ends at r: positions idx(r)+1 ... idx(r)+n, the same
  for every chunk.
* reduce (reduce.h:32-52): the rank after the root sends, each next one reduces, the root
  ends: positions idx(root)+1 ... idx(root)+n.
* Tree all_reduce (all_reduce.h:149-229): :func:`ncclpy.order.topology.tree_expr` of the
  channel's tree; every element of the channel folds the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .arith import BLOCK, Arith
from .config import OrderConfig
from .split import GRAIN, Split, align_up, cbd_split, chunk_bytes, div_up, tuned_channels
from .topology import Expr, normalize_ring, ring_rotation, tree_expr
from .versions import CannotPredict, port_for

__all__ = ["OrderMap", "Prediction", "predict"]

#: chunkGrains{Lo,Mid,Hi} are 21-bit fields of ncclDevWorkColl (src/include/device.h:297)
_GRAIN_BITS = 21


@dataclass(frozen=True)
class OrderMap:
    """The fold of every element of one output: element e computes ``exprs[group[e]]``."""

    exprs: Tuple[Expr, ...]
    group: np.ndarray

    def expr(self, element: int) -> Expr:
        return self.exprs[int(self.group[element])]

    def runs(self) -> List[Tuple[int, int, int]]:
        """Maximal runs of elements sharing a fold: (first, last, group), in element order."""
        g = self.group
        if g.size == 0:
            return []
        cuts = np.flatnonzero(np.diff(g)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [g.size])) - 1
        return [(int(s), int(e), int(g[s])) for s, e in zip(starts, ends)]

    def elements_of(self, group: int) -> np.ndarray:
        return np.flatnonzero(self.group == group)


@dataclass(frozen=True)
class Prediction:
    """What NCCL computes for ``config``: the split, and the fold of every output element of
    every rank (``maps``: None where NCCL writes no reduction, reduce's non-roots; built on
    first use, as :meth:`spans` and :meth:`outputs` do without them)."""

    config: OrderConfig
    split: Split
    port: str
    _maps: List[Tuple[Optional[OrderMap], ...]] = field(default_factory=list, repr=False,
                                                        compare=False)

    @property
    def maps(self) -> Tuple[Optional[OrderMap], ...]:
        if not self._maps:
            self._maps.append(_maps(self.config, self.split))
        return self._maps[0]

    def defined(self, rank: int) -> bool:
        """Whether NCCL writes a reduction into ``rank``'s output."""
        cfg = self.config
        if not 0 <= rank < cfg.nranks:
            raise IndexError(f"rank: expected 0..{cfg.nranks - 1}, got {rank}")
        return cfg.collective != "reduce" or rank == cfg.root

    def order_map(self, rank: int = 0) -> Optional[OrderMap]:
        return self.maps[rank]

    def spans(self, rank: int = 0) -> Optional[List[Tuple[int, int, Expr]]]:
        """``rank``'s output as runs ``(start, stop, fold)`` in element order, computed from the
        split alone (no per-element arrays: what a fast evaluation walks); None where NCCL
        writes no reduction."""
        if not self.defined(rank):
            return None
        cfg = self.config
        n = cfg.nranks
        if n == 1:
            return [(0, cfg.count, 0)]
        out: List[Tuple[int, int, Expr]] = []
        for part in self.split.parts:
            lo, hi = part.offset, part.offset + part.count
            if cfg.algo == "tree":
                out.append((lo, hi, tree_expr(cfg.trees[part.channel])))
            elif cfg.collective == "all_reduce":
                rots = [ring_rotation(cfg.rings[part.channel], s) for s in range(n)]
                out += [(lo + a, lo + b, rots[s])
                        for a, b, s in _ring_runs(part.count, part.chunk, n, cfg.elem_size)]
            else:
                ring = normalize_ring(cfg.rings[part.channel])
                out.append((lo, hi, ring_rotation(ring, (ring.index(rank) + 1) % n)))
        return out

    def outputs(self, inputs: Sequence[np.ndarray],
                ranks: Optional[Sequence[int]] = None) -> List[Optional[np.ndarray]]:
        """Each rank's output for ``inputs`` (one logical array per rank: all_reduce/reduce
        ``count`` elements, reduce_scatter ``nranks*count``); bfloat16/float8 as their uint
        views.  Ranks with no defined output, and ranks not in ``ranks`` (default: all), get
        None.  Evaluated run by run (:meth:`spans`), each run one fold over slices."""
        cfg = self.config
        n = cfg.nranks
        if len(inputs) != n:
            raise ValueError(f"inputs: expected {n} arrays (one per rank), got {len(inputs)}")
        want = cfg.count * (n if cfg.collective == "reduce_scatter" else 1)
        arrs = [np.ascontiguousarray(a).reshape(-1) for a in inputs]
        for r, a in enumerate(arrs):
            if a.size != want:
                raise ValueError(f"inputs[{r}]: expected {want} elements, got {a.size}")
        ar = Arith(cfg.dtype, cfg.op, n, cfg.scalar)
        shared: Optional[np.ndarray] = None
        out: List[Optional[np.ndarray]] = []
        for r in range(n):
            if not self.defined(r) or (ranks is not None and r not in ranks):
                out.append(None)
                continue
            if cfg.collective == "all_reduce" and shared is not None:
                out.append(shared.copy())        # every rank has the same folds
                continue
            off = r * cfg.count if cfg.collective == "reduce_scatter" else 0
            res = _evaluate(ar, self.spans(r), [a[off:off + cfg.count] for a in arrs])
            if cfg.collective == "all_reduce":
                shared = res
            out.append(res)
        return out


def _evaluate(ar: Arith, spans: List[Tuple[int, int, Expr]],
              blocks: List[np.ndarray]) -> np.ndarray:
    """Fold every run of one output over slices of the inputs (views, BLOCK elements at most
    at a time: bounds the memory of a 64 MiB prediction)."""
    count = blocks[0].size
    res: Optional[np.ndarray] = None
    for lo, hi, expr in spans:
        for a in range(lo, hi, BLOCK):
            b = min(hi, a + BLOCK)
            part = ar.finish(ar.evaluate(expr, [ar.leaf(x[a:b]) for x in blocks]))
            if res is None:
                if a == 0 and b == count:
                    return np.array(part, copy=True)
                res = np.empty(count, dtype=part.dtype)
            res[a:b] = part
    assert res is not None
    return res


def _ring_runs(count: int, chunk: int, nranks: int,
               elem_size: int) -> List[Tuple[int, int, int]]:
    """(first, stop, starting ring position) of every chunk of one channel's part of ``count``
    elements with chunkCount ``chunk``: the runs :func:`_ring_starts` gives, element for
    element (all_reduce.h:32-64)."""
    loop = nranks * chunk
    out = []
    for base in range(0, count, loop):
        rem = count - base
        kp = chunk if rem >= loop else align_up(div_up(rem, nranks), 16 // elem_size)
        end = min(base + loop, count)
        for c in range(nranks):
            a, b = base + c * kp, min(base + (c + 1) * kp, end)
            if a >= b:
                break
            out.append((a, b, (c + 1) % nranks))
    return out


def _ring_starts(count: int, chunk: int, nranks: int, elem_size: int) -> np.ndarray:
    """The ring position that starts each element's fold, for one channel's part of ``count``
    elements with chunkCount ``chunk`` (all_reduce.h:32-64)."""
    o = np.arange(count, dtype=np.int64)
    loop = nranks * chunk
    base = (o // loop) * loop
    rem = count - base
    short = _align_up_vec((rem + nranks - 1) // nranks, 16 // elem_size)
    kp = np.where(rem < loop, short, chunk)
    c = (o - base) // kp
    return (c + 1) % nranks


def _align_up_vec(x: np.ndarray, a: int) -> np.ndarray:
    return (x + a - 1) // a * a


class _Exprs:
    """Distinct fold expressions, numbered in order of first use."""

    def __init__(self) -> None:
        self.ids: Dict[Expr, int] = {}

    def id(self, e: Expr) -> int:
        return self.ids.setdefault(e, len(self.ids))

    def tuple(self) -> Tuple[Expr, ...]:
        return tuple(self.ids)


def _refuse_unmodelled(cfg: OrderConfig) -> None:
    if cfg.algo == "tree" and cfg.collective != "all_reduce":
        raise CannotPredict(
            f"NCCL has no Tree kernel for {cfg.collective} (src/device/"
            f"{cfg.collective}.h defines Ring, PAT, NVLS and CollNet ones only): NCCL_ALGO=Tree "
            f"makes it fail with 'no algorithm/protocol available'")


def predict(cfg: OrderConfig) -> Prediction:
    """The prediction for ``cfg`` (CannotPredict with the reason for what the model does not
    cover)."""
    port = port_for(cfg.version)
    _refuse_unmodelled(cfg)
    n = cfg.nranks
    es = cfg.elem_size
    nc = cfg.task_channels if cfg.task_channels is not None else tuned_channels(
        cfg.collective, cfg.algo, cfg.proto, n, cfg.count, es, cfg.comm_channels,
        cfg.nthreads, cfg.threshold)
    cb = chunk_bytes(cfg.collective, cfg.algo, cfg.proto, cfg.buffsize)
    if cb == 0:
        raise CannotPredict(f"a {cfg.proto} buffer of {cfg.buffsize} bytes gives no chunk "
                            f"(NCCL would not run it)")
    if cb // GRAIN[cfg.proto] >= 1 << _GRAIN_BITS:
        raise CannotPredict(f"a {cfg.proto} buffer of {cfg.buffsize} bytes overflows NCCL's "
                            f"21-bit chunkGrains field (src/include/device.h:297)")
    split = cbd_split(port, cfg.collective, cfg.proto, n, cfg.count, es, nc,
                      cfg.comm_channels, {"lo": cb, "mid": cb, "hi": cb})
    return Prediction(cfg, split, port.name)


def _maps(cfg: OrderConfig, split: Split) -> Tuple[Optional[OrderMap], ...]:
    """Every rank's OrderMap (None where NCCL writes no reduction)."""
    n = cfg.nranks
    if n == 1:
        return (OrderMap((0,), np.zeros(cfg.count, dtype=np.int32)),)
    maps: List[Optional[OrderMap]]
    if cfg.collective == "all_reduce":
        maps = [_all_reduce_map(cfg, split)] * n
    elif cfg.collective == "reduce_scatter":
        maps = [_rotation_map(cfg, split, r) for r in range(n)]
    else:
        maps = [None] * n
        maps[cfg.root] = _rotation_map(cfg, split, cfg.root)
    return tuple(maps)


def _all_reduce_map(cfg: OrderConfig, split: Split) -> OrderMap:
    n = cfg.nranks
    ex = _Exprs()
    group = np.empty(cfg.count, dtype=np.int32)
    for part in split.parts:
        sl = slice(part.offset, part.offset + part.count)
        if cfg.algo == "tree":
            group[sl] = ex.id(tree_expr(cfg.trees[part.channel]))
            continue
        ring = cfg.rings[part.channel]
        ids = np.array([ex.id(ring_rotation(ring, s)) for s in range(n)], dtype=np.int32)
        group[sl] = ids[_ring_starts(part.count, part.chunk, n, cfg.elem_size)]
    return OrderMap(ex.tuple(), group)


def _rotation_map(cfg: OrderConfig, split: Split, rank: int) -> OrderMap:
    """reduce_scatter's block of ``rank`` / reduce's root: positions idx(rank)+1 ... +n."""
    ex = _Exprs()
    group = np.empty(cfg.count, dtype=np.int32)
    for part in split.parts:
        ring = normalize_ring(cfg.rings[part.channel])
        start = (ring.index(rank) + 1) % cfg.nranks
        group[part.offset:part.offset + part.count] = ex.id(ring_rotation(ring, start))
    return OrderMap(ex.tuple(), group)
