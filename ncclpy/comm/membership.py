"""Changing who is in a communicator: revoke, shrink, grow (NCCL 2.27-2.29), and recovery.

A mixin of :class:`ncclpy.Communicator`.

* ``revoke()`` (2.28.7, ``ncclCommRevoke``): stop every operation in flight, locally; the
  communicator becomes ``revoked`` (every call but shrink, split, close and abort is refused
  with the revoke's CommAbortedError) once NCCL says it is quiescent.  A thread blocked in a
  call gets that error too.
* ``shrink(exclude, abort=False)`` (2.27, ``ncclCommShrink``): a new communicator of the ranks
  not excluded, renumbered in order; every surviving rank calls it with the same list.
  ``abort=True`` (``NCCL_SHRINK_ABORT``) first terminates the parent's operations (a parent
  that was not revoked); the parent is then revoked.
* ``grow_unique_id()`` / ``grow(world_size, uid)`` (2.29, ``ncclCommGetUniqueId`` /
  ``ncclCommGrow``) on the existing ranks and :func:`ncclpy.grow_join` on the new ones: a new,
  larger communicator.  One existing rank makes the id and hands it to the new ranks (any
  channel: the store, MPI); the other existing ranks pass none.  ``ncclpy.grow_join`` (in
  :mod:`ncclpy.comm.startup`, beside ``init``) is this mixin's ``_grow_join`` on Communicator.

Children are independent Communicators (no watchdog, no checked mode), closed on their own --
before their parent.  A revoked parent (or one shrunk with ``abort=True``) is closed with
``ncclCommAbort``: NCCL forbids finalizing it, and its destroy waits in a barrier for ranks
that may be dead (NCCL 2.31's intra-node destroy barrier has no timeout), which ncclpy never
risks.

The recovery recipe (docs/reference/concepts/recovery.rst): ``comm.on_failure = "revoke"``
makes the watchdog revoke instead of abort; its CommAbortedError names the suspects; every
survivor calls ``comm.shrink(exclude=err.suspects)`` and carries on with the child.  Before
``ncclCommShrink`` the survivors agree through the store that each can shrink
(:mod:`ncclpy.comm.shrinkvote`): NCCL refuses a parent whose async error is set, and the
others would wait for the refused rank for ever.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Optional, Sequence

from .._nccl.flags import REVOKE_DEFAULT, SHRINK_ABORT, SHRINK_DEFAULT
from .._nccl.functions import UniqueId
from .._nccl.lib import NCCL_IN_PROGRESS, require_version
from ..errors import (ArgumentError, ArgumentTypeError, CommAbortedError, NcclError,
                      NcclpyError, NcclTimeoutError, as_int)
from .lifecycle import REVOKED, USABLE
from .shrinkvote import child_objects, survivors_ready

__all__ = ["CommMembership", "ON_FAILURE", "check_on_failure", "exclude_list"]

log = logging.getLogger(__name__)

#: what the watchdog does with a verdict
ON_FAILURE = ("abort", "revoke")


def check_on_failure(value: Any, what: str = "on_failure") -> str:
    if value not in ON_FAILURE:
        raise ArgumentError(f"{what}: expected 'abort' or 'revoke', got {value!r}")
    return str(value)


def _address(struct: Any) -> Optional[int]:
    """The ``const ncclConfig_t*`` argument: the struct's address (declared ``c_void_p``, as
    for ncclCommInitRankConfig), or NULL for the parent's config."""
    return None if struct is None else ctypes.addressof(struct)


