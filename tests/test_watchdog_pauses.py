"""A pause is not a death (issue 36), with the real Watchdog threads over the real store and
every default (1 s beat, 0.1 s tick, 3 s silence limit, 300 s timeout): N-1 ranks in one
process (tests/watchdog_crowd.py), the last rank alone in another, SIGSTOPped and SIGCONTed.

* paused 1.5 s, 2.5 s and 6 s (twice the silence limit; ``python -m bench.scale --pauses``
  pauses 60 s) while no call is in flight: no verdict anywhere, and the job goes on;
* paused 1.5 s while every other rank waits in a call on it (timeout 300 s): no verdict;
* paused for good while every other rank waits on it: every waiting rank names it, and only
  it, silent past the silence limit (named, or following the first verdict published in the
  table); once resumed it is left alone while idle, and its next call follows that verdict:
  one cause in every rank's error;
* killed, with the launcher's notice: every rank names it from that notice (peer_dead, or
  following the first such verdict), waiting or not -- not from its silence.

How soon the verdicts come is a speed (``python -m bench.scale``), not asserted here: the reads
that wait for them are bounded by :data:`wait_util.HANG`, a hang's bound.

The three jobs (the pauses at 16 and 256 ranks, the kill) are independent and spend their time
waiting (pauses, silences), not on the CPU: they run at once, each on a thread of its own
(:func:`jobs`), and each test checks its own.
"""
from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterator, List

import pytest

from ncclpy.debug.deaths import publish_deaths
from ncclpy.store import StoreLimits, StoreServer, TCPStore
from store_util import env as _env
from wait_util import HANG

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("watchdog_pauses")]

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 3.0                    # the default silence limit
LONG = 6.0                     # an idle pause past twice the limit


class Job:
    """The store, the crowd (ranks 0 .. N-2) and the victim (rank N-1)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.srv = StoreServer("127.0.0.1", 0, limits=StoreLimits.for_world(world)).start()
        self.crowd = self._spawn(0, world - 1)
        self.victim = self._spawn(world - 1, world)
        self.lines: Dict[Any, List[Dict[str, Any]]] = {self.crowd: [], self.victim: []}
        self.sel = selectors.DefaultSelector()
        self.buf: Dict[Any, bytes] = {self.crowd: b"", self.victim: b""}
        for p in (self.crowd, self.victim):
            assert p.stdout.readline() == b"up\n"
            self.sel.register(p.stdout.fileno(), selectors.EVENT_READ, p)

    def _spawn(self, first: int, last: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.join(HERE, "watchdog_crowd.py"),
                                 str(self.srv.port), str(self.world), str(first), str(last)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0, env=_env())

    def read(self, seconds: float, until: Any = None) -> None:
        """Collect verdict lines for ``seconds`` (or until ``until()`` is true)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and until()):
            for key, _ in self.sel.select(max(0.0, min(0.1, end - time.monotonic()))):
                p = key.data                     # unbuffered: select sees every byte
                data = os.read(key.fd, 1 << 16)
                if not data:
                    self.sel.unregister(key.fd)
                    continue
                *done, self.buf[p] = (self.buf[p] + data).split(b"\n")
                self.lines[p].extend(json.loads(line) for line in done if line)

    def verdicts(self) -> List[Dict[str, Any]]:
        return self.lines[self.crowd] + self.lines[self.victim]

    def tell(self, cmd: str, who: Any = None) -> None:
        p = who or self.crowd
        p.stdin.write(cmd.encode() + b"\n")
        p.stdin.flush()

    def pause(self, seconds: float) -> None:
        self.victim.send_signal(signal.SIGSTOP)
        self.read(seconds)
        self.victim.send_signal(signal.SIGCONT)

    def close(self) -> None:
        for p in (self.crowd, self.victim):
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(30)
        self.sel.close()
        self.srv.close()


def _pauses(world: int) -> Dict[str, Any]:
    """Pauses while nothing waits (no verdict), a short one while a call waits (none), then for
    good while a call waits; what every rank said after that."""
    job = Job(world)
    try:
        job.read(1.5)                                  # heartbeats flow
        for gap in (1.5, 2.5, LONG):                   # nothing waits on it
            job.pause(gap)
            job.read(1.5)
            assert job.verdicts() == [], (gap, job.verdicts()[:2])
        job.tell("wait")                               # every crowd rank waits on a call
        job.read(0.5)
        job.pause(1.5)                                 # a short pause: the call just waits
        job.read(1.0)
        job.tell("done")
        assert job.verdicts() == [], job.verdicts()[:2]
        job.read(1.0)
        job.tell("wait")
        job.read(0.5)
        job.victim.send_signal(signal.SIGSTOP)         # for good, while they wait on it
        job.read(HANG, lambda: len(job.lines[job.crowd]) >= world - 1)
        crowd = job.lines[job.crowd]
        job.victim.send_signal(signal.SIGCONT)
        job.read(2.0)
        idle = list(job.lines[job.victim])              # idle: its communicator left alone
        job.tell("wait", job.victim)                     # its next call follows at once
        job.read(HANG, lambda: job.lines[job.victim])
    finally:
        job.close()
    return {"crowd": crowd, "idle": idle, "victim": job.lines[job.victim]}


def _killed() -> List[Dict[str, Any]]:
    """Rank 15 of 16 killed, the launcher's notice published: what the others said."""
    job = Job(16)
    try:
        job.read(1.5)
        job.victim.kill()
        job.victim.wait(10)
        with TCPStore("127.0.0.1", job.srv.port, timeout=5) as s:   # what ncclpy run does
            publish_deaths(s, [15], "was killed by signal SIGKILL")
        job.read(HANG, lambda: len(job.lines[job.crowd]) >= 15)
    finally:
        job.close()
    return job.lines[job.crowd]


@pytest.fixture(scope="module")
def jobs() -> Iterator[Dict[Any, Future]]:
    """This file's three jobs, started together (see the module docstring); each test waits
    for its own, whose assertion errors it raises."""
    with ThreadPoolExecutor(3) as pool:
        yield {16: pool.submit(_pauses, 16), 256: pool.submit(_pauses, 256),
               "killed": pool.submit(_killed)}


@pytest.mark.parametrize("world", [16, 256])
def test_a_paused_rank_comes_back_to_a_working_job_unless_a_call_waits_on_it(world, jobs):
    victim = world - 1
    got = jobs[world].result()
    crowd, idle = got["crowd"], got["idle"]
    assert sorted(v["rank"] for v in crowd) == list(range(world - 1)), len(crowd)
    for v in crowd:
        assert v["suspects"] == [victim], v
        assert v["reason"] in ("peer_silent", "peer_aborted"), v
        m = re.search(rf"rank {victim} silent (\d+\.\d) s", v["message"])
        assert m and float(m.group(1)) >= LIMIT, v          # silent past the limit, not before
    named = [v for v in crowd if v["reason"] == "peer_silent"]
    assert named and all("read afresh from the store" in v["message"] for v in named)
    assert idle == []
    (back,) = got["victim"]                             # the victim follows, naming itself
    assert back["reason"] == "peer_aborted" and back["suspects"] == [victim], back


def test_a_killed_rank_is_named_by_every_rank_from_the_launchers_notice(jobs):
    crowd = jobs["killed"].result()
    assert sorted(v["rank"] for v in crowd) == list(range(15))
    assert all(v["suspects"] == [15] for v in crowd), crowd[:2]
    # from the notice (peer_dead, or following the first such verdict): never its silence
    assert sum(v["reason"] == "peer_dead" for v in crowd) >= 1
    assert all(v["reason"] in ("peer_dead", "peer_aborted") for v in crowd)
