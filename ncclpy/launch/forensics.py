"""What ``ncclpy run`` does for a hung or failed job: the status table and every rank's dump.

* Every rank gets ``NCCLPY_TRACE_DIR`` (unless set): ``<tmp>/ncclpy-trace/job-<time>-<pid>``,
  so all of a job's flight-recorder dumps land in one directory.
* On SIGUSR1 the launcher prints the status table (:mod:`ncclpy.debug.status`) to stderr and
  asks each rank for its dump; when ``--timeout`` fires or a rank fails, it does the same before
  stopping the others (the table only when a communicator registered one: a job that failed
  before making one gets no table), waits up to :data:`DUMP_WAIT` seconds for the dumps, and
  names the directory (``ncclpy trace DIR``).
* A rank is sent the dump signal only when its heartbeat says it handles it (a process
  without the handler would be killed by it): the signal is ``NCCLPY_TRACE_SIGNAL``'s.
"""
from __future__ import annotations

import glob
import logging
import os
import signal
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Sequence

__all__ = ["Forensics", "DUMP_WAIT", "job_trace_dir"]

log = logging.getLogger(__name__)

#: seconds the launcher waits for the dumps it asked for before it stops the ranks
DUMP_WAIT = 3.0


def job_trace_dir() -> str:
    """A fresh directory name for one job's dumps."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(tempfile.gettempdir(), "ncclpy-trace", f"job-{stamp}-{os.getpid()}")


class Forensics:
    """The launcher's view of its job's store and dumps.  ``base``: the ranks' environment
    (gets ``NCCLPY_TRACE_DIR``); ``line``: writes one line to the launcher's stderr."""

    def __init__(self, addr: str, port: int, token: str, base: MutableMapping[str, str],
                 line: Callable[[str], None]) -> None:
        self.addr, self.port, self.token, self.line = addr, port, token, line
        if not base.get("NCCLPY_TRACE_DIR", "").strip():
            base["NCCLPY_TRACE_DIR"] = job_trace_dir()
        self.trace_dir = base["NCCLPY_TRACE_DIR"]
        from ..debug.recorder import trace_signal
        try:
            self.signal = trace_signal(base)
        except Exception:  # noqa: BLE001 - each rank reports its own bad setting
            self.signal = None
        self.asked_at: Optional[float] = None
        self.started = time.time()      # dumps older than the job are not its own

    def snapshot(self) -> Optional[List[Dict[str, Any]]]:
        """Every communicator's table, or None (said in one line) when the store is gone."""
        from ..debug.status import snapshot
        from ..store import TCPStore
        try:
            with TCPStore(self.addr, self.port, token=self.token or None, timeout=2.0,
                          connect_timeout=1.0) as store:
                return snapshot(store, timeout=2.0)
        except Exception as e:  # noqa: BLE001 - a view: never fatal to the launcher
            self.line(f"ncclpy run: could not read the ranks' progress from the store at "
                      f"{self.addr}:{self.port}: {type(e).__name__}: {e}")
            return None

    def show(self, why: str, only_registered: bool = False) -> Optional[List[Dict[str, Any]]]:
        """Print the status table (``why`` in its first line); the snapshot.
        ``only_registered``: print nothing when no communicator registered its table (a job that
        failed before making one: the table would only say there is none)."""
        from ..debug.status import format_snapshot
        snap = self.snapshot()
        if snap is not None and not snap and only_registered:
            log.debug("ncclpy run: %s; no communicator registered its progress: no table", why)
        elif snap is not None:
            self.line(f"ncclpy run: {why}; where every rank is (ncclpy status):")
            for ln in format_snapshot(snap).splitlines():
                self.line("  " + ln)
        return snap

    def request_dumps(self, snap: Optional[Sequence[Dict[str, Any]]],
                      pids: Mapping[int, int]) -> List[int]:
        """Send the dump signal to the ranks (rank -> pid, those still running here) whose
        heartbeat says they handle it; the ranks asked."""
        if self.signal is None or not snap:
            return []
        handles = {row.rank for c in snap for row in c.get("rows", ())
                   if row.progress.signal == self.signal and not row.closed}
        asked = []
        for rank, pid in sorted(pids.items()):
            if rank in handles:
                try:
                    os.kill(pid, self.signal)
                    asked.append(rank)
                except OSError:
                    pass
        if asked:
            self.asked_at = time.time()
        return asked

    def wait_dumps(self, ranks: Sequence[int], wait: float = DUMP_WAIT) -> None:
        """Wait (at most ``wait`` s) until each of ``ranks`` wrote a dump since it was asked."""
        if not ranks or self.asked_at is None:
            return
        since, end = self.asked_at - 1.0, time.monotonic() + wait
        left = set(ranks)
        while left and time.monotonic() < end:
            for r in list(left):
                for f in glob.glob(os.path.join(self.trace_dir, f"*-rank{r}.jsonl")):
                    try:
                        if os.path.getmtime(f) >= since:
                            left.discard(r)
                    except OSError:
                        pass
            time.sleep(0.05)

    def collect(self, why: str, pids: Mapping[int, int]) -> None:
        """The job hangs or failed: the table (when a communicator registered one), then every
        rank's dump (bounded)."""
        snap = self.show(why, only_registered=True)
        self.wait_dumps(self.request_dumps(snap, pids))

    def on_signal(self, pids: Mapping[int, int]) -> None:
        """SIGUSR1 to the launcher: the table and fresh dumps; the job goes on."""
        snap = self.show(f"received {signal.Signals(signal.SIGUSR1).name}")
        asked = self.request_dumps(snap, pids)
        if asked:
            self.line(f"ncclpy run: asked rank(s) {', '.join(map(str, asked))} for their "
                      f"flight-recorder dumps, in {self.trace_dir}")

    def summary(self) -> Optional[str]:
        """The closing line naming the dumps, or None when there are none."""
        files = []
        for f in glob.glob(os.path.join(self.trace_dir, "ncclpy-trace-*.jsonl")):
            try:
                if os.path.getmtime(f) >= self.started - 1.0:
                    files.append(f)
            except OSError:
                pass
        if not files:
            return None
        return (f"ncclpy run: {len(files)} flight-recorder dump(s) in {self.trace_dir}; "
                f"see what went wrong: ncclpy trace {self.trace_dir}")
