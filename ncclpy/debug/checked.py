"""Checked mode: every rank's NCCL calls compared across ranks through the store, before NCCL.

Turned on per communicator (``ncclpy.init(..., checked=True)`` or ``NCCLPY_CHECKED=1``).  Each
*round* -- one collective made outside a group, or every collective of a ``with group():``
block at its outermost end -- is summarised into a :func:`fingerprint` (pure: built from the
call's real :class:`~ncclpy.plan.types.Plan`) and exchanged through the rendezvous store by a
:class:`Checker`:

* the collective part (per call: the communicator's sequence number, the collective, the NCCL
  function, count, dtype, op with its premul scalar, root, in place or not) must be identical on
  every rank; each rank compares its own with rank 0's;
* the point-to-point part of a collective (the ``Send``/``Recv`` calls its plan makes, e.g. a
  grouped all_to_all) must pair up: rank r's sends to p, in order, equal p's receives from r;
* the user's own ``send``/``recv``/``send_recv`` are not part of the round: they are paired
  with the peer's, per pair of ranks and in order, by :mod:`ncclpy.debug.pairing` (only the two
  ranks of a pair take part), so a rank that makes no point-to-point call never waits.

On ncclpy's store a round is **one round trip per rank and leaves no key**: each rank sends a
VOTE (:mod:`ncclpy.store.tablewire`) carrying a hash of its collective part, which must be equal
on every rank, and a sum over its point-to-point part (``+H(src, dst, k, count, dtype)`` for
its k-th send to a peer, ``-H(...)`` for its k-th receive from one), which cancels to 0 over all
ranks exactly when every send meets its receive (up to a 64-bit hash collision).  The server
answers every rank once all voted, so a mismatch raises :class:`CallMismatchError` on *every*
rank -- before any NCCL call of the round was made.  Only then (the slow path) does every rank
publish its fingerprint; rank 0 reads them all, builds the table and publishes it, the others
read it, and the last one out deletes the keys.  A rank that never arrives is named, after the
timeout, in a :class:`CallCheckTimeout`.

A store without the vote (torch's) gets the older exchange through keys: set, get rank 0's,
get each peer's, arrive, read the shared counter of problems; the previous round's keys are
deleted, so at most two rounds' keys exist at any time.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..semantics.dtypes import NCCL_DTYPE_NAMES
from ..errors import CallCheckTimeout, CallMismatchError, StoreError, UnsupportedError
from ..store import tablewire as _TW
from ..store.sync import count_out, delete_key, wait_counted_out
# store helpers shared with pairing (which must not import this module: issue 37), under
# the names they had here
from ..store.sync import is_timeout as _is_timeout, wait_key as _wait_key
from .pairing import PairCheck

__all__ = ["Checker", "fingerprint", "compare", "format_table", "round_hashes", "P2P_CALLS",
           "FIELDS"]

log = logging.getLogger(__name__)

#: user calls that are point-to-point only: checked by pairing, not compared across ranks
#: (the one-sided RMA calls have no partner call at all: neither compared nor paired)
P2P_CALLS = frozenset(("send", "recv", "send_recv", "put_signal", "signal", "wait_signal"))
#: the fields of one collective call, in the order the table shows them
FIELDS = ("seq", "coll", "nccl", "count", "dtype", "op", "root", "in_place", "config")
_COUNT_ARG = {"AllReduce": 2, "Reduce": 2, "Broadcast": 2, "ReduceScatter": 2, "AllGather": 2,
              "AlltoAll": 2, "Gather": 2, "Scatter": 2}
_COUNT_ARG.update({fn + "Config": i for fn, i in _COUNT_ARG.items()})   # + the config ptr
_OP_NAMES = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


def _op_text(plan: Any, call: Any) -> Optional[str]:
    op = plan.meta.get("op")
    if op is not None:
        return str(op)                      # RedOp: "SUM", "premul_sum(0.5)" (scalar included)
    if call is not None and call.fn.replace("Config", "") in ("AllReduce", "Reduce",
                                                                "ReduceScatter"):
        v = call.args[4]
        return _OP_NAMES.get(v, str(v)) if type(v) is int else "premul_sum"
    return None


def _call_entry(plan: Any, seq: int) -> Dict[str, Any]:
    calls = plan.calls
    coll = [c for c in calls if c.fn not in ("Send", "Recv")]
    first = coll[0] if coll else None
    if first is None:
        nccl, count = "p2p", None           # a collective made of send/recv: pairing checks it
    else:
        nccl = "+".join(c.fn for c in coll)
        count = [c.args[_COUNT_ARG[c.fn]] for c in coll]
        count = count[0] if len(count) == 1 else count
    dtype = plan.meta.get("dtype")
    if dtype is None and first is not None:
        dtype = NCCL_DTYPE_NAMES.get(first.args[3], first.args[3])
    root = plan.meta.get("root")
    return {"seq": seq, "coll": plan.collective, "nccl": nccl, "count": count,
            "dtype": dtype, "op": _op_text(plan, first), "root": root,
            "in_place": bool(plan.meta.get("in_place", False)),
            "config": plan.meta.get("config")}       # CollConfig.describe(): NCCL checks it
                                                      # only locally


def fingerprint(plans: Sequence[Any], seq: int, names: Optional[Sequence[str]] = None
                ) -> Dict[str, Any]:
    """The fingerprint of one round: ``plans`` are the round's calls in order (one outside a
    group), ``seq`` the communicator's sequence number of the first; ``names`` the user calls
    (default: each plan's collective).  JSON-able."""
    calls: List[Dict[str, Any]] = []
    p2p: List[List[Any]] = []
    for i, plan in enumerate(plans):
        name = names[i] if names is not None else plan.collective
        if name not in P2P_CALLS:
            calls.append(_call_entry(plan, seq + i))
        for c in plan.calls:
            if c.fn == "Send" or c.fn == "Recv":
                buf, count, dt, peer = c.args
                p2p.append([c.fn.lower(), int(peer), int(count),
                            NCCL_DTYPE_NAMES.get(dt, dt), seq + i])
    return {"seq": seq, "n": len(plans), "calls": calls, "p2p": p2p}


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def round_hashes(fp: Dict[str, Any], rank: int) -> Tuple[int, int]:
    """(hash of the collective part, p2p sum mod 2**64) of one rank's fingerprint ``fp``: the
    hash is equal on every rank exactly when their collective parts are; the sums of all ranks
    add up to 0 exactly when every send has its matching receive (see the module docstring)."""
    coll = _h64(json.dumps([fp["seq"], fp["calls"]], separators=(",", ":"), sort_keys=True))
    total, nth = 0, {}
    for kind, peer, count, dtype, _ in fp["p2p"]:
        chan = (rank, peer) if kind == "send" else (peer, rank)
        k = nth[(kind, peer)] = nth.get((kind, peer), -1) + 1
        h = _h64(f"{chan[0]}>{chan[1]}#{k}:{count}:{dtype}")
        total += h if kind == "send" else -h
    return coll, total & ((1 << 64) - 1)


def _p2p_with(fp: Dict[str, Any], kind: str, peer: int) -> List[Tuple[int, str]]:
    return [(e[2], e[3]) for e in fp["p2p"] if e[0] == kind and e[1] == peer]


def compare(fps: Dict[int, Optional[Dict[str, Any]]], ranks: Optional[Sequence[int]] = None
            ) -> List[str]:
    """Every problem among the fingerprints ``fps`` (rank -> fingerprint, None: never arrived)
    as one line each; empty when they agree.  ``ranks``: only the problems of these ranks
    (default: all).  Collective parts are compared with the lowest present rank's."""
    present = sorted(r for r, f in fps.items() if f is not None)
    out: List[str] = []
    missing = sorted(r for r, f in fps.items() if f is None)
    if missing:
        out.append(f"rank(s) {', '.join(map(str, missing))} never arrived at the check")
    if not present:
        return out
    ref_rank = present[0]
    ref = fps[ref_rank]
    mine = present if ranks is None else [r for r in ranks if fps.get(r) is not None]
    for r in mine:
        f = fps[r]
        if r != ref_rank:
            if f["seq"] != ref["seq"]:
                out.append(f"rank {r}: sequence number {f['seq']} != rank {ref_rank}'s "
                           f"{ref['seq']}")
            if len(f["calls"]) != len(ref["calls"]):
                out.append(f"rank {r}: {len(f['calls'])} collective call(s) in the round, rank "
                           f"{ref_rank} made {len(ref['calls'])}")
            for i, (a, b) in enumerate(zip(f["calls"], ref["calls"])):
                diff = [k for k in FIELDS if k != "seq" and a.get(k) != b.get(k)]
                if diff:
                    out.append(f"rank {r}: call {i} differs from rank {ref_rank}'s in "
                               f"{', '.join(diff)}")
        for kind, other in (("send", "recv"), ("recv", "send")):
            peers = sorted({e[1] for e in f["p2p"] if e[0] == kind})
            for p in peers:
                g = fps.get(p)
                if g is None:
                    continue            # reported as missing (or out of range below)
                a, b = _p2p_with(f, kind, p), _p2p_with(g, other, r)
                if a != b:
                    prep, back = ("to", "from") if kind == "send" else ("from", "to")
                    out.append(f"rank {r}: {kind}s {prep} rank {p} {_pairs(a)} do not match "
                               f"rank {p}'s {other}s {back} rank {r} {_pairs(b)}")
            for p in peers:
                if p not in fps:
                    out.append(f"rank {r}: {kind} with peer {p}, which is not a rank of the "
                               f"communicator")
    return out


def _pairs(x: List[Tuple[int, str]]) -> str:
    return "[" + ", ".join(f"{c}x{d}" for c, d in x) + "]" if x else "(none)"


def _call_text(c: Dict[str, Any], marks: set) -> str:
    parts = []
    for k in FIELDS[1:]:
        v = c.get(k)
        if v is None and k not in marks:
            continue
        s = f"{k}={v}"
        parts.append(f"*{s}*" if k in marks else s)
    return " ".join(parts)


def format_table(fps: Dict[int, Optional[Dict[str, Any]]], name: str = "default",
                 round_: Optional[int] = None, problems: Sequence[str] = ()) -> str:
    """The mismatch table: one line per rank (and per call of a group), differing fields
    marked ``*field=value*``, then the problems found."""
    present = sorted(r for r, f in fps.items() if f is not None)
    ref = fps[present[0]] if present else None
    missing = any(f is None for f in fps.values())
    head = (f"checked mode: the ranks' calls on communicator {name!r} "
            f"{'could not be compared' if missing and len(problems) <= 1 else 'do not match'}")
    if round_ is not None:
        head += f" (check {round_})"
    lines = [head + "; nothing of this round was given to NCCL:",
             f"  {'rank':>4}  {'seq':>5}  call"]
    for r in sorted(fps):
        f = fps[r]
        if f is None:
            lines.append(f"  {r:>4}  {'-':>5}  (never arrived)")
            continue
        seqmark = "*" if ref is not None and f["seq"] != ref["seq"] else ""
        calls = f["calls"]
        if not calls:
            texts = ["(no collective)"]
        else:
            texts = []
            for i, c in enumerate(calls):
                other = ref["calls"][i] if ref is not None and i < len(ref["calls"]) else None
                marks = {k for k in FIELDS[1:] if other is None or c.get(k) != other.get(k)}
                texts.append(_call_text(c, marks))
        p2p = f["p2p"]
        if p2p:
            texts.append("p2p " + ", ".join(f"{k} {'to' if k == 'send' else 'from'} {p} "
                                            f"{n}x{d}" for k, p, n, d, _ in p2p))
        for i, t in enumerate(texts):
            rk = f"{r:>4}" if i == 0 else " " * 4
            sq = f"{seqmark}{f['seq']}" if i == 0 else ""
            lines.append(f"  {rk}  {sq:>5}  {t}")
    if problems:
        lines.append("problems:")
        lines.extend(f"  - {p}" for p in problems)
    return "\n".join(lines)


class Checker:
    """Cross-rank call check of one communicator through ``store`` (see module docstring).

    ``prefix`` names the communicator's keys (its name and bootstrap generation);
    ``timeout`` bounds every wait.  :meth:`check` raises or returns; ``seq`` advances by the
    number of calls of each round, ``round`` by one per round, on every rank alike.
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, name: str = "default",
                 prefix: Optional[str] = None, timeout: float = 300.0) -> None:
        if store is None and int(world_size) > 1:   # uid_exchange="mpi": there is no store
            raise UnsupportedError(
                f"checked: communicator {name!r} has no rendezvous store (its uid came over "
                f"MPI_Bcast, uid_exchange='mpi', or a torch broadcast, from_torch on a torch "
                f"without a reachable store), and checked mode compares the ranks' calls "
                f"through that store; use uid_exchange='store' (NCCLPY_UID_EXCHANGE=store) "
                f"or checked=False")
        self.store = store
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.name = name
        self.prefix = prefix if prefix is not None else f"ncclpy/{name}/chk"
        self.timeout = float(timeout)
        self.seq = 0
        self.round = 0
        self._arrive = bool(getattr(store, "supports_arrive", False))
        self._vote = bool(getattr(store, "supports_tables", False))
        self._pairs = PairCheck(store, self.rank, self.world_size, self.prefix, self.timeout,
                                name)

    def _key(self, rnd: int, what: str) -> str:
        return f"{self.prefix}/{rnd}/{what}"

    def check(self, plans: Sequence[Any], names: Optional[Sequence[str]] = None) -> None:
        """Compare this round's ``plans`` across ranks; raise CallMismatchError (every rank)
        or CallCheckTimeout (a rank never arrived).  Its collectives are compared across every
        rank (one round); its sends and receives (``send``, ``recv``, ``send_recv``) are
        paired with their peers' only (:mod:`ncclpy.debug.pairing`): ranks that take no part
        in them never wait for them."""
        names = [p.collective for p in plans] if names is None else list(names)
        coll = [i for i, nm in enumerate(names) if nm not in P2P_CALLS]
        ops = [(c.fn.lower(), int(c.args[3]), int(c.args[1]),
                str(NCCL_DTYPE_NAMES.get(c.args[2], c.args[2])))
               for i, nm in enumerate(names) if nm in P2P_CALLS
               for c in plans[i].calls if c.fn == "Send" or c.fn == "Recv"]
        if coll:
            self._check_round([plans[i] for i in coll], [names[i] for i in coll])
        if ops:
            self._pairs.check(ops)

    def _check_round(self, plans: Sequence[Any], names: Sequence[str]) -> None:
        rnd, seq = self.round, self.seq
        self.round += 1
        self.seq += len(plans)
        fp = fingerprint(plans, seq, names)
        if self.world_size == 1:
            problems = compare({0: fp})
            if problems:
                raise CallMismatchError(format_table({0: fp}, self.name, rnd, problems))
            return
        if self._vote:
            self._check_vote(rnd, fp)
        else:
            self._check_keys(rnd, fp)

    def _check_vote(self, rnd: int, fp: Dict[str, Any]) -> None:
        """One VOTE round trip; the table only on a mismatch."""
        me, n = self.rank, self.world_size
        own = [e for e in fp["p2p"] if not 0 <= e[1] < n]    # a peer that is not a rank
        coll, total = round_hashes(fp, me)
        try:
            rep = self.store.vote(self._key(rnd, "v"), n, me, coll, total, bad=bool(own),
                                  timeout=self.timeout)
        except Exception as e:
            if not _is_timeout(e):
                raise
            rep = _TW.VoteReply(_TW.TIMED_OUT, 0, [])
        if rep.verdict & _TW.TIMED_OUT:
            out: Dict[int, Optional[Dict[str, Any]]] = {me: fp}
            out.update((r, None) for r in rep.missing)
            self._raise_timeout(rnd, out, "waiting for every rank to compare", rep.missing)
        if rep.verdict:
            self._mismatch_table(rnd, fp)

    def _mismatch_table(self, rnd: int, fp: Dict[str, Any], published: bool = False) -> None:
        """The slow path after a failed vote (or count of problems): build the table on rank 0,
        share it, raise CallMismatchError on every rank.  Rank 0, which may host the store,
        leaves only after every rank has read the table (the "out" meeting), so no rank is
        left asking a store that is gone; a failure of that last meeting, once the table is
        read, loses nothing and is only logged."""
        store, me, n = self.store, self.rank, self.world_size
        deadline = time.monotonic() + self.timeout
        fps: Dict[int, Optional[Dict[str, Any]]] = {me: fp}
        try:
            if not published:
                store.set(self._key(rnd, f"fp/{me}"), json.dumps(fp, separators=(",", ":")))
                self._meet(rnd, deadline)
            if me == 0:
                fps = self._read_all(rnd, fps, deadline)
                for r in range(n):
                    self._delete(self._key(rnd, f"fp/{r}"))
                store.set(self._key(rnd, "table"), json.dumps(
                    {str(r): f for r, f in fps.items()}, separators=(",", ":")))
            else:
                raw = json.loads(_wait_key(store, self._key(rnd, "table"),
                                           max(deadline - time.monotonic(), 0.001)))
                fps = {int(r): f for r, f in raw.items()}
        except Exception as e:
            if not (_is_timeout(e) or isinstance(e, (StoreError, OSError))
                    or "DistStoreError" in type(e).__name__):
                raise
            log.warning("checked mode: the mismatch table could not be collected: %s", e)
            problems = compare(fps) + [f"rank {me} could not collect every rank's calls for "
                                       f"this table ({type(e).__name__}: {e})"]
            raise CallMismatchError(format_table(fps, self.name, rnd, problems), table=fps,
                                    problems=problems) from e
        try:
            self._leave(rnd, deadline)
        except Exception as e:  # noqa: BLE001 - the table is read: nothing is lost
            log.debug("checked mode: leaving the mismatch table of check %d: %s", rnd, e)
        problems = compare(fps)
        raise CallMismatchError(format_table(fps, self.name, rnd, problems), table=fps,
                                problems=problems)

    def _leave(self, rnd: int, deadline: float) -> None:
        """Every rank has read the table before rank 0 (which may host the store) goes on:
        each other rank counts itself out with one ``add`` (its reply is sent before the count
        can be seen), and rank 0 polls the count, then deletes the round's keys.  A barrier
        would not do: its last reply may still be unsent when rank 0, released first, exits
        and takes the store with it, leaving a rank to wait out its timeout."""
        key = self._key(rnd, "out")
        if self.rank != 0:
            count_out(self.store, key)
            return
        wait_counted_out(self.store, key, self.world_size - 1,
                         max(deadline - time.monotonic(), 0.001), "checked mode's table")
        for what in ("table", "n", "out"):
            self._delete(self._key(rnd, what))

    def _check_keys(self, rnd: int, fp: Dict[str, Any]) -> None:
        """The exchange through keys, for a store without the vote (torch's)."""
        store, me = self.store, self.rank
        deadline = time.monotonic() + self.timeout
        store.set(self._key(rnd, f"fp/{me}"), json.dumps(fp, separators=(",", ":")))
        fps: Dict[int, Optional[Dict[str, Any]]] = {me: fp}
        want = {0} | {e[1] for e in fp["p2p"] if 0 <= e[1] < self.world_size}
        try:
            for r in sorted(want - {me}):
                fps[r] = self._read(rnd, r, deadline)
        except Exception as e:
            if not _is_timeout(e):
                raise
            self._timed_out(rnd, fps, "reading the others' calls")
        bad = bool(compare(fps, [me]))
        if bad:
            store.add(self._key(rnd, "bad"), 1)
        try:
            self._meet(rnd, deadline)
        except Exception as e:
            if not _is_timeout(e):
                raise
            self._timed_out(rnd, fps, "waiting for every rank to compare")
        nbad = int(store.add(self._key(rnd, "bad"), 0))
        if rnd > 0:          # every rank has finished the previous round: drop its keys
            self._delete(self._key(rnd - 1, f"fp/{me}"))
            if me == 0:
                for what in ("n", "bad", "all", "table", "out"):
                    self._delete(self._key(rnd - 1, what))
        if nbad:             # rank 0 builds the table; it leaves after every rank read it
            self._mismatch_table(rnd, fp, published=True)

    def _read(self, rnd: int, r: int, deadline: float) -> Dict[str, Any]:
        left = max(deadline - time.monotonic(), 0.001)
        return json.loads(_wait_key(self.store, self._key(rnd, f"fp/{r}"), left))

    def _meet(self, rnd: int, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        key = self._key(rnd, "n")
        if self._arrive:
            self.store.arrive(key, self.world_size, left)
            return
        if int(self.store.add(key, 1)) == self.world_size:
            self.store.set(self._key(rnd, "all"), b"1")
        _wait_key(self.store, self._key(rnd, "all"), left)

    def _read_all(self, rnd: int, fps: Dict[int, Optional[Dict[str, Any]]],
                  deadline: float) -> Dict[int, Optional[Dict[str, Any]]]:
        out = dict(fps)
        for r in range(self.world_size):
            if out.get(r) is None:
                try:
                    out[r] = self._read(rnd, r, max(deadline, time.monotonic() + 1.0))
                except Exception as e:
                    if not _is_timeout(e):
                        raise
                    out[r] = None
        return out

    def _present(self, rnd: int, r: int) -> bool:
        key = self._key(rnd, f"fp/{r}")
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _timed_out(self, rnd: int, fps: Dict[int, Optional[Dict[str, Any]]],
                   doing: str) -> None:
        out: Dict[int, Optional[Dict[str, Any]]] = {}
        for r in range(self.world_size):
            f = fps.get(r)
            if f is None and self._present(rnd, r):
                try:
                    f = self._read(rnd, r, time.monotonic() + 1.0)
                except Exception:
                    f = None
            out[r] = f
        self._raise_timeout(rnd, out, doing, [r for r, f in out.items() if f is None])

    def _raise_timeout(self, rnd: int, out: Dict[int, Optional[Dict[str, Any]]], doing: str,
                       missing: List[int]) -> None:
        problems = compare(out)
        msg = (f"checked mode: rank {self.rank} timed out after {self.timeout:g} s {doing} on "
               f"communicator {self.name!r} (check {rnd}, sequence {out[self.rank]['seq']}); "
               f"rank(s) {', '.join(map(str, missing)) or '?'} never arrived\n"
               + format_table(out, self.name, rnd, problems))
        raise CallCheckTimeout(msg, table=out, problems=problems, missing=missing)

    def _delete(self, key: str) -> None:
        delete_key(self.store, key)
