"""Seeing and stopping what goes wrong: death notices and the heartbeat table of the watchdog.

(:mod:`ncclpy.watchdog` and :mod:`ncclpy.checked` stay where users import them.)
"""
from __future__ import annotations

__all__: list = []
