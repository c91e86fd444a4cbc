"""NCCL data types and the logical dtypes ncclpy accepts on top of them.

One table: NCCL's ``ncclDataType_t`` values, item sizes, the NCCL version that introduced them,
and the integer "view" dtype used to move or compare their bits in numpy (bfloat16 and float8 have
no numpy dtype).  ``bool`` and complex dtypes are mapped the way torch.distributed maps them, so a
cross-check compares like with like.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from .errors import ArgumentTypeError, UnsupportedError

__all__ = ["DType", "DTYPES", "LOGICAL", "Logical", "NCCL_DTYPE_NAMES", "dtype_name",
           "logical", "nccl_dtype", "ALL_DTYPE_NAMES", "C_NAMES"]


@dataclass(frozen=True)
class DType:
    """One NCCL data type."""

    name: str            # canonical ncclpy name, also numpy's where numpy has it
    nccl: int            # ncclDataType_t value
    itemsize: int        # bytes per element
    kind: str            # 'int', 'uint' or 'float'
    view: str            # numpy unsigned-int dtype of the same size (bitwise moves/compares)
    min_nccl: int = 0    # NCCL version code that introduced the type (0: always there)
    torch: str = ""      # torch dtype attribute name

    @property
    def numpy(self) -> Optional[str]:
        """numpy dtype name, or None where numpy has none (bfloat16, float8)."""
        return None if self.name in ("bfloat16", "float8_e4m3", "float8_e5m2") else self.name


DTYPES: Dict[str, DType] = {d.name: d for d in (
    DType("int8", 0, 1, "int", "uint8", torch="int8"),
    DType("uint8", 1, 1, "uint", "uint8", torch="uint8"),
    DType("int32", 2, 4, "int", "uint32", torch="int32"),
    DType("uint32", 3, 4, "uint", "uint32", torch="uint32"),
    DType("int64", 4, 8, "int", "uint64", torch="int64"),
    DType("uint64", 5, 8, "uint", "uint64", torch="uint64"),
    DType("float16", 6, 2, "float", "uint16", torch="float16"),
    DType("float32", 7, 4, "float", "uint32", torch="float32"),
    DType("float64", 8, 8, "float", "uint64", torch="float64"),
    DType("bfloat16", 9, 2, "float", "uint16", min_nccl=21000, torch="bfloat16"),
    DType("float8_e4m3", 10, 1, "float", "uint8", min_nccl=22400, torch="float8_e4m3fn"),
    DType("float8_e5m2", 11, 1, "float", "uint8", min_nccl=22400, torch="float8_e5m2"),
)}

NCCL_DTYPE_NAMES: Dict[int, str] = {d.nccl: d.name for d in DTYPES.values()}
#: each type's ``ncclDataType_t`` enumerator in nccl.h (the binding gate proves the values)
C_NAMES: Dict[str, str] = {"int8": "ncclInt8", "uint8": "ncclUint8", "int32": "ncclInt32",
                           "uint32": "ncclUint32", "int64": "ncclInt64", "uint64": "ncclUint64",
                           "float16": "ncclFloat16", "float32": "ncclFloat32",
                           "float64": "ncclFloat64", "bfloat16": "ncclBfloat16",
                           "float8_e4m3": "ncclFloat8e4m3", "float8_e5m2": "ncclFloat8e5m2"}


@dataclass(frozen=True)
class Logical:
    """A user-facing dtype and how it travels through NCCL.

    ``wire`` is the NCCL type, ``factor`` how many wire elements make one logical element
    (2 for complex), ``ops`` the reductions allowed (None: all), ``op_map`` the op
    substitutions torch.distributed makes (bool: sum->max, prod->min).
    """

    name: str
    wire: DType
    factor: int = 1
    ops: Optional[frozenset] = None
    op_map: Optional[Dict[str, str]] = None
    itemsize: int = 0


def _mk(name: str, wire: str, factor: int = 1, ops=None, op_map=None) -> Logical:
    w = DTYPES[wire]
    return Logical(name, w, factor, frozenset(ops) if ops else None, op_map, w.itemsize * factor)


LOGICAL: Dict[str, Logical] = {n: _mk(n, n) for n in DTYPES}
LOGICAL.update({
    "bool": _mk("bool", "uint8", ops={"sum", "prod", "max", "min"},
                op_map={"sum": "max", "prod": "min"}),
    "complex32": _mk("complex32", "float16", 2, ops={"sum", "avg", "premul_sum"}),
    "complex64": _mk("complex64", "float32", 2, ops={"sum", "avg", "premul_sum"}),
    "complex128": _mk("complex128", "float64", 2, ops={"sum", "avg", "premul_sum"}),
})

ALL_DTYPE_NAMES = tuple(DTYPES)

_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "int": "int32", "long": "int64",
    "char": "int8", "byte": "uint8", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
    "fp64": "float64", "float8_e4m3fn": "float8_e4m3", "e4m3": "float8_e4m3",
    "e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2",
    "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128",
    "bool_": "bool", "f4": "float32", "f8": "float64", "f2": "float16", "i1": "int8",
    "u1": "uint8", "i4": "int32", "u4": "uint32", "i8": "int64", "u8": "uint64",
    "c8": "complex64", "c16": "complex128", "b1": "bool",
}

_NO_NCCL = {"int16", "uint16", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
            "float4_e2m1fn_x2", "quint8", "qint8", "qint32", "quint4x2", "object", "str"}


def dtype_name(obj: Any) -> str:
    """Canonical logical name of a dtype given as a string, numpy dtype, torch dtype, DType,
    Logical, or anything whose ``str()`` names one (e.g. ``torch.bfloat16``).

    Raises UnsupportedError for dtypes NCCL cannot carry (int16, uint16, ...).
    """
    if isinstance(obj, (DType, Logical)):
        return obj.name
    if isinstance(obj, type):  # numpy scalar types, e.g. np.float32
        obj = getattr(obj, "__name__", str(obj))
    s = str(getattr(obj, "name", None) or obj) if not isinstance(obj, str) else obj
    s = s.strip().lower()
    if s.startswith("torch."):
        s = s[len("torch."):]
    if s.startswith("<") or s.startswith("dtype("):  # repr forms
        s = s.strip("<>").replace("dtype(", "").replace(")", "").replace("'", "")
    s = s.split(".")[-1]
    if s.endswith("_") and s != "bool_":
        s = s[:-1]
    s = _ALIASES.get(s, s)
    if s in LOGICAL:
        return s
    if s in _NO_NCCL:
        raise UnsupportedError(
            f"dtype {s!r} has no NCCL equivalent; NCCL carries "
            f"{', '.join(ALL_DTYPE_NAMES)} (ncclpy also maps bool and complex like torch)")
    raise ArgumentTypeError(
        f"dtype {obj!r} is not a dtype ncclpy knows; expected one of "
        f"{', '.join(LOGICAL)}")


def logical(obj: Any) -> Logical:
    """The :class:`Logical` description of a dtype (see :func:`dtype_name`)."""
    return LOGICAL[dtype_name(obj)]


def nccl_dtype(obj: Any, nccl_version: int = 0) -> DType:
    """The NCCL wire type for a dtype, checking the loaded NCCL version has it."""
    lg = logical(obj)
    if nccl_version and lg.wire.min_nccl > nccl_version:
        raise UnsupportedError(
            f"dtype {lg.name!r} needs NCCL >= {_fmt_version(lg.wire.min_nccl)}; "
            f"the loaded NCCL is {_fmt_version(nccl_version)}")
    return lg.wire


def _fmt_version(code: int) -> str:
    if code < 10000:  # NCCL_VERSION for <= 2.8
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
