"""Buffers: what ncclpy accepts as a send or receive buffer, device or host, and how it is keyed.

The room of one concern: :mod:`.buffer` parses a buffer (the entry point, :func:`as_buffer`),
:mod:`.spec` holds the parsed form and the checks every parser shares, :mod:`.host` parses host
memory (the CPU backend), :mod:`.dlpack` reads DLPack capsules, :mod:`.key` keys a buffer for
the prepared-call caches.  Imports point down: spec and dlpack below host, host below buffer,
buffer below key.  This face hands on :mod:`.buffer`'s public names, so ``from ncclpy.buffers
import Buffer, as_buffer`` keeps working.
"""
from __future__ import annotations

from .buffer import (DEVICE_HOST, DEVICE_UNKNOWN, Buffer, BufferSpec, DLPackInfo, as_buffer,
                     device_of, from_cai, host_memory, parse_dlpack_capsule, set_host_memory,
                     type_kind)

__all__ = ["BufferSpec", "Buffer", "as_buffer", "DEVICE_HOST", "DEVICE_UNKNOWN",
           "parse_dlpack_capsule", "DLPackInfo", "type_kind", "device_of", "from_cai",
           "set_host_memory", "host_memory"]
