"""Real SLURM ``srun`` on a one-machine cluster (Debian's slurm-wlm and munge).

The fixture starts a private munged (own key and socket) and slurmctld + slurmd (own config,
ports, state and spool under the test's temp dir) in about five seconds, and stops them, by
pid, at the end.  Tests skip, with the reason, where the programs are missing, where this is
not root, or where the cluster does not come up.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from ncclpy.rendezvous import SLURM_PORT_BASE, free_port

_PROGS = ("srun", "slurmctld", "slurmd", "munged", "mungekey", "sinfo")
_MISSING = [p for p in _PROGS if shutil.which(p) is None]
pytestmark = [
    pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed "
                       "(Debian: apt-get install slurm-wlm munge)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the one-machine SLURM cluster runs as root"),
]

_SCRIPT = r"""
import os, sys
import ncclpy
bs = ncclpy.bootstrap(timeout=float(os.environ.get("T", "30")))
if os.environ.get("FAIL_RANK") == str(bs.rank):
    ncclpy.bootstrap("b", uid_exchange="carrier-pigeon")
with open(os.path.join(sys.argv[1], f"rank{bs.rank}.txt"), "w") as f:
    f.write(" ".join(map(str, (bs.rank, bs.world_size, bs.local_rank, bs.info.source,
                               bs.info.master_port, os.environ["SLURM_JOB_ID"], bs.uid.hex()))))
"""


def _slurm_conf(d, host: str, ncpu: int, munge_sock: str) -> str:
    p1, p2 = free_port(), free_port()
    return f"""ClusterName=ncclpytest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_sock}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/ctld.pid
SlurmdPidFile={d}/d.pid
SlurmctldPort={p1}
SlurmdPort={p2}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/d.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={ncpu} Sockets=1 CoresPerSocket={ncpu} ThreadsPerCore=1 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    os.chmod(d / "munge", 0o700)
    sock, key = str(d / "munge" / "sock"), str(d / "munge" / "key")
    procs: list[subprocess.Popen] = []
    host = socket.gethostname().split(".")[0]
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    try:
        subprocess.run(["mungekey", "-c", "-k", key], check=True, capture_output=True,
                       timeout=20)
        procs.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={d}/munge/pid", f"--log-file={d}/munge/log",
             f"--seed-file={d}/munge/seed"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        (d / "slurm.conf").write_text(_slurm_conf(d, host, os.cpu_count() or 1, sock))
        for prog in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([prog, "-D", "-f", str(d / "slurm.conf")], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                               text=True, timeout=20)
            state = (r.stdout + r.stderr).strip()
            if state == "idle":
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.3)
        if state != "idle":
            logs = "".join((d / f).read_text()[-600:] for f in ("ctld.log", "d.log")
                           if (d / f).exists())
            pytest.skip(f"the one-machine SLURM cluster did not come up within 60 s (sinfo: "
                        f"{state!r}); logs: {logs}")
        yield env
    finally:
        if len(procs) == 3 and all(p.poll() is None for p in procs):
            _drain(env)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _drain(env: dict, wait: float = 20.0) -> None:
    """Cancel what is left and wait until no job and no step daemon (slurmstepd) of this
    cluster remain, so stopping slurmd leaves nothing behind."""
    subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=20)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        jobs = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True,
                              timeout=20).stdout.strip()
        steps = subprocess.run(["scontrol", "listpids"], env=env, capture_output=True,
                               text=True, timeout=20).stdout.strip().splitlines()[1:]
        if not jobs and not steps and not _stepds(env):
            return
        time.sleep(0.3)


def _stepds(env: dict) -> list[int]:
    """slurmstepd processes whose SLURM_CONF is this cluster's."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"slurmstepd"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SLURM_CONF={env['SLURM_CONF']}".encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            continue
    return out


def _srun(slurm, tmp_path, n: int, *extra: str, **env: str):
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT)
    base = {k: v for k, v in slurm.items()
            if not k.startswith(("NCCLPY_", "MASTER_", "OMPI_", "PMI", "TORCHELASTIC"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    base.update(env, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    res = subprocess.run(["srun", "-n", str(n), "--overcommit", *extra, sys.executable,
                          str(script), str(tmp_path)], env=base, capture_output=True,
                         text=True, timeout=90, cwd=tmp_path)
    return res, time.monotonic() - t0


def test_srun_4_ranks_hold_one_uid_at_the_port_derived_from_the_job_id(slurm, tmp_path):
    res, _ = _srun(slurm, tmp_path, 4)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(4)]
    assert [r[:4] for r in rows] == [[str(i), "4", str(i), "slurm"] for i in range(4)]
    job = int(rows[0][5])
    assert {int(r[4]) for r in rows} == {SLURM_PORT_BASE + job % 10000}
    assert len({r[6] for r in rows}) == 1


def test_srun_ends_the_step_when_a_rank_fails_and_the_error_is_readable(slurm, tmp_path):
    res, took = _srun(slurm, tmp_path, 4, "--kill-on-bad-exit=1", FAIL_RANK="2")
    assert res.returncode != 0
    assert "uid_exchange: expected one of store, mpi, auto" in res.stderr, res.stderr
    assert took < 30
