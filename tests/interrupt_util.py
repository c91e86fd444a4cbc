"""Inject a KeyboardInterrupt at each point where CPython can deliver one, in ncclpy's frames.

CPython runs signal handlers (SIGINT's raises KeyboardInterrupt) only at its *eval breaker*
checks, in the thread that runs them: at a function's entry (``RESUME``), right after a
``CALL`` of a C function returns (a Python callee called straight from the eval loop returns
without a check: its entry was the check), and on backward jumps (3.11/3.12
Python/bytecodes.c, ``CHECK_EVAL_BREAKER``).  A blocking C call that waits (a contended lock's
``acquire``) raises the interrupt *instead* of taking effect.  So between a C call's return
and the next such point, nothing can interrupt: ``with lock:`` holds the lock from its
``__enter__`` to the protected block with no check between, which is why the standard
library's locks are safe and ``lock.acquire(); try:`` is not.

:class:`Injector` is a ``sys.settrace`` function that counts those points in the frames of
ncclpy's own modules (everything under ``ncclpy/`` except the CPU engine, ``ncclpy/cpu``, which
stands for libnccl and the CUDA runtime: C code in production, so calls into it are C calls)
and raises KeyboardInterrupt at point number ``at`` (once; ``at=-1``: count only).  It is a
little different from CPython in two places: a Python function that a ``functools.partial``
called counts as called straight (no check when the partial returns: the ctypes route's
dispatch; its own checks, after the C call inside, are visited), and the interrupt is raised
before the next instruction instead of at the call: where the two have different exception
handlers (a protected block ends or begins right after the call, as in ``return f()`` inside
``try``, whose ``finally`` is copied after the call) the point is skipped, not misplaced.
"""
from __future__ import annotations

import dis
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import ncclpy

__all__ = ["Injector", "inject_each"]

_ROOT = os.path.dirname(os.path.abspath(ncclpy.__file__)) + os.sep
_ENGINE = os.path.join(_ROOT, "cpu") + os.sep
_CALLS = {dis.opmap[n] for n in ("CALL", "CALL_FUNCTION_EX", "CALL_KW") if n in dis.opmap}
_JUMPS = {v for k, v in dis.opmap.items() if "JUMP_BACKWARD" in k and "NO_INTERRUPT" not in k}
_CACHE: Dict[str, bool] = {}
#: Python callees that C calls (a class's __init__ through type.__call__, ...): the caller's
#: CALL checks when they return
_VIA_C = frozenset(("__init__", "__new__", "__call__", "__del__", "__enter__", "__exit__"))


_TABLES: Dict[Any, List[Tuple[int, int, int]]] = {}


def _handler(code: Any, offset: int) -> int:
    """The exception handler (its target offset; -1: none) covering ``offset`` in ``code``."""
    table = _TABLES.get(code)
    if table is None:
        parse = getattr(dis, "_parse_exception_table", None)
        entries = parse(code) if parse is not None else []
        table = _TABLES[code] = [(e.start, e.end, e.target) for e in entries]
    for start, end, target in table:
        if start <= offset < end:
            return target
    return -1


def _ours(filename: str) -> bool:
    v = _CACHE.get(filename)
    if v is None:
        v = _CACHE[filename] = filename.startswith(_ROOT) and not filename.startswith(_ENGINE)
    return v


class Injector:
    """The trace function (see the module docstring): ``points`` counts the delivery points
    passed; ``where`` is the one interrupted ((function, line) or None)."""

    def __init__(self, at: int = -1) -> None:
        self.at = at
        self.points = 0
        self.where: Optional[Tuple[str, int]] = None
        self._after: Dict[Any, str] = {}     # frame -> "call", "jump", "py" (a Python callee)
        self._at: Dict[Any, int] = {}        # frame -> offset of its last instruction

    def _point(self, frame: Any) -> None:
        n = self.points
        self.points = n + 1
        if n == self.at:
            self.where = (frame.f_code.co_name, frame.f_lineno)
            raise KeyboardInterrupt(f"injected at {frame.f_code.co_name}:{frame.f_lineno}")

    def __call__(self, frame: Any, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        if event != "call":
            return None
        if not _ours(frame.f_code.co_filename):
            return None
        back = frame.f_back
        if back is not None and self._after.get(back) == "call" and \
                frame.f_code.co_name not in _VIA_C:
            self._after[back] = "py"          # a Python callee: its entry is the check
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        self._after[frame] = ""
        self._point(frame)                    # RESUME
        return self._local

    def _local(self, frame: Any, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        if event == "opcode":
            prev = self._after.get(frame)
            if prev == "call" or prev == "jump":
                self._after[frame] = ""
                if _handler(frame.f_code, self._at.get(frame, -1)) == \
                        _handler(frame.f_code, frame.f_lasti):
                    self._point(frame)
                # else: CPython raises it at the call, whose handler this instruction lacks
                # (a ``return f()`` inside ``try``: the ``finally`` copied after the call is
                # not protected by itself): not modelled here, the point is skipped
            op = frame.f_code.co_code[frame.f_lasti]
            self._after[frame] = "call" if op in _CALLS else "jump" if op in _JUMPS else ""
            self._at[frame] = frame.f_lasti
        elif event == "return":
            self._after.pop(frame, None)
        return self._local

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` traced (the trace is removed however it ends)."""
        old = sys.gettrace()
        sys.settrace(self)
        try:
            return fn()
        finally:
            sys.settrace(old)


def inject_each(fn: Callable[[], Any], after: Callable[[Optional[BaseException], Injector],
                                                       None], limit: int = 2000) -> List[str]:
    """Run ``fn`` once per delivery point, interrupted there (``after(error, injector)``
    checks what it left, then puts things back for the next run), until a run passes every
    point uninterrupted; the points interrupted, as "function:line".  Fails past ``limit``."""
    where: List[str] = []
    for at in range(limit):
        inj = Injector(at)
        err: Optional[BaseException] = None
        try:
            inj.run(fn)
        except KeyboardInterrupt as e:
            err = e
        after(err, inj)
        if inj.where is None:
            assert err is None, f"an interrupt nobody injected: {err!r}"
            return where
        where.append(f"{inj.where[0]}:{inj.where[1]}")
    raise AssertionError(f"more than {limit} interrupt points")
