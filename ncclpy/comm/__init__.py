"""The call path: a user call -> resolved plan -> NCCL calls -> :class:`Work`.

``communicator`` (the :class:`Communicator` and its lifecycle), ``extras`` (split,
registration, NCCL memory), ``resolver`` and ``prepared`` (parse and plan once, cache),
``execute`` (issue a plan, groups), ``work`` (completion handles on pooled events),
``streams`` (which stream a call runs on).  The public names are re-exported here and at the
top of :mod:`ncclpy`.
"""
from __future__ import annotations

from ..debug.watchdog import default_timeout, env_flag
from .._nccl.collconfig import CollConfig
from .communicator import Communicator, Config, Registration, group
from .simulate import SimulatedGroup
from .startup import init

__all__ = ["Communicator", "Config", "CollConfig", "Registration", "init", "group",
           "SimulatedGroup", "default_timeout", "env_flag"]
