"""A real two-rank gloo run of ``ncclpy check``'s session for tests/test_check_torch_backends.py,
in the two situations a CPU machine with one torch cannot otherwise produce:

* ``unvalidated``: the tables' record (``divergences.VALIDATED``) names another torch than this
  one, as on a torch the tables were not validated with;
* ``two``: the session checks two torch process groups (the default gloo group and a second
  gloo group) against the reference, the path ``--torch-backend nccl,nccl-legacy`` takes on a
  GPU.

Usage: ``python tests/torch_backends_job.py MODE JSON_FILE [check arguments...]``.  The ranks
are forked (the changed table and the wrapped set-up reach them); rank 0 prints the report
and writes the JSON, and the exit status is the run's.
"""
from __future__ import annotations

import os
import sys
import tempfile

from ncclpy.check import cli, divergences as D, session as S
from ncclpy.launch.spawn import spawn


def _two_groups(orig):
    def setup(rank, cfg):
        ctx = orig(rank, cfg)
        g = ctx["dist"].new_group(backend="gloo")
        S._torch_sides(ctx, [("gloo", None), ("gloo-again", g)])
        return ctx
    return setup


def main(argv) -> int:
    mode, js, *args = argv
    if mode == "unvalidated":
        D.VALIDATED["gloo"] = (("ProcessGroupGloo", "2.11"),)
    elif mode == "two":
        S._setup_torch = _two_groups(S._setup_torch)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    parser = cli.build_parser()
    ns = parser.parse_args(["-n", "2", "--json", js, *args])
    cfg = cli._config(parser, ns, 2, "gloo", "no GPU (tests/torch_backends_job.py)")
    fd, res = tempfile.mkstemp(prefix="ncclpy-tbjob-", suffix=".json")
    os.close(fd)
    os.unlink(res)
    cfg.update(torch_backends=None, result_file=res)
    try:
        spawn(S.spawn_entry, 2, args=(cfg,), start_method="fork", timeout=240)
        return int(cli._result(res).get("exit_code", 2))
    finally:
        if os.path.exists(res):
            os.unlink(res)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
