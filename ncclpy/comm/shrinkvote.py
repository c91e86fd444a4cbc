"""Before ``ncclCommShrink``: the survivors agree that each of them can shrink.

NCCL's child init refuses a parent whose asynchronous error is set (init.cc
``ncclCommInitChildComm`` -> ``ncclCommEnsureReady``, NCCL 2.27-2.30.7: the abort flag, then
``comm->asyncResult``, then the proxy's ``proxyState->asyncResult``; ncclInProgress becomes
ncclInvalidArgument), and that error may be the proxy's -- a peer's socket closed when it died
-- which ``ncclCommRevoke`` leaves in place.  The refused rank returns at once; the other
survivors wait inside their blocking ``ncclCommShrink`` for it, for ever (a GPU run,
2026-11-26: ``docs/gpu-runs.md``).  So each survivor publishes, through the rendezvous store,
its parent's async error and the exclude list it passes; the lowest survivor reads every vote
and publishes the verdict, which the others read (about 3N requests in all, N + 1 keys left per
shrink): any refusal, or lists that differ, fail every survivor at once with the same error; a
survivor that never comes fails the others after the timeout.

What it cannot see: an error that appears after the vote (a parent not revoked, whose proxy
still runs, shrunk with ``abort=True``; ``NCCL_SHRINK_ABORT``'s own steps), and survivors of a
communicator without a store (a bare Communicator: nothing to agree through).  A store that
cannot be reached (its host was excluded) skips the vote, with a warning: NCCL's shrink itself
needs no store.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

from .._nccl.lib import NCCL_IN_PROGRESS, NCCL_SUCCESS
from ..errors import (NCCL_RESULT_NAMES, ArgumentError, NcclTimeoutError, StoreError,
                      StoreTimeout, nccl_error_from_code)

__all__ = ["survivors_ready", "child_objects"]

log = logging.getLogger(__name__)
_INVALID_ARGUMENT = 4
_REMOTE_ERROR = 6
_IN_PROGRESS_TEXT = ("Attempt to use communicator before the previous operation returned "
                     "ncclSuccess")


def survivors_ready(comm: Any, excluded: List[int], states: tuple) -> Optional[int]:
    """Raise on every survivor unless every survivor's parent is ready to shrink with the
    same exclude list (see the module docstring); the vote's number (None: no vote).
    ``states``: the lifecycle states a poll of the parent is allowed in."""
    ex = getattr(comm, "_objects", None)
    if ex is None or ex.store is None:
        return None
    life, lib, h = comm._life, comm._lib, comm._handle
    def poll() -> Tuple[int, str]:
        code = lib.async_error(h)
        return code, (lib.fresh_error_text(h) if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS)
                      else "")
    code, text = life.call("shrink", poll, states=states, timed=False, poll=True)
    if code == NCCL_IN_PROGRESS:           # ncclCommEnsureReady: 7 -> 4, with this WARN
        code, text = _INVALID_ARGUMENT, _IN_PROGRESS_TEXT
    seq = comm._shrink_votes = getattr(comm, "_shrink_votes", 0) + 1
    base = f"{ex.prefix}/shrink{seq}"
    gone = sorted(set(excluded))
    survivors = [r for r in range(comm.world_size) if r not in gone]
    leader = survivors[0]
    mine = {"code": code, "text": text, "exclude": gone}
    try:
        ex.store.set(f"{base}/{comm.rank}", json.dumps(mine).encode())   # (the leader's
        if comm.rank != leader:             # too: a survivor whose list differs reads it)
            verdict = _get(ex.store, f"{base}/verdict", comm, leader)
        else:
            verdict = _count(ex.store, base, comm, survivors, mine)
            ex.store.set(f"{base}/verdict", json.dumps(verdict).encode())
    except StoreTimeout:
        raise
    except (StoreError, OSError) as e:
        log.warning("shrink: the survivors' vote could not reach the store (%s: %s); "
                    "ncclCommShrink goes ahead without it (a survivor NCCL refuses leaves the "
                    "others waiting in theirs)", type(e).__name__, e)
        return None
    _apply(verdict, mine, leader)
    return seq


def _get(store: Any, key: str, comm: Any, who: int) -> dict:
    """``key``'s JSON value, written by rank ``who``, within the communicator's timeout."""
    try:
        value = store.get(key, timeout=comm._timeout)
    except (StoreTimeout, TimeoutError):
        raise NcclTimeoutError(8, "shrink", f"rank {who} did not reach shrink() within "
                               f"{comm._timeout:g} s (every survivor calls it with the same "
                               f"exclude list); abort this communicator (comm.abort())") from None
    try:
        return json.loads(value.decode())
    except ValueError:
        return {"code": _INVALID_ARGUMENT, "text": f"an unreadable vote {value[:40]!r}"}


def _count(store: Any, base: str, comm: Any, survivors: List[int], mine: dict) -> dict:
    """The leader (the lowest survivor): every other survivor's vote, then the verdict every
    survivor applies: {"exclude", "refused": {rank: vote}, "lists": {rank: list},
    "missing": rank or None}."""
    votes: Dict[int, dict] = {comm.rank: mine}
    deadline = time.monotonic() + comm._timeout
    missing = None
    for r in survivors:
        if r == comm.rank:
            continue
        try:
            votes[r] = json.loads(store.get(f"{base}/{r}", timeout=max(
                deadline - time.monotonic(), 0.1)).decode())
        except (StoreTimeout, TimeoutError):
            missing = r
            break
        except ValueError:
            votes[r] = {"code": _INVALID_ARGUMENT, "text": "an unreadable vote",
                        "exclude": mine["exclude"]}
    return {"exclude": mine["exclude"], "missing": missing, "timeout": comm._timeout,
            "lists": {str(r): v.get("exclude") for r, v in votes.items()},
            "refused": {str(r): v for r, v in votes.items()
                        if int(v.get("code", 0)) != NCCL_SUCCESS}}


def _apply(verdict: dict, mine: dict, leader: int) -> None:
    """Raise what the leader's verdict says (the same error on every survivor)."""
    if verdict.get("missing") is not None:
        raise NcclTimeoutError(8, "shrink", f"rank {verdict['missing']} did not reach shrink("
                               f"exclude={verdict['exclude']}) within "
                               f"{verdict.get('timeout', 0):g} s (every survivor calls it with "
                               f"the same list); abort this communicator (comm.abort())")
    lists = {int(r): x for r, x in verdict.get("lists", {}).items()}
    if verdict.get("exclude") != mine["exclude"] or any(x != mine["exclude"]
                                                          for x in lists.values()):
        lists.setdefault(leader, verdict.get("exclude"))
        raise ArgumentError("shrink: the survivors passed different exclude lists: "
                            + ", ".join(f"rank {r}: {x}" for r, x in sorted(lists.items()))
                            + "; every survivor passes the same list (e.g. err.suspects)")
    refused = {int(r): v for r, v in verdict.get("refused", {}).items()}
    if refused:
        first = int(refused[min(refused)]["code"])
        reasons = "; ".join(f"rank {r}: {_said(v)}" for r, v in sorted(refused.items()))
        why = (" (a revoke leaves a network error of NCCL's proxy in place: over the socket "
               "transport a dead peer's closed connection)"
               if any(int(v["code"]) == _REMOTE_ERROR for v in refused.values()) else "")
        raise nccl_error_from_code(
            first, "ncclCommShrink",
            f"not called: NCCL refuses to shrink a communicator whose asynchronous error is "
            f"set (ncclCommEnsureReady), on rank(s) {sorted(refused)} ({reasons}){why}, so "
            f"every survivor stops here: abort this communicator and make a new one among the "
            f"survivors (a fresh unique id)")


def child_objects(comm: Any, child: Any, seq: Optional[int]) -> None:
    """Give a shrink's child the parent's store for its objects and its own shrinks (a
    second failure is voted on too), under a prefix of its own."""
    ex = getattr(comm, "_objects", None)
    if ex is None or ex.store is None or seq is None or getattr(child, "_objects", None):
        return
    from .objects import ObjectExchange
    child._objects = ObjectExchange(ex.store, child.rank, child.world_size,
                                    f"{ex.prefix}/child{seq}", child._timeout)


def _said(v: dict) -> str:
    code = int(v.get("code", 0))
    name = NCCL_RESULT_NAMES.get(code, f"ncclResult {code}")
    text = v.get("text") or ""
    return f"{name} ({code})" + (f": {text}" if text else "")
