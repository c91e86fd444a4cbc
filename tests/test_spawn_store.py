"""``ncclpy.spawn`` hosts the job's store in the parent, as ``ncclpy run``'s launcher does (issue
38, item 14): a child may connect a store client to the rendezvous address at once, without any
rank calling ``ncclpy.bootstrap``/``ncclpy.init`` first; the store closes when the children end.
Real child processes, real sockets."""
from __future__ import annotations

import json
import os
import socket

import pytest

import ncclpy
from ncclpy.errors import LaunchError, StoreError
from ncclpy.launch.spawn import spawn

pytestmark = pytest.mark.timeout(180)


# --- child functions (module level: the spawn start method pickles them by name) ------------
def _store_child(rank: int, outdir: str) -> None:
    """The issue's script: a store client at the rendezvous info's address, a set/get across
    ranks (each reads the next rank's key: it waits until that rank has written it)."""
    info = ncclpy.resolve()
    with ncclpy.TCPStore(info.master_addr, info.master_port, timeout=60,
                         connect_timeout=10) as store:
        store.set(f"from/{rank}", f"rank {rank} was here")
        peer = (rank + 1) % info.world_size
        got = store.get(f"from/{peer}", timeout=60).decode()
        total = store.add("ranks", 1)
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"got": got, "peer": peer, "addr": info.master_addr, "port": info.master_port,
                   "hosted_by": os.environ.get("NCCLPY_STORE_HOSTED_BY"), "add": total}, f)


def _noop_child(rank: int) -> None:
    pass


# --- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_store_client_at_the_rendezvous_address_works_under_spawn(tmp_path, start_method):
    n = 3
    assert spawn(_store_child, n, args=(str(tmp_path),), timeout=120,
                 start_method=start_method) is None
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(n)]
    for r, got in enumerate(res):
        assert got["got"] == f"rank {(r + 1) % n} was here", res
        assert got["hosted_by"] == "launcher", res     # rank 0 joins it as a client
    assert sorted(g["add"] for g in res) == [1, 2, 3], res
    addr, port = res[0]["addr"], res[0]["port"]
    # the children have all ended: so has the store they used (nothing listens any more)
    with pytest.raises(StoreError):
        ncclpy.TCPStore(addr, port, timeout=2, connect_timeout=1)


def test_a_master_port_spawn_cannot_bind_is_one_launch_error_before_any_child_starts():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(LaunchError) as ei:
            spawn(_noop_child, 2, master_port=port, timeout=60)
    finally:
        taken.close()
    msg = str(ei.value)
    assert f"could not host the job's store at 127.0.0.1:{port}" in msg and "\n" not in msg, msg
