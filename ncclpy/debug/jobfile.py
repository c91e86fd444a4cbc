"""The job file of a running ``ncclpy run``: how ``ncclpy status`` finds its store.

A single-node ``ncclpy run`` picks its store's port and a random token itself, so nobody else
knows them.  While it runs, the launcher hosting the store writes them, readable by its user
only (mode 0600), to ``<tmp>/ncclpy-jobs-<uid>/<launcher pid>.json`` and removes the file when it
ends; ``ncclpy status`` without ``--master-port`` reads the files of launchers still alive.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

__all__ = ["jobs_dir", "write_job", "remove_job", "live_jobs"]


def jobs_dir() -> str:
    """``<tmp>/ncclpy-jobs-<uid>``."""
    return os.path.join(tempfile.gettempdir(), f"ncclpy-jobs-{os.getuid()}")


def write_job(addr: str, port: int, token: str, world: int, trace_dir: str,
              command: List[str]) -> Optional[str]:
    """Write this launcher's job file; its path (None when it could not be written)."""
    d = jobs_dir()
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"{os.getpid()}.json")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "addr": addr, "port": port, "token": token,
                       "world": world, "trace_dir": trace_dir, "command": command,
                       "started": time.time()}, f)
        os.replace(path + ".tmp", path)
        return path
    except OSError:
        return None


def remove_job(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_jobs() -> List[Dict[str, Any]]:
    """The job files of this user's launchers still running, newest first."""
    d = jobs_dir()
    out = []
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for n in names:
        if not n.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, n)) as f:
                job = json.load(f)
            if _alive(int(job["pid"])):
                out.append(job)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda j: -float(j.get("started", 0)))
