"""The ncclpy exception hierarchy.

Every error ncclpy raises derives from :class:`NcclpyError`.  Argument errors are also
``ValueError``/``TypeError`` so generic handlers keep working; NCCL result codes map to one
class each so callers can catch exactly what they expect.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

__all__ = [
    "as_int",
    "NcclpyError", "ArgumentError", "ArgumentTypeError", "UnsupportedError", "VersionError",
    "MissingDependencyError", "CudaUnavailableError", "RendezvousError", "LaunchError",
    "ProcessRaisedException",
    "StoreError", "StoreTimeout", "StoreConnectionError", "StoreAuthError", "StoreProtocolError",
    "StoreRequestError",
    "NcclError", "NcclUnhandledCudaError", "NcclSystemError", "NcclInternalError",
    "NcclInvalidArgument", "NcclInvalidUsage", "NcclRemoteError", "NcclInProgress",
    "NcclTimeoutError", "nccl_error_from_code", "NCCL_RESULT_NAMES",
    "CallMismatchError", "CallCheckTimeout", "CommAbortedError", "EnvironmentMismatchError",
    "NotLaunchedError", "CannotPredict", "PinError",
]


class NcclpyError(Exception):
    """Base class of every error raised by ncclpy."""


class ArgumentError(NcclpyError, ValueError):
    """A bad argument value: the message names the argument, what was given, what was expected."""


class ArgumentTypeError(NcclpyError, TypeError):
    """An argument of the wrong type (e.g. not a buffer, not a stream)."""


class UnsupportedError(ArgumentError):
    """A valid request that NCCL (or this NCCL version) cannot do, e.g. BAND, int16, AVG on bool."""


class VersionError(NcclpyError, RuntimeError):
    """The loaded NCCL (or CuPy) is too old for the requested function."""


class MissingDependencyError(NcclpyError, ImportError):
    """CuPy or NCCL is not installed; the message names the pip extra to install."""


class CudaUnavailableError(NcclpyError, RuntimeError):
    """No usable CUDA device or driver for a communicator; the message gives the reason in the
    words of ``ncclpy info`` (no CUDA driver, no GPU visible, CuPy missing, the CUDA error)."""


class RendezvousError(NcclpyError, RuntimeError):
    """Rank / world size / store address could not be resolved, or the uid exchange failed."""


class LaunchError(NcclpyError, RuntimeError):
    """The launcher or spawn could not start or keep its ranks."""


class ProcessRaisedException(LaunchError):
    """A child started by :func:`ncclpy.spawn` raised; carries its rank and formatted traceback
    (``message``: one line said instead of the traceback, for a known mistake)."""

    def __init__(self, rank: int, exitcode: Optional[int], tb: str,
                 message: Optional[str] = None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = tb
        super().__init__(message or
                         f"rank {rank} raised an exception (exit code {exitcode}):\n{tb}")


class StoreError(NcclpyError, RuntimeError):
    """Base class of TCP store errors."""


class StoreTimeout(StoreError, TimeoutError):
    """A store call did not complete in time; names key, address and seconds waited."""


class StoreConnectionError(StoreError, ConnectionError):
    """The store server could not be reached or the connection broke."""


class StoreAuthError(StoreError, PermissionError):
    """The store rejected this client's token (or the client gave none)."""


class StoreProtocolError(StoreError):
    """A malformed frame was received."""


class StoreRequestError(StoreError):
    """The server refused a well-formed request (e.g. key or value over the size limit)."""


class CallMismatchError(NcclpyError, RuntimeError):
    """Checked mode: the ranks' calls do not match (raised on every rank before NCCL is called).

    The message is a table, one line per rank with its sequence number and call, differing
    fields marked ``*field=value*``.  ``table``: rank -> fingerprint (None: never arrived);
    ``problems``: one line per problem found.
    """

    def __init__(self, message: str, *, table: Any = None, problems: Any = ()) -> None:
        super().__init__(message)
        self.table = table
        self.problems = list(problems)


class CallCheckTimeout(CallMismatchError, TimeoutError):
    """Checked mode: a rank never arrived at the check within the communicator's timeout;
    ``missing`` lists those ranks."""

    def __init__(self, message: str, *, table: Any = None, problems: Any = (),
                 missing: Any = ()) -> None:
        super().__init__(message, table=table, problems=problems)
        self.missing = list(missing)


class EnvironmentMismatchError(NcclpyError, RuntimeError):
    """Checked mode, at init: the ranks differ in something that changes NCCL's behaviour (its
    version, the Config, NCCL_ALGO, NCCL_PROTO, a transport switch...); raised on every rank
    before NCCL is called.  ``errors`` and ``notes`` (the differences that do not matter): one
    line each, naming the ranks and their values (:mod:`ncclpy.debug.agree`)."""

    def __init__(self, message: str, *, errors: Any = (), notes: Any = ()) -> None:
        super().__init__(message)
        self.errors, self.notes = list(errors), list(notes)


class NotLaunchedError(NcclpyError, RuntimeError):
    """The call was made inside ``group(simulate=True)``: NCCL only estimated its time
    (``ncclGroupSimulateEnd``) and never launched it, so its Work has no result to wait for."""


