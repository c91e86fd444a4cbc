"""The launcher's address and port checks: the store's host must resolve (and, on one node,
be an address of this machine), and ports P (ncclpy's store) and P+1 (torch's) must be free.
"""
from __future__ import annotations

import socket
from typing import Any

from ..errors import ArgumentError, LaunchError

__all__ = ["bind_family", "check_local", "free_port", "check_port", "check_ports_free"]


def bind_family(host: str, flag: str = "--master-addr") -> int:
    """The address family to bind ``host`` with; a precise error when it does not resolve."""
    try:
        return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ArgumentError(f"{flag} {host!r}: cannot resolve this host name "
                            f"({getattr(e, 'strerror', None) or e})") from None


def check_local(host: str, name: str = "--master-addr") -> None:
    """On one node the launcher hosts the store here: ``host`` must be an address of this
    machine (``name``: the flag or argument, for the error)."""
    fam = bind_family(host)
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        where = ("with --nnodes 1 rank 0 runs here and hosts the store, so leave --master-addr "
                 "out (127.0.0.1)" if name.startswith("-") else
                 "spawn's ranks all run here and rank 0 hosts the store, so leave master_addr "
                 "out (127.0.0.1)")
        raise ArgumentError(
            f"{name} {host}: not an address of this machine ({e.strerror or e}); {where} or "
            f"give one of this machine's addresses") from None


def free_port(host: str) -> int:
    """A free port P on ``host`` (a local address) with P+1 free too (torch's store gets
    ``MASTER_PORT`` = P+1), below the kernel's ephemeral range where possible
    (:func:`ncclpy.rendezvous.free_port`)."""
    from ..rendezvous import free_port as pick
    try:
        return pick(host, span=2)
    except OSError as e:
        raise LaunchError(f"cannot pick a free port on {host} ({e.strerror or e}); pass "
                          f"--master-port") from None


def check_port(port: Any, name: str = "--master-port") -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65534:
        raise ArgumentError(f"{name}: expected a port in 1..65534 (ncclpy's store listens "
                            f"on P, torch's on P+1), got {port!r}")


def check_ports_free(host: str, port: int, name: str = "--master-port") -> None:
    """Rank 0 runs here: ncclpy's store needs ``port`` and torch's ``port + 1``, both free."""
    fam = bind_family(host, "--master-addr")
    for p, whose in ((port, "ncclpy's store"), (port + 1, "torch's store, P+1")):
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the stores do
                s.bind((host, p))
        except OSError as e:
            raise ArgumentError(f"{name} {port}: port {p} ({whose}) on {host} is not free "
                                f"({e.strerror or e}); pick another {name} or leave it out "
                                f"for a free pair") from None
