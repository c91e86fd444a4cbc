"""``ncclpy check`` as one rank of a launched job: what it read, said at once, and a failure to
meet its peers in one line.

With ``RANK`` and ``WORLD_SIZE`` in the environment the check runs as that rank and meets the
others through torch's store at ``MASTER_ADDR:MASTER_PORT``.  Those variables are often left
over from another job (a shell that ran torchrun), and then the check would wait silently for
peers that never come and end in torch's traceback.  So: :func:`announce` is the first line on
stderr (rank r of N, under which launcher, the variables read, how long it waits);
:func:`from_env` and :func:`store_problem` refuse malformed or missing variables before
anything starts; :func:`rendezvous_failure` turns torch's store errors into one line (what it
waited for, for how long, what to do), and :func:`held_stderr` keeps torch's C++ log of the
wait (a C++ stack per connection retry) off the screen unless the setup goes on.  No torch
import here: the CLI reads this first.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Iterator, Mapping, Optional, Tuple

__all__ = ["Launched", "from_env", "announce", "store_problem", "rendezvous_failure",
           "held_stderr", "Held", "JOB_VARS", "STORE_VARS", "UNSET_HINT"]

#: both set: the check runs as one rank of a launched job
JOB_VARS = ("RANK", "WORLD_SIZE")
#: where torch's store lives (torch's ``env://`` rendezvous)
STORE_VARS = ("MASTER_ADDR", "MASTER_PORT")
_READ = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") + STORE_VARS
#: a launcher's own variable -> its name (neither set: the variables may be left over)
_LAUNCHERS = (("NCCLPY_RANK", "ncclpy run"), ("TORCHELASTIC_RUN_ID", "torchrun"))
UNSET_HINT = ("unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to let ncclpy check start "
              "its own ranks")


@dataclass(frozen=True)
class Launched:
    """This process's place in a launched job, as the environment says."""

    rank: int
    world_size: int
    launcher: str                    # "ncclpy run", "torchrun" or "" (no launcher's own var)
    read: Dict[str, str] = field(default_factory=dict)   # the variables read, as set

    @property
    def store(self) -> Tuple[str, str]:
        """(MASTER_ADDR, MASTER_PORT) as set ('' when unset)."""
        return self.read.get("MASTER_ADDR", ""), self.read.get("MASTER_PORT", "")

    def to_cfg(self) -> Dict[str, object]:
        """A plain dict for the run's configuration."""
        return {"rank": self.rank, "world_size": self.world_size, "launcher": self.launcher,
                "read": dict(self.read)}


def from_env(env: Mapping[str, str]) -> Optional[Launched]:
    """The launched job ``env`` names (None: RANK or WORLD_SIZE unset, the check starts its own
    ranks).  ValueError with a one-line reason for a value that is not a rank of the job."""
    if not all(k in env for k in JOB_VARS):
        return None
    read = {k: env[k] for k in _READ if k in env}
    ws_text, rank_text = env["WORLD_SIZE"].strip(), env["RANK"].strip()
    tail = ("(RANK and WORLD_SIZE make ncclpy check one rank of a launched job; " + UNSET_HINT
            + ")")
    if not ws_text.isdigit() or int(ws_text) < 1:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']!r} in the environment is not a number "
                         f"of ranks; expected an integer >= 1 {tail}")
    n = int(ws_text)
    if not rank_text.isdigit() or int(rank_text) >= n:
        raise ValueError(f"RANK={env['RANK']!r} in the environment is not a rank of "
                         f"WORLD_SIZE={n}; expected an integer in 0..{n - 1} {tail}")
    who = next((name for var, name in _LAUNCHERS if env.get(var)), "")
    return Launched(int(rank_text), n, who, read)


def announce(job: Launched, timeout: float) -> str:
    """The first line on stderr: rank r of N, under what, the variables read, the wait."""
    seen = " ".join(f"{k}={v}" for k, v in job.read.items())
    addr, port = job.store
    if job.launcher:
        head = f"running as rank {job.rank} of {job.world_size} under {job.launcher} ({seen})"
        hint = ""
    else:
        head = (f"running as rank {job.rank} of {job.world_size} of a launched job: {seen} "
                f"set, by no launcher ncclpy knows (left over from another job?)")
        hint = f" ({UNSET_HINT})"
    wait = (f"; waiting up to {timeout:g} s for {_others(job.rank, job.world_size)} at "
            f"{addr or '?'}:{port or '?'}" if job.world_size > 1 else "")
    return f"ncclpy check: {head}{wait}{hint}"


