"""Real Open MPI ``mpirun`` (Debian's openmpi-bin) starting ranks that call ncclpy.bootstrap().

The uid travels over ncclpy's store (the default: the store address needs nothing from the user
on one node) or over MPI_Bcast (``NCCLPY_UID_EXCHANGE=mpi``, where mpi4py is importable).  Tests
skip, with the reason, where ``mpirun`` is not installed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ncclpy.bootstrap import UID_BYTES, choose_uid_exchange
from ncclpy.errors import ArgumentError, UnsupportedError
from ncclpy.rendezvous import resolve
from wait_util import HANG

MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(
    MPIRUN is None, reason="mpirun is not installed (Debian: apt-get install openmpi-bin)")

try:   # load the MPI library without initialising MPI in this process
    import mpi4py
    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI  # noqa: F401
    HAVE_MPI4PY = True
except Exception:   # ImportError; RuntimeError when mpi4py's wheel finds no libmpi
    HAVE_MPI4PY = False

_SCRIPT = r"""
import os, sys
import ncclpy
out = sys.argv[1]
bs = ncclpy.bootstrap("a", timeout=float(os.environ.get("T", "30")))
if os.environ.get("FAIL_RANK") == str(bs.rank):
    ncclpy.bootstrap("b", uid_exchange="carrier-pigeon")     # a user mistake: ArgumentError
if os.environ.get("SKIP_RANK") == str(bs.rank):
    sys.exit(0)                                              # never joins communicator "b"
b = ncclpy.bootstrap("b", timeout=float(os.environ.get("T", "30")))
with open(os.path.join(out, f"rank{bs.rank}.txt"), "w") as f:
    f.write(" ".join(map(str, (bs.rank, bs.world_size, bs.local_rank, bs.info.source,
                               bs.uid_exchange, type(bs.store).__name__, bs.info.master_addr,
                               bs.info.master_port, bs.uid.hex(), b.uid.hex()))))
"""


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCLPY_", "MASTER_", "OMPI_", "PMI", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # as root mpirun refuses to start without these (its --allow-run-as-root equivalent)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include="lo",
               OMPI_MCA_oob_tcp_if_include="lo", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _mpirun(tmp_path, n: int, *, exports=(), timeout: float = 60, **extra: str):
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT)
    cmd = [MPIRUN, "--oversubscribe", "-n", str(n)]
    for name in exports:
        cmd += ["-x", name]
    cmd += [sys.executable, str(script), str(tmp_path)]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=_env(**extra), capture_output=True, text=True,
                         timeout=timeout, cwd=tmp_path)
    return res, time.monotonic() - t0


def _rows(tmp_path, n: int) -> list[list[str]]:
    return [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(n)]


@needs_mpirun
def test_mpirun_4_ranks_hold_one_uid_over_the_store(tmp_path):
    """Plain ``mpirun -n 4 python x.py``: ranks, sizes, local ranks from Open MPI; rank 0
    hosts the store on loopback at a port derived from the job id; one uid per communicator."""
    res, _ = _mpirun(tmp_path, 4)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(tmp_path, 4)
    assert [r[:7] for r in rows] == [[str(i), "4", str(i), "openmpi", "store", "TCPStore",
                                      "127.0.0.1"] for i in range(4)]
    assert len({r[7] for r in rows}) == 1 and 30000 <= int(rows[0][7]) <= 32766
    assert len({r[8] for r in rows}) == 1 and len({r[9] for r in rows}) == 1
    assert rows[0][8] != rows[0][9] and len(rows[0][8]) == 2 * UID_BYTES


@needs_mpirun
def test_mpirun_with_master_addr_and_port_exported(tmp_path):
    """What an mpirun user gives on several nodes: ``-x MASTER_ADDR -x MASTER_PORT``."""
    from ncclpy.rendezvous import free_port
    port = free_port()
    res, _ = _mpirun(tmp_path, 2, exports=("MASTER_ADDR", "MASTER_PORT"),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(tmp_path, 2)
    assert {(r[6], r[7]) for r in rows} == {("127.0.0.1", str(port))}
    assert rows[0][8] == rows[1][8]


@needs_mpirun
@pytest.mark.skipif(not HAVE_MPI4PY, reason="mpi4py is not importable (pip install mpi4py)")
def test_mpirun_4_ranks_hold_one_uid_over_mpi_bcast(tmp_path):
    """``NCCLPY_UID_EXCHANGE=mpi``: the uid comes by MPI_Bcast, no store at all."""
    res, _ = _mpirun(tmp_path, 4, exports=("NCCLPY_UID_EXCHANGE",), NCCLPY_UID_EXCHANGE="mpi")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(tmp_path, 4)
    assert [r[:6] for r in rows] == [[str(i), "4", str(i), "openmpi", "mpi", "NoneType"]
                                     for i in range(4)]
    assert len({r[8] for r in rows}) == 1 and len({r[9] for r in rows}) == 1
    assert rows[0][8] != rows[0][9]


@needs_mpirun
def test_mpirun_ends_the_job_when_a_rank_fails_and_the_error_is_readable(tmp_path):
    """Rank 2 makes a mistake after the first exchange: it exits 1 with ncclpy's error, and
    mpirun stops rank 0, which would wait (up to 300 s) for rank 2 to read the next uid."""
    res, took = _mpirun(tmp_path, 4, exports=("FAIL_RANK", "T"), FAIL_RANK="2", T="300")
    assert res.returncode != 0
    assert "ArgumentError: uid_exchange: expected one of store, mpi, auto, got argument " \
           "uid_exchange='carrier-pigeon'" in res.stderr
    assert "non-zero" in res.stdout + res.stderr     # mpirun's own account of the abort
    assert took < HANG, f"mpirun took {took:.1f} s to end the job (rank 0 waits 300 s)"
    assert not (tmp_path / "rank0.txt").exists() and not (tmp_path / "rank2.txt").exists()


@needs_mpirun
@pytest.mark.skipif(not HAVE_MPI4PY, reason="mpi4py is not importable (pip install mpi4py)")
def test_mpi_bcast_of_a_missing_rank_times_out_with_a_named_error(tmp_path):
    """Rank 0 never joins communicator "b": the others' MPI_Bcast wait is bounded (no hang)."""
    res, took = _mpirun(tmp_path, 4, exports=("NCCLPY_UID_EXCHANGE", "SKIP_RANK", "T"),
                        NCCLPY_UID_EXCHANGE="mpi", SKIP_RANK="0", T="2")
    assert res.returncode != 0
    assert "waited 2 s for the MPI_Bcast of the NCCL unique id of communicator 'b'" in res.stderr
    assert took < 30