class PinError(ArgumentError):
    """An NCCL environment variable NCCL refuses (NCCL_ALGO / NCCL_PROTO it cannot parse), or a
    call NCCL would refuse for it ("no algorithm/protocol available"): NCCL's own words, with
    the variable (:mod:`ncclpy.order.pins`)."""


class CannotPredict(NcclpyError):
    """The reduction-order model (:mod:`ncclpy.order`) does not cover this configuration;
    ``str(e)`` says why (an unchecked NCCL version, an algorithm other than Ring/Tree, a
    missing log line, ...).  ``ncclpy order`` reports it as the verdict CANNOT_PREDICT: an
    answer with its reason, not a failure of any call."""


class CommAbortedError(NcclpyError, RuntimeError):
    """The watchdog aborted the communicator (a call exceeded the timeout, or a peer died).

    Attributes: ``collective`` and ``seq`` (the oldest unfinished call and its sequence number
    on this communicator), ``suspects`` (ranks suspected: dead, or silent), ``reason``.
    """

    def __init__(self, message: str, *, collective: str = "", seq: int = -1,
                 suspects: Any = (), reason: str = "") -> None:
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.suspects = list(suspects)
        self.reason = reason


NCCL_RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}


class NcclError(NcclpyError, RuntimeError):
    """An NCCL call returned a non-success result (one subclass per ``ncclResult_t``).

    Attributes: ``code`` (ncclResult_t), ``call`` (the NCCL function), ``last_error``
    (``ncclGetLastError`` text, possibly empty).
    """

    code: int = -1

    def __init__(self, code: int, call: str = "", last_error: str = "") -> None:
        self.code = code
        self.call = call
        self.last_error = last_error
        name = NCCL_RESULT_NAMES.get(code, f"ncclResult {code}")
        msg = f"{call or 'NCCL call'} failed: {name} ({code})"
        if last_error:
            msg += f": {last_error}"
        super().__init__(msg)


class NcclUnhandledCudaError(NcclError):
    """ncclUnhandledCudaError (1): a CUDA call inside NCCL failed."""

    code = 1


class NcclSystemError(NcclError):
    """ncclSystemError (2): a system call failed (socket, memory, shared memory, ...)."""

    code = 2


class NcclInternalError(NcclError):
    """ncclInternalError (3): an NCCL internal check failed (an NCCL bug or memory corruption)."""

    code = 3


class NcclInvalidArgument(NcclError):
    """ncclInvalidArgument (4): NCCL refused an argument value ncclpy let through."""

    code = 4


class NcclInvalidUsage(NcclError):
    """ncclInvalidUsage (5): the call sequence is wrong for NCCL (a programming error)."""

    code = 5


class NcclRemoteError(NcclError):
    """ncclRemoteError (6): a peer failed or exited, or the network broke."""

    code = 6


class NcclInProgress(NcclError):
    """ncclInProgress (7) where ncclpy could not wait for it (nonblocking communicators
    are polled until ready)."""

    code = 7


class NcclTimeoutError(NcclError):
    """ncclTimeout (8), and ncclpy's own bounded waits: ``Work.wait()``, ``barrier()``,
    nonblocking init/split/finalize not done within the communicator's timeout.  The
    communicator should then be aborted (``comm.abort()``)."""

    code = 8


_BY_CODE = {cls.code: cls for cls in (
    NcclUnhandledCudaError, NcclSystemError, NcclInternalError, NcclInvalidArgument,
    NcclInvalidUsage, NcclRemoteError, NcclInProgress, NcclTimeoutError)}


def nccl_error_from_code(code: int, call: str = "", last_error: str = "") -> NcclError:
    """Build the NcclError subclass for ``code`` (unknown codes give a plain NcclError)."""
    return _BY_CODE.get(int(code), NcclError)(int(code), call, last_error)


#: the largest pointer or size_t NCCL takes (64 bits); ctypes wraps anything larger silently
U64_MAX = (1 << 64) - 1
#: the largest int64_t
I64_MAX = (1 << 63) - 1


def as_int(label: str, value: Any, minimum: Optional[int] = None,
           maximum: Optional[int] = None) -> int:
    """``value`` as a Python int (``operator.index``; bools and None refused), >= ``minimum``
    and <= ``maximum`` (where given).

    The one integer-argument check of the package, so every message reads the same:
    "LABEL must be an int, got VALUE (TYPE)" / "LABEL is V; expected an int >= MINIMUM".
    """
    if isinstance(value, bool) or value is None:
        raise ArgumentTypeError(f"{label} must be an int, got {value!r} "
                                f"({type(value).__name__})")
    try:
        v = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{label} must be an int, got {value!r} "
                                f"({type(value).__name__})") from None
    if minimum is not None and v < minimum:
        raise ArgumentError(f"{label} is {v}; expected an int >= {minimum}")
    if maximum is not None and v > maximum:
        raise ArgumentError(f"{label} is {v}; expected an int <= {maximum}"
                            + (" (it must fit 64 bits: ctypes would wrap it silently)"
                               if maximum in (U64_MAX, I64_MAX) else ""))
    return int(v)
