"""Which NCCL versions the reduction-order model covers, and what differs between them.

The model is a port of NCCL's own code (:mod:`ncclpy.order.split`, :mod:`ncclpy.order.model`).
A port covers a range of release tags whose code was read and found to compute the same thing;
each :class:`Port` names the tags checked and the source lines that differ between ports.  A
version that no port lists is refused with the reason (:class:`CannotPredict`), never guessed:
NCCL moves this code between releases (the continuous-byte split arrived in 2.22, and 2.29
changed its constants).

Line numbers below are at the tag named (``v2.28.9-1``, ``v2.30.7-1``); each module that ports a
rule cites the lines it ports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from ..errors import CannotPredict

__all__ = ["Port", "PORTS", "CannotPredict", "port_for", "checked_versions", "format_version",
           "parse_version"]


@dataclass(frozen=True)
class Port:
    """One range of NCCL versions with identical reduction-order code.

    ``tags``: the release tags (version codes, 22809 = 2.28.9) whose source was compared.  The
    other fields are the lines of ``scheduleCollTasksToPlan`` (src/enqueue.cc) that differ
    between ports, for a lone Ring/Tree task:

    * ``min_traffic``: ``MinTrafficPerChannel`` (bytes);
    * ``traffic_floor``: the plan's traffic adds ``max(MinTrafficPerChannel, task traffic)``
      (else the task's traffic alone);
    * ``traffic_rule``: ``"max"`` = ``trafficPerChannel = max(MinTrafficPerChannel,
      traffic/nChannels)``, ``"div16"`` = ``divUp(traffic/nChannels, 16)*16``;
    * ``cell_rule``: ``"fixed16"`` = cells of 16 bytes, ``"traffic"`` = ``divUp(divUp(
      MinTrafficPerChannel, trafficPerByte), 16)*16``;
    * ``lo_divup``: the first channel's cells are ``divUp`` (else a floor) of its traffic;
    * ``ll_x4``: LL counts 4 bytes of traffic per byte (its lines are half flags, half sent
      twice): task traffic times 4 (ncclPrepareTasks) and trafficPerByte times 4.
    """

    name: str
    tags: Tuple[int, ...]
    min_traffic: int
    traffic_floor: bool
    traffic_rule: str
    cell_rule: str
    lo_divup: bool
    ll_x4: bool
    source: str


#: The checked ports (every release tag from 2.22.3 to 2.30.7 was compared, token by token, for
#: every piece the model uses; docs/reference/concepts/reduction-order.rst lists them).  Only
#: the split differs: the device loops, operand order, ncclCollCbdPart, grain sizes, buffer
#: defaults, calcCollChunking for Ring/Tree, the Ring/Tree channel tuning, the thresholds and
#: the AVG pre-multiplier are the same in all of them.  2.21.5 and older split on the host in
#: another way (no ncclCollCbdPart, a host-computed last chunk): not ported.
PORTS: Tuple[Port, ...] = (
    Port("2.22", (22203,), 512, False, "max", "fixed16", False, False,
         "v2.22.3-1 src/enqueue.cc scheduleCollTasksToPlan: MinTrafficPerChannel = 512, "
         "trafficBytes += task->trafficBytes, cellSize = 16, cellsLo = min(cells, "
         "(trafficPerChannel-currentTraffic)/trafficPerCell)"),
    Port("2.23-2.25", (22304, 22403, 22501), 16 << 10, True, "max", "traffic", True, False,
         "v2.23.4-1 src/enqueue.cc: MinTrafficPerChannel = 16K before the first pass, "
         "trafficBytes += max(MinTrafficPerChannel, task->trafficBytes), cellSize = "
         "divUp(divUp(MinTrafficPerChannel, trafficPerByte), 16)*16, cellsLo with divUp"),
    Port("2.26-2.28", (22602, 22603, 22605, 22606, 22703, 22705, 22706, 22707, 22803, 22807,
                       22809), 16 << 10, True, "max", "traffic", True, True,
         "v2.28.9-1 src/enqueue.cc:419 (LL trafficBytes *= 4, since v2.26.2-1), :529 "
         "(MinTrafficPerChannel = 16K), :562 (trafficPerChannel = max(MinTrafficPerChannel, "
         "trafficBytes/nChannels)), :599-601 (LL trafficPerByte *= 4; cellSize)"),
    Port("2.29-2.30", (22902, 22903, 22907, 23003, 23004, 23007), 32 << 10, True, "div16",
         "traffic", True, True,
         "v2.30.7-1 src/enqueue.cc:585 (MinTrafficPerChannel = 32K, since v2.29.2-1), :618 "
         "(trafficPerChannel = divUp(trafficBytes/nChannels, 16)*16: no MinTraffic floor)"),
)


def format_version(code: int) -> str:
    """``22809`` -> ``"2.28.9"``."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def parse_version(text: str) -> int:
    """``"2.28.9"`` (or ``"22809"``) -> 22809; ValueError naming what was given."""
    t = str(text).strip()
    parts = t.split(".")
    if len(parts) == 3 and all(p.isdigit() for p in parts):
        major, minor, patch = (int(p) for p in parts)
        if major == 2 and minor < 100 and patch < 100:
            return major * 10000 + minor * 100 + patch
    if t.isdigit() and 20000 <= int(t) < 30000:
        return int(t)
    raise ValueError(f"expected an NCCL version such as 2.28.9, got {text!r}")


def checked_versions() -> Tuple[int, ...]:
    """Every version some port covers, in order."""
    return tuple(sorted(v for p in PORTS for v in p.tags))


def port_for(version: int) -> Port:
    """The port covering NCCL ``version``; :class:`CannotPredict` naming the checked versions
    when none does."""
    for p in PORTS:
        if version in p.tags:
            return p
    known = ", ".join(format_version(v) for v in checked_versions())
    raise CannotPredict(f"NCCL {format_version(version)} is not a version whose source the model "
                        f"was checked against (checked: {known})")
