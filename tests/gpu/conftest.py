"""GPU tests by world size: ``--gpu-worlds 1,2`` (or ``NCCLPY_GPU_WORLDS=1,2``) keeps only the
GPU tests whose largest world size (``@pytest.mark.gpu_world(n, ...)``: the ranks it spawns at
once) is listed; the others are deselected.  Tests without the ``gpu`` marker are untouched.

The option exists when this directory (or a file in it) is named on the command line, as in
``python -m pytest tests/gpu --gpu-worlds 1,2`` (pytest reads options only from the conftest
files of the paths it is given); the environment variable works however pytest is started.
Under a selection a GPU test without a ``gpu_world`` mark is a usage error, so none is lost.
"""
from __future__ import annotations

import os
from typing import List, Optional, Set, Tuple

import pytest

ENV = "NCCLPY_GPU_WORLDS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-worlds", default=None, metavar="N[,N...]",
                     help=f"run only the GPU tests whose largest world size is one of these "
                          f"(also {ENV}=N,N)")


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


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
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
