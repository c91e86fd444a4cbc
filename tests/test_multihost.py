"""Several hosts for real: ``ncclpy run --nnodes K`` and torchrun across network namespaces.

Each host is a network namespace with its own address in 10.213.0.0/24, joined by a bridge in
a namespace of its own (tests/netns_util.py); nothing touches the machine's own network.  The
namespaces are made once for this module and removed at its end, also when a test fails; the
tests skip, with the reason, where namespaces cannot be made (not root, no iproute2, ...).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from netns_util import Hosts, cannot_make_namespaces

WHY_NOT = cannot_make_namespaces()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

TOKEN = "0123456789abcdef0123456789abcdef"

_SCRIPT = r"""
import os, socket, sys, time
import ncclpy
out, t = sys.argv[1], float(sys.argv[2])
bs = ncclpy.bootstrap("a", timeout=t)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((bs.info.master_addr, 9))            # no packet: just the route to the store's host
me = s.getsockname()[0]
row = (bs.rank, bs.world_size, bs.local_rank, bs.info.source, bs.info.store_kind,
       bs.info.master_addr, os.environ.get("NCCLPY_STORE_TOKEN", "-"), me, bs.uid.hex())
with open(os.path.join(out, f"rank{bs.rank}.txt"), "w") as f:
    f.write(" ".join(map(str, row)))
