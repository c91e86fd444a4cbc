"""NCCL versions that introduced the native calls ncclpy otherwise emulates with send/recv."""
from __future__ import annotations

__all__ = ["NATIVE_MIN_VERSION"]

#: function -> first NCCL version code that exports it
NATIVE_MIN_VERSION = {"AlltoAll": 22800, "Gather": 22800, "Scatter": 22800}
