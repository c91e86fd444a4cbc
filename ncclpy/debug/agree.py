"""Do the ranks run the same thing?  Compare libnccl, versions, NCCL_* settings and the Config.

Mismatched settings across ranks are a quiet cause of hangs and wrong results: one rank with
``NCCL_PROTO=Simple`` and another without, two NCCL versions, different communicator options.
At init in checked mode (before NCCL creates the communicator) and in ``ncclpy info
--all-ranks``, each rank gathers its :func:`facts` and the ranks compare them:

* **behaviour** -- the NCCL version, ncclpy's version, the communicator's Config, and the
  NCCL_* variables that change what NCCL does (algorithms, protocols, channels, buffers, and
  every transport or feature switch: ``*_DISABLE``, ``*_ENABLE``, ``*_LEVEL``, ``NCCL_NET``...):
  a difference is an error naming the ranks and values;
* **noted** -- the library's path, CuPy, torch, the CUDA driver and runtime, Python, and the
  other NCCL_* variables (``NCCL_DEBUG``, node-local ``NCCL_SOCKET_IFNAME``...): listed, not
  fatal.

Traffic: two VOTEs per rank (one round trip each, the hashes of both parts) when the ranks
agree, which is the common case; only on a difference does each rank publish its facts, rank 0
read them (N gets) and publish the comparison, which every rank reads: O(N) in total.
NCCL's effective parameters (its parameter API, NCCL >= 2.30.4: what NCCL resolved from the
environment, ``nccl.conf`` files and its defaults) join the two parts as ``param NCCL_*``,
split by the same rule as the variables.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import EnvironmentMismatchError

__all__ = ["facts", "split", "compare", "Comparison", "exchange", "BEHAVIOUR_VARS",
           "behaviour_var", "check_agreement", "compare_all_ranks"]

log = logging.getLogger(__name__)

#: NCCL_* variables that change NCCL's behaviour (plus every *_DISABLE/_ENABLE/_LEVEL switch)
BEHAVIOUR_VARS = frozenset((
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_NET", "NCCL_BUFFSIZE", "NCCL_NTHREADS",
    "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS",
    "NCCL_CROSS_NIC", "NCCL_CHUNK_SIZE", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_COMM_BLOCKING",
    "NCCL_LAUNCH_MODE", "NCCL_RUNTIME_CONNECT", "NCCL_GRAPH_MIXING_SUPPORT",
    "NCCL_NVLS_CHUNKSIZE", "NCCL_CGA_CLUSTER_SIZE", "NCCL_TUNER_PLUGIN", "NCCL_NET_PLUGIN",
    "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_SINGLE_RING_THRESHOLD", "NCCL_LL_THRESHOLD",
    "NCCL_TREE_THRESHOLD", "NCCL_WORK_FIFO_DEPTH"))
_SWITCH_SUFFIXES = ("_DISABLE", "_ENABLE", "_LEVEL")


def behaviour_var(name: str) -> bool:
    """Whether the NCCL_* variable ``name`` changes what NCCL does."""
    return name in BEHAVIOUR_VARS or name.endswith(_SWITCH_SUFFIXES)


def _dist(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _config_text(config: Any) -> Optional[str]:
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        return json.dumps({f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                          sort_keys=True, default=str)
    return repr(config)


def facts(config: Any = None, env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """This process's facts: ``{"behaviour": {...}, "noted": {...}}`` (JSON-able)."""
    from .._version import __version__
    env = os.environ if env is None else env
    beh: Dict[str, Any] = {"ncclpy": __version__, "config": _config_text(config)}
    noted: Dict[str, Any] = {"python": sys.version.split()[0], "cupy": _dist("cupy-cuda13x")
                             or _dist("cupy-cuda12x") or _dist("cupy"), "torch": _dist("torch")}
    try:
        from .._nccl.lib import get_lib
        lib = get_lib()
        beh["nccl_version"] = int(lib.version)
        noted["libnccl"] = getattr(lib, "path", None)
        try:
            from .._nccl.params import has_param_api, nccl_params
            if has_param_api(lib):
                for k, v in nccl_params(lib=lib).items():
                    (beh if behaviour_var(k) else noted)[f"param {k}"] = v
        except Exception as e:  # noqa: BLE001 - said as the value
            noted["nccl_params"] = f"unavailable ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - said as the value
        beh["nccl_version"] = f"unavailable ({type(e).__name__})"
    for key, fn in (("cuda_driver", "driverGetVersion"), ("cuda_runtime", "runtimeGetVersion")):
        try:
            from cupy.cuda import runtime
            noted[key] = int(getattr(runtime, fn)())
        except Exception:  # noqa: BLE001 - no CUDA here: said as None
            noted[key] = None
    for k in sorted(env):
        if k.startswith("NCCL_"):
            (beh if behaviour_var(k) else noted)[f"env {k}"] = env[k]
    return {"behaviour": beh, "noted": noted}


