"""The simulated ranks of ``python -m bench.scale``: one event loop, one connection per rank,
the real wire protocol and the real decisions.

Each simulated rank does what a real watchdog thread does, with the same functions: a BEAT
every interval (its progress counter in), :func:`~ncclpy.watchdog.peers_from_beat` on each
on-time reply (ages as of the reply's arrival), a tick every 0.1 s that runs
:meth:`~ncclpy.watchdog.WatchState.step` for every rank with something to judge (a suspect, a
death, a published abort; a rank with none of these has nothing a tick could decide), a fresh
read (a PEEK) when the step asks for a confirmation, and on a verdict a BEAT_ABORT that
publishes it, after which the rank is silent.  A rank may have a call waiting (``wait``): its
Work is then the pending call the rule needs before a silence is a verdict.
"""
from __future__ import annotations

import heapq
import selectors
import socket
import time
from typing import Any, Dict, List, Optional

from ncclpy.debug.heartbeat import is_late, on_time_limit
from ncclpy.debug.verdicts import CONFIRM, Peer, Published, WatchState, peers_from_beat
from ncclpy.store import protocol as P
from ncclpy.store import tablewire as W
from ncclpy.debug.watchdog import INTERVAL, report_after

__all__ = ["Client", "Sim", "Loop", "NAME", "GROUP", "DEAD_AFTER", "REPORT", "GRACE", "TICK"]

NAME = "scale"
GROUP = f"ncclpy/{NAME}/0/hb"           # the real Watchdog's group for this name, generation 0
DEAD_AFTER = max(3.0 * INTERVAL, 3.0)   # the Watchdog's default silence limit
REPORT = report_after(DEAD_AFTER, INTERVAL)   # the age past which the store lists a peer
CONNECTING = 256                        # connections being set up at once
GRACE = 300.0                           # never-seen grace: the default communicator timeout
TICK = 0.1                              # the Watchdog's default tick
EPOCH = b"ncclpy/dead/epoch"
RANKS = b"ncclpy/dead/ranks"


class Client:
    """One connection of the event loop: greeting, then request/reply in order.  At most
    :data:`CONNECTING` are being set up at a time (8,192 simultaneous connects from one
    process overflow the listen queue; a real rank's client retries instead)."""

    def __init__(self, loop: "Loop", port: int) -> None:
        self.sock: Optional[socket.socket] = None
        self.port = port
        self.buf = bytearray()
        self.greeted = False
        self.expect: List[Any] = []       # (kind, sent at) per request in flight, in order
        self.loop = loop
        loop.connect_queue.append(self)
        loop.pump_connects()

    def open(self) -> None:
        self.sock = socket.socket()
        self.sock.setblocking(False)
        self.sock.connect_ex(("127.0.0.1", self.port))
        self.loop.connecting += 1
        self.loop.sel.register(self.sock, selectors.EVENT_READ, self)

    def send(self, op: int, body: bytes, kind: Any) -> None:
        self.expect.append((kind, time.monotonic()))
        self.sock.send(P.request(op, body))

    def readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            raise ConnectionError("the store closed a connection")
        self.buf += data
        if not self.greeted:
            if len(self.buf) < P.HELLO_SIZE:
                return
            flags = P.parse_hello(self.buf)[2]
            if flags & P.FLAG_REFUSED:
                raise ConnectionError("the store refused a client: " + bytes(
                    self.buf[P.HELLO_SIZE + 5:]).decode(errors="replace"))
            del self.buf[:P.HELLO_SIZE]
            self.greeted = True
            self.loop.connecting -= 1
            self.loop.pump_connects()
        while len(self.buf) >= 5:
            status, n = P.REP_HEADER.unpack_from(self.buf, 0)
            if len(self.buf) < 5 + n:
                return
            body = bytes(self.buf[5:5 + n])
            del self.buf[:5 + n]
            kind, t0 = self.expect.pop(0)
            self.loop.reply(self, kind, status, body, t0)


class Sim:
    """A simulated rank: its heartbeat connection and its watchdog's decisions."""

    def __init__(self, rank: int, world: int, start: float) -> None:
        self.rank, self.world, self.start = rank, world, start
        self.state = WatchState(rank, world, NAME, GRACE, DEAD_AFTER, start, never_grace=GRACE)
        self.beats = 0
        self.peers: Dict[int, Peer] = {}
        self.epoch = 0
        self.dead: List[int] = []
        self.published: Optional[Published] = None
        self.wait_since: Optional[float] = None   # a call waiting since (None: idle)
        self.decision: Optional[Any] = None
        self.decided_at = 0.0
        self.client: Optional[Client] = None
        self.busy = False                  # a request (and its follow-ups) in flight
        self.confirm_ok = True
        self.late = 0
        self.confirms = 0


