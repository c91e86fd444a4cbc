"""The bench's output files that cannot be written (issue 38, item 16): ``--csv /dev/full`` and
the like end in one line naming the flag, the file and the error, exit status 1, no traceback,
no rank left waiting; a reader that closes stdout early (``| head -1``) ends the run quietly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from module_run import ROOT, run_module

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")]

_SWEEP = ["all_reduce", "--device", "cpu", "-b", "1K", "-e", "2K", "-f", "2", "-n", "1", "-q"]
_ENOSPC = "cannot write: No space left on device (ENOSPC)\n"


@pytest.mark.parametrize("flag, shown", [("--csv", "--csv"), ("-J", "-J/--output_file"),
                                         ("--plot", "--plot")])
@pytest.mark.parametrize("ranks", [[], ["--nproc", "2"]], ids=["1 rank", "2 ranks"])
def test_a_full_disk_is_one_line_naming_the_file(flag, shown, ranks, tmp_path):
    path = "/dev/full"
    if flag == "--plot":                 # matplotlib takes its format from the extension
        path = str(tmp_path / "full.png")
        os.symlink("/dev/full", path)
    cp = run_module("bench", *_SWEEP, *ranks, flag, path, timeout=240)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert cp.stderr == f"python -m bench: {shown} {path}: {_ENOSPC}", cp.stderr
    assert "# Out of bounds values : 0 OK" in cp.stdout        # the run itself was fine
    assert "# Writing" not in cp.stdout                         # and claims no file


def test_ncclpy_bench_names_itself_and_the_other_files_still_get_written(tmp_path):
    js = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-m", "ncclpy", "bench", *_SWEEP, "--nproc", "2",
                         "--csv", "/dev/full", "-J", str(js)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=240)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert cp.stderr == f"ncclpy bench: --csv /dev/full: {_ENOSPC}", cp.stderr
    assert f"# Writing JSON output to {js}" in cp.stdout and js.exists()


def test_a_reader_that_stops_after_one_line_ends_the_run_quietly(tmp_path):
    """``python -m bench ... --csv F | head -1``: nothing on stderr, exit status 141."""
    err = open(tmp_path / "err", "w+")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "bench", *_SWEEP, "--nproc", "2", "--csv",
                          str(tmp_path / "r.csv")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=err, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().startswith("# ncclpy bench")
        p.stdout.close()                                          # head -1 has what it wants
        rc = p.wait(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err.seek(0)
    assert err.read() == "" and rc == 141
