"""Semantics: what each collective means, independent of how it is called.

:mod:`.dtypes` (NCCL's wire types and their names), :mod:`.ops` (reduction operators, version
codes), :mod:`.registry` (the one table of collectives: byte counts, bus-bandwidth factors,
planners, references), :mod:`.scalars` (premul_sum's scalar encodings), :mod:`.numerics`
(verifiable inputs, bit views, ULP distances) and :mod:`.reference` (every collective in numpy,
rank order).  The reduction-order model (:mod:`ncclpy.order`) sits above, in its own room.
Nothing here loads CUDA, CuPy, NCCL or torch.  ``ncclpy.ops``, ``ncclpy.dtypes``,
``ncclpy.registry`` and ``ncclpy.reference`` stay importable under those names
(``ncclpy/__init__.py``).
"""
__all__: list = []
