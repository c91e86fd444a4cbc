"""NCCL data types and the logical dtypes ncclpy accepts on top of them.

One table: NCCL's ``ncclDataType_t`` values, item sizes, the NCCL version that introduced them,
and the integer "view" dtype used to move or compare their bits in numpy (bfloat16 and float8 have
no numpy dtype).  ``bool`` and complex dtypes are mapped the way torch.distributed maps them, so a
cross-check compares like with like.
"""
from __future__ import annotations

from dataclasses import dataclass
import re
from typing import Any, Dict, Optional, Tuple

from ..errors import ArgumentTypeError, NcclpyError, UnsupportedError

__all__ = ["DType", "DTYPES", "LOGICAL", "Logical", "NCCL_DTYPE_NAMES", "dtype_name",
           "logical", "nccl_dtype", "ALL_DTYPE_NAMES", "C_NAMES", "NAME_TABLE", "SHORT_NAMES",
           "TESTS_NAMES", "accepted_names", "format_version"]


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

# -- names: the one table every parser and every report uses ------------------------------------
#: Per logical dtype: its canonical name (numpy's / torch's), its short name (bit widths, as
#: NCCL's ncclInt8/ncclFloat32 and torch's int8/float32 count them: ``i8`` is int8, ``f32``
#: float32), its nccl-tests name (the bench's ``type`` column, ``-d``), its ``ncclDataType_t``
#: enumerators (the first is nccl.h's own; the others are nccl.h's aliases) and other names
#: accepted on input.  Every name in a row parses back to that row's dtype.
NAME_TABLE: Tuple[Tuple[str, str, str, Tuple[str, ...], Tuple[str, ...]], ...] = (
    # canonical    short   nccl-tests  ncclDataType_t                   also accepted
    ("int8", "i8", "int8", ("ncclInt8", "ncclChar"), ("char",)),
    ("uint8", "u8", "uint8", ("ncclUint8",), ("byte",)),
    ("int32", "i32", "int32", ("ncclInt32", "ncclInt"), ("int",)),
    ("uint32", "u32", "uint32", ("ncclUint32",), ()),
    ("int64", "i64", "int64", ("ncclInt64",), ("long",)),
    ("uint64", "u64", "uint64", ("ncclUint64",), ()),
    ("float16", "f16", "half", ("ncclFloat16", "ncclHalf"), ("fp16",)),
    ("float32", "f32", "float", ("ncclFloat32", "ncclFloat"), ("fp32",)),
    ("float64", "f64", "double", ("ncclFloat64", "ncclDouble"), ("fp64",)),
    ("bfloat16", "bf16", "bfloat16", ("ncclBfloat16",), ()),
    ("float8_e4m3", "e4m3", "f8e4m3", ("ncclFloat8e4m3",),
     ("float8_e4m3fn", "fp8_e4m3", "f8_e4m3")),
    ("float8_e5m2", "e5m2", "f8e5m2", ("ncclFloat8e5m2",), ("fp8_e5m2", "f8_e5m2")),
    ("bool", "bool", "", (), ("bool_",)),
    ("complex32", "c32", "", (), ("chalf",)),
    ("complex64", "c64", "", (), ("cfloat",)),
    ("complex128", "c128", "", (), ("cdouble",)),
)
#: canonical name -> short name (compact reports: ``ncclpy check``'s matrix)
SHORT_NAMES: Dict[str, str] = {r[0]: r[1] for r in NAME_TABLE}
#: NCCL type -> nccl-tests' type name (the bench's ``type`` column and ``-d`` values)
TESTS_NAMES: Dict[str, str] = {r[0]: r[2] for r in NAME_TABLE if r[2]}
#: each NCCL type's ``ncclDataType_t`` enumerator in nccl.h (the binding gate proves the values)
C_NAMES: Dict[str, str] = {r[0]: r[3][0] for r in NAME_TABLE if r[3]}


def _parse_table() -> Dict[str, str]:
    out: Dict[str, str] = {}
    for canon, short, tests, cnames, extra in NAME_TABLE:
        for nm in (canon, short, tests, *cnames, *extra, DTYPES[canon].torch
                   if canon in DTYPES else ""):
            key = nm.lower()
            if not key:
                continue
            if out.get(key, canon) != canon:  # pragma: no cover - a table edit's mistake
                raise AssertionError(f"dtype name {nm!r} would mean {out[key]} and {canon}")
            out[key] = canon
    return out


#: every accepted name (lower case) -> canonical name
_NAMES: Dict[str, str] = _parse_table()

#: numpy's byte-count codes: ncclpy's short names count bits, so these are refused with the
#: spelling to use ('i8'/'u8' are ncclpy's int8/uint8; numpy reads them as int64/uint64)
_NUMPY_CODES = {"i1": "int8", "u1": "uint8", "i2": "int16", "u2": "uint16", "i4": "int32",
                "u4": "uint32", "f2": "float16", "f4": "float32", "f8": "float64",
                "c8": "complex64", "c16": "complex128", "b1": "bool"}
#: numpy 1's scalar type aliases by their names (``str(np.float_)``): numpy's meaning (float_
#: is float64), never the NCCL name the stem would give (ncclFloat is float32)
_NUMPY_SCALAR_ALIASES = {"bool_": "bool", "int_": "int64", "float_": "float64",
                         "complex_": "complex128"}
