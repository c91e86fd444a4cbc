"""What one launcher may start on this machine, checked before the first rank starts.

``ncclpy run -n N`` keeps two pipes per rank open (its output and its errors, pumped to the
terminal with the rank's prefix), a rank's process, and three threads per rank (two pumps and a
waiter).  Asking for more than the machine allows used to fork thousands of ranks and then end
on "Too many open files" without naming the real failure; :func:`check_start_limits` refuses
such a request in one line, naming the flag, what N needs and what this process may have, and
raises the soft open-file limit up to the hard one first when that is enough.
"""
from __future__ import annotations

import resource
from typing import Optional

from ..errors import ArgumentError

__all__ = ["FDS_PER_RANK", "THREADS_PER_RANK", "SPARE_FDS", "fds_needed", "check_start_limits"]

#: descriptors the launcher keeps per running rank (stdout and stderr read ends)
FDS_PER_RANK = 2
#: threads the launcher runs per rank (two output pumps and a waiter)
THREADS_PER_RANK = 3
#: descriptors kept free for the launcher itself (store, logs, the pipes of a rank being made)
SPARE_FDS = 64


def fds_needed(nproc: int) -> int:
    """Open files ``ncclpy run`` needs for ``nproc`` ranks on this node."""
    return FDS_PER_RANK * nproc + SPARE_FDS


def _threads_max() -> Optional[int]:
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def check_start_limits(nproc: int, flag: str = "nproc") -> None:
    """Raise ArgumentError when this process cannot hold ``nproc`` ranks (open files, user
    processes/threads, the kernel's thread table); raises the soft open-file limit when the hard
    one allows what is needed."""
    need = fds_needed(nproc)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard == resource.RLIM_INFINITY or hard >= need:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
                soft = need
            except (ValueError, OSError):
                pass
        if soft < need:
            raise ArgumentError(
                f"{flag} {nproc}: starting {nproc} ranks here needs about {need} open files "
                f"({FDS_PER_RANK} output pipes per rank) but this process may open {soft} "
                f"(ulimit -n; hard limit {'unlimited' if hard == resource.RLIM_INFINITY else hard})"
                f"; start fewer ranks per node or raise the limit")
    tasks = (1 + THREADS_PER_RANK) * nproc + SPARE_FDS
    uproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if uproc != resource.RLIM_INFINITY and uproc < tasks:
        raise ArgumentError(
            f"{flag} {nproc}: starting {nproc} ranks here needs about {tasks} processes and "
            f"threads ({THREADS_PER_RANK} launcher threads and a process per rank) but this user "
            f"may have {uproc} (ulimit -u); start fewer ranks per node or raise the limit")
    tmax = _threads_max()
    if tmax is not None and tmax < tasks:
        raise ArgumentError(
            f"{flag} {nproc}: starting {nproc} ranks here needs about {tasks} processes and "
            f"threads but the kernel allows {tmax} in all (/proc/sys/kernel/threads-max); start "
            f"fewer ranks per node")
