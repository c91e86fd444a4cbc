"""Where torch.distributed is known to differ from NCCL's semantics, what it then outputs, and
which of its refusals are known.

A *divergence* is never a blanket excuse: each one comes with a model of torch's wrong output
(:func:`predicted_outputs`), and ``ncclpy check`` reports "torch divergence" only when torch's
bytes equal that prediction on every rank.  Any other difference is a mismatch.

* ``nccl``, bfloat16 PREMUL_SUM: torch's ``unpackPreMulSum<float, ncclBfloat16>`` converts the
  factor to a *float* and passes its address; NCCL reads the 2 bytes of a bfloat16 there, i.e.
  the low 16 bits of the float32 (little endian): 0x0000 for 2.0, so every product is 0.
* ``gloo``, float AVG: gloo sums, then divides by n (torch's ``div_``); NCCL premultiplies each
  input by 1/n rounded to the dtype, then sums.  all_reduce divides the real view (half and
  bfloat16 in float32, then rounded); reduce/reduce_scatter of complex tensors divide by the
  complex n, which c10's complex division does as a multiplication by 1/n rounded.
* ``gloo``, bool SUM: gloo adds the bool bytes (a bool tensor holding 2); torch's NCCL backend
  maps SUM to MAX (logical or), which is what the reference does.

*Known refusals* (:data:`KNOWN_REFUSALS`): the exceptions torch's NCCL backend raises on purpose
for a dtype/op it does not support, matched by collective, dtype, op and message.  Any other
exception is an error of the run, never "unsupported".

*Not called* (:data:`NOT_CALLED`): refusals the check never provokes.  torch's ``scatter``
converts each tensor's dtype inside the ``ncclGroupStart``/``ncclGroupEnd`` it opened, so its
"Unconvertible NCCL type UInt32" leaves that group open; NCCL's group depth belongs to the
thread, not the communicator, so every later NCCL call of the thread (ncclpy's included) is
only queued, never launched, and every later case reads stale buffers (seen on an H100 with
torch 2.11 and NCCL 2.28.9, 2026-11-25: all scatter and send_recv cases after the first uint32
scatter failed).  Such a case runs on ncclpy's side only and is "unsupported" for torch.

*Validated with* (:data:`VALIDATED`): these tables (and the gloo ones in
:mod:`ncclpy.check.cases`) were found by running the check on given torch versions and backend
implementations.  :func:`tables_status` says whether a run's torch is one of them; on another
torch the check still applies the tables (a divergence is reported only where torch's bytes
equal its prediction) but says that the divergences and refusals it lists were found on this
torch, not known from a validated one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..semantics import numerics as nm
from ..semantics.dtypes import LOGICAL

__all__ = ["Divergence", "DIVERGENCES", "divergence", "predicted_outputs", "Refusal",
           "KNOWN_REFUSALS", "known_refusal", "NOT_CALLED", "not_called",
           "REDUCING_COLLECTIVES", "VALIDATED", "torch_minor", "tables_status"]

REDUCING_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter")
_FLOATS = ("float16", "float32", "float64", "bfloat16", "complex32", "complex64", "complex128")
Sel = Union[str, Tuple[str, ...]]   # "*" or the names it covers


def _has(sel: Sel, name: Optional[str]) -> bool:
    return sel == "*" or name in sel


@dataclass(frozen=True)
class Divergence:
    """A documented way torch differs from NCCL; ``model`` names how its output is predicted."""

    backend: str                 # "nccl" or "gloo"
    collectives: Tuple[str, ...]
    dtypes: Tuple[str, ...]
    ops: Tuple[str, ...]
    reason: str
    model: str                   # "bf16_premul_low16", "gloo_avg_div", "gloo_bool_bytesum"


DIVERGENCES: Tuple[Divergence, ...] = (
    Divergence("nccl", REDUCING_COLLECTIVES, ("bfloat16",), ("premul_sum",),
               "torch passes the premul_sum factor as a float32 for a bfloat16 op and NCCL reads "
               "its low 16 bits as the bfloat16 scalar (0 for 2.0: the result is zeros)",
               "bf16_premul_low16"),
    Divergence("gloo", REDUCING_COLLECTIVES, _FLOATS, ("avg",),
               "gloo's AVG sums, then divides by n (NCCL multiplies each input by 1/n rounded "
               "to the dtype, then sums)", "gloo_avg_div"),
    Divergence("gloo", REDUCING_COLLECTIVES, ("bool",), ("sum",),
               "gloo adds bool bytes (a bool tensor holding 2); torch's NCCL backend maps SUM "
               "to MAX", "gloo_bool_bytesum"),
)


def divergence(backend: str, case: Any, world_size: int = 0) -> Optional[Divergence]:
    """The documented divergence that may apply to ``case`` on ``backend``, if any (whether it
    does is decided by comparing torch's output with :func:`predicted_outputs`)."""
    for d in DIVERGENCES:
        if d.backend == backend and case.collective in d.collectives and \
                case.dtype in d.dtypes and case.op in d.ops:
            return d
    return None


# -- predicted wrong outputs ----------------------------------------------------------------
def _values(arrs: Sequence[np.ndarray], name: str) -> Tuple[np.ndarray, str]:
    """(float64 values of the flat wire elements, rank x element; the wire float type)."""
    wire = LOGICAL[name].wire.name
    return np.stack([nm.decode(nm.as_bits(a, name).reshape(-1), wire) for a in arrs]), wire


def _logical(bits: np.ndarray, name: str, shape: tuple) -> np.ndarray:
    if name == "complex32":
        return bits.view(np.float16).reshape(shape)
    return nm.from_bits(bits, name).reshape(shape)


def _div_in(dtype_name: str, total: np.ndarray, n: int, by_reciprocal: bool) -> np.ndarray:
    """Bits of ``total / n`` as torch's CPU kernels compute it for wire type ``dtype_name``."""
    with np.errstate(all="ignore"):
        if dtype_name == "float64":
            q = total * (1.0 / n) if by_reciprocal else total / n
            return nm.encode(q, "float64")
        t32 = total.astype(np.float32)               # half/bfloat16: computed in float32
        q32 = t32 * (np.float32(1) / np.float32(n)) if by_reciprocal else t32 / np.float32(n)
        return nm.encode(q32.astype(np.float32), dtype_name)


def _model(d: Divergence, case: Any, arrs: Sequence[np.ndarray], n: int) -> np.ndarray:
    """torch's (wrong) reduction of equally shaped arrays under divergence ``d``."""
    from ..semantics.scalars import float32_bits
    from ..semantics.reference import reduce_arrays
    name = case.dtype
    shape = np.asarray(arrs[0]).shape
    if d.model == "bf16_premul_low16":
        low16 = float32_bits(float(case.scalar)) & 0xFFFF
        return reduce_arrays(list(arrs), case.op_obj(), name, n, scalar_bits=low16)
    if d.model == "gloo_bool_bytesum":
        bits = np.stack([nm.as_bits(a, name).reshape(-1) for a in arrs]).astype(np.uint64)
        return (bits.sum(axis=0) & 0xFF).astype(np.uint8).view(np.bool_).reshape(shape)
    if d.model == "gloo_avg_div":
        vals, wire = _values(arrs, name)
        total = vals.sum(axis=0)          # exact for ncclpy check's inputs (see numerics)
        complex_div = name.startswith("complex") and case.collective != "all_reduce"
        return _logical(_div_in(wire, total, n, complex_div), name, shape)
    raise ValueError(f"unknown divergence model {d.model!r}")  # pragma: no cover


def predicted_outputs(d: Divergence, case: Any, inputs: Sequence[Optional[np.ndarray]], n: int,
                      backend: str, rank: Optional[int] = None) -> List[Optional[np.ndarray]]:
    """Per rank, what torch outputs for ``case`` under divergence ``d`` (None: undefined), from
    every rank's input (the blocks a rank does not need may be zeros, as in
    :func:`ncclpy.check.runner.case_inputs`).  With ``rank``, only that rank's entry is
    computed (the others are None)."""
    coll = case.collective
    arrs = [np.asarray(x) for x in inputs]
    want = range(n) if rank is None else [rank]
    out: List[Optional[np.ndarray]] = [None] * n
    if coll == "all_reduce":
        res = _model(d, case, arrs, n)
        for r in want:
            out[r] = res.copy()
    elif coll == "reduce":
        # torch's reduce is in place: NCCL leaves non-roots alone, gloo uses them as scratch
        for r in want:
            if r == case.root:
                out[r] = _model(d, case, arrs, n)
            elif backend == "nccl":
                out[r] = arrs[r].copy()
    elif coll == "reduce_scatter":
        blocks = [np.split(a, n, axis=0) for a in arrs]
        for r in want:
            out[r] = _model(d, case, [blocks[s][r] for s in range(n)], n)
    else:  # pragma: no cover
        raise ValueError(f"no divergence model for {coll}")
    return out


# -- known refusals -------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """An exception torch raises on purpose: where (collectives, dtypes, ops) and its message."""

    backend: str
    collectives: Sel
    dtypes: Sel
    ops: Sel
    pattern: str
    reason: str


_FP8 = ("float8_e4m3", "float8_e5m2")
_INTS = ("int8", "uint8", "int32", "uint32", "int64", "uint64")
_COMPLEX = ("complex32", "complex64", "complex128")
#: torch calls the check does not make (module docstring); ``pattern`` is unused
NOT_CALLED: Tuple[Refusal, ...] = (
    Refusal("nccl", "*", ("uint32", "uint64"), "*", "",
            "torch's NCCL backend maps no uint32/uint64 tensor to an NCCL type (not called: "
            "torch's scatter refuses them inside an NCCL group it leaves open, which stalls "
            "every later NCCL call of the process)"),
    Refusal("nccl", ("gather",), _COMPLEX, "*", "",
            "torch's gather hands a complex tensor to NCCL without the real view, and NCCL has "
            "no complex type (not called: torch raises 'Unconvertible NCCL type' from inside "
            "its NCCL call path)"),
)
KNOWN_REFUSALS: Tuple[Refusal, ...] = (
    Refusal("nccl", "*", ("uint32", "uint64"), "*",
            r"data type is not supported for NCCL process group",
            "torch's NCCL backend maps no uint32/uint64 tensor to an NCCL type"),
    Refusal("nccl", REDUCING_COLLECTIVES, _INTS + _FP8, ("premul_sum",),
            r"PreMulSum Data type must be half, float, bfloat16 or double",
            "torch's PREMUL_SUM takes half, float, bfloat16 and double only"),
    Refusal("nccl", REDUCING_COLLECTIVES, _FP8, "*",
            r"Float8 dtypes are not curren\w+ supported for NCCL reductions",
            "torch refuses float8 reductions on its NCCL backend"),
    Refusal("nccl", ("reduce", "reduce_scatter"), _COMPLEX, "*",
            r"data type is not supported for NCCL process group: Complex",
            "torch's Python layer hands this collective's complex tensor to its NCCL backend "
            "without the real view, and NCCL has no complex type"),
    Refusal("nccl", REDUCING_COLLECTIVES, ("bool",), ("avg",),
            r"Cannot use ReduceOp\.AVG with boolean inputs", "torch: no AVG for bool"),
    Refusal("nccl", REDUCING_COLLECTIVES, ("complex32", "complex64", "complex128"),
            ("prod", "min", "max"), r"does not support .* on complex tensors",
            "torch reduces complex tensors with SUM, AVG and PREMUL_SUM only"),
)


def not_called(backend: str, case: Any) -> Optional[str]:
    """The reason the check does not call torch for ``case`` on ``backend`` (None: it does)."""
    for r in NOT_CALLED:
        if r.backend == backend and _has(r.collectives, case.collective) and \
                _has(r.dtypes, case.dtype) and _has(r.ops, case.op):
            return r.reason
    return None


def known_refusal(backend: str, case: Any, message: str) -> Optional[str]:
    """The reason, when ``message`` is a known refusal of torch for ``case``; else None."""
    for r in KNOWN_REFUSALS:
        if r.backend == backend and _has(r.collectives, case.collective) and \
                _has(r.dtypes, case.dtype) and _has(r.ops, case.op) and \
                re.search(r.pattern, message or ""):
            return r.reason
    return None


# -- the torch versions the tables were validated with --------------------------------------
#: per table family (``"nccl"``: every NCCL implementation of torch; ``"gloo"``), the (backend
#: implementation, torch major.minor) pairs with which the check ran and its tables held
VALIDATED: Dict[str, Tuple[Tuple[str, str], ...]] = {
    # the GPU runs of 2026-11-25..27 (docs/gpu-runs.md): torch 2.11.0+cu130, NCCL 2.28.9
    "nccl": (("ProcessGroupNCCL", "2.11"),),
    # the CPU matrix (tests/test_check_gloo.py): torch 2.13.0+cpu and 2.15.0+cu132
    "gloo": (("ProcessGroupGloo", "2.13"), ("ProcessGroupGloo", "2.15")),
}


def torch_minor(version: str) -> str:
    """``"2.15.0+cu132"`` -> ``"2.15"`` (the version without patch level or local tag)."""
    parts = str(version).split("+")[0].split(".")
    return ".".join(parts[:2])


def tables_status(torch_version: str, family: str, implementation: str) -> Dict[str, Any]:
    """Whether the tables of ``family`` were validated with this torch (its major.minor and its
    backend ``implementation``), as the check's header records it: ``validated``,
    ``validated_with`` (["ProcessGroupNCCL torch 2.11", ...]), ``torch`` and ``note`` (the line
    the report prints)."""
    minor = torch_minor(torch_version)
    pairs = VALIDATED.get(family, ())
    ok = (implementation, minor) in pairs
    impls = sorted({i for i, _ in pairs})
    versions = ", ".join(v for _, v in pairs)
    same_impl = impls == [implementation]
    said = (f"tables validated with torch {versions}" + ("" if same_impl else
                                                        f" ({', '.join(impls)})")
            if pairs else f"tables validated with no torch for backend {family}")
    this = f"this is torch {minor}" + ("" if same_impl else f" ({implementation})")
    note = f"{said}; {this}" + ("" if ok else ": divergences listed as found, not as known")
    return {"validated": ok, "validated_with": [f"{i} torch {v}" for i, v in pairs],
            "torch": minor, "implementation": implementation, "note": note}
