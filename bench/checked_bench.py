"""``python bench/checked_bench.py``: the cost of checked mode per call (CPU, no GPU).

Ranks are threads of one process, each with its own ncclpy TCPStore client of a real
StoreServer on loopback; each rank checks the same real plan (an in-place float32 all_reduce
planned by the real Resolver) ``--calls`` times through :class:`ncclpy.checked.Checker`.  The
figure is the median, over ranks, of each rank's median per-call wall time, at each world size.
Also: the unchecked hot path's extra cost (one attribute test; the watchdog's deque append).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
import timeit
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ncclpy import Buffer  # noqa: E402
from ncclpy.debug.checked import Checker  # noqa: E402
from ncclpy.plan.types import PlanContext  # noqa: E402
from ncclpy.comm.resolver import Resolver  # noqa: E402
from ncclpy.store import StoreServer, TCPStore  # noqa: E402


def run(world: int, calls: int) -> float:
    srv = StoreServer("127.0.0.1", 0).start()
    meds: List[float] = [0.0] * world
    start = threading.Barrier(world)

    def rank(r: int) -> None:
        store = TCPStore("127.0.0.1", srv.port, timeout=120)
        plan = Resolver(PlanContext(r, world)).resolve(
            "all_reduce", 0, Buffer(0x100000, 1024, "float32", 0), None, ("sum",)).plan
        chk = Checker(store, r, world, name=f"bench{world}", timeout=120)
        chk.check([plan])                  # warm-up
        start.wait()
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            chk.check([plan])
            ts.append(time.perf_counter() - t0)
        meds[r] = statistics.median(ts)
        store.close()
    th = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    srv.close()
    return statistics.median(meds)


def hot_path() -> Dict[str, float]:
    class C:
        _checker = None
        _watch = collections.deque(maxlen=1 << 16)
    c, w = C(), object()
    n = 1_000_000
    test = min(timeit.repeat("c._checker is not None", globals={"c": c}, number=n, repeat=5))
    app = min(timeit.repeat("q = c._watch\nif q is not None: q.append(w)",
                            setup="c._watch.clear()", globals={"c": c, "w": w}, number=n // 20,
                            repeat=5))
    return {"checker_test_ns": test / n * 1e9, "watch_append_ns": app / (n // 20) * 1e9}


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench.checked_bench``'s parser (one-line usage errors, exit status 2)."""
    from ncclpy.cli_util import OneLineParser, int_at_least
    ap = OneLineParser(prog="python -m bench.checked_bench",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=_worlds, default=[2, 8, 64], metavar="N,N,...",
                    help="world sizes, ranks as threads over one real store (default 2,8,64)")
    ap.add_argument("--calls", type=int_at_least(1, "an integer >= 1"), default=200, metavar="K",
                    help="checked calls per rank at world sizes up to 8; a quarter (at least "
                         "20) above (default 200)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the results as JSON (its folder must exist)")
    return ap


def _worlds(text: str) -> List[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or any(w < 2 for w in out):
        raise argparse.ArgumentTypeError(f"expected world sizes >= 2 such as 2,8,64, got "
                                         f"{text!r}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; a usage error is one line (exit 2), Ctrl-C 130, a closed pipe 141."""
    from ncclpy.cli_util import run_main
    return run_main("python -m bench.checked_bench", lambda: _main(argv))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.json:
        from ncclpy.cli_util import check_output_path
        why = check_output_path(a.json)
        if why:
            ap.error(f"{ap.flag('json')}: {why}")
    doc = {"cpus": os.cpu_count(), "calls": a.calls, "results": [], **hot_path()}
    for w in a.worlds:
        calls = a.calls if w <= 8 else max(a.calls // 4, 20)
        med = run(w, calls)
        doc["results"].append({"world": w, "calls": calls, "median_us": med * 1e6})
        print(f"world {w:>3}: checked call median {med * 1e6:9.1f} us ({calls} calls/rank)")
    print(f"unchecked hot path: checker test {doc['checker_test_ns']:.1f} ns, watchdog deque "
          f"append {doc['watch_append_ns']:.1f} ns")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
