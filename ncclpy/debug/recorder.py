"""The flight recorder: a bounded ring of a communicator's last calls, dumped on a hang.

Each communicator keeps the last ``NCCLPY_TRACE_BUFFER`` calls (default
:data:`DEFAULT_BUFFER`; 0: off) in a ring.  Recording a call costs the hot path one list, one
``time.time()`` and a short walk up the stack to the user's call site (the first frame outside
ncclpy's call path); everything else -- the call's count, dtype, op, peers -- is read from the
call's immutable :class:`~ncclpy.plan.types.Plan` only when the ring is dumped.  A call's
completion is stamped when ncclpy sees its event complete (a host wait, ``is_completed()``, the
watchdog's drain every tick): the recorder never queries the GPU itself.

A dump is JSON lines (schema :data:`SCHEMA`, documented in ``docs/reference/concepts/hangs.rst``
and ``ncclpy/debug/trace_schema.json``): a header line, one line per call, oldest first, and an
``end`` line; a dump cut short (a crashed rank, a full disk) loses only its tail, which
``ncclpy trace`` reports.  Dumps go to ``NCCLPY_TRACE_DIR`` (default: ``ncclpy-trace`` in the
temporary directory) on a watchdog abort, a host wait's timeout, a checked-mode timeout,
``comm.dump_trace()``, and the signal ``NCCLPY_TRACE_SIGNAL`` (default SIGUSR1; ``off``: none).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, Optional

from ..errors import ArgumentError

__all__ = ["Recorder", "for_comm", "SCHEMA", "DEFAULT_BUFFER", "buffer_size", "trace_dir",
           "dump_all", "install_signal", "describe", "site_text", "ISSUED", "COMPLETED", "FAILED",
           "ABORTED", "dump_file_name", "trace_signal", "note_dump", "installed_signal",
           "interrupted"]

log = logging.getLogger(__name__)

SCHEMA = "ncclpy-trace/1"
DEFAULT_BUFFER = 2000
_MAX_BUFFER = 1 << 20
ISSUED, COMPLETED, FAILED, ABORTED = "issued", "completed", "failed", "aborted"
# an entry is a list: [seq, resolved call, code, lasti, t_issue, t_done, state, err, cseq];
# cseq: the call's number among the communicator's collectives (-1: send/recv)
SEQ, CALL, CODE, LASTI, T_ISSUE, T_DONE, STATE, ERR, CSEQ = range(9)
_P2P = frozenset(("send", "recv", "send_recv", "put_signal", "signal", "wait_signal"))

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: the call path: frames in these files are ncclpy's, never a user's call site
_INTERNAL = tuple(_PKG + p for p in ("comm" + os.sep, "debug" + os.sep, "_nccl" + os.sep))
_inside: Dict[str, bool] = {}
_getframe, _now = sys._getframe, time.time
_live: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_signal_lock = threading.Lock()
_signal_installed: Optional[int] = None


def buffer_size(env: Optional[Dict[str, str]] = None) -> int:
    """``NCCLPY_TRACE_BUFFER`` checked (calls kept per communicator, 0: off)."""
    raw = (os.environ if env is None else env).get("NCCLPY_TRACE_BUFFER")
    if raw is None or not raw.strip():
        return DEFAULT_BUFFER
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= _MAX_BUFFER:
        raise ArgumentError(f"NCCLPY_TRACE_BUFFER: expected a number of calls from 0 (off) to "
                            f"{_MAX_BUFFER}, got {raw!r}")
    return n


def trace_dir(env: Optional[Dict[str, str]] = None) -> str:
    """Where dumps go: ``NCCLPY_TRACE_DIR``, else ``<tmp>/ncclpy-trace``."""
    d = (os.environ if env is None else env).get("NCCLPY_TRACE_DIR", "").strip()
    return d or os.path.join(tempfile.gettempdir(), "ncclpy-trace")


def _is_inside(filename: str) -> bool:
    v = _inside.get(filename)
    if v is None:
        v = _inside[filename] = os.path.abspath(filename).startswith(_INTERNAL)
    return v


def _line(code: Any, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code``."""
    line = code.co_firstlineno
    for start, end, ln in code.co_lines():
        if start <= lasti < end:
            return ln if ln is not None else line
        if ln is not None:
            line = ln
    return line


