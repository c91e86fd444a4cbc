"""What every ncclpy command line shares: one-line usage errors, Ctrl-C and closed pipes.

* :class:`OneLineParser`: an ``argparse.ArgumentParser`` whose errors are one line,
  ``<prog>: error: <flag as the user typed it>: <what was wrong>``, exit status 2, no usage
  block and no traceback.  :meth:`OneLineParser.flag` gives the spelling the user typed for an
  option (``-n``, ``--nprocs`` or an abbreviation such as ``--nproc``), for errors found after
  parsing.
* :func:`run_cli`: runs a command's body; Ctrl-C ends it with one line and exit status 130, a
  closed standard output (``ncclpy check | head -3``) ends it quietly with exit status 141
  (128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe); :func:`run_main`
  also turns a usage error's ``SystemExit`` into the status ``main(argv)`` returns.
* :func:`int_at_least` (an argparse type) and :func:`check_output_path` (an output file is
  checked before anything runs, and no directory is made): the checks every tool shares.

Library code never prints; these helpers are for the command-line modules only.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import select
import sys
import tempfile
from typing import Callable, List, NoReturn, Optional, Sequence, TextIO

__all__ = ["OneLineParser", "run_cli", "run_main", "typed_flag", "silence_stdout",
           "is_closed_pipe", "stdout_reader_gone", "int_at_least", "check_output_path",
           "exit_status", "EXIT_INTERRUPTED", "EXIT_CLOSED_PIPE"]

#: exit status after Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130
#: exit status when standard output was closed by the reader (128 + SIGPIPE)
EXIT_CLOSED_PIPE = 141


def typed_flag(option_strings: Sequence[str], argv: Sequence[str],
               others: Sequence[str] = ()) -> str:
    """The spelling of an option the user typed in ``argv`` (exact, ``--name=value``, an
    abbreviation argparse accepted, or ``-nVALUE``); the longest name when none is found.
    ``others``: the parser's other options, never taken for an abbreviation of this one
    (``--device`` is not ``--device_cta_count``)."""
    longs = [o for o in option_strings if o.startswith("--")]
    shorts = [o for o in option_strings if len(o) == 2 and o[0] == "-" and o[1] != "-"]
    for tok in argv:
        if tok == "--":
            break
        name = tok.split("=", 1)[0]
        if name in option_strings:
            return name
        if name in others:
            continue
        if name.startswith("--") and len(name) > 2 and any(o.startswith(name) for o in longs):
            return name
        if not tok.startswith("--"):
            for s in shorts:
                if tok.startswith(s):
                    return s
    return max(option_strings, key=len) if option_strings else ""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the flag as the user typed it."""

    _argv: List[str]

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def flag(self, dest: str) -> str:
        """The option of destination ``dest`` as the user typed it (else its longest name)."""
        for a in self._actions:
            if a.dest == dest and a.option_strings:
                others = [o for b in self._actions if b is not a for o in b.option_strings]
                return typed_flag(a.option_strings, getattr(self, "_argv", []), others)
        return dest

    def _rename(self, message: str) -> str:
        """argparse's ``argument -n/--nprocs: ...`` -> ``--nprocs: ...`` (the typed spelling)."""
        m = re.match(r"argument (\S+): (.*)", message, re.S)
        if not m:
            return message
        names = m.group(1).split("/")
        if all(n.startswith("-") for n in names):
            others = [o for a in self._actions for o in a.option_strings if o not in names]
            return f"{typed_flag(names, getattr(self, '_argv', []), others)}: {m.group(2)}"
        return f"{m.group(1)}: {m.group(2)}"

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` on one line and exit with status 2."""
        text = " ".join(self._rename(str(message)).split())
        self.exit(2, f"{self.prog}: error: {text} (see '{self.prog} -h')\n")

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        if message:
            try:
                sys.stderr.write(message)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        raise SystemExit(status)


def is_closed_pipe(e: BaseException) -> bool:
    """Whether ``e`` is EPIPE *and* standard output's reader has gone (an EPIPE from a socket
    to a dead peer is a real error, never silenced)."""
    if not (isinstance(e, BrokenPipeError) or (isinstance(e, OSError)
                                               and e.errno == errno.EPIPE)):
        return False
    return stdout_reader_gone()


def stdout_reader_gone(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default standard output) is a pipe or socket whose reading end is
    closed (poll reports POLLERR/POLLHUP; never true for a file or a live terminal)."""
    stream = sys.stdout if stream is None else stream
    if stream is None or getattr(stream, "closed", False):
        return True
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False       # no descriptor (replaced by a StringIO): cannot tell, say no
    try:
        p = select.poll()
        p.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):   # no poll(): trust the EPIPE
        return True


def silence_stdout() -> None:
    """Point standard output at /dev/null, so that nothing (not even the interpreter's final
    flush) writes to a pipe whose reader has gone."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run a command's ``body`` as command-line tools behave: its exit status; Ctrl-C ->
    ``<prog>: interrupted`` on stderr and 130; a closed stdout -> quiet, 141."""
    try:
        rc = body()
        sys.stdout.flush()        # a closed pipe shows here for output still buffered
        return int(rc or 0)
    except KeyboardInterrupt:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            silence_stdout()
        try:
            sys.stderr.write(f"{prog}: interrupted\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        return EXIT_INTERRUPTED
    except OSError as e:
        if not is_closed_pipe(e):
            raise
        silence_stdout()
        return EXIT_CLOSED_PIPE


def run_main(prog: str, body: Callable[[], int]) -> int:
    """:func:`run_cli`, and a usage error's or ``--help``'s ``SystemExit`` as the exit status
    (2, 0): what every command's ``main(argv)`` returns instead of raising."""
    try:
        return run_cli(prog, body)
    except SystemExit as e:
        return exit_status(e)


def exit_status(e: SystemExit) -> int:
    """The status a ``SystemExit`` stands for (argparse: 2 for a usage error, 0 for help)."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def int_at_least(lo: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``; else "expected <what>, got <value>"."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    return parse


def check_output_path(path: str) -> str:
    """'' when ``path`` can be written (its directory exists and takes a new file, or the file
    exists and can be opened for writing), else why not.  Nothing is left behind, and no
    directory is made: every tool checks its output files this way before it starts."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{path!r} is a directory; expected a file name"
    parent = os.path.dirname(full) or "."
    if not os.path.isdir(parent):
        return f"cannot write {path!r}: directory {parent!r} does not exist"
    # Never the path itself for a new file: ranks of one launch check the same path at once,
    # and one rank's probe file made another's creation fail (EEXIST) or its open recreate it.
    try:
        fd = os.open(full, os.O_WRONLY | os.O_APPEND)   # an existing file; never creates one
        os.close(fd)
        return ""
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"cannot write {path!r}: {e.strerror or e}"
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".ncclpy-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write {path!r}: {e.strerror or e}"
    return ""
