"""``Communicator``: every NCCL collective and point-to-point call on raw device buffers.

Creation: without a :class:`Config`, through CuPy's ``cupy.cuda.nccl.NcclCommunicator`` (inside
``cupy.cuda.Device(device)``); with one, or when ``NCCL_COMM_BLOCKING=0`` makes NCCL create every
communicator nonblocking, through ``ncclCommInitRankConfig`` bound with ctypes from the same
libnccl.  A nonblocking communicator (the effective mode, environment included:
:func:`ncclpy._nccl.config.effective_nonblocking`) is polled with ``ncclCommGetAsyncError``
until ready, within ``timeout``, after init and after each call.  Split and registration live
in :mod:`ncclpy.comm.extras`.  Each communicator builds, once, a dispatch table ``NCCL name ->
callable(*args, stream)`` (:mod:`ncclpy._nccl.dispatch`): CuPy's bound methods where CuPy wraps
the call and the communicator came from CuPy, ctypes functions on the raw ``ncclComm_t``
otherwise (AlltoAll, Gather, Scatter, and everything on a ctypes-created communicator).  NCCL
errors from either path become ncclpy's NcclError subclass with the code, the call and
``ncclGetLastError``'s text.

Each method: resolve (``ncclpy.comm.resolver``: parse the buffers, plan (pure,
``ncclpy.plan``) and pick the stream on the first call; a cached, never-stale result on a
repeated one), issue (``ncclpy.comm.execute.issue``) -> :class:`~ncclpy.comm.work.Work`.
``prepare`` resolves a call once for repeated use (``ncclpy.comm.prepared``).  Finalize,
abort, close and the lock that orders them with every call: ``ncclpy.comm.lifecycle``.
"""
from __future__ import annotations

import dataclasses
import logging
from hashlib import blake2b
import os
import threading
from typing import Any, Dict, List, Optional

from .._nccl.config import Config, effective_nonblocking, init_struct
from .._nccl.cuda import cuda
from .._nccl.dispatch import (build_dispatch, call_cupy, cupy_init, int_arg,
                             lib_group, require_device, uid_list)
from .._nccl.lib import NCCL_IN_PROGRESS, get_lib, require_version
from ..errors import ArgumentError, ArgumentTypeError, NcclError, NcclpyError
from .extras import CommExtras, Registration
from .lifecycle import USABLE, Lifecycle
from .teardown import CommLifecycle
from .._nccl.functions import FUNCTIONS
from .membership import CommMembership, check_on_failure
from .memory import CommMemory
from .rma import CommRMA
from .window import CommWindows
from .execute import group_scope, issue
from ..plan.types import PlanContext
from .prepared import Prepared
from .resolver import Resolver
from .simulate import check_simulate, simulated_group
from ..debug.nvtx import enabled as nvtx_enabled
from ..debug.nvtx import ranges as nvtx_ranges
from ..debug.recorder import trace_signal, buffer_size, for_comm
from ..debug.watchdog import default_timeout, env_flag
from .hot import make_hot
from ..debug.reaper import reaper
from .work import Work

__all__ = ["Communicator", "Config", "Registration", "group"]

log = logging.getLogger(__name__)
REVOKE_VERSION = FUNCTIONS["ncclCommRevoke"][2]


