"""POSIX shared memory for the CPU engine's ranks in several processes: one named segment per
rank and communicator (its control block) and one per rank for its payloads.

Segments are opened with ``shm_open`` and mapped with ``mmap`` directly (not
``multiprocessing.shared_memory``, whose resource tracker would start a process and unlink
segments a peer still maps).  A control block's name exists only until every peer has mapped
it: its owner then unlinks it.  Payload segments keep their names while their rank lives (peers map each new one as it grows), so a
killed rank leaves its payload segments behind: ``ncclpy run`` and ``ncclpy.spawn`` unlink those
of their ranks once the job has ended (:func:`sweep` with ``pids``; with ``--cpu`` or not), and
every CPU-backend process sweeps what dead processes left (older than 10 s) when it starts.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Iterable, Optional

import numpy as np

try:
    import _posixshmem
except ImportError:  # pragma: no cover - not a POSIX system
    _posixshmem = None

__all__ = ["Segment", "available", "sweep"]


def available() -> Optional[str]:
    """None when POSIX shared memory is usable here, else why not."""
    if _posixshmem is None:
        return "this Python has no POSIX shared memory (_posixshmem)"
    if not os.path.isdir("/dev/shm"):
        return "/dev/shm does not exist"
    return None


class Segment:
    """One mapped segment: ``addr`` (its address), ``i64`` (an int64 view of its start: the
    control fields), ``name`` (None once unlinked)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, fd: int = -1) -> None:
        self.name: Optional[str] = name
        self.made_as = name
        self._fd = fd                     # an owner's: held with a shared flock while alive
        self.mm = mm
        self.size = len(mm)
        self.owner = owner
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.addr = ctypes.addressof(self._anchor)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """A new segment of ``size`` bytes (zeroed); fails if ``name`` exists, and with an
        :class:`OSError` naming /dev/shm when it has no room (never a SIGBUS later).  The
        owner holds a shared ``flock`` on it while it lives: :func:`sweep` removes only
        segments nobody holds."""
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(e.errno, f"CPU backend: /dev/shm has no room for {size} bytes "
                                       f"({e.strerror}); free it or make it larger") from None
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink(name)
            raise
        return cls(name, mm, True, fd)

    @classmethod
    def attach(cls, name: str) -> Optional["Segment"]:
        """Map an existing segment; None while it does not exist (or is still being sized)."""
        try:
            fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, False)

    def view(self, dtype: type, count: int, offset: int = 0) -> np.ndarray:
        """A numpy view of ``count`` items of ``dtype`` at ``offset``."""
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid); owners only, once."""
        if self.owner and self.name is not None:
            name, self.name = self.name, None
            try:
                _posixshmem.shm_unlink(name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink (owner) and unmap; views made by :meth:`view` must be gone."""
        self.unlink()
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:     # a numpy view still alive: the mapping goes with it
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sweep(root: str = "/dev/shm", min_age: float = 10.0,
          pids: Optional[Iterable[int]] = None) -> int:
    """Unlink the CPU backend's segments no live process owns (a killed job's: its owner's
    shared ``flock`` went with it; older than ``min_age`` seconds, so a segment being created
    is never taken); how many.  Works across PID namespaces sharing /dev/shm.  ``pids``: only
    the payload segments of those processes (named ``...-p<pid>``), whatever their age: a
    launcher's ranks, once they have all ended."""
    import time
    n = 0
    try:
        names = [x for x in os.listdir(root) if x.startswith("ncclpy-")]
    except OSError:
        return 0
    if pids is not None:
        ends = tuple(f"-p{int(p)}" for p in pids)
        names = [x for x in names if ends and x.endswith(ends)]
        min_age = 0.0
    now = time.time()
    for name in names:
        path = os.path.join(root, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue                  # its owner is alive
            try:
                os.unlink(path)
                n += 1
            except OSError:
                pass
        finally:
            os.close(fd)
    return n
