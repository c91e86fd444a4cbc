"""POSIX shared memory for the CPU engine's ranks in several processes: one named segment per
rank and communicator (its control block) and one per rank for its payloads.

Segments are opened with ``shm_open`` and mapped with ``mmap`` directly (not
``multiprocessing.shared_memory``, whose resource tracker would start a process and unlink
segments a peer still maps).  A name exists only until every peer has mapped the segment: the
owner then unlinks it, so a killed job leaves nothing behind in /dev/shm once it got that far.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

import numpy as np

try:
    import _posixshmem
except ImportError:  # pragma: no cover - not a POSIX system
    _posixshmem = None

__all__ = ["Segment", "available"]


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

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name: Optional[str] = name
        self.mm = mm
        self.size = len(mm)
        self.owner = owner
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.addr = ctypes.addressof(self._anchor)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """A new segment of ``size`` bytes (zeroed); fails if ``name`` exists."""
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink(name)
            raise
        os.close(fd)
        return cls(name, mm, True)

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
