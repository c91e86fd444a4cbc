"""``ncclpy check --backend cpu``: ncclpy's side on its CPU backend, torch's on gloo.

Every rank runs ``ncclpy.init(device="cpu")`` (:mod:`ncclpy.cpu`: the CPU engine in place of
libnccl and CUDA, ranks meeting through shared memory) beside torch's gloo process group, and
each case goes through both on torch CPU tensors holding the same seeded input
(:func:`ncclpy.check.runner.run_case_ncclpy`).  No NCCL and no GPU run: the header and the
JSON say so (``header.ncclpy_backend``: "CPU backend: NCCL's semantics and order, not
NCCL").  ncclpy's float reductions are judged against NCCL's order for the configuration the
CPU backend runs (:mod:`ncclpy.check.exact`), gloo's against the rank-order reference.
Without a GPU, ``--backend auto`` picks this backend where it can run (:func:`unavailable`).
What gloo cannot run (:data:`ncclpy.check.cases.GLOO_UNSUPPORTED`) still runs on ncclpy's side,
judged by the reference alone: status ``reference only``, counted apart, never as passed.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from . import cases as C
from .report import plural

__all__ = ["setup", "header_lines", "reference_only_cases", "compared", "problems", "NOTE",
           "unavailable", "LABEL"]

#: the ncclpy side of a ``--backend cpu`` run in so many words (the header and the JSON)
LABEL = "CPU backend: NCCL's semantics and order, not NCCL"

#: what the header and the JSON say about the ncclpy side of a ``--backend cpu`` run
NOTE = ("ncclpy ran on its CPU backend (ncclpy.init(device='cpu')): the CPU engine computes "
        "NCCL's semantics on host memory; no NCCL and no GPU ran")


def unavailable() -> str:
    """Why the CPU backend cannot run on this machine ('' when it can): x86-64 Linux with POSIX
    shared memory."""
    from ..cpu.backend import cannot_run
    why = cannot_run()
    return f"the CPU backend cannot run here: {why}" if why else ""


def setup(ctx: Dict[str, Any], header: Dict[str, Any], timeout: float) -> None:
    """Start this rank's CPU communicator (``ctx["comm"]``); every rank learns whether all did
    (through the control group); a failure is ``header["ncclpy_error"]`` and no comm."""
    from .runner import _short
    ok = True
    info: Dict[str, Any] = {"name": "cpu", "nccl": False, "label": LABEL, "note": NOTE}
    try:
        import ncclpy
        from .._nccl.lib import get_lib
        from ..semantics.ops import format_version
        # no watchdog: every wait of the check is bounded by --timeout already, and its
        # 3 s heartbeat silence limit misfires where ranks outnumber cores (4 ranks on 2
        # cores computing 1 MiB references aborted a healthy run)
        ctx["comm"] = ncclpy.init(device="cpu", timeout=timeout, watchdog=False)
        info["engine"] = str(get_lib().path)
        info["models_nccl"] = format_version(ctx["comm"].nccl_version)
    except Exception as e:  # noqa: BLE001 - reported in the header; the run then fails
        ok = False
        header["ncclpy_error"] = _short(e)
    flags: List[Any] = [None] * ctx["n"]
    ctx["dist"].all_gather_object(flags, ok, group=ctx["ctrl"])
    if not all(flags):
        header.setdefault("ncclpy_error", "ncclpy.init(device='cpu') failed on another rank")
        if ctx.get("comm") is not None:
            try:
                ctx["comm"].close()
            except Exception:  # noqa: BLE001 - best effort: the run fails anyway
                pass
        ctx["comm"] = None
    header["ncclpy_backend"] = info
    header["device"] = "cpu (no GPU)"


def reference_only_cases(cases: Sequence[C.Case]) -> int:
    """How many of ``cases`` gloo cannot run (ncclpy against the reference alone)."""
    return sum(1 for c in cases if c.collective != "barrier" and
               C.torch_not_called("cpu", c) is not None)


def header_lines(h: Dict[str, Any]) -> List[str]:
    """The header's lines about the ncclpy side of a ``--backend cpu`` run (unwrapped)."""
    info = h.get("ncclpy_backend") or {}
    if h.get("ncclpy_error"):
        return ["  ncclpy side: its CPU backend (ncclpy.init(device='cpu')) did not start; no "
                "NCCL and no GPU either"]
    out = [f"  {info.get('label', LABEL)}", f"  ncclpy side: {info.get('note', NOTE)}"]
    if info.get("engine"):
        out.append(f"  ncclpy engine: {info['engine']}; torch side: gloo on the same CPU "
                   f"tensors")
    k = h.get("reference_only_cases", 0)
    if k:
        out.append(f"  {plural(k, 'case')} gloo cannot run: "
                   f"ncclpy is compared with the reference alone there (r in the matrix; "
                   f"never counted as passed)")
    return out


def compared(counts: Dict[str, int]) -> str:
    """The JSON's ``compared`` for a ``--backend cpu`` run."""
    if not counts.get("ncclpy_cases"):
        return "torch (gloo) vs numpy reference only; ncclpy (CPU backend) did not run"
    k = counts.get("passed_reference_only", 0)
    return ("ncclpy on its CPU backend (not NCCL, no GPU) vs torch (gloo) vs numpy reference"
            + (f"; {k} case(s) ncclpy vs the reference only (gloo cannot run them)" if k
               else ""))


def problems(h: Dict[str, Any]) -> List[str]:
    """What fails a ``--backend cpu`` run whatever the cases say: ncclpy did not start."""
    if h.get("ncclpy_error"):
        return [f"ncclpy's CPU backend did not run: {h['ncclpy_error']}"]
    return []
