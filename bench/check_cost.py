"""Where a case of ``ncclpy check`` spends its time, and what gathering the verdicts in batches
saved: the whole check, as users run it, at each world size, once with one verdict gather per
case (as before issue 34) and once with the default batch, in one run.

Each run is ``python -m ncclpy check -n N --json FILE`` (the backend the machine has: since
issue 51 ncclpy's CPU backend beside gloo on a machine without a GPU (``--backend gloo``: gloo
alone, what the figures of issue 34 in docs/performance.md measured), nccl on a GPU); the figures are the JSON's ``timing``:
rank 0's start-up, its milliseconds per case, and per phase -- building the inputs, the numpy
reference, the torch side, the ncclpy side, the comparisons, gathering the verdicts (``sync``:
also the wait for the slowest rank).  The ranks of one run share this machine's cores: at more
ranks than cores the figures include that contention (say so beside them).

Usage: ``python -m bench.check_cost [-n 2,4] [--sizes 0,1,7,1024,65537,1MiB] [--batch 1,32]
[--backend auto|gloo|nccl] [-J FILE]``; a table on stdout, JSON with ``-J``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as ``python bench/check_cost.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ncclpy.check.runner import PHASES  # noqa: E402
from ncclpy.check.session import BATCH_ENV, VERDICT_BATCH  # noqa: E402
from ncclpy.cli_util import OneLineParser, run_main  # noqa: E402

__all__ = ["main", "build_parser", "measure", "table"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the GPU check's default sizes (the CPU's lack 65537): one matrix on every machine
SIZES = "0,1,7,1024,65537,1MiB"


def _ints(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers such as 2,4, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 such as 2,4, got {text!r}")
    return out


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m bench.check_cost",
                      description="Time ncclpy check per case and per phase, with one verdict "
                                  "gather per case and with the default batch.")
    p.add_argument("-n", "--nprocs", type=_ints, default=[2, 4], metavar="N[,N]",
                   help="world sizes (default 2,4)")
    p.add_argument("--batch", type=_ints, default=[1, VERDICT_BATCH], metavar="B[,B]",
                   help=f"verdict batches to compare (default 1,{VERDICT_BATCH})")
    p.add_argument("--sizes", default=SIZES, help=f"the check's --sizes (default {SIZES})")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="the check's --backend (default auto)")
    p.add_argument("-J", "--json", default=None, metavar="FILE", help="also write JSON here")
    return p


def measure(n: int, batch: int, sizes: str, backend: str = "auto",
            timeout: float = 900.0) -> Dict[str, Any]:
    """One check run: its timing, cases and exit status."""
    fd, path = tempfile.mkstemp(prefix="ncclpy-check-cost-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, **{BATCH_ENV: str(batch)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    try:
        cp = subprocess.run([sys.executable, "-m", "ncclpy", "check", "-n", str(n), "-q",
                             "--sizes", sizes, "--backend", backend, "--json", path],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return {"n": n, "batch": batch, "error": f"{type(e).__name__}: {e}"}
    finally:
        os.unlink(path)
    t = doc.get("timing") or {}
    return {"n": n, "batch": batch, "backend": doc.get("header", {}).get("backend"),
            "exit_code": cp.returncode, "cases": t.get("cases"), "seconds": doc.get("seconds"),
            **{k: t.get(k) for k in ("setup_s", "walk_s", "per_case_ms", "phases_per_case_ms")}}


def table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The results, one line per run (ms per case, per phase)."""
    head = f"{'n':>3} {'batch':>5} {'cases':>6} {'start':>6} {'ms/case':>8}" + "".join(
        f" {p:>9}" for p in PHASES)
    out = [f"# ncclpy check: rank 0's time per case (ms) and per phase, cpus={os.cpu_count()}",
           head]
    for r in rows:
        if "error" in r:
            out.append(f"{r['n']:>3} {r['batch']:>5}  error: {r['error']}")
            continue
        ph = r.get("phases_per_case_ms") or {}
        out.append(f"{r['n']:>3} {r['batch']:>5} {r['cases']:>6} {r['setup_s']:>5.1f}s "
                   f"{r['per_case_ms']:>8.2f}" + "".join(f" {ph.get(p, 0.0):>9.2f}"
                                                        for p in PHASES))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The benchmark's command line; 0 when every run exited 0 (a closed pipe, Ctrl-C: quiet)."""
    return run_main("python -m bench.check_cost", lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    ns = build_parser().parse_args(argv)
    rows = []
    for n in ns.nprocs:
        for b in ns.batch:
            rows.append(measure(n, b, ns.sizes, ns.backend))
    for line in table(rows):
        print(line, flush=True)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"cpus": os.cpu_count(), "sizes": ns.sizes, "runs": rows}, f, indent=1)
    return 0 if all("error" not in r and r.get("exit_code") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