# ------------------------------------------------------ choosing the exchange (no mpirun needed)
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_ess_base_jobid": "99"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_store_is_the_default_and_the_env_chooses():
    info = resolve(env=OMPI)
    assert choose_uid_exchange(None, info, {})[0] == "store"
    assert choose_uid_exchange(None, info, {"NCCLPY_UID_EXCHANGE": "store"})[0] == "store"
    with pytest.raises(ArgumentError, match=r"NCCLPY_UID_EXCHANGE='bcast'"):
        choose_uid_exchange(None, info, {"NCCLPY_UID_EXCHANGE": "bcast"})
    with pytest.raises(ArgumentError,
                       match=r"expected one of store, mpi, auto, got argument uid_exchange=3"):
        choose_uid_exchange(3, info, {})


def test_mpi_needs_an_mpi_launcher():
    info = resolve(env=TORCHRUN)
    with pytest.raises(ArgumentError, match="not started by an MPI launcher .* from torchrun"):
        choose_uid_exchange("mpi", info, {})
    how, why = choose_uid_exchange("auto", info, {})
    assert how == "store" and "not started by an MPI launcher" in why
    with pytest.raises(ArgumentError, match="a store= was passed"):
        choose_uid_exchange("mpi", resolve(env=OMPI), {}, store_given=True)


@pytest.mark.skipif(not HAVE_MPI4PY, reason="mpi4py is not importable (pip install mpi4py)")
def test_mpi_under_an_mpi_launcher_with_mpi4py():
    # importing mpi4py.MPI here would initialise MPI as a singleton; the choice only needs the
    # import to work, which a child process shows without touching this one
    code = ("from ncclpy.bootstrap import choose_uid_exchange\n"
            "from ncclpy.rendezvous import resolve\n"
            f"env = {OMPI!r}\n"
            "print(choose_uid_exchange('auto', resolve(env=env), env)[0],\n"
            "      choose_uid_exchange(None, resolve(env=env), {'NCCLPY_UID_EXCHANGE': 'mpi'})[0])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["mpi", "mpi"]


def test_mpi_without_mpi4py_is_a_precise_error():
    """mpi4py hidden from a child process: "mpi" names what is missing, "auto" falls back."""
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "from ncclpy.bootstrap import choose_uid_exchange\n"
            "from ncclpy.rendezvous import resolve\n"
            f"env = {OMPI!r}\ninfo = resolve(env=env)\n"
            "print(choose_uid_exchange('auto', info, env)[0])\n"
            "try:\n    choose_uid_exchange('mpi', info, env)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.strip().split("\n")
    assert first == "store"
    assert second.startswith("ArgumentError") and "mpi4py is not importable" in second


def test_checked_mode_without_a_store_is_a_precise_error():
    from ncclpy.debug.checked import Checker
    with pytest.raises(UnsupportedError, match="no rendezvous store .* uid_exchange='mpi'"):
        Checker(None, 0, 2, name="x")


def test_bootstrap_refuses_mpi_exchange_with_checked_mode_on():
    """NCCLPY_CHECKED=1 needs the store: refused before any exchange, naming both."""
    code = ("import ncclpy, sys\n"
            f"env = {{**{OMPI!r}, 'NCCLPY_CHECKED': '1'}}\n"
            "try:\n    ncclpy.bootstrap(env=env, uid_exchange='mpi')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert res.returncode == 0, res.stderr
    if not HAVE_MPI4PY:
        assert "mpi4py is not importable" in res.stdout
    else:
        assert res.stdout.startswith("ArgumentError") and "NCCLPY_CHECKED" in res.stdout
