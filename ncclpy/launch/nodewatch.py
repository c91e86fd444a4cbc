"""Multi-node fail-fast for ``ncclpy run --nnodes K``: the launchers watch each other.

Every node's launcher, once the job's ncclpy store (hosted by rank 0 on node 0) is up, sets
``ncclpy/node/<k>`` to a beat counter every ``interval`` s and reads the other nodes' keys:

* ``failed: <what>`` -- that node's launcher saw one of its ranks fail: this node stops its ranks;
* ``done`` -- that node's ranks all succeeded: it is no longer watched;
* a counter that stops moving for ``dead_after`` s (while this launcher kept reading) -- its
  launcher was killed or its host is unreachable: this node marks that node's ranks dead
  (``ncclpy/dead/<rank>``, for the ranks' watchdogs) and stops its own.

:attr:`NodeWatch.failure` then holds one line naming the node and its ranks, which the launcher
prints before stopping its ranks.  A node never seen (its launcher not started yet, a wrong
token) is never declared dead; a store that goes away (rank 0 ended) ends the watch quietly.
All store calls are bounded (connect 0.5 s, calls 1 s): the watch never holds the launcher up.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

__all__ = ["NodeWatch", "NODE_KEY", "DEFAULT_INTERVAL", "DEFAULT_DEAD_AFTER"]

log = logging.getLogger(__name__)

NODE_KEY = "ncclpy/node/{node}"
DEAD_KEY = "ncclpy/dead/{rank}"
DEFAULT_INTERVAL = 0.5
DEFAULT_DEAD_AFTER = 4.0


def node_ranks(node: int, nproc: int) -> str:
    """``"node 1 (ranks 2-3)"``."""
    lo, hi = node * nproc, node * nproc + nproc - 1
    return f"node {node} (rank{'s' if hi > lo else ''} {lo}{f'-{hi}' if hi > lo else ''})"


class NodeWatch:
    """The watch of one node's launcher (see the module docstring)."""

    def __init__(self, host: str, port: int, token: str, node: int, nnodes: int, nproc: int,
                 *, interval: float = DEFAULT_INTERVAL,
                 dead_after: float = DEFAULT_DEAD_AFTER) -> None:
        self.host, self.port, self.token = host, int(port), token
        self.node, self.nnodes, self.nproc = node, nnodes, nproc
        self.interval, self.dead_after = float(interval), float(dead_after)
        self.failure: Optional[str] = None
        self._announced: Optional[str] = None
        self._store: Any = None
        self._ever_connected = False
        self._beat = 0
        # node -> [last value, time it last changed, reads since]
        self._seen: dict[int, list[Any]] = {}
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                         name=f"ncclpy-run-nodewatch-{node}")

    def start(self) -> "NodeWatch":
        self._thread.start()
        return self

    def _connect(self) -> Any:
        from ..store import TCPStore
        return TCPStore(self.host, self.port, token=self.token or None, timeout=1.0,
                        connect_timeout=0.5)

    def _run(self) -> None:
        from ..errors import StoreError
        while not self._stop.wait(self.interval) and self.failure is None:
            try:
                if self._store is None:
                    self._store = self._connect()
                    self._ever_connected = True
                self._tick(self._store, time.monotonic())
            except (StoreError, OSError) as e:
                self._drop()
                if self._ever_connected:
                    log.debug("ncclpy run: node %d lost the job's store at %s:%d (%s); the "
                              "node watch ends", self.node, self.host, self.port, e)
                    return
            except Exception:   # never let the watch take the launcher down
                log.debug("ncclpy run: node watch error", exc_info=True)

    def _tick(self, store: Any, now: float) -> None:
        self._beat += 1
        store.set(NODE_KEY.format(node=self.node), f"beat {self._beat}")
        for j in range(self.nnodes):
            if j == self.node or j in self._done:
                continue
            key = NODE_KEY.format(node=j)
            if not store.check([key]):
                continue
            val = store.get(key, timeout=1.0).decode(errors="replace")
            if val == "done":
                self._done.add(j)
            elif val.startswith("failed: "):
                self._fail(store, f"{node_ranks(j, self.nproc)} failed: {val[8:]}", None)
            else:
                seen = self._seen.get(j)
                if seen is None or seen[0] != val:
                    self._seen[j] = [val, now, 0]
                    continue
                seen[2] += 1
                # silent for dead_after while this watch kept reading (not a stalled store)
                if now - seen[1] >= self.dead_after and seen[2] >= self.dead_after / \
                        self.interval / 2:
                    self._fail(store, f"{node_ranks(j, self.nproc)} stopped heartbeating "
                               f"{now - seen[1]:.1f} s ago (its launcher was killed or its host "
                               f"is unreachable)", j)
            if self.failure is not None:
                return

    def _fail(self, store: Any, why: str, dead_node: Optional[int]) -> None:
        if dead_node is not None:   # tell the ranks' watchdogs which peers are gone
            for r in range(dead_node * self.nproc, (dead_node + 1) * self.nproc):
                try:
                    store.set(DEAD_KEY.format(rank=r),
                              f"was lost with {node_ranks(dead_node, self.nproc)}")
                except Exception:
                    break
        self.failure = why

    def _drop(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:
                pass

    def announce(self, what: str) -> None:
        """Before this node stops its ranks after a failure: set ``failed: <what>`` for the other
        nodes, and on node 0 (whose rank 0 hosts the store) give them ``2.5 * interval`` to read
        it before the store goes away with rank 0."""
        self._announced = what
        try:
            store = self._connect()
            try:
                store.set(NODE_KEY.format(node=self.node), f"failed: {what}")
            finally:
                store.close()
        except Exception as e:
            log.debug("ncclpy run: could not announce node %d's failure: %s", self.node, e)
            return
        if self.node == 0:
            time.sleep(2.5 * self.interval)

    def finish(self, outcome: Optional[str]) -> None:
        """Stop the thread and tell the other nodes: ``outcome`` None = "done", else
        ``failed: <outcome>`` (best effort, about a second at most)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self.failure is not None and outcome is None:
            outcome = self.failure
        if outcome is not None and outcome == self._announced:
            self._drop()
            return
        try:
            store = self._store or (self._connect() if not self._ever_connected else None)
            if store is not None:
                store.set(NODE_KEY.format(node=self.node),
                          "done" if outcome is None else f"failed: {outcome}")
        except Exception as e:
            log.debug("ncclpy run: could not publish node %d's end: %s", self.node, e)
        finally:
            self._drop()
