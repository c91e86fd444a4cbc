"""What the CPU engine reads at communicator init and which algorithm a call then runs, as NCCL
does it (src/graph/tuning.cc ncclTopoTuneModel, src/enqueue.cc topoGetAlgoInfo at v2.28.9-1):

* at the init of a communicator of more than one rank (tuning.cc:247), NCCL_PROTO and then
  NCCL_ALGO go through NCCL's ``parseList`` (tuning.cc:419-428); one it cannot parse fails the
  init with ncclInvalidUsage and its WARN (the text ``ncclGetLastError`` gives), once the ranks
  met (the tuning runs after the bootstrap, in initTransportsRank: src/init.cc:1356);
* the pins read then (:meth:`ncclpy.order.pins.Pins.from_env`: NCCL_ALGO, NCCL_PROTO,
  NCCL_MIN/MAX_NCHANNELS, NCCL_MIN/MAX_CTAS and the buffer sizes, with NCCL's configuration
  files under the environment; the numbers are NCCL_PARAMs, read once per process) stay the
  communicator's: a later change of NCCL_ALGO/NCCL_PROTO changes nothing for it, and a split,
  shrink or grow child reads them at its own init;
* each collective NCCL plans (broadcast, reduce, all_gather, reduce_scatter, all_reduce:
  ``collTaskAppend``; all_to_all, gather and scatter are send/recv to NCCL, src/enqueue.cc:
  2585-2609) runs what :meth:`ncclpy.order.pins.Pins.cpu_choice` says for the CPU backend's
  machine (one node per rank, one ring, no NVLS, no CollNet); where nothing can run, NCCL
  fails it with ncclInvalidUsage and "Error : no algorithm/protocol available for function %s
  with datatype %s." (src/enqueue.cc:1848-1860), reported where NCCL launches it: the call
  outside a group, the outermost ncclGroupEnd inside one.  A one-rank communicator never gets
  there (taskAppend -> ncclLaunchOneRank, src/enqueue.cc:2569-2571).

:func:`ncclpy.cpu.order_choice` says what a communicator runs (:func:`comm_choice`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple, Union

from ..semantics.dtypes import C_NAMES, DTYPES
from ..order.ncclenv import nccl_environ
from ..order.config import DEFAULT_VERSION
from ..order.pins import Choice, PinError, Pins, no_algorithm_text
from .codes import BY_ENUM, INTERNAL, INVALID_USAGE, SUCCESS

__all__ = ["init_pins", "call_choice", "comm_choice", "refusal_now", "PLANNED", "nccl_type_name"]

#: NCCL's function name -> ncclpy's collective name, for the collectives NCCL plans
#: (``collTaskAppend``, so topoGetAlgoInfo chooses their algorithm and protocol)
PLANNED = {"Broadcast": "broadcast", "Reduce": "reduce", "AllGather": "all_gather",
           "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce"}


def nccl_type_name(dtype: int) -> str:
    """src/collectives.cc ncclDatatypeToString (2.28.9): ncclInt8 ... ncclFloat8e5m2; it has
    no case for ncclUint8, which it names "Unknown"."""
    d = BY_ENUM.get(dtype)
    if d is None or d.name == "uint8":
        return "Unknown"
    return C_NAMES[d.name]


def init_pins(nranks: int, version: int,
              env: Optional[Mapping[str, str]] = None) -> Tuple[Optional[Pins], int, bytes]:
    """What the init of a communicator of ``nranks`` ranks (NCCL ``version``) reads: (its pins,
    SUCCESS, b"") or (None, ncclInvalidUsage, NCCL's WARN) where parseList refuses NCCL_PROTO
    or NCCL_ALGO (NCCL parses NCCL_PROTO first, tuning.cc:419-428; a one-rank communicator
    parses neither, tuning.cc:247).  ``env`` None: the process's environment as NCCL sees it
    (its configuration files under it, NCCL_PARAMs read once per process:
    :mod:`ncclpy.order.ncclenv`)."""
    try:
        return Pins.from_env(env, nranks=nranks, version=version), SUCCESS, b""
    except PinError as e:
        text = str(e)
        for var in ("NCCL_PROTO", "NCCL_ALGO"):     # Pins names the variable; NCCL's WARN
            head = f"{var}={(nccl_environ() if env is None else env).get(var)}: "
            if text.startswith(head):
                text = text[len(head):]
                break
        return None, INVALID_USAGE, text.encode()


def call_choice(c: Any, fn: str, dtype: int, op: int = 0) -> Union[Choice, str, None]:
    """What the call ``fn`` (NCCL's name) of datatype ``dtype`` and op ``op`` runs on the
    engine's communicator ``c``: its Choice, NCCL's refusal text (a str) where nothing is
    enabled for it, or None for what NCCL does not plan (send/recv, all_to_all, gather,
    scatter) and on a communicator without pins.  Cached per (function, datatype, whether the
    device op is PreMulSum/SumPostDiv: PAT refuses those, enqueue.cc:1805-1806): the pins are
    the init's."""
    coll = PLANNED.get(fn)
    if coll is None or c.pins is None:
        return None
    d = BY_ENUM.get(dtype)
    premul = op >= 5 or (op == 4 and d is not None and d.kind == "float")
    key = (fn, dtype, premul)
    got = c.choices.get(key)
    if got is None:
        try:
            got = c.pins.cpu_choice(coll, nccl_type_name(dtype), premul=premul)
        except PinError as e:
            got = str(e)
        c.choices[key] = got
    return got


def refusal_now(c: Any, fn: str, dtype: int) -> Tuple[int, bytes]:
    """The code and WARN of a call nothing is enabled for, from the environment when NCCL
    plans it (topoGetAlgoInfo reads NCCL_ALGO/NCCL_PROTO then, enqueue.cc:1844-1860):
    ncclInvalidUsage when either is set, else ncclInternalError."""
    env = nccl_environ()
    a, p = env.get("NCCL_ALGO"), env.get("NCCL_PROTO")
    version = c.pins.version if c.pins is not None else DEFAULT_VERSION
    text = no_algorithm_text(PLANNED[fn], nccl_type_name(dtype), a, p, version)
    return (INVALID_USAGE if (a is not None or p is not None) else INTERNAL), text.encode()


def comm_choice(eng: Any, comm: Any, collective: str, dtype: str = "float32",
                op: str = "sum") -> Choice:
    """:func:`ncclpy.cpu.order_choice` on the engine ``eng``."""
    ops = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4, "premul_sum": 5}
    if op not in ops:
        raise ValueError(f"op: expected one of {', '.join(ops)}, got {op!r}")
    names = {v: k for k, v in PLANNED.items()}
    if collective not in names:
        raise ValueError(f"collective: expected one of {', '.join(names)}, got {collective!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of NCCL's types ({', '.join(DTYPES)}), got "
                         f"{dtype!r}")
    h = comm if isinstance(comm, int) else getattr(comm, "handle", None)
    c = eng.comms.get(int(h or 0)) if isinstance(h, int) else None
    if c is None or c.freed:
        raise ValueError(f"comm: expected a live communicator of the CPU backend, got {comm!r}")
    if c.pins is None:                 # its init was refused (what it said then)
        raise PinError(c.init_text.decode())
    got = call_choice(c, names[collective], DTYPES[dtype].nccl, ops[op])
    if isinstance(got, str):
        raise PinError(got)
    assert got is not None
    return got
