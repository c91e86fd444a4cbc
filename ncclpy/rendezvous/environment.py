"""Environment-based rendezvous: who am I (rank, world size, local rank) and where is the store.

:func:`resolve` reads, field by field and in this order: explicit arguments; ``NCCLPY_*``
variables (set by ``ncclpy run`` and :func:`ncclpy.spawn`); torchrun's; Open MPI's; MPICH/PMI's;
SLURM's.  Rank, world size and local rank/size come from the first *launcher* that provides them
(launcher values are never mixed); explicit arguments and ``NCCLPY_*`` override per field.

Launchers nest (torchrun under mpirun, anything under an ``sbatch`` step), so a lower launcher
whose world size differs from the chosen one is simply an outer launcher and is ignored.  Two
launchers that claim the *same* world (same or unknown size) with different ranks contradict each
other, and that is an error.  SLURM's variables are never checked against another launcher: in
a batch step every process inherits ``SLURM_PROCID=0``.  All problems found are reported in one
:class:`~ncclpy.errors.RendezvousError` that lists what was looked for and what was found.
"""
from __future__ import annotations

import logging
import os
import random
import re
import socket
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional

from ncclpy.errors import RendezvousError

__all__ = [
    "RendezvousInfo", "resolve", "expand_hostlist", "first_host", "free_port", "SOURCES",
    "ENV_VARS", "mpi_job_port", "SLURM_PORT_BASE", "MPI_PORT_BASE",
]

log = logging.getLogger(__name__)

