"""Rings and trees as NCCL builds them, and the fold expression each one gives.

A fold expression is what NCCL computes for one output element, written as nested tuples: a
tuple is a left fold of its items, ``(a, b, c)`` = ``(a + b) + c``, and an item is a rank (its
input) or a nested tuple (a sub-result).  A ring gives a flat tuple of every rank; a tree gives
``(v, T(down[0]), T(down[1]), ...)`` for each rank ``v`` (the rank's own input first, then its
children's results in ``down[]`` order: prims_simple.h:233 puts the input in srcs[0] and the
peers after it, common_kernel.h:93-146 folds srcs in order; LL/LL128 fold the same items in
the same order with the operands of each add swapped, prims_ll.h:259-265,
prims_ll128.h:223-252, which IEEE addition does not see).

Trees also come from NCCL's double binary tree (src/graph/trees.cc) for the default topology of
one rank per node, nodes in rank order (what ncclpy's hostid-socket placement gives).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

__all__ = ["Expr", "Tree", "normalize_ring", "ring_rotation", "btree", "dtree",
           "default_trees", "tree_expr", "expr_ranks", "format_expr", "expr_to_json",
           "parse_ring", "check_tree"]

Expr = Union[int, Tuple["Expr", ...]]
#: one channel's tree: for each rank (index), ``(up, (down0, down1, ...))``; up -1 at the root
Tree = Tuple[Tuple[int, Tuple[int, ...]], ...]


def parse_ring(ring: Sequence[int], nranks: int) -> Tuple[int, ...]:
    """Validate a ring (every rank once); ValueError saying what is wrong."""
    r = tuple(int(x) for x in ring)
    if len(r) != nranks or sorted(r) != list(range(nranks)):
        raise ValueError(f"expected each of the {nranks} ranks 0..{nranks - 1} exactly once, "
                         f"got {','.join(str(x) for x in r)}")
    return r


def normalize_ring(ring: Sequence[int]) -> Tuple[int, ...]:
    """The ring rotated to start at rank 0: position p holds the rank whose ``ring->index`` is
    p (setupChannel, src/init.cc:684-690: index = distance from rank 0 along ``next``)."""
    r = tuple(ring)
    i = r.index(0)
    return r[i:] + r[:i]


def ring_rotation(ring: Sequence[int], start: int) -> Tuple[int, ...]:
    """The fold that starts at ring position ``start`` and goes around once (a flat expr)."""
    r = normalize_ring(ring)
    n = len(r)
    return tuple(r[(start + k) % n] for k in range(n))


def btree(nranks: int, rank: int) -> Tuple[int, int, int, int]:
    """ncclGetBtree (src/graph/trees.cc:32-64): (up, down0, down1, parentChildType)."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1), -1
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    child_type = 0 if rank < up else 1
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1, child_type


def dtree(nranks: int, rank: int) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """ncclGetDtree (src/graph/trees.cc:86-109): ((up, d0, d1) of tree 0, the same of tree 1);
    tree 1 mirrors tree 0 for an even count, shifts it by one for an odd count."""
    u0, a0, b0, _ = btree(nranks, rank)
    if nranks % 2 == 1:
        u, d0, d1, _ = btree(nranks, (rank - 1 + nranks) % nranks)
        t1 = (-1 if u == -1 else (u + 1) % nranks, -1 if d0 == -1 else (d0 + 1) % nranks,
              -1 if d1 == -1 else (d1 + 1) % nranks)
    else:
        u, d0, d1, _ = btree(nranks, nranks - 1 - rank)
        t1 = (-1 if u == -1 else nranks - 1 - u, -1 if d0 == -1 else nranks - 1 - d0,
              -1 if d1 == -1 else nranks - 1 - d1)
    return (u0, a0, b0), t1


