"""``ncclpy run``'s supervisor (ncclpy.launch.launcher._supervise), driven directly with real
tiny rank processes (``sh -c 'exit 3'``, a 300 s sleeper that must be stopped, ranks that
ignore SIGTERM): fail-fast, the job's exit code and its one summary line, signals forwarded
once (the first event decides), --timeout, --keep-going, another node's failure, a closed
output pipe, and who is told (the death notice, the node watch, the forensics).

Each test waits for the events themselves; :data:`HANG` only bounds a hang.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ncclpy.cli_util import EXIT_CLOSED_PIPE  # noqa: E402
from ncclpy.launch.launcher import (EXIT_TIMEOUT, _how, _signal_group, _Sink,  # noqa: E402
                                    _supervise)

#: a bound on a hang, never an expected duration
HANG = 30.0
SLEEPER = ["sleep", "300"]


def _exit(code: int) -> List[str]:
    return ["sh", "-c", f"exit {code}"]


KILLED = ["sh", "-c", "kill -9 $$"]


def _dispositions(ignore_term: bool):
    def fn() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else signal.SIG_DFL)
    return fn


def start(*cmds: List[str], deaf: tuple = ()) -> List[subprocess.Popen]:
    """One rank per command, as the launcher starts them (own session, piped output);
    the ranks in ``deaf`` ignore SIGTERM."""
    return [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True,
                             preexec_fn=_dispositions(i in deaf)) for i, c in enumerate(cmds)]


class Told:
    """Records what the supervisor tells: the death notice, the node watch, the forensics."""

    def __init__(self, failure: Optional[str] = None, on_signal: Any = None) -> None:
        self.notified: list = []
        self.announced: list = []
        self.collected: list = []
        self.looks: list = []
        self.failure = failure
        self._on_signal = on_signal

    def notify(self, rank: int, rc: int) -> bool:
        self.notified.append((rank, rc))
        return True

    def announce(self, text: str) -> None:
        self.announced.append(text)

    def collect(self, why: str, pids: dict) -> None:
        self.collected.append((why, dict(pids)))

    def on_signal(self, pids: dict) -> None:
        self.looks.append(dict(pids))
        if self._on_signal is not None:
            self._on_signal()


class Job:
    def __init__(self, rc, out, err, outcome, procs):
        self.rc, self.out, self.err, self.outcome, self.procs = rc, out, err, outcome, procs

    @property
    def codes(self) -> list:
        return [p.returncode for p in self.procs]


def supervise(procs, ranks=None, *, grace=5.0, pending=None, out_stream=None, **kw) -> Job:
    """Run ``_supervise`` on ``procs``, bounded by :data:`HANG` (a hang kills every rank and
    fails); only the keywords given are passed (the defaults are part of the contract)."""
    ranks = list(range(len(procs))) if ranks is None else ranks
    out, err = _Sink(out_stream if out_stream is not None else io.BytesIO()), _Sink(io.BytesIO())
    outcome: list = []
    res: dict = {}

    def body() -> None:
        try:
            res["rc"] = _supervise(procs, ranks, out, err, kw.pop("prefix", True), grace,
                                   [] if pending is None else pending, outcome=outcome, **kw)
        except BaseException as e:           # the mutant's error, re-raised in the test
            res["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(HANG)
    if t.is_alive():
        for p in procs:
            _signal_group(p, signal.SIGKILL)
        t.join(HANG)
        pytest.fail(f"_supervise did not return within {HANG} s")
    if "error" in res:
        raise res["error"]
    for p in procs:
        p.wait(HANG)
    text = out.stream.getvalue() if isinstance(out.stream, io.BytesIO) else b""
    return Job(res["rc"], text, err.stream.getvalue().decode(), outcome, procs)


def _gone(pid: int) -> bool:
    """The process ``pid`` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pid: int) -> bool:
    end = time.monotonic() + HANG
    while not _gone(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


# -- _how and _signal_group ---------------------------------------------------------------------
def test_how_a_rank_ended():
    assert _how(3) == "exited with code 3"
    assert _how(0) == "exited with code 0"
    assert _how(1) == "exited with code 1"
    assert _how(-9) == "was killed by signal SIGKILL"
    assert _how(-15) == "was killed by signal SIGTERM"


def test_signal_group_reaches_the_rank_and_what_it_started_also_after_it_exited():
    p = start(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!; exit 0"])[0]
    child = int(p.stdout.readline())
    try:
        assert p.wait(HANG) == 0
        _signal_group(p, signal.SIGKILL)                 # the rank is gone, its group is not
        assert _wait_gone(child), "the rank's child outlived the signal to its group"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
        p.stdout.close()
        p.stderr.close()


def test_signal_group_falls_back_to_the_rank_alone():
    p = subprocess.Popen(SLEEPER, preexec_fn=_dispositions(False))   # no group of its own
    try:
        _signal_group(p, signal.SIGTERM)
        assert p.wait(HANG) == -signal.SIGTERM
        _signal_group(p, signal.SIGTERM)                 # reaped: nothing, no error
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# -- the ranks end on their own -----------------------------------------------------------------
def test_every_rank_exits_0_the_job_exits_0_and_says_nothing():
    told = Told()
    j = supervise(start(["sh", "-c", "echo hi; echo oops >&2"], ["sh", "-c", "echo there"]),
                  [4, 5], notify=told.notify, watch=told, forensics=told)
    assert j.rc == 0 and j.err == "[rank 4] oops\n" and j.outcome == []
    assert sorted(j.out.splitlines()) == [b"[rank 4] hi", b"[rank 5] there"]
    assert (told.notified, told.announced, told.collected) == ([], [], [])
    j = supervise(start(["sh", "-c", "echo raw"]), prefix=False)
    assert (j.rc, j.out) == (0, b"raw\n")


class _SlowStream:
    """A reader that takes its time (a slow terminal): the ranks exit before it has it all."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, b: bytes) -> None:
        time.sleep(0.05)
        self.data += b

    def flush(self) -> None:
        pass


def test_every_line_a_rank_wrote_is_out_when_the_job_ends():
    slow = _SlowStream()
    lines = "".join(f"echo line{k}; " for k in range(8))
    j = supervise(start(["sh", "-c", lines + "exit 0"]), out_stream=slow, prefix=False)
    assert j.rc == 0
    assert slow.data == b"".join(f"line{k}\n".encode() for k in range(8))


# -- fail-fast ----------------------------------------------------------------------------------
def test_a_failed_rank_stops_the_others_and_its_code_is_the_jobs():
    told = Told()
    procs = start(SLEEPER, _exit(3), SLEEPER)
    pids = {0: procs[0].pid, 2: procs[2].pid}
    j = supervise(procs, notify=told.notify, watch=told, forensics=told)
    assert j.rc == 3
    assert j.codes == [-signal.SIGTERM, 3, -signal.SIGTERM]     # SIGTERM, not yet SIGKILL
    assert j.err == "ncclpy run: rank 1 exited with code 3; stopped the other 2 ranks\n"
    assert j.outcome == ["rank 1 exited with code 3"]
    assert told.notified == [(1, 3)]
    assert told.announced == ["rank 1 exited with code 3"]
    assert told.collected == [("rank 1 exited with code 3", pids)]


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace():
    j = supervise(start(SLEEPER, _exit(4), deaf=(0,)), [6, 7], grace=0.3)
    assert (j.rc, j.codes) == (4, [-signal.SIGKILL, 4])
    assert j.err == ("ncclpy run: rank 7 exited with code 4; stopped the other 1 rank "
                     "(1 with SIGKILL after 0.3 s)\n")


def test_a_rank_killed_by_a_signal_exits_128_plus_it():
    j = supervise(start(SLEEPER, KILLED))
    assert (j.rc, j.codes) == (128 + 9, [-signal.SIGTERM, -signal.SIGKILL])
    assert j.err == "ncclpy run: rank 1 was killed by signal SIGKILL; stopped the other 1 rank\n"
    assert j.outcome == ["rank 1 was killed by signal SIGKILL"]


def test_the_only_rank_failing_tells_nobody():
    told = Told()
    j = supervise(start(_exit(9)), notify=told.notify, watch=told, forensics=told)
    assert j.rc == 9
    assert j.err == "ncclpy run: rank 0 exited with code 9; no other rank was running\n"
    assert (told.notified, told.announced, told.collected) == ([], [], [])
    j = supervise(start(_exit(9)), unstarted=2)
    assert j.err == ("ncclpy run: rank 0 exited with code 9; no other rank was running; 2 ranks "
                     "were never started (the failure came during start-up)\n")
    j = supervise(start(_exit(1)), unstarted=1)
    assert j.rc == 1 and j.err.endswith("; 1 rank was never started (the failure came during "
                                         "start-up)\n")


# -- signals ------------------------------------------------------------------------------------
def test_a_signal_is_forwarded_once_and_decides_the_exit_code():
    told = Told()
    pending = [signal.SIGTERM, signal.SIGINT]           # the first one decides
    j = supervise(start(SLEEPER, SLEEPER), [2, 3], pending=pending, notify=told.notify,
                  watch=told, forensics=told)
    assert j.rc == 128 + signal.SIGTERM
    assert j.err == ("ncclpy run: received SIGTERM; forwarded it to 2 ranks (exit: rank 2 "
                     "SIGTERM, rank 3 SIGTERM)\n")
    assert j.outcome == ["its launcher received SIGTERM"]
    # the ranks it stopped are no failure of their own: nobody is told of a death
    assert (told.notified, told.announced, told.collected) == ([], [], [])


def test_ranks_ignoring_a_forwarded_signal_are_killed_after_the_grace():
    j = supervise(start(SLEEPER, ["sh", "-c", "exit 0"], deaf=(0,)),
                  pending=[signal.SIGTERM], grace=0.3)
    assert j.rc == 128 + signal.SIGTERM and j.codes[0] == -signal.SIGKILL
    assert j.err.startswith("ncclpy run: received SIGTERM; forwarded it to 2 ranks, killed 1 "
                            "still running after 0.3 s (exit: rank 0 SIGKILL, rank 1 ")


def test_sigusr1_is_a_look_inside_and_the_job_goes_on(tmp_path):
    go = tmp_path / "go"
    told = Told(on_signal=go.touch)
    wait_go = ["sh", "-c", f"n=0; while [ ! -e {go} ]; do n=$((n+1)); "
                           f"[ $n -gt 400 ] && exit 5; sleep 0.05; done; exit 0"]
    procs = start(wait_go, wait_go)
    pids = {10: procs[0].pid, 11: procs[1].pid}
    j = supervise(procs, [10, 11], pending=[signal.SIGUSR1], forensics=told)
    assert (j.rc, j.codes) == (0, [0, 0])               # not forwarded: not killed by it
    assert told.looks == [pids]


def test_signals_received_before_a_failure_is_seen_decide():
    told = Told()
    procs = start(_exit(3), SLEEPER)
    procs[0].wait(HANG)                                  # failed already, not yet seen
    pids = {0: procs[0].pid, 1: procs[1].pid}
    j = supervise(procs, pending=[signal.SIGUSR1, signal.SIGTERM], notify=told.notify,
                  forensics=told)
    assert j.rc == 128 + signal.SIGTERM
    assert told.looks == [pids] and told.notified == []


# -- --timeout ----------------------------------------------------------------------------------
def test_the_timeout_stops_the_ranks_still_running_and_exits_124():
    told = Told()
    procs = start(["true"], SLEEPER)
    procs[0].wait(HANG)
    j = supervise(procs, [0, 1], timeout=1.5, forensics=told)
    assert (j.rc, j.codes) == (EXIT_TIMEOUT, [0, -signal.SIGTERM])
    assert j.err == ("ncclpy run: --timeout 1.5 s passed with rank 1 still running; stopped it;"
                     " exit code 124\n")
    assert told.collected == [("--timeout 1.5 s passed", {1: procs[1].pid})]


def test_the_timeout_kills_ranks_ignoring_sigterm_after_the_grace():
    j = supervise(start(SLEEPER, SLEEPER, deaf=(1,)), [3, 4], timeout=0.5, grace=0.3)
    assert (j.rc, j.codes) == (EXIT_TIMEOUT, [-signal.SIGTERM, -signal.SIGKILL])
    assert j.err == ("ncclpy run: --timeout 0.5 s passed with ranks 3, 4 still running; stopped "
                     "them (1 with SIGKILL after 0.3 s); exit code 124\n")


# -- --keep-going -------------------------------------------------------------------------------
def test_keep_going_lets_the_others_finish_and_exits_with_the_first_failure(tmp_path):
    go = tmp_path / "go"
    told = Told()

    def notify(rank: int, rc: int) -> bool:
        told.notify(rank, rc)
        go.touch()                                      # the survivor ends once told
        return True
    wait_go = ["sh", "-c", f"n=0; while [ ! -e {go} ]; do n=$((n+1)); "
                           f"[ $n -gt 400 ] && exit 5; sleep 0.05; done; exit 0"]
    procs = start(_exit(0), _exit(3), wait_go)
    procs[0].wait(HANG)
    j = supervise(procs, notify=notify, watch=told, forensics=told, keep_going=True)
    assert (j.rc, j.codes) == (3, [0, 3, 0])
    assert told.notified == [(1, 3)] and (told.announced, told.collected) == ([], [])
    assert j.err == ("ncclpy run: 1 rank failed; --keep-going: the others ran to their end "
                     "(rank 0 exit 0, rank 1 exited with code 3, rank 2 exit 0); exit code of "
                     "the first failure\n")
    assert j.outcome == []


def test_keep_going_a_signal_death_is_128_plus_it_and_the_last_rank_tells_nobody():
    told = Told()
    j = supervise(start(KILLED), notify=told.notify, keep_going=True)
    assert j.rc == 128 + 9 and told.notified == []
    assert j.err == ("ncclpy run: 1 rank failed; --keep-going: the others ran to their end "
                     "(rank 0 was killed by signal SIGKILL); exit code of the first failure\n")


# -- another node, a closed pipe ----------------------------------------------------------------
def test_another_nodes_failure_stops_this_nodes_ranks_and_exits_1():
    told = Told(failure="node 1 failed: rank 5 exited with code 3")
    j = supervise(start(SLEEPER, SLEEPER, deaf=(1,)), [0, 1], watch=told, grace=0.3)
    assert (j.rc, j.codes) == (1, [-signal.SIGTERM, -signal.SIGKILL])
    assert told.announced == ["node 1 failed: rank 5 exited with code 3"]
    assert j.err == ("ncclpy run: node 1 failed: rank 5 exited with code 3; stopped this node's 2"
                     " running ranks (1 with SIGKILL after 0.3 s); exit code 1\n")
    j = supervise(start(SLEEPER), [0], watch=Told(failure="node 2 stopped answering"))
    assert j.err == ("ncclpy run: node 2 stopped answering; stopped this node's 1 running rank; "
                     "exit code 1\n")


class _ClosedPipe:
    def write(self, b: bytes) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


def test_a_closed_output_pipe_stops_the_job_quietly():
    told = Told()
    j = supervise(start(["sh", "-c", "echo hi; exec sleep 300"], SLEEPER),
                  out_stream=_ClosedPipe(), notify=told.notify, watch=told, forensics=told)
    assert (j.rc, j.codes) == (EXIT_CLOSED_PIPE, [-signal.SIGTERM, -signal.SIGTERM])
    assert j.outcome == ["its output pipe was closed"] and j.err == ""
    assert (told.notified, told.announced, told.collected) == ([], [], [])


# -- what the ranks started ---------------------------------------------------------------------
def test_a_ranks_children_go_when_it_exits_and_none_outlives_the_job(tmp_path):
    """Rank 0 exits 0 at once, leaving two children in its group: one that SIGTERM stops (gone
    while rank 1 still runs: the exit signalled the group) and one that ignores SIGTERM (gone
    when the job ends: every group gets SIGKILL)."""
    pids, ready, go = tmp_path / "pids", tmp_path / "ready", tmp_path / "go"
    rank0 = ["sh", "-c", f"sleep 300 >/dev/null 2>&1 & a=$!; "
                         f"(trap '' TERM; touch {ready}; exec sleep 300) >/dev/null 2>&1 & "
                         f"b=$!; while [ ! -e {ready} ]; do sleep 0.02; done; "
                         f"echo $a $b > {pids}.tmp; mv {pids}.tmp {pids}; exit 0"]
    rank1 = ["sh", "-c", f"n=0; while [ ! -e {go} ]; do n=$((n+1)); "
                         f"[ $n -gt 400 ] && exit 5; sleep 0.05; done; exit 0"]
    seen: list = []

    def watch() -> None:            # rank 1 ends once rank 0's first child is gone
        end = time.monotonic() + HANG
        while not pids.exists() and time.monotonic() < end:
            time.sleep(0.02)
        seen.extend(int(x) for x in pids.read_text().split())
        if _wait_gone(seen[0]):
            seen.append("first gone while the job ran")
            go.touch()
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        j = supervise(start(rank0, rank1))
        t.join(HANG)
        assert "first gone while the job ran" in seen
        assert (j.rc, j.codes) == (0, [0, 0])
        assert _wait_gone(seen[1]), "a child that ignores SIGTERM outlived the job"
    finally:
        for pid in seen[:2]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_job_that_ends_before_its_timeout_exits_0():
    j = supervise(start(_exit(0), _exit(0)), timeout=HANG)
    assert (j.rc, j.err) == (0, "")


def test_keep_going_exit_code_1_is_1(tmp_path):
    go = tmp_path / "go"
    wait_go = ["sh", "-c", f"n=0; while [ ! -e {go} ]; do n=$((n+1)); "
                           f"[ $n -gt 400 ] && exit 5; sleep 0.05; done; exit 0"]
    j = supervise(start(_exit(1), wait_go), keep_going=True,
                  notify=lambda rank, rc: go.touch() or True)
    assert (j.rc, j.codes) == (1, [1, 0])
