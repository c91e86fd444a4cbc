"""The rendezvous environment matrix: each launcher's variables, precedence, missing, conflicts."""
from __future__ import annotations

import logging

import pytest

from ncclpy.errors import ArgumentError, RendezvousError
from ncclpy.launch.env import RENDEZVOUS_VARS, rank_env
from ncclpy.rendezvous import RendezvousInfo, expand_hostlist, first_host, resolve

ADDR = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", **ADDR}
OMPI = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
         "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[03-06],login1",
         "SLURM_JOB_ID": "4242"}
NCCLPY = {"NCCLPY_RANK": "2", "NCCLPY_WORLD_SIZE": "4", "NCCLPY_LOCAL_RANK": "2",
          "NCCLPY_LOCAL_WORLD_SIZE": "4", "NCCLPY_MASTER_ADDR": "127.0.0.1",
          "NCCLPY_MASTER_PORT": "41000"}

# (id, env, kwargs, expected (rank, world, local_rank, local_world, addr, port, source, device))
OK_CASES = [
    ("torchrun", TORCHRUN, {}, (5, 8, 1, 4, "10.0.0.1", 29500, "torchrun", None)),
    ("torchrun-elastic-port-shift", {**TORCHRUN, "TORCHELASTIC_RUN_ID": "abc"}, {},
     (5, 8, 1, 4, "10.0.0.1", 29501, "torchrun", None)),
    ("torchrun-elastic-explicit-ncclpy-port",
     {**TORCHRUN, "TORCHELASTIC_RUN_ID": "abc", "NCCLPY_MASTER_PORT": "31000"}, {},
     (5, 8, 1, 4, "10.0.0.1", 31000, "torchrun", None)),
    ("torchrun-elastic-explicit-arg-port", {**TORCHRUN, "TORCHELASTIC_RUN_ID": "abc"},
     {"master_port": 32000}, (5, 8, 1, 4, "10.0.0.1", 32000, "torchrun", None)),
    ("torchrun-no-local-vars", {"RANK": "3", "WORLD_SIZE": "4", **ADDR}, {},
     (3, 4, 3, 4, "10.0.0.1", 29500, "torchrun", None)),
    ("openmpi-with-master-addr", {**OMPI, **ADDR}, {},
     (6, 8, 2, 4, "10.0.0.1", 29500, "openmpi", None)),
    ("openmpi-under-slurm-batch", {**OMPI, "SLURM_PROCID": "0", "SLURM_NTASKS": "8",
                                   "SLURM_JOB_NODELIST": "n[7-8]", "MASTER_PORT": "29600"}, {},
     (6, 8, 2, 4, "n7", 29600, "openmpi", None)),
    ("mpich-pmi", {**MPICH, **ADDR}, {}, (3, 4, 1, 2, "10.0.0.1", 29500, "mpich", None)),
    ("mpich-pmix-agrees", {**MPICH, "PMIX_RANK": "3", **ADDR}, {},
     (3, 4, 1, 2, "10.0.0.1", 29500, "mpich", None)),
    ("cray-pmi-local-vars", {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1",
                             "PMI_LOCAL_SIZE": "4", **ADDR}, {},
     (5, 8, 1, 4, "10.0.0.1", 29500, "mpich", None)),
    ("slurm", {**SLURM, "MASTER_PORT": "29500"}, {},
     (7, 16, 3, 4, "gpu03", 29500, "slurm", None)),
    ("slurm-port-from-job-id", SLURM, {}, (7, 16, 3, 4, "gpu03", 20000 + 4242, "slurm", None)),
    ("slurm-tasks-per-node-compressed",
     {"SLURM_PROCID": "9", "SLURM_NTASKS": "10", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
      "SLURM_TASKS_PER_NODE": "3(x3),1", "SLURM_NODELIST": "a1,b[2-5]", "MASTER_PORT": "1234"},
     {}, (9, 10, 0, 1, "a1", 1234, "slurm", None)),
    ("slurm-master-addr-wins", {**SLURM, **ADDR}, {},
     (7, 16, 3, 4, "10.0.0.1", 29500, "slurm", None)),
    ("ncclpy-vars", NCCLPY, {}, (2, 4, 2, 4, "127.0.0.1", 41000, "NCCLPY", None)),
    ("ncclpy-with-device", {**NCCLPY, "NCCLPY_DEVICE": "1"}, {},
     (2, 4, 2, 4, "127.0.0.1", 41000, "NCCLPY", 1)),
    ("ncclpy-over-torchrun-names", {**rank_env(2, 4, 2, 4, "127.0.0.1", 41000, "t")}, {},
     (2, 4, 2, 4, "127.0.0.1", 41000, "NCCLPY", None)),
    ("torchrun-over-openmpi-nested", {**TORCHRUN, "OMPI_COMM_WORLD_RANK": "1",
                                      "OMPI_COMM_WORLD_SIZE": "2"}, {},
     (5, 8, 1, 4, "10.0.0.1", 29500, "torchrun", None)),
    ("torchrun-over-slurm-batch", {**TORCHRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, {},
     (5, 8, 1, 4, "10.0.0.1", 29500, "torchrun", None)),
    ("torchrun-and-openmpi-agree", {**TORCHRUN, **OMPI, "OMPI_COMM_WORLD_RANK": "5"}, {},
     (5, 8, 1, 4, "10.0.0.1", 29500, "torchrun", None)),
    ("args-override-env", TORCHRUN, {"rank": 4, "local_rank": 0,
                                     "master_addr": "h", "master_port": 7000},
     (4, 8, 0, 4, "h", 7000, "args", None)),
    ("args-world-size-overrides-env", TORCHRUN, {"world_size": 6},
     (5, 6, 1, 4, "10.0.0.1", 29500, "torchrun", None)),
    ("args-rank-silences-env-conflict",
     {"RANK": "1", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      **ADDR}, {"rank": 3}, (3, 4, 3, 4, "10.0.0.1", 29500, "args", None)),
    ("args-only", {}, {"rank": 1, "world_size": 2, "master_addr": "h", "master_port": 7000},
     (1, 2, 1, 2, "h", 7000, "args", None)),
    ("args-device", {}, {"rank": 1, "world_size": 2, "master_addr": "h", "master_port": 7000,
                         "device": 0}, (1, 2, 1, 2, "h", 7000, "args", 0)),
    ("ncclpy-addr-over-master-addr", {**TORCHRUN, "NCCLPY_MASTER_ADDR": "store-host"}, {},
     (5, 8, 1, 4, "store-host", 29500, "torchrun", None)),
    ("whitespace-tolerated", {"RANK": " 1 ", "WORLD_SIZE": "2 ", **ADDR}, {},
     (1, 2, 1, 2, "10.0.0.1", 29500, "torchrun", None)),
]


@pytest.mark.parametrize("env,kwargs,expected", [c[1:] for c in OK_CASES],
                         ids=[c[0] for c in OK_CASES])
def test_resolve_matrix(env, kwargs, expected):
    info = resolve(env=env, **kwargs)
    assert isinstance(info, RendezvousInfo)
    got = (info.rank, info.world_size, info.local_rank, info.local_world_size,
           info.master_addr, info.master_port, info.source, info.device)
    assert got == expected


def test_world_size_one_defaults_to_loopback_and_a_free_port():
    info = resolve(rank=0, world_size=1, env={})
    assert (info.rank, info.world_size, info.master_addr) == (0, 1, "127.0.0.1")
    assert 0 < info.master_port < 65536
    info = resolve(env={"RANK": "0", "WORLD_SIZE": "1"})
    assert info.master_addr == "127.0.0.1" and info.source == "torchrun"


def test_torchrun_port_shift_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="ncclpy.rendezvous"):
        resolve(env={**TORCHRUN, "TORCHELASTIC_RUN_ID": "x"})
    assert "MASTER_PORT+1" in caplog.text



