"""The selftest's stages: what each runs, its time bound, how many ranks it runs at once, and
which of them a run does.

Pure data and arithmetic, no GPU and no subprocess: :func:`select` turns ``--stage`` names into
the list to run, :func:`decide` says whether a stage still fits the time left and with which
timeout, :func:`shard_commands` gives a stage's exact command lines for a context (the Python to
use, the folder its files go to; a sharded pytest stage is several pytest processes that run at
once), and :func:`stage_of` says which stage runs a given GPU test (the same selection the
commands make: files, ignored files, world sizes).

Concurrency (:mod:`ncclpy.selftest.schedule`): the stages that time nothing run side by side on
the one GPU, within a budget of ranks at once (``ranks`` is a stage's weight, per shard); the
ones that time something (``exclusive``: bench, overhead, nccl-tests) run alone.  A stage
``on_request`` (nccl-tests) runs only when ``--stage`` names it: not in the default proof.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Cmd", "Ctx", "Stage", "STAGES", "NAMES", "DEFAULT_BUDGET_S", "RESERVE_S",
           "ARTIFACTS_ENV", "select", "decide", "commands", "shard_commands", "prefix",
           "by_name", "stage_of", "TIMED", "CUDA_COSTS_SUFFIX", "DEFAULT", "ON_REQUEST",
           "SIDE_JSON", "SIDE_MARGIN_S"]

#: default global deadline (seconds): the whole proof in one device call, leaving time in a
#: session's 15 minutes of device time for a second call that reruns what failed
DEFAULT_BUDGET_S = 480.0
#: seconds kept back from the budget: a stopped command's grace (runner.GRACE_S, 15 s), then
#: packing the logs, the ledger and the report
RESERVE_S = 25.0
#: environment variable through which GPU tests leave artifacts (check JSON) for the report
ARTIFACTS_ENV = "NCCLPY_GPU_ARTIFACTS"
#: the overhead stage's second JSON, ``python -m bench.cuda_costs``'s, after the stage prefix
CUDA_COSTS_SUFFIX = "cuda-costs.json"
#: the nccl-tests stage's JSON (``bench.nccl_tests_side``'s), in the folder named by its prefix
SIDE_JSON = "nccl-tests-side.json"


@dataclass(frozen=True)
class Cmd:
    """One command line of a stage, with variables added to its environment."""

    argv: Tuple[str, ...]
    env: Tuple[Tuple[str, str], ...] = ()

    def shell(self) -> str:
        """The command as one would type it (environment first)."""
        import shlex
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{envs} {cmd}" if envs else cmd


@dataclass(frozen=True)
class Ctx:
    """Where a run's commands put their files: ``work`` (logs, junit XML, JSON), ``tmp``
    (pytest's basetemp, not kept), and the Python that runs them."""

    python: str
    work: str
    tmp: str


@dataclass(frozen=True)
class Stage:
    """A stage: ``timeout_s`` bounds it; it is not started with less than ``min_s`` left.

    ``ranks``: the most ranks it runs at once (per shard); ``exclusive``: it times something
    and runs alone; ``kills_ranks``: its tests kill ranks that may have kernels in flight, so it
    runs outside the run's MPS server (:mod:`ncclpy.selftest.gpuenv`); ``shards``: a pytest
    stage's tests split over this many pytest processes that run at once (``--gpu-shard K/N``).
    A pytest stage selects ``paths`` minus ``ignore``, keeping the tests whose largest world size
    is in ``worlds`` (all when empty).  ``on_request``: only run when ``--stage`` names it."""

    name: str
    title: str
    kind: str                       # info | pytest | bench | overhead | nccl-tests | cmd
    timeout_s: float
    min_s: float
    args: Tuple[str, ...] = ()      # bench/overhead/cmd: their arguments
    checks: Tuple[int, ...] = ()    # world sizes whose ``ncclpy check`` JSON the stage leaves
    notes: str = ""
    ranks: int = 1
    exclusive: bool = False
    kills_ranks: bool = False
    shards: int = 1
    paths: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()
    worlds: Tuple[int, ...] = ()
    on_request: bool = False


_GPU = "tests/gpu"
_CHECK = "tests/gpu/test_check_gpu.py"
_FORENSICS = "tests/gpu/test_forensics_gpu.py"
_PART2 = "tests/gpu/test_part2_gpu.py"
_EXAMPLES = "tests/gpu/test_examples_gpu.py"
_BENCH = "tests/gpu/test_bench_gpu.py"
_DIFF = "tests/gpu/test_standin_differential.py"
_ORDER = "tests/gpu/test_order_gpu.py"
#: the GPU test files with a stage of their own; the rest are the communicator's tests
_OWN = (_CHECK, _FORENSICS, _PART2, _EXAMPLES, _BENCH, _DIFF, _ORDER)

STAGES: Tuple[Stage, ...] = (
    Stage("info", "versions and ncclpy info", "info", 60, 20, ranks=0,
          notes="Python, GPU, driver, NCCL, CuPy, torch (+CUDA, NCCL), MPS; `ncclpy info`"),
    Stage("gpu2", "GPU tests at world sizes 1-2", "pytest", 300, 90, ranks=2, shards=2,
          paths=(_GPU,), ignore=_OWN, worlds=(1, 2),
          notes="collective matrix at 1 and 2 ranks, streams, graphs, registration, "
                "nonblocking, split, NCCL_COMM_BLOCKING=0, torch tensors, lifecycle, host "
                "API, torch interop, prepared calls"),
    Stage("check2", "ncclpy check -n 2 --backend nccl, bit for bit against torch", "pytest",
          300, 90, ranks=2, shards=2, paths=(_CHECK,), worlds=(2,), checks=(2,),
          notes="CUDA_VISIBLE_DEVICES=0 (both ranks on one GPU), JSON kept; injected "
                "corruption must fail; --window"),
    Stage("worlds34", "GPU tests at world sizes 3-4", "pytest", 240, 60, ranks=4,
          kills_ranks=True, paths=(_GPU,), ignore=_OWN, worlds=(3, 4),
          notes="collective matrix at 3 and 4 ranks, split, nonblocking split, the "
                "watchdog's aborts (3-rank jobs)"),
    Stage("part2", "NCCL 2.27-2.32 part 2: windows, RMA, shrink, grow, suspend", "pytest",
          300, 60, ranks=3, kills_ranks=True, paths=(_PART2,),
          notes="window collectives vs the reference, put/signal/wait, suspend/resume with "
                "memory statistics, revoke+shrink; 3-rank jobs: shrink after a SIGKILLed rank, "
                "grow 2 -> 3"),
    Stage("standin-diff", "real NCCL vs the CPU stand-in: the rules table's scenarios", "pytest",
          240, 60, ranks=1, paths=(_DIFF,),
          notes="tests/nccl_rules_scenarios.py on 1-rank communicators (one process): each "
                "observation must equal NCCL's source (ncclpy/cpu/RULES.md) and the "
                "stand-in's"),
    Stage("check4", "ncclpy check -n 4 --backend nccl, bit for bit against torch", "pytest",
          360, 90, ranks=4, paths=(_CHECK,), worlds=(4,), checks=(4,),
          notes="4 ranks on one GPU"),
    Stage("examples", "every example, spawned and under ncclpy run", "pytest", 360, 90,
          ranks=6, shards=2, paths=(_EXAMPLES,)),
    Stage("benchtests", "bench GPU tests (every collective, dtypes, graphs, torch)", "pytest",
          360, 90, ranks=2, shards=2, paths=(_BENCH,)),
    Stage("forensics", "hang forensics: flight recorder, ncclpy trace, ncclpy status", "pytest",
          300, 90, ranks=3, shards=2, kills_ranks=True, paths=(_FORENSICS,),
          notes="3-rank jobs on one GPU: a skipped collective, a send without its recv (and "
                "the status table showing it blocked), a SIGSTOPped rank, the status table "
                "while a job hangs"),
    Stage("order", "NCCL's reduction order: the model's bits against real NCCL's", "pytest",
          240, 120, ranks=7, paths=(_ORDER,),
          notes="ncclpy order --observe --matrix proof: ranks 3 and 4 (hostid-socket: each "
                "rank its own node), Ring and Tree, LL/LL128/Simple, 1 and 2 channels, "
                "float32/bfloat16/float16, alignment path, one and several loops, the split's "
                "second channel; reduce_scatter and reduce on Ring; 0 mismatches"),
    Stage("bench", "bench sweep all_reduce 8 B - 256 MiB, n=2, ncclpy/cupy/torch", "bench",
          150, 45, ranks=2, exclusive=True,
          args=("all_reduce", "-b", "8", "-e", "256M", "-f", "2", "--nproc", "2",
                "--device", "cuda", "--backend", "ncclpy,cupy,torch")),
    # ~25 s of set-up (2 processes, torch, 4-5 communicators each), ~25 s of timed calls
    # (2 per-call modes x 4 sizes x 5 backends x 2,100 calls, plus 200 graph replays with a
    # barrier each and 200 captured calls per backend and size), ~10 s for bench.cuda_costs,
    # up to ~15 s for the offline install: ~75 s, bounded at twice that
    Stage("overhead", "host overhead per call, n=2: ncclpy (defaults), ncclpy-bare, cupy, "
          "torch, nccl4py where installed; CUDA calls' host cost", "overhead", 150, 60,
          ranks=2, exclusive=True,
          args=("--nproc", "2", "--modes", "eager,prepared,graph,capture", "--breakdown"),
          notes="bench/install_wheels.sh --optional first (nccl4py from wheels/, when carried "
                "along), then bench.overhead, then bench.cuda_costs (its JSON beside)"),
    # its own call (--stage nccl-tests), not the default proof's 480 s: ~60 s to build
    # nccl-tests from wheels/nccl-tests (16 cores), then per round 12 program runs (2
    # collectives x 3 modes x 2 programs).  Two ranks on one GPU talk over NCCL's socket
    # transport on loopback at ~3 GB/s busbw at 256 MiB (docs/gpu-runs.md, 2026-11-25 14:30,
    # H100: a 3-backend sweep to 256 MiB took 63 s), so one eager sweep to 256 MiB with -n 20
    # -w 5 -c 1, out of place and in place, is ~10-20 s, and a program's start-up 3-10 s (the
    # bench: Python, torch, 2 processes): ~120-160 s a round.  2 rounds (the fewest that give a
    # spread); the runner gets the stage's decided bound less 30 s as its --budget
    # (shard_commands) and starts no round that would not fit it
    Stage("nccl-tests", "nccl-tests 2.19.6 beside ncclpy's bench: all_reduce and sendrecv, "
          "8 B - 256 MiB, n=2, eager, graph, cputime", "nccl-tests", 420, 150, ranks=2,
          exclusive=True, on_request=True,
          args=("--nproc", "2", "--rounds", "2", "--carry", "wheels/nccl-tests"),
          notes="builds all_reduce_perf and sendrecv_perf from wheels/nccl-tests (python -m "
                "bench.nccl_tests_build prepare; carried along), then python -m "
                "bench.nccl_tests_side: the two programs interleaved, medians over rounds, "
                "the ratios and verdicts against the targets, the tables for "
                "docs/performance.md"),
)
NAMES: Tuple[str, ...] = tuple(s.name for s in STAGES)
#: the stages a run without --stage runs (the one-call proof)
DEFAULT: Tuple[str, ...] = tuple(s.name for s in STAGES if not s.on_request)
#: the stages that run only when --stage names them
ON_REQUEST: Tuple[str, ...] = tuple(s.name for s in STAGES if s.on_request)
#: the stages whose result is a stage, not tests (the GPU ledger records them as items)
TIMED: Tuple[str, ...] = tuple(s.name for s in STAGES
                               if s.kind in ("bench", "overhead", "nccl-tests"))


def by_name(name: str) -> Stage:
    """The stage called ``name`` (ValueError naming the stages that exist)."""
    for s in STAGES:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; the stages are: {', '.join(NAMES)}")


def select(names: Optional[Sequence[str]] = None) -> List[Stage]:
    """The stages to run, in the fixed order, each once.

    ``None`` or empty: all but the ``on_request`` ones.  Otherwise the named ones, plus ``info``
    (always first: the record of a run needs its versions).  Unknown names raise ValueError
    listing the names.
    """
    if not names:
        return [s for s in STAGES if not s.on_request]
    wanted = set()
    for n in names:
        wanted.add(by_name(n.strip()).name)
    wanted.add("info")
    return [s for s in STAGES if s.name in wanted]


def decide(stage: Stage, remaining_s: float) -> Tuple[bool, float, str]:
    """(run it?, its timeout, why not) with ``remaining_s`` seconds of budget left.

    A stage runs when at least ``min_s`` is left; its timeout is its own bound or what is
    left, whichever is smaller.
    """
    if remaining_s < stage.min_s:
        return False, 0.0, (f"not enough time left: needs at least {stage.min_s:.0f} s, "
                            f"{max(remaining_s, 0.0):.0f} s left of the budget")
    return True, float(min(stage.timeout_s, remaining_s)), ""


def prefix(stage: Stage) -> str:
    """File-name prefix of a stage's files: ``02-gpu2`` (``00-name`` outside STAGES)."""
    number = NAMES.index(stage.name) + 1 if stage.name in NAMES else 0
    return f"{number:02d}-{stage.name}"


def shard_prefix(stage: Stage, k: int) -> str:
    """File-name prefix of shard ``k`` (1-based): the stage's own when it has one shard."""
    return prefix(stage) if stage.shards <= 1 else f"{prefix(stage)}.s{k}"


def _pytest_args(stage: Stage) -> List[str]:
    args = list(stage.paths or stage.args)
    args += [f"--ignore={p}" for p in stage.ignore]
    if stage.worlds:
        args += ["--gpu-worlds", ",".join(str(w) for w in stage.worlds)]
    return args


#: seconds of a stage's bound the nccl-tests runner does not get as its --budget: SIGINT at the
#: bound, the grace after it, the stage's files
SIDE_MARGIN_S = 30.0


def shard_commands(stage: Stage, ctx: Ctx, timeout: Optional[float] = None) -> List[List[Cmd]]:
    """The exact command lines of ``stage`` (run from the repository root): one list per shard;
    the shards run at once, the commands of a shard one after another.  ``timeout``: the bound
    :func:`decide` gave it (default its own), which a command that bounds itself is told."""
    work, py = ctx.work, ctx.python
    bound = stage.timeout_s if timeout is None else min(stage.timeout_s, timeout)
    p = prefix(stage)
    if stage.kind == "info":
        return [[Cmd((py, "-m", "ncclpy.selftest.probe", os.path.join(work, f"{p}.json"))),
                 Cmd((py, "-m", "ncclpy", "info", "--torch"))]]
    if stage.kind == "pytest":
        out = []
        for k in range(1, max(1, stage.shards) + 1):
            sp = shard_prefix(stage, k)
            shard = ["--gpu-shard", f"{k}/{stage.shards}"] if stage.shards > 1 else []
            out.append([Cmd((py, "-m", "pytest", *_pytest_args(stage), *shard, "-m", "gpu", "-q",
                             "-rfEs", "-p", "no:cacheprovider",
                             "-p", "ncclpy.selftest.ledger_plugin",
                             f"--junitxml={os.path.join(work, sp + '.xml')}",
                             f"--basetemp={os.path.join(ctx.tmp, sp)}"),
                            env=((ARTIFACTS_ENV, work),))])
        return out
    if stage.kind == "bench":
        return [[Cmd((py, "-m", "bench", *stage.args, "-J", os.path.join(work, f"{p}.json")))]]
    if stage.kind == "overhead":
        return [[Cmd(("bash", "bench/install_wheels.sh", "--optional", "--python", py)),
                 Cmd((py, "-m", "bench.overhead", *stage.args,
                      "-J", os.path.join(work, f"{p}.json"))),
                 Cmd((py, "-m", "bench.cuda_costs", "--json",
                      os.path.join(work, f"{p}.{CUDA_COSTS_SUFFIX}")))]]
    if stage.kind == "nccl-tests":    # its build folder is not kept (nor packed)
        return [[Cmd((py, "-m", "bench.nccl_tests_side", *stage.args, "--out",
                      os.path.join(work, p), "--build-dir",
                      os.path.join(ctx.tmp, "nccl-tests-build"), "--budget",
                      f"{max(30.0, bound - SIDE_MARGIN_S):.0f}", "--python", py))]]
    if stage.kind == "cmd":           # ``python ARGS``: for stages made outside STAGES
        return [[Cmd((py, *stage.args))]]
    raise ValueError(f"stage {stage.name}: unknown kind {stage.kind!r}")


def commands(stage: Stage, ctx: Ctx, timeout: Optional[float] = None) -> List[Cmd]:
    """Every command line of ``stage``, shard after shard (what ``--list`` shows)."""
    return [c for shard in shard_commands(stage, ctx, timeout) for c in shard]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def stage_of(test_id: str, worlds: Sequence[int]) -> Optional[str]:
    """The stage that runs GPU test ``test_id`` (a pytest node id from the repository root)
    whose ``gpu_world`` marks say ``worlds``; None when no stage selects it."""
    path = test_id.split("::", 1)[0]
    top = max(worlds) if worlds else None
    for s in STAGES:
        if s.kind != "pytest" or not any(_under(path, p) for p in s.paths):
            continue
        if any(_under(path, p) for p in s.ignore):
            continue
        if s.worlds and (top is None or top not in s.worlds):
            continue
        return s.name
    return None
