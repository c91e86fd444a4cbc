"""``ncclpy order --sweep``: how the fold of each element moves with the message size, for one
collective, world size and configuration (the question "why did prefill and decode give
different bits?").

For every size given, and every exact count between two given sizes where the tuned channel
count changes or a second loop begins (found by bisection), :func:`sweep` computes what NCCL's
planning decides (the tuned channel count, the channels used, the loops of
``nranks*chunkCount`` elements per channel and the last, shorter loop's chunk) and what it does
to the folds: how many distinct
folds the output has, the fold of one element, and how many elements of the common prefix fold
differently from the size before.  Nothing here builds a per-element map: the split is integer
arithmetic (:func:`ncclpy.order.model.predict`), one element's fold and the distinct folds come
from one loop of one channel (:func:`fold_of`, :func:`distinct_folds`), and two sizes are
compared run by run (:meth:`ncclpy.order.model.Prediction.spans`).

Sizes are bytes per rank in nccl-tests' convention (its "size" column): all_reduce and reduce
``count`` elements, reduce_scatter each rank's input of ``nranks*count``
(:func:`parse_sizes`, :func:`count_for`).  The algorithm and protocol are what the config says:
NCCL's own choice between them comes from a bandwidth model of the machine that ncclpy does not
port, so the sweep never changes them.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ArgumentError
from .config import OrderConfig
from .model import Prediction, predict
from .split import Part, Split, align_up, div_up
from .topology import Expr

__all__ = ["SweepError", "Point", "Row", "Sweep", "parse_sizes", "count_for", "sweep",
           "fold_of", "distinct_folds", "differing", "format_bytes", "MAX_RUNS",
           "MAX_BOUNDARIES"]

#: runs (:meth:`Prediction.spans`) above which two sizes are not compared element by element
MAX_RUNS = 1 << 21
#: boundaries searched between two consecutive given sizes
MAX_BOUNDARIES = 64
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?$", re.I)


#: a size list the sweep cannot take (the message says what was given and expected)
SweepError = ArgumentError


def _size(text: str) -> int:
    m = _SIZE.match(text.strip())
    if not m:
        raise SweepError(f"expected a size in bytes such as 8, 64K, 1.5M or 2G (K/M/G are "
                         f"powers of 1024, as nccl-tests reads them), got {text!r}")
    value = Fraction(m.group(1)) * _UNITS[(m.group(2) or "")[:1].lower()]
    if value.denominator != 1:
        raise SweepError(f"{text.strip()!r} is not a whole number of bytes")
    return int(value)


def parse_sizes(text: str) -> List[int]:
    """Bytes from ``1K,4K,64K`` (a list) or ``8..256M`` (nccl-tests' ``-b 8 -e 256M -f 2``:
    from 8 doubling while <= 256M) or ``8..256M:4`` (times 4), or a list of both; sorted,
    duplicates dropped.  SweepError saying what is wrong."""
    out = set()
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise SweepError("expected sizes such as 1K,64K,4M or a range such as 8..256M, got "
                         f"{text!r}")
    for item in items:
        if not item:
            raise SweepError(f"an empty item in {text!r}")
        if ".." not in item:
            out.add(_size(item))
            continue
        lo_text, hi_text = item.split("..", 1)
        factor = 2
        if ":" in hi_text:
            hi_text, f_text = hi_text.split(":", 1)
            if not f_text.strip().isdigit() or int(f_text) < 2:
                raise SweepError(f"{item!r}: expected a factor >= 2 after ':' (MIN..MAX:F), "
                                 f"got {f_text!r}")
            factor = int(f_text)
        lo, hi = _size(lo_text), _size(hi_text)
        if lo < 1:
            raise SweepError(f"{item!r}: a range starts at 1 byte or more (it multiplies)")
        if lo > hi:
            raise SweepError(f"{item!r}: the first size ({lo} bytes) is above the last ({hi})")
        size = lo
        while size <= hi:
            out.add(size)
            size *= factor
    return sorted(out)


def count_for(collective: str, nranks: int, nbytes: int, elem_size: int, dtype: str) -> int:
    """NCCL's count for a size of ``nbytes`` per rank (nccl-tests' size column: reduce_scatter's
    is each rank's input of nranks x count); SweepError when it is not a whole count."""
    if nbytes < 1:
        raise SweepError(f"{nbytes} bytes: expected at least one {elem_size}-byte {dtype} "
                         f"element")
    per = elem_size * (nranks if collective == "reduce_scatter" else 1)
    if nbytes % per:
        if collective == "reduce_scatter":
            raise SweepError(f"{nbytes} bytes is not a multiple of {per} bytes ({nranks} ranks "
                             f"x {elem_size}-byte {dtype}: reduce_scatter's size is each "
                             f"rank's input, nccl-tests' convention)")
        raise SweepError(f"{nbytes} bytes is not a multiple of {elem_size} bytes (the "
                         f"{dtype} element size)")
    return nbytes // per


