"""Rank bodies for tests/test_cpu_backend_debug.py: three hangs on the CPU backend
(``ncclpy.init(device="cpu")``), each a real process, on host buffers.

``python cpu_debug_job.py SCENARIO`` (under ``ncclpy run -n 2``), or :func:`spawned` under
``ncclpy.spawn``: one all_reduce every rank makes, then

* ``skip``: rank 1 skips the second all_reduce that rank 0 makes;
* ``unpaired``: rank 0 sends to rank 1, which never receives;
* ``mismatch``: both make the second all_reduce, rank 1 with 4 elements instead of 8.

A rank with nothing left to call idles until the launcher stops it (a bound of
``JOB_IDLE`` seconds, never a timing window).  Each line that makes a call ends with a
``# CALL <name>`` marker the tests look for.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import ncclpy


def _idle() -> None:
    end = time.monotonic() + float(os.environ.get("JOB_IDLE", "60"))
    while time.monotonic() < end:      # stopped by the launcher long before
        time.sleep(0.1)


def play(scenario: str) -> int:
    comm = ncclpy.init("job", device="cpu")
    r = comm.rank
    x = np.ones(8, np.float32)
    comm.all_reduce(x).wait()                                  # CALL first
    if scenario == "skip":
        if r == 0:
            comm.all_reduce(x).wait()                          # CALL skipped
        else:
            _idle()
    elif scenario == "unpaired":
        if r == 0:
            comm.send(x, 1).wait()                             # CALL unpaired-send
        else:
            _idle()
    elif scenario == "mismatch":
        y = x if r == 0 else np.ones(4, np.float32)
        comm.all_reduce(y).wait()                              # CALL mismatched
    comm.close()
    return 0


def spawned(rank: int, scenario: str) -> None:
    """:func:`play` as an ``ncclpy.spawn`` target."""
    play(scenario)


if __name__ == "__main__":
    sys.exit(play(sys.argv[1]))
