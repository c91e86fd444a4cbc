"""What NCCL's environment decides about a reduction's order: NCCL_ALGO and NCCL_PROTO (read as
NCCL reads them), the channel count and the buffer sizes; which algorithm and protocol they
pin, and the configuration a machine with no tuning of its own (ncclpy's CPU backend) then
runs.  Citations are at v2.28.9-1.

* ``NCCL_PROTO`` then ``NCCL_ALGO`` go through ``parseList`` (src/graph/tuning.cc:54-130,
  called at :419-428 by ncclTopoTuneModel at every communicator init with more than one rank,
  :247): ``;``-separated entries, each ``[function:]list``; only the first may lack the
  function prefix; a list starting with ``^`` disables the names it gives and enables the
  others, otherwise it enables only them; names and prefixes are matched without case against
  ncclAlgoStr / ncclProtoStr / ncclFuncStr (src/init.cc:49-51); anything else is
  ncclInvalidUsage at init.  LL128 starts at 2 ("the platform decides", tuning.cc:412,
  478-494), everything else at 1.
* comm->nChannels = max(min(NCCL_MAX_NCHANNELS, found, maxCTAs), NCCL_MIN_NCHANNELS, minCTAs)
  (src/graph/connect.cc:321-358, 490-491; ``found`` is the search's channels after NCCL's
  duplication, connect.cc:452; NCCL_MIN_CTAS / NCCL_MAX_CTAS replace the config's minCTAs
  (default 1) / maxCTAs (MAXCHANNELS), init.cc:1661-1680).  These and the buffer sizes are
  NCCL_PARAMs: read once per process (:mod:`ncclpy.order.ncclenv`).
* a call with no enabled algorithm/protocol fails: "Error : no algorithm/protocol available
  for function %s with datatype %s." ("No algorithm/protocol available ..." from v2.30.3-1),
  ncclInvalidUsage when NCCL_ALGO or NCCL_PROTO is set, at the group end that plans it
  (src/enqueue.cc:1845-1860, in ncclPrepareTasks).

A prediction for a GPU needs the choice pinned (:meth:`Pins.pinned`): NCCL's tuning picks among
several enabled algorithms from its bandwidth model, which depends on the machine; and even a
pin holds only under :data:`PINNED_ASSUMES`.  The CPU backend has no such model;
:meth:`Pins.cpu_choice` says what it runs (Ring unless only Tree is enabled; Simple unless it
is disabled; one channel unless NCCL_MIN/MAX_NCHANNELS or the CTA limits say otherwise).
There is no per-collective configuration in NCCL's source up to v2.30.7-1 and the dev branch
(ncclpy/cpu/RULES.md): the environment is the only pin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import PinError
from .config import DEFAULT_VERSION, OrderConfig
from .ncclenv import _CACHE, c_strtoll, nccl_environ, param

__all__ = ["Pins", "Choice", "PinError", "parse_list", "NCCL_ALGOS", "NCCL_PROTOS",
           "NCCL_FUNCS", "APPLICABLE", "MODELLED", "no_algorithm_text", "c_strtoll",
           "PINNED_ASSUMES", "SIMPLE_ONLY"]

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
#: algorithms NCCL runs with Simple only: NVLS, NVLSTree and PAT (tuning.cc:280-282), and the
#: CollNets, whose other protocols get no bandwidth (tuning.cc:318-319)
SIMPLE_ONLY = ("NVLS", "NVLSTree", "PAT", "CollNetDirect", "CollNetChain")
#: what a pin by the environment assumes on a GPU: where one of these does not hold NCCL may run
#: something else (symmetric kernels ignore NCCL_ALGO/NCCL_PROTO: enqueue.cc:360-361,
#: symmetric_sched.cc:26-31; a tuner plugin may pick any pair and the channels, enqueue.cc:
#: 1940-1974; an env plugin answers ncclGetEnv, plugin/env.cc)
PINNED_ASSUMES = ("buffers outside NCCL_WIN_COLL_SYMMETRIC windows, no tuner plugin "
                  "(NCCL_TUNER_PLUGIN, libnccl-tuner.so, the net plugin's), no env plugin")
#: the algorithms the reduction-order model covers (ncclpy.order.model)
MODELLED = ("Ring", "Tree")
_MAXCHANNELS = 64          # src/include/device.h MAXCHANNELS (32 up to 2.24.3)
_UNSET = -2                # NCCL_PARAM defaults meaning "not set" (connect.cc:325-326)
_BUFF_ENV = (("simple", "NCCL_BUFFSIZE"), ("ll", "NCCL_LL_BUFFSIZE"),
             ("ll128", "NCCL_LL128_BUFFSIZE"))


def parse_list(text: str, names: Tuple[str, ...]) -> Dict[str, Dict[str, int]]:
    """NCCL's parseList (tuning.cc:54-130): per function of NCCL_FUNCS, each name's state.
    Starts from NCCL's defaults (LL128 2, the rest 1); PinError with NCCL's WARN text."""
    table = {f: {n: (2 if n == "LL128" else 1) for n in names} for f in NCCL_FUNCS}
    entries = text.split(";")
    offset = 0
    for entry in entries:
        at_start = offset == 0           # strtok_r's first token is fullStr itself (:66)
        offset += len(entry) + 1
        if entry == "":                  # strtok_r skips empty tokens
            continue
        prefix: Optional[str]
        pieces = [p for p in entry.split(":") if p != ""]
        if len(pieces) >= 2:
            prefix, elems = pieces[0], pieces[1]
        elif not at_start:
            raise PinError(f'All entries except the first must have a prefix: "{text}"')
        elif pieces:
            prefix, elems = None, pieces[0]
        else:                            # elemList = prefix = NULL, then elemList[0] (:74-78)
            raise PinError(f'"{text}": an entry of colons only makes NCCL read a null pointer '
                           f'(tuning.cc:74-78): it crashes')
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
                      proto_env: Optional[str], version: int = DEFAULT_VERSION) -> str:
    """NCCL's WARN when nothing is enabled for a call (src/enqueue.cc:1845-1859; worded "No
    algorithm/protocol available" from v2.30.3-1, v2.30.7-1 enqueue.cc:2063).  A variable set
    to an empty string counts as set (``if (algoEnv)``)."""
    a = f" NCCL_ALGO was set to {algo_env}." if algo_env is not None else ""
    p = f" NCCL_PROTO was set to {proto_env}." if proto_env is not None else ""
    head = "No" if version >= 23003 else "Error : no"
    return (f"{head} algorithm/protocol available for function {_FUNC_OF[collective]} "
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
    version: int = DEFAULT_VERSION

    def config(self, collective: str, nranks: int, count: int, **call: Any) -> OrderConfig:
        """The model's config of one call made with this choice (``call``: dtype, op, scalar,
        root as :meth:`OrderConfig.make` takes them); ValueError as it raises."""
        call.setdefault("version", self.version)
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
    min_ctas: int = 1
    max_ctas: int = _MAXCHANNELS
    version: int = DEFAULT_VERSION
    pat_enable: int = 2

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, *, nranks: Optional[int] = None,
                 version: int = DEFAULT_VERSION) -> "Pins":
        """The pins NCCL ``version`` reads at the init of a communicator of ``nranks`` ranks.
        ``env`` None: this process's environment with NCCL's configuration files under it,
        numbers read once per process as NCCL's NCCL_PARAMs are; a mapping: exactly those
        variables, nothing cached.  PinError naming the variable for what NCCL refuses at
        init (an unknown algorithm, protocol or prefix); a one-rank communicator parses
        neither (tuning.cc:247).  Numbers are read as NCCL reads them, each surprise kept in
        ``notes``."""
        cache = _CACHE if env is None else None
        env = nccl_environ() if env is None else env
        algo_env = env.get("NCCL_ALGO")
        proto_env = env.get("NCCL_PROTO")
        parse = nranks is None or nranks > 1
        tables = {}
        for var, text, names in (("NCCL_PROTO", proto_env, NCCL_PROTOS),
                                 ("NCCL_ALGO", algo_env, NCCL_ALGOS)):
            try:                                                # tuning.cc:419-428
                tables[var] = parse_list(text if (text and parse) else "", names)
            except PinError as e:
                raise PinError(f"{var}={text}: {e}") from None
        most = 64 if version >= 22501 else 32
        notes = []

        def read(name: str, default: int) -> int:
            val, note = param(env, name, default, cache=cache)
            if note:
                notes.append(note)
            return val

        def int32(v: int) -> int:                  # connect.cc: the int64 read into an int
            v &= 0xFFFFFFFF
            return v - (1 << 32) if v >= 1 << 31 else v

        lo = 0                                                  # connect.cc:328-337
        for name in ("NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS"):
            v = read(name, _UNSET)
            lo = int32(v) if v != _UNSET else lo
        lo = max(0, min(lo, most))
        hi = most                                               # connect.cc:342-351
        for name in ("NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS"):
            v = read(name, _UNSET)
            hi = int32(v) if v != _UNSET else hi
        hi = max(1, min(hi, most))
        ctas = []
        for name, default in (("NCCL_MIN_CTAS", 1), ("NCCL_MAX_CTAS", most)):
            v = int32(read(name, _UNSET))                       # init.cc:1661-1680
            ctas.append(v if v > 0 else default)
        buffs = []
        for proto, var in _BUFF_ENV:
            v = read(var, _UNSET)
            if v != _UNSET:                                     # init.cc:711
                buffs.append((proto, v))
        pat = read("NCCL_PAT_ENABLE", 2)                       # tuning.cc:201-209
        return cls(algo_env, proto_env, _freeze(tables["NCCL_ALGO"]),
                   _freeze(tables["NCCL_PROTO"]), lo, hi, tuple(buffs), tuple(notes),
                   ctas[0], min(ctas[1], most), version, pat)

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
        """comm->nChannels from the ``found`` channels (the search's, after NCCL's duplication,
        connect.cc:452): max(min(max channels, found, maxCTAs), min channels, minCTAs)
        (connect.cc:490-491).  A split child's cap by its parent's channels is not modelled."""
        n = min(self.max_channels, found, self.max_ctas)
        return max(n, self.min_channels, self.min_ctas)

    def pinned_channels(self) -> Optional[int]:
        """comm->nChannels where the environment decides it whatever NCCL found (at least one
        channel), else None."""
        got = {self.comm_channels(f) for f in (1, 64)}      # monotonic in found: the ends
        return got.pop() if len(got) == 1 else None

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
            maybe = "; LL128 where the platform allows it" if states["LL128"] == 2 else ""
            return None, None, (f"NCCL_PROTO does not pin one protocol for {collective} "
                                f"(enabled: {', '.join(protos) or 'none'}{maybe}); NCCL's "
                                f"tuning picks")
        if algos[0] not in MODELLED:
            return None, None, (f"NCCL_ALGO pins {algos[0]} for {collective}; the model covers "
                                f"Ring and Tree only")
        return algos[0].lower(), protos[0].lower(), ""

    def cpu_choice(self, collective: str, dtype_nccl_name: str = "ncclFloat32", *,
                   premul: bool = False) -> Choice:
        """What ncclpy's CPU backend runs for ``collective``: its machine has one node per
        rank, no NVLS, no CollNet, and its search finds one channel with rings 0..n-1; of the
        enabled algorithms Ring (its own choice: NCCL's depends on its cost model), else Tree;
        of the protocols Simple, else LL, else LL128 (LL128 only where NCCL_PROTO names it: the CPU
        is not a platform NCCL enables it on by default).  PinError with NCCL's words where
        nothing can run (NCCL fails the call with ncclInvalidUsage); PAT alone runs in Ring's
        order, said in ``why`` (the model does not cover PAT).  PAT is off where
        NCCL_PAT_ENABLE=0 (ncclPatEnable, tuning.cc:201-209; its default 2 enables it on a
        machine of one rank per node) and for a reduce_scatter whose device op is PreMulSum or
        SumPostDiv (``premul``: premul_sum, float avg; enqueue.cc:1805-1806)."""
        states = self.proto_states(collective)
        on = [p for p in ("Simple", "LL", "LL128") if states[p] == 1]
        # the CPU machine has neither NVLS nor CollNet (tuning.cc:462-472, enqueue.cc:1799);
        # NVLS, NVLSTree, PAT and the CollNets run Simple only (tuning.cc:280-282, 318-319)
        no_pat = self.pat_enable == 0 or (premul and collective == "reduce_scatter")
        algos = [a for a in self.enabled_algos(collective)
                 if not a.startswith(("NVLS", "CollNet"))
                 and (a not in SIMPLE_ONLY or "Simple" in on)
                 and not (a == "PAT" and no_pat)]
        if not algos or not on:
            raise PinError(no_algorithm_text(collective, dtype_nccl_name, self.algo_env,
                                             self.proto_env, self.version))
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
            why.append(f"only {', '.join(algos)} enabled, which the model does not cover: "
                       f"Ring's order (not NCCL's bits)")
        proto = "Simple" if algo not in modelled else on[0]
        why.append(f"NCCL_PROTO pins {proto}" if len(on) == 1 and self.proto_env is not None
                   else f"{proto}, the CPU backend's default")
        pinned = channels != 1 or self.pinned_channels() is not None
        why.append(f"{channels} channel{'s' if channels != 1 else ''}" +
                   (" (NCCL_MIN/MAX_NCHANNELS, NCCL_MIN/MAX_CTAS)" if pinned
                    else " (the CPU backend's one ring)"))
        return Choice(algo.lower(), proto.lower(), channels, self.buffsizes, "; ".join(why),
                      self.version)


def _freeze(t: Dict[str, Dict[str, int]]) -> Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...]:
    return tuple((f, tuple(v.items())) for f, v in t.items())