def format_bytes(n: int) -> str:
    """``64 KiB``, ``4 MiB``; other sizes in bytes (``98306 B``)."""
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


# -- one size -------------------------------------------------------------------------------
def _ring_all_reduce(cfg: OrderConfig) -> bool:
    """Whether the chunking decides folds (Ring all_reduce, all_reduce.h:32-64); Tree,
    reduce_scatter and reduce fold every element of a channel the same way."""
    return cfg.algo == "ring" and cfg.collective == "all_reduce" and cfg.nranks > 1


def _trimmed(pred: Prediction, parts: Sequence[Part]) -> Prediction:
    """A prediction of the same config over a few parts (a fresh one: its maps are its own)."""
    s = pred.split
    return Prediction(pred.config, Split(s.channel_lo, s.channel_hi, s.count_lo, s.count_mid,
                                         s.count_hi, tuple(parts), s.task_channels), pred.port)


def _part_of(split: Split, element: int) -> Part:
    offsets = [q.offset for q in split.parts]
    return split.parts[bisect.bisect_right(offsets, element) - 1]


def fold_of(pred: Prediction, rank: int, element: int) -> Expr:
    """The fold of ``element`` of ``rank``'s output, as ``pred.order_map(rank).expr(element)``
    gives it, from the one loop of the one channel that holds it: the fold of an element of a
    ring all_reduce depends on its loop only through whether that loop is the last, shorter one
    (``rem`` in all_reduce.h:36), which the loop's own elements up to the part's end decide."""
    cfg = pred.config
    if not 0 <= element < cfg.count:
        raise IndexError(f"element: expected 0..{cfg.count - 1}, got {element}")
    part = _part_of(pred.split, element)
    if _ring_all_reduce(cfg):
        loop = cfg.nranks * part.chunk
        base = (element - part.offset) // loop * loop
        part = Part(part.channel, part.offset + base, min(part.count - base, loop), part.chunk)
    spans = _trimmed(pred, [part]).spans(rank)
    assert spans is not None, "rank has no reduction"
    for lo, hi, expr in spans:
        if lo <= element < hi:
            return expr
    raise AssertionError(f"element {element} in no run of its part")


def distinct_folds(pred: Prediction, rank: int) -> List[Expr]:
    """Every fold ``rank``'s output uses (in order of first use): a part's first loop of a ring
    all_reduce, when it is full, starts a chunk at every ring position; a later, shorter loop
    only at some of them."""
    cfg = pred.config
    parts = list(pred.split.parts)
    if _ring_all_reduce(cfg):
        parts = [Part(q.channel, q.offset, min(q.count, cfg.nranks * q.chunk), q.chunk)
                 for q in parts]
    seen: Dict[Expr, None] = {}
    for _, _, expr in _trimmed(pred, parts).spans(rank) or []:
        seen.setdefault(expr, None)
    return list(seen)


def _runs_estimate(pred: Prediction) -> int:
    cfg = pred.config
    if not _ring_all_reduce(cfg):
        return len(pred.split.parts)
    return sum(div_up(q.count, q.chunk) + cfg.nranks for q in pred.split.parts)


