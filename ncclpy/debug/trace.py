"""Join the flight-recorder dumps of every rank and say what went wrong (``ncclpy trace``).

:func:`load` reads dump files (:mod:`ncclpy.debug.recorder`'s JSON lines) from files and
directories, tolerating dumps cut short (a crashed rank): it keeps what parsed and says where
it stopped; what a rank did past the end of its cut-short dump is unknown, never "not issued".
A dump of a schema this ncclpy does not read (:data:`SUPPORTED_SCHEMAS`) is refused.
:func:`analyze` then, per communicator:

* the ranks whose dump is missing or cut short;
* the first collective (by its number among the communicator's collectives, ``cseq``) where the
  ranks disagree: ranks that never issued it (with their last call and its site), or ranks
  whose call differs (the differing fields marked ``*field=value*``, as checked mode does);
* unmatched send/recv: per ordered pair of ranks, the k-th send of a to b against the k-th
  receive of b from a (missing on one side, or count/dtype differing);
* where the first unfinished call completed and where not; a call issued everywhere and
  completed nowhere is reported as stuck in NCCL (a stopped rank, a hung kernel, the network).

Pure: no store, no GPU; :mod:`ncclpy.debug.tracecli` prints it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checked import FIELDS
from .recorder import SCHEMA
from ..errors import ArgumentError

__all__ = ["Dump", "load", "analyze", "Finding", "CommReport",
           "call_text", "MARKED", "SUPPORTED_SCHEMAS", "UNKNOWN_CUT_SHORT"]

#: the dump schemas this ncclpy reads (a dump of another is refused, never guessed at)
SUPPORTED_SCHEMAS: Tuple[str, ...] = (SCHEMA,)
#: what a rank did past the end of its cut-short dump
UNKNOWN_CUT_SHORT = "unknown (dump cut short)"

#: the fields compared between ranks (checked mode's, without the sequence number)
MARKED = tuple(k for k in FIELDS if k != "seq")


@dataclass
class Dump:
    """One rank's dump: its header, its calls (oldest first), whether it was cut short."""

    path: str
    header: Dict[str, Any]
    calls: List[Dict[str, Any]]
    truncated: bool = False
    note: str = ""

    @property
    def rank(self) -> int:
        return int(self.header.get("rank", -1))

    @property
    def key(self) -> Tuple[str, str]:
        return (str(self.header.get("comm", "?")), str(self.header.get("comm_id", "?")))


