"""What the stages share on one GPU: how many run at once, one CUDA MPS daemon for the whole
run, and a CTA limit that lets every rank running at once fit on the GPU's SMs.

Several ranks already share one GPU in every multi-rank test; running stages side by side only
raises the number.  NCCL's docs (``NCCL_MULTI_RANK_GPU_ENABLE``, 2.30): ranks sharing a GPU
must leave enough SMs for each other or NCCL hangs; so the shared stages get ``NCCL_MAX_CTAS =
SMs // (2 x capacity)`` (:func:`ncclpy.launch.placement.cta_limit`'s rule, with room for two
communicators per rank; the user's own value is kept), and one MPS daemon serves every rank of
the run (each ``ncclpy run`` / ``ncclpy.spawn`` then finds it through ``CUDA_MPS_PIPE_DIRECTORY``
and starts none of its own; the daemon's ``CUDA_VISIBLE_DEVICES`` is not the ranks').  One
daemon also means one fault domain: a fatal GPU error in one client reaches every client of the
server (2026-11-26 and 27 on an H200: a rank SIGKILLed with a kernel in flight left every other
client with ``cudaErrorIllegalAddress``, then ``cudaErrorMpsServerNotReady``).  So a stage whose
tests kill ranks (``Stage.kills_ranks``) runs outside it, in a fault domain of its own:
``CUDA_MPS_PIPE_DIRECTORY`` names an empty folder, where the CUDA driver finds no daemon and
runs the process without MPS (NVIDIA's ``nvidia-cuda-mps-control`` manual: "If the connection
attempt fails, the program continues to run as it normally would without MPS"), and
``NCCLPY_MPS=off`` keeps its jobs from starting daemons of their own.  That needs the GPU in
the Default compute mode: under ``Exclusive_Process`` (what NVIDIA's MPS guide sets) only the
MPS server may hold a context ("exclusive-mode restrictions are applied to the MPS server"), so
there such stages stay clients of the server and the report says so.  ``--mps off`` runs
every stage without MPS.  The timed stages (bench, overhead) run alone, without the CTA limit.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

__all__ = ["RunEnv", "prepare", "default_jobs", "default_capacity", "compute_modes"]


def default_jobs(cpus: Optional[int] = None) -> int:
    """Commands at once: half the cores, at least 1, at most 8 (one GPU)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def default_capacity(cpus: Optional[int] = None) -> int:
    """Ranks at once (a stage's ``ranks`` is its peak): the cores less two for the pytest and
    selftest processes; at least 4."""
    cpus = cpus or os.cpu_count() or 1
    return max(4, cpus - 2)


@dataclass
class RunEnv:
    """The run's shared settings: variables for the shared stages and for every stage, the
    MPS daemon started (stopped by :meth:`close`), and a note for the report."""

    jobs: int
    capacity: int
    shared_env: Dict[str, str] = field(default_factory=dict)
    all_env: Dict[str, str] = field(default_factory=dict)
    notes: Dict[str, Any] = field(default_factory=dict)
    mps: Any = None
    #: variables the stages must not inherit (the MPS daemon's CUDA_VISIBLE_DEVICES)
    unset: Tuple[str, ...] = ()
    #: the empty folder the stages that kill ranks get as CUDA_MPS_PIPE_DIRECTORY (made once)
    no_mps_dir: Optional[str] = None
    #: False where a process outside the MPS server cannot use the GPU (an exclusive mode)
    isolate: bool = True

    def env_for(self, exclusive: bool, kills_ranks: bool = False) -> Dict[str, Optional[str]]:
        """A stage's additions to its environment (None: a variable it must not inherit).
        ``kills_ranks``: the stage runs outside any MPS server (the module's docstring)."""
        out: Dict[str, Optional[str]] = dict(self.all_env)
        if not exclusive:
            out.update(self.shared_env)
        out.update({k: None for k in self.unset})
        if kills_ranks and self.isolate:
            if self.no_mps_dir is None:
                self.no_mps_dir = tempfile.mkdtemp(prefix="ncclpy-no-mps-")
            out.update(NCCLPY_MPS="off", CUDA_MPS_PIPE_DIRECTORY=self.no_mps_dir,
                       CUDA_MPS_LOG_DIRECTORY=None)
        return out

    def close(self, failed: bool = False) -> None:
        mps, self.mps = self.mps, None
        if mps is not None:
            mps.stop(failed=failed)
        empty, self.no_mps_dir = self.no_mps_dir, None
        if empty is not None:
            shutil.rmtree(empty, ignore_errors=True)


def compute_modes() -> List[str]:
    """nvidia-smi's compute mode of each GPU ([] where nvidia-smi cannot say)."""
    from .probe import nvidia_smi
    return [row[0] for row in nvidia_smi(["compute_mode"]) if row]


def prepare(jobs: int, capacity: int, env: Optional[Mapping[str, str]] = None,
            mps_mode: str = "auto", biggest: int = 1,
            modes: Optional[Callable[[], List[str]]] = None) -> RunEnv:
    """The run's :class:`RunEnv`: the CTA limit when stages share the GPU (``jobs`` > 1 and the
    SM count is known), an MPS daemon when ``mps_mode`` allows one (``"off"``: none).

    The limit leaves room for twice the ranks at once (``capacity``, or ``biggest``, the largest
    stage, which runs alone when it does not fit): a rank may hold two communicators' kernels on
    the GPU at once (torch's and ncclpy's in the check, a parent and its split child)."""
    from ncclpy.errors import LaunchError
    from ncclpy.launch import placement
    from ncclpy.launch.mps import setup_mps
    env = dict(os.environ if env is None else env)
    out = RunEnv(jobs, capacity)
    out.notes.update(jobs=jobs, capacity=capacity)
    if jobs > 1:
        if env.get("NCCL_MAX_CTAS"):
            out.notes["max_ctas"] = f"{env['NCCL_MAX_CTAS']} (yours, kept)"
        else:
            sms = placement.gpu_sm_count(env)
            room = 2 * max(capacity, biggest)
            limit = placement.cta_limit(room, sms, placement.loaded_nccl_version())
            if sms and limit:
                out.shared_env["NCCL_MAX_CTAS"] = str(limit)
                out.notes["max_ctas"] = (f"{limit} ({sms} SMs / 2 x {max(capacity, biggest)} "
                                         f"ranks at once)")
            else:
                out.notes["max_ctas"] = "not set (SM count unknown)"
    if mps_mode == "off":           # and no job starts one of its own either
        out.all_env["NCCLPY_MPS"] = "off"
        out.notes["mps"] = "off (--mps off: none for the run, none per job)"
        return out
    try:
        setup = setup_mps(mps_mode, True, env, name="selftest --mps")
    except LaunchError:
        raise                       # --mps on, and it cannot be had: the caller says why
    except Exception as e:  # noqa: BLE001 - the run goes on without MPS, and says so
        out.notes["mps"] = f"none: {e}"
        return out
    out.notes["mps"] = setup.status or "none"
    if setup.daemon is not None:
        out.mps = setup
        out.all_env.update(setup.env)
        out.unset = tuple(setup.unset)
    exclusive = [m for m in (modes or compute_modes)() if m.lower() != "default"]
    if exclusive:
        out.isolate = False
        out.notes["mps"] += (f"; compute mode {exclusive[0]}: a process outside the MPS server "
                             f"cannot use the GPU, so the stages that kill ranks run as its "
                             f"clients too (one killed rank may fault the others)")
    return out