def differing(a: Prediction, b: Prediction, rank: int) -> Optional[int]:
    """How many of the elements both outputs have (the shorter's) fold differently in ``a`` and
    ``b``; None when either has more than :data:`MAX_RUNS` runs (not compared)."""
    if max(_runs_estimate(a), _runs_estimate(b)) > MAX_RUNS:
        return None
    sa, sb = a.spans(rank) or [], b.spans(rank) or []
    end = min(a.config.count, b.config.count)
    i = j = pos = diff = 0
    while pos < end:
        while sa[i][1] <= pos:
            i += 1
        while sb[j][1] <= pos:
            j += 1
        stop = min(sa[i][1], sb[j][1], end)
        if sa[i][2] != sb[j][2]:
            diff += stop - pos
        pos = stop
    return diff


# -- the sweep ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """What NCCL's planning gives one size: ``given`` (a size the user asked for) or a boundary
    found by bisection (the first count with a new tuned channel count, or with a second
    loop)."""

    nbytes: int
    count: int
    given: bool
    pred: Prediction
    loops: Optional[int]              # the most loops of nranks*chunk a channel runs (ring AR)
    last_chunk: Optional[int]         # channel lo's last loop's chunk, elements (ring AR)
    folds: int                        # distinct folds of the output
    element: Optional[Expr]           # the fold of the element asked for (None: beyond)
    differ: Optional[int] = None      # elements folding differently from the point before
    shared: int = 0                   # elements this point shares with the point before

    @property
    def task_channels(self) -> int:
        return self.pred.split.task_channels

    @property
    def used(self) -> int:
        return len(self.pred.split.parts)

    def structure(self) -> Tuple[int, int, Optional[int]]:
        """(tuned channels, channels used, loops): a row's points share it."""
        return (self.task_channels, self.used, self.loops)


@dataclass(frozen=True)
class Row:
    """Consecutive points with the same structure, each folding the elements it shares with the
    point before it as that point does (so every element they share folds alike)."""

    points: Tuple[Point, ...]
    changes: Tuple[str, ...]          # what differs from the row before (empty for the first)


@dataclass(frozen=True)
class Sweep:
    """The sweep of ``base`` (its count unused) over ``sizes`` (bytes), for ``rank``'s output
    and ``element``."""

    base: OrderConfig
    rank: int
    element: Optional[int]
    points: Tuple[Point, ...]
    rows: Tuple[Row, ...]
    truncated: Tuple[Tuple[int, int], ...]   # gaps (bytes, bytes) with boundaries left unsearched

    @property
    def chunk(self) -> int:
        return self.points[0].pred.split.parts[0].chunk


def _bytes_of(cfg: OrderConfig, count: int) -> int:
    return count * cfg.elem_size * (cfg.nranks if cfg.collective == "reduce_scatter" else 1)


