"""NCCL's reduction order: which fold of the ranks' contributions NCCL computes for each output
element of a Ring or Tree reduction, predicted from NCCL's source, and the bits it gives.

A pure model (no GPU): :class:`OrderConfig` describes a call, :func:`predict` gives its
:class:`Prediction` (or raises :class:`CannotPredict` with the reason), ``Prediction.outputs``
the bits for given inputs, :func:`judge` the verdict on what NCCL returned;
:class:`Pins` what NCCL's environment pins (and what the CPU backend then runs).  Revealing inputs
(:mod:`ncclpy.order.reveal`) make NCCL's output say the order it used; NCCL's debug logs
(:mod:`ncclpy.order.logs`) say what it did.  ``ncclpy order`` is the command line.
"""
from __future__ import annotations

from .config import OrderConfig
from .model import OrderMap, Prediction, predict
from .pins import Choice, PinError, Pins
from .reveal import RevealPlan, observed_masks, reveal_plan, revealing_inputs, signature
from .topology import Expr, expr_to_json, format_expr
from .verdict import CANNOT_PREDICT, MISMATCH, PREDICTED, Verdict, cannot_predict, judge
from .versions import PORTS, CannotPredict, checked_versions

__all__ = ["OrderConfig", "OrderMap", "Prediction", "predict", "RevealPlan", "reveal_plan",
           "revealing_inputs", "observed_masks", "signature", "Expr", "format_expr",
           "expr_to_json", "PREDICTED", "MISMATCH", "CANNOT_PREDICT", "Verdict", "judge",
           "cannot_predict", "CannotPredict", "PORTS", "checked_versions", "Pins", "Choice",
           "PinError"]
