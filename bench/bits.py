"""The bits column (``--algo``, ``--proto``, ``--repeat-bits``): what each combination's output
is, bit for bit, on data where the order of a reduction matters.

Per size, series and case, after the timed and ``-c`` checked calls (whose verifiable inputs
make every order give the same bits, so they cannot tell orders apart), one more out-of-place
call, untimed, on seeded random normals (integer types: normals x 10 rounded), the same inputs
for every combination.  Its output is compared with

* the model's prediction (:mod:`ncclpy.order`) for the configuration the combination pins:
  ``exact``, ``MISMATCH k/n`` (k of the n output elements of every rank differ), or
  ``n/a: <reason>`` (not a reduction, an integer type, what the model cannot predict and why);
  on ncclpy's CPU backend the configuration is :meth:`ncclpy.order.pins.Pins.cpu_choice`'s,
  on a GPU :meth:`~ncclpy.order.pins.Pins.pinned`'s at 2 ranks (every order NCCL could take
  folds the same two operands, so its rings, trees and channels do not change the bits);
  beyond 2 ranks they come from NCCL's topology search, which the bench does not read;
* the first combination that ran at that size: ``same bits`` or ``k of n elements differ``;
* with ``--repeat-bits N``, the call made N times: ``N runs: same bits`` or
  ``N runs: k of n elements varied``.

Counts are summed over the ranks (ranks whose output NCCL does not define, reduce's and
gather's non-roots, are left out).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ncclpy.semantics import numerics as nm
from ncclpy.semantics.dtypes import C_NAMES, DTYPES

if TYPE_CHECKING:
    from .backends import Backend, Buffers

__all__ = ["bits_inputs", "prediction", "BitsColumn", "header_line", "summary_lines",
           "REDUCTIONS", "SEP", "GPU_BEYOND_TWO"]

#: the collectives the model folds (ncclpy.order.model)
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
#: between the parts of the column's text
SEP = " | "
#: why a GPU run of more than 2 ranks is not predicted here
GPU_BEYOND_TWO = ("on a GPU NCCL's rings and trees come from its topology search, which the "
                  "bench does not read (ncclpy order --observe reads them from NCCL's log)")


def bits_inputs(collective: str, dtype: str, op: str, rank: int, n: int, seed: int
                ) -> np.ndarray:
    """Rank ``rank``'s ``n`` inputs of the bits call (host dtype: bfloat16 and float8 as their
    uint views): seeded normals, the same on every process and for every combination."""
    rng = nm.rng_for(seed, rank, f"bench-bits/{collective}/{dtype}/{op}")
    vals = rng.standard_normal(n)
    if DTYPES[dtype].kind != "float":
        vals = np.round(vals * 10)
    return nm.from_bits(nm.encode(vals, dtype), dtype)


def prediction(b: "Backend", device: str, collective: str, world: int, count: int, dtype: str,
               op: str, root: int) -> Tuple[Any, str]:
    """(the model's Prediction, "") for this call on ``b``'s communicator, or (None, why not)."""
    from ncclpy.order.model import predict
    from ncclpy.order.pins import PinError, Pins
    from ncclpy.order.versions import CannotPredict
    if collective not in REDUCTIONS:
        return None, "not a reduction (its output copies inputs)"
    if DTYPES[dtype].kind != "float":
        return None, f"{dtype}: every order of an integer {op} gives the same bits"
    try:
        pins = Pins.from_env(getattr(b, "nccl_env", None) or {})
        call = {"dtype": dtype, "op": op, "root": root if collective == "reduce" else 0,
                "version": b.bits_version()}
        if device == "cpu":
            cfg = pins.cpu_choice(collective, C_NAMES[dtype]).config(
                collective, world, count, **call)
        elif world != 2:
            return None, GPU_BEYOND_TWO
        else:
            algo, proto, why = pins.pinned(collective)
            if why:
                return None, why
            from ncclpy.order.config import OrderConfig
            cfg = OrderConfig.make(collective, world, count, algo=algo, proto=proto,
                                   channels=pins.pinned_channels() or 1, **call)
        return predict(cfg), ""
    except (CannotPredict, PinError, ValueError) as e:
        return None, " ".join(str(e).split())


def header_line(basis: str, reference: Optional[str], repeats: int) -> str:
    """The ``#`` line above a table with the bits column, saying what it compares."""
    parts = [f"the model's prediction ({basis})"]
    if reference:
        parts.append(f"the first combination that ran ({reference})")
    if repeats:
        parts.append(f"{repeats} runs of the call")
    return ("# bits: one more out-of-place call per size, untimed, on seeded random normals "
            "(integer types: rounded), its output against " + ", ".join(parts))


def summary_lines(rows: Sequence[Any]) -> Tuple[List[str], bool]:
    """The footer's bits lines over ``rows`` (:class:`bench.rows.Row` with a bits column) and
    whether they pass: no MISMATCH against the model and no repeated call whose bits varied."""
    docs = [r.extra["bits"] for r in rows if isinstance(r.extra.get("bits"), dict)]
    if not docs:
        return [], True
    kinds = [d["model"]["verdict"] for d in docs]
    bad = kinds.count("MISMATCH")
    line = (f"# {'Bits vs the model':<20} : {kinds.count('exact')} exact, {bad} MISMATCH, "
            f"{kinds.count('n/a')} n/a" + (" FAILED" if bad else ""))
    out = [line]
    reps = [d["repeats"] for d in docs if d.get("repeats")]
    varied = sum(1 for d in reps if d["differing"])
    if reps:
        out.append(f"# {'Bits across runs':<20} : " + (
            f"{varied} of {len(reps)} rows varied FAILED" if varied else
            f"the same in all {len(reps)} rows ({reps[0]['runs']} runs each)"))
    return out, not bad and not varied


def _has_output(collective: str, rank: int, root: int) -> bool:
    return not (collective in ("reduce", "gather") and rank != root)


def _differ(a: np.ndarray, b: np.ndarray) -> int:
    a, b = a.reshape(-1), b.reshape(-1)
    if a.size != b.size:
        return max(a.size, b.size)
    return int(np.count_nonzero(a != b))


class BitsColumn:
    """The column of one collective's table on one rank (``state``: the sweep's rank state,
    with ``cfg``, ``coll``, ``rank``, ``world``, ``coord``)."""

    def __init__(self, state: Any, first_combo: Dict[str, str]) -> None:
        self.state = state
        #: backend name -> the label of its first combination that runs this collective
        self.first_combo = first_combo
        #: backend name -> (case key, this rank's bits of the first combination's output)
        self._first: Dict[str, Tuple[tuple, Optional[np.ndarray]]] = {}

    def row(self, b: "Backend", bufs: "Buffers", dtype: str, op: str, root: int, seed: int
            ) -> Dict[str, Any]:
        """Run the bits call(s) on ``b`` and return the row's JSON (with its ``text``)."""
        st = self.state
        cfg, name, rank, coord = st.cfg, st.coll.name, st.rank, st.coord
        lay = bufs.layout
        mine = bits_inputs(name, dtype, op, rank, lay.send, seed)
        runs: List[np.ndarray] = []
        for _ in range(max(1, cfg.repeat_bits)):
            b.fill(bufs, mine, False)
            b.run(name, bufs, op, root, False)
            got = np.array(nm.as_bits(b.output(bufs, False), dtype).reshape(-1), copy=True)
            got[:cfg.test_corrupt.get(rank, 0)] ^= 1      # test-only: --test-corrupt
            runs.append(got)
        defined = _has_output(name, rank, root) and b.output_defined(name, rank, root, False)
        out = runs[0] if defined else None
        n_total = int(coord.reduce(out.size if out is not None else 0, "sum"))
        doc: Dict[str, Any] = {"model": self._model(b, lay, dtype, op, root, seed, out)}
        texts = [self._model_text(doc["model"])]
        ref = self.first_combo.get(b.name)
        if ref is not None:
            key = (dtype, op, root, lay.total)
            if getattr(b, "combo", None) is not None and b.combo.label == ref:
                self._first[b.name] = (key, out)
                doc["first"] = {"reference": ref, "is_reference": True}
                texts.append("first combination")
            else:
                got = self._first.get(b.name)
                base = got[1] if got is not None and got[0] == key else None
                k = _differ(out, base) if (out is not None and base is not None) else 0
                seen = int(coord.reduce(1 if (out is None or base is not None) else 0, "min"))
                k = int(coord.reduce(k, "sum"))
                if seen:
                    doc["first"] = {"reference": ref, "is_reference": False, "differing": k,
                                    "compared": n_total}
                    texts.append("same bits" if k == 0 else
                                 f"{k} of {n_total} elements differ")
                else:
                    doc["first"] = None
                    texts.append(f"{ref} did not run this case")
        if cfg.repeat_bits:
            k = max((_differ(r, runs[0]) for r in runs[1:]), default=0) if defined else 0
            k = int(coord.reduce(k, "sum"))
            doc["repeats"] = {"runs": cfg.repeat_bits, "differing": k, "compared": n_total}
            texts.append(f"{cfg.repeat_bits} runs: " + (
                "same bits" if k == 0 else f"{k} of {n_total} elements varied"))
        doc["text"] = SEP.join(texts)
        return doc

    def _model(self, b: "Backend", lay: Any, dtype: str, op: str, root: int, seed: int,
               out: Optional[np.ndarray]) -> Dict[str, Any]:
        st = self.state
        name, rank, world, coord = st.coll.name, st.rank, st.world, st.coord
        pred, why = prediction(b, st.cfg.device, name, world, lay.count, dtype, op, root)
        why = coord.any(why) or ""            # the same on every rank; agreed all the same
        if pred is None:
            return {"verdict": "n/a", "reason": why}
        from ncclpy.order.verdict import judge
        inputs = [bits_inputs(name, dtype, op, r, lay.send, seed) for r in range(world)]
        observed: List[Optional[np.ndarray]] = [None] * world
        observed[rank] = None if out is None else nm.from_bits(out, dtype)
        v = judge(pred, inputs, observed)
        k = int(coord.reduce(v.differing, "sum"))
        n = int(coord.reduce(v.compared, "sum"))
        first = coord.any(v.first[0].text(dtype) if v.first else "")
        doc: Dict[str, Any] = {"verdict": "exact" if k == 0 else "MISMATCH", "differing": k,
                               "compared": n, "config": pred.config.describe()}
        if first:
            doc["first_difference"] = first
        return doc

    @staticmethod
    def _model_text(m: Dict[str, Any]) -> str:
        if m["verdict"] == "n/a":
            return f"n/a: {m['reason']}"
        if m["verdict"] == "exact":
            return "exact"
        return f"MISMATCH {m['differing']}/{m['compared']}"
