"""One-sided RMA (NCCL >= 2.29) on CPU through the faithful STAND-IN for libnccl
(tests/nccl_standin*.py): put_signal / signal / wait_signal through the declared ctypes
prototypes, NCCL's refusals said first (enqueue.cc rmaTaskAppend: a source inside a symmetric
window, signal index and context 0 before 2.32), the calls one-sided for checked mode.
Split from tests/test_nccl_part2.py."""
from __future__ import annotations

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.config import Config
from ncclpy.plan.types import NCCL_FUNCTIONS

from nccl_standin import DevArray, run_ranks, standin

from part2_util import NEW, calls as _calls, comm as _comm
from part2_util import fill as _fill, read as _read


# -- one-sided RMA ------------------------------------------------------------------------------

def test_put_signal_lands_in_the_peers_window_and_wait_signal_waits_for_it():
    """Through the declared ctypes prototypes (issue 35's defect 1: wait_signal's descriptor
    array never reached NCCL); the source lies in a symmetric window, as NCCL requires, and
    the signals are index 0 unless the Config gives more (NCCL 2.32's numRmaSig)."""
    def one(r: int, n: int):
        c = _comm(n, r, config=Config(blocking=True, num_rma_sig=8))
        try:
            wbuf = c.mem_alloc(8, "float32")
            _fill(wbuf, np.zeros(8, np.float32))          # before the collective register
            win = c.register_window(wbuf)
            src = c.mem_alloc(4, "float32")
            swin = c.register_window(src)
            if r == 0:
                _fill(src, np.arange(4, dtype=np.float32) + 10)
                w = c.put_signal(src, 1, win, offset=16)       # signal 0
                with c.group():                       # inside a group: run at its end
                    c.signal(1, signal=5)
                    c.signal(1, signal=5)
                w.wait()
                c.wait_signal([(1, 1, 7)]).wait()
            else:
                c.wait_signal({0: 1}).wait()                   # one signal 0 from rank 0
                c.wait_signal([(0, 2, 5)]).wait()
                c.signal(0, signal=7).wait()
            c.barrier().wait()
            got = _read(wbuf, 8)
            swin.close()
            win.close()
            return got
        finally:
            c.close()
    with standin(version=NEW) as eng:
        got = run_ranks(2, one, 2)
    assert np.array_equal(got[1], np.array([0, 0, 0, 0, 10, 11, 12, 13], np.float32))
    assert np.array_equal(got[0], np.zeros(8, np.float32))
    assert eng.violations == [] and not any(eng.signals.values())
    assert len(_calls(eng, "ncclWaitSignal")) == 3


def test_rma_arguments_are_checked_before_nccl():
    def one(r: int, n: int):
        c = _comm(n, r)
        try:
            win = c.register_window(c.mem_alloc(64))
            x = ncclpy.Buffer(win.ptr, 4, "float32", r)      # a source in a window
            bad = [(lambda: c.put_signal(x, 2, win), errors.ArgumentError, "peer 2 is out of"),
                   (lambda: c.put_signal(x, 1 - r, win, offset=-8), errors.ArgumentError,
                    "offset"),
                   (lambda: c.put_signal(x, 1 - r, win.handle), errors.ArgumentTypeError,
                    "expected an ncclpy.Window"),
                   (lambda: c.signal(1 - r, signal=-1), errors.ArgumentError, "signal"),
                   (lambda: c.signal(1 - r, ctx=2 ** 31), errors.ArgumentError, "ctx"),
                   (lambda: c.wait_signal({}), errors.ArgumentError, "at least one"),
                   (lambda: c.wait_signal([(0,)]), errors.ArgumentTypeError,
                    r"waits\[0\]: expected \(peer, count"),
                   (lambda: c.wait_signal({1 - r: 0}), errors.ArgumentError, "count"),
                   (lambda: c.wait_signal("0:1"), errors.ArgumentTypeError, "waits")]
            for call, exc, text in bad:
                with pytest.raises(exc, match=text):
                    call()
            win.close()
            with pytest.raises(errors.NcclpyError, match="the window is closed"):
                c.put_signal(x, 1 - r, win)
        finally:
            c.close()
    with standin(version=NEW) as eng:
        run_ranks(2, one, 2)
    assert _calls(eng, "ncclPutSignal") == [] and _calls(eng, "ncclSignal") == []

    def old(r: int, n: int):
        c = _comm(n, r)
        try:
            with pytest.raises(errors.VersionError, match=r"ncclSignal needs NCCL >= 2\.29\.2"):
                c.signal(1 - r)
        finally:
            c.close()
    with standin(version=22809):
        run_ranks(2, old, 2)


