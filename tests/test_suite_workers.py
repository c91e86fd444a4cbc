"""Which runs of the suite are spread over the cores (tests/suite_workers.py, from
tests/conftest.py): only the whole CPU suite, only when nobody chose, never a collection or a
run that selects GPU tests."""
from __future__ import annotations

import pytest

from suite_workers import WORKERS_ENV, whole_suite_workers


def _n(whole=True, numprocesses=None, collectonly=False, markexpr="", env=None, cpus=2):
    return whole_suite_workers(whole, numprocesses, collectonly, markexpr, env or {}, cpus)


def test_the_whole_suite_gets_one_worker_per_core_up_to_eight():
    assert [_n(cpus=c) for c in (1, 2, 3, 16)] == [0, 2, 3, 8]


@pytest.mark.parametrize("kw", [dict(whole=False), dict(numprocesses=0), dict(numprocesses=3),
                                dict(collectonly=True), dict(markexpr="gpu"),
                                dict(markexpr="not gpu and slow")])
def test_anything_else_stays_in_one_process(kw):
    """Some files, a chosen ``-n`` (0 included), a collection, any selection naming the GPU
    marker (GPU tests share one GPU under a device-time budget)."""
    assert _n(**kw) == 0


def test_the_environment_chooses_the_count():
    assert _n(env={WORKERS_ENV: "4"}) == 4
    assert _n(env={WORKERS_ENV: "1"}) == _n(env={WORKERS_ENV: "0"}) == 0
    assert _n(env={WORKERS_ENV: "lots"}, cpus=2) == 2          # not a count: the default