def _loops(pred: Prediction) -> Tuple[Optional[int], Optional[int]]:
    """(the most loops of nranks*chunk elements a channel runs, channel lo's last loop's chunk
    in elements: alignUp(divUp(rem, nranks), 16/sizeof(T)) when that loop is short,
    all_reduce.h:36); (None, None) where chunks do not decide folds."""
    cfg = pred.config
    if not _ring_all_reduce(cfg):
        return None, None
    n = cfg.nranks
    loops = max(div_up(q.count, n * q.chunk) for q in pred.split.parts)
    q = pred.split.parts[0]
    rem = q.count - (div_up(q.count, n * q.chunk) - 1) * n * q.chunk
    last = q.chunk if rem >= n * q.chunk else align_up(div_up(rem, n), 16 // cfg.elem_size)
    return loops, last


def _point(cfg: OrderConfig, count: int, rank: int, element: Optional[int],
           given: bool) -> Point:
    pred = predict(cfg.with_(count=count))
    loops, last = _loops(pred)
    fold = fold_of(pred, rank, element) if element is not None and element < count else None
    return Point(_bytes_of(cfg, count), count, given, pred, loops, last,
                 len(distinct_folds(pred, rank)), fold)


def _shape(pred: Prediction) -> Tuple[int, Optional[bool]]:
    """What the bisection looks for: the tuned channel count (it only grows with the size, so
    every change is found) and whether every channel runs one loop.  Not searched: the channels
    the split uses (cellsPerChannel's rounding makes them step back and forth by one or two
    near each tuned count, enqueue.cc:603-629) and loops beyond the first (they change every
    nranks x chunk x channels elements); the given sizes show both."""
    loops = _loops(pred)[0]
    return (pred.split.task_channels, None if loops is None else loops == 1)


def _boundaries(cfg: OrderConfig, lo: Point, hi: Point, rank: int,
                element: Optional[int]) -> Tuple[List[Point], bool]:
    """Counts between ``lo`` and ``hi`` where :func:`_shape` changes, each one element past a
    count with the shape of the point before it (so each is exact).  The bool: boundaries
    beyond :data:`MAX_BOUNDARIES` were left unsearched."""
    out: List[Point] = []
    cache: Dict[int, Tuple[int, Optional[bool]]] = {}

    def shape(c: int) -> Tuple[int, Optional[bool]]:
        if c not in cache:
            cache[c] = _shape(predict(cfg.with_(count=c)))
        return cache[c]

    a0, end = lo.count, shape(hi.count)
    while shape(a0) != end:
        if len(out) >= MAX_BOUNDARIES:
            return out, True
        a, b, now = a0, hi.count, shape(a0)   # shape(a) == now != shape(b)
        while b - a > 1:
            mid = (a + b) // 2
            if shape(mid) == now:
                a = mid
            else:
                b = mid
        if b == hi.count:
            break
        out.append(_point(cfg, b, rank, element, False))
        a0 = b
    return out, False


def _changes(prev: Point, cur: Point, element: Optional[int]) -> List[str]:
    out = []
    if prev.task_channels != cur.task_channels:
        out.append(f"tuned channels {prev.task_channels} -> {cur.task_channels}")
    if prev.used != cur.used:
        out.append(f"channels used {prev.used} -> {cur.used}")
    if prev.loops != cur.loops:
        out.append(f"loops {prev.loops} -> {cur.loops}")
    if cur.differ is None:
        out.append("folds not compared (too many runs)")
    elif cur.differ:
        out.append(f"{cur.differ} of the first {cur.shared} elements fold differently")
    if element is not None and prev.element != cur.element and cur.element is not None \
            and prev.element is not None:
        out.append(f"element {element}'s fold changes")
    return out


def sweep(base: OrderConfig, sizes: Sequence[int], rank: int = 0,
          element: Optional[int] = None, search: bool = True) -> Sweep:
    """The sweep of ``base`` over ``sizes`` (bytes per rank, ascending); ``search``: look for the
    exact counts between given sizes where the structure changes.  SweepError for a size that
    is no whole count; CannotPredict (from :func:`predict`) when the model refuses the config.
    """
    if not sizes:
        raise SweepError("no size given")
    counts = [count_for(base.collective, base.nranks, s, base.elem_size, base.dtype)
              for s in sizes]
    given = [_point(base, c, rank, element, True) for c in counts]
    points: List[Point] = [given[0]]
    truncated: List[Tuple[int, int]] = []
    for lo, hi in zip(given, given[1:]):
        if search and _shape(lo.pred) != _shape(hi.pred):
            found, more = _boundaries(base, lo, hi, rank, element)
            points += found
            if more:
                truncated.append((lo.nbytes, hi.nbytes))
        points.append(hi)
    # what each point shares with the one before it
    done: List[Point] = [points[0]]
    for p in points[1:]:
        prev = done[-1]
        done.append(replace(p, differ=differing(prev.pred, p.pred, rank),
                            shared=min(prev.count, p.count)))
    rows: List[Row] = []
    group: List[Point] = [done[0]]
    changes: List[str] = []
    for p in done[1:]:
        prev = group[-1]
        if p.structure() == prev.structure() and p.differ == 0 and p.element == prev.element:
            group.append(p)
            continue
        rows.append(Row(tuple(group), tuple(changes)))
        changes = _changes(prev, p, element)
        group = [p]
    rows.append(Row(tuple(group), tuple(changes)))
    return Sweep(base, rank, element, tuple(done), tuple(rows), tuple(truncated))