def site_text(code: Any, lasti: int) -> Optional[str]:
    """``file:line:function`` of a recorded call site (its code and instruction offset)."""
    if code is None:
        return None
    return f"{code.co_filename}:{_line(code, lasti)}:{code.co_name}"


def describe(plan: Any, seq: int) -> Dict[str, Any]:
    """What a call was, from its Plan: checked mode's fields (coll, nccl, count, dtype, op,
    root, in_place) and its point-to-point part ``p2p`` [[send|recv, peer, count, dtype]]."""
    from .checked import fingerprint
    fp = fingerprint((plan,), seq)
    if fp["calls"]:
        d = dict(fp["calls"][0])
    else:
        d = {"seq": seq, "coll": plan.collective, "nccl": "p2p", "count": None, "dtype":
             plan.meta.get("dtype"), "op": None, "root": None,
             "in_place": bool(plan.meta.get("in_place", False))}
    d["nccl_calls"] = [c.fn for c in plan.calls]
    d["p2p"] = [e[:4] for e in fp["p2p"]]
    peer = plan.meta.get("peer")
    d["peer"] = peer if isinstance(peer, int) else None
    return d


def dump_file_name(comm: str, comm_id: str, rank: int) -> str:
    """``ncclpy-trace-<comm>-<id>-rank<r>.jsonl`` (the name made safe for a file system)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in comm)[:64] or "comm"
    return f"ncclpy-trace-{safe}-{comm_id}-rank{rank}.jsonl"


class Recorder:
    """The ring of one communicator (see the module docstring).  ``comm`` is read at dump time
    for its state (a weak reference: the recorder never keeps a communicator alive)."""

    __slots__ = ("comm_name", "comm_id", "rank", "world_size", "device", "nccl_version",
                 "capacity", "ring", "count", "colls", "nvtx", "_comm", "__weakref__")

    def __init__(self, comm: Any, capacity: int, comm_id: str = "") -> None:
        self.comm_name = comm.name
        self.comm_id = comm_id or "0"
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device = comm.device
        self.nccl_version = getattr(comm, "nccl_version", 0)
        self.capacity = int(capacity)
        self.ring: Deque[list] = deque(maxlen=self.capacity)
        self.count = 0
        self.colls = 0
        self.nvtx: Any = None             # ncclpy.debug.nvtx's ranges when NCCLPY_NVTX=1
        self._comm = weakref.ref(comm)
        _live.add(self)

    # -- the hot path ---------------------------------------------------------------------
    def open(self, r: Any, depth: int = 1) -> list:
        """Record the resolved call ``r`` (:class:`~ncclpy.comm.resolver.Resolved`) about to
        be issued; the entry its Work stamps on completion.  ``depth``: how many frames above
        this one the user's frame usually is (more are walked while still inside ncclpy)."""
        try:
            f = _getframe(depth)
        except ValueError:        # a shallower stack than usual
            f = _getframe(1)
        return self.open_at(r, f)

    def open_at(self, r: Any, f: Any, p2p: Optional[bool] = None) -> list:
        """:meth:`open` from frame ``f`` (the fast path's caller): the user's call site is
        ``f`` or the first frame above it outside ncclpy's call path; ``p2p``: whether the
        call is point-to-point (not numbered among the collectives), None: read it from
        the plan."""
        e = self.entry_at(r, f, p2p)
        ring = self.ring
        ring += (e,)              # not a call: no interrupt between it and the return (the
        return e                  # caller learns of every entry it made: tests/test_interrupts)

    def entry_at(self, r: Any, f: Any, p2p: Optional[bool] = None) -> list:
        """:meth:`open_at`'s entry, numbered, not yet in the ring: the fast path appends it
        itself (``rec.ring.append(e)``: the entry is its own before the append, so an
        interrupt after the append finds it)."""
        code = f.f_code
        while _inside.get(code.co_filename, None) is not False and _is_inside(code.co_filename):
            b = f.f_back
            if b is None:
                break
            f, code = b, b.f_code
        if p2p is None:
            p2p = r.plan.collective in _P2P
        t = _now()                # the last call: from here to the return, no interrupt (a
        if p2p:                   # number is never taken without its entry)
            k = -1
        else:
            k = self.colls
            self.colls = k + 1
        n = self.count
        self.count = n + 1
        return [n, r, code, f.f_lasti, t, None, ISSUED, None, k]   # f_lasti: O(1) (f_lineno
        # scans the code's line table)

    @staticmethod
    def fail(e: list, err: BaseException) -> None:
        """The call failed (raised before or instead of reaching NCCL, or its Work failed)."""
        if e[STATE] == ISSUED:
            e[STATE], e[ERR], e[T_DONE] = FAILED, f"{type(err).__name__}: {err}", time.time()

    @staticmethod
    def done(e: list) -> None:
        """Its completion was seen."""
        if e[STATE] == ISSUED:
            e[T_DONE], e[STATE] = time.time(), COMPLETED

    # -- the rest -------------------------------------------------------------------------
    def mark_aborted(self) -> None:
        """The communicator was aborted: what never completed never will."""
        for e in list(self.ring):
            if e[STATE] == ISSUED:
                e[STATE] = ABORTED

    def retire(self) -> None:
        """The communicator was closed cleanly: a signal no longer dumps this ring."""
        _live.discard(self)

    def last(self) -> Optional[list]:
        """The newest entry (None when nothing was recorded)."""
        try:
            return self.ring[-1]
        except IndexError:
            return None

    def entries(self) -> List[Dict[str, Any]]:
        """The ring as JSON-able dicts, oldest first."""
        out = []
        for e in list(self.ring):
            r = e[CALL]
            d = {"kind": "call"}
            d.update(describe(r.plan, e[SEQ]))
            d.update(cseq=e[CSEQ], stream=r.stream, group=bool(r.in_group or r.plan.group),
                     site=site_text(e[CODE], e[LASTI]), t_issue=e[T_ISSUE], t_done=e[T_DONE],
                     state=e[STATE], error=e[ERR])
            out.append(d)
        return out

    def header(self, reason: str) -> Dict[str, Any]:
        comm = self._comm()
        state, abort = "gone", None
        if comm is not None:
            life = getattr(comm, "_life", None)
            state = str(getattr(life, "state", "?"))
            err = getattr(life, "abort_error", None)
            abort = None if err is None else str(err)
        n = len(self.ring)
        return {"kind": "header", "schema": SCHEMA, "comm": self.comm_name,
                "comm_id": self.comm_id, "rank": self.rank, "world_size": self.world_size,
                "device": self.device, "nccl_version": self.nccl_version,
                "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                "reason": reason, "capacity": self.capacity, "recorded": self.count,
                "collectives": self.colls,
                "dropped": self.count - n, "state": state, "abort": abort}

    def dump(self, path: Optional[str] = None, reason: str = "requested") -> str:
        """Write the ring (see the module docstring) to ``path`` -- a file, or a directory
        that gets :func:`dump_file_name` -- default :func:`trace_dir`; the file written."""
        target = path or trace_dir()
        if path is None or os.path.isdir(target) or target.endswith(os.sep):
            os.makedirs(target, exist_ok=True)
            target = os.path.join(target, dump_file_name(self.comm_name, self.comm_id,
                                                         self.rank))
        lines = [self.header(reason)] + self.entries()
        lines.append({"kind": "end", "entries": len(lines) - 1})
        tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for d in lines:
                f.write(json.dumps(d, separators=(",", ":"), default=str) + "\n")
        os.replace(tmp, target)
        return target

    def try_dump(self, reason: str) -> Optional[str]:
        """:meth:`dump` to the trace directory, never raising (an error path calls it); the
        file, or None (logged) when it could not be written."""
        try:
            p = self.dump(None, reason)
        except Exception as e:  # noqa: BLE001 - a dump must never hide the error it explains
            log.warning("flight recorder of %r rank %d: could not write its dump: %s",
                        self.comm_name, self.rank, e)
            return None
        log.warning("flight recorder of %r rank %d: %s; dump written to %s", self.comm_name,
                    self.rank, reason, p)
        return p


