"""Give a test of Ctrl-C the default SIGINT disposition, however pytest itself was started.

A process started in the background without job control (``nohup cmd &``, ``setsid cmd &``
from a script, some CI runners) inherits SIGINT *ignored*, and so does every process it
starts: an ignored disposition survives ``exec``.  CPython installs its KeyboardInterrupt
handler only when SIGINT is not ignored at start-up, so under such a pytest a SIGINT sent to a
subprocess, or raised in-process, does nothing and every test of Ctrl-C fails for a reason
that is not the product's.  A test that signals a process with SIGINT therefore sets the
disposition that process gets itself:

* :func:`popen_kwargs` (or :func:`default_sigint` as ``preexec_fn``): the child gets SIGINT's
  default disposition before it execs (a Python child then installs KeyboardInterrupt);
* :func:`sigint_handled`: for the duration, this process's SIGINT raises KeyboardInterrupt
  (:func:`signal.default_int_handler`, what an interactive start gives), and whatever it
  starts meanwhile gets the default disposition (a Python handler is reset by ``exec``); the
  previous disposition is restored after.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Any, Callable, Dict, Iterator, Optional

__all__ = ["default_sigint", "popen_kwargs", "sigint_handled"]


def default_sigint() -> None:
    """``preexec_fn``: SIGINT back to its default disposition in the child, before ``exec``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_kwargs(preexec_fn: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """Keyword arguments for :class:`subprocess.Popen` / :func:`subprocess.run`: the child
    starts with SIGINT's default disposition (then runs ``preexec_fn``, if any)."""
    if preexec_fn is None:
        return {"preexec_fn": default_sigint}

    def both() -> None:
        default_sigint()
        preexec_fn()
    return {"preexec_fn": both}


@contextlib.contextmanager
def sigint_handled() -> Iterator[None]:
    """While active (main thread only): SIGINT raises KeyboardInterrupt in this process, as
    when it was started from a terminal; the previous disposition is restored after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        # None: a handler not installed from Python; the default is the nearest to it
        signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)
