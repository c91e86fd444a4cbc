"""Waiting for an event in a test, with a bound on a hang only (issue 40: no fixed windows as
expected durations): :func:`wait_until` polls a condition; :data:`HANG` is the bound, far
beyond what any wait it bounds takes on a loaded machine."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Tuple

__all__ = ["HANG", "wait_until", "in_thread"]

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


def in_thread(fn: Callable[..., Any], *args: Any) -> Tuple[threading.Thread, Dict[str, Any]]:
    """Start ``fn(*args)`` on a daemon thread; (the thread, a dict that gets ``value`` or
    ``error``, what it returned or raised)."""
    out: Dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: B902 - examined by the test
            out["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out
