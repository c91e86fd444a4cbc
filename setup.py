"""The packages (the rest of the metadata is in pyproject.toml): ncclpy, and the repository's
bench/ folder installed as ``ncclpy_bench``, the sweep behind ``ncclpy bench`` (``python -m
bench`` in a checkout, ``python -m ncclpy_bench`` installed).  No top-level ``bench`` package is
installed: it would clash with anything else of that name in a user's environment.  bench/
imports itself relatively, so one source serves both names."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["ncclpy", "ncclpy.*"]) + ["ncclpy_bench",
                                                                "ncclpy_bench.backends"],
      package_dir={"ncclpy_bench": "bench"})
