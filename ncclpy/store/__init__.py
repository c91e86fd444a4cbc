"""ncclpy's TCP key-value store: the rendezvous point of a job.

``StoreServer`` (a daemon-thread server), ``TCPStore`` (its client, duck-compatible with
``torch.distributed.TCPStore``), ``StoreLimits`` (the server's bounds, also settable through
``NCCLPY_STORE_*`` environment variables: see :mod:`.limits`) and ``barrier``. The wire format
is in :mod:`.protocol`.
"""
from __future__ import annotations

from .client import TCPStore
from .limits import StoreLimits
from .server import StoreServer
from .sync import barrier

__all__ = ["StoreServer", "TCPStore", "StoreLimits", "barrier"]
