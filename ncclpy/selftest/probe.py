"""Is there a GPU, and what is this machine: versions for the record of a run.

:func:`cuda_reason` is what the selftest asks before anything else (empty when a CUDA GPU and
NCCL are usable).  ``python -m ncclpy.selftest.probe FILE`` is the ``info`` stage: it writes
:func:`collect` as JSON to FILE and prints it readably.  The NVIDIA driver version comes from
NVML (nvidia-ml-py) or ``nvidia-smi``; MPS is "present" when ``nvidia-cuda-mps-control`` is on
the PATH; the test tools the pytest stages need (pytest, pytest-timeout) are listed, and a
missing one fails the stage with its name.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["cuda_reason", "nvidia_driver", "nvidia_smi", "collect", "main", "test_tools",
           "TEST_TOOLS"]

log = logging.getLogger(__name__)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def cuda_reason() -> str:
    """Empty when a CUDA device and CuPy's NCCL are usable here, else why not (one line): the
    reason ``ncclpy info`` gives (``ncclpy.info.no_gpu_reason``) where it exists."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from ncclpy.info import no_gpu_reason
        except ImportError:
            pass
        else:
            try:
                return _one_line(no_gpu_reason())
            except Exception as e:  # noqa: BLE001 - a broken install is a reason too
                return _one_line(f"{type(e).__name__}: {e}")
        try:
            import cupy
        except Exception as e:  # ImportError, or a broken CUDA install
            return _one_line(f"CuPy is not importable: {type(e).__name__}: {e}")
        try:
            n = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as e:  # CUDARuntimeError: no driver, insufficient driver, ...
            return _one_line(f"{type(e).__name__}: {e}")
        if n < 1:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            return "the CUDA runtime sees 0 devices" + (
                f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else "")
        try:
            from cupy.cuda import nccl
            if not getattr(nccl, "available", True):
                return "CuPy cannot load libnccl (install nvidia-nccl-cu12/cu13)"
        except Exception as e:
            return _one_line(f"cupy.cuda.nccl is unavailable: {type(e).__name__}: {e}")
    return ""


def nvidia_driver() -> Optional[str]:
    """The NVIDIA driver version (``580.159.04``), or None where neither NVML nor nvidia-smi
    answers."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:
        log.debug("NVML: %s", e)
    rows = nvidia_smi(["driver_version"])
    return rows[0][0] if rows and rows[0] else None


def nvidia_smi(fields: Sequence[str]) -> List[List[str]]:
    """``nvidia-smi --query-gpu=FIELDS`` rows ([] where nvidia-smi is absent or fails)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        p = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("nvidia-smi: %s", e)
        return []
    if p.returncode != 0:
        return []
    return [[c.strip() for c in line.split(",")] for line in p.stdout.splitlines() if line.strip()]


#: what the pytest stages need besides ncclpy's own dependencies (module -> pip name)
TEST_TOOLS = {"pytest": "pytest", "pytest_timeout": "pytest-timeout"}


def test_tools() -> Dict[str, Optional[str]]:
    """The version of each of :data:`TEST_TOOLS` importable here (None: missing)."""
    import importlib
    out: Dict[str, Optional[str]] = {}
    for mod, pip in TEST_TOOLS.items():
        try:
            m = importlib.import_module(mod)
        except Exception:  # noqa: BLE001 - absent or broken: missing either way
            out[pip] = None
        else:
            out[pip] = str(getattr(m, "__version__", "?"))
    return out


def collect() -> Dict[str, Any]:
    """``ncclpy info`` (with torch) plus the NVIDIA driver, nvidia-smi's view, MPS, the date."""
    from ncclpy.info import collect as info_collect
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ni = info_collect(import_torch=True)
    smi = nvidia_smi(["name", "driver_version", "memory.total", "compute_mode"])
    tools = test_tools()
    return {
        "test_tools": tools,
        "missing_tools": [name for name, v in tools.items() if v is None],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "ncclpy_info": ni,
        "nvidia_driver": nvidia_driver(),
        "nvidia_smi": smi,
        "mps_control": shutil.which("nvidia-cuda-mps-control"),
        "cuda_reason": cuda_reason(),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ncclpy.selftest.probe FILE``: write :func:`collect` to FILE, print it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m ncclpy.selftest.probe FILE.json", file=sys.stderr)
        return 2
    doc = collect()
    with open(args[0], "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
    from .report import versions
    for k, v in versions(doc).items():
        print(f"{k + ':':<14}{v}")
    for row in doc["nvidia_smi"]:
        print(f"{'nvidia-smi:':<14}{', '.join(row)}")
    print(f"{'GPU usable:':<14}{'yes' if not doc['cuda_reason'] else doc['cuda_reason']}")
    missing = doc["missing_tools"]
    print(f"{'test tools:':<14}" + ("all present" if not missing else
                                   f"missing {', '.join(missing)} (pip install "
                                   f"{' '.join(missing)}): the pytest stages cannot run"))
    return 0 if not doc["cuda_reason"] and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