def exclude_list(exclude: Any, rank: int, world_size: int) -> list:
    """``exclude`` checked: distinct ranks of the communicator, not this one, at least one
    (NCCL refuses an empty list: init.cc ncclCommShrink, ``excludeRanksCount > 0``)."""
    if isinstance(exclude, (str, bytes)) or not hasattr(exclude, "__iter__"):
        raise ArgumentTypeError(f"shrink: exclude: expected a list of ranks, got "
                                f"{type(exclude).__name__} {exclude!r}")
    ranks = [as_int("shrink: exclude[]", r, 0, world_size - 1) for r in exclude]
    if not ranks:
        raise ArgumentError("shrink: exclude: expected at least one rank to leave, got an "
                            "empty list (NCCL refuses it: ncclInvalidArgument); to copy a "
                            "communicator, use split()")
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise ArgumentError(f"shrink: exclude: rank(s) {dup} listed twice; expected distinct "
                            f"ranks")
    if rank in ranks:
        raise ArgumentError(f"shrink: exclude: lists this rank ({rank}); an excluded rank does "
                            f"not call shrink (it leaves; only the survivors call it)")
    return sorted(ranks)


class CommMembership:
    """revoke / shrink / grow of a Communicator (uses ``_lib``, ``_handle``, ``_life``,
    ``_nccl``, ``_timeout``, ``_nonblocking``, ``_config``, ``_device``, ``_resolver``)."""

    _lib: Any
    _handle: int
    _life: Any
    _nccl: Any
    _timeout: float
    _nonblocking: bool
    _config: Any
    _device: int
    _resolver: Any
    _on_failure: str
    _member_lock: Any
    name: str
    rank: int
    world_size: int
    _check_usable: Any
    _stop_watchdog: Any
    _wait_ready: Any
    _new_child: Any

    @property
    def on_failure(self) -> str:
        """The watchdog's action on a verdict, ``"abort"`` (the default, ncclCommAbort) or
        ``"revoke"`` (ncclCommRevoke, NCCL >= 2.28.7, which keeps the handle for shrink);
        also set by ``NCCLPY_ON_FAILURE``."""
        return self._on_failure

    @on_failure.setter
    def on_failure(self, value: str) -> None:
        value = check_on_failure(value)
        if value == "revoke":
            require_version("ncclCommRevoke", self._lib.version, self._lib.path)
        self._on_failure = value

    # -- revoke -------------------------------------------------------------------------------
    def revoke(self) -> None:
        """``ncclCommRevoke``: stop every operation in flight (local), then wait (within the
        timeout) until NCCL says the communicator is quiescent.  Idempotent."""
        if self._life.state is REVOKED:
            return
        require_version("ncclCommRevoke", self._lib.version, self._lib.path)
        self._revoke_now(CommAbortedError(
            f"the communicator ({self._life.owner}) was revoked by comm.revoke(); shrink it "
            f"to the survivors (comm.shrink) or close it", reason="revoked"))

    def _revoke_now(self, error: CommAbortedError) -> None:
        life = self._life
        busy = life.begin_revoke(error)
        if busy is None:
            if life.state is REVOKED:
                return
            raise life.refusal("revoke")
        self._resolver.clear()
        self._stop_watchdog(closed=False)
        rec = getattr(self, "_recorder", None)
        if rec is not None:
            rec.mark_aborted()
        # a revoke waiting for a call inside NCCL holds the member lock from now: a shrink
        # or close (``_settled``) waits for the revoke, never runs before it
        locked = bool(busy) and self._member_lock.acquire(timeout=self._timeout)
        if busy and life.defer_until_idle(lambda: self._revoke_call(locked)):
            log.warning("revoke of the communicator (%s): %s is still inside NCCL on another "
                        "thread; no two threads may be inside NCCL with one communicator, so "
                        "ncclCommRevoke waits until that call returns (every call but "
                        "shrink, split, close and abort is refused meanwhile)", life.owner,
                        busy)
            return
        self._revoke_call(locked)

    def _revoke_call(self, locked: bool = False) -> None:
        """ncclCommRevoke and its wait for quiescence, with no other thread inside NCCL
        (``locked``: the member lock was taken when the revoke was deferred)."""
        life = self._life
        if not locked:
            self._member_lock.acquire()  # shrink and close wait until it is quiescent
        try:
            with life.api:                # the call and its wait: no other call between
                self._revoke_steps()
        finally:
            self._member_lock.release()

    def _revoke_steps(self) -> None:
        life = self._life
        lib, h = self._lib, self._handle
        try:
            code = self._nccl("ncclCommRevoke", lib.ncclCommRevoke, h, REVOKE_DEFAULT,
                              states=(REVOKED,))
            lib.check(code, "ncclCommRevoke", h, in_progress_ok=True)
            self._quiescent("ncclCommRevoke")
        except BaseException:
            if life.state is not REVOKED:
                return                    # an abort took over (it is what ends the revoke)
            self.abort()                  # type: ignore[attr-defined]  # the only way left
            raise

    def _settled(self, what: str) -> None:
        """Wait (within the timeout) for a revoke in progress on another thread."""
        if not self._member_lock.acquire(timeout=self._timeout):
            raise NcclTimeoutError(8, what, f"a revoke of this communicator was still waiting "
                                            f"for NCCL to quiesce after {self._timeout:g} s")
        self._member_lock.release()

    def _quiescent(self, call: str) -> None:
        """Wait (``_wait_ready``: within the timeout) until NCCL says the revoked communicator
        is quiescent; an error it then reports (a dead peer's) is logged: the revoke itself
        is what was asked."""
        try:
            self._wait_ready(call, REVOKED)
        except NcclTimeoutError:
            raise
        except NcclError as e:
            log.info("%s: the communicator reports %s after the revoke", call, e)

    # -- shrink -------------------------------------------------------------------------------
    def shrink(self, exclude: Sequence[int], *, abort: bool = False,
               config: Any = None) -> Any:
        """``ncclCommShrink``: a new communicator of every rank not in ``exclude`` (ranks
        renumbered in order); collective over the survivors, who pass the same list.
        ``abort=True`` (NCCL_SHRINK_ABORT) terminates the parent's operations first (for a
        parent that was not revoked; it is revoked after).  ``config``: the child's
        :class:`~ncclpy.Config` (default: the parent's).  NCCL >= 2.27."""
        if not isinstance(abort, bool):
            raise ArgumentTypeError(f"shrink: abort: expected True or False, got {abort!r}")
        life = self._life
        self._settled("shrink")
        if life.state is not USABLE and life.state is not REVOKED:
            raise life.refusal("shrink")
        lib = self._lib
        require_version("ncclCommShrink", lib.version, lib.path)
        ranks = exclude_list(exclude, self.rank, self.world_size)
        struct = self._child_struct("shrink", config)   # (a bad config: before the vote)
        vote = survivors_ready(self, ranks, (REVOKED,))  # a refused survivor fails them all
        cfg = _address(struct)
        if abort and life.state is USABLE:
            life.begin_revoke(CommAbortedError(
                f"the communicator ({life.owner}) was shrunk with abort=True: NCCL terminated "
                f"its operations; use the child, and close this one", reason="revoked"))
            self._resolver.clear()
            self._stop_watchdog(closed=False)
        arr = (ctypes.c_int * max(len(ranks), 1))(*ranks)
        flags = SHRINK_ABORT if abort else SHRINK_DEFAULT
        tag = "shrink-" + "-".join(map(str, ranks)) if ranks else "shrink"
        child = self._make_child("ncclCommShrink", f"{self.name}/{tag}", config, struct,
                                 lambda slot: lib.ncclCommShrink(
                                     self._handle, arr, len(ranks), ctypes.byref(slot),
                                     cfg, flags))
        child_objects(self, child, vote)
        return child

    # -- grow ---------------------------------------------------------------------------------
    def grow_unique_id(self) -> bytes:
        """``ncclCommGetUniqueId`` (NCCL >= 2.29): the id of the next grow, made by one
        existing rank and handed to the new ranks (and passed to its own ``grow``)."""
        self._check_usable("grow_unique_id")
        lib = self._lib
        require_version("ncclCommGetUniqueId", lib.version, lib.path)
        uid = UniqueId()
        lib.check(self._nccl("ncclCommGetUniqueId", lib.ncclCommGetUniqueId, self._handle,
                             ctypes.byref(uid)), "ncclCommGetUniqueId", self._handle)
        return uid.to_bytes()

    def grow(self, world_size: int, uid: Optional[bytes] = None, *, config: Any = None) -> Any:
        """``ncclCommGrow`` on an existing rank: the new communicator of ``world_size`` ranks
        (this one keeps its rank).  The rank that made the id with :meth:`grow_unique_id`
        passes it; the other existing ranks pass None.  NCCL >= 2.29."""
        self._check_usable("grow")
        lib = self._lib
        require_version("ncclCommGrow", lib.version, lib.path)
        n = as_int("grow: world_size", world_size, self.world_size + 1)
        uid_p = None
        if uid is not None:
            from .._nccl.dispatch import uid_bytes
            holder = UniqueId.from_bytes(uid_bytes(uid))
            uid_p = ctypes.byref(holder)
        struct = self._child_struct("grow", config)
        cfg = _address(struct)
        return self._make_child("ncclCommGrow", f"{self.name}/grow{n}", config, struct,
                                lambda slot: lib.ncclCommGrow(self._handle, n, uid_p, -1,
                                                              ctypes.byref(slot), cfg))

    # -- children -----------------------------------------------------------------------------
    def _child_struct(self, what: str, config: Any) -> Any:
        if config is None:
            return None
        from .._nccl.config import Config
        if not isinstance(config, Config):
            raise ArgumentTypeError(f"{what}: config: expected an ncclpy.Config or None, got "
                                    f"{type(config).__name__}")
        return config.to_struct(self._lib.version)

    def _make_child(self, call: str, name: str, config: Any, struct: Any, fn: Any) -> Any:
        """``fn(slot)`` (an NCCL call writing ``*newcomm``) through ``_new_child``, then the
        child wrapped (its config kept alive with it)."""
        from .._nccl.cuda import cuda
        with cuda().device(self._device):
            handle, nonblocking = self._new_child(call, fn, (REVOKED,))
        if not handle:
            raise NcclpyError(f"{call} returned no communicator for this rank")
        child_cfg = config if config is not None else self._config
        return type(self)._wrap(self._lib, handle, None, self._device,  # type: ignore
                                child_cfg, nonblocking, self._timeout, name, call, struct)

    @classmethod
    def _grow_join(cls, world_size: int, rank: int, uid: bytes, *,
                   device: Optional[int] = None, config: Any = None,
                   timeout: Optional[float] = None, name: str = "grown") -> Any:
        """:func:`ncclpy.grow_join`'s work, wrapped in ``cls`` (the caller hands the class in,
        as ``type(self)`` does for the children above: this module never imports
        communicator.py, which imports it -- issue 37)."""
        from .._nccl.config import Config, effective_nonblocking
        from .._nccl.cuda import cuda
        from .._nccl.dispatch import uid_bytes
        from .._nccl.lib import get_lib
        from ..debug.watchdog import default_timeout
        lib = get_lib()
        require_version("ncclCommGrow", lib.version, lib.path)
        n = as_int("grow_join: world_size", world_size, 2)
        r = as_int("grow_join: rank", rank, 1, n - 1)
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(f"grow_join: config: expected an ncclpy.Config or None, "
                                    f"got {type(config).__name__}")
        holder = UniqueId.from_bytes(uid_bytes(uid))
        struct = None if config is None else config.to_struct(lib.version)
        dev = cuda().get_device() if device is None else as_int("grow_join: device", device, 0)
        slot = ctypes.c_void_p(0)
        with cuda().device(dev):
            code = lib.ncclCommGrow(None, n, ctypes.byref(holder), r, ctypes.byref(slot),
                                    _address(struct))
        lib.check(code, "ncclCommGrow", None, in_progress_ok=True)
        nonblocking = code == NCCL_IN_PROGRESS or effective_nonblocking(config, lib.version)
        if not slot.value:
            raise NcclpyError("ncclCommGrow returned no communicator for this new rank")
        return cls._wrap(lib, slot.value, None, dev, config, nonblocking,  # type: ignore
                         default_timeout(timeout), name, "ncclCommGrow", struct)
