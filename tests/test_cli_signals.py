"""Ctrl-C and closed pipes, as command-line tools handle them, on real subprocesses:
``ncclpy check`` (its spawned ranks included), ``ncclpy check --list``, ``ncclpy info`` and
``python -m bench``.  Ctrl-C: one line ``<prog>: interrupted``, exit status 130, no traceback, no
rank left running.  A reader that closes early (``| head``): nothing on stderr, exit status 141
(128 + SIGPIPE), the run stopped at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from sigint_util import popen_kwargs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _needs_torch() -> None:
    """check and bench run torch's gloo backend: those tests skip without torch (check --list,
    --list-skips and info run without it)."""
    pytest.importorskip("torch")


def _env() -> dict:
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "NCCLPY_CHECK_INJECT", "NCCLPY_RANK", "NCCLPY_WORLD_SIZE"):
        e.pop(k, None)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    return e


def _start(cmd: List[str], stderr, **env: str) -> subprocess.Popen:
    # a session of its own: a signal to its process group is what a terminal's Ctrl-C sends;
    # SIGINT's default disposition, however pytest was started (tests/sigint_util.py)
    return subprocess.Popen(cmd, cwd=ROOT, env={**_env(), **env}, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True, **popen_kwargs())


def _group_alive(pgid: int) -> List[str]:
    """Processes of process group ``pgid`` still running: zombies awaiting init, processes
    already tearing down (no command line left) and multiprocessing's resource tracker (it
    leaves by itself when the parent's pipe closes) excluded."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmd.strip() and "resource_tracker" not in cmd:
                out.append(f"{d.name}: {cmd[:200]}")
    return out


def _read_until(p: subprocess.Popen, needle: str) -> List[str]:
    lines = []
    for line in p.stdout:
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never printed: {''.join(lines)[-2000:]}")


CHECK = [sys.executable, "-m", "ncclpy", "check", "-n", "2"]


@pytest.mark.parametrize("to_group", [False, True], ids=["kill-INT-pid", "terminal-Ctrl-C"])
def test_ctrl_c_during_check_is_one_line_and_130(to_group, tmp_path):
    """SIGINT mid-run (after the header, while the cases run): the parent stops its ranks and
    says one line; with the terminal's group-wide Ctrl-C the ranks stay quiet too."""
    _needs_torch()
    err = open(tmp_path / "err", "w+")
    p = _start(CHECK, err)
    try:
        _read_until(p, "torch backend gloo:")    # the last header line: the cases run now
        if to_group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGINT)
        rest = p.stdout.read()
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err.seek(0)
    stderr = err.read()
    assert rc == 130, stderr
    assert stderr == "ncclpy check: interrupted\n", stderr
    assert " cases on 2 ranks" not in rest          # it was stopped mid-run
    assert _group_alive(p.pid) == []


def test_closed_pipe_stops_check_quietly(tmp_path):
    """``ncclpy check | head -3``: rank 0 notices the reader is gone and the run stops at once,
    quietly, with 141; no rank is left."""
    _needs_torch()
    err = open(tmp_path / "err", "w+")
    p = _start(CHECK, err)
    try:
        for _ in range(3):
            assert p.stdout.readline()
        p.stdout.close()                         # the reader goes away, as head does
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err.seek(0)
    assert err.read() == ""
    assert rc == 141
    assert _group_alive(p.pid) == []


@pytest.mark.parametrize("cmd", [
    ["-m", "ncclpy", "check", "--list"],
    ["-m", "ncclpy", "check", "--list-skips"],
    ["-m", "ncclpy", "info"],
    ["-m", "bench", "all_reduce", "-b", "8", "-e", "1M", "-f", "2", "-q"],
    ["-m", "bench", "all_reduce", "-b", "8", "-e", "1M", "-f", "2", "-q", "--nproc", "2"],
], ids=lambda c: " ".join(c[1:4]) + (" --nproc 2" if "--nproc" in c else ""))
def test_output_into_a_closed_pipe_is_quiet(cmd, tmp_path):
    """The reader closes before the command writes anything: no BrokenPipeError, nothing on
    stderr, exit status 141."""
    if cmd[1] == "bench":
        _needs_torch()
    r, w = os.pipe()
    os.close(r)
    with open(tmp_path / "err", "w+") as err:
        p = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), stdout=w, stderr=err,
                           timeout=150)
        os.close(w)
        err.seek(0)
        stderr = err.read()
    assert stderr == "", stderr
    assert p.returncode == 141


def test_ctrl_c_during_bench_is_one_line_and_130(tmp_path):
    _needs_torch()
    err = open(tmp_path / "err", "w+")
    p = _start([sys.executable, "-m", "bench", "all_reduce", "-b", "1M", "-e", "1M", "-n",
                "1000000", "-w", "0", "-q"], err, PYTHONUNBUFFERED="1")
    try:
        _read_until(p, "(elements)")             # the table's title: the sweep runs now
        os.killpg(p.pid, signal.SIGINT)
        p.stdout.read()
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err.seek(0)
    stderr = err.read()
    assert rc == 130 and stderr == "python -m bench: interrupted\n", stderr
