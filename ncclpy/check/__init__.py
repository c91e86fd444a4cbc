"""``ncclpy check``: every collective through torch.distributed and ncclpy on identical seeded
inputs, compared byte for byte with each other and with a reference: for all_reduce, reduce and
reduce_scatter on float types, wherever the reduction-order model predicts the call, its
prediction of NCCL's bits (bit for bit, for any input); elsewhere
:mod:`ncclpy.reference`'s fold in rank order, with the reason (docs:
concepts/check-reference).  Without a GPU, ncclpy runs on its CPU backend ("CPU backend: NCCL's
semantics and order, not NCCL").

Modules: :mod:`.cases` (the matrix and what gloo supports), :mod:`.runner` (one case on one rank),
:mod:`.inputs` (the input kinds: verifiable, normal, order-revealing), :mod:`.exact` (a rank's
comparisons with NCCL's order), :mod:`.refs` (rank 0's choice of each side's reference),
:mod:`.refheader` (what the header says about the references), :mod:`.nccl_log` (``--backend
nccl``: what NCCL's debug log says about ncclpy's communicator),
:mod:`.session` (a rank's whole run), :mod:`.cpu_side` (``--backend cpu``: ncclpy's side on its
CPU backend against torch's gloo), :mod:`.divergences` (torch's known divergences and refusals,
and the torch versions they were validated with),
:mod:`.fairness` (pinned environment, same libnccl, placement under torchrun),
:mod:`.torch_backends` (``--torch-backend``: torch's NCCL backends and the implementation each
one runs),
:mod:`.compare` (byte and ULP comparison), :mod:`.report` (table rows, summary and JSON),
:mod:`.overview` (progress line, collective x dtype matrix, what did not pass),
:mod:`ncclpy.check.cli` (``main(argv)``), :mod:`.seed_examples` (the seed tutorials' examples
as data), :mod:`.launched` (under a launcher: what it read, said first; not meeting the peers
in one line), :mod:`.memory` (sizes that cannot fit refused before any rank starts),
``schema.json`` (the ``--json`` file's schema).  ``session``
imports ``runner``, never the reverse.
Importing this package imports neither torch nor CuPy.
"""
from __future__ import annotations

__all__: list = []
