"""``ncclpy info``: what ncclpy, CuPy, NCCL, CUDA and the environment look like from here.

``collect()`` gathers everything into a JSON-able dict, section by section: a section that fails
records its error and the rest is still reported.  Nothing here needs a GPU; without one the
report says so plainly.  torch is never imported unless ``collect(import_torch=True)``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from typing import Any, Mapping, Optional

from .rendezvous import ENV_VARS as _RENDEZVOUS_VARS

__all__ = ["collect", "format_info", "loaded_library_path", "rendezvous_env", "ENV_NAMES",
           "ENV_PREFIXES", "MASKED", "no_gpu_reason", "gpu_device_reason", "NO_DRIVER",
           "torch_build"]

#: Exact variable names reported: every variable :func:`ncclpy.rendezvous.resolve` reads
#: (torchrun, Open MPI, MPICH/PMI/PMIx, SLURM, ``NCCLPY_*``) plus device selection.
ENV_NAMES: tuple[str, ...] = tuple(sorted(set(_RENDEZVOUS_VARS) | {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE",
    "PMIX_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST",
    "SLURM_NODELIST", "SLURM_STEP_NODELIST",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
}))
#: Variable prefixes reported.
ENV_PREFIXES = ("NCCL_", "NCCLPY_", "OMPI_COMM_WORLD_", "PMI_")
#: Variables whose value is never shown.
MASKED = ("NCCLPY_STORE_TOKEN",)

_INSTALL_HINT = "pip install 'ncclpy[cu13]' (CUDA 13) or 'ncclpy[cu12]' (CUDA 12)"
#: the words for a machine without a CUDA driver (libcuda), in ``ncclpy info`` and skip reasons
NO_DRIVER = "no CUDA driver"
_NO_LIBNCCL = "CuPy cannot load libnccl (install nvidia-nccl-cu12/cu13 or set LD_LIBRARY_PATH)"


def _no_cupy_reason() -> str:
    """Why CuPy cannot be used ('' if it can): what ``ncclpy info`` says in its GPUs line."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return f"CuPy is not usable ({type(e).__name__}: {e})"
    return ""


def gpu_device_reason() -> str:
    """'' when CuPy sees at least one CUDA GPU, else why not, in the words ``ncclpy info``
    prints after "GPUs: none visible": CuPy missing, :data:`NO_DRIVER`, the CUDA error, or no
    GPU (with ``CUDA_VISIBLE_DEVICES`` when it is set)."""
    why = _no_cupy_reason()
    if why:
        return why
    from cupy.cuda import runtime
    try:
        drv = int(runtime.driverGetVersion())
    except Exception:
        drv = 0
    if not drv:
        return NO_DRIVER
    try:
        n = int(runtime.getDeviceCount())
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if n < 1:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no CUDA GPU" + (f" with CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "")
    return ""


def no_gpu_reason() -> str:
    """'' when a CUDA GPU and NCCL are usable from here, else why not: the one reason
    ``ncclpy info``, the GPU tests' skips and the examples give (see :func:`gpu_device_reason`;
    a missing CuPy adds the install hint, a missing libnccl says so)."""
    why = gpu_device_reason()
    if why:
        return f"{why}; {_INSTALL_HINT}" if why.startswith("CuPy is not") else why
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            return _NO_LIBNCCL
    except Exception as e:
        return f"cupy.cuda.nccl unavailable ({type(e).__name__}: {e})"
    return ""


def _version_str(code: int) -> str:
    from .semantics.ops import format_version
    return format_version(int(code))


def _cuda_version_str(code: int) -> str:
    """'13.2' from CUDA's 13020."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def loaded_library_path(stem: str = "libnccl.so") -> Optional[str]:
    """Path of the shared library whose file name starts with ``stem`` mapped into this process.

    Reads ``/proc/self/maps`` (Linux); None when not mapped or not readable.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith(stem):
                        return path
    except OSError:
        return None
    return None


