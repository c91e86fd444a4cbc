"""``--algo`` / ``--proto`` / ``--repeat-bits``: NCCL's algorithm x protocol combinations.

Each combination is one communicator, made with ``NCCL_ALGO`` and ``NCCL_PROTO`` set to it in
the environment while it is created: NCCL reads both there at init (ncclTopoTuneModel,
src/graph/tuning.cc:419-427 at v2.28.9-1, through ncclGetEnv, which calls getenv each time:
src/misc/param.cc:96-99), and ncclpy's CPU backend reads them at its communicator's init too
(:meth:`ncclpy.order.pins.Pins.cpu_choice`).  Every rank makes every combination's
communicator at the start, one after the other, so the sweep alternates them at each size as
it alternates backends.  No other variable is changed: the ones NCCL caches for the process
(NCCL_MIN/MAX_NCHANNELS, the buffer sizes: NCCL_PARAM, src/misc/param.cc:76-93) stay what the
process was started with, the same for every combination.

A combination NCCL refuses or ignores for a collective is not run and is said in one line
(:func:`refusal`): an algorithm with no kernel for it (Tree for reduce_scatter, reduce,
all_gather, broadcast: tuning.cc:273-277), NVLS, NVLSTree and PAT with another protocol than
Simple (tuning.cc:280-282), the send/recv collectives (whose protocol NCCL picks by size,
src/enqueue.cc:821-835), one rank (a copy: enqueue.cc:2569-2570), and on the CPU backend an
algorithm it does not model.  LL128 is run wherever it is named: NCCL_PROTO=LL128 enables it
whatever the platform (only its default state 2 asks the platform, tuning.cc:480-494), and the
CPU backend models it only when named.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ncclpy.errors import ArgumentError
from ncclpy.order.pins import NCCL_ALGOS, NCCL_PROTOS, PinError, Pins

__all__ = ["Combo", "parse_names", "make_combos", "refusal", "applied", "add_combo_flags",
           "check_combo_flags", "P2P", "SIMPLE_ONLY", "COMBO_BACKENDS", "environ"]

#: the collectives NCCL runs as send/recv: NCCL_ALGO and NCCL_PROTO do not apply
P2P = ("all_to_all", "gather", "scatter", "send_recv")
#: algorithms NCCL has Simple kernels for only (tuning.cc:280-282)
SIMPLE_ONLY = ("NVLS", "NVLSTree", "PAT")
#: the backends whose communicator is made at init from NCCL's environment (torch makes its
#: NCCL communicator at its first call; gloo has no algorithms)
COMBO_BACKENDS = ("ncclpy", "cupy")
#: NCCL's function names (ncclFuncStr) of the collectives NCCL_ALGO/NCCL_PROTO prefix
_FUNC = {"broadcast": "Broadcast", "reduce": "Reduce", "all_gather": "AllGather",
         "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce"}


@dataclass(frozen=True)
class Combo:
    """One combination: ``algo`` and ``proto`` in NCCL's spelling (``Ring``, ``LL128``), None
    where the flag was not given (the environment's value, or NCCL's tuning, decides)."""

    algo: Optional[str] = None
    proto: Optional[str] = None

    @property
    def label(self) -> str:
        """``ring/simple`` (lowercase), or just the part given (``tree``, ``ll128``)."""
        return "/".join(x.lower() for x in (self.algo, self.proto) if x)

    def env(self) -> Dict[str, str]:
        """The variables set while this combination's communicator is made."""
        out = {}
        if self.algo:
            out["NCCL_ALGO"] = self.algo
        if self.proto:
            out["NCCL_PROTO"] = self.proto
        return out

    def pins(self, base: Optional[Mapping[str, str]] = None) -> Pins:
        """What NCCL reads at the communicator's init: ``base`` (default os.environ) with this
        combination set; PinError as :meth:`Pins.from_env` raises it."""
        env = dict(os.environ if base is None else base)
        env.update(self.env())
        return Pins.from_env(env)

    def to_json(self) -> Dict[str, Any]:
        return {"label": self.label, "algorithm": self.algo, "protocol": self.proto,
                "env": self.env()}


@contextlib.contextmanager
def applied(combo: Optional[Combo]) -> Iterator[Dict[str, str]]:
    """``combo``'s variables set in the environment for the block (NCCL reads them at the init
    made inside it), then restored; yields every NCCL_* variable as the init sees it."""
    values = combo.env() if combo is not None else {}
    with environ(**values):
        yield snapshot("NCCL_")


@dataclass
class _Hold:
    """One value of a variable held by overlapping environ() blocks: what was there before it,
    and how many blocks of which threads hold it."""

    value: Optional[str]
    before: Optional[str]
    holders: Dict[int, int] = field(default_factory=dict)


