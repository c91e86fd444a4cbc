"""Children that die with their parent: ``prctl(PR_SET_PDEATHSIG)`` through ctypes (Linux only).

Best effort: elsewhere, or without a usable libc, nothing happens.  Linux sends the signal when
the *thread* that forked the child exits, so the caller must fork from a thread that outlives
the child (the main thread, or the thread that also waits for the child).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Any, Optional

__all__ = ["prctl_function", "die_with_parent"]

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def prctl_function() -> Optional[Any]:
    """libc's ``prctl`` (load it in the parent: a preexec_fn should not search for libraries);
    None off Linux or without libc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int, parent_pid: Optional[int], prctl: Any = None) -> bool:
    """In a child: get ``sig`` when the parent dies; exit at once if ``parent_pid`` (the
    expected parent, None to skip the check) is already gone. True when armed."""
    prctl = prctl if prctl is not None else prctl_function()
    if prctl is None:
        return False
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died between the fork and prctl: nobody would stop this child
    return True