@pytest.mark.parametrize("extra, port, kind", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, 29500, "torchrun"),   # join torchrun's store
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, 29501, "ncclpy"),    # own store beside it
    ({}, 29501, "ncclpy"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "NCCLPY_MASTER_PORT": "31000"}, 31000, "ncclpy"),
])
def test_torchrun_store_kind(extra, port, kind):
    info = resolve(env={**TORCHRUN, "TORCHELASTIC_RUN_ID": "x", **extra})
    assert (info.master_port, info.store_kind) == (port, kind)
    assert resolve(env=TORCHRUN).store_kind == "ncclpy"   # plain RANK/MASTER_*: not torchrun

# (id, env, kwargs, substrings that must all appear in the one error)
BAD_CASES = [
    ("nothing", {}, {}, ["no rank found", "no world size found", "no store address",
                         "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK", "found: none"]),
    ("contradictory-torchrun-openmpi",
     {"RANK": "1", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      **ADDR}, {}, ["contradictory rank", "RANK=1", "OMPI_COMM_WORLD_RANK=2"]),
    ("contradictory-unknown-size", {"RANK": "1", "WORLD_SIZE": "4", "PMI_RANK": "3", **ADDR}, {},
     ["contradictory rank", "PMI_RANK=3"]),
    ("contradictory-pmi-pmix", {**MPICH, "PMIX_RANK": "0", **ADDR}, {},
     ["contradictory rank", "PMIX_RANK=0"]),
    ("contradictory-pmix-only", {"PMIX_RANK": "2", "RANK": "1", "WORLD_SIZE": "4", **ADDR}, {},
     ["contradictory rank", "PMIX_RANK=2", "RANK=1"]),
    ("contradictory-pmi-local-rank", {**MPICH, "PMI_LOCAL_RANK": "0", **ADDR}, {},
     ["contradictory local_rank", "MPI_LOCALRANKID=1", "PMI_LOCAL_RANK=0"]),
    ("contradictory-ncclpy-torchrun", {**NCCLPY, "RANK": "3", "WORLD_SIZE": "4"}, {},
     ["contradictory rank", "NCCLPY_RANK=2", "RANK=3"]),
    ("rank-not-below-world", {"RANK": "4", "WORLD_SIZE": "4", **ADDR}, {},
     ["rank 4", "world size 4"]),
    ("local-rank-not-below", {**TORCHRUN, "LOCAL_RANK": "4"}, {},
     ["local rank 4", "local world size 4"]),
    ("non-integer-rank", {"RANK": "one", "WORLD_SIZE": "4", **ADDR}, {},
     ["RANK='one' is not an integer"]),
    ("negative-world", {"RANK": "0", "WORLD_SIZE": "-2", **ADDR}, {}, ["WORLD_SIZE='-2'"]),
    ("zero-world", {"RANK": "0", "WORLD_SIZE": "0", **ADDR}, {}, ["WORLD_SIZE='0' must be >= 1"]),
    ("non-integer-port", {**TORCHRUN, "MASTER_PORT": "http"}, {},
     ["MASTER_PORT='http' is not an integer"]),
    ("port-out-of-range", {**TORCHRUN, "MASTER_PORT": "70000"}, {}, ["above 65535"]),
    ("elastic-port-shift-out-of-range",
     {**TORCHRUN, "MASTER_PORT": "65535", "TORCHELASTIC_RUN_ID": "x"}, {}, ["above 65535"]),
    ("rank-without-world", {"RANK": "0", **ADDR}, {}, ["no world size found"]),
    ("world-without-rank", {"OMPI_COMM_WORLD_SIZE": "4", **ADDR}, {}, ["no rank found"]),
    ("no-address", {"RANK": "0", "WORLD_SIZE": "2"}, {},
     ["no store address found", "no store port found"]),
    ("mpi-without-slurm-or-addr", MPICH, {}, ["no store address found"]),
    ("bad-nodelist", {**SLURM, "SLURM_JOB_NODELIST": "gpu[03-"}, {}, ["SLURM_JOB_NODELIST"]),
    ("bad-device", {**NCCLPY, "NCCLPY_DEVICE": "cuda:0"}, {}, ["NCCLPY_DEVICE='cuda:0'"]),
    ("bad-arg", {}, {"rank": "x", "world_size": 2, "master_addr": "h", "master_port": 1},
     ["argument rank='x' is not an integer"]),
    ("args-contradict-env-local", TORCHRUN, {"world_size": 2, "rank": 0},
     ["local world size 4 exceeds world size 2"]),
    ("bool-arg", {}, {"rank": True, "world_size": 2, "master_addr": "h", "master_port": 1},
     ["argument rank=True"]),
    ("several-problems-one-error", {"RANK": "x", "WORLD_SIZE": "y", "MASTER_PORT": "z"}, {},
     ["RANK='x'", "WORLD_SIZE='y'", "MASTER_PORT='z'", "no store address"]),
]


