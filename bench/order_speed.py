"""``python -m bench.order_speed``: how long the reduction-order model takes to predict a large
call (issue 52's target: a 64 MiB float32 all_reduce "in seconds, not minutes").

For each configuration it times, best of ``--repeat``: ``predict`` (the split and every
element's fold), and ``Prediction.outputs`` (the bits of every rank's output for random inputs,
the part that grows with the ranks).  CPU only; one line per configuration, ``--json`` for
the figures.  Target: both under 10 s for 16 Mi float32 elements (64 MiB) at 8 ranks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["main", "measure", "TARGET_S"]

#: the target for one 64 MiB prediction (each of the two parts)
TARGET_S = 10.0


def measure(nranks: int, count: int, proto: str, algo: str, channels: int,
            repeat: int) -> Dict[str, Any]:
    """Best-of-``repeat`` seconds of predict() and outputs() for one all_reduce."""
    from ncclpy.order import OrderConfig, predict
    cfg = OrderConfig.make("all_reduce", nranks, count, algo=algo, proto=proto,
                           channels=channels)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(count).astype(np.float32) for _ in range(nranks)]
    best_p = best_o = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        pred = predict(cfg)
        t1 = time.perf_counter()
        pred.outputs(xs)
        t2 = time.perf_counter()
        best_p, best_o = min(best_p, t1 - t0), min(best_o, t2 - t1)
    return {"ranks": nranks, "count": count, "bytes": 4 * count, "algo": algo, "proto": proto,
            "channels": channels, "predict_s": round(best_p, 3), "outputs_s": round(best_o, 3),
            "target_s": TARGET_S,
            "met": best_p <= TARGET_S and best_o <= TARGET_S}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the configurations; exit 1 when one misses the target."""
    p = argparse.ArgumentParser(prog="python -m bench.order_speed", description=__doc__)
    p.add_argument("--count", type=int, default=16 << 20, help="elements (default 16Mi)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    rows: List[Dict[str, Any]] = []
    for algo, proto, channels in (("ring", "ll", 2), ("ring", "simple", 2), ("tree", "ll128", 2)):
        rows.append(measure(ns.ranks, ns.count, proto, algo, channels, ns.repeat))
        r = rows[-1]
        if not ns.json:
            print(f"{algo}/{proto} {channels} ch, {r['ranks']} ranks, {r['bytes'] >> 20} MiB: "
                  f"predict {r['predict_s']:.2f} s, outputs {r['outputs_s']:.2f} s "
                  f"({'meets' if r['met'] else 'MISSES'} the {TARGET_S:.0f} s target)")
    if ns.json:
        print(json.dumps(rows, indent=1))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