def test_nccls_rma_refusals_are_said_before_nccl():
    """enqueue.cc rmaTaskAppend (issue 35's defect 4): a put's source must lie in a symmetric
    window of the communicator; signal and context are 0 before NCCL 2.32, below the
    Config's num_rma_sig / num_rma_ctx from 2.32; num_rma_ctx=0 disables RMA.  ncclpy says
    each before NCCL; the stand-in refuses each as NCCL does when handed them directly."""
    def one(r: int, n: int, version: int, cfg: Config):
        c = _comm(n, r, config=cfg)
        try:
            win = c.register_window(c.mem_alloc(64))
            plain = c.register_window(c.mem_alloc(64), symmetric=False)
            x = DevArray(np.ones(4, np.float32), device=r)
            inside = ncclpy.Buffer(plain.ptr, 4, "float32", r)
            if cfg.num_rma_ctx != 0:
                with pytest.raises(errors.ArgumentError, match="inside a window of this comm"):
                    c.put_signal(x, 1 - r, win)
                with pytest.raises(errors.ArgumentError, match="registered with symmetric=Tr"):
                    c.put_signal(inside, 1 - r, win)          # in a non-symmetric window
            ok = ncclpy.Buffer(win.ptr, 4, "float32", r)
            if version < 23200:
                for call in (lambda: c.signal(1 - r, signal=1),
                             lambda: c.wait_signal([(1 - r, 1, 1)]),
                             lambda: c.put_signal(ok, 1 - r, win, ctx=1)):
                    with pytest.raises(errors.ArgumentError, match=r"expected 0, got 1 "
                                       r"\(NCCL < 2\.32 takes only 0"):
                        call()
            elif cfg.num_rma_ctx == 0:
                with pytest.raises(errors.ArgumentError, match="num_rma_ctx=0. disables"):
                    c.signal(1 - r)
            else:
                with pytest.raises(errors.ArgumentError, match=r"signal: expected 0\.\.1, "
                                   r"got 2 \(the communicator's Config"):
                    c.signal(1 - r, signal=2)
            plain.close()
            win.close()
        finally:
            c.close()
    for version, cfg in ((23007, Config(blocking=True)),
                         (NEW, Config(blocking=True, num_rma_sig=2)),
                         (NEW, Config(blocking=True, num_rma_ctx=0))):
        with standin(version=version) as eng:
            run_ranks(2, one, 2, version, cfg)
        assert [c for c in eng.calls if c[0].endswith(":issued")] == [], version

    def raw(r: int, n: int):            # the stand-in's own refusals, through ctypes
        c = _comm(n, r)
        try:
            win = c.register_window(c.mem_alloc(64))
            lib, h = c._lib, c._handle
            x = DevArray(np.ones(4, np.float32), device=r)
            codes = [lib.ncclPutSignal(x.ptr, 4, 7, 1 - r, win.handle, 0, 0, 0, 0, h, None),
                     lib.ncclPutSignal(win.ptr, 4, 7, 1 - r, win.handle, 0, 1, 0, 0, h, None),
                     lib.ncclSignal(1 - r, 0, 1, 0, h, None),
                     lib.ncclWaitSignal(0, None, h, None)]
            win.close()
            return codes
        finally:
            c.close()
    with standin(version=23007) as eng:
        assert run_ranks(2, raw, 2) == [[4, 4, 4, 4]] * 2
    assert eng.violations == []


def test_rma_calls_are_one_sided_for_checked_mode_and_the_recorder():
    from ncclpy.debug.checked import P2P_CALLS
    from ncclpy.debug.recorder import _P2P
    assert {"put_signal", "signal", "wait_signal"} <= P2P_CALLS & _P2P
    assert NCCL_FUNCTIONS["PutSignal"][4] == "peerWin" and NCCL_FUNCTIONS["WaitSignal"] == (
        "nDesc", "signalDescs")


def test_the_source_window_is_the_one_nccl_finds(monkeypatch):
    """dev_runtime.cc ncclDevrFindWindow: the window with the highest start at or below the
    source address, holding it; it must be symmetric (rmaTaskAppend).  ncclpy asks also that
    it hold the whole source.  NCCL_NUM_RMA_CTX overrides the Config's num_rma_ctx as NCCL
    applies it (init.cc envConfigOverride)."""
    from ncclpy.plan.rma import rma_limits, source_window
    sym, plain = (0x1000, 0x1000, True), (0x1800, 0x100, False)
    assert source_window(0x1100, 16, [sym]) == 0
    assert source_window(0x1ff8, 16, [sym]) is None           # runs past the window's end
    assert source_window(0x1810, 16, [sym, plain]) is None    # NCCL finds the plain one
    assert source_window(0x1900, 16, [sym, plain]) is None    # past the plain one: none
    assert source_window(0x0800, 16, [sym]) is None
    assert rma_limits(23203, None, 0).contexts == 0 and rma_limits(22902).signals == 1
    from types import SimpleNamespace
    from ncclpy.comm.rma import CommRMA
    fake = SimpleNamespace(_config=Config(num_rma_ctx=0), _lib=SimpleNamespace(version=23203))
    monkeypatch.setenv("NCCL_NUM_RMA_CTX", "2")
    assert CommRMA._rma_limits(fake).contexts == 2
    monkeypatch.setenv("NCCL_NUM_RMA_CTX", "-1")               # ignored by NCCL too
    assert CommRMA._rma_limits(fake).contexts == 0
