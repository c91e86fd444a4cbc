"""``ncclSetEncryption`` (NCCL 2.32): ask NCCL to encrypt its TCP sockets with a pre-shared key.

Process-wide and set before any communicator exists; NCCL built without TLS support refuses it
(its error is raised as ncclpy's NcclError subclass).  Bound from the 2.32 header's
``ncclEncryptionConfig_t`` (mode, psk) and proven by the binding gate.
"""
from __future__ import annotations

import ctypes
from typing import Optional

from ..errors import ArgumentError, ArgumentTypeError

__all__ = ["EncryptionConfigStruct", "ENCRYPTION_MODE_NONE", "ENCRYPTION_MODE_PSK",
           "ENCRYPTION_CONFIG_VERSION", "encryption_struct", "set_encryption"]

ENCRYPTION_MODE_NONE = 0           # NCCL_ENCRYPTION_MODE_NONE
ENCRYPTION_MODE_PSK = 1            # NCCL_ENCRYPTION_MODE_PSK
ENCRYPTION_CONFIG_VERSION = 23200  # ncclEncryptionConfig_v23200


class EncryptionConfigStruct(ctypes.Structure):
    """``ncclEncryptionConfig_t`` as nccl.h of NCCL 2.32 declares it."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint),
                ("version", ctypes.c_uint), ("mode", ctypes.c_int),
                ("psk", ctypes.c_char_p)]


def encryption_struct(psk: Optional[str]) -> EncryptionConfigStruct:
    """The config for ``psk`` (None: plaintext, NCCL_ENCRYPTION_MODE_NONE)."""
    from .config import CONFIG_MAGIC
    if psk is not None and not isinstance(psk, str):
        raise ArgumentTypeError(f"set_encryption: psk: expected a str or None, got "
                                f"{type(psk).__name__}")
    if psk is not None and (not psk or "\x00" in psk):
        raise ArgumentError("set_encryption: psk is empty or contains a NUL character; "
                            "expected the pre-shared key text, or None for plaintext")
    s = EncryptionConfigStruct()
    s.size = ctypes.sizeof(EncryptionConfigStruct)
    s.magic = CONFIG_MAGIC
    s.version = ENCRYPTION_CONFIG_VERSION
    s.mode = ENCRYPTION_MODE_NONE if psk is None else ENCRYPTION_MODE_PSK
    s.psk = None if psk is None else psk.encode()
    return s


def set_encryption(psk: Optional[str]) -> None:
    """``ncclSetEncryption``: encrypt NCCL's TCP sockets with ``psk`` (None: plaintext).
    VersionError below NCCL 2.32; NCCL's own error where it was built without TLS."""
    from .lib import get_lib
    lib = get_lib()
    s = encryption_struct(psk)
    lib.check(lib.fn("ncclSetEncryption")(ctypes.addressof(s)), "ncclSetEncryption")
