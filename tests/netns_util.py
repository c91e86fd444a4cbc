"""Hosts made of Linux network namespaces, for multi-node tests on one machine.

:class:`Hosts` builds K namespaces ``ncclpy-<tag>-h<k>``, each with ``lo`` and an ``eth0`` holding
``10.213.0.<k+1>/24``, wired by veth pairs to a bridge that lives in a namespace of its own
(``ncclpy-<tag>-sw``): no interface, route or address is added to the machine's own namespace,
so all test traffic stays inside the namespaces made here (and their loopback).  ``close()``
deletes them all (the veths and the bridge go with their namespaces); processes started with
:meth:`Hosts.popen` are killed first.  :func:`cannot_make_namespaces` says why, where they
cannot be made (not root, no ``ip``, no CAP_SYS_ADMIN in a container...).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from typing import Optional, Sequence

__all__ = ["Hosts", "cannot_make_namespaces", "SUBNET"]

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def cannot_make_namespaces() -> Optional[str]:
    """None when network namespaces, veths and bridges can be made here; else why not."""
    if shutil.which("ip") is None:
        return "the ip command is missing (Debian: apt-get install iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"ncclpy-probe-{uuid.uuid4().hex[:8]}"
    try:
        res = _ip("netns", "add", name, check=False)
        if res.returncode != 0:
            return f"ip netns add failed: {res.stderr.strip()}"
        res = _ip("-n", name, "link", "add", "br0", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"cannot make a bridge in a namespace: {res.stderr.strip()}"
        res = _ip("-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "a1",
                  check=False)
        if res.returncode != 0:
            return f"cannot make a veth pair in a namespace: {res.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"ip netns failed: {e}"
    finally:
        _ip("netns", "del", name, check=False)


class Hosts:
    """K "hosts" (network namespaces) on one bridge; see the module docstring."""

    def __init__(self, k: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"ncclpy-{self.tag}-sw"
        self.names = [f"ncclpy-{self.tag}-h{i}" for i in range(k)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ("-n", self.switch)
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip(*sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip(*sw, "link", "set", f"p{i}", "master", "br0")
            _ip(*sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def addr(self, i: int) -> str:
        """The address of host ``i`` (its eth0)."""
        return f"{SUBNET}.{i + 1}"

    def popen(self, i: int, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` inside host ``i`` (``ip netns exec`` execs it: the pid is the
        command's own).  Killed by :meth:`close` if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):   # anything still running in a namespace made here
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()