class Loop:
    """The event loop driving every simulated rank and the checked-mode voters."""

    def __init__(self, port: int, world: int, sims: List[Sim]) -> None:
        self.port, self.world, self.sims = port, world, sims
        self.sel = selectors.DefaultSelector()
        self.due: List[Any] = [(s.start, s.rank, "start") for s in sims]
        heapq.heapify(self.due)
        self.rtts: List[float] = []
        self.record = False
        self.votes_left = 0
        self.vote_t0 = 0.0
        self.vote_times: List[float] = []
        self.vote_bad = 0
        self.voters: List[Client] = []
        self.connect_queue: List[Client] = []
        self.connecting = 0
        self.next_tick = 0.0
        self.ticks = 0

    def close(self) -> None:
        """Close every connection of this run (the next run needs the descriptors)."""
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
        self.connect_queue.clear()

    def pump_connects(self) -> None:
        while self.connect_queue and self.connecting < CONNECTING:
            self.connect_queue.pop(0).open()

    def wait_all(self, on: bool) -> None:
        """Every simulated rank issues a call that waits (``on``), or its call completes."""
        now = time.monotonic()
        for s in self.sims:
            s.wait_since = now if on else None

    # heartbeats
    def beat(self, s: Sim) -> None:
        if s.busy or s.client is None or not s.client.greeted or s.decision is not None:
            return                          # a real watchdog's call would still be blocked
        s.beats += 1
        body = W.pack_beat(GROUP.encode(), s.rank, self.world, REPORT,
                           f"{s.beats}:0".encode(), EPOCH, count=s.beats)
        s.busy = True
        s.client.send(P.Op.BEAT, body, ("beat", s))

    def reply(self, c: Client, kind: Any, status: int, body: bytes, t0: float) -> None:
        now = time.monotonic()
        what, s = kind
        if what == "vote":
            self._voted(body)
            return
        if status != P.Status.OK and what != "dead":
            raise RuntimeError(f"{what}: status {status}: {body[:200]!r}")
        if what in ("beat", "peek"):
            rtt = now - t0
            if self.record and what == "beat":
                self.rtts.append(rtt)
            rep = W.parse_beat(body, self.world)
            if is_late(rtt, on_time_limit(INTERVAL)):
                s.late += 1
                s.busy = False
                if what == "beat":
                    s.peers = {}
                else:
                    s.confirm_ok = False
                return
            if what == "beat":
                s.confirm_ok = True
            self._heard(s, rep, now)
            if rep.epoch != s.epoch:
                s.epoch = rep.epoch
                c.send(P.Op.GET, P.U32.pack(1000) + RANKS, ("dead", s))
                return
            s.busy = False
            self._judge(s, now, confirmed=what == "peek")
        elif what == "dead":
            if status == P.Status.OK:
                s.dead = sorted(int(x) for x in body.decode().split(",") if x.strip().isdigit())
            s.busy = False
            self._judge(s, now)
        elif what == "abort":
            pass

    def _heard(self, s: Sim, rep: Any, at: float) -> None:
        if rep.first_aborted is not None and s.published is None and \
                rep.first_aborted[0] != s.rank:
            s.published = Published.decode(rep.first_aborted[1])
        s.peers = peers_from_beat(rep, at, s.rank, at - s.start > GRACE)

    def _judge(self, s: Sim, now: float, confirmed: bool = False) -> None:
        """One step of the rank's decisions; a confirmation read, or a verdict published."""
        if s.decision is not None or s.busy:
            return
        pend = [(0, "all_reduce", s.wait_since)] if s.wait_since is not None else []
        d = s.state.step(now, pend, s.peers, s.dead, None, INTERVAL, None, s.published,
                         confirmed=confirmed)
        if d == CONFIRM:
            if not confirmed and s.confirm_ok and s.client is not None:
                s.busy = True
                s.confirms += 1
                s.client.send(P.Op.BEAT, W.pack_beat(GROUP.encode(), s.rank, self.world,
                                                     REPORT, b"", EPOCH, W.BEAT_PEEK),
                              ("peek", s))
            return
        if d is not None:
            s.decision, s.decided_at = d, now
            verdict = b"0:0\n" + s.state.published(d).encode()
            s.client.send(P.Op.BEAT, W.pack_beat(GROUP.encode(), s.rank, self.world, REPORT,
                                                 verdict, EPOCH, W.BEAT_CLOSE | W.BEAT_ABORT),
                          ("abort", s))

    def tick(self, now: float) -> None:
        """Every rank's watchdog tick: those with something to judge step."""
        self.ticks += 1
        for s in self.sims:
            if s.decision is None and not s.busy and (s.peers or s.dead or s.published):
                self._judge(s, now)

    # checked mode
    def vote_round(self, key: bytes, bodies: List[bytes]) -> None:
        self.votes_left = len(bodies)
        self.vote_t0 = time.monotonic()
        for c, body in zip(self.voters, bodies):
            c.send(P.Op.VOTE, body, ("vote", None))

    def _voted(self, body: bytes) -> None:
        if W.parse_vote(body).verdict:
            self.vote_bad += 1
        self.votes_left -= 1
        if self.votes_left == 0:
            self.vote_times.append(time.monotonic() - self.vote_t0)

    def run_until(self, end: float, stop: Any = None) -> None:
        while True:
            now = time.monotonic()
            if now >= end or (stop is not None and stop()):
                return
            while self.due and self.due[0][0] <= now:
                _, r, what = heapq.heappop(self.due)
                s = self.sims[r]
                if what == "start":
                    s.client = Client(self, self.port)
                    heapq.heappush(self.due, (now + 0.01, r, "beat"))
                else:
                    self.beat(s)
                    heapq.heappush(self.due, (now + INTERVAL, r, "beat"))
            if now >= self.next_tick:
                self.next_tick = now + TICK
                self.tick(now)
            nxt = min(self.due[0][0] if self.due else end, self.next_tick)
            wait = min(0.05, max(0.0, nxt - now))
            for key, _ in self.sel.select(wait):
                key.data.readable()
