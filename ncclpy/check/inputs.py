"""The inputs of a ``ncclpy check`` case, by kind (:data:`ncclpy.check.cases.INPUT_KINDS`), and
the conversions between a case's logical arrays and the float arrays NCCL reduces.

* ``verifiable``: :func:`ncclpy.semantics.numerics.verifiable_input` (every partial result exact in
  any order; random bit patterns for data movement);
* ``normal``: seeded standard normals, rounded to the type (per rank and block, from
  (seed, case, rank, block) like the verifiable ones);
* ``reveal``: :func:`ncclpy.order.reveal.revealing_inputs`, laid out per block, so that each
  output element ``i`` (reduce_scatter: of each rank's block) has the layout of element ``i``
  that :func:`ncclpy.order.reveal.observed_masks` decodes.

Complex types are reduced by NCCL as their float pairs (``LOGICAL[name].wire``, twice the
count): :func:`to_wire` and :func:`from_wire` go between the two views, bits unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..semantics import numerics as nm
from ..semantics.dtypes import LOGICAL

__all__ = ["block_input", "to_wire", "from_wire", "wire_name"]


def wire_name(dtype: str) -> str:
    """The NCCL type ``dtype``'s values travel and fold as (complex64 -> float32)."""
    return LOGICAL[dtype].wire.name


def to_wire(arr: Any, dtype: str) -> np.ndarray:
    """The 1-D array of NCCL's type that holds the bits of ``arr`` (logical ``dtype``):
    complex values as their float pairs; bfloat16/float8 as uint views, as the order model
    takes them."""
    return nm.from_bits(nm.as_bits(np.asarray(arr), dtype).reshape(-1), wire_name(dtype))


def from_wire(arr: Any, dtype: str) -> np.ndarray:
    """The logical array of ``dtype`` holding the bits of the wire array ``arr``."""
    bits = nm.as_bits(np.asarray(arr).reshape(-1), wire_name(dtype))
    if dtype == "complex32":
        return bits.view(np.float16).reshape(-1, 2)
    return nm.from_bits(bits, dtype)


def block_input(kind: str, dtype: str, count: int, *, op: Optional[str], world_size: int,
                seed: int, rank: int, tag: str, movement: bool = False,
                scalar: Optional[float] = None) -> np.ndarray:
    """Rank ``rank``'s block of ``count`` elements (logical ``dtype``) of input kind ``kind``;
    ``tag`` names the case and block (the same tag, the same block)."""
    if kind == "verifiable":
        return nm.verifiable_input(dtype, count, op=op, world_size=world_size, seed=seed,
                                   rank=rank, tag=tag, random_bits=movement, scalar=scalar)
    wire = wire_name(dtype)
    wcount = count * LOGICAL[dtype].factor
    if kind == "normal":
        rng = nm.rng_for(seed, rank, f"{tag}|normal")
        bits = nm.encode(rng.standard_normal(wcount), wire)
    elif kind == "reveal":
        from ..order.reveal import reveal_plan, revealing_inputs
        plan = reveal_plan(wire, world_size)
        bits = nm.as_bits(revealing_inputs(plan, wcount)[rank], wire)
    else:
        raise ValueError(f"inputs: expected verifiable, normal or reveal, got {kind!r}")
    return from_wire(nm.from_bits(bits, wire), dtype)
