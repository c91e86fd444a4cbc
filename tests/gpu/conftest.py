"""GPU tests by world size: ``--gpu-worlds 1,2`` (or ``NCCLPY_GPU_WORLDS=1,2``) keeps only the
GPU tests whose largest world size (``@pytest.mark.gpu_world(n, ...)``: the ranks it spawns at
once) is listed; the others are deselected.  Tests without the ``gpu`` marker are untouched.

The option exists when this directory (or a file in it) is named on the command line, as in
``python -m pytest tests/gpu --gpu-worlds 1,2`` (pytest reads options only from the conftest
files of the paths it is given); the environment variable works however pytest is started.
Under a selection a GPU test without a ``gpu_world`` mark is a usage error, so none is lost.

``--gpu-shard K/N`` (or ``NCCLPY_GPU_SHARD=K/N``) keeps the K-th of N shares of the GPU tests
that remain: N pytest processes with K = 1..N run every test once, side by side (the selftest's
sharded stages).  Tests that share a module- or class-scoped fixture (one spawn for several
tests) stay in one share; the shares are balanced by test count, the biggest groups first.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Set, Tuple

import pytest

ENV = "NCCLPY_GPU_WORLDS"
SHARD_ENV = "NCCLPY_GPU_SHARD"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-worlds", default=None, metavar="N[,N...]",
                     help=f"run only the GPU tests whose largest world size is one of these "
                          f"(also {ENV}=N,N)")
    parser.addoption("--gpu-shard", default=None, metavar="K/N",
                     help=f"run only the K-th of N equal shares of the GPU tests (also "
                          f"{SHARD_ENV}=K/N)")


def parse_shard(text: str) -> Tuple[int, int]:
    """``"2/3"`` -> (2, 3); UsageError unless 1 <= K <= N."""
    k, sep, n = text.strip().partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 1 <= int(k) <= int(n):
        raise pytest.UsageError(f"--gpu-shard / {SHARD_ENV}: expected K/N with 1 <= K <= N "
                                f"(e.g. 1/2), got {text!r}")
    return int(k), int(n)


def parse_worlds(text: str) -> Set[int]:
    """``"1,2"`` -> {1, 2}; UsageError for anything but positive integers."""
    out: Set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise pytest.UsageError(f"--gpu-worlds / {ENV}: expected world sizes such as 1,2 "
                                    f"(integers >= 1), got {text!r}")
        out.add(int(part))
    if not out:
        raise pytest.UsageError(f"--gpu-worlds / {ENV}: no world size in {text!r}")
    return out


def item_worlds(item: pytest.Item) -> Tuple[int, ...]:
    """The world sizes of every ``gpu_world`` mark on ``item`` (empty: none)."""
    sizes: List[int] = []
    for m in item.iter_markers("gpu_world"):
        sizes += [int(a) for a in m.args]
    return tuple(sorted(set(sizes)))


def _selection(config: pytest.Config) -> Optional[str]:
    try:
        text = config.getoption("--gpu-worlds")
    except ValueError:           # this conftest was not read at start-up: no option
        text = None
    return text or os.environ.get(ENV) or None


def _shard(config: pytest.Config) -> Optional[str]:
    try:
        text = config.getoption("--gpu-shard")
    except ValueError:
        text = None
    return text or os.environ.get(SHARD_ENV) or None


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    _select_worlds(config, items)
    text = _shard(config)
    if not text:
        return
    k, n = parse_shard(text)
    gpu = [it for it in items if it.get_closest_marker("gpu") is not None]
    mine = {id(it) for it in shard_of(gpu, n)[k - 1]}
    drop = [it for it in gpu if id(it) not in mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if it.get_closest_marker("gpu") is None
                    or id(it) in mine]


def fixture_group(item: pytest.Item) -> str:
    """The tests that must stay in one shard share this key: the module- or class-scoped
    fixtures they use (their set-up runs once for all of them); a test without one is alone."""
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for name, defs in (getattr(info, "name2fixturedefs", None) or {}).items():
        if defs and str(defs[-1].scope) in ("module", "class", "package"):
            keys.append(f"{defs[-1].baseid}::{name}")
    return "|".join(sorted(keys)) or item.nodeid


def shard_of(items: List[pytest.Item], n: int) -> List[List[pytest.Item]]:
    """``items`` split into ``n`` shares (see the module docstring); the same on every run."""
    groups: Dict[str, List[pytest.Item]] = {}
    for it in sorted(items, key=lambda it: it.nodeid):
        groups.setdefault(fixture_group(it), []).append(it)
    shares: List[List[pytest.Item]] = [[] for _ in range(n)]
    for _key, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        min(shares, key=len).extend(members)
    return shares


def _select_worlds(config: pytest.Config, items: List[pytest.Item]) -> None:
    text = _selection(config)
    if not text:
        return
    want = parse_worlds(text)
    keep: List[pytest.Item] = []
    drop: List[pytest.Item] = []
    for item in items:
        if item.get_closest_marker("gpu") is None:
            keep.append(item)
            continue
        worlds = item_worlds(item)
        if not worlds:
            raise pytest.UsageError(f"{item.nodeid}: a GPU test without a gpu_world mark; "
                                    f"add @pytest.mark.gpu_world(N) (the ranks it spawns)")
        (keep if max(worlds) in want else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the rank pools this session started (tests/rank_pool.py)."""
    import sys
    pool = sys.modules.get("rank_pool")
    if pool is not None:
        pool.close_pools()
