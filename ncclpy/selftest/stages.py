"""The selftest's stages: what each runs, its time bound, and which of them a run does.

Pure data and arithmetic, no GPU and no subprocess: :func:`select` turns ``--stage`` names into
the ordered list to run, :func:`decide` says whether a stage still fits the time left and with
which timeout, and :func:`commands` gives a stage's exact command lines for a context (the
Python to use, the folder its files go to).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Cmd", "Ctx", "Stage", "STAGES", "NAMES", "DEFAULT_BUDGET_S", "RESERVE_S",
           "ARTIFACTS_ENV", "select", "decide", "commands", "prefix", "by_name"]

#: default global deadline (seconds): the device tool stops a command at 600 s
DEFAULT_BUDGET_S = 540.0
#: seconds kept back from the budget: a stopped command's grace (runner.GRACE_S, 15 s), then
#: packing the logs and writing the report
RESERVE_S = 25.0
#: environment variable through which GPU tests leave artifacts (check JSON) for the report
ARTIFACTS_ENV = "NCCLPY_GPU_ARTIFACTS"


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
    """A stage: ``timeout_s`` bounds it; it is not started with less than ``min_s`` left."""

    name: str
    title: str
    kind: str                       # info | pytest | bench | overhead | cmd
    timeout_s: float
    min_s: float
    args: Tuple[str, ...] = ()      # what the stage runs (kind-specific, see commands())
    checks: Tuple[int, ...] = ()    # world sizes whose ``ncclpy check`` JSON the stage leaves
    notes: str = ""


_GPU = "tests/gpu"
_CHECK = "tests/gpu/test_check_gpu.py"
_FORENSICS = "tests/gpu/test_forensics_gpu.py"
_PART2 = "tests/gpu/test_part2_gpu.py"
_NOT_COMM = ("--ignore=tests/gpu/test_examples_gpu.py", "--ignore=tests/gpu/test_bench_gpu.py",
             f"--ignore={_FORENSICS}", f"--ignore={_PART2}")
_NOT_CHECK = f"--ignore={_CHECK}"

STAGES: Tuple[Stage, ...] = (
    Stage("info", "versions and ncclpy info", "info", 60, 20,
          notes="Python, GPU, driver, NCCL, CuPy, torch (+CUDA, NCCL), MPS; `ncclpy info`"),
    Stage("gpu2", "GPU tests at world sizes 1-2", "pytest", 240, 90,
          args=(_GPU, "--gpu-worlds", "1,2", *_NOT_COMM, _NOT_CHECK),
          notes="collective matrix at 1 and 2 ranks, streams, graphs, registration, "
                "nonblocking, split, NCCL_COMM_BLOCKING=0, torch tensors"),
    Stage("check2", "ncclpy check -n 2 --backend nccl, bit for bit against torch", "pytest",
          360, 120, args=(_CHECK, "--gpu-worlds", "2"), checks=(2,),
          notes="CUDA_VISIBLE_DEVICES=0 (both ranks on one GPU), JSON kept; injected "
                "corruption must fail"),
    Stage("worlds34", "GPU tests at world sizes 3-4", "pytest", 240, 90,
          args=(_GPU, "--gpu-worlds", "3,4", *_NOT_COMM, _NOT_CHECK),
          notes="collective matrix at 3 and 4 ranks, split, nonblocking split"),
    Stage("part2", "NCCL 2.27-2.32 part 2: windows, RMA, shrink, grow, suspend", "pytest",
          300, 90, args=(_PART2,),
          notes="window collectives vs the reference, put/signal/wait, suspend/resume with "
                "memory statistics, revoke+shrink; 3-rank jobs: shrink after a SIGKILLed rank, "
                "grow 2 -> 3"),
    Stage("check4", "ncclpy check -n 4 --backend nccl, bit for bit against torch", "pytest",
          420, 120, args=(_CHECK, "--gpu-worlds", "4"), checks=(4,),
          notes="4 ranks on one GPU"),
    Stage("bench", "bench sweep all_reduce 8 B - 256 MiB, n=2, ncclpy/cupy/torch", "bench",
          240, 60, args=("all_reduce", "-b", "8", "-e", "256M", "-f", "2", "--nproc", "2",
                         "--device", "cuda", "--backend", "ncclpy,cupy,torch")),
    Stage("overhead", "host overhead per call, n=2, ncclpy/cupy/torch", "overhead", 150, 45,
          args=("--nproc", "2", "--backend", "ncclpy,cupy,torch")),
    Stage("examples", "every example, spawned and under ncclpy run", "pytest", 480, 120,
          args=("tests/gpu/test_examples_gpu.py",)),
    Stage("benchtests", "bench GPU tests (every collective, dtypes, graphs, torch)", "pytest",
          480, 120, args=("tests/gpu/test_bench_gpu.py",)),
    Stage("forensics", "hang forensics: flight recorder, ncclpy trace, ncclpy status", "pytest",
          360, 90, args=(_FORENSICS,),
          notes="3-rank jobs on one GPU: a skipped collective, a send without its recv (and "
                "the status table showing it blocked), a SIGSTOPped rank, the status table "
                "while a job hangs"),
)
NAMES: Tuple[str, ...] = tuple(s.name for s in STAGES)


def by_name(name: str) -> Stage:
    """The stage called ``name`` (ValueError naming the stages that exist)."""
    for s in STAGES:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; the stages are: {', '.join(NAMES)}")


def select(names: Optional[Sequence[str]] = None) -> List[Stage]:
    """The stages to run, in the fixed order (most valuable first), each once.

    ``None`` or empty: all of them.  Otherwise the named ones, plus ``info`` (always first: the
    record of a run needs its versions).  Unknown names raise ValueError listing the names.
    """
    if not names:
        return list(STAGES)
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


def commands(stage: Stage, ctx: Ctx) -> List[Cmd]:
    """The exact command lines of ``stage`` (run from the repository root)."""
    p, work = prefix(stage), ctx.work
    py = ctx.python
    if stage.kind == "info":
        return [Cmd((py, "-m", "ncclpy.selftest.probe", os.path.join(work, f"{p}.json"))),
                Cmd((py, "-m", "ncclpy", "info", "--torch"))]
    if stage.kind == "pytest":
        return [Cmd((py, "-m", "pytest", *stage.args, "-m", "gpu", "-q", "-rfEs",
                     "-p", "no:cacheprovider", f"--junitxml={os.path.join(work, p + '.xml')}",
                     f"--basetemp={os.path.join(ctx.tmp, p)}"),
                    env=((ARTIFACTS_ENV, work),))]
    if stage.kind == "bench":
        return [Cmd((py, "-m", "bench", *stage.args, "-J", os.path.join(work, f"{p}.json")))]
    if stage.kind == "overhead":
        return [Cmd((py, "-m", "bench.overhead", *stage.args,
                     "-J", os.path.join(work, f"{p}.json")))]
    if stage.kind == "cmd":           # ``python ARGS``: for stages made outside STAGES
        return [Cmd((py, *stage.args))]
    raise ValueError(f"stage {stage.name}: unknown kind {stage.kind!r}")

