"""The watchdog lives in :mod:`ncclpy.debug.watchdog` (the package of what goes wrong and how it is
seen); ``ncclpy.watchdog`` stays where users import it: this name *is* that module."""
import sys

from .debug import watchdog as _module

sys.modules[__name__] = _module
