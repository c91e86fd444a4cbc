"""The data a plan is made of: exact NCCL calls, device copies, placeholders.

A :class:`Plan` is what planning produces from user arguments without touching a GPU, and what
execution runs in a few thin lines.  Arguments are in NCCL's C order, up to but excluding
``comm`` and ``stream`` (the executor appends those), e.g. ``AllReduce`` is
``(sendbuff, recvbuff, count, datatype, op)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

from .._nccl.functions import NCCL_FUNCTIONS

__all__ = ["NcclCall", "Copy", "Scratch", "PremulSpec", "PREMUL_OP", "Plan", "PlanContext",
           "Step", "NCCL_FUNCTIONS", "nccl_call", "one_call_plan"]

@dataclass(frozen=True)
class Scratch:
    """A pointer into the plan's scratch allocation (``Plan.scratch_bytes``), at ``offset``."""

    offset: int = 0


class _PremulOp:
    """Placeholder for the ncclRedOp_t the executor creates from ``Plan.premul``."""

    _inst = None

    def __new__(cls):  # singleton
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "PREMUL_OP"


PREMUL_OP = _PremulOp()


_set = object.__setattr__
_new = object.__new__


@dataclass(frozen=True, init=False)
class NcclCall:
    """One NCCL call: function name (no ``nccl`` prefix) and its C-order args before comm."""

    fn: str
    args: Tuple

    def __init__(self, fn: str, args: Tuple) -> None:
        _set(self, "__dict__", nccl_call(fn, args).__dict__)   # the checks live in nccl_call

    def arg(self, name: str):
        """Argument by its NCCL parameter name."""
        return self.args[NCCL_FUNCTIONS[self.fn].index(name)]


def nccl_call(fn: str, args: Tuple) -> NcclCall:
    """``NcclCall(fn, args)``: ``fn`` must be an NCCL function of :data:`NCCL_FUNCTIONS` and
    ``args`` its arguments.  Built without calling the class (on Python 3.11 a class call with
    a Python ``__init__`` costs ~150 ns, and every cold call builds one); frozen: the fields go
    in with one ``object.__setattr__``."""
    want = NCCL_FUNCTIONS.get(fn)
    if want is None:
        raise ValueError(f"unknown NCCL function {fn!r}")
    if len(args) != len(want):
        raise ValueError(f"nccl{fn} takes {len(want)} args {want}, got {args!r}")
    c = _new(NcclCall)
    _set(c, "__dict__", {"fn": fn, "args": args})
    return c


@dataclass(frozen=True)
class Copy:
    """A device-to-device ``cudaMemcpyAsync`` on the call's stream (list forms, staging)."""

    dst: Union[int, Scratch]
    src: Union[int, Scratch]
    nbytes: int


Step = Union[NcclCall, Copy]


@dataclass(frozen=True)
class PremulSpec:
    """``ncclRedOpCreatePreMulSum`` inputs: the scalar already encoded in ``datatype``."""

    scalar: bytes
    datatype: int


@dataclass(frozen=True)
class PlanContext:
    """What planning needs to know about the communicator (no GPU handle)."""

    rank: int
    world_size: int
    device: int = 0
    nccl_version: int = 23203
    #: force the grouped send/recv path even where NCCL has a native call (tests, benchmarks)
    force_fallback: bool = False
    #: the call is issued inside a user group (``with comm.group()``): send/recv to self is
    #: then allowed, as NCCL pairs it with a recv from self in the same group
    in_group: bool = False
    #: what ``nccl_version`` is, in a refusal (``{}``: its number): the loaded NCCL's for a
    #: communicator, the planned one for ``ncclpy plan``
    version_note: str = "the loaded NCCL is {}"

    def has_native(self, fn: str) -> bool:
        """Whether the loaded NCCL has ncclGather/ncclScatter/ncclAlltoAll natively."""
        from .native import NATIVE_MIN_VERSION
        need = NATIVE_MIN_VERSION.get(fn, 0)
        return not self.force_fallback and self.nccl_version >= need


@dataclass(frozen=True, init=False)
class Plan:
    """The exact work for one user call.

    ``steps`` run in order; if ``group`` the NCCL calls among them are wrapped in
    ncclGroupStart/End (copies that precede or follow are issued outside the group, in order).
    ``premul`` asks the executor to create a PreMulSum op, substitute it for ``PREMUL_OP`` and
    destroy it after the (outermost) group ends.  ``scratch_bytes`` of device memory back the
    ``Scratch`` pointers.  ``path`` says which path was chosen, e.g. "native" or "p2p".
    """

    collective: str
    steps: Tuple[Step, ...]
    group: bool = False
    premul: Optional[PremulSpec] = None
    scratch_bytes: int = 0
    path: str = "native"
    #: bytes this rank sends / receives (for logs and the bench)
    nbytes: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    def __init__(self, collective: str, steps: Tuple[Step, ...], group: bool = False,
                 premul: Optional[PremulSpec] = None, scratch_bytes: int = 0,
                 path: str = "native", nbytes: int = 0, meta: Optional[dict] = None) -> None:
        # frozen: the fields go in with one object.__setattr__ instead of one per field
        _set(self, "__dict__", {"collective": collective, "steps": steps, "group": group,
                                "premul": premul, "scratch_bytes": scratch_bytes, "path": path,
                                "nbytes": nbytes, "meta": {} if meta is None else meta})

    @property
    def calls(self) -> Tuple[NcclCall, ...]:
        return tuple(s for s in self.steps if isinstance(s, NcclCall))


def one_call_plan(coll: str, fn: str, args: Tuple, nbytes: int, meta: dict,
                  premul: Optional[PremulSpec] = None, path: str = "native") -> Plan:
    """The Plan of exactly one NCCL call ``nccl_call(fn, args)`` (most calls), built like
    :func:`nccl_call` without calling the classes (a cold call plans once)."""
    p = _new(Plan)
    _set(p, "__dict__", {"collective": coll, "steps": (nccl_call(fn, args),), "group": False,
                         "premul": premul, "scratch_bytes": 0, "path": path, "nbytes": nbytes,
                         "meta": meta})
    return p