def rendezvous_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The NCCL_* and rendezvous variables in ``env`` (default os.environ), secrets masked."""
    env = os.environ if env is None else env
    out = {}
    for k in sorted(env):
        if k in ENV_NAMES or k.startswith(ENV_PREFIXES):
            v = env[k]
            out[k] = "<set, hidden>" if k in MASKED else v
    return out


def _cupy_section() -> dict[str, Any]:
    d: dict[str, Any] = {}
    if importlib.util.find_spec("cupy") is None:
        d["installed"] = False
        d["hint"] = _INSTALL_HINT
        return d
    try:
        import cupy
    except Exception as e:
        d.update(installed=True, error=f"import cupy failed: {type(e).__name__}: {e}",
                 hint=_INSTALL_HINT)
        return d
    d.update(installed=True, version=cupy.__version__)
    return d


def _nccl_section() -> dict[str, Any]:
    d: dict[str, Any] = {}
    try:
        from cupy.cuda import nccl
    except Exception as e:
        d["error"] = f"cupy.cuda.nccl unavailable: {type(e).__name__}: {e}"
        return d
    if not getattr(nccl, "available", True):
        d["error"] = _NO_LIBNCCL
        return d
    for key, fn in (("runtime", "get_version"), ("build", "get_build_version")):
        try:
            code = int(getattr(nccl, fn)())
            d[key] = code
            d[key + "_str"] = _version_str(code)
        except Exception as e:
            d[key + "_error"] = f"{type(e).__name__}: {e}"
    d["library"] = loaded_library_path("libnccl.so")
    return d


def _cuda_section() -> dict[str, Any]:
    d: dict[str, Any] = {"gpus": []}
    try:
        from cupy.cuda import runtime
    except Exception as e:
        d["error"] = f"CUDA runtime unavailable (CuPy: {type(e).__name__}: {e})"
        d["gpus_note"] = "none visible (CuPy not usable)"
        return d
    try:
        drv = int(runtime.driverGetVersion())
        d["driver"] = drv
        d["driver_str"] = _cuda_version_str(drv) if drv else NO_DRIVER
    except Exception as e:
        d["driver"] = 0
        d["driver_str"] = f"{NO_DRIVER} ({type(e).__name__}: {e})"
    try:
        rt = int(runtime.runtimeGetVersion())
        d["runtime"] = rt
        d["runtime_str"] = _cuda_version_str(rt)
    except Exception as e:
        d["runtime_error"] = f"{type(e).__name__}: {e}"
    why = gpu_device_reason()       # the same words as the GPU tests' skip reason
    if why:
        d["gpus_note"] = f"none visible ({why})"
        return d
    try:
        n = int(runtime.getDeviceCount())
    except Exception as e:  # pragma: no cover - a device lost between the two calls
        d["gpus_note"] = f"none visible ({type(e).__name__}: {e})"
        return d
    for i in range(n):
        g: dict[str, Any] = {"index": i}
        try:
            p = runtime.getDeviceProperties(i)
            name = p.get("name", b"?")
            g["name"] = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            g["memory_bytes"] = int(p.get("totalGlobalMem", 0))
            g["compute_capability"] = f"{p.get('major', '?')}.{p.get('minor', '?')}"
            g["pci_bus_id"] = (f"{p.get('pciDomainID', 0):04x}:{p.get('pciBusID', 0):02x}:"
                               f"{p.get('pciDeviceID', 0):02x}")
        except Exception as e:
            g["error"] = f"{type(e).__name__}: {e}"
        d["gpus"].append(g)
    return d


def torch_build(version_file: Optional[str] = None) -> dict[str, Optional[str]]:
    """torch's own version (``torch.__version__``, with the wheel's local tag: ``2.15.0+cu132``,
    ``2.13.0+cpu``) and what it was built for, read from ``torch/version.py`` without importing
    torch.  pip's version of the wheel (its metadata) may lack the local tag (the package
    index's CUDA wheel of 2.15 says ``2.15.0``), so it is reported apart, never used as torch's.
    Keys: version, cuda, hip (None where unknown or absent), build ("CUDA 13.2", "ROCm 6.4",
    "CPU")."""
    out: dict[str, Optional[str]] = {"version": None, "cuda": None, "hip": None, "build": None}
    if version_file is None:
        spec = importlib.util.find_spec("torch")
        locs = list(spec.submodule_search_locations or []) if spec is not None else []
        version_file = os.path.join(locs[0], "version.py") if locs else None
    try:
        with open(version_file or "", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return out
    for key in ("__version__", "cuda", "hip"):
        m = re.search(rf"^{key}\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.M)
        out[key.strip("_")] = m.group(1) if m else None
    out["build"] = (f"CUDA {out['cuda']}" if out["cuda"] else f"ROCm {out['hip']}" if out["hip"]
                    else "CPU" if out["version"] else None)
    return out


def _torch_section(import_torch: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"installed": importlib.util.find_spec("torch") is not None}
    if not d["installed"]:
        return d
    b = torch_build()
    d["wheel_version"] = _dist_version("torch")          # pip's view; may lack "+cu132"
    d["version"] = b["version"] or d["wheel_version"]
    d["build"] = b["build"]
    if import_torch:
        try:
            import torch
            d["version"] = torch.__version__
            d["cuda_available"] = bool(torch.cuda.is_available())
            d["cuda"] = torch.version.cuda
            d["build"] = (f"CUDA {torch.version.cuda}" if torch.version.cuda else
                          f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None)
                          else "CPU")
            d.update(_torch_nccl(torch))
        except Exception as e:
            d["error"] = f"import torch failed: {type(e).__name__}: {e}"
    return d


def _torch_nccl(torch: Any) -> dict[str, Any]:
    """torch's NCCL: its version and the libnccl file it calls (a CUDA wheel carries one, also
    on a machine without a GPU; a CPU wheel none, which is said, never guessed)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available()):
        return {"nccl": "none (this torch is built without NCCL)", "libnccl": None}
    out: dict[str, Any] = {}
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        out["nccl"] = f"unavailable ({type(e).__name__})"
    from ._nccl.loaded import torch_libnccl
    out["libnccl"], how = torch_libnccl()
    if out["libnccl"] is None:
        out["libnccl_note"] = how
    return out


