"""``ncclpy check --backend nccl``: what NCCL's debug log says about ncclpy's communicator, for
the exact reference (:mod:`ncclpy.check.exact`).

The pins (:class:`ncclpy.order.pins.Pins`: NCCL_ALGO, NCCL_PROTO, NCCL_MIN/MAX_NCHANNELS) say
the algorithm, protocol and channel count; NCCL's log says what they cannot: the version, each
channel's ring and tree, rank 0's tuning table (the thread counts and thresholds that decide
how many channels a call of a given size uses), a tuner plugin, and, per call, the algorithm,
protocol and channel range NCCL chose (:mod:`ncclpy.order.logs` parses them).

* :func:`log_env`: the ranks run with ``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS=INIT,GRAPH,
  TUNING,ENV`` and ``NCCL_DEBUG_FILE=<dir>/nccl.%h.%p.log`` (as ``ncclpy order --observe``'s
  jobs do, :func:`ncclpy.order.observe.job_env`); a value the user set is kept (and said).
* :func:`read_init`: after ``ncclpy.init`` every rank reads every rank's file and picks the
  block of ncclpy's communicator by its pointer (NCCL's ``comm %p`` of the "Init START" line,
  init.cc:1574 at v2.28.9-1): torch's communicators log to the same files.
* :class:`CallTail`: rank 0 reads the lines its file gained during one ncclpy call: NCCL prints
  the call's ``Bytes -> Algo`` line (enqueue.cc:741, rank 0 only) while it enqueues it, into a
  line-buffered file (debug.cc:261 ``setlinebuf``), so it is there when the call returns.

Whatever is missing makes the cases that need it keep the rank-order reference, with the
reason "missing log lines: ..." (never a guess).
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..order.logs import CallLine, CommLog, LogError, merge_rings, merge_trees, parse_log
from ..order.topology import Tree

__all__ = ["LOG_VARS", "log_env", "log_path", "InitLog", "read_init", "CallTail", "call_problem",
           "comm_block", "call_rows", "after_init"]

#: what the check sets for NCCL's log (NCCL_DEBUG_FILE is added with the run's directory)
LOG_VARS: Tuple[Tuple[str, str], ...] = (("NCCL_DEBUG", "INFO"),
                                         ("NCCL_DEBUG_SUBSYS", "INIT,GRAPH,TUNING,ENV"))
_START = re.compile(r"NCCL INFO .*\bcomm (0x[0-9a-fA-F]+) rank \d+ nranks \d+ .*- Init START")
_HEADER = "x:0:0 [0] NCCL INFO comm 0x0 rank 0 nRanks 1 nNodes 1\n"


def log_env(env: Mapping[str, str], directory: str) -> Tuple[Dict[str, str], List[str]]:
    """(variables to set, 'K=V' kept from ``env``) for NCCL's debug log in ``directory``."""
    out: Dict[str, str] = {}
    kept: List[str] = []
    for k, v in LOG_VARS + (("NCCL_DEBUG_FILE", os.path.join(directory, "nccl.%h.%p.log")),):
        if k in env:
            kept.append(f"{k}={env[k]}")
        else:
            out[k] = v
    return out, kept


def log_path(pattern: str, pid: int) -> Optional[str]:
    """This process's file for NCCL_DEBUG_FILE ``pattern`` (debug.cc:225-250: ``%p`` the pid,
    ``%h`` the host name, ``%%`` a percent sign), or None when there is none."""
    text = pattern.replace("%%", "\0").replace("%p", str(pid)).replace("%h", "*")
    found = sorted(glob.glob(text.replace("\0", "%")))
    return found[-1] if found else None


def comm_block(text: str, handle: int) -> Optional[CommLog]:
    """The block of the communicator at address ``handle`` in one rank's log (None: not
    there).  Blocks are cut at each "Init START" line (:func:`ncclpy.order.logs.parse_log`),
    whose ``comm %p`` names the communicator."""
    blocks = parse_log(text)
    starts = [int(m.group(1), 16) for m in (_START.search(ln) for ln in text.splitlines()) if m]
    if len(starts) != len(blocks) or handle not in starts:
        return None
    return blocks[len(starts) - 1 - starts[::-1].index(handle)]


@dataclass
class InitLog:
    """What NCCL logged at ncclpy's communicator's init, for the model; ``problem`` says what
    is missing ('' when nothing)."""

    problem: str = ""
    version: Optional[int] = None
    channels: Optional[int] = None
    rings: Tuple[Tuple[int, ...], ...] = ()
    trees: Tuple[Tree, ...] = ()
    max_threads: Dict[Tuple[str, str], int] = field(default_factory=dict)
    thresholds: Dict[Tuple[str, str], int] = field(default_factory=dict)
    tuner: str = ""
    tree_problem: str = ""

    def describe(self) -> str:
        """One line: version, channels and rings as NCCL logged them."""
        if self.problem:
            return self.problem
        from ..order.versions import format_version
        rings = "; ".join(" ".join(str(r) for r in ring) for ring in self.rings)
        return (f"NCCL {format_version(self.version or 0)} logged {self.channels} channel"
                f"{'s' if self.channels != 1 else ''}, rings {rings}")


