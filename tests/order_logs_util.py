"""NCCL debug-log lines written with NCCL's own format strings (v2.28.9-1, file:line beside each),
for the log parser's and the observe path's CPU tests."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

_ALGO_STR = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")


def info(msg: str, pid: int = 4242, dev: int = 0) -> str:
    """debug.cc:364-378: "<host>:<pid>:<tid> [<dev>] NCCL INFO <msg>"."""
    return f"gpu-host:{pid}:{pid + 7} [{dev}] NCCL INFO {msg}"


def tuning_table(max_threads: Dict[Tuple[str, str], int]) -> List[str]:
    """graph/tuning.cc:499-533 (rank 0): three algorithms per block, three protocols each."""
    lines = []
    for block in range(3):
        algos = _ALGO_STR[block * 3:block * 3 + 3]
        line = "  Algorithm   |"
        for a in algos:
            line += " %14s   %14s   %14s |" % ("", a, "")
        lines.append(line)
        line = "  Protocol    |"
        for _ in algos:
            for p in ("LL", "LL128", "Simple"):
                line += " %14s |" % p
        lines.append(line)
        line = " Max NThreads |"
        for a in algos:
            for p in ("ll", "ll128", "simple"):
                key = {"Tree": "tree", "Ring": "ring"}.get(a)
                line += " %14d |" % max_threads.get((key, p), 640)
        lines.append(line)
    return lines


def comm_block(rank: int, nranks: int, channels: int, rings: Sequence[Sequence[int]],
               trees: Sequence[Sequence[Tuple[int, Tuple[int, ...]]]],
               max_threads: Optional[Dict[Tuple[str, str], int]] = None,
               thresholds: Tuple[int, ...] = (8, 8, 64, 24, 8, 64)) -> List[str]:
    """One communicator's init lines as rank ``rank`` prints them."""
    out = [f"ncclCommInitRankConfig comm 0x55d0c0de{rank:04x} rank {rank} nranks {nranks} "
           f"cudaDev 0 nvmlDev 0 busId 1b000 commId 0xfeed - Init START",       # init.cc:1574
           f"comm 0x55d0c0de{rank:04x} rank {rank} nRanks {nranks} nNodes {nranks} "
           f"localRanks 1 localRank 0 MNNVL 0"]                                  # init.cc:1170
    for c in range(channels):
        ring = list(rings[c])
        i = ring.index(rank)
        if rank == 0:                                                            # rings.cc:47
            r0 = ring[i:] + ring[:i]
            out.append(f"Channel {c:02d}/{channels:02d} :" + "".join(f" {x}" for x in r0))
    trees_line = "Trees"
    for c in range(channels):
        up, downs = trees[c][rank]
        d = list(downs) + [-1] * (3 - len(downs))
        trees_line += f" [{c}] {d[0]}/{d[1]}/{d[2]}->{rank}->{up}"            # init.cc:1221
    for c in range(channels):
        ring = list(rings[c])
        i = ring.index(rank)
        prev, nxt = ring[(i - 1) % nranks], ring[(i + 1) % nranks]
        out.append(f"Ring {c:02d} : {prev} -> {rank} -> {nxt}")                   # init.cc:1223
    out.append(trees_line)                                                       # init.cc:1226
    t = thresholds
    out.append(f"threadThresholds {t[0]}/{t[1]}/{t[2]} | {t[3]}/{t[4]}/{t[5]} | 512 | 512")
    if rank == 0:
        out += tuning_table(max_threads or {})
    out.append(f"{channels} coll channels, {channels} collnet channels, 0 nvls channels, "
               f"{channels} p2p channels, {channels} p2p channels per peer")    # init.cc:1358
    out.append(f"ncclCommInitRankConfig comm 0x55d0c0de{rank:04x} rank {rank} nranks "
               f"{nranks} cudaDev 0 nvmlDev 0 busId 1b000 commId 0xfeed - Init COMPLETE")
    return out


def call_line(func: str, nbytes: int, algo: str, proto: str, lo: int, hi: int) -> str:
    """enqueue.cc:741 (rank 0)."""
    return f"{func}: {nbytes} Bytes -> Algo {algo} proto {proto} channel{{Lo..Hi}}={{{lo}..{hi}}}"


def write_logs(job_dir: str, per_rank: Sequence[Sequence[str]],
               head: Sequence[str] = ("NCCL version 2.28.9+cuda13.0",)) -> List[str]:
    """One file per rank, as NCCL_DEBUG_FILE=nccl.%h.%p.log names them."""
    paths = []
    for r, msgs in enumerate(per_rank):
        path = os.path.join(job_dir, f"nccl.gpu-host.{5000 + r}.log")
        with open(path, "w") as f:
            for m in list(head) + list(msgs):
                f.write(info(m, pid=5000 + r) + "\n")
        paths.append(path)
    return paths