def _safe(fn: Any) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # pragma: no cover - defensive: one broken section, not the report
        return {"error": f"{type(e).__name__}: {e}", "gpus": []}


def collect(import_torch: bool = False) -> dict[str, Any]:
    """Everything ``ncclpy info`` reports, as a JSON-able dict."""
    from ._version import __version__
    try:
        import numpy
        np_version: Optional[str] = numpy.__version__
    except Exception:
        np_version = None
    d: dict[str, Any] = {
        "ncclpy": __version__,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "numpy": np_version,
    }
    d["cupy"] = _safe(_cupy_section)
    if d["cupy"].get("version"):
        d["nccl"] = _safe(_nccl_section)
        d["cuda"] = _safe(_cuda_section)
    else:
        why = _no_cupy_reason() or "CuPy is not usable"
        d["nccl"] = {"error": f"{why}; {_INSTALL_HINT}"}
        d["cuda"] = {"error": why, "gpus": [], "gpus_note": f"none visible ({why})"}
    d["torch"] = _torch_section(import_torch)
    d["cpu_backend"] = _cpu_backend_section()
    d["env"] = rendezvous_env()
    return d


def _cpu_backend_section() -> dict[str, Any]:
    """Whether the CPU backend (``ncclpy.init(device="cpu")``) can run here, and what it
    models (it is not NCCL)."""
    from .cpu.backend import MODELLED_VERSION, cannot_run
    why = cannot_run()
    v = MODELLED_VERSION
    return {"available": why is None, "error": why,
            "models": f"{v // 10000}.{v // 100 % 100}.{v % 100}"}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def format_info(d: Mapping[str, Any]) -> str:
    """Human-readable report of a :func:`collect` dict."""
    lines = []

    def row(k: str, v: Any) -> None:
        lines.append(f"{k + ':':<22}{v}")

    row("ncclpy", d.get("ncclpy"))
    row("Python", f"{d.get('python')} ({d.get('python_executable')})")
    row("platform", d.get("platform"))
    row("numpy", d.get("numpy") or "not installed")
    cp = d.get("cupy", {})
    if cp.get("version"):
        row("CuPy", cp["version"])
    elif cp.get("installed"):
        row("CuPy", f"not importable: {cp.get('error')} ({cp.get('hint')})")
    else:
        row("CuPy", f"not installed ({cp.get('hint', _INSTALL_HINT)})")
    nc = d.get("nccl", {})
    if nc.get("error"):
        row("NCCL", nc["error"])
    else:
        row("NCCL runtime", nc.get("runtime_str") or f"unknown ({nc.get('runtime_error')})")
        row("NCCL build (CuPy)", nc.get("build_str") or f"unknown ({nc.get('build_error')})")
        row("libnccl loaded", nc.get("library") or "not found in /proc/self/maps")
    cu = d.get("cuda", {})
    if cu.get("error"):
        row("CUDA", cu["error"])
    else:
        row("CUDA driver", cu.get("driver_str", "unknown"))
        row("CUDA runtime", cu.get("runtime_str") or f"unknown ({cu.get('runtime_error')})")
    gpus = cu.get("gpus") or []
    if not gpus:
        row("GPUs", cu.get("gpus_note", "none visible"))
    else:
        row("GPUs", len(gpus))
        for g in gpus:
            if "error" in g:
                lines.append(f"  GPU {g['index']}: {g['error']}")
            else:
                lines.append(f"  GPU {g['index']}: {g['name']}, {_gib(g['memory_bytes'])}, "
                             f"compute {g['compute_capability']}, PCI {g['pci_bus_id']}")
    cb = d.get("cpu_backend", {})
    if cb:
        if cb.get("available"):
            row("CPU backend", f"available: ncclpy.init(device='cpu') / ncclpy run --cpu "
                               f"(NCCL {cb.get('models')}'s semantics on host memory; not NCCL)")
        else:
            row("CPU backend", f"not available: {cb.get('error')}")
    t = d.get("torch", {})
    if not t.get("installed"):
        row("torch", "not installed")
    else:
        extra = []
        if t.get("build"):
            extra.append(f"{t['build']} build")
        if t.get("wheel_version") and t["wheel_version"] != t.get("version"):
            extra.append(f"pip: {t['wheel_version']}")
        if "cuda_available" in t:
            extra.append(f"CUDA available: {t['cuda_available']}")
            extra.append(f"NCCL {t.get('nccl')}")
            if t.get("libnccl"):
                extra.append(f"libnccl {t['libnccl']}")
        if t.get("error"):
            extra.append(t["error"])
        suffix = f" ({', '.join(extra)})" if extra else ""
        row("torch", (t.get("version") or "installed") + suffix)
    env = d.get("env", {})
    if env:
        lines.append("environment:")
        for k, v in env.items():
            lines.append(f"  {k}={v}")
    else:
        lines.append("environment:          no NCCL_* or rendezvous variables set")
    return "\n".join(lines)