def default_trees(nranks: int, channels: int) -> Tuple[Tree, ...]:
    """Each channel's tree for one rank per node, nodes in rank order, when NCCL's search found
    one channel: connectTrees (src/graph/connect.cc:137-172) gives channel 0 tree 0 and its
    duplicate channel 1 tree 1 (setTreeDown fills down[] in order, skipping -1, connect.cc:
    117-128; one rank per node has no intra-node child, connect.cc:60-61); ncclTopoPostset
    doubles the channels (connect.cc:439) and copyChannels repeats them from channel 0
    (connect.cc:355-364), so channel c has tree c mod 2."""
    per_tree: List[Tree] = []
    for t in (0, 1):
        ranks = []
        for r in range(nranks):
            up, d0, d1 = dtree(nranks, r)[t]
            ranks.append((up, tuple(d for d in (d0, d1) if d != -1)))
        per_tree.append(tuple(ranks))
    return tuple(per_tree[c % 2] for c in range(channels))


def check_tree(tree: Tree) -> int:
    """Validate one channel's tree (every rank once, one root, ups and downs agree, no cycle);
    returns the root.  ValueError saying what is wrong."""
    n = len(tree)
    roots = [r for r, (up, _) in enumerate(tree) if up == -1]
    if len(roots) != 1:
        raise ValueError(f"expected exactly one root (up = -1), got {len(roots)}")
    if len(tree[roots[0]][1]) > 2:
        raise ValueError(f"root {roots[0]} has {len(tree[roots[0]][1])} children (the root "
                         f"folds at most NCCL_MAX_TREE_ARITY_TOP = 2, device.h:184)")
    for r, (up, downs) in enumerate(tree):
        if up != -1 and not 0 <= up < n:
            raise ValueError(f"rank {r}: up {up} is not a rank")
        if len(downs) > 3:
            raise ValueError(f"rank {r}: {len(downs)} children (NCCL_MAX_TREE_ARITY is 3)")
        for d in downs:
            if not 0 <= d < n or tree[d][0] != r:
                raise ValueError(f"rank {r}: child {d} does not name {r} as its up")
    seen: Dict[int, bool] = {}

    def visit(v: int) -> None:
        if v in seen:
            raise ValueError(f"rank {v} is reached twice")
        seen[v] = True
        for d in tree[v][1]:
            visit(d)
    visit(roots[0])
    if len(seen) != n:
        raise ValueError(f"ranks {sorted(set(range(n)) - set(seen))} are not in the tree")
    return roots[0]


def tree_expr(tree: Tree) -> Expr:
    """The fold expression of a tree all_reduce: T(v) = (x_v, T(down0), T(down1), ...) at the
    root (runTreeSplit, src/device/all_reduce.h:149-229: the root's recvReduceCopySend folds
    its input then down[0], down[1]; each inner rank's recvReduceSend does the same up to 3
    children, NCCL_MAX_TREE_ARITY; every rank then receives the root's result)."""
    root = check_tree(tree)

    def t(v: int) -> Expr:
        downs = tree[v][1]
        if not downs:
            return v
        return (v,) + tuple(t(d) for d in downs)
    return t(root)


def expr_ranks(e: Expr) -> List[int]:
    """The ranks of an expression, left to right."""
    if isinstance(e, int):
        return [e]
    out: List[int] = []
    for item in e:
        out.extend(expr_ranks(item))
    return out


def format_expr(e: Expr) -> str:
    """``((2 + 3) + 0) + 1`` for (2, 3, 0, 1); nested tuples in parentheses."""
    if isinstance(e, int):
        return str(e)
    text = format_expr(e[0])
    for k, item in enumerate(e[1:]):
        right = format_expr(item)
        if not isinstance(item, int):
            right = f"({right})"
        text = f"{text} + {right}" if k == 0 else f"({text}) + {right}"
    return text


def expr_to_json(e: Expr) -> Union[int, list]:
    """Nested lists for JSON (a list is a left fold of its items)."""
    if isinstance(e, int):
        return e
    return [expr_to_json(x) for x in e]