#: Launcher sources in precedence order (inner-most launcher first) and their variables:
#: field -> variable names (the first set one wins; several set with different values conflict).
SOURCES: dict[str, dict[str, tuple[str, ...]]] = {
    "NCCLPY": {
        "rank": ("NCCLPY_RANK",), "world_size": ("NCCLPY_WORLD_SIZE",),
        "local_rank": ("NCCLPY_LOCAL_RANK",), "local_world_size": ("NCCLPY_LOCAL_WORLD_SIZE",),
    },
    "torchrun": {
        "rank": ("RANK",), "world_size": ("WORLD_SIZE",),
        "local_rank": ("LOCAL_RANK",), "local_world_size": ("LOCAL_WORLD_SIZE",),
    },
    "openmpi": {
        "rank": ("OMPI_COMM_WORLD_RANK",), "world_size": ("OMPI_COMM_WORLD_SIZE",),
        "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
        "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    },
    "mpich": {
        "rank": ("PMI_RANK", "PMIX_RANK"), "world_size": ("PMI_SIZE",),
        "local_rank": ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
        "local_world_size": ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
    },
    "slurm": {
        "rank": ("SLURM_PROCID",), "world_size": ("SLURM_NTASKS",),
        "local_rank": ("SLURM_LOCALID",), "local_world_size": ("SLURM_NTASKS_PER_NODE",),
    },
}
_LAUNCHERS = ("torchrun", "openmpi", "mpich", "slurm")
_FIELDS = ("rank", "world_size", "local_rank", "local_world_size")
_ADDR_VARS = ("NCCLPY_MASTER_ADDR", "MASTER_ADDR")
_PORT_VARS = ("NCCLPY_MASTER_PORT", "MASTER_PORT")
_NODELIST_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST")
#: an MPI job's id, for the store port derived on one node (Open MPI 4, PMIx, MPICH's PMI)
_MPI_JOB_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_KVSNAME")
_OTHER_VARS = ("NCCLPY_DEVICE", "TORCHELASTIC_RUN_ID", "SLURM_TASKS_PER_NODE",
               "SLURM_NODEID", "SLURM_JOB_ID", "NCCLPY_UID_EXCHANGE") + _MPI_JOB_VARS
#: base of the store port derived from SLURM_JOB_ID when no port is given under SLURM
SLURM_PORT_BASE = 20000
#: under mpirun on one node with no port given, the store port is MPI_PORT_BASE + the job id
#: mod MPI_PORT_SPAN: 30000..32766, below Linux's ephemeral ports (32768..60999)
MPI_PORT_BASE = 30000
MPI_PORT_SPAN = 2767


@dataclass(frozen=True)
class RendezvousInfo:
    """Where this process stands in the job and where ncclpy's store lives.

    ``source`` names where the rank came from: "args", "NCCLPY", "torchrun", "openmpi", "mpich"
    or "slurm".  ``device`` is the GPU the launcher chose (``NCCLPY_DEVICE``), else None.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    device: Optional[int] = None
    #: "ncclpy": ncclpy's TCP store at (master_addr, master_port), hosted by rank 0;
    #: "torchrun": torchrun's own agent store there, joined as a client (torch's TCPStore)
    store_kind: str = "ncclpy"
    #: where the store address and port came from, e.g. "MASTER_ADDR, MASTER_PORT" or
    #: "127.0.0.1 (all ranks on one node), derived from OMPI_MCA_ess_base_jobid" (for errors)
    store_from: str = ""


# ----------------------------------------------------------------------------- hostlists
_BRACKET = re.compile(r"\[([^\]]*)\]")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {s!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in host list {s!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {item!r} in host list {whole!r}")
            width = len(lo)
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            out.append(item)
        else:
            raise ValueError(f"bad item {item!r} in host list {whole!r}")
    if not out:
        raise ValueError(f"empty brackets in host list {whole!r}")
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu3"`` -> node01, node02, node03, node07, gpu3.

    Several bracket groups in one name expand as a product (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, ...).
    Raises ValueError on malformed input.
    """
    hosts: list[str] = []
    for part in _split_top(nodelist):
        names = [""]
        pos = 0
        for m in _BRACKET.finditer(part):
            prefix = part[pos:m.start()]
            items = _expand_range_list(m.group(1), nodelist)
            names = [n + prefix + x for n in names for x in items]
            pos = m.end()
        names = [n + part[pos:] for n in names]
        if any(not n or "[" in n or "]" in n for n in names):
            raise ValueError(f"malformed host list {nodelist!r}")
        hosts.extend(names)
    if not hosts:
        raise ValueError(f"empty host list {nodelist!r}")
    return hosts


def first_host(nodelist: str) -> str:
    """First host of a SLURM host list, without expanding it: ``"node[01-04],x"`` -> ``node01``."""
    part = _split_top(nodelist)[0] if nodelist.strip() else ""
    if not part:
        raise ValueError(f"empty host list {nodelist!r}")
    name, pos = "", 0
    for m in _BRACKET.finditer(part):
        name += part[pos:m.start()] + _expand_range_list(m.group(1).split(",")[0], nodelist)[0]
        pos = m.end()
    name += part[pos:]
    if "[" in name or "]" in name:
        raise ValueError(f"malformed host list {nodelist!r}")
    return name


def _expand_tasks_per_node(spec: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (SLURM_TASKS_PER_NODE format)."""
    out: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE item {item!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def mpi_job_port(job: str) -> int:
    """The store port of an MPI job on one node: :data:`MPI_PORT_BASE` + the job id mod
    :data:`MPI_PORT_SPAN` (an integer id as is, any other string through CRC-32), so every rank
    of the job derives the same port and concurrent jobs rarely share one."""
    job = job.strip()
    n = int(job) if job.isdigit() else zlib.crc32(job.encode())
    return MPI_PORT_BASE + n % MPI_PORT_SPAN


#: the lowest port :func:`free_port` picks from (below it: well-known and common services)
PICK_LOW = 10000
_RANDOM = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux; else 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(family: int, host: str, port: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the stores bind
            s.bind((host, port))
        return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port P free on ``host`` right now, with P+1 .. P+span-1 free too.

    Picked at random *below* the kernel's ephemeral range where there is room: a port from
    that range (what binding port 0 gives) can be taken, between this check and the real
    bind, by any outgoing connection's source port, and the store then fails with
    EADDRINUSE.  Falls back to binding port 0 when no port below the range is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo, _ = _ephemeral_range()
    if lo - span > PICK_LOW:
        for _ in range(64):
            p = _RANDOM.randrange(PICK_LOW, lo - span + 1)
            if all(_bindable(family, host, p + k) for k in range(span)):
                return p
    for _ in range(64):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            p = int(s.getsockname()[1])
        if p + span - 1 <= 65535 and all(_bindable(family, host, p + k) for k in range(1, span)):
            return p
    raise OSError(f"no {span} consecutive free port(s) found on {host}")


# ----------------------------------------------------------------------------- resolve
class _Collector:
    """Gathers parsed values, the variables seen and the problems, for one final error."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.problems: list[str] = []
        self.found: dict[str, str] = {}
        self.bad: set[str] = set()   # variables that were set but unusable

    def raw(self, var: str) -> Optional[str]:
        v = self.env.get(var)
        if v is None or v.strip() == "":
            return None
        self.found[var] = v
        return v.strip()

    def integer(self, var: str, minimum: int = 0) -> Optional[int]:
        v = self.raw(var)
        if v is None:
            return None
        try:
            n = int(v)
        except ValueError:
            self.problems.append(f"{var}={v!r} is not an integer")
            self.bad.add(var)
            return None
        if n < minimum:
            self.problems.append(f"{var}={v!r} must be >= {minimum}")
            self.bad.add(var)
            return None
        return n

    def field(self, source: str, fld: str) -> Optional[int]:
        vars_ = SOURCES[source][fld]
        minimum = 1 if fld.endswith("world_size") else 0
        vals = [(v, self.integer(v, minimum)) for v in vars_]
        vals = [(v, n) for v, n in vals if n is not None]
        if len({n for _, n in vals}) > 1:
            self.problems.append(
                "contradictory " + fld + ": " + ", ".join(f"{v}={n}" for v, n in vals))
        return vals[0][1] if vals else None


def _check_arg(name: str, value, minimum: int, col: _Collector) -> Optional[int]:
    """Validate an explicit integer argument (ints or integer strings; not bools)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        n = int(value) if isinstance(value, int) else int(str(value).strip())
    except ValueError:
        col.problems.append(f"argument {name}={value!r} is not an integer")
        return None
    if n < minimum:
        col.problems.append(f"argument {name}={value!r} must be >= {minimum}")
        return None
    return n


def _looked_for() -> str:
    lines = ["explicit arguments: rank, world_size, local_rank, local_world_size, master_addr, "
             "master_port"]
    for src, fields in SOURCES.items():
        lines.append(f"{src}: " + ", ".join("/".join(v) for f in _FIELDS for v in [fields[f]]))
    lines.append("store address: " + ", ".join(_ADDR_VARS + _PORT_VARS)
                 + "; first host of " + "/".join(_NODELIST_VARS[:2]) + " for MPI and SLURM")
    return "\n  ".join(lines)


def _known_vars() -> tuple[str, ...]:
    names = [v for fields in SOURCES.values() for f in _FIELDS for v in fields[f]]
    return tuple(names) + _ADDR_VARS + _PORT_VARS + _NODELIST_VARS + _OTHER_VARS


#: Every environment variable :func:`resolve` reads (``ncclpy info`` reports all of them).
ENV_VARS: tuple[str, ...] = _known_vars()


def _fail(col: _Collector, headline: str) -> RendezvousError:
    for var in _known_vars():
        col.raw(var)
    found = ", ".join(f"{k}={v!r}" for k, v in sorted(col.found.items())) or "none of them"
    msg = (f"{headline}:\n  - " + "\n  - ".join(col.problems)
           + "\nlooked for:\n  " + _looked_for()
           + f"\nfound: {found}"
           + "\nhint: start the ranks with `ncclpy run -n N`, ncclpy.spawn, torchrun, mpirun or "
             "srun, or pass rank=, world_size= (and master_addr=, master_port=) explicitly")
    return RendezvousError(msg)


def resolve(rank: Optional[int] = None, world_size: Optional[int] = None,
            local_rank: Optional[int] = None, master_addr: Optional[str] = None,
            master_port: Optional[int] = None, env: Optional[Mapping[str, str]] = None, *,
            local_world_size: Optional[int] = None, device: Optional[int] = None,
            ) -> RendezvousInfo:
    """Resolve this process's rank, world size, local rank/size, store address and device.

    ``env`` replaces ``os.environ`` (for tests and for launchers that build environments).
    Raises one :class:`RendezvousError` listing every problem, what was looked for and found.
    """
    env = os.environ if env is None else env
    col = _Collector(env)

    args = {"rank": _check_arg("rank", rank, 0, col),
            "world_size": _check_arg("world_size", world_size, 1, col),
            "local_rank": _check_arg("local_rank", local_rank, 0, col),
            "local_world_size": _check_arg("local_world_size", local_world_size, 1, col)}
    per_source = {src: {f: col.field(src, f) for f in _FIELDS} for src in SOURCES}

    # SLURM's local world size: SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE[SLURM_NODEID]
    slurm = per_source["slurm"]
    if slurm["local_world_size"] is None and col.raw("SLURM_TASKS_PER_NODE") is not None:
        try:
            counts = _expand_tasks_per_node(col.raw("SLURM_TASKS_PER_NODE") or "")
            node = col.integer("SLURM_NODEID") or 0
            slurm["local_world_size"] = counts[min(node, len(counts) - 1)]
        except ValueError as e:
            col.problems.append(str(e))

    # the launcher: the inner-most one that gives a rank or a world size
    present = [s for s in _LAUNCHERS
               if per_source[s]["rank"] is not None or per_source[s]["world_size"] is not None]
    launcher = present[0] if present else None
    chosen: dict[str, Optional[int]] = {}
    origin: dict[str, str] = {}
    for f in _FIELDS:
        for src, vals in (("args", args), ("NCCLPY", per_source["NCCLPY"]),
                          (launcher, per_source[launcher] if launcher else {})):
            if src is not None and vals.get(f) is not None:
                chosen[f], origin[f] = vals[f], src
                break
        else:
            chosen[f] = None

    # contradictions: same world (equal or unknown size), different rank. SLURM is exempt.
    # (explicit rank= makes the environment's ranks irrelevant)
    claims = [s for s in ("NCCLPY", "torchrun", "openmpi", "mpich")
              if per_source[s]["rank"] is not None and args["rank"] is None]
    for i, a in enumerate(claims):
        for b in claims[i + 1:]:
            ra, rb = per_source[a]["rank"], per_source[b]["rank"]
            wa, wb = per_source[a]["world_size"], per_source[b]["world_size"]
            if ra != rb and (wa is None or wb is None or wa == wb):
                names_a, names_b = (next(v for v in SOURCES[x]["rank"] if col.raw(v) is not None)
                                    for x in (a, b))
                col.problems.append(
                    f"contradictory rank: {a} says {names_a}={ra} (world size {wa}) but {b} says "
                    f"{names_b}={rb} (world size {wb})")
            elif ra != rb:
                log.debug("rendezvous: %s (rank %s of %s) is nested in %s (rank %s of %s); "
                          "using %s", a, ra, wa, b, rb, wb, a)
    if launcher and launcher != "slurm" and per_source["slurm"]["rank"] is not None:
        log.debug("rendezvous: SLURM_PROCID=%s ignored, %s launched this process",
                  per_source["slurm"]["rank"], launcher)

    r, ws = chosen["rank"], chosen["world_size"]

    def _bad(fld: str) -> bool:
        return any(v in col.bad for src in SOURCES.values() for v in src[fld])

    if r is None and not _bad("rank"):
        col.problems.append("no rank found")
    if ws is None and not _bad("world_size"):
        col.problems.append("no world size found")
    if r is not None and ws is not None and r >= ws:
        col.problems.append(f"rank {r} (from {origin['rank']}) is not below world size {ws} "
                            f"(from {origin['world_size']})")
    lr, lws = chosen["local_rank"], chosen["local_world_size"]
    if lr is None and lws is None and r is not None and ws is not None:
        lr, lws = r, ws
        log.debug("rendezvous: no local rank given; assuming one node (local rank = rank)")
    elif lr is None and r is not None:
        lr = r % lws if lws else r
    elif lws is None and ws is not None:
        lws = ws
    if lr is not None and lws is not None and lr >= lws:
        col.problems.append(f"local rank {lr} is not below local world size {lws}")
    if lws is not None and ws is not None and lws > ws:
        col.problems.append(f"local world size {lws} exceeds world size {ws}")

    # the store address
    addr: Optional[str] = None
    addr_from = ""
    if master_addr:
        addr, addr_from = str(master_addr).strip(), "argument master_addr"
    if addr is None:
        for var in _ADDR_VARS:
            v = col.raw(var)
            if v is not None:
                addr, addr_from = v, var
                break
    if addr is None and launcher in ("openmpi", "mpich", "slurm"):
        for var in _NODELIST_VARS:
            v = col.raw(var)
            if v is not None:
                try:
                    addr, addr_from = first_host(v), f"first host of {var}"
                except ValueError as e:
                    col.problems.append(f"{var}: {e}")
                break
    store_kind = "ncclpy"
    port = _check_arg("master_port", master_port, 1, col)
    port_from = "argument master_port" if port is not None else ""
    if port is None:
        for var in _PORT_VARS:
            p = col.integer(var, 1)
            if p is not None:
                port, port_from = p, var
                if var == "MASTER_PORT" and col.raw("TORCHELASTIC_RUN_ID") is not None:
                    if (col.raw("TORCHELASTIC_USE_AGENT_STORE") or "").lower() == "true":
                        # torchrun's agent serves a TCPStore at MASTER_PORT for its workers:
                        # join it (no second port that could collide with torchrun's sockets)
                        store_kind = "torchrun"
                        port_from = "MASTER_PORT (torchrun's agent store, joined as a client)"
                    else:
                        port += 1
                        port_from = "MASTER_PORT+1 (torchrun's own store owns MASTER_PORT)"
                        log.debug("rendezvous: under torchrun, ncclpy's store uses MASTER_PORT+1"
                                  " = %d; set NCCLPY_MASTER_PORT to choose another", port)
                break
            if col.raw(var) is not None:  # set but bad: do not fall through silently
                break
    if port is not None and port > 65535:
        col.problems.append(f"store port {port} (from {port_from}) is above 65535")
    if port is None and addr_from.startswith("first host") and col.raw("SLURM_JOB_ID"):
        job = col.integer("SLURM_JOB_ID")
        if job is not None:
            port, port_from = SLURM_PORT_BASE + job % 10000, "derived from SLURM_JOB_ID"
    if (launcher in ("openmpi", "mpich") and origin.get("rank") == launcher
            and lws is not None and lws == ws and (addr is None or port is None)):
        # mpirun/mpiexec with every rank on this node and no address given: rank 0 hosts the
        # store on loopback, at a port every rank derives from the job's id
        job_var = next((v for v in _MPI_JOB_VARS if col.raw(v) is not None), None)
        if addr is None and (port is not None or job_var is not None):
            addr, addr_from = "127.0.0.1", f"default of {launcher} with all ranks on one node"
        if port is None and job_var is not None and not col.bad & set(_PORT_VARS):
            port, port_from = mpi_job_port(col.raw(job_var) or ""), f"derived from {job_var}"
    if ws == 1:
        if addr is None:
            addr, addr_from = "127.0.0.1", "default for world size 1"
        if port is None:
            port, port_from = free_port(addr if addr in ("127.0.0.1", "localhost", "::1")
                                        else ""), "free port (world size 1)"
    mpi_hint = ""
    if launcher in ("openmpi", "mpich"):
        x = "-x" if launcher == "openmpi" else "-genv"
        mpi_hint = (f"; under {'mpirun' if launcher == 'openmpi' else 'mpiexec'} on several nodes "
                    f"pass {x} MASTER_ADDR=<rank 0's host> {x} MASTER_PORT=<free port>")
    if addr is None:
        col.problems.append("no store address found (set MASTER_ADDR or NCCLPY_MASTER_ADDR"
                            + mpi_hint + ")")
    if port is None and not col.bad & set(_PORT_VARS):
        col.problems.append("no store port found (set MASTER_PORT or NCCLPY_MASTER_PORT"
                            + mpi_hint + ")")

    dev = _check_arg("device", device, 0, col)
    if dev is None and device is None and (col.raw("NCCLPY_DEVICE") or "").strip().lower() \
            != "cpu":                       # "cpu": the CPU backend's (ncclpy.cpu)
        dev = col.integer("NCCLPY_DEVICE", 0)

    if col.problems:
        raise _fail(col, "cannot resolve the rendezvous")
    assert r is not None and ws is not None and lr is not None and lws is not None
    assert addr is not None and port is not None
    source = origin["rank"]
    info = RendezvousInfo(rank=r, world_size=ws, local_rank=lr, local_world_size=lws,
                          master_addr=addr, master_port=port, source=source, device=dev,
                          store_kind=store_kind, store_from=f"{addr_from}; {port_from}")
    log.debug("rendezvous: rank %d/%d local %d/%d from %s; store %s:%d (%s, %s); device %s",
              r, ws, lr, lws, source, addr, port, addr_from, port_from, dev)
    return info
