"""STAND-IN for libnccl and CUDA across the processes of one job: CPU tests of ncclpy's own
logic only (the flight recorder, dumps, ``ncclpy trace``, ``ncclpy status``, the launcher's
forensics), on ncclpy's real call path up to the NCCL launch.

Each process runs the in-process stand-in (tests/nccl_standin.py) for its one rank; what
crosses processes is only *when* an NCCL operation may complete: a collective once every rank
of the communicator issued it, a send/recv once both sides did -- counted through the job's
real store (one ``add`` per operation and rank, then polls).  No data moves between processes:
results are not checked here (tests/test_call_path.py checks them on thread-ranks, tests/gpu on
a GPU).  It never makes a GPU test pass.

As NCCL does, the first send/recv between two ranks connects the pair on the host, inside the
launch: the call blocks until the peer posted its side (or the communicator is aborted, then
it fails) -- what a real GPU run of a send without its recv showed (docs/gpu-runs.md).
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any, Iterator, List, Tuple

import nccl_standin as S
from ncclpy._nccl import cuda as _cuda
from ncclpy._nccl import lib as _lib

__all__ = ["ProcStandIn", "proc_standin"]


class ProcStandIn(S.StandIn):
    """The engine of one rank-process; ``store``: a client of the job's store."""

    def __init__(self, store: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.store = store
        self.announced: set = set()
        self.nccl._wait_world = lambda c, timeout=30.0: S.SUCCESS   # peers join elsewhere
        submit = self.nccl._submit

        def connect_then_submit(ops: List[Any]) -> int:
            for c, _stream, op in ops:
                if op.kind == "p2p" and op.key[4] == 0 and not self._connect(c, op):
                    return S.INTERNAL
            return submit(ops)
        self.nccl._submit = connect_then_submit

    def _connect(self, c: Any, op: S._Op) -> bool:
        """The pair's first send/recv: post this side, wait for the peer's (False: aborted)."""
        _w, _p2p, src, dst = op.key[:4]
        base = self._key(op.key[:4] + ("connect", 2), op)
        mine = "send" if c.rank == src else "recv"
        self.store.add(f"{base}/{mine}", 1)
        other = f"{base}/{'recv' if mine == 'send' else 'send'}"
        while int(self.store.add(other, 0)) < 1:
            if c.abort_flag:
                return False
            time.sleep(0.01)
        return True

    def _key(self, key: Tuple[Any, ...], op: S._Op) -> str:
        """The operation's name across processes: the communicator (its uid), the operation's
        sequence, and what must agree for NCCL to complete it (function, dtype and count of a
        collective; the bytes of a send/recv): ranks that disagree never meet, as in a hang."""
        uid = next((u for u, w in self.worlds.items() if w.id == key[0]), b"?")
        h = hashlib.blake2b(uid, digest_size=6).hexdigest()
        a = op.args
        what = (f"{a['fn']}/{a['dtype']}/{a['count']}" if op.kind == "coll"
                else f"{a['nbytes']}B")
        return "standin/" + h + "/" + "/".join(map(str, key[1:])) + "/" + what

    def ready(self, key: Tuple[Any, ...], ops: List[S._Op]) -> bool:
        k = self._key(key, ops[0])
        if k not in self.announced:
            self.announced.add(k)
            self.store.add(k, len(ops))
        return int(self.store.add(k, 0)) >= key[-1]

    def _execute(self, ops: List[S._Op]) -> None:
        return              # the other ranks' memory is in other processes: nothing moves


@contextlib.contextmanager
def proc_standin(store: Any, **kw: Any) -> Iterator[ProcStandIn]:
    """The cross-process stand-in in place of libnccl and CUDA for the block."""
    eng = ProcStandIn(store, **kw)
    with _lib.use_lib(eng.nccl), _cuda.use(eng.cuda):
        yield eng
    eng.nccl.cdll.raise_pending()
