"""``python -m bench.nccl_tests_side --out DIR``: nccl-tests 2.19.6 and ncclpy's bench, side by
side, on the same ranks of the same GPU, in one call.

For each round, collective (all_reduce, sendrecv) and mode, nccl-tests' program and
``python -m bench`` run one after the other with the same flags; the order of the two
alternates from round to round (A B, then B A) so that neither always runs first.  Modes:
``eager`` (per call, -b 8 -e 256M -f 2), ``graph`` (-G, 8 B - 64 KiB), ``cputime`` (-C 1,
8 B - 64 KiB: the host's time of issuing one call).  The medians over the rounds go into
``DIR/nccl-tests-side.json`` and ``DIR/nccl-tests-side.md`` (tables for docs/performance.md;
:mod:`bench.nccl_tests_compare` has the targets); every run's JSON and output stay in
``DIR/runs/``.

Same ranks: nccl-tests starts under MPI (``mpiexec -n 1 env K=V ... prog : -n 1 ...``), each
rank with the variables ncclpy's placement gives that rank (:func:`ncclpy.launch.placement.
place`: on one GPU with NCCL < 2.30 a distinct ``NCCL_HOSTID`` per rank over the socket
transport) and ``NCCL_TESTS_DEVICE`` = the rank's GPU (common.cu: the device of every thread
is that index plus its own); the bench's ranks (``--nproc``) get the same placement from
``ncclpy.spawn``.  One CUDA MPS daemon serves both programs, or neither has one.

What could not run for want of something (no GPU, nvcc, MPI, carried source) is ``not run``
with what is missing; a failed build (the end of its log), a program failing at every run (the
end of its output) or a device fault that ended the rounds is ``failed`` with that reason;
``complete`` only when every run of the rounds done wrote its figures.  A run stopped at its
bound is not started again for that collective and mode; a CUDA fault that reaches every process
on the GPU (a rank killed with a kernel in flight does that to every MPS client) ends the
rounds, the reason naming the stop before it.  Wrong elements fail the comparison (nccl-tests
then exits non-zero; its JSON is read all the same).  Every wait is bounded (``--budget``).
Exit status: 0 complete, 1 partial or failed, 3 not run, 130 interrupted (what completed is
kept), 2 usage.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import nccl_tests_build as B
from . import nccl_tests_compare as C
from . import nccl_tests_run as R

__all__ = ["COLLECTIVES", "SCHEMA", "mode_args", "nccl_tests_argv", "bench_argv", "main",
           "Side", "ranks_env"]

SCHEMA = "ncclpy-nccl-tests-side/1"
#: name -> (nccl-tests program, the bench's collective)
COLLECTIVES: Dict[str, Tuple[str, str]] = {"all_reduce": ("all_reduce_perf", "all_reduce"),
                                           "sendrecv": ("sendrecv_perf", "send_recv")}
JSON_NAME, MD_NAME = "nccl-tests-side.json", "nccl-tests-side.md"
#: seconds kept back from --budget for killing a run and writing the files
RESERVE_S = 10.0
#: a program's run is not started with less time than this left
MIN_RUN_S = 5.0


class _Stop(Exception):
    """SIGINT or SIGTERM: stop the run in progress and write what there is."""


def mode_args(mode: str, *, minbytes: str, maxbytes: str, small: str, iters: int, warmup: int,
              check: int, graph: int) -> List[str]:
    """The flags both programs get in ``mode`` (nccl-tests' spelling, which the bench takes)."""
    top = maxbytes if mode == "eager" else small
    args = ["-b", minbytes, "-e", top, "-f", "2", "-n", str(iters), "-w", str(warmup),
            "-c", str(check if mode == "eager" else 0)]
    if mode == "graph":
        args += ["-G", str(graph)]
    elif mode == "cputime":
        args += ["-C", "1"]
    return args


def nccl_tests_argv(mpiexec: str, binary: str, args: Sequence[str], json_path: str,
                    per_rank: Sequence[Mapping[str, str]]) -> List[str]:
    """``mpiexec -n 1 env K=V ... binary ARGS -J PATH : -n 1 env ...``: one block per rank, so
    that each rank gets its own variables with any MPMD launcher (MPICH's hydra, Open MPI)."""
    out = [mpiexec]
    for r, env in enumerate(per_rank):
        if r:
            out.append(":")
        out += ["-n", "1", "env"] + [f"{k}={v}" for k, v in sorted(env.items())]
        out += [binary, *args, "-J", json_path]
    return out


def bench_argv(python: str, collective: str, args: Sequence[str], json_path: str, *,
               nproc: int, device: str) -> List[str]:
    """``python -m bench COLL --backend ncclpy --device D --nproc N ARGS -J PATH`` (the
    installed ``ncclpy_bench`` where this module is that)."""
    return [python, "-m", __package__ or "bench", collective, "--backend", "ncclpy",
            "--device", device, "--nproc", str(nproc), *args, "-J", json_path]


def ranks_env(nproc: int, device: str, env: Mapping[str, str]) -> Tuple[List[Dict[str, str]],
                                                                         List[str], str]:
    """(each rank's variables for nccl-tests, the variables to drop, ncclpy's placement line):
    ncclpy's placement of ``nproc`` ranks here plus ``NCCL_TESTS_DEVICE``; on ``cpu`` only the
    rank's index (there is no GPU to place)."""
    if device != "cuda":
        return [{"NCCL_TESTS_DEVICE": "0"} for _ in range(nproc)], [], "cpu: no placement"
    from ncclpy.launch.placement import place, summary_line
    p = place(nproc, env=env)
    per = [dict(p.env(r), NCCL_TESTS_DEVICE=str(p.device(r))) for r in range(nproc)]
    return per, list(p.unset), summary_line("both programs", p)


class Side:
    """One comparison: the plan, the runs done, the files written after each round (and on an
    interruption, with every run that completed)."""

    def __init__(self, ns: Any, env: Dict[str, str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ns, self.env, self.clock = ns, env, clock
        self.t0 = clock()
        self.deadline = self.t0 + ns.budget
        self.runs: List[Dict[str, Any]] = []
        #: (collective, mode, tool) -> each completed run's rows, in order
        self.data: Dict[Tuple[str, str, str], List[Dict[int, Dict[str, Any]]]] = {}
        self.doc: Dict[str, Any] = {
            "schema": SCHEMA, "status": "not run", "reason": "", "flags": [],
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "setup": {"nproc": ns.nproc, "device": ns.device, "rounds_planned": ns.rounds,
                      "rounds_done": 0, "iters": ns.iters, "warmup": ns.warmup,
                      "check": ns.check, "graph": ns.graph, "modes": ns.modes,
                      "collectives": ns.collectives, "minbytes": ns.minbytes,
                      "maxbytes": ns.maxbytes, "small": ns.small, "budget_s": ns.budget,
                      "order": "the two programs alternate: nccl-tests first in odd rounds, "
                               "ncclpy first in even ones"},
            "nccl_tests": {}, "commands": {}, "runs": self.runs, "collectives": {},
            "markdown": ""}
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        #: (tool, collective, mode) -> why it is not started again (stopped at its bound once)
        self.stuck: Dict[Tuple[str, str, str], str] = {}
        #: the first run stopped at its bound (what a later failure is laid at)
        self.stopped: Optional[Dict[str, Any]] = None
        #: why no run is started any more ('' while the rounds go on)
        self.halt = ""
        #: the CUDA MPS setup both programs share (stopped at the end)
        self.mps: Any = None
        #: what it is doing, for the reason of an interruption
        self.phase = "the set-up"

    # -------------------------------------------------------------------- running
    def left(self) -> float:
        return self.deadline - self.clock()

    def _run(self, argv: List[str], env: Dict[str, str], log_path: str, cap: float
             ) -> Tuple[Optional[int], float, str, List[int]]:
        """(exit status or None when stopped at its bound, seconds, its output, the pids of
        its processes still running after it was stopped and waited for)."""
        bound = max(1.0, min(cap, self.left() - RESERVE_S))
        t0 = self.clock()
        left: List[int] = []
        with open(log_path, "wb") as f:
            f.write(f"$ {' '.join(shlex.quote(a) for a in argv)}\n# bound {bound:.0f} s\n"
                    .encode())
            f.flush()
            try:
                self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, preexec_fn=R.pdeathsig)
            except OSError as e:
                return 127, 0.0, f"cannot start {argv[0]}: {e}", []
            try:
                rc: Optional[int] = self.proc.wait(bound)
            except subprocess.TimeoutExpired:
                rc = None
            finally:       # its ranks too, whatever it left behind, and wait for them to go
                left = R.stop_tree(self.proc)
                self.proc = None
        with open(log_path, errors="replace") as f:
            text = f.read()
        return rc, round(self.clock() - t0, 2), text, left

    def one(self, rnd: int, tool: str, coll: str, mode: str, argv: List[str],
            env: Dict[str, str], json_path: str) -> Dict[int, Dict[str, Any]]:
        """Run one program once; its rows (``{}`` when it failed: the run record says why)."""
        log_path = json_path[:-len(".json")] + ".log"
        rec: Dict[str, Any] = {"round": rnd, "tool": tool, "collective": coll, "mode": mode,
                               "rc": None, "seconds": 0.0, "json": os.path.relpath(
                                   json_path, self.ns.out), "log": os.path.relpath(
                                   log_path, self.ns.out), "error": ""}
        why_not = self.stuck.get((tool, coll, mode)) or (
            "the budget was spent" if self.left() - RESERVE_S < MIN_RUN_S else "")
        if why_not:                     # a hung program would hang again: not started
            rec["error"] = f"not started: {why_not}"
            self.runs.append(rec)
            return {}
        cap = self.ns.run_timeout if mode == "eager" else self.ns.run_timeout / 2
        try:
            rc, secs, text, left = self._run(argv, env, log_path, cap)
        except _Stop:
            R.redact_json(json_path)    # its environment, cut short or not, is not kept
            rec["error"] = "interrupted"
            self.runs.append(rec)
            raise
        rec.update(rc=rc, seconds=secs)
        if left:
            rec["outlived"] = left
            text += (f"\n# still running {R.RANKS_WAIT_S:.0f} s after it was stopped: "
                     f"pids {left}\n")
        if rc is None:
            self.stuck[(tool, coll, mode)] = (f"{tool} {coll} {mode} was stopped at its bound "
                                              f"in round {rnd}")
        if tool == "nccl-tests" and "version_line" not in self.doc["nccl_tests"]:
            v = C.version_line(text)
            if v:
                self.doc["nccl_tests"]["version_line"] = v
        doc, rec["error"] = R.redact_json(json_path)
        rows: Dict[int, Dict[str, Any]] = {}
        if doc is not None:
            rows = C.parse_results(doc)
            oob = C.out_of_bounds(doc)
            if oob:
                rec["out_of_bounds"] = oob
            rec.setdefault("nccl_version", doc.get("nccl_version"))
            if tool == "nccl-tests":
                devs = (doc.get("config") or {}).get("devices") or []
                if devs and isinstance(devs[0], dict):
                    self.doc["nccl_tests"].setdefault("gpu", devs[0].get("device_info"))
        wrong = sum(v for r in rows.values() for k in ("nwrong", "ip_nwrong")
                    for v in [r.get(k)] if v)
        if rc != 0 or not rows:
            why = ("stopped at its bound" if rc is None else f"exit status {rc}")
            if rc is not None and rows and (wrong or rec.get("out_of_bounds")):
                # common.cu's run() ends non-zero on wrong elements: its figures stand
                rec["error"] = (f"{why}: wrong elements ({wrong:.0f} elements; "
                                f"{rec.get('out_of_bounds', 0)} results out of bounds)")
                rec["wrong"] = wrong
            else:
                rec["error"] = f"{why}; {rec['error'] or 'no rows'}".rstrip("; ")
                rows = {}
            rec["output_tail"] = B.tail(text, 15)
        self.runs.append(rec)
        self._watch(rec, text)
        return rows

    def _watch(self, rec: Dict[str, Any], text: str) -> None:
        """End the rounds (``halt``) on a CUDA fault that reaches every process on the GPU, or
        on a failure after a run was stopped at its bound (killing a rank with a kernel in
        flight faults every client of an MPS server): later runs would fail for that cause and
        their failures would be laid at the wrong program."""
        from ncclpy.selftest.runner import device_fault
        what = f"{rec['tool']} {rec['collective']} {rec['mode']} (round {rec['round']})"
        if rec["rc"] is None and self.stopped is None:
            self.stopped = rec
        s = self.stopped
        after = "" if s is None or s is rec else \
            f"{s['tool']} {s['collective']} {s['mode']} (round {s['round']})"
        fault = device_fault(text)
        if fault and after:
            self.halt = (f"device faulted after stopping {after} at its bound: {fault} (in "
                         f"{what}'s output); no run was started after it")
        elif fault:
            self.halt = (f"device fault in {what}: {fault}; no run was started after it (one "
                         f"process's fault reaches every process on the GPU under MPS)")
        elif after and rec["rc"] != 0 and not (rec.get("out_of_bounds") or rec.get("wrong")):
            self.halt = (f"{what} failed after {after} was stopped at its bound: "
                         f"{C.key_line(text) or rec['error']}; no run was started after it (a "
                         f"rank killed with a kernel in flight can fault every process of the "
                         f"MPS server)")

    # -------------------------------------------------------------------- the rounds
    def rounds(self, nt_bins: Mapping[str, str], mpiexec: str, nt_env: Dict[str, str],
               nc_env: Dict[str, str], per_rank: List[Dict[str, str]]) -> None:
        ns = self.ns
        self.phase = "the runs"
        os.makedirs(os.path.join(ns.out, "runs"), exist_ok=True)
        longest = 0.0
        for rnd in range(1, ns.rounds + 1):
            if rnd > 1 and self.left() - RESERVE_S < longest:
                self.doc["setup"]["rounds_note"] = (
                    f"{rnd - 1} of {ns.rounds} rounds: a round took {longest:.0f} s and "
                    f"{max(0.0, self.left()):.0f} s of the budget were left")
                break
            t_round = self.clock()
            self._round(rnd, nt_bins, mpiexec, nt_env, nc_env, per_rank)
            if self.halt:
                self.doc["setup"]["rounds_note"] = f"round {rnd} was cut short"
                self.finish()
                break
            longest = max(longest, self.clock() - t_round)
            self.doc["setup"]["rounds_done"] = rnd
            self.finish()

    def _round(self, rnd: int, nt_bins: Mapping[str, str], mpiexec: str,
               nt_env: Dict[str, str], nc_env: Dict[str, str],
               per_rank: List[Dict[str, str]]) -> None:
        ns = self.ns
        rdir = os.path.join(ns.out, "runs")
        for coll in ns.collectives:
            prog, bcoll = COLLECTIVES[coll]
            for mode in ns.modes:
                args = mode_args(mode, minbytes=ns.minbytes, maxbytes=ns.maxbytes,
                                 small=ns.small, iters=ns.iters, warmup=ns.warmup,
                                 check=ns.check, graph=ns.graph)
                stem = os.path.join(rdir, f"r{rnd}-{coll}-{mode}")
                nt_json, nc_json = f"{stem}-nccl-tests.json", f"{stem}-ncclpy.json"
                for p in (nt_json, nc_json):
                    if os.path.exists(p):
                        os.remove(p)
                nt_argv = nccl_tests_argv(mpiexec, nt_bins[coll], args, nt_json, per_rank)
                nc_argv = bench_argv(ns.python, bcoll, args, nc_json, nproc=ns.nproc,
                                     device=ns.device)
                cmds = self.doc["commands"].setdefault(mode, {})
                cmds.setdefault(coll, {"nccl-tests": " ".join(map(shlex.quote, nt_argv)),
                                       "ncclpy": " ".join(map(shlex.quote, nc_argv))})
                pair = [("nccl-tests", nt_argv, nt_env, nt_json),
                        ("ncclpy", nc_argv, nc_env, nc_json)]
                for tool, argv, env, path in (pair if rnd % 2 else pair[::-1]):
                    rows = self.one(rnd, tool, coll, mode, argv, env, path)
                    self.data.setdefault((coll, mode, tool), []).append(rows)
                    if self.halt:
                        return

    def summarise(self) -> None:
        """Medians, rows, verdicts, status and reason of the runs so far (no file written)."""
        ns = self.ns
        planned = {m: C.planned_sizes(ns.minbytes, ns.maxbytes if m == "eager" else ns.small)
                   for m in ns.modes}
        colls: Dict[str, Any] = {}
        for coll in ns.collectives:
            med = {(mode, tool): C.medians([r for r in self.data.get((coll, mode, tool), [])
                                            if r])
                   for mode in ns.modes for tool in C.TOOLS}
            host = (med[("cputime", "nccl-tests")], med[("cputime", "ncclpy")]) \
                if "cputime" in ns.modes else None
            rows = {mode: C.compare(med[(mode, "nccl-tests")], med[(mode, "ncclpy")], mode,
                                    host if mode == "eager" else None) for mode in ns.modes}
            summary = C.summarise(rows, planned)
            summary["out_of_bounds"] = sum(r.get("out_of_bounds") or 0 for r in self.runs
                                           if r["collective"] == coll)
            colls[coll] = {"rows": rows, "summary": summary}
        self.doc["collectives"] = colls
        self.doc["status"], self.doc["reason"] = C.status_of(self.runs, self.halt)
        self._flags()

    def finish(self) -> None:
        """Summarise and write the files."""
        self.summarise()
        self.write()

    def interrupted(self, why: str) -> None:
        """SIGINT or SIGTERM: the figures of every run that completed, status interrupted."""
        self.summarise()
        self.doc["status"], self.doc["reason"] = "interrupted", why
        self.write()

    def _flags(self) -> None:
        flags = []
        if self.ns.device != "cuda":
            flags.append("cpu: the bench ran on ncclpy's CPU backend; the ratios mean nothing")
        v = self.doc["nccl_tests"].get("version_line")
        if not v:
            flags.append("not nccl-tests: its output has no '# nccl-tests version' line")
        elif v["version"] != B.VERSION:
            flags.append(f"nccl-tests {v['version']}, not {B.VERSION}")
        codes = {r["tool"]: r["nccl_version"] for r in self.runs
                 if r.get("nccl_version") is not None}
        if len(set(codes.values())) > 1:
            flags.append(f"different NCCL: nccl-tests {codes.get('nccl-tests')}, ncclpy "
                         f"{codes.get('ncclpy')}")
        self.doc["versions"] = codes
        self.doc["flags"] = flags
        self.doc["comparable"] = not flags

    # -------------------------------------------------------------------- output
    def write(self) -> None:
        self.doc["seconds"] = round(self.clock() - self.t0, 1)
        self.doc["markdown"] = C.render(self.doc, B.VERSION)
        os.makedirs(self.ns.out, exist_ok=True)
        for name, text in ((JSON_NAME, json.dumps(self.doc, indent=1, default=str)),
                           (MD_NAME, self.doc["markdown"])):
            tmp = os.path.join(self.ns.out, f".{name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text if text.endswith("\n") else text + "\n")
            os.replace(tmp, os.path.join(self.ns.out, name))

    def not_run(self, reason: str) -> int:
        """A missing prerequisite: status not run, exit 3."""
        self.doc["status"], self.doc["reason"] = "not run", reason
        self.write()
        sys.stderr.write(f"python -m bench.nccl_tests_side: not run: {reason}\n")
        return 3

    def failed(self, reason: str) -> int:
        """A failure before any run (the build): status failed, exit 1."""
        self.doc["status"], self.doc["reason"] = "failed", reason
        self.write()
        sys.stderr.write(f"python -m bench.nccl_tests_side: failed: {reason}\n")
        return 1


# ------------------------------------------------------------------------------ CLI
def _parser() -> Any:
    from ncclpy.cli_util import OneLineParser, int_at_least
    p = OneLineParser(prog="python -m bench.nccl_tests_side",
                      description="nccl-tests 2.19.6 and ncclpy's bench side by side on the same "
                                  "ranks: time and busbw per size, their ratios, the verdicts.")
    p.add_argument("--out", required=True, metavar="DIR", help="where the files go (created)")
    p.add_argument("--nccl-tests", dest="nccl_tests", default=None, metavar="BUILD_DIR",
                   help="a folder with all_reduce_perf and sendrecv_perf (and build.json): "
                        "use it instead of building")
    p.add_argument("--carry", default=B.DEFAULT_CARRY, help="the carried source and MPI wheel "
                   f"(default {B.DEFAULT_CARRY}; python -m bench.nccl_tests_build prepare)")
    p.add_argument("--build-dir", default=None, help="where to build (default DIR/build)")
    p.add_argument("--mpirun", default=None, metavar="MPIEXEC",
                   help="the MPI launcher (default: the build's, else mpiexec on PATH)")
    p.add_argument("--nproc", type=int_at_least(1, "a number of ranks >= 1"), default=2)
    p.add_argument("--rounds", type=int_at_least(1, "a number of rounds >= 1"), default=3)
    p.add_argument("--collectives", default="all_reduce,sendrecv",
                   help="comma-separated: all_reduce, sendrecv (default both)")
    p.add_argument("--modes", default="eager,graph,cputime",
                   help="comma-separated: eager, graph, cputime (default all)")
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="256M", help="eager mode's largest size")
    p.add_argument("--small", default="64K", help="graph and cputime modes' largest size")
    p.add_argument("-n", "--iters", type=int_at_least(1, "iterations >= 1"), default=20)
    p.add_argument("-w", "--warmup", type=int_at_least(0, "warm-up iterations >= 0"),
                   default=5)
    p.add_argument("-c", "--check", type=int_at_least(0, "check iterations >= 0"), default=1)
    p.add_argument("-G", "--graph", type=int_at_least(1, "graph launches >= 1"), default=10)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="the bench's device (cpu: its CPU backend, for testing the pipeline)")
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="one CUDA MPS daemon for both programs (default auto)")
    p.add_argument("--budget", type=float, default=390.0, metavar="SECONDS",
                   help="the whole call's bound, build included (default 390)")
    p.add_argument("--run-timeout", type=float, default=150.0, metavar="SECONDS",
                   help="one program's run, eager mode (half that in the others; default 150)")
    p.add_argument("--build-timeout", type=float, default=240.0, metavar="SECONDS")
    p.add_argument("--python", default=sys.executable, help="the Python that runs the bench")
    return p