class Communicator(CommExtras, CommWindows, CommRMA, CommMembership, CommMemory,
                   CommLifecycle):
    """An NCCL communicator of ``world_size`` ranks; this process is ``rank`` on ``device``.
    Each call checks its arguments before NCCL (Argument*Error), enqueues on ``stream``
    (default: see :mod:`ncclpy.comm.streams`; CUDA-graph capture allowed) and returns a Work;
    NCCL failures raise NcclError subclasses, a closed one NcclpyError."""

    def __init__(self, world_size: int, rank: int, uid: Any, device: int,
                 config: Optional[Config] = None, *, timeout: Optional[float] = None) -> None:
        world_size = int_arg("world_size", world_size, 1)
        rank = int_arg("rank", rank, 0)
        if rank >= world_size:
            raise ArgumentError(f"rank: {rank} is out of range for world_size {world_size}; "
                                f"expected 0 <= rank < {world_size}")
        device = int_arg("device", device, 0)
        uids = uid_list(uid)         # several: ncclCommInitRankScalable (NCCL >= 2.23)
        uid = uids[0]
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(f"config: expected ncclpy.Config or None, got "
                                    f"{type(config).__name__}")
        timeout = default_timeout(timeout)
        trace = _trace_settings()      # bad settings, or NVTX asked for and missing: before NCCL
        lib = get_lib()
        if _on_failure_env() == "revoke":   # refused before NCCL makes a handle to leak
            require_version("ncclCommRevoke", lib.version, lib.path)
        # NCCL_COMM_BLOCKING=0 makes even a config-less communicator nonblocking: its init then
        # returns ncclInProgress, which CuPy cannot represent, so it is made through ctypes.
        nonblocking = effective_nonblocking(config, lib.version)
        cfg_struct = init_struct(config, lib.version)
        how = "ncclCommInitRank" if cfg_struct is None else "ncclCommInitRankConfig"
        if len(uids) > 1:
            how = "ncclCommInitRankScalable"
            if len(uids) > world_size:
                raise ArgumentError(f"uid: {len(uids)} unique ids for {world_size} ranks; "
                                    f"NCCL takes at most one per rank")
        if cfg_struct is not None or len(uids) > 1:
            require_version(how, lib.version, lib.path)
        require_device(device)
        nc = None
        code = 0
        with cuda().device(device):
            if len(uids) > 1:
                handle, code = lib.comm_init_rank_scalable(world_size, uids, rank, cfg_struct)
            elif cfg_struct is None:
                try:
                    code, nc = call_cupy(lib, "ncclCommInitRank", None, cupy_init,
                                         lib.cupy_nccl, world_size, uid, rank)
                except NcclError:
                    lib.repair_group_depth()
                    raise
                if nc is None:  # ncclInProgress: the environment changed under us
                    raise NcclpyError("ncclCommInitRank (through CuPy) returned ncclInProgress: "
                                      "NCCL made the communicator nonblocking (NCCL_COMM_BLOCKING"
                                      f"={os.environ.get('NCCL_COMM_BLOCKING')!r}) and CuPy "
                                      "cannot hand it back; set it before creating the "
                                      "communicator")
                handle = int(nc.comm)
            else:
                handle, code = lib.comm_init_rank_config(world_size, uid, rank, cfg_struct)
        self._setup(lib, handle, nc, rank, world_size, device, config, float(timeout),
                    cfg_struct, nonblocking)
        if nonblocking or code == NCCL_IN_PROGRESS:
            try:
                self._wait_ready(how)
            except BaseException:
                self.abort()
                raise
        lib.mark_seen()
        self._recorder = for_comm(self, blake2b(uid, digest_size=4).hexdigest(), *trace)

    @classmethod
    def from_bootstrap(cls, bs: Any, config: Optional[Config] = None, *,
                       timeout: Optional[float] = None, checked: Optional[bool] = None,
                       watchdog: Optional[bool] = None) -> "Communicator":
        """A communicator from an :class:`ncclpy.bootstrap.Bootstrap` hand-over.

        ``checked`` (default ``$NCCLPY_CHECKED``, off): first compare the ranks' NCCL, versions,
        NCCL_* settings and ``config`` (:mod:`ncclpy.debug.agree`: EnvironmentMismatchError
        before NCCL is called), then every call across ranks through the bootstrap's store
        before NCCL sees it (:mod:`ncclpy.checked`).
        ``watchdog`` (default ``$NCCLPY_WATCHDOG``, on): a daemon thread that aborts the
        communicator when a call outlives ``timeout`` or a peer dies (:mod:`ncclpy.watchdog`).
        """
        checked = env_flag("checked", checked, "NCCLPY_CHECKED", False)
        watchdog = env_flag("watchdog", watchdog, "NCCLPY_WATCHDOG", True)
        store = getattr(bs, "store", None)
        if checked and store is not None and bs.world_size > 1:   # before NCCL sees them
            from ..debug.agree import check_agreement
            check_agreement(store, bs.rank, bs.world_size,
                            f"ncclpy/{getattr(bs, 'name', 'default')}/"
                            f"{getattr(bs, 'generation', 0)}/agree",
                            default_timeout(timeout), config)
        comm = cls(bs.world_size, bs.rank, getattr(bs, "uids", None) or bs.uid, bs.device,
                   config, timeout=timeout)
        comm.bootstrap = bs
        comm.name = getattr(bs, "name", "default")
        if checked:
            from ..debug.checked import Checker
            comm._checker = Checker(store, comm.rank, comm.world_size, name=comm.name,
                                    prefix=f"ncclpy/{comm.name}/{getattr(bs, 'generation', 0)}"
                                           f"/chk", timeout=comm._timeout)
        if watchdog:
            from ..debug.watchdog import Watchdog
            comm._watchdog = Watchdog(comm, store).start()
        from .objects import ObjectExchange
        comm._objects = ObjectExchange(store, comm.rank, comm.world_size,
                                       f"ncclpy/{comm.name}/{getattr(bs, 'generation', 0)}/obj",
                                       comm._timeout)
        return comm

    @classmethod
    def _wrap(cls, lib: Any, handle: int, nc: Any, device: int, config: Optional[Config],
              nonblocking: bool, timeout: float, name: str, call: str = "ncclCommSplit",
              cfg_struct: Any = None) -> "Communicator":
        """A Communicator around an existing handle (split, shrink and grow children)."""
        obj = cls.__new__(cls)
        obj._setup(lib, handle, nc, 0, 1, device, config, timeout, cfg_struct, nonblocking)
        if nonblocking:
            try:
                obj._wait_ready(call)
            except BaseException:
                obj.abort()
                raise
        obj._rank = lib.comm_query("ncclCommUserRank", handle)
        obj._world_size = lib.comm_query("ncclCommCount", handle)
        obj._ctx = PlanContext(obj._rank, obj._world_size, device, lib.version)
        obj.name = name
        try:
            obj._recorder = for_comm(obj, blake2b(name.encode(), digest_size=4).hexdigest(),
                                     *_trace_settings())
        except BaseException:          # the environment changed since the parent's init
            obj.abort()
            raise
        return obj

    def _setup(self, lib: Any, handle: int, nc: Any, rank: int, world_size: int, device: int,
               config: Optional[Config], timeout: float, cfg_struct: Any,
               nonblocking: bool) -> None:
        self._lib = lib
        self._handle = handle
        self._nc = nc
        self._rank = rank
        self._world_size = world_size
        self._device = device
        self._config = config
        self._cfg_struct = cfg_struct        # NCCL may keep pointers to its strings
        self._nonblocking = bool(nonblocking)   # the mode NCCL gave it (env included)
        self._timeout = timeout
        # the resolver owns the planning context (``_ctx`` below) and the call cache
        self._resolver = Resolver(PlanContext(rank, world_size, device, lib.version),
                                  mode="nonblocking" if nonblocking else "blocking")
        self._life = Lifecycle(f"rank {rank} of 'default'")
        self._did_finalize = False
        self._captured_calls = 0             # calls issued while their stream captured
        self._premul_ops: set = set()
        self._registrations: Dict[int, Registration] = {}   # by Registration.id
        self._windows: Dict[int, Any] = {}   # open ncclpy.Window by id (comm/window.py)
        self._slots: List[Any] = []           # *win slots NCCL may still write (window.py)
        self._member_lock = threading.Lock()  # a revoke until quiescent (comm/membership.py)
        self._on_failure = _on_failure_env()
        if self._on_failure == "revoke" and lib.version < REVOKE_VERSION:
            self._on_failure = "abort"       # a child of an older NCCL (the parent was refused)
        self._allocations: Dict[int, int] = {}
        self._barrier_buf: Any = None
        self._checker: Any = None            # checked mode (ncclpy.checked.Checker)
        #: the tracker of issued Work: the watchdog's deque, else the process reaper's
        self._watch: Any = reaper().lane()
        self._captured_events: List[Any] = []   # Works of captured calls (events: close)
        self._watchdog: Any = None
        self._recorder: Any = None           # the flight recorder (ncclpy.debug.recorder)
        self._objects: Any = None            # broadcast_object / all_gather_object (objects.py)
        self.bootstrap: Any = None
        self._name = "default"
        self._dispatch = build_dispatch(self, lib, handle, nc)
        self._hot = make_hot(self)           # the fast path (ncclpy.comm.hot)

    # -- state ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The communicator's name (``ncclpy.init(name)``; split children add ``/split<c>``)."""
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = str(value)
        self._life.owner = f"rank {self._rank} of {self._name!r}"
        rec = getattr(self, "_recorder", None)
        if rec is not None:
            rec.comm_name = self._name

    @property
    def rank(self) -> int:
        """This process's rank in the communicator (``ncclCommUserRank`` for split children)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks (``ncclCommCount`` for split children)."""
        return self._world_size

    @property
    def device(self) -> int:
        """The CUDA device ordinal this rank uses."""
        return self._device

    @property
    def nccl_version(self) -> int:
        """The loaded NCCL's version code, e.g. 23203 for 2.32.3."""
        return self._lib.version

    @property
    def config(self) -> Optional[Config]:
        """The :class:`Config` it was created with, or None where NCCL's defaults apply."""
        return self._config

    @property
    def nonblocking(self) -> bool:
        """Whether NCCL made it nonblocking (``Config.blocking=False`` or NCCL_COMM_BLOCKING=0)."""
        return self._nonblocking

    @property
    def handle(self) -> int:
        """The raw ``ncclComm_t`` (0 once closed)."""
        return 0 if self._closed else self._handle

    @property
    def nccl_comm(self) -> Any:
        """CuPy's NcclCommunicator when CuPy created this communicator, else None."""
        return self._nc

    @property
    def force_fallback(self) -> bool:
        """Use grouped send/recv for gather/scatter/all_to_all even where NCCL is native."""
        return self._ctx.force_fallback

    @force_fallback.setter
    def force_fallback(self, value: bool) -> None:
        self._ctx = dataclasses.replace(self._ctx, force_fallback=bool(value))

    @property
    def _ctx(self) -> PlanContext:
        """The planning context, held by the resolver: setting it drops every cached call."""
        return self._resolver.ctx

    @_ctx.setter
    def _ctx(self, ctx: PlanContext) -> None:
        self._resolver.set_context(ctx)

    @property
    def timeout(self) -> float:
        """Seconds a call, a wait, a barrier or a check may take (``timeout=`` or
        ``$NCCLPY_TIMEOUT``, default 300)."""
        return self._timeout

    def dump_trace(self, path: Optional[str] = None) -> str:
        """Write this rank's flight recorder (its last calls, ``NCCLPY_TRACE_BUFFER``) as JSON
        lines to ``path`` (a file, or a directory; default ``$NCCLPY_TRACE_DIR``) for
        ``ncclpy trace``; the file written."""
        rec = self._recorder
        if rec is None:
            raise NcclpyError(f"dump_trace: the flight recorder of communicator {self.name!r} "
                              f"is off (NCCLPY_TRACE_BUFFER=0)")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"dump_trace: path: expected a file or directory name, got "
                                    f"{type(path).__name__} {path!r}")
        try:
            return rec.dump(None if path is None else os.fspath(path), "comm.dump_trace()")
        except OSError as e:
            raise ArgumentError(f"dump_trace: path {path!r}: cannot write the dump there: "
                                f"{e.strerror or e}") from None

    @property
    def checked(self) -> bool:
        """Whether checked mode compares every call across ranks."""
        return self._checker is not None

    # -- calls ----------------------------------------------------------------------------
    # Each method: refuse if closed, resolve (the resolver's cache: a repeated call is not
    # parsed or planned again; a new one is, with every check), issue the C calls, record.
    # ``config``: an ncclpy.CollConfig makes each NCCL call its nccl<Coll>Config variant
    # (NCCL >= 2.31; same on every rank: checked mode compares it).
    def all_reduce(self, sendbuf: Any, recvbuf: Any = None, op: Any = "sum", *,
                   stream: Any = None, config: Any = None) -> Work:
        """Every rank gets ``op`` over all ranks' ``sendbuf`` (in place if recvbuf is None).
        NCCL: ``ncclAllReduce`` (premul_sum: with ``ncclRedOpCreatePreMulSum``)."""
        h = self._hot
        if h is not None and config is None:
            w = h("all_reduce", sendbuf, recvbuf, (op,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("all_reduce")
        r = self._resolver.resolve("all_reduce", stream, sendbuf, recvbuf, (op,), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def reduce(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, op: Any = "sum", *,
               stream: Any = None, config: Any = None) -> Work:
        """``root`` gets ``op`` over all ranks' ``sendbuf`` (in place if recvbuf is None).
        NCCL: ``ncclReduce``."""
        h = self._hot
        if h is not None and config is None:
            w = h("reduce", sendbuf, recvbuf, (root, op), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("reduce")
        r = self._resolver.resolve("reduce", stream, sendbuf, recvbuf, (root, op), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def broadcast(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *,
                  stream: Any = None, config: Any = None) -> Work:
        """Every rank gets ``root``'s ``sendbuf`` (in place if recvbuf is None).
        NCCL: ``ncclBroadcast``."""
        h = self._hot
        if h is not None and config is None:
            w = h("broadcast", sendbuf, recvbuf, (root,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("broadcast")
        r = self._resolver.resolve("broadcast", stream, sendbuf, recvbuf, (root,), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def all_gather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None,
                   config: Any = None) -> Work:
        """``recvbuf`` (N*count, or a list of N) gets every rank's ``sendbuf`` in rank order;
        ``sendbuf`` None: in place (this rank's block of recvbuf is its input).
        NCCL: ``ncclAllGather`` (a list adds copies from a scratch buffer)."""
        h = self._hot
        if h is not None and config is None:
            w = h("all_gather", sendbuf, recvbuf, (), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("all_gather")
        r = self._resolver.resolve("all_gather", stream, sendbuf, recvbuf, (), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any = None, op: Any = "sum", *,
                       stream: Any = None, config: Any = None) -> Work:
        """Rank r gets block r of ``op`` over all ranks' ``sendbuf`` (N*count or a list).
        NCCL: ``ncclReduceScatter``."""
        h = self._hot
        if h is not None and config is None:
            w = h("reduce_scatter", sendbuf, recvbuf, (op,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("reduce_scatter")
        r = self._resolver.resolve("reduce_scatter", stream, sendbuf, recvbuf, (op,), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def all_to_all(self, sendbuf: Any, recvbuf: Any = None, send_counts: Any = None,
                   recv_counts: Any = None, *, stream: Any = None, config: Any = None) -> Work:
        """Block d of this rank's ``sendbuf`` goes to rank d (even, uneven counts, lists).
        NCCL: ``ncclAlltoAll`` (NCCL >= 2.28, even counts), else grouped ncclSend/ncclRecv."""
        if self._life.state is not USABLE:
            self._check_usable("all_to_all")
        r = self._resolver.resolve("all_to_all", stream, sendbuf, recvbuf,
                                   (send_counts, recv_counts), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def gather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *,
               stream: Any = None, config: Any = None) -> Work:
        """``root``'s ``recvbuf`` gets every rank's ``sendbuf`` in rank order (None off the
        root).  NCCL: ``ncclGather`` (NCCL >= 2.28), else grouped ncclSend/ncclRecv."""
        h = self._hot
        if h is not None and config is None:
            w = h("gather", sendbuf, recvbuf, (root,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("gather")
        r = self._resolver.resolve("gather", stream, sendbuf, recvbuf, (root,), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def scatter(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *,
                stream: Any = None, config: Any = None) -> Work:
        """Rank r's ``recvbuf`` gets block r of ``root``'s ``sendbuf`` (None off the root).
        NCCL: ``ncclScatter`` (NCCL >= 2.28), else grouped ncclSend/ncclRecv."""
        h = self._hot
        if h is not None and config is None:
            w = h("scatter", sendbuf, recvbuf, (root,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("scatter")
        r = self._resolver.resolve("scatter", stream, sendbuf, recvbuf, (root,), config)
        return issue(self, r, (sendbuf, recvbuf, config))

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> Work:
        """Send ``buf`` to ``peer`` (which must post a matching recv).  NCCL: ``ncclSend``."""
        h = self._hot
        if h is not None:
            w = h("send", buf, None, (peer,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("send")
        return issue(self, self._resolver.resolve("send", stream, buf, None, (peer,)), (buf,))

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> Work:
        """Receive into ``buf`` from ``peer``.  NCCL: ``ncclRecv``."""
        h = self._hot
        if h is not None:
            w = h("recv", buf, None, (peer,), stream)
            if w is not None:
                return w
        if self._life.state is not USABLE:
            self._check_usable("recv")
        return issue(self, self._resolver.resolve("recv", stream, buf, None, (peer,)), (buf,))

    def send_recv(self, sendbuf: Any, recvbuf: Any, send_peer: int, recv_peer: int, *,
                  stream: Any = None) -> Work:
        """Send ``sendbuf`` to ``send_peer``, receive ``recvbuf`` from ``recv_peer``: one
        group of ``ncclSend`` + ``ncclRecv``; the buffers must not overlap."""
        if self._life.state is not USABLE:
            self._check_usable("send_recv")
        return issue(self, self._resolver.resolve("send_recv", stream, sendbuf, recvbuf,
                                                  (send_peer, recv_peer)), (sendbuf, recvbuf))

    def broadcast_object(self, obj: Any, root: int = 0, *,
                         max_bytes: Optional[int] = None) -> Any:
        """``obj`` of rank ``root`` on every rank (torch's ``broadcast_object_list`` for one
        object), pickled through the rendezvous store, not NCCL: no GPU memory, no stream.
        Every rank calls it, in the same order.  ``max_bytes`` bounds the pickled object
        (default 16 MiB).  See :mod:`ncclpy.comm.objects`."""
        self._check_usable("broadcast_object")
        return self._object_exchange("broadcast_object").broadcast(obj, root, max_bytes)

    def all_gather_object(self, obj: Any, *, max_bytes: Optional[int] = None) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank (torch's
        ``all_gather_object``), pickled through the rendezvous store; ``max_bytes`` bounds
        each rank's pickled object (default 16 MiB), the joined result the store's largest
        value.  See :mod:`ncclpy.comm.objects`."""
        self._check_usable("all_gather_object")
        return self._object_exchange("all_gather_object").all_gather(obj, max_bytes)

    def _object_exchange(self, what: str) -> Any:
        if self._objects is None:
            from ..errors import UnsupportedError
            raise UnsupportedError(f"{what}: this communicator was not made by ncclpy.init / "
                                   f"from_bootstrap (a split child or a bare Communicator), so "
                                   f"it has no rendezvous store for objects")
        return self._objects

    def barrier(self, *, stream: Any = None, timeout: Optional[float] = None) -> Work:
        """Block the host until every rank has reached the barrier.

        ``timeout`` (seconds; default: the communicator's timeout): a rank that never arrives
        raises NcclTimeoutError instead of hanging; the communicator should then be aborted.
        NCCL: ``ncclAllReduce`` of one float32 on ``stream``, then a host wait; the Work returned
        is complete (symmetry only: ``wait()`` returns at once).  Not during graph capture."""
        self._check_usable("barrier")
        if self._barrier_buf is None:
            arr = cuda().zeros_float32(1, self._device)
            self._barrier_buf = _parse(arr, "barrier buffer")
        buf = self._barrier_buf
        work = issue(self, self._resolver.resolve("barrier", stream, buf), (buf,))
        work.wait(timeout=self._timeout if timeout is None else timeout)
        return work

    def prepare(self, name: str, *args: Any, stream: Any = None, **kwargs: Any) -> Prepared:
        """Validate and plan one call once: ``p = comm.prepare("all_reduce", x, op="sum")``,
        then ``p()`` / ``p(stream=s)`` issues the same NCCL call(s) with nothing but the C
        calls and the Work bookkeeping (see :mod:`ncclpy.comm.prepared`).  Arguments as the method
        ``name`` takes them; ``stream`` fixes the default stream of every call.  Argument
        errors are raised here; ``barrier`` cannot be prepared."""
        self._check_usable("prepare")
        return Prepared(self, name, args, kwargs, stream)

    def group(self, simulate: bool = False):
        """``with comm.group():`` fuse the calls inside into one NCCL group
        (``ncclGroupStart``/``ncclGroupEnd``); Works are recorded at the outermost end.
        ``simulate=True``: end with ``ncclGroupSimulateEnd`` (NCCL >= 2.22), launch nothing,
        ``g.estimated_time`` is NCCL's estimate (:mod:`ncclpy.comm.simulate`)."""
        self._check_usable("group")
        if check_simulate(simulate):
            return simulated_group(self._lib, self._dispatch["GroupStart"], self)
        return group_scope(self._dispatch["GroupStart"], self._dispatch["GroupEnd"], self)

    def __repr__(self) -> str:
        state = "open" if self._life.state is USABLE else self._life.state
        from ..cpu.backend import installed
        if installed():     # its device is a label (the local rank), its NCCL the CPU engine
            where, how = f"cpu:{self._device}", "CPU backend"
        else:
            where, how = f"device {self._device}", "cupy" if self._nc is not None else "ctypes"
        return (f"<ncclpy.Communicator {self.name!r} rank {self._rank}/{self._world_size} "
                f"{where} ({how}, {state})>")


def _parse(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    from ..buffers.buffer import as_buffer
    if isinstance(obj, (list, tuple)):
        return [as_buffer(o, f"{name}[{i}]") for i, o in enumerate(obj)]
    return as_buffer(obj, name)


def _itemsize(dtype: Any) -> int:
    from ..semantics.dtypes import logical
    return logical(dtype).itemsize


def _on_failure_env() -> str:
    """``$NCCLPY_ON_FAILURE`` checked (``abort`` when unset)."""
    return check_on_failure(os.environ.get("NCCLPY_ON_FAILURE") or "abort", "NCCLPY_ON_FAILURE")


def _trace_settings() -> tuple:
    """(ring size, NVTX ranges or None) from ``NCCLPY_TRACE_BUFFER``/``NCCLPY_NVTX``, and
    ``NCCLPY_TRACE_SIGNAL`` checked: read before NCCL makes a communicator."""
    trace_signal()
    return buffer_size(), (nvtx_ranges() if nvtx_enabled() else None)


def group(simulate: bool = False):
    """``with ncclpy.group():`` an NCCL group across every communicator of this thread
    (``simulate=True``: see :meth:`Communicator.group`)."""
    lib = get_lib()
    if check_simulate(simulate):
        return simulated_group(lib, lib_group(lib, "ncclGroupStart"))
    return group_scope(lib_group(lib, "ncclGroupStart"), lib_group(lib, "ncclGroupEnd"))