@pytest.mark.parametrize("env,kwargs,needles", [c[1:] for c in BAD_CASES],
                         ids=[c[0] for c in BAD_CASES])
def test_resolve_errors(env, kwargs, needles):
    with pytest.raises(RendezvousError) as ei:
        resolve(env=env, **kwargs)
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in:\n{msg}"
    # the one error lists what was looked for and what was found
    assert "looked for:" in msg and "found:" in msg
    for var in env:
        if env[var].strip():
            assert var in msg


@pytest.mark.parametrize("nodelist,first,expanded", [
    ("node[01-04,07],gpu3", "node01", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
    ("gpu3", "gpu3", ["gpu3"]),
    ("a,b,c", "a", ["a", "b", "c"]),
    ("n[9-11]", "n9", ["n9", "n10", "n11"]),
    ("n[008-010]", "n008", ["n008", "n009", "n010"]),
    ("rack[1-2]-n[1,3]", "rack1-n1", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("x[5]y", "x5y", ["x5y"]),
    ("host-1.example.org,n[1-2].example.org", "host-1.example.org",
     ["host-1.example.org", "n1.example.org", "n2.example.org"]),
])
def test_slurm_nodelist(nodelist, first, expanded):
    assert first_host(nodelist) == first
    assert expand_hostlist(nodelist) == expanded


@pytest.mark.parametrize("bad", ["", "n[1-", "n]1[", "n[]", "n[3-1]", "n[a-b]", "n[1-2"])
def test_slurm_nodelist_malformed(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)
    with pytest.raises(ValueError):
        first_host(bad)


def test_rank_env_sets_every_name():
    env = rank_env(3, 8, 1, 4, "10.1.2.3", 29400, "tok", device=1, extra={"NCCL_NET": "Socket"})
    assert set(RENDEZVOUS_VARS) <= set(env)
    assert all(isinstance(v, str) for v in env.values())
    assert env["NCCLPY_RANK"] == env["RANK"] == "3"
    assert env["NCCLPY_WORLD_SIZE"] == env["WORLD_SIZE"] == "8"
    assert env["NCCLPY_LOCAL_RANK"] == env["LOCAL_RANK"] == "1"
    assert env["NCCLPY_LOCAL_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
    assert env["NCCLPY_MASTER_ADDR"] == env["MASTER_ADDR"] == "10.1.2.3"
    assert env["NCCLPY_MASTER_PORT"] == "29400" and env["MASTER_PORT"] == "29401"
    assert env["NCCLPY_STORE_TOKEN"] == "tok" and env["NCCLPY_DEVICE"] == "1"
    assert env["NCCL_NET"] == "Socket"
    info = resolve(env={**env, "TORCHELASTIC_RUN_ID": "x"})
    assert (info.rank, info.world_size, info.master_port, info.device) == (3, 8, 29400, 1)
    bare = rank_env(0, 1, 0, 1, "h", 5, None, torch_master_port=9)
    assert "NCCLPY_STORE_TOKEN" not in bare and "NCCLPY_DEVICE" not in bare
    assert bare["MASTER_PORT"] == "9"


@pytest.mark.parametrize("args", [
    (4, 4, 0, 1, "h", 1, None), (0, 1, 1, 1, "h", 1, None), (0, 1, 0, 1, "", 1, None),
    (0, 1, 0, 1, "h", 0, None), (-1, 1, 0, 1, "h", 1, None), (0, 1, 0, 1, "h", 65535, None),
])
def test_rank_env_rejects_bad_arguments(args):
    with pytest.raises(ArgumentError):
        rank_env(*args)


@pytest.mark.parametrize("port, torch_port, msg", [
    (65535, None, "master_port: expected a port in 1..65534 (torch's store takes master_port + 1)"
                  ", got 65535"),
    (70000, 9, "master_port: expected a port in 1..65535, got 70000"),
    (65535, 65535, "torch_master_port: expected a port in 1..65535 other than "
                   "master_port=65535, got 65535"),
])
def test_rank_env_port_errors_name_the_argument_given(port, torch_port, msg):
    with pytest.raises(ArgumentError) as ei:
        rank_env(0, 1, 0, 1, "h", port, None, torch_master_port=torch_port)
    assert str(ei.value) == msg
    assert rank_env(0, 1, 0, 1, "h", 65534, None)["MASTER_PORT"] == "65535"


# ---------------------------------------------------------------- MPI launchers on one node
OMPI_ONE_NODE = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                 "OMPI_MCA_ess_base_jobid": "2127888385"}
MPICH_ONE_NODE = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                  "MPI_LOCALNRANKS": "2", "PMI_KVSNAME": "kvs_4711_0"}


@pytest.mark.parametrize("env, job_var", [(OMPI_ONE_NODE, "OMPI_MCA_ess_base_jobid"),
                                          (MPICH_ONE_NODE, "PMI_KVSNAME")])
def test_mpi_on_one_node_needs_no_address(env, job_var):
    """Every rank on this node and no MASTER_*: loopback and a port derived from the job id,
    the same on every rank, in 30000..32766 (below the ephemeral ports)."""
    from ncclpy.rendezvous import MPI_PORT_BASE, mpi_job_port
    info = resolve(env=env)
    assert info.master_addr == "127.0.0.1"
    assert info.master_port == mpi_job_port(env[job_var])
    assert MPI_PORT_BASE <= info.master_port <= 32766
    assert job_var in info.store_from
    other = {**env, job_var: env[job_var] + "1"}
    assert resolve(env=other).master_port != info.master_port   # another job, another port
    # MASTER_ADDR / MASTER_PORT (mpirun -x) win over the derived default, each on its own
    assert resolve(env={**env, "MASTER_PORT": "31111"}).master_port == 31111
    got = resolve(env={**env, "MASTER_ADDR": "127.0.0.2"})
    assert (got.master_addr, got.master_port) == ("127.0.0.2", info.master_port)


def test_mpi_on_several_nodes_says_what_to_pass():
    """Ranks spread over nodes: nothing to derive; the error says which mpirun flags to add."""
    env = {**OMPI_ONE_NODE, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    with pytest.raises(RendezvousError) as e:
        resolve(env=env)
    assert "no store address found" in str(e.value)
    assert "-x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<free port>" in str(e.value)
    mpich = {**MPICH_ONE_NODE, "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0"}
    with pytest.raises(RendezvousError, match="-genv MASTER_ADDR"):
        resolve(env=mpich)


def test_mpi_job_port_accepts_any_job_id():
    from ncclpy.rendezvous import mpi_job_port
    assert mpi_job_port("7") == 30007
    assert mpi_job_port("prterun-host-1234@1") == mpi_job_port("prterun-host-1234@1")
    assert 30000 <= mpi_job_port("prterun-host-1234@1") <= 32766


def test_free_port_picks_below_the_ephemeral_range():
    """A port from the ephemeral range can be taken by any outgoing connection between the
    check and the store's bind (EADDRINUSE, seen in CI); picks come from below it."""
    import socket
    from ncclpy.rendezvous import environment as E
    lo, _ = E._ephemeral_range()
    if lo - 2 <= E.PICK_LOW:
        pytest.skip(f"no room below the ephemeral range here (it starts at {lo})")
    for span in (1, 2):
        for _ in range(20):
            p = E.free_port("127.0.0.1", span=span)
            assert E.PICK_LOW <= p and p + span - 1 < lo, (p, lo)
            for k in range(span):               # every port of the span binds
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", p + k))
    from ncclpy.launch.ports import free_port as launcher_port
    from ncclpy.launch.spawn import _two_free_ports
    assert launcher_port("127.0.0.1") < lo
    a, b = _two_free_ports("127.0.0.1")
    assert a != b and a < lo and b < lo
