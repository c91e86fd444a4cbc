"""The ``ncclpy`` command line: dispatch, help, version, ``check`` pass-through."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import ncclpy
from ncclpy.cli import build_parser, main
from sigint_util import popen_kwargs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def _run(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "ncclpy", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_version():
    cp = _run("--version")
    assert cp.returncode == 0 and cp.stdout.strip() == f"ncclpy {ncclpy.__version__}"


def test_help_lists_subcommands():
    cp = _run("--help")
    assert cp.returncode == 0
    for cmd in ("run", "info", "check"):
        assert cmd in cp.stdout


def test_no_command_prints_help_and_fails():
    cp = _run()
    assert cp.returncode == 2 and "usage: ncclpy" in cp.stderr


def test_unknown_command():
    cp = _run("frobnicate")
    assert cp.returncode == 2 and "invalid choice" in cp.stderr


def test_run_help_shows_torchrun_names():
    cp = _run("run", "--help")
    assert cp.returncode == 0
    for flag in ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank",
                 "--master-addr", "--master-port", "--ranks-per-gpu", "--no-prefix", "--grace",
                 "-m"):
        assert flag in cp.stdout


def test_run_requires_n():
    with pytest.raises(SystemExit) as e:
        main(["run", "prog.py"])
    assert e.value.code == 2


def test_run_parses_remainder_untouched():
    ns = build_parser().parse_args(["run", "-n", "2", "--no-prefix", "-m", "pkg.mod", "-n", "5",
                                    "--grace", "x"])
    assert ns.nproc == 2 and ns.no_prefix and ns.module
    assert ns.program == ["pkg.mod", "-n", "5", "--grace", "x"]


def test_info_json_in_process(capsys):
    assert main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ncclpy"] == ncclpy.__version__


def test_check_dispatches_lazily_with_all_arguments(monkeypatch):
    seen = []
    pkg = types.ModuleType("ncclpy.check")
    pkg.__path__ = []
    mod = types.ModuleType("ncclpy.check.cli")
    mod.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "ncclpy.check", pkg)
    monkeypatch.setitem(sys.modules, "ncclpy.check.cli", mod)
    assert main(["check", "--help", "all_reduce", "-n", "2"]) == 7
    assert seen == [["--help", "all_reduce", "-n", "2"]]


def test_check_missing_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ncclpy.check.cli", None)   # import raises ImportError
    assert main(["check", "x"]) == 2
    assert "ncclpy check: not available" in capsys.readouterr().err


def test_import_ncclpy_cli_is_light():
    code = ("import sys, ncclpy.cli, ncclpy.launch.launcher, ncclpy.launch.placement, "
            "ncclpy.info; print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "[]"


def test_console_script_entry_point_resolves():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    mod, _, fn = scripts["ncclpy"].partition(":")
    import importlib
    assert getattr(importlib.import_module(mod), fn) is main


# -- one-line usage errors, Ctrl-C and closed pipes (ncclpy.cli_util) --------------------------
@pytest.mark.parametrize("args, line", [
    (["frobnicate"], "ncclpy: error: COMMAND: invalid choice: 'frobnicate'"),
    (["info", "--bogus"], "ncclpy info: error: unrecognized arguments: --bogus"),
    (["run", "--nproc-per-node", "abc", "x.py"],
     "ncclpy run: error: --nproc-per-node: invalid int value: 'abc'"),
    (["run", "--nproc_per_node=two", "x.py"],
     "ncclpy run: error: --nproc_per_node: invalid int value: 'two'"),
    (["run", "--grace", "x", "-n", "1", "x.py"], "ncclpy run: error: --grace: invalid float value"),
    (["info", "--jsn"], "ncclpy info: error: unrecognized arguments: --jsn (see 'ncclpy info -h')"),
    (["plan", "all_reduce", "--cnt", "3"],
     "ncclpy plan: error: unrecognized arguments: --cnt 3 (see 'ncclpy plan -h')"),
])
def test_usage_errors_are_one_line_naming_the_flag_as_typed(args, line):
    cp = _run(*args)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    assert cp.stderr.count("\n") == 1 and cp.stderr.startswith(line), cp.stderr


def test_typed_flag_finds_the_spelling_used():
    from ncclpy.cli_util import typed_flag
    names = ["-n", "--nprocs"]
    assert typed_flag(names, ["-n", "3"]) == "-n"
    assert typed_flag(names, ["-n3"]) == "-n"
    assert typed_flag(names, ["--nproc", "3"]) == "--nproc"          # an abbreviation
    assert typed_flag(names, ["--nprocs=3"]) == "--nprocs"
    assert typed_flag(names, ["--", "-n"]) == "--nprocs"              # after --: not a flag
    assert typed_flag(names, []) == "--nprocs"


def test_closed_pipe_from_elsewhere_is_not_silenced():
    """An EPIPE that is not stdout's (a socket to a dead peer) is a real error: it is raised,
    not turned into the quiet exit of a closed output pipe."""
    code = ("from ncclpy.cli_util import run_cli\n"
            "def body():\n"
            "    raise BrokenPipeError(32, 'Broken pipe (a socket)')\n"
            "run_cli('prog', body)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 1 and "BrokenPipeError" in cp.stderr and "a socket" in cp.stderr


def test_ctrl_c_in_a_command_is_one_line_and_130():
    code = ("import os, signal\n"
            "from ncclpy.cli_util import run_cli\n"
            "def body():\n"
            "    print('partial', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    return 0\n"
            "raise SystemExit(run_cli('prog', body))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=60, **popen_kwargs())
    assert cp.returncode == 130 and cp.stderr == "prog: interrupted\n" and cp.stdout == "partial\n"
