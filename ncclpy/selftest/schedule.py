"""Run the stages side by side: the GPU proof in one device call.

The stages that time nothing share the GPU and the CPU cores: they start in the order given
(most GPU debt first, :mod:`ncclpy.selftest.debt`) as long as at most ``jobs`` commands run and
their ranks (a stage's ``ranks`` per shard) fit ``capacity``; one that does not fit waits while a
smaller one behind it may start.  The ``exclusive`` stages (bench, overhead: they time things)
then run alone, one after another; their minimum times are kept back from the shared phase so
that they still start (with the grace a stopped shared stage takes).  ``info`` runs first, alone (a record needs its versions).

Each shard of a stage is a :class:`Unit`: its commands one after another in their own process
group (:mod:`ncclpy.selftest.runner`'s environment and log lines), bounded by the stage's
timeout: at the bound SIGINT (pytest still writes what finished), ``grace_s`` later SIGKILL for
what is left of the group.  Ctrl-C stops every running unit the same way and ends the run: those
stages are "interrupted", the rest "not run".
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Any, Callable, Dict, IO, List, Mapping, Optional, Sequence, Tuple

from .report import StageResult, stage_line
from .runner import GRACE_S, _child_setup, _killpg, analyse, child_env
from .stages import RESERVE_S, Cmd, Ctx, Stage, decide, shard_commands, shard_prefix

__all__ = ["run_stages", "Unit", "POLL_S"]

log = logging.getLogger(__name__)

#: seconds between two looks at the running commands
POLL_S = 0.2


class Unit:
    """One shard of a stage: its commands, run one after another, bounded by ``deadline``."""

    def __init__(self, stage: Stage, k: int, cmds: List[Cmd], ctx: Ctx, root: str,
                 deadline: float, timeout_s: float, records: List[Dict[str, Any]],
                 env: Mapping[str, Optional[str]], grace_s: float,
                 clock: Callable[[], float]) -> None:
        self.stage, self.k, self.cmds = stage, k, list(cmds)
        self.root, self.deadline, self.timeout_s = root, deadline, timeout_s
        self.records, self.grace_s, self.clock = records, grace_s, clock
        self.env: Dict[str, Optional[str]] = dict(env)
        self.log: IO[bytes] = open(os.path.join(ctx.work, f"{shard_prefix(stage, k)}.log"),
                                   "ab")
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.rec: Dict[str, Any] = {}
        self.t0 = 0.0
        self.stop_at: Optional[float] = None
        self.done = False

    def _start_next(self) -> None:
        while self.cmds:
            cmd = self.cmds.pop(0)
            left = self.deadline - self.clock()
            self.rec = {"argv": list(cmd.argv), "shell": cmd.shell(), "rc": None,
                        "seconds": 0.0, "timed_out": False, "shard": self.k}
            self.records.append(self.rec)
            if left <= 1:
                self.rec["timed_out"] = True
                break
            self.log.write(f"$ {cmd.shell()}\n# bound {left:.0f} s\n".encode())
            self.log.flush()
            self.t0 = self.clock()
            env = child_env(self.root, cmd.env)
            for k, v in self.env.items():          # None: the command must not inherit it
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = v
            try:
                self.proc = subprocess.Popen(list(cmd.argv), cwd=self.root, env=env,
                                             stdin=subprocess.DEVNULL, stdout=self.log,
                                             stderr=subprocess.STDOUT,
                                             preexec_fn=_child_setup)
                return
            except OSError as e:
                self.rec.update(rc=127, error=f"{type(e).__name__}: {e}")
                self.log.write(f"# could not start: {e}\n".encode())
                continue
        self._finish()

    def start(self) -> None:
        self._start_next()

    def _finish(self) -> None:
        self.done = True
        self.proc = None
        self.log.close()

    def _ended(self, how: str) -> None:
        assert self.proc is not None
        self.rec["rc"] = self.proc.returncode
        self.rec["seconds"] = round(self.clock() - self.t0, 2)
        _killpg(self.proc.pid, signal.SIGKILL)          # ranks or helpers it left behind
        self.log.write(f"\n# {how}: exit status {self.rec['rc']} after "
                       f"{self.rec['seconds']:.1f} s\n\n".encode())
        self.log.flush()
        self.proc = None

    def poll(self) -> None:
        """Advance: the command ended (start the next), or reached the bound (stop it)."""
        if self.done or self.proc is None:
            return
        if self.proc.poll() is not None:
            stopped = self.stop_at is not None
            self._ended("stopped at its bound" if stopped and self.rec["timed_out"] else
                        "interrupted" if stopped else "exited")
            if stopped:
                self._finish()
            else:
                self._start_next()
            return
        now = self.clock()
        if self.stop_at is None and now >= self.deadline:
            self.rec["timed_out"] = True
            self.stop_at = now
            _killpg(self.proc.pid, signal.SIGINT)
        elif self.stop_at is not None and now >= self.stop_at + self.grace_s:
            _killpg(self.proc.pid, signal.SIGKILL)

    def signal_stop(self) -> None:
        """Ctrl-C, first half: SIGINT to the command now (every unit gets it before any is
        waited for); no command after it."""
        self.cmds = []
        if self.done:
            return
        if self.proc is None:
            self._finish()
            return
        self.rec["interrupted"] = True
        if self.stop_at is None:
            self.stop_at = self.clock()
            _killpg(self.proc.pid, signal.SIGINT)

    def finish_stop(self, until: float) -> None:
        """Ctrl-C, second half: wait until ``until`` for the command, then SIGKILL its group."""
        if self.done or self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, until - self.clock()))
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            pass
        _killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(10.0)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):   # unkillable (D state)
            log.warning("selftest: pid %d did not end after SIGKILL", self.proc.pid)
        self._ended("interrupted")
        self._finish()


class _Running:
    def __init__(self, stage: Stage, res: StageResult, units: List[Unit], t0: float) -> None:
        self.stage, self.res, self.units, self.t0 = stage, res, units, t0


def run_stages(stages: Sequence[Stage], ctx: Ctx, root: str, budget_s: float, *,
               say: Callable[[str], None] = print,
               after_stage: Optional[Callable[[List[StageResult]], None]] = None,
               grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic,
               jobs: int = 1, capacity: int = 0,
               env_for: Optional[Callable[[Stage], Mapping[str, Optional[str]]]] = None,
               ) -> Tuple[List[StageResult], bool]:
    """Run ``stages`` within ``budget_s``: one result per stage (in the order given) and
    whether the run was interrupted.  ``jobs``: most commands at once (1: one stage after
    another); ``capacity``: most ranks at once (0: no limit but ``jobs``); ``env_for``: extra
    variables for a stage's commands (None: remove the variable)."""
    t_start = clock()
    deadline = t_start + budget_s
    results = {s.name: StageResult(s.name, s.title) for s in stages}
    ordered = [results[s.name] for s in stages]
    first = [s for s in stages if s.kind == "info"]
    shared = [s for s in stages if s.kind != "info" and not s.exclusive]
    alone = [s for s in stages if s.exclusive]
    # the timed stages' minimum, and the grace a shared stage stopped at its bound may take
    keep_back = sum(s.min_s for s in alone) + (grace_s if alone else 0.0)
    state = {"interrupted": False}
    running: List[_Running] = []

    def used() -> Tuple[int, int]:
        units = [u for r in running for u in r.units if not u.done]
        return len(units), sum(u.stage.ranks for u in units)

    def launch(s: Stage, phase_end: float) -> bool:
        """Start ``s`` if it may; False when it must wait for room."""
        res = results[s.name]
        run, timeout, why = decide(s, phase_end - clock() - RESERVE_S)
        if not run:
            res.reason = why
            say(f"[selftest] {s.name}: not run: {why}")
            return True
        shards = shard_commands(s, ctx, timeout)
        n_units, n_ranks = used()
        if running and (n_units + len(shards) > max(1, jobs) or
                        (capacity and n_ranks + s.ranks * len(shards) > capacity)):
            return False
        res.timeout_s = timeout
        now = clock()
        res.start_s = round(now - t_start, 1)
        extra = dict(env_for(s)) if env_for is not None else {}
        units = [Unit(s, k, cmds, ctx, root, now + timeout, timeout, res.commands, extra,
                      grace_s, clock) for k, cmds in enumerate(shards, 1)]
        say(f"[selftest] {s.name}: {s.title} (bound {timeout:.0f} s"
            + (f", {len(units)} shards" if len(units) > 1 else "") + ")")
        running.append(_Running(s, res, units, now))
        for u in units:
            u.start()
        return True

    def reap() -> None:
        for r in [r for r in running if all(u.done for u in r.units)]:
            running.remove(r)
            r.res.seconds = round(clock() - r.t0, 2)
            analyse(r.stage, r.res, ctx)
            if state["interrupted"] or any(c.get("interrupted") for c in r.res.commands):
                r.res.status = "interrupted"
            say(f"[selftest] {stage_line(r.res)}")
            if after_stage is not None:
                after_stage(ordered)

    def phase(todo: List[Stage], phase_end: float, limit_jobs: int) -> None:
        pending = list(todo)
        while pending or running:
            for s in list(pending):
                if len(running) >= limit_jobs and running:
                    break
                if launch(s, phase_end):
                    pending.remove(s)
            for r in running:
                for u in r.units:
                    u.poll()
            reap()
            if running:
                time.sleep(POLL_S)

    try:
        phase(first, deadline, 1)
        phase(shared, deadline - keep_back, max(1, jobs))
        phase(alone, deadline, 1)
    except KeyboardInterrupt:
        state["interrupted"] = True
        units = [u for r in running for u in r.units]
        for u in units:                 # every command gets SIGINT at once ...
            u.signal_stop()
        until = clock() + grace_s       # ... and one grace for all of them
        for u in units:
            try:
                u.finish_stop(until)
            except KeyboardInterrupt:      # a second Ctrl-C: no more grace
                until = clock()
                u.finish_stop(until)
        try:
            reap()
        except KeyboardInterrupt:
            pass
        for res in ordered:
            if res.status == "not run" and not res.commands:
                res.reason = "the run was interrupted first"
    return ordered, state["interrupted"]