def read_init(files: Sequence[Tuple[Optional[str], int]]) -> InitLog:
    """The init facts of ncclpy's communicator from every rank's ``(log file, comm handle)``
    (rank order); ``problem`` "missing log lines: ..." where a file or line is missing."""
    logs: List[CommLog] = []
    for r, (path, handle) in enumerate(files):
        if not path or not os.path.exists(path):
            return InitLog(f"missing log lines: no NCCL debug file of rank {r}"
                           + (f" ({path})" if path else ""))
        with open(path, errors="replace") as f:
            block = comm_block(f.read(), handle)
        if block is None or block.rank != r:
            return InitLog(f"missing log lines: no 'Init START' block of ncclpy's communicator "
                           f"(comm {handle:#x}) in rank {r}'s log {path}")
        logs.append(block)
    b0 = logs[0]
    if b0.version is None or b0.channels is None:
        return InitLog("missing log lines: the version banner or 'coll channels' of rank 0")
    try:
        rings = merge_rings(logs, b0.channels)
    except LogError as e:
        return InitLog(f"missing log lines: {e}")
    out = InitLog("", b0.version, b0.channels, rings, (), dict(b0.max_threads),
                  dict(b0.thresholds), b0.tuner)
    try:
        out.trees = merge_trees(logs, b0.channels)
    except LogError as e:
        out.tree_problem = f"missing log lines: {e}"
    return out


class CallTail:
    """Rank 0's log file, read from where the last read stopped: :meth:`skip` before an ncclpy
    call, :meth:`calls` after it (the call lines NCCL printed meanwhile)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self.offset = 0

    def _read(self) -> str:
        if not self.path:
            return ""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        end = data.rfind(b"\n") + 1             # whole lines only
        self.offset += end
        return data[:end].decode(errors="replace")

    def skip(self) -> None:
        """Forget what the file holds so far (torch's lines, earlier calls)."""
        self._read()

    def calls(self) -> List[CallLine]:
        """The call lines written since the last read."""
        text = self._read()
        if "Bytes -> " not in text:
            return []
        return parse_log(_HEADER + text)[0].calls


def call_problem(lines: Sequence[Sequence[object]], expect: Sequence[object]) -> str:
    """Why rank 0's logged call lines do not confirm the predicted call (''): ``lines`` are
    ``[func, nbytes, algo, proto, channel_lo, channel_hi, symmetric, kernel]``, ``expect``
    ``[func, nbytes, algo, proto, channel_lo, channel_hi]``."""
    func, nbytes = expect[0], expect[1]
    mine = [ln for ln in lines if ln[0] == func and ln[1] == nbytes]
    if not mine:
        return (f"missing log lines: rank 0 logged no '{func}: {nbytes} Bytes -> Algo' line "
                f"for this call (NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS including TUNING)")
    if len(mine) > 1:
        return f"rank 0 logged {len(mine)} '{func}: {nbytes} Bytes' lines for one call"
    ln = mine[0]
    if ln[6]:
        return f"NCCL ran a symmetric kernel ({ln[7]}), whose order the model does not cover"
    got = (ln[2], ln[3], ln[4], ln[5])
    want = tuple(expect[2:6])
    if got != want:
        return (f"NCCL logged {got[0]}/{got[1]} on channels {got[2]}..{got[3]}, the model "
                f"computes {want[0]}/{want[1]} on channels {want[2]}..{want[3]}")
    return ""


def call_rows(calls: Sequence[CallLine]) -> List[List[object]]:
    """Call lines as the JSON-friendly rows :func:`call_problem` reads."""
    return [[c.func, c.nbytes, c.algo, c.proto, c.channel_lo, c.channel_hi, c.symmetric,
             c.kernel] for c in calls]


def after_init(ctx: Dict[str, Any]) -> None:
    """Every rank, once ncclpy's communicator is up on every rank: read its init lines from
    every rank's log (``ctx["nccl_init"]``, an :class:`InitLog`); rank 0 also starts reading
    its own file for the call lines (``ctx["nccl_tail"]``).  Collective over the control
    group: every rank calls it."""
    pattern = os.environ.get("NCCL_DEBUG_FILE", "")
    path = log_path(pattern, os.getpid()) if pattern else None
    handle = int(getattr(ctx["comm"], "handle", 0) or 0)
    rows: List[Any] = [None] * int(ctx["n"])
    ctx["dist"].all_gather_object(rows, (path, handle), group=ctx["ctrl"])
    ctx["nccl_init"] = read_init(rows)
    if ctx["rank"] == 0:
        tail = CallTail(path)
        tail.skip()
        ctx["nccl_tail"] = tail
