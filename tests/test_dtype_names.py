"""One naming scheme for dtypes (ncclpy.dtypes.NAME_TABLE): every name a report prints --
``ncclpy check``'s matrix titles and rows, ``ncclpy plan``'s header and ncclDataType_t
arguments, the bench's nccl-tests ``type`` column -- parses back as input to the same dtype;
short names count bits (i8 = int8, f32 = float32, as NCCL and torch); numpy's byte-count codes
are refused in one line naming what to write, and numpy typestrings keep numpy's meaning."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ncclpy import errors
from ncclpy.check.overview import matrix_lines
from ncclpy.semantics.dtypes import (C_NAMES, DTYPES, LOGICAL, NAME_TABLE, SHORT_NAMES, TESTS_NAMES,
                                     accepted_names, dtype_name)
from ncclpy.plan import cli as plan_cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "NCCLPY_CHECK_INJECT")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


# -- the table ----------------------------------------------------------------------------------

def test_every_name_of_the_table_means_its_own_row_in_any_case():
    seen = {}
    for canon, short, tests, cnames, extra in NAME_TABLE:
        assert canon in LOGICAL
        for nm in (canon, short, tests, *cnames, *extra):
            if not nm:
                continue
            for spelled in (nm, nm.upper(), f" {nm} "):
                assert dtype_name(spelled) == canon, (spelled, canon)
            assert seen.setdefault(nm.lower(), canon) == canon, f"{nm} means two dtypes"
        assert set(accepted_names(canon)) >= {canon, short}
    assert set(SHORT_NAMES) == set(LOGICAL)
    assert set(TESTS_NAMES) == set(DTYPES) == set(C_NAMES)


def test_the_names_the_issue_found_refused_are_accepted():
    assert [dtype_name(n) for n in ("f32", "i32", "f16", "c64", "bf16", "fp32", "f64", "i64",
                                    "u64", "u32", "c128", "c32", "e4m3", "e5m2")] == [
        "float32", "int32", "float16", "complex64", "bfloat16", "float32", "float64", "int64",
        "uint64", "uint32", "complex128", "complex32", "float8_e4m3", "float8_e5m2"]


def test_short_names_count_bits_like_nccl_and_torch():
    # i8/u8 meant int64/uint64 (numpy's byte counts) before: they are int8/uint8 now, as the
    # check's matrix titles, ncclInt8 and torch.int8 say (README: "dtype names")
    assert dtype_name("i8") == "int8" and dtype_name("u8") == "uint8"
    assert dtype_name("I8") == "int8" and dtype_name("ncclInt8") == "int8"


@pytest.mark.parametrize("code,meant,write", [
    ("f4", "float32", "write float32 or f32"), ("i4", "int32", "write int32 or i32"),
    ("u4", "uint32", "write uint32 or u32"), ("f2", "float16", "write float16 or f16"),
    ("i1", "int8", "write int8 or i8"), ("u1", "uint8", "write uint8 or u8"),
    ("c8", "complex64", "write complex64 or c64"),
    ("c16", "complex128", "write complex128 or c128"),
    ("b1", "bool", "write bool"), ("f8", "float64", "write float64 or f64 (an 8-bit float is "
                                                    "float8_e4m3 = e4m3")])
def test_numpy_byte_codes_are_refused_naming_what_to_write(code, meant, write):
    with pytest.raises(errors.ArgumentTypeError) as ei:
        dtype_name(code)
    msg = str(ei.value)
    assert f"dtype {code!r} is numpy's byte-count code for {meant}" in msg and write in msg
    assert "\n" not in msg


def test_numpy_code_of_a_type_nccl_lacks_is_unsupported():
    with pytest.raises(errors.UnsupportedError, match="'i2' is numpy's code for int16, which has "
                                                      "no NCCL equivalent"):
        dtype_name("i2")


def test_numpy_typestrings_and_objects_keep_numpy_meaning():
    assert dtype_name("<i8") == "int64" and dtype_name("<u8") == "uint64"
    assert dtype_name("|i1") == "int8" and dtype_name("<f4") == "float32"
    assert dtype_name("<c16") == "complex128" and dtype_name("|b1") == "bool"
    assert dtype_name(np.dtype("i8")) == "int64" and dtype_name(np.int64) == "int64"
    assert dtype_name(np.dtype("<f2")) == "float16"
    assert dtype_name("dtype('int64')") == "int64"
    assert dtype_name("<class 'numpy.float64'>") == "float64"


def test_torch_dtypes_parse():
    torch = pytest.importorskip("torch")
    for canon, d in DTYPES.items():
        t = getattr(torch, d.torch, None)
        if t is not None:
            assert dtype_name(t) == canon
    assert dtype_name(torch.complex64) == "complex64" and dtype_name(torch.bool) == "bool"


# -- the aliases, written out here (not read from NAME_TABLE) -----------------------------------
#: every name ncclpy accepts for each dtype (lower case; any case is accepted): canonical,
#: short (bits), nccl-tests' type name, nccl.h's ncclDataType_t names, torch's, the rest
ALIASES = {
    "int8": {"int8", "i8", "ncclint8", "ncclchar", "char"},
    "uint8": {"uint8", "u8", "nccluint8", "byte"},
    "int32": {"int32", "i32", "ncclint32", "ncclint", "int"},
    "uint32": {"uint32", "u32", "nccluint32"},
    "int64": {"int64", "i64", "ncclint64", "long"},
    "uint64": {"uint64", "u64", "nccluint64"},
    "float16": {"float16", "f16", "half", "ncclfloat16", "ncclhalf", "fp16"},
    "float32": {"float32", "f32", "float", "ncclfloat32", "ncclfloat", "fp32"},
    "float64": {"float64", "f64", "double", "ncclfloat64", "nccldouble", "fp64"},
    "bfloat16": {"bfloat16", "bf16", "ncclbfloat16"},
    "float8_e4m3": {"float8_e4m3", "e4m3", "f8e4m3", "ncclfloat8e4m3", "float8_e4m3fn",
                    "fp8_e4m3", "f8_e4m3"},
    "float8_e5m2": {"float8_e5m2", "e5m2", "f8e5m2", "ncclfloat8e5m2", "fp8_e5m2", "f8_e5m2"},
    "bool": {"bool", "bool_"},
    "complex32": {"complex32", "c32", "chalf"},
    "complex64": {"complex64", "c64", "cfloat"},
    "complex128": {"complex128", "c128", "cdouble"},
}
#: torch's dtype attributes -> ncclpy's dtype (torch.half is torch.float16, and so on)
TORCH = {"int8": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
         "uint32": "uint32", "int64": "int64", "long": "int64", "uint64": "uint64",
         "float16": "float16", "half": "float16", "float32": "float32", "float": "float32",
         "float64": "float64", "double": "float64", "bfloat16": "bfloat16",
         "float8_e4m3fn": "float8_e4m3", "float8_e5m2": "float8_e5m2", "bool": "bool",
         "complex32": "complex32", "chalf": "complex32", "complex64": "complex64",
         "cfloat": "complex64", "complex128": "complex128", "cdouble": "complex128"}
#: torch dtypes NCCL cannot carry: refused as unsupported
TORCH_REFUSED = ("int16", "short", "uint16", "float8_e4m3fnuz", "float8_e5m2fnuz", "quint8",
                 "qint8", "qint32", "quint4x2")


@pytest.mark.parametrize("canon", list(ALIASES))
def test_every_alias_means_its_dtype_and_no_other(canon):
    for nm in sorted(ALIASES[canon]):
        for spelled in (nm, nm.upper(), nm.capitalize(), f" {nm}\t", f"torch.{nm}"):
            if spelled.startswith("torch.") and nm not in TORCH and nm != canon:
                continue
            assert dtype_name(spelled) == canon, (spelled, canon)
    assert set(accepted_names(canon)) == ALIASES[canon]      # nothing more, nothing less
    assert accepted_names(canon)[0] == canon


def test_the_alias_table_covers_every_dtype_once():
    assert set(ALIASES) == set(LOGICAL)
    every = [nm for names in ALIASES.values() for nm in names]
    assert len(every) == len(set(every))
    assert {TORCH[t] for t in TORCH} == set(LOGICAL)


def test_every_torch_dtype_is_its_dtype_or_refused():
    torch = pytest.importorskip("torch")
    for attr, canon in TORCH.items():
        assert dtype_name(getattr(torch, attr)) == canon, attr
    for attr in TORCH_REFUSED:
        if hasattr(torch, attr):
            with pytest.raises(errors.UnsupportedError, match="has no NCCL equivalent"):
                dtype_name(getattr(torch, attr))
    for attr in dir(torch):                 # whatever else torch has: mapped, or refused
        t = getattr(torch, attr)
        if isinstance(t, torch.dtype) and attr not in TORCH:
            with pytest.raises(errors.NcclpyError):
                dtype_name(t)


# -- the reports --------------------------------------------------------------------------------

def test_check_matrix_titles_parse_back_to_their_column():
    for d in LOGICAL:
        rec = {"case": {"collective": "all_reduce", "dtype": d}, "status": "pass"}
        title = matrix_lines([rec], [])[2].split()
        assert len(title) == 1 and dtype_name(title[0]) == d, (d, title)


def test_a_real_check_report_titles_select_the_same_dtypes(tmp_path):
    out = tmp_path / "c.json"
    r = _run("-m", "ncclpy", "check", "-n", "2", "--collectives", "all_reduce", "--ops", "sum",
             "--sizes", "4", "--json", str(out))
    assert r.returncode in (0, 1), r.stderr
    lines = r.stdout.splitlines()
    head = lines[lines.index("by collective and dtype:") + 1].split()
    ran = [c["case"]["dtype"] for c in json.loads(out.read_text())["cases"]]
    run_dtypes = [d for d in LOGICAL if d in ran or any(
        s.get("dtype") == d for s in json.loads(out.read_text()).get("skipped", []))]
    assert [dtype_name(t) for t in head] == run_dtypes
    # the titles as --dtypes select exactly those dtypes, each the same
    r = _run("-m", "ncclpy", "check", "-n", "2", "--collectives", "all_reduce", "--ops", "sum",
             "--sizes", "4", "--dtypes", ",".join(head), "--list")
    assert r.returncode == 0, r.stderr
    listed = {ln.split("/")[1] for ln in r.stdout.splitlines() if ln.startswith("all_reduce/")}
    assert listed == set(ran)


def test_check_refuses_a_numpy_code_in_one_line():
    r = _run("-m", "ncclpy", "check", "-n", "2", "--dtypes", "f32,f4", "--list")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "ncclpy check: error: --dtypes: dtype 'f4' is numpy's byte-count code for float32; "
        "ncclpy's short names count bits, as NCCL and torch do (i8 = int8, f32 = float32): "
        "write float32 or f32 (see 'ncclpy check -h')"]


@pytest.mark.parametrize("short", [SHORT_NAMES[d] for d in LOGICAL])
def test_plan_prints_names_that_parse_back(short, capsys):
    assert plan_cli.main(["all_reduce", "--dtype", short, "--count", "4", "-n", "2",
                          "--nccl-version", "2.30.7"]) == 0
    out = capsys.readouterr().out
    canon = dtype_name(short)
    head = out.splitlines()[0]
    assert f" elements, {canon}, " in head, head
    for c in set(re.findall(r"datatype=(nccl\w+) \(\d+\)", out)):
        assert dtype_name(c) == LOGICAL[canon].wire.name
    assert plan_cli.main(["all_reduce", "--dtype", short, "--count", "4", "--json", "-",
                          "--nccl-version", "2.30.7"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["dtype"] == canon


def test_bench_type_column_parses_back(tmp_path):
    from bench.cli import parse_dtypes
    out = tmp_path / "b.json"
    r = _run("-m", "bench", "all_reduce", "-d", "all", "--device", "cpu", "--backend", "torch",
             "-n", "2", "-b", "8", "-e", "8", "-J", str(out))
    assert r.returncode == 0, r.stderr
    types = [x["type"] for x in json.loads(out.read_text())["results"]]
    assert "float" in types and "half" in types and "int8" in types
    for t in types:
        (d,) = parse_dtypes(t)
        assert TESTS_NAMES[d] == t
    col = [ln.split()[2] for ln in r.stdout.splitlines()
           if ln.strip() and not ln.startswith("#") and ln.split()[0].isdigit()]
    assert col == types
    assert parse_dtypes("f32,i8,bf16,f16,i64") == ["float32", "int8", "bfloat16", "float16",
                                                  "int64"]
    with pytest.raises(errors.ArgumentError, match="-d/--datatype: dtype 'f4' is numpy's"):
        parse_dtypes("f4")