def split(f: Mapping[str, Any]) -> Tuple[str, str]:
    """The canonical texts of the two parts (what the votes hash)."""
    return (json.dumps(f["behaviour"], sort_keys=True, default=str),
            json.dumps(f["noted"], sort_keys=True, default=str))


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclasses.dataclass
class Comparison:
    """What differs across ranks: ``errors`` (behaviour) and ``notes`` (one line each)."""

    errors: List[str]
    notes: List[str]

    def text(self, world: int) -> str:
        if not self.errors and not self.notes:
            return f"all {world} ranks run the same NCCL with the same settings"
        lines = []
        if self.errors:
            lines.append(f"the ranks differ in what changes NCCL's behaviour ({len(self.errors)})"
                         f":")
            lines += [f"  - {e}" for e in self.errors]
        if self.notes:
            lines.append(f"noted, not fatal ({len(self.notes)}):")
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def _groups(values: Mapping[int, Any]) -> str:
    by: Dict[str, List[int]] = {}
    for r, v in sorted(values.items()):
        by.setdefault(json.dumps(v, default=str), []).append(r)
    parts = []
    for v, rs in sorted(by.items(), key=lambda kv: kv[1][0]):
        shown = "(unset)" if v == "null" else v
        parts.append(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {shown}")
    return "; ".join(parts)


def _ranks(rs: Sequence[int]) -> str:
    from .verdicts import ranks_text as fmt
    return fmt(list(rs), 16)


def compare(all_facts: Mapping[int, Mapping[str, Any]]) -> Comparison:
    """Every key whose value differs between ranks, with which ranks have which value."""
    errors: List[str] = []
    notes: List[str] = []
    for part, out in (("behaviour", errors), ("noted", notes)):
        keys = sorted({k for f in all_facts.values() for k in f.get(part, {})})
        for k in keys:
            vals = {r: f.get(part, {}).get(k) for r, f in all_facts.items()}
            if len({json.dumps(v, default=str) for v in vals.values()}) > 1:
                out.append(f"{k}: {_groups(vals)}")
    return Comparison(errors, notes)


def exchange(store: Any, rank: int, world: int, prefix: str, timeout: float,
             f: Mapping[str, Any], always: bool = False) -> Comparison:
    """Compare ``f`` across the ``world`` ranks through ``store`` (see the module docstring);
    ``always``: gather every rank's facts even when the votes agree (``ncclpy info
    --all-ranks``).  Every rank gets the same Comparison."""
    beh, noted = split(f)
    agreed = False
    if world == 1:
        return Comparison([], [])
    if not always and getattr(store, "supports_tables", False):
        from ..store import tablewire as W
        v1 = store.vote(f"{prefix}/v1", world, rank, _h64(beh), timeout=timeout)
        v2 = store.vote(f"{prefix}/v2", world, rank, _h64(noted), timeout=timeout)
        if (v1.verdict | v2.verdict) & W.TIMED_OUT:
            from ..errors import StoreTimeout
            raise StoreTimeout(f"comparing the ranks' NCCL settings: rank(s) "
                               f"{_ranks(v1.missing or v2.missing)} never came within "
                               f"{timeout:g} s")
        agreed = not v1.verdict and not v2.verdict
    if agreed:
        return Comparison([], [])
    from ..store.sync import count_out, delete_key, wait_counted_out, wait_key
    store.set(f"{prefix}/f/{rank}", json.dumps(f, default=str))
    if rank == 0:
        got = {0: dict(f)}
        for r in range(1, world):
            got[r] = json.loads(wait_key(store, f"{prefix}/f/{r}", timeout))
        cmp = compare(got)
        store.set(f"{prefix}/report", json.dumps(dataclasses.asdict(cmp)))
        wait_counted_out(store, f"{prefix}/out", world - 1, timeout, "the settings comparison")
        for key in [f"{prefix}/f/{r}" for r in range(world)] + [f"{prefix}/report",
                                                                f"{prefix}/out"]:
            delete_key(store, key)
        return cmp
    cmp = Comparison(**json.loads(wait_key(store, f"{prefix}/report", timeout)))
    count_out(store, f"{prefix}/out")
    return cmp


def check_agreement(store: Any, rank: int, world: int, prefix: str, timeout: float,
                    config: Any = None) -> Comparison:
    """Checked mode's check at init: raise EnvironmentMismatchError (every rank) on a
    behaviour difference; log the noted ones."""
    cmp = exchange(store, rank, world, prefix, timeout, facts(config))
    if cmp.notes and rank == 0:
        log.warning("checked mode: the ranks differ in settings that do not change NCCL's "
                    "behaviour:\n%s", "\n".join(f"  - {n}" for n in cmp.notes))
    if cmp.errors:
        raise EnvironmentMismatchError(f"checked mode (rank {rank}): " + cmp.text(world),
                                       errors=cmp.errors, notes=cmp.notes)
    return cmp


def compare_all_ranks(timeout: float = 120.0) -> Tuple[int, int, Comparison]:
    """``ncclpy info --all-ranks`` in one rank of a launched job: compare every rank's facts
    through the job's store; (this rank, world size, the Comparison every rank gets).
    RendezvousError when not under a launcher, StoreError when the store fails."""
    from ..rendezvous.bootstrap import connect_store
    from ..rendezvous import resolve
    info = resolve()
    store = connect_store(info, timeout=timeout)
    cmp = exchange(store, info.rank, info.world_size, "ncclpy/info/agree", timeout, facts(),
                   always=True)
    return info.rank, info.world_size, cmp