#: Python's scalar types as dtypes, numpy's and torch's meaning (``np.dtype(float)`` and
#: ``torch.tensor(1., dtype=float)`` are float64), never the NCCL name ``float`` (float32)
_PY_TYPES = {float: "float64", int: "int64", bool: "bool", complex: "complex128"}
_TYPESTR = re.compile(r"^[<>|=][a-z]\d+$")

_NO_NCCL = {"int16", "uint16", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
            "float4_e2m1fn_x2", "quint8", "qint8", "qint32", "quint4x2", "object", "str"}


def _numpy_code_error(obj: Any, code: str) -> NcclpyError:
    np_name = _NUMPY_CODES[code]
    if np_name not in LOGICAL:
        return UnsupportedError(f"dtype {obj!r} is numpy's code for {np_name}, which has no NCCL "
                                f"equivalent; NCCL carries {', '.join(ALL_DTYPE_NAMES)}")
    short = SHORT_NAMES[np_name]
    use = np_name if short == np_name else f"{np_name} or {short}"
    eight = " (an 8-bit float is float8_e4m3 = e4m3 or float8_e5m2 = e5m2)" if code == "f8" else ""
    return ArgumentTypeError(
        f"dtype {obj!r} is numpy's byte-count code for {np_name}; ncclpy's short names count "
        f"bits, as NCCL and torch do (i8 = int8, f32 = float32): write {use}{eight}")


def accepted_names(name: str) -> Tuple[str, ...]:
    """Every input name that means the logical dtype ``name`` (lower case), canonical first."""
    canon = dtype_name(name)
    return (canon, *sorted(k for k, v in _NAMES.items() if v == canon and k != canon))


def dtype_name(obj: Any) -> str:
    """Canonical logical name of a dtype given as a string, numpy dtype, torch dtype, DType,
    Logical, or anything whose ``str()`` names one (e.g. ``torch.bfloat16``).

    Strings: any name of :data:`NAME_TABLE` (canonical, short, nccl-tests', ncclDataType_t,
    torch's) in any case, or a numpy typestr with its byte order (``'<f4'``).  numpy's bare
    byte-count codes (``'f4'``, ``'i4'``) are refused with the name to write: short names count
    bits (``'i8'`` is int8).  Raises UnsupportedError for dtypes NCCL cannot carry (int16, ...).
    """
    if isinstance(obj, (DType, Logical)):
        return obj.name
    if obj in _PY_TYPES:       # Python's own: as numpy and torch read them (float is double)
        return _PY_TYPES[obj]
    if isinstance(obj, type):  # numpy scalar types, e.g. np.float32
        obj = getattr(obj, "__name__", str(obj))
    s = str(getattr(obj, "name", None) or obj) if not isinstance(obj, str) else obj
    s = s.strip().lower()
    hit = _NAMES.get(s)
    if hit is not None:        # the common case: a name of the table
        return hit
    if _TYPESTR.match(s):      # '<i8': numpy's typestr, byte counts (CUDA array interface)
        s = _numpy_typestr(obj, s)
    if s.startswith("torch."):
        s = s[len("torch."):]
    if s.startswith("<") or s.startswith("dtype("):  # repr forms
        s = s.strip("<>").replace("dtype(", "").replace(")", "").replace("'", "")
    s = s.split(".")[-1]
    s = _NUMPY_SCALAR_ALIASES.get(s, s)
    if s in _NUMPY_CODES and s not in _NAMES:
        raise _numpy_code_error(obj, s)
    s = _NAMES.get(s, s)
    if s in LOGICAL:
        return s
    if s in _NO_NCCL:
        raise UnsupportedError(
            f"dtype {s!r} has no NCCL equivalent; NCCL carries "
            f"{', '.join(ALL_DTYPE_NAMES)} (ncclpy also maps bool and complex like torch)")
    raise ArgumentTypeError(
        f"dtype {obj!r} is not a dtype ncclpy knows; expected one of "
        f"{', '.join(LOGICAL)} (or their short names "
        f"{', '.join(v for k, v in SHORT_NAMES.items() if v != k)})")


def _numpy_typestr(obj: Any, s: str) -> str:
    import numpy as np
    try:
        return np.dtype(s).name
    except TypeError:
        raise ArgumentTypeError(f"dtype {obj!r} is not a numpy typestr ncclpy knows; expected "
                                f"e.g. '<f4'") from None


def logical(obj: Any) -> Logical:
    """The :class:`Logical` description of a dtype (see :func:`dtype_name`)."""
    return LOGICAL[dtype_name(obj)]


def nccl_dtype(obj: Any, nccl_version: int = 0,
               version_note: str = "the loaded NCCL is {}") -> DType:
    """The NCCL wire type for a dtype, checking NCCL ``nccl_version`` has it (``version_note``
    says in the error what that version is, ``{}`` its number: the loaded NCCL's by default,
    a planned one for ``ncclpy plan``)."""
    lg = logical(obj)
    if nccl_version and lg.wire.min_nccl > nccl_version:
        raise UnsupportedError(
            f"dtype {lg.name!r} needs NCCL >= {format_version(lg.wire.min_nccl)}; "
            f"{version_note.format(format_version(nccl_version))}")
    return lg.wire


def format_version(code: int) -> str:
    """'2.28.3' from an NCCL version code (both NCCL_VERSION forms: 2708 and 22803)."""
    if code < 10000:  # NCCL_VERSION for <= 2.8
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
