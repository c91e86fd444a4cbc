"""Contracts of ncclpy.dtypes the mutation run found unpinned (docs/testing.md): the
logical size of complex types, the names each dtype accepts, numpy's scalar types and aliases by
their numpy meaning, and the NCCL version in a refusal."""
from __future__ import annotations

import numpy as np
import pytest

from ncclpy.semantics import dtypes as D
from ncclpy.errors import UnsupportedError


def test_complex_types_are_two_wire_elements():
    assert (D.logical("complex64").itemsize, D.logical("complex64").factor) == (8, 2)
    assert (D.logical("complex128").itemsize, D.logical("complex128").factor) == (16, 2)
    assert D.logical("complex64").wire.name == "float32"
    assert (D.logical("float64").itemsize, D.logical("float64").factor) == (8, 1)


def test_accepted_names_are_the_names_of_that_dtype_only():
    assert D.accepted_names("complex64") == ("complex64", "c64", "cfloat")
    assert D.accepted_names("c64") == ("complex64", "c64", "cfloat")
    assert D.accepted_names("float32") == ("float32", "f32", "float", "fp32", "ncclfloat",
                                           "ncclfloat32")


@pytest.mark.parametrize("obj,want", [
    (np.float32, "float32"), (np.float64, "float64"), (np.int8, "int8"), (np.uint64, "uint64"),
    (np.bool_, "bool"), (np.complex64, "complex64"), (np.dtype("float16"), "float16"),
    ("float_", "float64"), ("int_", "int64"), ("complex_", "complex128"), ("bool_", "bool"),
    ("numpy.float_", "float64"), ("<class 'numpy.bool_'>", "bool"), ("dtype('int32')", "int32"),
    ("torch.bfloat16", "bfloat16"), ("<f8", "float64"), ("|b1", "bool"),
    (float, "float64"), (int, "int64"), (bool, "bool"), (complex, "complex128"),
    ("float", "float32"),                  # the NCCL name (ncclFloat) stays float32
])
def test_numpy_scalar_types_and_aliases_mean_what_numpy_means(obj, want):
    assert D.dtype_name(obj) == want


@pytest.mark.parametrize("bad", ["half_", "float32_", "int32_"])
def test_a_stray_underscore_is_not_silently_dropped(bad):
    with pytest.raises(Exception, match=f"dtype '{bad}' is not a dtype ncclpy knows"):
        D.dtype_name(bad)


@pytest.mark.parametrize("code,dtype", [("f4", "float32"), ("i1", "int8"), ("c8", "complex64")])
def test_numpy_byte_codes_are_refused_with_the_name_to_write(code, dtype):
    with pytest.raises(Exception, match=f"numpy's byte-count code for {dtype}"):
        D.dtype_name(code)


def test_a_dtype_newer_than_nccl_names_both_versions_in_both_forms():
    with pytest.raises(UnsupportedError) as e:
        D.nccl_dtype("bfloat16", 2708)                 # NCCL <= 2.8 encodes 2.7.8 as 2708
    assert str(e.value) == "dtype 'bfloat16' needs NCCL >= 2.10.0; the loaded NCCL is 2.7.8"
    with pytest.raises(UnsupportedError) as e:
        D.nccl_dtype("float8_e4m3", 22309, version_note="planned for NCCL {}")
    assert str(e.value) == "dtype 'float8_e4m3' needs NCCL >= 2.24.0; planned for NCCL 2.23.9"
    assert D.nccl_dtype("float8_e4m3", 22400).name == "float8_e4m3"
    assert D.nccl_dtype("bfloat16", 0).name == "bfloat16"      # 0: no version to check
    assert D.nccl_dtype("float8_e5m2").name == "float8_e5m2"   # the default: no check


@pytest.mark.parametrize("code,text", [(9999, "9.9.99"), (10000, "1.0.0"), (2708, "2.7.8"),
                                       (22809, "2.28.9"), (23203, "2.32.3")])
def test_format_version(code, text):
    assert D.format_version(code) == text