#: environ()'s bookkeeping, shared by the threads of one process (thread-ranks in tests):
#: variable -> its holds, innermost last (a thread's nested block may set another value)
_ENV_COND = threading.Condition()
_ENV_HELD: Dict[str, List[_Hold]] = {}
#: how long a block waits for other threads to leave a variable it wants at another value
ENV_WAIT_S = 60.0


@contextlib.contextmanager
def environ(**values: Optional[str]) -> Iterator[None]:
    """Set (a str) or unset (None) environment variables for the block, then restore them.

    The process has one environment: blocks that overlap in several threads (ranks as threads)
    and want the same value share it, and the last to leave restores what was there before the
    first came, whatever the order they leave in.  A block that wants another value than other
    threads' blocks hold waits until they have left (at most :data:`ENV_WAIT_S`, then
    RuntimeError): otherwise one of them would run under the other's value.  A block nested in
    the same thread may set another value; leaving, it restores the outer one."""
    me = threading.get_ident()

    def clash() -> Optional[str]:
        for k, v in values.items():
            top = _ENV_HELD.get(k, [None])[-1]
            if top is not None and top.value != v and any(t != me for t in top.holders):
                return k
        return None

    taken: List[Tuple[str, _Hold]] = []
    with _ENV_COND:
        if not _ENV_COND.wait_for(lambda: clash() is None, timeout=ENV_WAIT_S):
            k = clash()
            raise RuntimeError(f"environment variable {k}: {values[k]!r} wanted, but another "
                               f"thread's block has held it at {_ENV_HELD[k][-1].value!r} for "
                               f"{ENV_WAIT_S:g} s")
        try:
            for k, v in values.items():
                stack = _ENV_HELD.get(k, [])
                if stack and stack[-1].value == v:
                    hold = stack[-1]
                else:
                    hold = _Hold(v, os.environ.get(k))
                    _put(k, v)                      # may raise (a NUL in the value)
                    stack.append(hold)
                    _ENV_HELD[k] = stack
                hold.holders[me] = hold.holders.get(me, 0) + 1
                taken.append((k, hold))
        except BaseException:
            _release(taken, me)
            raise
    try:
        yield
    finally:
        with _ENV_COND:
            _release(taken, me)
            _ENV_COND.notify_all()


def snapshot(prefix: str = "") -> Dict[str, str]:
    """The environment's variables starting with ``prefix``, read while no environ() block is
    entering or leaving (os.environ lists its keys, then reads each)."""
    with _ENV_COND:
        return {k: v for k, v in os.environ.items() if k.startswith(prefix)}


def _release(taken: List[Tuple[str, "_Hold"]], me: int) -> None:
    """Leave the holds ``taken`` (innermost first); a hold nobody holds any more puts back the
    value from before it."""
    for k, hold in reversed(taken):
        hold.holders[me] -= 1
        if hold.holders[me] == 0:
            del hold.holders[me]
        if not hold.holders:
            stack = _ENV_HELD[k]
            stack.remove(hold)
            _put(k, hold.before)
            if not stack:
                del _ENV_HELD[k]


def _put(key: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _key(text: str) -> str:
    return text.strip().lower().replace("_", "").replace("-", "")


def parse_names(text: str, names: Sequence[str], flag: str) -> List[str]:
    """A comma-separated list of NCCL's names (``names``: ncclAlgoStr or ncclProtoStr), matched
    without case, ``_`` or ``-`` (``ring``, ``LL128``, ``nvls_tree``), in the order given,
    duplicates once; ArgumentError naming ``flag`` otherwise."""
    by_key = {_key(n): n for n in names}
    out: List[str] = []
    for part in str(text).split(","):
        key = _key(part)
        if key.startswith("^") or any(c in part for c in ";:"):
            raise ArgumentError(
                f"{flag} {text}: each combination pins one name; NCCL's ^ (disable) and "
                f"function: forms are not combinations; expected a comma-separated list of "
                f"{', '.join(names)}")
        if key not in by_key:
            raise ArgumentError(f"{flag}: expected a comma-separated list of {', '.join(names)} "
                                f"(any case), got {part.strip()!r}" + (
                                    f" in {text!r}" if "," in str(text) else ""))
        if by_key[key] not in out:
            out.append(by_key[key])
    return out


def make_combos(algos: Sequence[Optional[str]], protos: Sequence[Optional[str]]
                ) -> List[Combo]:
    """Every algorithm with every protocol, the algorithm outermost (``ring/ll``,
    ``ring/simple``, ``tree/ll``, ...); an empty list: not given."""
    return [Combo(a, p) for a in (list(algos) or [None]) for p in (list(protos) or [None])]


def refusal(combo: Combo, collective: str, world: int, device: str,
            env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why ``combo`` is not run for ``collective`` (one line, NCCL's source cited), or None."""
    if collective not in _FUNC:
        return (f"NCCL runs {collective} as send/recv, whose protocol it picks by size "
                f"(src/enqueue.cc:821-835): NCCL_ALGO and NCCL_PROTO do not apply to it")
    if world == 1:
        return ("one rank: NCCL copies the input (ncclLaunchOneRank, src/enqueue.cc:2569-2570) "
                "and runs no algorithm or protocol")
    func = _FUNC[collective]
    try:
        pins = combo.pins(env)
    except PinError as e:                 # the user's own NCCL_* under a partial combination
        return f"NCCL refuses the environment at init: {e}"
    set_to = " ".join(f"{k}={v}" for k, v in combo.env().items())
    fails = (f"with {set_to} every call fails with \"no algorithm/protocol available\" "
             f"(src/enqueue.cc:1845-1860)")
    algos = pins.enabled_algos(collective)
    if not algos:
        what = combo.algo or "enabled"
        return f"NCCL has no {what} kernel for {func} (src/graph/tuning.cc:273-277): {fails}"
    states = pins.proto_states(collective)
    protos = [p for p in NCCL_PROTOS if states[p]]
    pairs = [(a, p) for a in algos for p in protos if not (a in SIMPLE_ONLY and p != "Simple")]
    if not protos or not pairs:
        return (f"NCCL has {', '.join(algos)} kernels for Simple only (src/graph/tuning.cc:"
                f"280-282): {fails}")
    if device == "cpu" and not any(a in ("Ring", "Tree") for a in algos):
        return (f"ncclpy's CPU backend models Ring and Tree only: it would fold "
                f"{', '.join(algos)}'s calls in Ring's order, not NCCL's")
    return None


# ---------------------------------------------------------------------------- the flags
def add_combo_flags(g: Any) -> None:
    """Add --algo, --proto and --repeat-bits to the argument group ``g``."""
    g.add_argument("--algo", default=None, metavar="ALGO[,ALGO...]",
                   help="run the sweep once per algorithm (and protocol, --proto), each on its "
                        "own communicator made with NCCL_ALGO set to it: NCCL's names, any "
                        "case (ring, tree, nvls, nvlstree, collnetdirect, collnetchain, pat); "
                        "adds the bits column (--backend ncclpy or cupy)")
    g.add_argument("--proto", default=None, metavar="PROTO[,PROTO...]",
                   help="run the sweep once per protocol (ll, ll128, simple, any case), each "
                        "on its own communicator made with NCCL_PROTO set to it; with --algo "
                        "every algorithm x protocol combination")
    g.add_argument("--repeat-bits", "--repeat_bits", dest="repeat_bits", type=_repeats,
                   default=0, metavar="N",
                   help="run the bits column's call N times (N >= 2) and say whether every "
                        "run gave the same bits")


def _repeats(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer N >= 2, got {text!r}") from None
    if v < 2:
        raise argparse.ArgumentTypeError(f"expected an integer N >= 2 (the runs compared with "
                                         f"the first), got {text!r}")
    return v


def check_combo_flags(p: Any, a: Any, backends: Sequence[str], device: str
                      ) -> Tuple[List[Combo], int]:
    """(combinations, repeat_bits) from the parsed flags; ArgumentError naming the flag as
    typed for a name NCCL does not have, a backend that cannot pin a combination, or NCCL's
    symmetric kernels (-R 2), which do not follow NCCL_ALGO/NCCL_PROTO."""
    algos = parse_names(a.algo, NCCL_ALGOS, p.flag("algo")) if a.algo is not None else []
    protos = parse_names(a.proto, NCCL_PROTOS, p.flag("proto")) if a.proto is not None else []
    combos = make_combos(algos, protos) if (algos or protos) else []
    used = [(dest, shown) for dest, shown, on in (
        ("algo", a.algo, a.algo is not None), ("proto", a.proto, a.proto is not None),
        ("repeat_bits", a.repeat_bits, bool(a.repeat_bits))) if on]
    if not used:
        return combos, 0
    dest, shown = used[0]
    flag = f"{p.flag(dest)} {shown}"
    bad = [b for b in backends if b not in COMBO_BACKENDS]
    if bad:
        why = ("torch.distributed's gloo runs no NCCL" if device == "cpu" else
               "torch.distributed makes its NCCL communicator at its first call, not at init")
        raise ArgumentError(f"{flag}: needs --backend {' or '.join(COMBO_BACKENDS)} (a "
                            f"communicator made from NCCL's environment at init); {why}")
    if combos and getattr(a, "local_register", 0) == 2:
        raise ArgumentError(f"{flag}: -R 2 registers symmetric windows, and NCCL runs its "
                            f"symmetric kernels on them whatever NCCL_ALGO and NCCL_PROTO say "
                            f"(src/enqueue.cc:360-361); drop one of them")
    return combos, int(a.repeat_bits)