def note_dump(err: BaseException, path: Optional[str]) -> None:
    """Append "flight-recorder dump: <path>" to ``err``'s message (when a dump was written)."""
    if path and err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\nflight-recorder dump: {path}",) + err.args[1:]


def interrupted(e: list, err: BaseException) -> None:
    """Entry ``e``'s call was interrupted (``err``) when NCCL may or may not have had it: its
    Work keeps the buffers until the GPU passes its event and stamps the entry then; the
    entry says so, so that a dump never claims the call surely ran."""
    if e[STATE] == ISSUED and e[ERR] is None:
        e[ERR] = (f"{type(err).__name__} during the call: it may not have reached NCCL; its "
                  f"Work kept the buffers until the GPU passed it")


def for_comm(comm: Any, comm_id: str, capacity: int, nvtx: Any) -> Optional[Recorder]:
    """The recorder of a new communicator (None when the ring and NVTX are both off);
    installs the dump signal.  ``capacity``: :func:`buffer_size`; ``nvtx``: the NVTX ranges
    (:func:`ncclpy.debug.nvtx.ranges`) or None; both read before NCCL made the communicator."""
    if not capacity and nvtx is None:
        return None
    rec = Recorder(comm, capacity, comm_id)
    rec.nvtx = nvtx
    try:
        install_signal()
    except ArgumentError as e:      # checked before the communicator was made: never here
        log.warning("%s", e)
    return rec


