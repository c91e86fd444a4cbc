"""Sphinx configuration of the ncclpy API reference.

Build: ``python -m sphinx -W --keep-going -b html docs/reference build/reference``;
examples: the same with ``-b doctest``.  Autodoc imports ncclpy's modules, which load CuPy,
torch and libnccl only when a call needs them, so the build needs no GPU.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)                        # ncclpy and bench from this checkout
sys.path.insert(0, os.path.join(HERE, "_ext"))  # the reference's own directives

import ncclpy  # noqa: E402

project = "ncclpy"
author = "ncclpy authors"
copyright = "ncclpy authors"
version = release = ncclpy.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "ncclpy_ref",
]

exclude_patterns = ["_build"]
templates_path: list = []
html_theme = "alabaster"
html_static_path: list = []
html_theme_options = {"description": "a thin, fast, honest Python layer over NVIDIA NCCL",
                      "page_width": "1100px"}

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# doctest: examples that need no GPU run everywhere; those that need one carry
# ``:skipif: NO_GPU`` (NO_GPU: ``ncclpy info``'s reason, '' where a GPU is usable) and say
# "Needs a GPU" in the text before them.
doctest_global_setup = """
import ncclpy
from ncclpy.info import no_gpu_reason
NO_GPU = no_gpu_reason()
"""
doctest_test_doctest_blocks = ""   # only explicit ``.. doctest::`` blocks run

import doctest  # noqa: E402

# exception messages are part of the API: check them (Sphinx's default ignores them)
doctest_default_flags = doctest.ELLIPSIS | doctest.DONT_ACCEPT_TRUE_FOR_1
