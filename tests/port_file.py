"""Rank 0 binds port 0 (the kernel picks a free port, atomically) and tells the other rank
processes through a file: no "find a free port, close it, bind it again" race, which an
outgoing connection's ephemeral port can win (EADDRINUSE)."""
from __future__ import annotations

import os
import time

__all__ = ["publish_port", "read_port"]


def publish_port(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically (rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(int(port)))
    os.replace(tmp, path)


def read_port(path: str, timeout: float = 60.0) -> int:
    """The port rank 0 published at ``path``, waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no port published at {path} within {timeout:g} s") from None
            time.sleep(0.02)
