"""Checked mode's send/recv pairing: every send from a to b meets b's receive from a, in order.

NCCL pairs point-to-point operations per ordered pair of ranks (a channel a>b), in the order
each side issued them, whatever the grouping: the k-th send of a to b moves its bytes into the
k-th receive of b from a.  A send without its receive, or with a receive of another size or
type, hangs or corrupts -- the hardest hangs of pipeline-parallel and MoE programs.  So before
NCCL sees a standalone send/recv or a group, each rank posts, for each of its operations, one
key ``<prefix>/pp/<a>><b>/<s|r><k>`` = ``count:dtype``, then reads the key of the operation that
must meet it (and deletes it: each key has one reader).  Only the two ranks of a pair talk:
ranks that take no part never wait, and the traffic is 3 requests per operation per rank,
O(operations) in total.

What is reported, on both ranks of the pair, before NCCL is called:

* *mismatched*: the k-th send and the k-th receive differ in count or dtype;
* *ambiguous*: within one round, the same messages in another order (NCCL pairs them in
  issue order, so sizes cross over);
* *missing*: no matching operation came within the timeout (a send no one receives, or both
  ranks sending first outside a group: NCCL deadlocks there) -- a CallCheckTimeout that says
  what the peer posted instead.

Operations with oneself are paired within the round, without the store.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence, Tuple

from ..errors import CallCheckTimeout, CallMismatchError
from ..store.sync import delete_key, is_timeout, wait_key

__all__ = ["PairCheck", "Op"]

#: one point-to-point operation of a round: (kind "send"|"recv", peer, count, dtype)
Op = Tuple[str, int, int, str]


def _chan(me: int, kind: str, peer: int) -> Tuple[int, int]:
    return (me, peer) if kind == "send" else (peer, me)


def _text(kind: str, k: int, peer: int, count: Any, dtype: Any) -> str:
    return f"{kind} #{k} {'to' if kind == 'send' else 'from'} rank {peer} ({count}x{dtype})"


class PairCheck:
    """The pairing of one communicator's point-to-point operations (see the module
    docstring); ``get(key, timeout)`` reads a key, waiting for it."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, timeout: float,
                 name: str = "default") -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.timeout, self.name = prefix, float(timeout), name
        self.next: Dict[Tuple[int, int, str], int] = {}    # (src, dst, kind) -> next k

    def _key(self, src: int, dst: int, kind: str, k: int) -> str:
        return f"{self.prefix}/pp/{src}>{dst}/{kind[0]}{k}"

    def check(self, ops: Sequence[Op]) -> None:
        """Pair this round's ``ops`` (in issue order); raise CallMismatchError or
        CallCheckTimeout on a problem, before NCCL is called."""
        me, n = self.rank, self.world_size
        bad = [f"rank {me}: {kind} with peer {p}, which is not a rank of the communicator "
               f"of {n}" for kind, p, _, _ in ops if not 0 <= p < n]
        if bad:
            raise CallMismatchError(self._head() + "\n" + "\n".join(f"  - {b}" for b in bad),
                                    problems=bad)
        mine: List[Tuple[str, int, int, Any, int]] = []
        for kind, p, count, dtype in ops:
            src, dst = _chan(me, kind, p)
            k = self.next.get((src, dst, kind), 0)
            self.next[(src, dst, kind)] = k + 1
            mine.append((kind, p, count, dtype, k))
        problems = self._self_pairs([m for m in mine if m[1] == me])
        remote = [m for m in mine if m[1] != me]
        for kind, p, count, dtype, k in remote:          # post everything first, then read
            src, dst = _chan(me, kind, p)
            self.store.set(self._key(src, dst, kind, k), f"{count}:{dtype}")
        deadline = time.monotonic() + self.timeout
        got: Dict[Tuple[str, int, int], Tuple[str, str]] = {}
        for kind, p, count, dtype, k in remote:
            other = "recv" if kind == "send" else "send"
            src, dst = _chan(me, kind, p)
            key = self._key(src, dst, other, k)
            try:
                raw = self._get(key, max(deadline - time.monotonic(), 0.001))
            except Exception as e:  # noqa: BLE001 - a timeout is the finding
                if not is_timeout(e):
                    raise
                raise CallCheckTimeout(self._missing(kind, p, count, dtype, k),
                                       problems=[f"rank {me}: {_text(kind, k, p, count, dtype)} "
                                                 f"was never met"], missing=[p]) from None
            delete_key(self.store, key)
            c, _, d = raw.decode().partition(":")
            got[(kind, p, k)] = (c, d)
        problems += self._compare(remote, got)
        if problems:
            raise CallMismatchError(self._head() + "\n" + "\n".join(f"  - {x}"
                                                                    for x in problems),
                                    problems=problems)

    def _compare(self, remote: Sequence[Tuple[str, int, int, Any, int]],
                 got: Dict[Tuple[str, int, int], Tuple[str, str]]) -> List[str]:
        me = self.rank
        out: List[str] = []
        by_peer: Dict[Tuple[str, int], List[Tuple[Tuple[str, str], Tuple[str, str], int]]] = {}
        for kind, p, count, dtype, k in remote:
            by_peer.setdefault((kind, p), []).append(((str(count), str(dtype)),
                                                      got[(kind, p, k)], k))
        for (kind, p), items in sorted(by_peer.items()):
            wrong = [(a, b, k) for a, b, k in items if a != b]
            if not wrong:
                continue
            other = "recv" if kind == "send" else "send"
            if sorted(a for a, _, _ in items) == sorted(b for _, b, _ in items):
                out.append(f"ambiguous: rank {me}'s {kind}s {'to' if kind == 'send' else 'from'} "
                           f"rank {p} [{_list(a for a, _, _ in items)}] and rank {p}'s "
                           f"{other}s [{_list(b for _, b, _ in items)}] pair up only in "
                           f"another order; NCCL pairs them in issue order")
                continue
            for a, b, k in wrong:
                out.append(f"mismatched: rank {me}'s {_text(kind, k, p, *a)} meets rank "
                           f"{p}'s {other} #{k} of {b[0]}x{b[1]}")
        return out

    def _self_pairs(self, ops: Sequence[Tuple[str, int, int, Any, int]]) -> List[str]:
        sends = [(str(c), str(d)) for kind, _, c, d, _ in ops if kind == "send"]
        recvs = [(str(c), str(d)) for kind, _, c, d, _ in ops if kind == "recv"]
        if sends == recvs:
            return []
        return [f"rank {self.rank}: its sends to itself [{_list(sends)}] do not match its "
                f"receives from itself [{_list(recvs)}] in this group"]

    def _missing(self, kind: str, p: int, count: Any, dtype: Any, k: int) -> str:
        me = self.rank
        other = "recv" if kind == "send" else "send"
        posted = []
        for what in ("send", "recv"):      # what the peer posted on the pair's channels
            src, dst = _chan(p, what, me)
            for j in range(k, k + 4):
                try:
                    if self.store.check([self._key(src, dst, what, j)]):
                        posted.append(_text(what, j, me, "?", "?").split(" (")[0])
                except Exception:  # noqa: BLE001 - best effort
                    break
        hint = (f"; rank {p} posted instead: {', '.join(posted)}" if posted else
                f"; rank {p} posted nothing for rank {me} (it never reached its matching "
                f"{other}, or skipped it)")
        if kind == "send" and any(x.startswith("send") for x in posted):
            hint += ("; both ranks send first outside a group, which NCCL deadlocks on: put "
                     "each send and its recv in one group (with comm.group():)")
        return (f"{self._head()}\n  - rank {me}: {_text(kind, k, p, count, dtype)} was not "
                f"met by rank {p}'s {other} #{k} within {self.timeout:g} s{hint}; nothing "
                f"of this round was given to NCCL")

    def _head(self) -> str:
        return (f"checked mode: send/recv on communicator {self.name!r} do not pair up (rank "
                f"{self.rank}); nothing of this round was given to NCCL:")

    def _get(self, key: str, timeout: float) -> bytes:
        return wait_key(self.store, key, timeout)



def _list(items: Any) -> str:
    return ", ".join(f"{c}x{d}" for c, d in items)

