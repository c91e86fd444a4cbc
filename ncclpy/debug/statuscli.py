"""``ncclpy status``: one line per rank of a running job, laggards first.

It reads the progress every rank's watchdog publishes with its heartbeat
(:mod:`ncclpy.debug.status`) from the job's store: ``--master-addr``/``--master-port`` and
``NCCLPY_STORE_TOKEN`` as for ``ncclpy run`` (or ``NCCLPY_MASTER_ADDR``/``MASTER_ADDR``,
``NCCLPY_MASTER_PORT``/``MASTER_PORT``); without a port, the job of this user's running
``ncclpy run`` (``--job PID`` when there are several).  The token: ``NCCLPY_STORE_TOKEN``, else
the one a running single-node ``ncclpy run`` of this user recorded for that store (its job
file, :mod:`ncclpy.debug.jobfile`); a store that wants one and got none is one line saying
where a job's token is.  ``--watch SECONDS`` refreshes it until Ctrl-C.  A wrong address, port
or token is one line (exit 2).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, List, Optional, Sequence, Tuple

from ..cli_util import OneLineParser, run_main
from ..errors import StoreAuthError, StoreError
from .status import format_snapshot, snapshot

__all__ = ["main", "build_parser"]

PROG = "ncclpy status"


def _port(text: str) -> int:
    import argparse
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port 1..65535, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1..65535, got {v}")
    return v


def _seconds(text: str) -> float:
    import argparse
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.1 <= v < 86400:
        raise argparse.ArgumentTypeError(f"expected seconds between 0.1 and 86400, got {text!r}")
    return v


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description="Where is every rank of a running job, now: its "
                      "last call issued and completed, since when, and the line that made it; "
                      "laggards first.")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   metavar="H", help="address of the job's store (default: $NCCLPY_MASTER_ADDR, "
                                     "$MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=_port,
                   default=None, metavar="P", help="port of the job's ncclpy store (default: "
                   "$NCCLPY_MASTER_PORT, $MASTER_PORT, else this user's running ncclpy run)")
    p.add_argument("--job", type=int, default=None, metavar="PID",
                   help="the ncclpy run (launcher pid) to look at, when several run")
    p.add_argument("--comm", default=None, metavar="NAME", help="only this communicator")
    p.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _token_hint() -> str:
    """Where a job's store token is, for the errors about it."""
    from .jobfile import jobs_dir
    return (f"the job's token is in every rank's environment as NCCLPY_STORE_TOKEN (multi-node: "
            f"the value exported on every node); a single-node ncclpy run records it in its job "
            f"file in {jobs_dir()}, which {PROG} reads by itself")


def _job_token(addr: str, port: int) -> Optional[str]:
    """The token of this user's running ``ncclpy run`` whose store is ``addr:port``, if any."""
    from .jobfile import live_jobs
    for j in live_jobs():
        if int(j.get("port", -1)) == port and str(j.get("addr")) in (addr, "127.0.0.1",
                                                                       "localhost"):
            return j.get("token") or None
    return None


def _target(p: OneLineParser, ns: Any) -> Tuple[str, int, Optional[str], str]:
    """(addr, port, token, where it came from).  The token: ``NCCLPY_STORE_TOKEN``, else that of
    this user's running ``ncclpy run`` whose store it is (its job file)."""
    env = os.environ
    port_txt = env.get("NCCLPY_MASTER_PORT") or env.get("MASTER_PORT")
    addr = ns.master_addr or env.get("NCCLPY_MASTER_ADDR") or env.get("MASTER_ADDR")
    token = env.get("NCCLPY_STORE_TOKEN") or None
    if ns.master_port is not None:
        addr = addr or "127.0.0.1"
        return (addr, ns.master_port, token or _job_token(addr, ns.master_port),
                f"{p.flag('master_port')}")
    if port_txt and ns.job is None:
        try:
            port = _port(port_txt)
        except Exception:
            p.exit(2, f"{PROG}: error: MASTER_PORT / NCCLPY_MASTER_PORT: expected a port "
                      f"1..65535, got {port_txt!r}\n")
        addr = addr or "127.0.0.1"
        return addr, port, token or _job_token(addr, port), "the environment"
    from .jobfile import jobs_dir, live_jobs
    jobs = live_jobs()
    if ns.job is not None:
        jobs = [j for j in jobs if int(j["pid"]) == ns.job]
        if not jobs:
            p.exit(2, f"{PROG}: error: --job {ns.job}: no running ncclpy run with that pid "
                      f"(job files in {jobs_dir()})\n")
    if not jobs:
        p.exit(2, f"{PROG}: error: no running ncclpy run of this user found, and no "
                  f"--master-port (or MASTER_PORT) given; pass the job's --master-addr and "
                  f"--master-port with its NCCLPY_STORE_TOKEN\n")
    if len(jobs) > 1:
        pids = ", ".join(str(j["pid"]) for j in jobs)
        p.exit(2, f"{PROG}: error: {len(jobs)} ncclpy run jobs are running (launcher pids "
                  f"{pids}); choose one with --job PID\n")
    j = jobs[0]
    return (str(j["addr"]), int(j["port"]), j.get("token") or None,
            f"ncclpy run pid {j['pid']}")


def _show(store: Any, ns: Any, where: str) -> None:
    snap = snapshot(store, ns.comm)
    if ns.json:
        print(json.dumps({"store": where, "time": time.time(), "communicators": [
            {k: v for k, v in c.items() if k != "rows"} |
            {"ranks": [r.to_json() for r in c.get("rows", [])]} for c in snap]}, indent=1))
    else:
        print(format_snapshot(snap))
    sys.stdout.flush()


def _main(argv: List[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    addr, port, token, src = _target(p, ns)
    where = f"{addr}:{port}"
    from ..store import TCPStore
    try:
        store = TCPStore(addr, port, token=token, timeout=5.0, connect_timeout=2.0)
    except StoreAuthError as e:
        if token is None:
            p.exit(2, f"{PROG}: error: the store at {where} (from {src}) requires the job's "
                      f"token and none was given (set NCCLPY_STORE_TOKEN): {_token_hint()}\n")
        why = str(e).split(": ", 1)[-1]     # the store's reason, without the address again
        given = ("NCCLPY_STORE_TOKEN" if token == os.environ.get("NCCLPY_STORE_TOKEN")
                 else "the job file of the ncclpy run using that port")
        p.exit(2, f"{PROG}: error: the store at {where} (from {src}) refused the token from "
                  f"{given}: {why}; {_token_hint()}\n")
    except (StoreError, OSError) as e:
        p.exit(2, f"{PROG}: error: cannot reach the job's store at {where} (from {src}): "
                  f"{e}\n")
    with store:
        try:
            if ns.watch is None:
                _show(store, ns, where)
                return 0
            try:
                while True:
                    print(f"--- {time.strftime('%H:%M:%S')} {where}")
                    _show(store, ns, where)
                    time.sleep(ns.watch)
            except KeyboardInterrupt:
                return 0
        except StoreError as e:
            p.exit(2, f"{PROG}: error: the store at {where} stopped answering: {e}\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ncclpy status``; the exit code (0, 2 for a usage or connection error, 141)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_main(PROG, lambda: _main(args))
