"""TCP keepalive on the store's sockets: a peer host that froze or vanished is found in seconds.

Why: without it a connection to a host that stopped answering (powered off, kernel hung, network
cut) looks idle forever, and a pending call waits for its full timeout.  With these settings the
kernel probes an idle connection after :data:`IDLE` s, every :data:`INTERVAL` s, and resets it
after :data:`COUNT` unanswered probes (about 11 s in all).  A *process* that is stopped while its
host runs (SIGSTOP) still has its kernel answering probes: the client's application-level probe
(:mod:`.transport`) finds that case.
"""
from __future__ import annotations

import socket

__all__ = ["set_keepalive", "IDLE", "INTERVAL", "COUNT"]

IDLE, INTERVAL, COUNT = 5, 2, 3


def set_keepalive(sock: socket.socket) -> None:
    """Turn keepalive on with the module's timing (best effort: options the OS lacks are
    skipped)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    except OSError:
        return
    for name, value in (("TCP_KEEPIDLE", IDLE), ("TCP_KEEPINTVL", INTERVAL),
                        ("TCP_KEEPCNT", COUNT)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass
