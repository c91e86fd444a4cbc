"""What NCCL's environment decides about a reduction's order: NCCL_ALGO and NCCL_PROTO (read as
NCCL reads them), NCCL_MIN/MAX_NCHANNELS and the buffer sizes; which algorithm and protocol
they pin, and the configuration a machine with no tuning of its own (ncclpy's CPU backend)
then runs.

NCCL reads these at communicator init (ncclTopoTuneModel, src/graph/tuning.cc:394-406 at
v2.28.9-1; the channels in ncclTopoPostset, src/graph/connect.cc:328-352, 485-492):

* ``NCCL_ALGO`` / ``NCCL_PROTO`` go through ``parseList`` (tuning.cc:54-130): ``;``-separated
  entries, each ``[function:]list``; only the first may lack the function prefix (else
  "All entries except the first must have a prefix"); a list starting with ``^`` disables the
  names it gives and enables the others, otherwise it enables only them; names are matched
  without case against ncclAlgoStr / ncclProtoStr (src/init.cc:49-51); an unknown name or
  prefix is ncclInvalidUsage at init.  LL128 starts at 2 ("platform decides", tuning.cc:392),
  everything else at 1.
* comm->nChannels = max(min(NCCL_MAX_NCHANNELS, found), NCCL_MIN_NCHANNELS) (connect.cc:490-491,
  copyChannels duplicating the found rings): NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS = K gives
  K channels whatever the search found.
* a call with no enabled algorithm/protocol fails: "Error : no algorithm/protocol available
  for function %s with datatype %s." and ncclInvalidUsage when NCCL_ALGO or NCCL_PROTO is set
  (src/enqueue.cc:1845-1860).

A prediction for a GPU needs the choice pinned (:meth:`Pins.pinned`): NCCL's tuning picks among
several enabled algorithms from its bandwidth model, which depends on the machine.  The CPU
backend has no such model; :meth:`Pins.cpu_choice` says what it runs (Ring unless only Tree is
enabled; Simple unless it is disabled; one channel unless NCCL_MIN_NCHANNELS asks for more).
There is no per-collective configuration in NCCL's source up to v2.30.7-1 and the dev branch
(ncclpy/cpu/RULES.md): the environment is the only pin.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from .config import OrderConfig

__all__ = ["Pins", "Choice", "PinError", "parse_list", "NCCL_ALGOS", "NCCL_PROTOS",
           "NCCL_FUNCS", "APPLICABLE", "MODELLED", "no_algorithm_text", "c_strtoll"]

#: ncclAlgoStr, ncclProtoStr, ncclFuncStr (src/init.cc:49-51 at v2.28.9-1), NCCL's order
NCCL_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("LL", "LL128", "Simple")
NCCL_FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
#: ncclpy's collective names for the functions NCCL_ALGO/NCCL_PROTO can prefix
_FUNC_OF = {"broadcast": "Broadcast", "reduce": "Reduce", "all_gather": "AllGather",
            "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce"}
#: the algorithms NCCL has a kernel for, per function (tuning.cc:273-277: Broadcast and Reduce
#: only Ring; AllGather/ReduceScatter no Tree, CollNetChain, NVLSTree; AllReduce no PAT)
APPLICABLE: Dict[str, Tuple[str, ...]] = {
    "Broadcast": ("Ring",), "Reduce": ("Ring",),
    "AllGather": ("Ring", "CollNetDirect", "NVLS", "PAT"),
    "ReduceScatter": ("Ring", "CollNetDirect", "NVLS", "PAT"),
    "AllReduce": ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree"),
}
#: the algorithms the reduction-order model covers (ncclpy.order.model)
MODELLED = ("Ring", "Tree")
_HEX = "0123456789abcdefABCDEF"
_MAXCHANNELS = 64          # src/include/device.h MAXCHANNELS (32 up to 2.24.3)
_BUFF_ENV = (("simple", "NCCL_BUFFSIZE"), ("ll", "NCCL_LL_BUFFSIZE"),
             ("ll128", "NCCL_LL128_BUFFSIZE"))


def c_strtoll(text: str) -> Tuple[int, str]:
    """What NCCL's ncclLoadParam (misc/param.cc:76-93: ``strtoll(str, nullptr, 0)``) reads from
    ``text``, and '' or why a user would not mean it (trailing characters, no digits)."""
    t = text.lstrip()
    sign = -1 if t[:1] == "-" else 1
    t = t[1:] if t[:1] in "+-" else t
    if t[:2].lower() == "0x" and t[2:3] and t[2:3] in _HEX:
        base, t = 16, t[2:]
    elif t[:1] == "0":
        base = 8
    else:
        base = 10
    digits = "0123456789abcdef"[:base]
    n = 0
    while n < len(t) and t[n].lower() in digits:
        n += 1
    value = sign * int(t[:n], base) if n else 0
    if not n:
        return value, "no digits"
    if t[n:].strip():
        return value, f"it stops at {t[n:]!r}"
    return value, ""


class PinError(ValueError):
    """A variable NCCL refuses at init (ncclInvalidUsage), with NCCL's words."""


def parse_list(text: str, names: Tuple[str, ...]) -> Dict[str, Dict[str, int]]:
    """NCCL's parseList (tuning.cc:54-130): per function of NCCL_FUNCS, each name's state.
    Starts from NCCL's defaults (LL128 2, the rest 1); PinError with NCCL's WARN text."""
    table = {f: {n: (2 if n == "LL128" else 1) for n in names} for f in NCCL_FUNCS}
    entries = text.split(";")
    first = True
    for entry in entries:
        if entry == "":                  # strtok_r skips empty tokens
            continue
        prefix: Optional[str]
        pieces = [p for p in entry.split(":") if p != ""]
        if len(pieces) >= 2:
            prefix, elems = pieces[0], pieces[1]
        elif pieces:
            if not first:
                raise PinError(f'All entries except the first must have a prefix: "{text}"')
            prefix, elems = None, pieces[0]
        else:
            first = False
            continue
        first = False
        unset, setv = (1, 0) if elems.startswith("^") else (0, 1)
        elems = elems[1:] if elems.startswith("^") else elems
        funcs = [f for f in NCCL_FUNCS if prefix is None or f.lower() == prefix.lower()]
        if not funcs:
            raise PinError(f'Unrecognized prefix token "{prefix}" when parsing "{text}"')
        for f in funcs:
            for n in names:
                table[f][n] = unset
            for tok in (t for t in elems.split(",") if t != ""):
                match = [n for n in names if n.lower() == tok.lower()]
                if not match:
                    raise PinError(f'Unrecognized element token "{tok}" when parsing "{text}"')
                table[f][match[0]] = setv
    return table


def no_algorithm_text(collective: str, dtype_nccl_name: str, algo_env: Optional[str],
                      proto_env: Optional[str]) -> str:
    """NCCL's WARN when nothing is enabled for a call (src/enqueue.cc:1845-1859)."""
    a = f" NCCL_ALGO was set to {algo_env}." if algo_env else ""
    p = f" NCCL_PROTO was set to {proto_env}." if proto_env else ""
    return (f"Error : no algorithm/protocol available for function {_FUNC_OF[collective]} "
            f"with datatype {dtype_nccl_name}.{a}{p}")


@dataclass(frozen=True)
class Choice:
    """What a call runs: ``algo``/``proto`` in the model's names (ring, tree; ll, ll128,
    simple), ``channels`` (comm->nChannels), ``buffsizes`` per protocol (overrides only) and
    ``why`` (one line: what decided it)."""

    algo: str
    proto: str
    channels: int
    buffsizes: Tuple[Tuple[str, int], ...]
    why: str

    def config(self, collective: str, nranks: int, count: int, **call: Any) -> OrderConfig:
        """The model's config of one call made with this choice (``call``: dtype, op, scalar,
        root as :meth:`OrderConfig.make` takes them); ValueError as it raises."""
        return OrderConfig.make(collective, nranks, count, algo=self.algo, proto=self.proto,
                                channels=self.channels, buffsizes=dict(self.buffsizes), **call)


