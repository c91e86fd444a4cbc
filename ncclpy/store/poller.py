"""The server loop's OS layer: a readiness poller and the open-files limit.

``Poller`` is epoll where there is one (Linux), else :mod:`selectors`, with events as epoll's
bits. Its ``poll`` clamps the timeout: epoll takes an ``int`` of milliseconds, so a deadline
weeks away (a ``get`` with a huge timeout) would otherwise raise ``OverflowError``.
"""
from __future__ import annotations

import logging
import select
import selectors
from typing import List, Optional, Tuple

__all__ = ["Poller", "READ", "WRITE", "ERRS", "MAX_POLL_SECONDS", "raise_nofile_limit"]

log = logging.getLogger(__name__)

READ, WRITE = 1, 4            # epoll's EPOLLIN / EPOLLOUT (translated for selectors)
ERRS = 8 | 16                 # EPOLLERR | EPOLLHUP: let recv() report them
MAX_POLL_SECONDS = 60.0       # the loop wakes at least this often; far deadlines just re-arm


class Poller:
    """epoll where there is one (Linux), else ``selectors``; events as epoll's bits."""

    def __init__(self) -> None:
        self._ep = select.epoll() if hasattr(select, "epoll") else None
        self._sel = None if self._ep is not None else selectors.DefaultSelector()

    def register(self, fd: int, ev: int) -> None:
        if self._ep is not None:
            self._ep.register(fd, ev)
        else:
            self._sel.register(fd, self._to_sel(ev))

    def modify(self, fd: int, ev: int) -> None:
        if self._ep is not None:
            self._ep.modify(fd, ev)
        else:
            self._sel.modify(fd, self._to_sel(ev))

    def unregister(self, fd: int) -> None:
        if self._ep is not None:
            self._ep.unregister(fd)
        else:
            self._sel.unregister(fd)

    def poll(self, timeout: Optional[float]) -> List[Tuple[int, int]]:
        """Ready ``(fd, events)``; ``timeout`` None waits forever, any other is clamped to
        ``0 .. MAX_POLL_SECONDS``."""
        if timeout is not None:
            timeout = min(max(timeout, 0.0), MAX_POLL_SECONDS)
        if self._ep is not None:
            return self._ep.poll(-1 if timeout is None else timeout)
        return [(k.fd, (READ if m & selectors.EVENT_READ else 0)
                 | (WRITE if m & selectors.EVENT_WRITE else 0))
                for k, m in self._sel.select(timeout)]

    @staticmethod
    def _to_sel(ev: int) -> int:
        return ((selectors.EVENT_READ if ev & READ else 0)
                | (selectors.EVENT_WRITE if ev & WRITE else 0))

    def close(self) -> None:
        (self._ep or self._sel).close()


def raise_nofile_limit() -> Optional[int]:
    """Raise this process's soft open-files limit to the hard one (best effort).

    A server of 512+ ranks needs 512+ descriptors and many systems default to 1024 soft. Returns
    the soft limit now in force, or None where it cannot be read (no ``resource`` module).
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover
        return None
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft
    # "infinity" is refused for files by some kernels (and macOS caps at OPEN_MAX): step down
    for target in ((hard,) if hard != resource.RLIM_INFINITY else ()) + (1 << 20, 1 << 16, 10240):
        if target <= soft or (hard != resource.RLIM_INFINITY and target > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as e:
            log.debug("store server: could not raise the open-files limit to %d: %s", target, e)
            continue
        log.debug("store server: raised the open-files limit from %d to %d", soft, target)
        return target
    return soft