def dump_all(reason: str, path: Optional[str] = None) -> List[str]:
    """Dump every live recorder of this process; the files written."""
    out = []
    for r in list(_live):
        p = r.try_dump(reason) if path is None else r.dump(path, reason)
        if p:
            out.append(p)
    return out


def trace_signal(env: Optional[Dict[str, str]] = None) -> Optional[int]:
    raw = (os.environ if env is None else env).get("NCCLPY_TRACE_SIGNAL", "USR1").strip()
    if raw.lower() in ("", "0", "off", "none", "no"):
        return None
    name = raw.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    sig = getattr(signal, name, None)
    if sig is None and raw.isdigit():
        sig = int(raw)
    if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ArgumentError(f"NCCLPY_TRACE_SIGNAL: expected a signal name such as USR1 or USR2 "
                            f"(or off), got {raw!r}")
    return int(sig)


def _on_signal(signum: int, frame: Any) -> None:
    dump_all(f"signal {signal.Signals(signum).name}")


def installed_signal() -> int:
    """The signal that dumps this process's recorders (0: none installed)."""
    return _signal_installed or 0


def install_signal(env: Optional[Dict[str, str]] = None) -> Optional[int]:
    """Make ``NCCLPY_TRACE_SIGNAL`` dump every recorder (once per process, from the main
    thread only, and never over a handler the program installed); the signal, or None."""
    global _signal_installed
    sig = trace_signal(env)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return None
    with _signal_lock:
        if _signal_installed == sig:
            return sig
        try:
            cur = signal.getsignal(sig)
            if cur not in (signal.SIG_DFL, None) and cur is not _on_signal:
                log.info("flight recorder: signal %d already has a handler; not dumping on it",
                         sig)
                return None
            signal.signal(sig, _on_signal)
        except (ValueError, OSError) as e:   # not the main interpreter, an odd platform
            log.info("flight recorder: could not handle signal %d: %s", sig, e)
            return None
        _signal_installed = sig
    return sig
