"""Seeing and stopping what goes wrong: the watchdog and its heartbeats and death notices,
checked mode with its send/recv pairing and the ranks' agreement, the flight recorder,
``ncclpy trace``, ``ncclpy status`` and NVTX ranges.

The watchdog (:mod:`ncclpy.debug.watchdog`) and checked mode (:mod:`ncclpy.debug.checked`) live
here; ``ncclpy.watchdog`` and ``ncclpy.checked`` stay where users import them (the same
modules).
"""
from __future__ import annotations

__all__: list = []
