"""Waiting for an event in a test, with a bound on a hang only (issue 40: no fixed windows as
expected durations): :func:`wait_until` polls a condition; :data:`HANG` is the bound, far
beyond what any wait it bounds takes on a loaded machine."""
from __future__ import annotations

import time
from typing import Callable

__all__ = ["HANG", "wait_until"]

#: seconds: a bound on a hang only.  The waits it bounds end in about a second on an idle
#: machine and later on a loaded one, never this late; no test expects a duration under it.
HANG = 30.0


def wait_until(pred: Callable[[], object], what: str, bound: float = HANG) -> None:
    """Return once ``pred()`` is true; fail naming ``what`` if it is not within ``bound``
    seconds (a hang)."""
    end = time.monotonic() + bound
    while not pred():
        assert time.monotonic() < end, f"{what}: not within {bound:g} s"
        time.sleep(0.005)
