"""Checked mode lives in :mod:`ncclpy.debug.checked` (the package of what goes wrong and how it is
seen); ``ncclpy.checked`` stays where users import it: this name *is* that module."""
import sys

from .debug import checked as _module

sys.modules[__name__] = _module
