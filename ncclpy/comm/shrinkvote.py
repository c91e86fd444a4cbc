"""Before ``ncclCommShrink``: the survivors agree that each of them can shrink.

NCCL's child init refuses a parent whose asynchronous error is set (init.cc
``ncclCommInitChildComm`` -> ``ncclCommEnsureReady``, NCCL 2.27-2.30.7), and that error may be
the proxy's -- a peer's socket closed when it died (``ncclCommGetAsyncError`` reads
``proxyState->asyncResult``) -- which ``ncclCommRevoke`` leaves in place.  The refused rank
returns at once; the other survivors wait inside their blocking ``ncclCommShrink`` for it, for
ever (a GPU run, 2026-11-26: ``docs/gpu-runs.md``).  So each survivor publishes its parent's
async error through the rendezvous store and reads the others' (N-1 reads per survivor): any
refusal fails every survivor at once with the same error naming the refused ranks and NCCL's
reason; a survivor that never comes fails the others after the timeout.  A communicator without
a store (a bare Communicator, a child) skips the vote: its survivors have nothing to agree
through.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List

from .._nccl.lib import NCCL_IN_PROGRESS, NCCL_SUCCESS
from ..errors import NCCL_RESULT_NAMES, NcclTimeoutError, StoreTimeout, nccl_error_from_code

__all__ = ["survivors_ready"]


def survivors_ready(comm: Any, excluded: List[int], states: tuple) -> None:
    """Raise on every survivor unless every survivor's parent is ready to shrink (see the
    module docstring); ``states``: the lifecycle states a poll of the parent is allowed in."""
    ex = getattr(comm, "_objects", None)
    if ex is None or ex.store is None:
        return
    life, lib, h = comm._life, comm._lib, comm._handle
    life.enter_poll("shrink", *states)
    try:
        code = lib.async_error(h)
        text = lib.fresh_error_text(h) if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS) else ""
    finally:
        life.release()
    seq = comm._shrink_votes = getattr(comm, "_shrink_votes", 0) + 1
    base = f"{ex.prefix}/shrink{seq}"
    mine = f"{code} {text}".strip() if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS) else "0"
    ex.store.set(f"{base}/{comm.rank}", mine.encode())
    gone = set(excluded)
    refused: Dict[int, str] = {} if mine == "0" else {comm.rank: mine}
    deadline = time.monotonic() + comm._timeout
    for r in range(comm.world_size):
        if r == comm.rank or r in gone:
            continue
        try:
            value = ex.store.get(f"{base}/{r}", timeout=max(deadline - time.monotonic(), 0.1))
        except (StoreTimeout, TimeoutError):
            raise NcclTimeoutError(8, "shrink", f"rank {r} did not reach shrink(exclude="
                                   f"{sorted(gone)}) within {comm._timeout:g} s (every "
                                   f"survivor calls it with the same list); abort this "
                                   f"communicator (comm.abort())") from None
        said = value.decode(errors="replace")
        if said != "0":
            refused[r] = said
    if refused:
        first = int(next(iter(sorted(refused.items())))[1].split(" ", 1)[0])
        reasons = "; ".join(f"rank {r}: {_name(v)}" for r, v in sorted(refused.items()))
        raise nccl_error_from_code(
            first, "ncclCommShrink",
            f"not called: NCCL refuses to shrink a communicator whose asynchronous error is "
            f"set (ncclCommEnsureReady), on rank(s) {sorted(refused)} ({reasons}); a revoke "
            f"leaves a network error of NCCL's proxy in place, so every survivor stops here: "
            f"abort this communicator and make a new one among the survivors (a fresh unique "
            f"id, e.g. ncclpy.init with the survivors' ranks)")


def _name(said: str) -> str:
    code, _, text = said.partition(" ")
    name = NCCL_RESULT_NAMES.get(int(code), f"ncclResult {code}") if code.isdigit() else code
    return f"{name} ({code})" + (f": {text}" if text else "")
