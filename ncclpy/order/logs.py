"""What NCCL did, from its debug logs: the version, the channels, every channel's ring and
tree, the tuning tables, buffer-size overrides, and for each call the algorithm, protocol and
channel range NCCL chose.

Run NCCL with ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,ENV`` and one
``NCCL_DEBUG_FILE`` per rank (``nccl.%h.%p.log``).  The lines read (format strings at
v2.28.9-1; the same at v2.30.7-1 unless said):

* ``NCCL version 2.28.9+cuda13.0`` (init.cc:603-608);
* ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d`` (init.cc:1170);
* ``%d coll channels, ...`` (init.cc:1358): comm->nChannels;
* ``Ring %02d : %d -> %d -> %d`` (init.cc:1223): each rank's prev and next on each channel;
* ``Trees [%d] %d/%d/%d->%d->%d ...`` (init.cc:1221-1226): each rank's down[0..2] and up;
* ``threadThresholds %ld/%ld/%ld | %ld/%ld/%ld | %ld | %ld`` (graph/tuning.cc:564);
* the tuning table's ``Algorithm`` and ``Max NThreads`` rows (tuning.cc:504-523, rank 0);
* ``NCCL_BUFFSIZE set by environment to %lld.`` and the like (misc/param.cc:89);
* ``TUNER/Plugin: Using %s`` (plugin/tuner/tuner_v*.cc): a tuner plugin is loaded;
* per call, rank 0 only: ``%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}``
  (enqueue.cc:741, NCCL >= 2.24.3), and ``%s [Symmetric]: %ld Bytes -> Kernel %s ...``
  (scheduler/symmetric_sched.cc:229) for a symmetric kernel.

A file holds one block per communicator, cut at each ``- Init START`` line (init.cc:1574).
The INFO format is not a stable interface (NVIDIA/nccl#1644): a line the parser does not find
makes the verdict CANNOT_PREDICT ("missing log lines"), never a guess.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .topology import Tree

__all__ = ["CallLine", "CommLog", "parse_log", "merge_rings", "merge_trees", "LogError",
           "ALGO_NAMES", "PROTO_NAMES", "FUNC_NAMES"]

#: ncclAlgoToString / ncclProtoToString / ncclFuncToString (src/collectives.cc:13-80)
ALGO_NAMES = {"RING": "ring", "TREE": "tree", "NVLS": "nvls", "NVLS_TREE": "nvls_tree",
              "COLLNET_DIRECT": "collnet_direct", "COLLNET_CHAIN": "collnet_chain",
              "PAT": "pat"}
PROTO_NAMES = {"LL": "ll", "LL128": "ll128", "SIMPLE": "simple"}
FUNC_NAMES = {"AllReduce": "all_reduce", "ReduceScatter": "reduce_scatter", "Reduce": "reduce",
              "AllGather": "all_gather", "Broadcast": "broadcast"}
#: ncclAlgoStr / ncclProtoStr (src/init.cc:50-51): the tuning table's names
_TABLE_ALGOS = {"Tree": "tree", "Ring": "ring"}
_TABLE_PROTOS = ("ll", "ll128", "simple")

_INFO = re.compile(r"NCCL INFO (.*)$")
_VERSION = re.compile(r"^NCCL version (\d+)\.(\d+)\.(\d+)")
_COMM = re.compile(r"^comm 0x[0-9a-f]+ rank (\d+) nRanks (\d+) nNodes (\d+)")
_CHANNELS = re.compile(r"^(\d+) coll channels,")
_RING = re.compile(r"^Ring (\d+) : (-?\d+) -> (\d+) -> (-?\d+)")
_TREES = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(\d+)->(-?\d+)")
_THRESH = re.compile(r"^threadThresholds (\d+)/(\d+)/(\d+) \| (\d+)/(\d+)/(\d+)")
_ENV = re.compile(r"^(NCCL_[A-Z0-9_]+) set by environment to (\S+?)\.?$")
_CALL = re.compile(r"^(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+) "
                   r"channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}")
_SYM = re.compile(r"^(\w+) \[Symmetric\]: (\d+) Bytes -> Kernel (\S+)")
_START = re.compile(r"- Init START")


class LogError(Exception):
    """A log lacks what a verdict needs; ``str(e)`` names the missing line."""


@dataclass(frozen=True)
class CallLine:
    """Rank 0's line for one collective: what NCCL chose."""

    func: str
    nbytes: int
    algo: str
    proto: str
    channel_lo: int
    channel_hi: int
    symmetric: bool = False
    kernel: str = ""


@dataclass
class CommLog:
    """One communicator as one rank's log shows it."""

    version: Optional[int] = None
    rank: Optional[int] = None
    nranks: Optional[int] = None
    nnodes: Optional[int] = None
    channels: Optional[int] = None
    ring: Dict[int, Tuple[int, int]] = field(default_factory=dict)     # ch -> (prev, next)
    tree: Dict[int, Tuple[int, Tuple[int, ...]]] = field(default_factory=dict)  # ch -> up,downs
    thresholds: Dict[Tuple[str, str], int] = field(default_factory=dict)
    max_threads: Dict[Tuple[str, str], int] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    tuner: str = ""
    calls: List[CallLine] = field(default_factory=list)