time.sleep(float(os.environ.get("HOLD", "0")))
"""


@pytest.fixture(scope="module")
def hosts():
    h = Hosts(3)
    try:
        yield h
    finally:
        h.close()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCLPY_", "MASTER_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(NCCLPY_STORE_TOKEN=TOKEN, GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _script(tmp_path) -> str:
    p = tmp_path / "ranks.py"
    p.write_text(_SCRIPT)
    return str(p)


def _run_node(hosts, k: int, nnodes: int, port: int, cmd: list, *, nproc: int = 2,
              master: str = "", env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ncclpy", "run", "--nnodes", str(nnodes), "--node-rank",
            str(k), "--master-addr", master or hosts.addr(0), "--master-port", str(port),
            "-n", str(nproc), *cmd]
    return hosts.popen(k, argv, env=env or _env(), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)


def _finish(procs, timeout: float) -> list[tuple[int, str, str]]:
    """(rc, stdout, stderr) of each, all within ``timeout`` s (then killed: a test failure)."""
    end = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate(timeout=10)
            pytest.fail(f"{p.args[4:]} still running after {timeout} s:\n{o}\n{e}")
        outs.append((p.returncode, o, e))
    return outs


def _rows(tmp_path, n: int) -> list[list[str]]:
    return [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(n)]


def test_ncclpy_run_on_3_hosts_shares_one_uid_and_the_token(hosts, tmp_path):
    cmd = [sys.executable, _script(tmp_path), str(tmp_path), "30"]
    procs = [_run_node(hosts, k, 3, 29610, cmd) for k in range(3)]
    for rc, o, e in _finish(procs, 90):
        assert rc == 0, o + e
    rows = _rows(tmp_path, 6)
    for r, row in enumerate(rows):
        assert row[:8] == [str(r), "6", str(r % 2), "NCCLPY", "ncclpy", hosts.addr(0), TOKEN,
                           hosts.addr(r // 2)]   # rank r runs on host r // 2, with its address
    assert len({row[8] for row in rows}) == 1


@pytest.mark.slow
def test_ncclpy_check_on_gloo_passes_across_2_hosts(hosts):
    cmd = [sys.executable, "-m", "ncclpy", "check", "--backend", "gloo", "--collectives",
           "all_reduce,broadcast", "--dtypes", "float32", "--sizes", "8", "--timeout", "60"]
    procs = [_run_node(hosts, k, 2, 29620, cmd) for k in range(2)]
    (rc0, o0, e0), (rc1, o1, e1) = _finish(procs, 180)
    assert rc0 == 0 and rc1 == 0, o0 + e0 + o1 + e1
    assert "on 4 ranks (gloo)" in o0 and ", 0 failed" in o0 and "passed bit for bit" in o0


@pytest.mark.slow
def test_torchrun_across_2_hosts_joins_torchruns_store(hosts, tmp_path):
    pytest.importorskip("torch")
    script = _script(tmp_path)
    env = _env()
    del env["NCCLPY_STORE_TOKEN"]   # torchrun's store: no token of ncclpy's
    procs = [hosts.popen(k, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                             "--node-rank", str(k), "--nproc-per-node", "2", "--master-addr",
                             hosts.addr(0), "--master-port", "29630", script, str(tmp_path),
                             "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True) for k in range(2)]
    for rc, o, e in _finish(procs, 180):
        assert rc == 0, o + e
    rows = _rows(tmp_path, 4)
    for r, row in enumerate(rows):
        assert row[:8] == [str(r), "4", str(r % 2), "torchrun", "torchrun", hosts.addr(0), "-",
                           hosts.addr(r // 2)]
    assert len({row[8] for row in rows}) == 1


def test_a_killed_launcher_fails_the_other_hosts_fast_naming_its_node(hosts, tmp_path):
    cmd = [sys.executable, _script(tmp_path), str(tmp_path), "100"]   # rendezvous' deadline
    env = _env(HOLD="600")                      # the ranks end only when stopped
    procs = [_run_node(hosts, k, 3, 29640, cmd, env=env) for k in range(3)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank*.txt"))) < 6:     # every rank past the rendezvous
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [_finish([p], 5) for p in procs if p.poll() is not None]
        time.sleep(0.1)
    t0 = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    outs = _finish([procs[0], procs[2]], 120)
    took = time.monotonic() - t0
    for rc, o, e in outs:
        assert rc == 1, o + e
        assert "node 1 (ranks 2-3) stopped heartbeating" in e, e
        assert "stopped this node's 2 running ranks" in e
    # fast: the heartbeat silence limit (4 s) and the grace on an idle machine; the bound is a
    # deadline far below the ranks' own 600 s, whatever the load
    assert took < 90, f"the other hosts took {took:.1f} s to stop"


def test_a_wrong_token_on_one_host(hosts, tmp_path):
    """Host 1's ranks: a clear auth error; host 0's rank 0: a timeout naming ranks 2 and 3."""
    cmd = [sys.executable, _script(tmp_path), str(tmp_path), "4"]
    p0 = _run_node(hosts, 0, 2, 29650, cmd)
    p1 = _run_node(hosts, 1, 2, 29650, cmd, env=_env(NCCLPY_STORE_TOKEN="f" * 32))
    t0 = time.monotonic()
    (rc0, o0, e0), (rc1, o1, e1) = _finish([p0, p1], 40)
    assert time.monotonic() - t0 < 25
    assert rc0 != 0 and rc1 != 0
    # both of host 1's ranks fail alike; fail-fast may stop one before it prints its error
    assert ("[rank 2]" in e1 or "[rank 3]" in e1) and "token" in e1.lower() \
        and "RendezvousError" in e1, e1
    assert "[rank 0]" in e0 and "waited 4 s to collect the 3 acknowledgements" in e0, e0
    assert "Ranks 2, 3 never reached the store" in e0, e0


def test_an_unreachable_master_address_is_a_clear_error_within_the_timeout(hosts, tmp_path):
    cmd = [sys.executable, _script(tmp_path), str(tmp_path), "3"]
    t0 = time.monotonic()
    p = _run_node(hosts, 1, 2, 29660, cmd, master="10.213.0.99")   # nobody has it
    ((rc, o, e),) = _finish([p], 40)
    assert time.monotonic() - t0 < 25
    assert rc != 0
    assert "could not reach the store at 10.213.0.99:29660 (hosted by rank 0) within 3 s" in e, e