@dataclass(frozen=True)
class Pins:
    """The order-relevant environment of one communicator, as NCCL reads it at init."""

    algo_env: Optional[str]
    proto_env: Optional[str]
    algos: Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...]
    protos: Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...]
    min_channels: int
    max_channels: int
    buffsizes: Tuple[Tuple[str, int], ...]
    notes: Tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Pins":
        """The pins in ``env`` (default os.environ); PinError naming the variable for what
        NCCL refuses at init (an unknown algorithm, protocol or prefix).  Numbers are read as
        NCCL reads them (strtoll, base 0: ``4x`` is 4), each such reading kept in ``notes``."""
        env = os.environ if env is None else env
        algo_env = env.get("NCCL_ALGO")
        proto_env = env.get("NCCL_PROTO")
        try:
            algos = parse_list(algo_env, NCCL_ALGOS) if algo_env else parse_list("", NCCL_ALGOS)
        except PinError as e:
            raise PinError(f"NCCL_ALGO={algo_env}: {e}") from None
        try:
            protos = (parse_list(proto_env, NCCL_PROTOS) if proto_env
                      else parse_list("", NCCL_PROTOS))
        except PinError as e:
            raise PinError(f"NCCL_PROTO={proto_env}: {e}") from None
        notes = []
        lo = _channels(env, "NCCL_MIN_NCHANNELS", "NCCL_MIN_NRINGS", 0, notes)
        hi = _channels(env, "NCCL_MAX_NCHANNELS", "NCCL_MAX_NRINGS", _MAXCHANNELS, notes)
        lo = max(0, min(lo, _MAXCHANNELS))                              # connect.cc:332-337
        hi = max(1, min(hi, _MAXCHANNELS))                              # connect.cc:346-351
        buffs = []
        for proto, var in _BUFF_ENV:
            text = env.get(var)
            if text:
                val, why = c_strtoll(text)
                if why:
                    notes.append(f"{var}={text}: NCCL reads it with strtoll as {val} ({why})")
                buffs.append((proto, val))
        return cls(algo_env, proto_env, _freeze(algos), _freeze(protos), lo, hi, tuple(buffs),
                   tuple(notes))

    # -- what is enabled -------------------------------------------------------------------
    def enabled_algos(self, collective: str) -> Tuple[str, ...]:
        """NCCL's algorithm names enabled for ``collective`` that have a kernel for it."""
        f = _FUNC_OF[collective]
        on = dict(dict(self.algos)[f])
        return tuple(a for a in APPLICABLE[f] if on[a])

    def proto_states(self, collective: str) -> Dict[str, int]:
        """Each protocol's state for ``collective``: 0 off, 1 on, 2 LL128's "the platform
        decides" (tuning.cc:392, 474-486)."""
        return dict(dict(self.protos)[_FUNC_OF[collective]])

    def comm_channels(self, found: int) -> int:
        """comm->nChannels from the search's ``found`` channels (connect.cc:490-491)."""
        return max(min(self.max_channels, found), self.min_channels)

    def pinned_channels(self) -> Optional[int]:
        """comm->nChannels where the environment decides it whatever NCCL's search found
        (at least one channel): NCCL_MIN_NCHANNELS >= NCCL_MAX_NCHANNELS (K = K included)
        gives the minimum, NCCL_MAX_NCHANNELS = 1 one channel; else None."""
        if self.min_channels >= self.max_channels:
            return self.min_channels
        return 1 if self.max_channels == 1 else None

    # -- what a call runs ------------------------------------------------------------------
    def pinned(self, collective: str) -> Tuple[Optional[str], Optional[str], str]:
        """(algo, proto, "") when the environment leaves NCCL exactly one algorithm with a
        kernel for ``collective`` and exactly one protocol (LL128's "platform decides"
        counting as maybe), in the model's names; else (None, None, why not)."""
        algos = self.enabled_algos(collective)
        if len(algos) != 1:
            what = ", ".join(algos) if algos else "none"
            return None, None, (f"NCCL_ALGO does not pin one algorithm for {collective} "
                                f"(enabled with a kernel: {what}); NCCL's tuning picks")
        states = self.proto_states(collective)
        protos = [p for p, s in states.items() if s]
        if len(protos) != 1 or states[protos[0]] == 2:
            return None, None, (f"NCCL_PROTO does not pin one protocol for {collective} "
                                f"(enabled: {', '.join(protos) or 'none'}"
                                f"{'; LL128 where the platform allows it' if states['LL128'] == 2 else ''}"
                                f"); NCCL's tuning picks")
        if algos[0] not in MODELLED:
            return None, None, (f"NCCL_ALGO pins {algos[0]} for {collective}; the model covers "
                                f"Ring and Tree only")
        return algos[0].lower(), protos[0].lower(), ""

    def cpu_choice(self, collective: str, dtype_nccl_name: str = "ncclFloat32") -> Choice:
        """What ncclpy's CPU backend runs for ``collective`` (a reduction): its "search" finds
        one channel with rings 0..n-1 and one node per rank; of the enabled algorithms Ring
        (NCCL's choice for large calls on one node), else Tree; of the protocols Simple, else
        LL, else LL128 (LL128 only where NCCL_PROTO names it: the CPU is not a platform NCCL
        enables it on by default).  PinError with NCCL's words where nothing is enabled (NCCL
        fails the call with ncclInvalidUsage); an enabled algorithm the model does not cover
        (PAT, NVLS, CollNet) alone gives Ring's order, said in ``why``."""
        algos = self.enabled_algos(collective)
        states = self.proto_states(collective)
        protos = [p for p in ("Simple", "LL", "LL128") if states[p] == 1]
        if not algos or not protos:
            raise PinError(no_algorithm_text(collective, dtype_nccl_name, self.algo_env,
                                             self.proto_env))
        modelled = [a for a in ("Ring", "Tree") if a in algos]
        channels = self.comm_channels(1)
        why = []
        if modelled:
            algo = modelled[0]
            if len(algos) > 1:
                why.append(f"{algo}, the CPU backend's choice among {', '.join(algos)}")
            elif self.algo_env:
                why.append(f"NCCL_ALGO pins {algo}")
            else:
                why.append(f"{algo}, NCCL's only algorithm for {collective}")
        else:
            algo = "Ring"
            why.append(f"only {', '.join(algos)} enabled, which the CPU backend does not "
                       f"model: it folds in Ring's order (not NCCL's bits)")
        proto = protos[0]
        why.append(f"NCCL_PROTO pins {proto}" if len(protos) == 1 and self.proto_env
                   else f"{proto}, the CPU backend's default")
        why.append(f"{channels} channel{'s' if channels != 1 else ''}" +
                   (" (NCCL_MIN/MAX_NCHANNELS)" if channels != 1 or self.max_channels < 64
                    else " (the CPU backend's one ring; NCCL_MIN_NCHANNELS asks for more)"))
        return Choice(algo.lower(), proto.lower(), channels, self.buffsizes, "; ".join(why))


def _freeze(t: Dict[str, Dict[str, int]]) -> Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...]:
    return tuple((f, tuple(v.items())) for f, v in t.items())


def _channels(env: Mapping[str, str], name: str, legacy: str, default: int,
              notes: list) -> int:
    """NCCL_PARAM's read (misc/param.cc:76-93: strtoll, base 0; the new name wins over the
    legacy one, connect.cc:330-331)."""
    value = default
    for var in (legacy, name):
        text = env.get(var)
        if text:
            val, why = c_strtoll(text)
            if why:
                notes.append(f"{var}={text}: NCCL reads it with strtoll as {val} ({why})")
            value = val
    return value