def _others(rank: int, n: int) -> str:
    """'the other rank (RANK=1)', 'the other 3 ranks (RANK=0, 2, 3)'."""
    rest = [r for r in range(n) if r != rank]
    which = ", ".join(map(str, rest)) if len(rest) <= 8 else f"0..{n - 1} but {rank}"
    return f"the other rank (RANK={which})" if len(rest) == 1 else \
        f"the other {len(rest)} ranks (RANK={which})"


def store_problem(job: Launched) -> str:
    """Why torch's store cannot be reached as set ('' if it can be tried): MASTER_ADDR or
    MASTER_PORT unset, or a port that is not one."""
    addr, port = job.store
    missing = [k for k in STORE_VARS if not job.read.get(k, "").strip()]
    if missing:
        meets = "meets the other ranks through" if job.world_size > 1 else "still needs"
        return (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: rank "
                f"{job.rank} of {job.world_size} {meets} torch's store at "
                f"MASTER_ADDR:MASTER_PORT; set {' and '.join(missing)}, or {UNSET_HINT}")
    p = port.strip()
    if not p.isdigit() or not 1 <= int(p) <= 65535:
        return (f"MASTER_PORT={port!r} in the environment is not a port; expected an integer "
                f"in 1..65535, or {UNSET_HINT}")
    return ""


def _ranks(k: int) -> str:
    return f"{k} rank" + ("" if k == 1 else "s")


def _torch_line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    return f"{type(e).__name__}: {first}"[:300]


def _is_rendezvous_error(e: BaseException) -> bool:
    """A failure of torch's store or ``env://`` rendezvous (not of a collective)."""
    try:
        import torch.distributed as dist
        if isinstance(e, getattr(dist, "DistError", ())):
            return True
    except Exception:  # noqa: BLE001 - no torch.distributed: no torch error either
        return False
    text = str(e)
    return isinstance(e, (ValueError, RuntimeError)) and (
        "rendezvous" in text or "MASTER_ADDR" in text or "MASTER_PORT" in text)


def rendezvous_failure(e: BaseException, rank: int, world_size: int, timeout: float,
                       launched: Optional[Mapping[str, object]] = None) -> Optional[str]:
    """One line for torch failing to meet the peers (``init_process_group``'s store), or None
    when ``e`` is something else (then it is raised as before).  ``launched``: the job's
    :meth:`Launched.to_cfg` when the check runs under a launcher (it then says what to do)."""
    if not _is_rendezvous_error(e):
        return None
    if not launched:
        return (f"rank {rank} of {world_size} could not meet the other ranks within "
                f"{timeout:g} s ({_torch_line(e)})")
    read = dict(launched.get("read") or {})        # type: ignore[arg-type]
    addr, port = read.get("MASTER_ADDR", "?"), read.get("MASTER_PORT", "?")
    where = f"{addr}:{port}"
    if "in use" in str(e).lower():
        return (f"rank {rank} of {world_size} could not open torch's store at {where} "
                f"(MASTER_ADDR:MASTER_PORT): the port is in use ({_torch_line(e)}); set another "
                f"MASTER_PORT on every rank, or {UNSET_HINT}")
    if world_size == 1:
        return (f"rank 0 of 1 could not set up torch's store at {where} (MASTER_ADDR:"
                f"MASTER_PORT) within {timeout:g} s ({_torch_line(e)}); {UNSET_HINT}")
    others = _others(rank, world_size)
    return (f"rank {rank} of {world_size} did not meet {others} at {where} (--timeout "
            f"{timeout:g} s; {_torch_line(e)}); start {others} with WORLD_SIZE="
            f"{world_size} MASTER_ADDR={addr} MASTER_PORT={port}, or {UNSET_HINT}")


class Held:
    """What :func:`held_stderr` does with the text it held: ``keep`` (write it back) or not."""

    keep: bool = True


@contextlib.contextmanager
def held_stderr() -> Iterator[Held]:
    """File descriptor 2 into a temporary file for the block (torch meeting its peers): torch's
    store client logs each failed connection with a C++ stack, at the C++ level.  The text is
    written back afterwards unless the block set ``keep = False`` (its one line says it all);
    an exception out of the block always writes it back."""
    held = Held()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):          # no usable stderr: nothing to hold
        yield held
        return
    tmp = tempfile.TemporaryFile()
    os.dup2(tmp.fileno(), 2)
    ok = False
    try:
        yield held
        ok = True
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        if held.keep or not ok:
            tmp.seek(0)
            data = tmp.read()
            try:
                if data:
                    os.write(2, data)
            except OSError:
                pass
        tmp.close()