def parse_log(text: str) -> List[CommLog]:
    """Every communicator block of one rank's NCCL debug file, in order.  The version banner
    and environment lines, printed once per process, apply to every block after them."""
    comms: List[CommLog] = []
    version: Optional[int] = None
    env: Dict[str, str] = {}
    tuner = ""
    table_algos: List[str] = []
    cur: Optional[CommLog] = None
    for raw in text.splitlines():
        m = _INFO.search(raw)
        if not m:
            continue
        msg = m.group(1).strip()
        v = _VERSION.match(msg)
        if v:
            version = int(v.group(1)) * 10000 + int(v.group(2)) * 100 + int(v.group(3))
            continue
        e = _ENV.match(msg)
        if e:
            env[e.group(1)] = e.group(2)
        if msg.startswith("TUNER/Plugin: Using"):
            tuner = msg
        starts = bool(_START.search(msg))
        if starts or (cur is None and _COMM.match(msg)):
            cur = CommLog(version=version, env=dict(env), tuner=tuner)
            comms.append(cur)
            if starts:
                continue
        if cur is None:            # before the first communicator: only the globals above
            continue
        cur.version, cur.tuner = version, tuner or cur.tuner
        cur.env.update(env)
        _parse_line(cur, msg, table_algos)
    return comms


def _parse_line(cur: CommLog, msg: str, table_algos: List[str]) -> None:
    c = _COMM.match(msg)
    if c:
        cur.rank, cur.nranks, cur.nnodes = int(c.group(1)), int(c.group(2)), int(c.group(3))
        return
    c = _CHANNELS.match(msg)
    if c:
        cur.channels = int(c.group(1))
        return
    r = _RING.match(msg)
    if r:
        cur.ring[int(r.group(1))] = (int(r.group(2)), int(r.group(4)))
        return
    if msg.startswith("Trees"):
        for t in _TREES.finditer(msg):
            downs = tuple(int(t.group(i)) for i in (2, 3, 4))
            kept = []
            for d in downs:              # NCCL's prims stop at the first -1 (prims_simple.h:602)
                if d < 0:
                    break
                kept.append(d)
            cur.tree[int(t.group(1))] = (int(t.group(6)), tuple(kept))
        return
    t = _THRESH.match(msg)
    if t:
        vals = [int(x) for x in t.groups()]
        for i, p in enumerate(_TABLE_PROTOS):
            cur.thresholds[("tree", p)] = vals[i]
            cur.thresholds[("ring", p)] = vals[3 + i]
        return
    if msg.startswith("Algorithm") or msg.lstrip().startswith("Algorithm   |"):
        table_algos[:] = [x.strip() for x in msg.split("|")[1:] if x.strip()]
        return
    if msg.lstrip().startswith("Max NThreads"):
        vals = [x.strip() for x in msg.split("|")[1:] if x.strip()]
        for i, name in enumerate(table_algos):
            algo = _TABLE_ALGOS.get(name)
            if algo is None:
                continue
            for j, p in enumerate(_TABLE_PROTOS):
                k = 3 * i + j
                if k < len(vals) and vals[k].isdigit():
                    cur.max_threads[(algo, p)] = int(vals[k])
        return
    s = _SYM.match(msg)
    if s:
        cur.calls.append(CallLine(FUNC_NAMES.get(s.group(1), s.group(1)), int(s.group(2)),
                                  "symmetric", "", -1, -1, True, s.group(3)))
        return
    k = _CALL.match(msg)
    if k:
        cur.calls.append(CallLine(FUNC_NAMES.get(k.group(1), k.group(1)), int(k.group(2)),
                                  ALGO_NAMES.get(k.group(3), k.group(3).lower()),
                                  PROTO_NAMES.get(k.group(4), k.group(4).lower()),
                                  int(k.group(5)), int(k.group(6))))


def merge_rings(logs: Sequence[CommLog], channels: int) -> Tuple[Tuple[int, ...], ...]:
    """Each channel's ring (ranks in ring order from rank 0) from every rank's ``Ring`` lines;
    LogError when a rank's line is missing or the next pointers do not make one ring."""
    n = len(logs)
    out = []
    for ch in range(channels):
        nxt: Dict[int, int] = {}
        for lg in logs:
            if lg.rank is None or ch not in lg.ring:
                raise LogError(f"no 'Ring {ch:02d}' line in rank {lg.rank}'s log")
            nxt[lg.rank] = lg.ring[ch][1]
        ring, cur = [], 0
        for _ in range(n):
            ring.append(cur)
            cur = nxt.get(cur, -1)
        if cur != 0 or sorted(ring) != list(range(n)):
            raise LogError(f"channel {ch}: the 'Ring' lines do not make one ring of {n} ranks")
        out.append(tuple(ring))
    return tuple(out)


def merge_trees(logs: Sequence[CommLog], channels: int) -> Tuple[Tree, ...]:
    """Each channel's tree from every rank's ``Trees`` line."""
    by_rank = {lg.rank: lg for lg in logs}
    out = []
    for ch in range(channels):
        tree = []
        for r in range(len(logs)):
            lg = by_rank.get(r)
            if lg is None or ch not in lg.tree:
                raise LogError(f"no '[{ch}]' entry in rank {r}'s 'Trees' line")
            tree.append(lg.tree[ch])
        out.append(tuple(tree))
    return tuple(out)
