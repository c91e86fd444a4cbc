"""``python -m tools.mutation``: plant one-line bugs in the modules whose contracts matter and
check that the tests of their area catch each one (docs/testing.md, "Mutation testing").

  list TARGET            the mutants of a target (all sites, the sample marked)
  run TARGET... [--all]  run the sample (or --survivors: re-run a report's survivors only)
  summary                the figures table of docs/testing.md from docs/mutation/*.json;
                         exit 1 when a module is under 90 % killed of its non-equivalent mutants
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from typing import List

from .report import TARGET_SCORE, figures, load_equivalent, table, update_testing_md
from .runner import Workspace, run_target, select
from .sites import describe, find_mutants
from .targets import TARGETS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "docs", "mutation")


def _targets(names: List[str], everything: bool) -> List[str]:
    names = list(TARGETS) if everything else names
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise SystemExit(f"mutation: unknown target(s) {bad or names}; expected some of "
                         f"{', '.join(TARGETS)} (or --all)")
    return names


def _report_path(name: str) -> str:
    return os.path.join(OUT, f"{name}.json")


def cmd_list(a: argparse.Namespace) -> int:
    for name in _targets(a.targets, False):
        t = TARGETS[name]
        src = open(os.path.join(ROOT, t.path), "rb").read()
        chosen = {m.id for m in select(t, src, a.seed, a.sample)}
        ms = find_mutants(src, t.funcs)
        print(f"# {name}: {len(ms)} sites, {len(chosen)} in the sample (*)")
        for line in describe(ms).splitlines():
            print(("* " if line.split()[0] in chosen else "  ") + line)
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    os.makedirs(OUT, exist_ok=True)
    eq = load_equivalent()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    for name in _targets(a.targets, a.all):
        t = TARGETS[name]
        src = open(os.path.join(ROOT, t.path), "rb").read()
        ms = select(t, src, a.seed, a.sample)
        old = None
        if a.survivors:
            if not os.path.exists(_report_path(name)):
                raise SystemExit(f"mutation: --survivors: {name} has no report "
                                 f"({_report_path(name)}); run its sample first: "
                                 f"python -m tools.mutation run {name}")
            with open(_report_path(name)) as f:
                old = json.load(f)
            again = {r["id"] for r in old["results"] if r["outcome"] in ("survived", "error")}
            ms = [m for m in find_mutants(src, t.funcs) if m.id in again]
            gone = again - {m.id for m in ms}
            if gone:
                print(f"# {name}: {len(gone)} survivors no longer exist in the source "
                      f"(the code changed): run the whole sample again", file=sys.stderr)
        ws = Workspace(ROOT, os.path.join(a.work, name))
        rep = run_target(ws, t, ms, eq.get(name, {}), a.budget,
                         lambda s: print(f"# {name}: {s}", flush=True))
        rep.update(target=name, sites=len(find_mutants(src, t.funcs)), seed=a.seed,
                   commit=commit, date=datetime.date.today().isoformat(), why=t.why)
        if old is not None:                         # merge the re-run into the old sample
            new = {r["id"]: r for r in rep["results"]}
            rep["results"] = [new.get(r["id"], r) for r in old["results"]]
            rep["seed"] = old["seed"]
        with open(_report_path(name), "w") as f:
            json.dump(rep, f, indent=1)
            f.write("\n")
        c = figures(rep, eq.get(name, {}))
        print(f"# {name}: {c}", flush=True)
    return cmd_summary(a, write=False)


def cmd_summary(a: argparse.Namespace, write: bool = True) -> int:
    eq = load_equivalent()
    reps = []
    for name in TARGETS:
        if os.path.exists(_report_path(name)):
            with open(_report_path(name)) as f:
                reps.append((name, json.load(f)))
    text = table(reps, eq)
    print(text)
    if write:
        update_testing_md(os.path.join(ROOT, "docs", "testing.md"), text)
    low = [n for n, r in reps if figures(r, eq.get(n, {}))["score"] < TARGET_SCORE]
    missing = [n for n in TARGETS if n not in dict(reps)]
    for n in low:
        print(f"mutation: {n} is under {TARGET_SCORE:.0%} killed", file=sys.stderr)
    for n in missing:
        print(f"mutation: {n} has no report (python -m tools.mutation run {n})", file=sys.stderr)
    return 1 if low or missing else 0


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.mutation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("list", cmd_list), ("run", cmd_run), ("summary", cmd_summary)):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        if name != "summary":
            s.add_argument("targets", nargs="*", metavar="TARGET")
            s.add_argument("--seed", type=int, default=40)
            s.add_argument("--sample", type=int, default=None,
                           help="mutants per target (default: the target's; 0: all)")
        if name == "run":
            s.add_argument("--all", action="store_true", help="every target")
            s.add_argument("--survivors", action="store_true",
                           help="re-run the survivors of the target's last report only")
            s.add_argument("--budget", type=float, default=1800.0,
                           help="seconds per target before it stops (default 1800)")
            s.add_argument("--work", default="/tmp/ncclpy-mutation",
                           help="where the copies of the checkout go")
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        print("mutation: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
