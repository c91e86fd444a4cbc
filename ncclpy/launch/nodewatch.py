"""Multi-node fail-fast for ``ncclpy run --nnodes K``: the launchers watch each other.

Node 0's launcher hosts the job's store; every node's launcher beats in the store's heartbeat
table ``ncclpy/nodes`` (:mod:`ncclpy.debug.heartbeat`: one request per node per ``interval``,
linear in nodes) and learns from each reply:

* a node whose beat is older than ``dead_after`` on the store's clock, in a reply that came on
  time -- its launcher was killed or its host is unreachable: this node marks that node's ranks
  dead (:mod:`ncclpy.debug.deaths`, for the ranks' watchdogs) and stops its own;
* the node epoch ``ncclpy/node/epoch`` moved -- a node announced ``failed: <what>`` (its
  launcher saw one of its ranks fail): this node reads the table (one request) and stops its
  ranks; a node that closed its entry with ``done`` is no longer watched.

A late reply is logged as "store slow" and judges nobody; a lost connection is re-dialled, and
never ends node 0's watch (the store is in its own process).  Another node's watch ends only when
the store is gone after node 0 said ``done``; before that, a store that refuses connections for
``dead_after`` seconds (node 0's launcher process is gone: its kernel refuses) or cannot be
reached at all for :data:`UNREACHABLE_AFTER` seconds (node 0's host froze or vanished; a store
that is merely slow still answers within that) is node 0's failure: its launcher hosts the store.
A node never seen (not started yet, a wrong token) is never declared dead.
:attr:`NodeWatch.failure` then holds one line naming the node and its ranks.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from ..debug.deaths import publish_deaths
from ..debug.heartbeat import Heart
from ..store import tablewire as W

__all__ = ["NodeWatch", "GROUP", "EPOCH_KEY", "DEFAULT_INTERVAL", "DEFAULT_DEAD_AFTER",
           "UNREACHABLE_AFTER"]

log = logging.getLogger(__name__)

GROUP = "ncclpy/nodes"
EPOCH_KEY = "ncclpy/node/epoch"
DEFAULT_INTERVAL = 0.5
DEFAULT_DEAD_AFTER = 4.0
#: seconds without any answer from node 0's store (timeouts, not refusals) before node 0 is
#: declared lost
UNREACHABLE_AFTER = 20.0


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
        self._heart: Optional[Heart] = None
        self._ever_connected = False
        self._lost_at: Optional[float] = None     # when the store stopped answering
        self._refused_since: Optional[float] = None   # ... and since when it refuses
        self._epoch = 0
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                         name=f"ncclpy-run-nodewatch-{node}")

    def start(self, first_beat: float = 10.0) -> "NodeWatch":
        """Beat once before returning (waiting up to ``first_beat`` s for the store), so a node
        whose ranks run has been seen: a node never seen is never declared dead.  Then watch
        from a thread."""
        from ..errors import StoreError
        try:
            self._open(first_beat)
            assert self._heart is not None
            self._heart.beat(b"beat")
        except (StoreError, OSError) as e:
            log.debug("ncclpy run: node %d's first beat failed (%s); the watch retries",
                      self.node, e)
            self._drop()
        self._thread.start()
        return self

    def _connect(self, budget: float = 2.0) -> Any:
        from ..store import TCPStore
        return TCPStore(self.host, self.port, token=self.token or None, timeout=1.0,
                        connect_timeout=budget)

    def _open(self, budget: float = 2.0) -> None:
        self._store = self._connect(budget)
        self._heart = Heart(self._store, GROUP, self.node, self.nnodes,
                            stale_after=self.dead_after, on_time=max(self.interval, 1.0),
                            call_timeout=1.0, watch=EPOCH_KEY,
                            what=f"ncclpy run: node {self.node}'s watch")
        self._ever_connected = True

    def _run(self) -> None:
        from ..errors import StoreError
        while not self._stop.wait(self.interval) and self.failure is None:
            now = time.monotonic()
            try:
                if self._store is None:
                    self._open()
                self._tick(now)
                self._lost_at = self._refused_since = None
            except (StoreError, OSError) as e:
                self._drop()
                if self._lost(now, e):
                    return
            except Exception:   # never let the watch take the launcher down
                log.debug("ncclpy run: node watch error", exc_info=True)

    def _lost(self, now: float, e: BaseException) -> bool:
        """The store did not answer: True when the watch ends (node 0 said done)."""
        if self.node == 0:                   # its own launcher's store: slow, never gone
            log.warning("ncclpy run: node 0's watch could not reach its own store (%s); "
                        "retrying", e)
            return False
        if not self._ever_connected:
            return False                     # node 0 not up yet: no verdict
        if 0 in self._done:
            log.debug("ncclpy run: node %d: the job's store is gone after node 0 finished (%s); "
                      "the node watch ends", self.node, e)
            return True
        refused = isinstance(e.__cause__ or e, ConnectionRefusedError) or \
            "Connection refused" in str(e)
        if self._lost_at is None:
            self._lost_at = now
            log.warning("ncclpy run: node %d cannot reach the job's store at %s:%d (%s); "
                        "retrying", self.node, self.host, self.port, e)
        if not refused:
            self._refused_since = None
        elif self._refused_since is None:
            self._refused_since = now
        gone = self._refused_since is not None and now - self._refused_since >= self.dead_after
        if gone or now - self._lost_at >= UNREACHABLE_AFTER:
            self.failure = (f"{node_ranks(0, self.nproc)}, whose launcher hosts the job's store "
                            f"at {self.host}:{self.port}, has not answered for "
                            f"{now - self._lost_at:.1f} s ("
                            + ("it refuses connections: its launcher is gone)" if gone else
                               "its host is unreachable or frozen)"))
        return False

    def _tick(self, now: float) -> None:
        heart = self._heart
        assert heart is not None
        rep = heart.beat(b"beat")
        if rep is None:
            return                           # late: store slow (logged), nobody judged
        if rep.epoch != self._epoch:
            self._epoch = rep.epoch
            full = heart.full()
            if full is None or full.full is None:
                self._epoch = -1             # read the table again next time
            else:
                for j, (_, closed, value) in enumerate(full.full):
                    text = value.decode(errors="replace")
                    if j == self.node:
                        continue
                    if closed and text == "done":
                        self._done.add(j)
                    elif text.startswith("failed: "):
                        self._fail(f"{node_ranks(j, self.nproc)} failed: {text[8:]}", None)
                        return
        for j, age in rep.stale:
            if j != self.node and j not in self._done:
                self._fail(f"{node_ranks(j, self.nproc)} stopped heartbeating {age:.1f} s ago "
                           f"(its launcher was killed or its host is unreachable)", j)
                return

    def _fail(self, why: str, dead_node: Optional[int]) -> None:
        if dead_node is not None and self._store is not None:   # tell the ranks' watchdogs
            try:
                publish_deaths(self._store, range(dead_node * self.nproc,
                                                  (dead_node + 1) * self.nproc),
                               f"was lost with {node_ranks(dead_node, self.nproc)}")
            except Exception as e:
                log.debug("ncclpy run: could not publish node %d's ranks as dead: %s",
                          dead_node, e)
        self.failure = why

    def _drop(self) -> None:
        store, self._store, self._heart = self._store, None, None
        if store is not None:
            try:
                store.close()
            except Exception:
                pass

    def _publish(self, text: str, close: bool) -> bool:
        """Set this node's entry (``close``: and leave the table) and bump the node epoch."""
        try:
            store = self._connect()
            try:
                store.beat(GROUP, self.node, self.nnodes, self.dead_after, text.encode(),
                           flags=W.BEAT_CLOSE if close else 0, timeout=1.0)
                store.add(EPOCH_KEY, 1)
            finally:
                store.close()
            return True
        except Exception as e:
            log.debug("ncclpy run: could not publish node %d's %r: %s", self.node, text, e)
            return False

    def announce(self, what: str) -> None:
        """Before this node stops its ranks after a failure: publish ``failed: <what>`` for the
        other nodes; node 0 (whose launcher hosts the store) then gives them ``2.5 *
        interval`` to read it before it stops."""
        self._announced = what
        if self._publish(f"failed: {what}", close=False) and self.node == 0:
            time.sleep(2.5 * self.interval)

    def finish(self, outcome: Optional[str]) -> None:
        """Stop the thread and tell the other nodes: ``outcome`` None = "done" (closing this
        node's entry), else ``failed: <outcome>`` (best effort, about a second at most)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._drop()
        if self.failure is not None and outcome is None:
            outcome = self.failure
        if outcome is not None and outcome == self._announced:
            return
        done = self._publish("done" if outcome is None else f"failed: {outcome}",
                             close=outcome is None)
        if done and self.node == 0 and outcome is None:
            time.sleep(2.5 * self.interval)   # the others read "done" before the store goes