def _check(p: Any, ns: Any) -> None:
    ns.collectives = [c.strip() for c in ns.collectives.split(",") if c.strip()]
    bad = [c for c in ns.collectives if c not in COLLECTIVES]
    if bad or not ns.collectives:
        p.error(f"{p.flag('collectives')}: expected all_reduce and/or sendrecv, got "
                f"{','.join(bad) or 'nothing'}")
    ns.modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    bad = [m for m in ns.modes if m not in C.MODES]
    if bad or not ns.modes:
        p.error(f"{p.flag('modes')}: expected eager, graph and/or cputime, got "
                f"{','.join(bad) or 'nothing'}")
    if ns.device == "cpu" and "graph" in ns.modes:
        ns.modes.remove("graph")        # the bench refuses -G on cpu; said in the setup
    for dest in ("minbytes", "maxbytes", "small"):     # both programs parse K/M/G the same
        if not re.fullmatch(r"\d+[KMG]?", getattr(ns, dest)):
            p.error(f"{p.flag(dest)}: expected a size in bytes such as 8, 64K or 256M, got "
                    f"{getattr(ns, dest)!r}")
    for dest in ("budget", "run_timeout", "build_timeout"):
        v = getattr(ns, dest)
        if not v > 0 or v != v or v == float("inf"):
            p.error(f"{p.flag(dest)}: expected seconds > 0, got {v!r}")
    ns.out = os.path.abspath(ns.out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; the exit status (see the module's docstring)."""
    from ncclpy.cli_util import exit_status
    p = _parser()
    try:
        ns = p.parse_args(argv)
        _check(p, ns)
    except SystemExit as e:
        return exit_status(e)
    env = dict(os.environ)
    side = Side(ns, env)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum: int, frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    for s in old:
        signal.signal(s, stop)
    try:
        return _main(side, ns, env)
    except _Stop as e:
        for s in old:                   # a second signal does not cut the writing short
            signal.signal(s, signal.SIG_IGN)
        if side.proc is not None:
            R.stop_tree(side.proc)
        side.interrupted(f"{e} during {side.phase}")
        return 130
    finally:
        if side.mps is not None:
            side.mps.stop()
        for s, h in old.items():
            signal.signal(s, h)


def _main(side: Side, ns: Any, env: Dict[str, str]) -> int:
    os.makedirs(ns.out, exist_ok=True)
    mpiexec = ns.mpirun
    nt = side.doc["nccl_tests"]
    nc_env = dict(env)
    here = os.path.dirname(os.path.dirname(os.path.abspath(B.__file__)))   # bench/'s parent
    nc_env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    if ns.device == "cuda":
        side.phase = "the GPU probe"
        why = R.gpu_reason(ns.python, nc_env)
        if why:
            return side.not_run(f"no usable CUDA GPU here: {why}")
    if ns.nccl_tests:
        info = B.load_build(ns.nccl_tests)
        bins = {c: os.path.join(ns.nccl_tests, prog) for c, (prog, _) in COLLECTIVES.items()}
        missing = [b for c, b in bins.items() if c in ns.collectives and not os.access(b, os.X_OK)]
        if missing:
            return side.not_run(f"--nccl-tests {ns.nccl_tests}: no executable "
                                f"{', '.join(os.path.basename(m) for m in missing)}")
    else:
        build_dir = ns.build_dir or os.path.join(ns.out, "build")
        side.phase = "the build"
        try:
            info = B.build(ns.carry, build_dir, python=ns.python,
                           timeout_s=min(ns.build_timeout, side.left() - RESERVE_S), env=env)
        except B.NotRunnable as e:
            return side.not_run(str(e))
        except B.BuildFailed as e:
            return side.failed(str(e))
        bins = dict(info.binaries)
        bins = {c: bins[prog] for c, (prog, _) in COLLECTIVES.items()}
        nt.update(build_seconds=0.0 if info.reused else info.seconds)
    if info is not None:
        nt.update(binaries=info.binaries, nccl_library=info.nccl_library,
                  cuda_version=info.cuda_version, gencode=info.gencode)
        mpiexec = mpiexec or info.mpiexec
    mpiexec = mpiexec or shutil.which("mpiexec", path=env.get("PATH")) or \
        shutil.which("mpirun", path=env.get("PATH"))
    if not mpiexec:
        return side.not_run("no MPI launcher: the build names none, --mpirun was not given and "
                            "neither mpiexec nor mpirun is on PATH")
    nt["mpiexec"] = mpiexec
    base = dict(env)
    if info is not None:
        libs = list(info.ld_library_path)
    else:                               # --nccl-tests DIR without build.json
        try:
            libs = R.library_dirs(mpiexec, ns.device, ns.python, nc_env)
        except B.NotRunnable as e:
            return side.not_run(f"--nccl-tests {ns.nccl_tests} has no build.json, and the "
                                f"libnccl to run it with cannot be found: {e}")
        nt["ld_library_path_from"] = (f"no build.json in {ns.nccl_tests}: the launcher's "
                                      f"../lib" + (" and ncclpy's libnccl and CUDA's runtime"
                                                   if ns.device == "cuda" else ""))
    nt["ld_library_path"] = libs
    base["LD_LIBRARY_PATH"] = os.pathsep.join(
        [*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    base.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    shared = ns.device == "cuda" and ns.nproc > 1
    if shared:
        from ncclpy.errors import NcclpyError
        from ncclpy.launch.mps import setup_mps
        try:
            m = setup_mps(ns.mps, True, env, name="--mps")
        except NcclpyError as e:
            return side.not_run(str(e))
        side.mps = m
        side.doc["setup"]["mps"] = m.status
        for d in (base, nc_env):
            d.update(m.env)
            for k in m.unset:
                d.pop(k, None)
            if not m.env and "already running" not in (m.status or ""):
                d["NCCLPY_MPS"] = "off"     # neither program gets a daemon of its own
    else:
        side.doc["setup"]["mps"] = "none (no GPU shared)"
    try:
        per_rank, unset, line = ranks_env(ns.nproc, ns.device, base)
    except Exception as e:  # noqa: BLE001 - the placement's reason is the run's
        return side.not_run(f"ncclpy's placement of {ns.nproc} ranks failed: {e}")
    for k in unset:
        base.pop(k, None)
    side.doc["setup"]["placement"] = line
    side.doc["setup"]["rank_env"] = per_rank
    side.rounds(bins, mpiexec, base, nc_env, per_rank)
    st = side.doc["status"]
    sys.stdout.write(side.doc["markdown"])
    sys.stdout.write(f"[nccl-tests-side] {st}; wrote {os.path.join(ns.out, JSON_NAME)} and "
                     f"{MD_NAME}\n")
    if st != "complete":
        sys.stderr.write(f"python -m bench.nccl_tests_side: {st}: {side.doc['reason']}\n")
        bad = next((r for r in side.runs if r.get("output_tail")), None)
        if bad:
            sys.stderr.write(f"the end of {bad['log']}:\n{bad['output_tail']}\n")
    return 0 if st == "complete" else 3 if st == "not run" else 1


if __name__ == "__main__":
    sys.exit(main())
