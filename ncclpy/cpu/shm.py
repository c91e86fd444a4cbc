"""POSIX shared memory for the CPU engine's ranks in several processes: one file per rank and
communicator (its control block, then its payloads: :mod:`ncclpy.cpu.channel`).

Files are opened with ``shm_open`` and mapped with ``mmap`` directly (not
``multiprocessing.shared_memory``, whose resource tracker would start a process and unlink
segments a peer still maps).  Their owner holds a shared ``flock`` on its descriptor while it
lives; each peer keeps a descriptor of its own, so a file's name exists only until every peer
has opened it: its owner then unlinks it, and a payload area that grows later grows in the same
file (:meth:`Segment.grow`; peers map more of it through their descriptor).  Once a job's ranks
have connected, nothing of it is named in /dev/shm, so no death can leave it there.  A peer
tells its owner's death from the lock (:meth:`Segment.holder_gone`: no pid is trusted, pids
are reused and differ between PID namespaces).  What a rank killed before its peers connected
left is unlinked by ``ncclpy run`` and ``ncclpy.spawn`` once the job has ended (:func:`sweep`
with ``pids``), by the survivors that saw it die, and by every CPU-backend process when it
starts (what dead processes left, older than 10 s).
"""
from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import mmap
import os
from typing import Iterable, Optional

from ..debug.verdicts import LOCAL     # the words that make the watchdog suspect no peer

try:
    import _posixshmem
except ImportError:  # pragma: no cover - not a POSIX system
    _posixshmem = None

__all__ = ["Mapping", "Segment", "ShmFull", "SHM_DIR", "available", "sweep"]

#: where POSIX shared memory lives on Linux
SHM_DIR = "/dev/shm"


def available() -> Optional[str]:
    """None when POSIX shared memory is usable here, else why not."""
    if _posixshmem is None:
        return "this Python has no POSIX shared memory (_posixshmem)"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


class ShmFull(OSError):
    """/dev/shm had no room for ``nbytes``: this rank's own failure (``rank``: set by the
    channel that asked), said in one line with the remedy."""

    def __init__(self, nbytes: int, why: str, rank: Optional[int] = None) -> None:
        super().__init__(_errno.ENOSPC, why)
        self.nbytes, self.why, self.rank = nbytes, why, rank

    def __str__(self) -> str:
        who = "this rank" if self.rank is None else f"rank {self.rank}"
        return (f"CPU backend: {who} ran out of shared memory: {SHM_DIR} has no room for "
                f"{_bytes(self.nbytes)} more ({self.why}); {LOCAL}: {SHM_DIR} is this "
                f"machine's, shared by all its ranks: free it or make it larger (in Docker: "
                f"docker run --shm-size=1g ...; Docker's default is 64 MiB)")


class Mapping:
    """One ``mmap`` of a segment's file: ``addr`` (its address), ``size``."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.size = len(mm)
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.addr = ctypes.addressof(self._anchor)

    def close(self) -> None:
        """Unmap; no address from it may be used after."""
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:     # a view still alive: the mapping goes with it
            pass


def _fallocate(fd: int, size: int, had: int) -> None:
    """Give the file ``size`` bytes now (never a SIGBUS later); :class:`ShmFull` when there is
    no room (the file keeps its size)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (_errno.ENOSPC, _errno.ENOMEM, _errno.EFBIG):
            raise
        try:
            os.ftruncate(fd, had)
        except OSError:
            pass
        raise ShmFull(size - had, e.strerror or str(e)) from None


class Segment:
    """One shared-memory file: ``name`` (None once unlinked), ``head`` (a mapping of its first
    bytes: ``addr`` and ``size`` are its), its descriptor (kept: the owner's holds a shared
    ``flock`` while it lives; a peer's maps more of the file and tests that lock)."""

    def __init__(self, name: str, fd: int, owner: bool, head: int) -> None:
        self.name: Optional[str] = name
        self.made_as = name
        self.owner = owner
        self._fd = fd
        self.head = Mapping(mmap.mmap(fd, head))
        self.addr, self.size = self.head.addr, self.head.size

    @classmethod
    def create(cls, name: str, size: int, head: Optional[int] = None) -> "Segment":
        """A new file of ``size`` bytes (zeroed), its first ``head`` bytes (default all)
        mapped; fails if ``name`` exists, and with :class:`ShmFull` when /dev/shm has no
        room (never a SIGBUS later).  The owner holds a shared ``flock`` on it while it lives:
        :func:`sweep` removes only files nobody holds, and peers tell its death by it."""
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            _fallocate(fd, size, 0)
            seg = cls(name, fd, True, size if head is None else head)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink(name)
            raise
        return seg

    @classmethod
    def attach(cls, name: str, head: int) -> Optional["Segment"]:
        """Open an existing file and map its first ``head`` bytes, keeping its descriptor;
        None while it does not exist or is smaller (still being sized)."""
        try:
            fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < head:
                os.close(fd)
                return None
            return cls(name, fd, False, head)
        except BaseException:
            os.close(fd)
            raise

    def file_size(self) -> int:
        """The file's size now (its owner grows it)."""
        return os.fstat(self._fd).st_size

    def grow(self, size: int) -> None:
        """Make the file ``size`` bytes (owner; never smaller): :class:`ShmFull` when there is
        no room."""
        had = self.file_size()
        if size > had:
            _fallocate(self._fd, size, had)

    def map(self, offset: int, length: int) -> Mapping:
        """A new mapping of ``length`` bytes from ``offset`` (a multiple of the page size)."""
        return Mapping(mmap.mmap(self._fd, length, offset=offset))

    def holder_gone(self) -> bool:
        """Whether the owner's lock is gone (a peer's test: its process ended, or it closed
        the file).  Never takes a live owner for gone; may take a gone one for live while
        another peer tests at the same moment (the next test sees it)."""
        if self.owner or self._fd < 0:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False                  # the owner (or a peer testing now) holds it
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def unlink(self) -> None:
        """Remove the name (mappings and descriptors stay valid); owners only, once."""
        if self.owner and self.name is not None:
            name, self.name = self.name, None
            try:
                _posixshmem.shm_unlink(name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink (owner), unmap the head, close the descriptor (the owner's lock goes)."""
        self.unlink()
        self.head.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sweep(root: str = SHM_DIR, min_age: float = 10.0,
          pids: Optional[Iterable[int]] = None) -> int:
    """Unlink the CPU backend's files no live process owns (a killed job's: its owner's
    shared ``flock`` went with it; older than ``min_age`` seconds, so a file being created
    is never taken); how many.  Works across PID namespaces sharing /dev/shm.  ``pids``: only
    the files of those processes (named ``...-p<pid>``), whatever their age: a launcher's
    ranks once they have all ended, or a peer a survivor saw die."""
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
