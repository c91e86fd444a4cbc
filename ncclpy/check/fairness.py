"""What makes the GPU comparison fair: one libnccl for both sides, one NCCL environment, and the
same placement of ranks on GPUs however the ranks were started.

* :data:`PINS` / :func:`fairness_env`: the variables both sides share, with the value ``ncclpy
  check`` sets when the user has not (a user's own value is kept and reported).  Algorithm,
  protocol *and* channel count are pinned: the channel count decides how NCCL cuts the buffer
  into rings, hence the reduction order of each element.
* :func:`libnccl_report`: which libnccl each side really calls.  torch's is found by resolving
  ``ncclGetVersion`` through torch's CUDA library handle and asking the dynamic loader which
  file defines it (``dladdr``); ncclpy's is the file it bound (the one CuPy's NCCL module is
  linked to).  Both real paths, both versions and every libnccl file mapped into the process
  are compared; any difference is a problem that fails the run.
* :func:`apply_launcher_placement`: under torchrun (which knows nothing of ranks sharing a GPU)
  the same placement as ``ncclpy run`` (:mod:`ncclpy.launch.placement`) is applied before NCCL
  starts; ``ncclpy run`` and :func:`ncclpy.spawn` have already done it (``NCCLPY_DEVICE`` set).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, MutableMapping, Optional, Tuple

from .._nccl.loaded import mapped_paths, symbol_library, torch_libnccl

__all__ = ["PINS", "fairness_env", "libnccl_report", "symbol_library", "torch_libnccl",
           "apply_launcher_placement", "mapped_paths"]

#: variables both sides must share: (name, value set when the user has not set it, why)
PINS: Tuple[Tuple[str, str, str], ...] = (
    ("NCCL_ALGO", "Ring", "same algorithm on both sides"),
    ("NCCL_PROTO", "Simple", "same protocol on both sides"),
    ("NCCL_MIN_NCHANNELS", "2", "same channel count (it decides each element's reduction order)"),
    ("NCCL_MAX_NCHANNELS", "2", "same channel count (it decides each element's reduction order)"),
    ("NCCL_NVLS_ENABLE", "0", "no NVLS (NVLink SHARP) unless --nvls"),
    ("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0", "torch: no buffer registration hook"),
    ("ENABLE_INTRA_NODE_COMM", "0", "torch: no intra-node custom all-reduce"),
    ("TORCH_NCCL_INTRA_NODE_COMM", "0", "torch: no intra-node custom all-reduce (newer name)"),
    ("TORCH_NCCL_NAN_CHECK", "0", "torch: no NaN check (data-movement inputs carry NaN bits)"),
)


def fairness_env(nvls: bool, env: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str],
                                                                            List[str], List[str]]:
    """(variables to set, 'K=V' pinned, 'K=V' kept from the user) for the GPU comparison."""
    env = dict(os.environ) if env is None else env
    out: Dict[str, str] = {}
    pinned: List[str] = []
    kept: List[str] = []
    for k, v, _why in PINS:
        if k == "NCCL_NVLS_ENABLE" and nvls:
            continue
        if k in env:
            kept.append(f"{k}={env[k]}")
        else:
            out[k] = v
            pinned.append(f"{k}={v}")
    return out, pinned, kept


def _files(paths: List[str]) -> List[str]:
    """Real paths, one per distinct file (device, inode)."""
    seen, out = set(), []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(os.path.realpath(p))
    return out


def _version_str(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return ".".join(str(x) for x in v)
    return str(v)


def libnccl_report(torch_version: Any, ncclpy_path: Optional[str],
                   ncclpy_version: Optional[str]) -> Dict[str, Any]:
    """Both sides' libnccl (real paths, versions), every mapped libnccl file, and the problems
    that make the comparison unfair (an empty list: the same library on both sides)."""
    from .._nccl.lib import loaded_nccl_paths
    tpath, how = torch_libnccl()
    npath = os.path.realpath(ncclpy_path) if ncclpy_path else None
    mapped = _files(loaded_nccl_paths())
    tver = _version_str(torch_version)
    problems: List[str] = []
    if tpath is None:
        problems.append(f"cannot tell which libnccl torch calls ({how})")
    if npath is None:
        problems.append("ncclpy bound no libnccl")
    if tpath and npath and not _same_file(tpath, npath):
        problems.append(f"torch calls {tpath} but ncclpy calls {npath}")
    if ncclpy_version is not None and tver != ncclpy_version:
        problems.append(f"torch reports NCCL {tver} but ncclpy's libnccl is {ncclpy_version}")
    if len(mapped) > 1:
        problems.append(f"{len(mapped)} different libnccl files are loaded: {', '.join(mapped)}")
    return {"torch_libnccl": tpath, "torch_found_by": how, "torch_nccl_version": tver,
            "ncclpy_libnccl": npath, "ncclpy_nccl_version": ncclpy_version,
            "all_libnccl": mapped, "same": not problems, "problems": problems}


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


# -- placement under torchrun ---------------------------------------------------------------
def apply_launcher_placement(env: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """When ranks were started by a launcher that does not place them (torchrun: no
    ``NCCLPY_DEVICE``), apply :mod:`ncclpy.launch.placement`'s plan for this local rank to
    ``env`` (default os.environ): its NCCL variables (e.g. ``NCCL_MULTI_RANK_GPU_ENABLE=1``
    when ranks share a GPU) and ``NCCLPY_DEVICE``.  Returns the placement summary, or None when
    there was nothing to do."""
    env = os.environ if env is None else env
    if env.get("NCCLPY_DEVICE") is not None:
        return None
    from ..launch import placement as P
    world = int(env.get("WORLD_SIZE") or 1)
    local_n = int(env.get("LOCAL_WORLD_SIZE") or world)
    local_rank = int(env.get("LOCAL_RANK") or env.get("RANK") or 0)
    ngpus = P.visible_gpu_count(env)
    shares = ngpus > 0 and local_n > ngpus
    version = P.loaded_nccl_version() if shares else None
    # more than 2 ranks per GPU: the CTA limit needs the GPUs' SM count (read in a child)
    sms = P.gpu_sm_count(env) if shares and -(-local_n // ngpus) > 2 else None
    plan = P.plan_placement(local_n, ngpus, version, single_node=world == local_n, env=env,
                            sm_count=sms)
    env.update(plan.env(local_rank))
    env["NCCLPY_DEVICE"] = str(plan.device(local_rank))
    return P.summary_line("ncclpy check", plan)
