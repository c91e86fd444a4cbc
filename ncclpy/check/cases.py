"""The ``ncclpy check`` matrix: collectives x dtypes x ops x sizes x roots x in/out of place.

Also the two tables that make the matrix honest:

* :data:`GLOO_UNSUPPORTED` - what torch.distributed's gloo backend (torch 2.13, found by running
  every collective x dtype x op at 2 and 3 ranks) refuses, with the error it gives.  On CPU the
  matrix leaves those combinations out and ``ncclpy check --list-skips`` prints why.
  With ``--backend cpu`` (ncclpy's CPU backend against torch's gloo) those combinations run on
  ncclpy's side only, compared with the reference alone (:func:`torch_not_called`).
* :data:`DIVERGENCES` (from :mod:`.divergences`) - cases where torch is known to differ from
  NCCL's semantics, each with a model of torch's wrong output; a case is reported as "torch
  divergence: <reason>" only when torch's bytes equal that model, otherwise as a mismatch.

A case's ``count`` follows nccl-tests' per-rank block convention: all_reduce/reduce/broadcast/
send_recv move ``count`` elements per rank, all_gather and gather send ``count`` (receive
``n*count``), reduce_scatter and scatter receive ``count`` (send ``n*count``), all_to_all moves
``count`` per peer.

A case's ``inputs`` says what its inputs are (:data:`INPUT_KINDS`): ``verifiable`` (every
partial result exact in any order, :func:`ncclpy.semantics.numerics.verifiable_input`; random bits
for data movement), ``normal`` (seeded standard normals, per rank) or ``reveal`` (the
order-revealing inputs of :mod:`ncclpy.order.reveal`).  The last two join the matrix for the
float sum reductions (:data:`ORDER_INPUTS_OPS`), where the order of the fold shows in the bits.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..semantics import numerics as nm
from ..semantics import registry
from ..semantics.dtypes import ALL_DTYPE_NAMES, LOGICAL, dtype_name
from ..errors import ArgumentError, NcclpyError
from .divergences import DIVERGENCES, Divergence, divergence

__all__ = ["Case", "build_matrix", "parse_sizes", "exact_claim", "gloo_skip_reason",
           "divergence", "Divergence", "GLOO_UNSUPPORTED", "DIVERGENCES", "DEFAULT_SIZES_CPU",
           "DEFAULT_SIZES_GPU", "ALL_DTYPES", "REDUCING_OPS", "PREMUL_SCALAR",
           "uneven_counts", "ulp_tolerance", "COLLECTIVES", "FP8_REDUCTION_MIN_CC", "BACKENDS",
           "torch_family", "torch_not_called", "INPUT_KINDS", "ORDER_INPUTS_OPS",
           "parse_inputs", "default_inputs", "default_sizes", "DEFAULT_SIZES_CPU_BACKEND",
           "FLOAT_REDUCTIONS", "input_kinds_for"]

#: every logical dtype the matrix knows (NCCL's 12 plus torch's bool and complex mappings)
ALL_DTYPES: Tuple[str, ...] = ALL_DTYPE_NAMES + ("bool", "complex32", "complex64", "complex128")
REDUCING_OPS = ("sum", "prod", "min", "max", "avg", "premul_sum")
#: the premul_sum scalar of the default matrix (any finite scalar gives exact results, see
#: :func:`ncclpy.semantics.numerics.exact_plan`; a power of two lets the inputs use more values)
PREMUL_SCALAR = 2.0
DEFAULT_SIZES_CPU = "0,1,7,1024,1MiB"
DEFAULT_SIZES_GPU = "0,1,7,1024,65537,1MiB"
#: the CPU backend's default sizes: its 1 MiB cases cost 0.2 s each on a 2-core machine (984
#: of them made ``ncclpy check -n 2`` take 225 s); 64 KiB keeps a size past every small-count
#: rule of NCCL's chunking (the last loop's alignUp(divUp(rem, n), 16/size)) at a 16th of it
DEFAULT_SIZES_CPU_BACKEND = "0,1,7,1024,64KiB"
#: what the inputs of a case are: ``verifiable`` (exact in any order), ``normal`` (seeded
#: standard normals), ``reveal`` (:mod:`ncclpy.order.reveal`'s order-revealing inputs)
INPUT_KINDS = ("verifiable", "normal", "reveal")
#: the ops whose cases also run on normal and revealing inputs: a sum (revealing inputs are
#: made for sums, and the order-free bound that judges them without a prediction is a sum's)
ORDER_INPUTS_OPS = ("sum",)
#: the collectives whose float results depend on NCCL's order
FLOAT_REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")
#: the collectives in matrix order (the registry's, barrier last)
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter", "send_recv", "barrier")
#: NCCL's float8 reduction kernels need this compute capability (sm90)
FP8_REDUCTION_MIN_CC = (9, 0)
#: the check's backends: ``nccl`` (ncclpy on a GPU against torch's NCCL), ``gloo`` (torch's
#: gloo against the reference; ncclpy does not run) and ``cpu`` (ncclpy's CPU backend,
#: ``ncclpy.init(device="cpu")``, against torch's gloo and the reference)
BACKENDS = ("nccl", "gloo", "cpu")


def torch_family(backend: str) -> str:
    """The torch backend a check backend compares with (the key of the divergence and refusal
    tables): ``nccl`` for ``nccl``, ``gloo`` for ``gloo`` and ``cpu``."""
    return "nccl" if backend == "nccl" else "gloo"


@dataclass(frozen=True)
class Case:
    """One cell of the matrix."""

    collective: str
    dtype: Optional[str]
    op: Optional[str] = None
    scalar: Optional[float] = None
    count: int = 0
    size_label: str = "0"
    root: Optional[int] = None
    in_place: bool = False
    variant: str = ""          # all_to_all: "even" / "uneven"
    inputs: str = "verifiable"  # one of INPUT_KINDS

    @property
    def key(self) -> str:
        """A stable identifier (also the seed tag of the inputs)."""
        op = self.op or "-"
        if self.op == "premul_sum":
            op = f"premul_sum({self.scalar:g})"
        return (f"{self.collective}/{self.dtype or '-'}/{op}/{self.count}/"
                f"{'-' if self.root is None else self.root}/{'ip' if self.in_place else 'oop'}"
                f"{'/' + self.variant if self.variant else ''}"
                f"{'' if self.inputs == 'verifiable' else '/' + self.inputs}")

    @property
    def input_key(self) -> str:
        """The seed tag of the inputs: the key without in/out of place, so the two variants of
        a cell run on the same inputs (built once, :func:`ncclpy.check.runner.run_case`)."""
        return dataclasses.replace(self, in_place=False).key

    def op_obj(self):
        """The ncclpy RedOp of this case (None for data movement)."""
        if self.op is None:
            return None
        from ..semantics.ops import RedOp
        return RedOp(self.op, self.scalar if self.op == "premul_sum" else None)


# -- gloo support (torch 2.13, measured) ------------------------------------------------------
_GLOO_NO_DTYPE = ("gloo: 'Invalid scalar type' - ProcessGroupGloo has no dispatch for "
                  "uint32/uint64/float8 (send/recv moves them: it needs no dispatch)")
_NOT_P2P = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
            "gather", "scatter")
_INT_AVG = "gloo: AVG divides the sum by n in place: 'result type Float can't be cast to the " \
           "desired output type' for integer tensors"
_C32_DIV = "gloo: '\"div_cpu\" not implemented for ComplexHalf'"
_NO_GATHER = "gloo: gather has no complex dispatch ('Invalid scalar type')"
#: (collectives or "*", dtypes, ops or "*", reason gloo refuses it)
GLOO_UNSUPPORTED: Tuple[Tuple[object, Tuple[str, ...], object, str], ...] = (
    (_NOT_P2P, ("uint32", "uint64", "float8_e4m3", "float8_e5m2"), "*", _GLOO_NO_DTYPE),
    ("*", ALL_DTYPE_NAMES + ("bool", "complex32", "complex64", "complex128"), ("premul_sum",),
     "gloo: 'Cannot use ReduceOp.PREMUL_SUM with Gloo'"),
    ("*", ("int8", "uint8", "int32", "int64"), ("avg",), _INT_AVG),
    ("*", ("bool",), ("avg",), "torch: AVG is not defined for bool (gloo: 'result type Float "
                               "can't be cast to Bool')"),
    (("reduce", "reduce_scatter"), ("complex32",), ("avg",), _C32_DIV),
    (("gather",), ("complex32", "complex64", "complex128"), "*", _NO_GATHER),
)


def gloo_skip_reason(collective: str, dtype: Optional[str], op: Optional[str]) -> str:
    """Why gloo cannot run this combination ('' if it can)."""
    for colls, dts, ops, why in GLOO_UNSUPPORTED:
        if (colls == "*" or collective in colls) and dtype in dts and \
                (ops == "*" or op in ops):   # type: ignore[operator]
            return why
    return ""


def torch_not_called(backend: str, case: "Case") -> Optional[str]:
    """Why the check does not call torch for ``case`` on ``backend`` (None: it does).  On
    ``cpu``: what gloo cannot run (:data:`GLOO_UNSUPPORTED`), which ncclpy's CPU backend runs
    and the reference alone judges; on ``nccl``: :data:`ncclpy.check.divergences.NOT_CALLED`."""
    if backend == "cpu":
        why = gloo_skip_reason(case.collective, case.dtype, case.op)
        return why or None
    from .divergences import not_called
    return not_called(backend, case)


# -- input kinds ----------------------------------------------------------------------------
def default_sizes(backend: str) -> str:
    """The ``--sizes`` a run on ``backend`` uses when none is given."""
    return {"nccl": DEFAULT_SIZES_GPU, "cpu": DEFAULT_SIZES_CPU_BACKEND}.get(backend,
                                                                          DEFAULT_SIZES_CPU)


def default_inputs(backend: str) -> Tuple[str, ...]:
    """The input kinds a run on ``backend`` uses when ``--inputs`` is not given: all three where
    ncclpy runs (``nccl``, ``cpu``: its side is judged against NCCL's order), verifiable only on
    ``gloo`` (torch alone, judged against the rank-order reference: as before)."""
    return INPUT_KINDS if backend in ("nccl", "cpu") else ("verifiable",)


def parse_inputs(text: str) -> Tuple[str, ...]:
    """``--inputs``: a comma list of :data:`INPUT_KINDS` (ArgumentError naming the flag)."""
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not items:
        raise ArgumentError(f"--inputs: no input kind given in {text!r}; expected a comma list "
                            f"of {', '.join(INPUT_KINDS)}")
    for it in items:
        if it not in INPUT_KINDS:
            raise ArgumentError(f"--inputs: {it!r} is not an input kind; expected a comma list "
                                f"of {', '.join(INPUT_KINDS)}")
    return tuple(k for k in INPUT_KINDS if k in items)


def input_kinds_for(coll: str, dt: str, op: Optional[str], n: int,
                    kinds: Sequence[str]) -> Tuple[List[str], str]:
    """(the kinds of ``kinds`` a case of ``coll``/``dt``/``op`` on ``n`` ranks runs with, why
    one asked for does not apply ('' when all do)).  Normal and revealing inputs: float sums
    of all_reduce, reduce and reduce_scatter (complex types on their float pairs); revealing
    inputs need 2 ranks or more and room in the type (:func:`ncclpy.order.reveal.reveal_plan`)."""
    out: List[str] = []
    why = ""
    floaty = op in ORDER_INPUTS_OPS and coll in FLOAT_REDUCTIONS and \
        LOGICAL[dt].wire.kind == "float" and dt != "bool"
    for k in kinds:
        if k == "verifiable":
            out.append(k)
        elif not floaty:
            continue
        elif k == "reveal":
            from ..order.reveal import reveal_plan
            try:
                reveal_plan(LOGICAL[dt].wire.name, n)
            except ValueError as e:
                why = f"revealing inputs: {e}"
                continue
            out.append(k)
        else:
            out.append(k)
    return out, why


# -- exactness ------------------------------------------------------------------------------
def exact_claim(case: Case, world_size: int) -> bool:
    """Whether the reference's result is claimed bit for bit for this case's verifiable inputs
    (otherwise the ULP distance is reported and compared with :func:`ulp_tolerance`).

    Integers and data movement: always.  Floats: whenever
    :func:`ncclpy.semantics.numerics.exact_plan` has a plan that makes every term and partial result
    exact in any order (all finite scalars); a non-finite premul_sum scalar is the one exception.
    Normal and revealing inputs are never exact in any order: against the rank-order reference they
    are judged by the order-free bound (:mod:`ncclpy.check.exact`)."""
    if case.op is None or case.dtype is None:
        return True
    if case.inputs != "verifiable":
        return False
    wire = LOGICAL[case.dtype].wire
    if wire.kind != "float":
        return True
    return nm.exact_plan(wire.name, case.op, world_size, case.scalar)[0] != "inexact"


def ulp_tolerance(case: Case, world_size: int) -> float:
    """ULPs allowed between a result and the reference when exactness is not claimed: one per
    rounding step of the fold (n)."""
    return float(max(1, world_size))


# -- sizes ----------------------------------------------------------------------------------
_UNITS = {"": None, "b": 1, "kb": 1000, "kib": 1024, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "gb": 1000 ** 3, "gib": 1024 ** 3, "k": 1024, "m": 1024 ** 2}


def parse_sizes(spec: str) -> List[Tuple[str, Optional[int], Optional[int]]]:
    """'0,1,7,1024,1MiB' -> [(label, elements or None, bytes or None)]: a bare number counts
    elements, a number with a unit (B, KiB, MiB, GiB, KB, MB, GB) counts bytes per block."""
    out = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", tok)
        if not m or m.group(2).lower() not in _UNITS:
            raise ArgumentError(f"--sizes: {tok!r} is not a size; expected an element count "
                                f"(e.g. 1024) or bytes with a unit (e.g. 1MiB, 64KB)")
        num, unit = int(m.group(1)), m.group(2).lower()
        if unit == "":
            out.append((tok, num, None))
        else:
            out.append((tok, None, num * _UNITS[unit]))
    if not out:
        raise ArgumentError("--sizes: no size given")
    return out


def _count_for(size: Tuple[str, Optional[int], Optional[int]], dtype: Optional[str]) -> int:
    label, elems, nbytes = size
    if elems is not None:
        return elems
    item = LOGICAL[dtype].itemsize if dtype else 1
    return max(1, nbytes // item)


def uneven_counts(count: int, n: int) -> List[List[int]]:
    """send_counts[s][d] for the uneven all_to_all case of block size ``count``: sizes vary
    between 0 and 2*count (some blocks empty), every rank sends and receives something."""
    if count == 0:
        return [[0] * n for _ in range(n)]
    pattern = [0, 1, 2, 1]
    return [[pattern[(s + 2 * d) % 4] * count + (1 if s == d else 0) for d in range(n)]
            for s in range(n)]


# -- matrix ---------------------------------------------------------------------------------
def _ops_for(collective: str, dtype: str, ops: Sequence[str]) -> List[Optional[str]]:
    if not registry.get(collective).reduces:
        return [None]
    lg = LOGICAL[dtype]
    return [o for o in ops if lg.ops is None or o in lg.ops]


def _skip_reason(backend: str, coll: str, dt: str, op: Optional[str], scalar: float,
                 gpu_cc: Optional[Tuple[int, int]]) -> str:
    if backend == "gloo":          # on cpu ncclpy runs them: torch_not_called
        why = gloo_skip_reason(coll, dt, op)
        if why:
            return why
    if op == "premul_sum":
        from ..semantics.scalars import encode_scalar
        try:
            encode_scalar(scalar, LOGICAL[dt].wire.name)
        except NcclpyError as e:
            return f"ncclpy refuses this scalar for {dt}: {e}"
    if backend == "nccl" and op is not None and dt.startswith("float8") and gpu_cc is not None \
            and tuple(gpu_cc) < FP8_REDUCTION_MIN_CC:
        return (f"float8 reductions need compute capability 9.0+ (NCCL's float8 kernels are "
                f"sm90+); this GPU is sm{gpu_cc[0]}{gpu_cc[1]}")
    return ""


def build_matrix(world_size: int, *, backend: str, collectives: Optional[Sequence[str]] = None,
                 dtypes: Optional[Sequence[str]] = None, ops: Optional[Sequence[str]] = None,
                 sizes: Optional[str] = None, roots: Optional[Sequence[int]] = None,
                 in_place: Optional[Sequence[bool]] = None,
                 premul_scalar: float = PREMUL_SCALAR,
                 gpu_cc: Optional[Tuple[int, int]] = None,
                 inputs: Optional[Sequence[str]] = None) -> Tuple[List[Case], List[dict]]:
    """(cases, skipped) for ``world_size`` ranks on ``backend`` (one of :data:`BACKENDS`).

    ``skipped`` lists what the filters allow but the backend cannot run, with the reason: what
    gloo refuses (``gloo`` only: on ``cpu`` ncclpy runs those cases, see
    :func:`torch_not_called`); premul_sum scalars the library refuses for a dtype (e.g. a
    non-integral one on an integer type); on a GPU of compute capability ``gpu_cc`` below 9.0,
    float8 reductions.
    ``in_place`` None: both variants where they differ for the side being tested (on gloo only
    all_gather and reduce_scatter, whose torch calls differ; torch's all_reduce, reduce and
    broadcast are in place by nature, gather/scatter take lists; on nccl and cpu, where ncclpy
    runs, both for every collective but send_recv).

    ``ops`` selects what the reducing collectives run; data movement ignores the op, so with
    ``ops`` given and ``collectives`` None only the reducing collectives (all_reduce, reduce,
    reduce_scatter) are in the matrix: ``--ops premul_sum`` checks premul_sum, not broadcast.
    A collective named in ``collectives`` always runs (once per case, whatever ``ops`` says).

    ``inputs`` (default :func:`default_inputs`): the input kinds; each case runs once per kind
    that applies to it (:func:`input_kinds_for`), a case to which none applies is left out.
    """
    n = world_size
    if backend not in BACKENDS:
        raise ArgumentError(f"--backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if collectives is None and ops is not None:
        collectives = [c for c in COLLECTIVES if registry.get(c).reduces]
    colls = [registry.get(c).name for c in (collectives or COLLECTIVES)]
    dts = [dtype_name(d) for d in (dtypes or ALL_DTYPES)]
    opl = list(ops or REDUCING_OPS)
    for o in opl:
        if o not in REDUCING_OPS:
            raise ArgumentError(f"--ops: {o!r} is not one of {', '.join(REDUCING_OPS)}")
    size_list = parse_sizes(sizes or default_sizes(backend))
    kinds = list(inputs) if inputs is not None else list(default_inputs(backend))
    for k in kinds:
        if k not in INPUT_KINDS:
            raise ArgumentError(f"--inputs: {k!r} is not one of {', '.join(INPUT_KINDS)}")
    root_list = sorted(set(roots if roots is not None else (0, n - 1)))
    for r in root_list:
        if not 0 <= r < n:
            raise ArgumentError(f"--roots: {r} is not a rank of 0..{n - 1}")
    cases: List[Case] = []
    skipped: List[dict] = []
    seen_skip = set()

    def skip(coll: str, dt: Optional[str], op: Optional[str], why: str,
             kind: Optional[str] = None) -> None:
        k = (coll, dt, op, kind)
        if k not in seen_skip:
            seen_skip.add(k)
            skipped.append({"collective": coll, "dtype": dt, "op": op, "reason": why,
                            **({"inputs": kind} if kind else {})})

    for coll in colls:
        c = registry.get(coll)
        if coll == "barrier":
            if "verifiable" in kinds:
                cases.append(Case("barrier", None))
            continue
        if coll == "send_recv" and n < 2:
            skip(coll, None, None, "send_recv needs at least 2 ranks")
            continue
        for dt in dts:
            for op in _ops_for(coll, dt, opl):
                why = _skip_reason(backend, coll, dt, op, premul_scalar, gpu_cc)
                if why:
                    skip(coll, dt, op, why)
                    continue
                if in_place is not None:
                    ips = list(in_place)
                elif coll in ("send_recv",):
                    ips = [False]
                elif backend == "gloo":
                    ips = [False, True] if coll in ("all_gather", "reduce_scatter") else \
                        ([True] if coll in ("all_reduce", "reduce", "broadcast") else [False])
                else:
                    ips = [False, True]
                variants = ["even", "uneven"] if coll == "all_to_all" else [""]
                mine, why = input_kinds_for(coll, dt, op, n, kinds)
                if why:                     # revealing inputs asked for, impossible here
                    skip(coll, dt, op, why, "reveal")
                for size in size_list:
                    count = _count_for(size, dt)
                    for rt in (root_list if c.rooted else [None]):
                        for kind in mine:
                            for ip in ips:
                                for v in variants:
                                    if count == 0 and (v == "uneven" or
                                                       kind != "verifiable"):
                                        continue    # nothing to tell apart
                                    cases.append(Case(
                                        coll, dt, op, premul_scalar if op == "premul_sum"
                                        else None, count, size[0], rt, ip, v, kind))
    return cases, skipped
