"""``check_output_path`` (every tool's check of its output files before it starts) run by many
processes at once on the same path -- as the ranks of ``ncclpy run`` do with ``python -m bench
-J`` -- never fails one of them and never leaves a file behind (a race CI caught)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import sys, time; from ncclpy.cli_util import check_output_path as c\n"
         "end, bad = float(sys.argv[2]), ''\n"
         "while time.time() < end and not bad:\n"
         "    bad = c(sys.argv[1])\n"
         "print(bad or 'ok')")


def test_concurrent_checks_of_one_new_path_all_pass_and_leave_nothing(tmp_path):
    target = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    end = str(time.time() + 4.0)          # every process checks over the same 2-3 s
    ps = [subprocess.Popen([sys.executable, "-c", PROBE, str(target), end],
                           stdout=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in ps]
    assert outs == ["ok"] * 4, outs
    assert os.listdir(tmp_path) == []


def test_an_existing_file_is_opened_not_recreated(tmp_path):
    from ncclpy.cli_util import check_output_path
    f = tmp_path / "keep.json"
    f.write_text("old")
    assert check_output_path(str(f)) == "" and f.read_text() == "old"
    f.chmod(0o444)
    if os.geteuid() != 0:           # root writes anyway
        assert "cannot write" in check_output_path(str(f))
    assert "does not exist" in check_output_path(str(tmp_path / "no" / "x.json"))
    assert "is a directory" in check_output_path(str(tmp_path))
