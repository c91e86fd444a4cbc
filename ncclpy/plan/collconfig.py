"""Planning with a per-collective config: a plan's collective calls become their
``nccl<Coll>Config`` variants, the ``ncclCollConfig_t`` address as the last argument.

Pure (no GPU, no NCCL call): the config's struct is made once per NCCL version and kept by the
:class:`~ncclpy.CollConfig` object, which the resolver's cache key holds.  A plan with a call
that has no config variant (the grouped ncclSend/ncclRecv of a fallback path) is refused: the
config could not be honoured, and silently dropping it would report work NCCL did not do.
"""
from __future__ import annotations

from typing import Any

from ..errors import ArgumentTypeError, UnsupportedError
from .types import NCCL_FUNCTIONS, NcclCall, Plan, nccl_call

__all__ = ["with_config", "check_config_arg"]


def check_config_arg(config: Any, call: str) -> Any:
    """``config`` of a collective: a CollConfig or None."""
    from .._nccl.collconfig import CollConfig
    if config is None or type(config) is CollConfig:
        return config
    raise ArgumentTypeError(f"{call}: config must be an ncclpy.CollConfig or None, got "
                            f"{type(config).__name__} {config!r}")


def with_config(plan: Plan, config: Any, nccl_version: int) -> Plan:
    """``plan`` with each NCCL call replaced by its config variant (VersionError below NCCL
    2.31; UnsupportedError when a call has none)."""
    config.check_version(nccl_version)
    ptr = config.pointer(nccl_version)
    steps = []
    for s in plan.steps:
        if type(s) is NcclCall:
            cfn = s.fn + "Config"
            if cfn not in NCCL_FUNCTIONS:
                raise UnsupportedError(
                    f"{plan.collective}: config= applies to NCCL's collective calls, but this "
                    f"call is planned as {plan.path} (ncclpy issues nccl{s.fn}, which takes no "
                    f"ncclCollConfig_t); drop config= or use a form NCCL runs natively")
            s = nccl_call(cfn, s.args + (ptr,))
        steps.append(s)
    meta = dict(plan.meta)
    meta["config"] = config.describe()
    return Plan(plan.collective, tuple(steps), plan.group, plan.premul, plan.scratch_bytes,
                plan.path, plan.nbytes, meta)
