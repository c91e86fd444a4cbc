"""A job for the hang-forensics tests, run by ``ncclpy run`` on ncclpy's CPU backend
(``ncclpy.init(device="cpu")``: real processes, the launcher's real store, ncclpy's real call
path, flight recorder, watchdog and dumps, the data through shared memory).

``python forensics_job.py SCENARIO``: ``ok`` (three all_reduce, all complete), ``skip`` (rank 2
skips the third all_reduce and idles ``JOB_IDLE`` seconds), ``differ`` (rank 2 makes a
broadcast instead), ``unmatched`` (rank 0 sends to rank 1, which never receives), ``stop`` (rank
2 stops itself with SIGSTOP before the third).
Each line that makes a call ends with a ``# CALL <name>`` marker the tests look for.  With
``--real`` (tests/gpu) it runs on real NCCL and CuPy arrays instead.
"""
from __future__ import annotations

import os
import signal
import sys
import time


def main(scenario: str, real: bool = False) -> int:
    return play(scenario, real)


def play(scenario: str, real: bool) -> int:
    import ncclpy
    env = os.environ
    if real:                      # the GPU tests: real NCCL, real device memory
        import cupy
        comm = ncclpy.init("job")
        x = cupy.ones(8, cupy.float32)
    else:
        import numpy as np
        comm = ncclpy.init("job", device="cpu")
        x = np.ones(8, np.float32)
    r = comm.rank
    comm.all_reduce(x).wait()                                 # CALL first
    comm.all_reduce(x).wait()                                 # CALL second
    if scenario == "skip" and r == 2:
        time.sleep(float(env.get("JOB_IDLE", "30")))          # skips the third
    elif scenario == "differ" and r == 2:
        comm.broadcast(x, root=0).wait()                      # CALL differs
    elif scenario == "stop" and r == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif scenario == "unmatched":
        if r == 0:
            comm.send(x, 1).wait()                            # CALL lonely-send
        else:
            time.sleep(float(env.get("JOB_IDLE", "30")))
    else:
        comm.all_reduce(x).wait()                             # CALL third
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--real" in sys.argv[2:]))