def _files(paths: Sequence[str]) -> List[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, _, names in os.walk(p):
                found += [os.path.join(root, n) for n in names
                          if n.startswith("ncclpy-trace-") and n.endswith(".jsonl")]
            out += sorted(found)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise ArgumentError(f"{p}: no such file or directory")
    return out


def _read(path: str) -> Tuple[Optional[Dump], str]:
    """One file: (the dump, "") or (None, why it is not a dump)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    lines = raw.decode("utf-8", "replace").splitlines()
    if not lines:
        return None, "empty"
    try:
        head = json.loads(lines[0])
    except ValueError:
        return None, "not a flight-recorder dump (its first line is not JSON)"
    if not isinstance(head, dict) or head.get("kind") != "header" or \
            not str(head.get("schema", "")).startswith("ncclpy-trace/"):
        return None, "not a flight-recorder dump (no ncclpy-trace header)"
    if head["schema"] not in SUPPORTED_SCHEMAS:
        raise ArgumentError(f"{path}: a dump of schema {head['schema']!r}, which this ncclpy "
                            f"cannot read; it reads {', '.join(map(repr, SUPPORTED_SCHEMAS))} "
                            f"(read it with the ncclpy that wrote it)")
    d = Dump(path, head, [])
    ended = False
    for i, line in enumerate(lines[1:], 2):
        try:
            e = json.loads(line)
        except ValueError:
            d.truncated, d.note = True, f"line {i} is cut short"
            break
        if not isinstance(e, dict):
            d.truncated, d.note = True, f"line {i} is not an object"
            break
        if e.get("kind") == "end":
            ended = True
            break
        if e.get("kind") == "call":
            d.calls.append(e)
    if not ended and not d.truncated:
        d.truncated, d.note = True, "it has no end line"
    return d, ""


def load(paths: Sequence[str]) -> Tuple[List[Dump], List[Tuple[str, str]]]:
    """The dumps under ``paths`` (files or directories, several hosts' included) and the files
    that are not dumps, with why.  Of two dumps of the same rank, the later one counts.
    ArgumentError: a path that does not exist, no readable dump, or a dump whose schema is
    not one of :data:`SUPPORTED_SCHEMAS` (its calls would be misread)."""
    files = _files(paths)
    if not files:
        raise ArgumentError(f"{', '.join(paths)}: no flight-recorder dump "
                              f"(ncclpy-trace-*.jsonl) found")
    best: Dict[Tuple[str, str, int], Dump] = {}
    bad = []
    for path in files:
        d, why = _read(path)
        if d is None:
            bad.append((path, why))
            continue
        k = d.key + (d.rank,)
        old = best.get(k)
        if old is None or float(d.header.get("time", 0)) >= float(old.header.get("time", 0)):
            best[k] = d
    if not best:
        raise ArgumentError(f"{', '.join(paths)}: no readable flight-recorder dump "
                              f"({len(bad)} file(s) skipped: {bad[0][0]}: {bad[0][1]})")
    return sorted(best.values(), key=lambda d: (d.key, d.rank)), bad


@dataclass
class Finding:
    """One problem: ``kind`` (missing_dump, truncated, never_issued, differs, unmatched_p2p,
    stuck, not_completed) and its text lines."""

    kind: str
    lines: List[str]
    ranks: List[int] = field(default_factory=list)


@dataclass
class CommReport:
    """What :func:`analyze` found on one communicator."""

    comm: str
    comm_id: str
    world_size: int
    ranks: List[int]
    missing: List[int]
    findings: List[Finding]
    timeline: Dict[int, List[str]]

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> Dict[str, Any]:
        return {"comm": self.comm, "comm_id": self.comm_id, "world_size": self.world_size,
                "ranks": self.ranks, "missing": self.missing, "ok": self.ok,
                "findings": [{"kind": f.kind, "ranks": f.ranks, "text": f.lines}
                             for f in self.findings],
                "timeline": {str(r): t for r, t in self.timeline.items()}}


def call_text(e: Dict[str, Any], marks: Sequence[str] = ()) -> str:
    """``all_reduce count=4 dtype=float32 op=SUM`` (fields in ``marks`` as ``*k=v*``)."""
    coll = str(e.get("coll", "?"))
    parts = [f"*{coll}*" if "coll" in marks else coll]
    p2p_only = e.get("nccl") == "p2p"
    for k in MARKED[1:]:
        v = e.get(k)
        if v is None or (k == "in_place" and not v and k not in marks) or \
                (k == "nccl" and k not in marks) or (p2p_only and k not in marks):
            continue
        s = f"{k}={v}"
        parts.append(f"*{s}*" if k in marks else s)
    if e.get("p2p"):
        parts.append(", ".join(f"{k} {'to' if k == 'send' else 'from'} {p} {n}x{d}"
                               for k, p, n, d in e["p2p"]))
    return " ".join(parts)


def _where(e: Optional[Dict[str, Any]]) -> str:
    if e is None:
        return "no call recorded"
    site = f" at {e['site']}" if e.get("site") else ""
    return f"#{e.get('seq')} {call_text(e)} ({e.get('state')}){site}"


def _ranks(rs: Sequence[int]) -> str:
    return ", ".join(map(str, rs))


def _collectives(dumps: Dict[int, Dump]) -> List[Finding]:
    by: Dict[int, Dict[int, Dict[str, Any]]] = {}
    for r, d in dumps.items():
        by[r] = {int(e["cseq"]): e for e in d.calls if int(e.get("cseq", -1)) >= 0}
    if not by:
        return []
    have = {r: (min(m) if m else None, max(m) if m else -1) for r, m in by.items()}
    start = max((lo for lo, _ in have.values() if lo is not None), default=0)
    end = max(hi for _, hi in have.values())
    for k in range(start, end + 1):
        issued = sorted(r for r in by if k in by[r])
        past = [r for r in by if have[r][1] < k]          # k is past the end of their dump
        never = sorted(r for r in past if not dumps[r].truncated)
        unknown = sorted(r for r in past if dumps[r].truncated)
        if never:
            e = by[issued[0]][k]
            lines = [f"collective #{k} ({call_text(e)}) was issued by rank(s) {_ranks(issued)} "
                     f"but never by rank(s) {_ranks(never)}"
                     + (f"; by rank(s) {_ranks(unknown)}: {UNKNOWN_CUT_SHORT}" if unknown
                        else "") + ":"]
            lines += [f"  rank {r} issued it at {by[r][k].get('site') or '?'} "
                      f"({by[r][k].get('state')})" for r in issued[:8]]
            for r in never:
                calls = dumps[r].calls
                lines.append(f"  rank {r} never issued it; its last call: "
                             f"{_where(calls[-1] if calls else None)}")
            for r in unknown:
                calls = dumps[r].calls
                lines.append(f"  rank {r}: {UNKNOWN_CUT_SHORT}; the last call read: "
                             f"{_where(calls[-1] if calls else None)}")
            return [Finding("never_issued", lines, never)]
        ref_rank = issued[0]
        ref = by[ref_rank][k]
        diff = {r: [f for f in MARKED if by[r][k].get(f) != ref.get(f)] for r in issued}
        if any(diff.values()):
            bad = sorted(r for r in issued if diff[r])
            marks = sorted({f for fs in diff.values() for f in fs}, key=MARKED.index)
            lines = [f"collective #{k}: the ranks' calls differ (in {', '.join(marks)}); "
                     f"compared with rank {ref_rank}'s:"]
            for r in issued:
                e = by[r][k]
                lines.append(f"  rank {r:>4}  #{e.get('seq')} "
                             f"{call_text(e, diff[r] and marks or ())}  at {e.get('site')}")
            return [Finding("differs", lines, bad)]
    return []


def _p2p(dumps: Dict[int, Dump], world: int) -> List[Finding]:
    """Per ordered pair (a, b): a's sends to b against b's recvs from a, in order."""
    sends: Dict[Tuple[int, int], List[Tuple[Dict[str, Any], int, str]]] = {}
    recvs: Dict[Tuple[int, int], List[Tuple[Dict[str, Any], int, str]]] = {}
    for r, d in dumps.items():
        for e in d.calls:
            for kind, peer, count, dtype in e.get("p2p") or ():
                side = sends if kind == "send" else recvs
                pair = (r, int(peer)) if kind == "send" else (int(peer), r)
                side.setdefault(pair, []).append((e, count, dtype))
    dropped = {r for r, d in dumps.items() if int(d.header.get("dropped", 0)) > 0}
    lines: List[str] = []
    ranks = set()
    for a, b in sorted(set(sends) | set(recvs)):
        if a not in dumps or b not in dumps or {a, b} & dropped:
            continue              # one side unknown: said as a missing or cut-short dump
        s, rv = sends.get((a, b), []), recvs.get((a, b), [])
        for i in range(max(len(s), len(rv))):
            x = s[i] if i < len(s) else None
            y = rv[i] if i < len(rv) else None
            if (y is None and dumps[b].truncated) or (x is None and dumps[a].truncated):
                continue          # past the end of a cut-short dump: unknown, not unmatched
            if x is not None and y is not None:
                if (x[1], x[2]) != (y[1], y[2]):
                    lines.append(f"  send #{i} from rank {a} to rank {b} ({x[1]}x{x[2]}, at "
                                 f"{x[0].get('site')}) meets a recv of {y[1]}x{y[2]} (at "
                                 f"{y[0].get('site')}): count or dtype differ")
                    ranks |= {a, b}
            elif x is not None:
                lines.append(f"  rank {a}: send #{i} to rank {b} ({x[1]}x{x[2]}, at "
                             f"{x[0].get('site')}, {x[0].get('state')}) has no matching recv "
                             f"on rank {b}")
                ranks.add(a)
            elif y is not None:
                lines.append(f"  rank {b}: recv #{i} from rank {a} ({y[1]}x{y[2]}, at "
                             f"{y[0].get('site')}, {y[0].get('state')}) has no matching send "
                             f"on rank {a}")
                ranks.add(b)
    if not lines:
        return []
    return [Finding("unmatched_p2p", ["send/recv that do not pair up (per pair of ranks, in "
                                      "order):"] + lines, sorted(ranks))]


def _unfinished(dumps: Dict[int, Dump], missing: Sequence[int] = ()) -> List[Finding]:
    """The oldest call not completed on some rank: where it completed and where not."""
    first: Optional[Tuple[int, Dict[str, Any]]] = None
    for r, d in dumps.items():
        for e in d.calls:
            if e.get("state") != "completed" and int(e.get("cseq", -1)) >= 0:
                if first is None or int(e["cseq"]) < int(first[1]["cseq"]):
                    first = (r, e)
                break
    if first is None:
        return []
    k = int(first[1]["cseq"])
    states: Dict[int, str] = {}
    for r, d in dumps.items():
        e = next((c for c in d.calls if int(c.get("cseq", -1)) == k), None)
        past = e is None and d.truncated and \
            all(int(c.get("cseq", -1)) < k for c in d.calls)
        states[r] = (UNKNOWN_CUT_SHORT if past else "not issued") if e is None \
            else str(e.get("state"))
    done = [r for r, s in states.items() if s == "completed"]
    notdone = sorted(r for r, s in states.items() if s != "completed")
    kind = "stuck" if not done and not missing and \
        all(s not in ("not issued", UNKNOWN_CUT_SHORT) for s in states.values()) \
        else "not_completed"
    head = (f"collective #{k} ({call_text(first[1])}) was issued by every rank and completed "
            f"on none: stuck inside NCCL (a stopped or hung rank, a kernel that cannot "
            f"finish, the network)" if kind == "stuck"
            else f"collective #{k} ({call_text(first[1])}) completed on rank(s) "
                 f"{_ranks(sorted(done)) or 'none'}, not on rank(s) {_ranks(notdone)}"
                 + (f" (no dump from rank(s) {_ranks(missing)})" if missing else ""))
    lines = [head] + [f"  rank {r}: {states[r]}" for r in notdone[:16]]
    return [Finding(kind, lines, notdone)]


def _timeline(d: Dump, last: int) -> List[str]:
    t0 = float(d.header.get("time", 0.0))
    out = []
    for e in (d.calls[-last:] if last > 0 else []):     # calls[-0:] would be every call
        ago = t0 - float(e.get("t_issue") or t0)
        out.append(f"#{e.get('seq'):<5} {call_text(e):<48} {str(e.get('state')):<9} "
                   f"-{ago:.1f}s  {e.get('site') or ''}")
    return out


def analyze(dumps: Sequence[Dump], last: int = 5) -> List[CommReport]:
    """One report per communicator (see the module docstring); ``last``: calls per rank in
    the timeline."""
    groups: Dict[Tuple[str, str], Dict[int, Dump]] = {}
    for d in dumps:
        groups.setdefault(d.key, {})[d.rank] = d
    out = []
    for (comm, cid), by in sorted(groups.items()):
        world = max(int(d.header.get("world_size", 0)) for d in by.values())
        missing = [r for r in range(world) if r not in by]
        findings: List[Finding] = []
        if missing:
            findings.append(Finding("missing_dump", [
                f"no dump from rank(s) {_ranks(missing)} (crashed or killed before dumping, "
                f"or their host's directory was not given); what they did is unknown"],
                missing))
        for r, d in sorted(by.items()):
            if d.truncated:
                findings.append(Finding("truncated", [
                    f"rank {r}'s dump {d.path} is cut short ({d.note}); its last "
                    f"{len(d.calls)} call(s) read"], [r]))
        first = _collectives(by)
        findings += first
        findings += _p2p(by, world)
        if not first:          # a call skipped or different explains what did not finish
            findings += _unfinished(by, missing)
        aborted = {r: d.header.get("abort") for r, d in by.items() if d.header.get("abort")}
        for r, why in sorted(aborted.items())[:1]:
            findings.append(Finding("aborted", [f"rank {r} aborted the communicator: {why}"],
                                    sorted(aborted)))
        tl = {r: _timeline(d, last) for r, d in sorted(by.items())}
        out.append(CommReport(comm, cid, world, sorted(by), missing, findings, tl))
    return out
