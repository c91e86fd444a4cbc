"""Test configuration: make ``gpu_util`` importable from every test directory; the store
fixtures (``server``, ``store``) the store test files share; the whole suite on every core,
its processes with a bytecode cache of their own."""
import atexit
import os
import shutil
import sys
import tempfile

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)
_root = os.path.dirname(_here)
if _root not in sys.path:
    sys.path.insert(0, _root)

from suite_workers import bytecode_cache_env, whole_suite_workers  # noqa: E402 (on the path)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Spread the whole suite over the cores when pytest-xdist is installed (the README's
    ``[test]`` extra installs it); without it, or for anything but the whole suite, nothing
    changes.  Groups (``xdist_group``) keep a module's shared expensive runs on one worker.
    The whole suite also gets its bytecode cache (:func:`_bytecode_cache`)."""
    if hasattr(config, "workerinput"):          # a worker inherits the controller's choices
        return
    where = config.invocation_params.dir
    whole = all(os.path.realpath(os.path.join(where, a)) == os.path.realpath(_here)
                for a in config.args)
    if whole:
        _bytecode_cache()
    if not config.pluginmanager.hasplugin("xdist"):
        return
    n = whole_suite_workers(whole, config.option.numprocesses,
                            config.option.collectonly, config.option.markexpr, os.environ,
                            len(os.sched_getaffinity(0)))
    if n:
        config.option.numprocesses = n
        config.option.dist = "loadgroup"


def _bytecode_cache() -> None:
    """Give the whole suite's run and the processes it starts a bytecode cache of their own,
    removed at the end, where ``PYTHONDONTWRITEBYTECODE`` would make each of them compile ncclpy
    again (:func:`suite_workers.bytecode_cache_env`).  Only the whole suite: the cache holds
    every module's bytecode, torch's and numpy's too (a cache folder replaces their
    ``__pycache__``), which a run compiles once (~4 s of CPU for torch); the suite's ~2,000
    processes repay that, a run of some files (a mutation run's, say) would not."""
    folder = tempfile.mkdtemp(prefix="ncclpy-test-pyc-")
    change = bytecode_cache_env(os.environ, folder)
    if not change:
        os.rmdir(folder)
        return
    atexit.register(shutil.rmtree, folder, True)
    for k, v in change.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    sys.dont_write_bytecode = False
    sys.pycache_prefix = folder


@pytest.fixture
def server():
    """A fresh ncclpy StoreServer on a free loopback port, closed after the test."""
    from ncclpy.store import StoreServer
    srv = StoreServer().start()
    yield srv
    srv.close()


@pytest.fixture
def store(server):
    """A client of ``server`` with a 10 s timeout."""
    from ncclpy.store import TCPStore
    with TCPStore(*server.address, timeout=10) as s:
        yield s


_GUARDED = ("NCCLPY_", "NCCL_", "CUDA_", "TORCH_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_")


def _guarded_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(_GUARDED)}


@pytest.fixture(autouse=True)
def _no_environment_leak(request):
    """A test that leaves an ncclpy/NCCL/CUDA/launcher variable changed in this process fails,
    named, instead of a later test failing for it (2026-11-27: NCCLPY_TRACE_BUFFER=0 leaked and
    every flight-recorder test after it failed).  Each test also starts with NCCL_PARAMs
    unread, as a fresh process does (ncclpy.order.ncclenv caches them as NCCL does)."""
    from ncclpy.order.ncclenv import forget_params
    forget_params()
    before = _guarded_env()
    yield
    after = _guarded_env()
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for k in changed:                       # put it back, so that only this test fails
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        pytest.fail(f"{request.node.nodeid} left the environment changed: " + ", ".join(
            f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed), pytrace=False)
