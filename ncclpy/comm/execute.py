"""The thin executor: run a :class:`~ncclpy.plan.types.Plan` on a communicator, and groups.

``execute`` allocates the plan's scratch, creates its PreMulSum op, issues its steps (device
copies with ``cudaMemcpyAsync``, NCCL calls through the communicator's dispatch table, grouped
when the plan says so), destroys the op and records the Work's event.

``issue`` runs a resolved call (:class:`ncclpy.comm.resolver.Resolved`): when it is nothing but NCCL
calls with final arguments -- the common case -- it makes exactly those C calls through the
dispatch table and records the Work, nothing else; otherwise it hands the call's plan to
``execute``.

Groups are thread-local, like NCCL's own: inside ``with group():`` NCCL only launches the work
at the outermost ``ncclGroupEnd``, so everything that must follow the launch (copies out of
scratch, destroying PreMulSum ops, recording Work events, polling nonblocking communicators)
is deferred until then.  The group end is called even when the block raises; the block's
exception is the one that propagates.

A call the watchdog aborted while it was blocked inside NCCL (NCCL's abort makes it return an
error) raises the abort's :class:`~ncclpy.errors.CommAbortedError`, which says why, with
NCCL's own error as its cause.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from functools import partial
from threading import get_ident
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from .._nccl.cuda import cuda
from .._nccl.group import GroupState, closed, group_depth, group_state, opened
from ..debug.recorder import interrupted, note_dump
from ..errors import CallCheckTimeout, NcclError, NcclpyError
from ..plan.types import PREMUL_OP, Copy, NcclCall, Scratch
from .lifecycle import ABORTED, ABORTING, USABLE
from .streams import keep_memory, torch_record
from .work import Work

__all__ = ["execute", "issue", "group_scope", "group_state", "group_depth", "segments",
           "Resources", "device_current"]

log = logging.getLogger(__name__)

_GONE_ABORT = (ABORTING, ABORTED)

def _group_exit(st: GroupState, end: Callable[[], int],
                raising: bool = False, sim: Any = None) -> None:
    err: Optional[BaseException] = None
    if st.depth == 1 and st.checks:      # checked mode: compare, then issue, before the end
        if raising:                      # the block raised: its deferred calls never run
            for d in st.checks:
                d.work._fail(NcclpyError("the group's block raised; its checked calls were "
                                         "not issued"))
            st.checks = []
        else:
            err = _run_checks(st)
    st.depth -= 1
    if st.depth == 0:
        closed()
    # the launch: timed by each watchdog while inside, each handle's API lock held (taken in
    # one order, so two threads' groups over the same communicators cannot deadlock) until
    # the nonblocking ones completed: no other thread's call meets NCCL's "in progress"
    held = sorted(st.comms.values(), key=id) if st.depth == 0 else ()
    locked: List[Any] = []
    try:
        try:
            for c in held:
                c._life.mark_call("ncclGroupEnd")
                locked.append(c)
                c._life.api.acquire()
            end()
        except Exception as e:  # noqa: BLE001 - re-raised below after the bookkeeping
            err = err or _aborted(held, e)
        except BaseException as e:  # noqa: B902 - re-raised below after the bookkeeping
            err = err or e
        finally:
            for c in locked:
                c._life.unmark_call()
        if st.depth > 0:
            if err is not None:
                raise err
            return
        comms, st.comms = list(st.comms.values()), {}
        pending, st.pending = st.pending, []
        try:
            # a simulated group launched nothing: its Works fail, its late copies are skipped
            told = sim.not_launched() if sim is not None and err is None else None
            if err is None:
                for c in comms:
                    if getattr(c, "nonblocking", False) and not c.closed:
                        try:
                            c._wait_ready("ncclGroupEnd")
                        except BaseException as e:  # noqa: B902
                            err = err or e
            for fn in pending:
                try:
                    fn(err or told)
                except BaseException as e:  # noqa: B902
                    log.warning("deferred group step failed: %s", e)
                    err = err or e
        finally:
            for c in comms:             # each held its handle from its first call in the group
                try:
                    c._life.release_hold()
                except Exception as e:  # noqa: BLE001 - the others are released all the same
                    log.warning("releasing %s after its group failed: %s", c, e)
    finally:
        for c in reversed(locked):
            try:
                c._life.api.release()
            except RuntimeError:        # pragma: no cover - taken by mark_call's failure
                pass
    if err is not None:
        raise err


def _aborted(comms: Sequence[Any], e: Exception) -> Exception:
    """The abort's CommAbortedError (``e`` as its cause) when one of ``comms`` was aborted
    while the failed call was inside NCCL; else ``e``."""
    for c in comms:
        ab = c._life.abort_error
        if ab is not None and ab is not e:
            ab.__cause__ = e
            return ab
    return e


def _join(st: GroupState, comm: Any) -> None:
    """``comm`` takes part in this thread's open group: it stays entered in its lifecycle
    (an abort waits for it) until the outermost group end."""
    if id(comm) not in st.comms:
        _refuse_simulated(st, comm)
        comm._life.hold("group", st.comms, id(comm), comm)


def _refuse_simulated(st: GroupState, comm: Any, sim: Any = None) -> None:
    """A nonblocking communicator's calls in a simulated group would run: NCCL's nonblocking
    group end launches them and ignores the simulation (group.cc ncclGroupEndInternal uses
    simInfo only on its blocking path)."""
    if (st.sim is not None or sim is not None) and getattr(comm, "_nonblocking", False):
        from ..errors import UnsupportedError
        raise UnsupportedError("group(simulate=True) with a nonblocking communicator: NCCL "
                               "launches a nonblocking group's calls and simulates nothing; "
                               "simulate on a blocking communicator (Config(blocking=True))")


@contextmanager
def group_scope(start: Callable[[], int], end: Callable[[], int],
                comm: Any = None, sim: Any = None) -> Iterator[Any]:
    """``ncclGroupStart`` ... ``ncclGroupEnd`` with ncclpy's deferral (see module docstring);
    ``sim``: a :class:`~ncclpy.comm.simulate.SimulatedGroup` whose ``end`` is
    ``ncclGroupSimulateEnd`` (yielded instead of the group state)."""
    st = group_state()
    if sim is not None and st.depth:
        from ..errors import UnsupportedError
        raise UnsupportedError("group(simulate=True) inside an open group: NCCL simulates "
                               "only at the outermost group end; open the simulated group "
                               "first, plain groups may nest inside it")
    if comm is not None and id(comm) not in st.comms:
        _refuse_simulated(st, comm, sim)     # this group's simulation, or an outer one's
        held: dict = {}
        try:
            comm._life.hold("group", held, id(comm), comm)
            start()
        except BaseException:
            if held:                         # (the hold is taken with its record in held)
                comm._life.release_hold()
            raise
        st.comms.update(held)
    else:
        start()
    st.depth += 1
    if st.depth == 1:
        opened()
    if sim is not None:
        st.sim = sim
    try:
        yield st if sim is None else sim
    except BaseException:
        try:
            _group_exit(st, end, raising=True, sim=sim)
        except Exception:
            log.warning("ncclGroupEnd failed while the group's block was raising; the block's "
                        "exception is re-raised", exc_info=True)
        raise
    finally:
        if sim is not None:
            st.sim = None
    _group_exit(st, end, sim=sim)


def segments(steps: Sequence[Any]) -> List[Tuple[bool, Tuple[Any, ...]]]:
    """Split plan steps into maximal runs: ``[(is_nccl_call, steps), ...]`` in order."""
    out: List[Tuple[bool, List[Any]]] = []
    for s in steps:
        is_call = isinstance(s, NcclCall)
        if not is_call and not isinstance(s, Copy):
            raise TypeError(f"plan step {s!r} is neither NcclCall nor Copy")
        if out and out[-1][0] == is_call:
            out[-1][1].append(s)
        else:
            out.append((is_call, [s]))
    return [(k, tuple(v)) for k, v in out]


@contextmanager
def device_current(cu: Any, device: int) -> Iterator[None]:
    """Make ``device`` CUDA's current device for the block (restored after); one cheap
    runtime call when it already is.  ``cu``: :func:`ncclpy._nccl.cuda.cuda`'s object."""
    prev = cu.get_device()
    if prev == device:
        yield
        return
    cu.set_device(device)
    try:
        yield
    finally:
        cu.set_device(prev)


class Resources:
    """A plan's scratch memory and PreMulSum op; resolves Scratch/PREMUL_OP placeholders."""

    __slots__ = ("comm", "scratch", "base", "op", "_free")

    def __init__(self, comm: Any, plan: Any, stream: int) -> None:
        self.comm = comm
        self.scratch = self._free = None
        if plan.scratch_bytes:
            self.scratch, self._free = comm._alloc_scratch(plan.scratch_bytes, stream,
                                                           plan.collective)
        self.base = int(self.scratch.ptr) if self.scratch is not None else 0
        self.op = comm._premul_create(plan.premul) if plan.premul is not None else None

    def value(self, a: Any) -> Any:
        if a is PREMUL_OP:
            if self.op is None:
                raise ValueError("plan uses PREMUL_OP but has no premul spec")
            return self.op
        if isinstance(a, Scratch):
            return self.base + a.offset
        return 0 if a is None else a

    def args(self, call: NcclCall) -> Tuple[Any, ...]:
        return tuple(self.value(a) for a in call.args)

    def copy(self, steps: Sequence[Copy], stream: int) -> None:
        """Issue ``steps`` on ``stream`` with the communicator's device current: a copy on the
        null (or per-thread) stream goes to the *current* device's stream, which must be the
        one the NCCL call was issued on for the two to be ordered."""
        cu = cuda()
        with device_current(cu, self.comm.device):
            for s in steps:
                if s.nbytes:
                    cu.memcpy_async(self.value(s.dst), self.value(s.src), s.nbytes, stream)

    def release(self, err: Optional[BaseException] = None) -> None:
        """After the plan's last step: destroy the PreMulSum op (NCCL allows it once the last
        call using it returned) and, for scratch allocated in a capture, enqueue its free."""
        op, self.op = self.op, None
        free, self._free = self._free, None
        try:
            if op is not None:
                self.comm._premul_destroy(op)
        finally:
            if free is not None:
                free()


def _finish(res: Resources, work: Work, err: Optional[BaseException]) -> None:
    try:
        res.release()
    finally:
        if err is None:
            work._record()
        else:
            work._fail(err)


def _late_copies(res: Resources, steps: Sequence[Copy], stream: int,
                 err: Optional[BaseException]) -> None:
    if err is None:
        res.copy(steps, stream)


def execute(comm: Any, plan: Any, stream: int, keep: Any = (),
            took: Optional[List[Any]] = None) -> Work:
    """Run ``plan`` on ``comm`` on ``stream``; returns the call's Work.  ``took``: [the flight
    recorder's entry]; the Work is appended once it has the entry (:func:`_recorded`)."""
    st = group_state()
    outer = st.depth > 0            # inside a user group: NCCL launches at its outermost end
    table = comm._dispatch
    res = Resources(comm, plan, stream)
    if res.op is not None:          # ncclRedOpCreatePreMulSum was a call of its own: what is
        comm._life._what = plan.collective   # inside NCCL from here on is the plan's call
    work = Work(comm, comm.device, stream, plan, keep=(res, keep))
    if took is not None and not outer:
        work._rec = took[0]
        took.append(work)
    issued = False
    begun = 0                       # steps begun (copies, NCCL calls): what may be enqueued
    try:
        if outer:
            _join(st, comm)
        for is_call, steps in segments(plan.steps):
            if not is_call:
                if issued and outer:
                    st.pending.append(partial(_late_copies, res, steps, stream))
                else:
                    begun += 1
                    res.copy(steps, stream)
            elif plan.group:
                begun += 1
                with group_scope(table["GroupStart"], table["GroupEnd"], comm):
                    for c in steps:
                        table[c.fn](*res.args(c), stream=stream)
            else:
                for c in steps:
                    begun += 1
                    table[c.fn](*res.args(c), stream=stream)
            issued = issued or is_call
        if not outer:
            work._record()          # recorded and tracked, then the op and scratch released
            begun = -1
            res.release()
    except BaseException as x:
        if outer:   # NCCL may still launch what was enqueued: keep the op until the group ends
            st.pending.append(res.release)
        else:
            if begun > 1 or begun == 1 and not _own_failure(comm, x):
                try:                # (an interrupt, or a failure after something was
                    if work._event is None:     # enqueued: the Work keeps the buffers until
                        work._record()          # the GPU passed it, and stamps the
                    else:                       # recorder's entry)
                        work._track()
                    if took is not None:
                        interrupted(took[0], x)
                except Exception as e:  # noqa: BLE001 - no event: let go
                    log.warning("a %s failed after its first step: its event could not be "
                                "recorded (%s)", plan.collective, e)
                    if took is not None:
                        del took[1:]
            elif took is not None and begun == 0:
                del took[1:]        # nothing enqueued: the entry fails with the call
            res.release()
        raise
    if outer:
        st.pending.append(partial(_finish, res, work))
    return work


def _own_failure(comm: Any, x: BaseException) -> bool:
    """Whether ``x`` is an NCCL call's (or a CUDA copy's) own failure: nothing enqueued."""
    if isinstance(x, NcclError):
        return True
    from .._nccl.dispatch import cupy_status
    return isinstance(x, Exception) and (cupy_status(x, comm._lib) is not None or
                                         type(x).__name__.endswith("CudaError") or
                                         "cudaError" in str(x))


def issue(comm: Any, r: Any, keep: Any = (), _after: int = 0,
          _took: Optional[List[Any]] = None) -> Work:
    """Run the resolved call ``r`` on ``comm`` (see module docstring); returns its Work.

    A communicator in checked mode (``comm._checker``) first compares the call across ranks
    (:func:`_checked_issue`); ``_after`` 1: the check passed; 2: a deferred call of a checked
    group (its Work is watched through the user's Work it hands its event to); 3: recorded
    by :func:`_recorded` (otherwise as 0).  A communicator with a flight recorder
    (``comm._recorder``) records the call first; the Work reaches its tracker (``comm._watch``:
    the watchdog's deque, or the reaper's) when its event is recorded (``Work._record``)."""
    if not _after:
        kept = keep_memory(keep)      # torch: the storages too, and the allocator told
        if kept is not keep:
            work = issue(comm, r, kept, 4)
            torch_record(kept, work)
            return work
        rec = comm._recorder
        if rec is not None:
            return _recorded(comm, rec, r, keep)
    elif _after == 4:
        _after = 0
        rec = comm._recorder
        if rec is not None:
            return _recorded(comm, rec, r, keep)
    elif _after == 3:
        _after = 0
    if not _after and comm._checker is not None:
        return _checked_issue(comm, r, keep)
    life = comm._life
    name = r.plan.collective
    work = None
    made = 0
    # Safe against an interrupt at any point (tests/test_interrupts.py): the API lock is held
    # by ``with`` (no check between its acquire and the block), the counts are taken and
    # ``counted`` set with no check between, and given back in the ``finally`` the same way;
    # once an NCCL call may have been made, the Work that keeps the buffers reaches the
    # tracker (_interrupted).  A missed wake-up of an abort is its poller's (lifecycle).
    with life.api:
        counted = False
        try:
            with life.lock:     # enter: refused once aborted or closed (nothing touches it)
                if life.state is not USABLE:
                    raise life.refusal(name)
                if life.holder is not None and life.holder != get_ident():
                    raise life.foreign_group(name)   # it would join that thread's group
                life.inflight += 1
                life.calls += 1
                life.entered += 1
                life._what = name
                counted = True
            life.plan = r.plan        # which peers it waits on, if it blocks inside NCCL
            calls = r.calls
            if calls is None:         # scratch, copies or a PreMulSum op: the plan's executor
                made = 2
                work = execute(comm, r.plan, r.stream, keep, _took)
            elif r.group or r.in_group:
                made = 2
                work = _issue_grouped(comm, r, keep)
            else:
                table, s = comm._dispatch, r.stream
                for fn, args in calls:
                    made += 1
                    table[fn](*args, stream=s)
                work = Work(comm, comm._device, s, r.plan, keep)
                if _took is not None:     # the flight recorder's entry goes with the Work
                    work._rec = _took[0]
                    _took.append(work)
                work._record()
                made = -1             # recorded and tracked (no check since _record's last)
        except BaseException as e:  # noqa: B902 - aborted while inside NCCL: say why
            if made > 0 and r.calls is not None and not (r.group or r.in_group):
                _interrupted(comm, r, keep, work, made, e, _took)
            if not isinstance(e, Exception):
                raise
            ab = _aborted((comm,), e)
            if ab is e:
                raise
            raise ab from e
        finally:
            if counted:               # leave: the counts, then an abort waiting for them
                with life.lock:
                    life.inflight -= 1
                    life.calls -= 1
                    idle = not life.inflight and (life.waiters or life.on_idle is not None)
                    counted = False
                if idle:
                    life.idle()
    if life.state is not USABLE and life.deferred and life.state in _GONE_ABORT:
        err = life.refusal(name)      # the abort waited for this call: say so
        if life.state is ABORTED:     # NCCL stopped its work: nothing kept
            work._fail(err)
        else:                         # the abort has yet to run: the buffers
            work._error = err         # stay kept (a dropped Work's sweep)
        raise err
    return work


def _interrupted(comm: Any, r: Any, keep: Any, work: Optional[Work], made: int,
                 x: BaseException, took: Optional[List[Any]] = None) -> None:
    """An exception after ``made`` NCCL calls of the plain route were begun: unless it is
    the first call's own failure (nothing was enqueued), the ops may be on the stream, so the
    Work that keeps the buffers is made (or finished: its event recorded, its capture asked)
    and handed to the tracker; the caller still raises ``x``."""
    from .._nccl.dispatch import cupy_status
    if made == 1 and work is None and (isinstance(x, NcclError) or isinstance(x, Exception)
                                       and cupy_status(x, comm._lib) is not None):
        return
    if work is None:
        work = Work(comm, comm._device, r.stream, r.plan, keep)
    if took is not None:              # the recorder's entry: stamped by the Work, and said
        work._rec = took[0]           # interrupted (NCCL may not have had the call)
        interrupted(took[0], x)
        took.append(work)
    try:
        if work._event is None:
            work._record()
        else:
            work._track()
    except Exception as e:  # noqa: BLE001 - no event: nothing to wait on
        log.warning("a %s interrupted after its NCCL call: its event could not be recorded "
                    "(%s); its buffers are let go", r.plan.collective, e)
        if took is not None:
            del took[1:]              # not tracked: the entry fails with the call


def _recorded(comm: Any, rec: Any, r: Any, keep: Any) -> Work:
    """``issue`` with the call in the flight recorder (and in an NVTX range when asked)."""
    e = rec.open(r, 4)    # 0 open, 1 here, 2 issue, 3 the Communicator method, 4 the user
    nv = rec.nvtx
    if nv is not None:
        nv.push(r.plan, e[0])
    took = [e]                        # [entry, the Work that took it, if one did]
    try:
        work = issue(comm, r, keep, 3, took)
    except BaseException as err:  # noqa: B902 - recorded, then re-raised
        if len(took) > 1 and took[-1]._event is not None and took[-1]._error is None:
            if took[-1]._done:        # tracked (an interrupt after NCCL may have had the
                rec.done(e)           # call): its Work stamps the entry when the GPU is done
            raise
        rec.fail(e, err)
        if isinstance(err, CallCheckTimeout):   # a hang caught by checked mode: dump
            note_dump(err, rec.try_dump("checked mode timeout"))
        raise
    finally:
        if nv is not None:
            nv.pop()
    work._rec = e                     # then read _done / _error: see Work._completed
    if work._error is not None:
        rec.fail(e, work._error)
    elif work._done:
        rec.done(e)
    return work


class _Deferred:
    """A checked call made inside a group: issued at the outermost group end, after the
    check, between the group's own ncclGroupStart and ncclGroupEnd."""

    __slots__ = ("comm", "resolved", "keep", "work")

    def __init__(self, comm: Any, resolved: Any, keep: Any, work: Work) -> None:
        self.comm, self.resolved, self.keep, self.work = comm, resolved, keep, work


def _checked_issue(comm: Any, r: Any, keep: Any) -> Work:
    """Checked mode: outside a group, compare then issue; inside one, defer the call (no NCCL
    call is made) until the outermost group end compares the whole group
    (:func:`_run_checks`)."""
    st = group_state()
    if st.depth == 0:
        comm._checker.check((r.plan,), (r.plan.collective,))
        return issue(comm, r, keep, 1)
    work = Work(comm, comm._device, r.stream, r.plan, keep)
    _join(st, comm)
    st.checks.append(_Deferred(comm, r, keep, work))
    return work


def _run_checks(st: GroupState) -> Optional[BaseException]:
    """At the outermost group end, before ncclGroupEnd: check each communicator's deferred
    calls across ranks, then issue them (still inside the group); on a mismatch nothing of
    that communicator is issued and its Works fail."""
    items, st.checks = st.checks, []
    by_comm: dict = {}
    for d in items:
        by_comm.setdefault(id(d.comm), []).append(d)
    err: Optional[BaseException] = None
    for ds in by_comm.values():
        comm = ds[0].comm
        try:
            comm._checker.check(tuple(d.resolved.plan for d in ds),
                                tuple(d.resolved.plan.collective for d in ds))
        except BaseException as e:  # noqa: B902 - failed below, raised by the group end
            err = err or e
            for d in ds:
                d.work._fail(e)
            continue
        for d in ds:
            try:
                real = issue(comm, d.resolved, d.keep, 2)
            except BaseException as e:  # noqa: B902
                err = err or e
                d.work._fail(e)
                continue
            st.pending.append(partial(_adopt, d.work, real))
    return err


def _adopt(work: Work, real: Work, err: Optional[BaseException]) -> None:
    if err is not None:
        work._fail(err)
        return
    work._adopt(real)
    watch = work._comm._watch
    if watch is not None:
        watch.append(work)


def _issue_grouped(comm: Any, r: Any, keep: Any) -> Work:
    """``issue`` for a call that groups its NCCL calls or is made inside a user group."""
    st = group_state()
    outer = st.depth > 0
    table, s = comm._dispatch, r.stream
    if outer:
        _join(st, comm)
    if r.group:
        with group_scope(table["GroupStart"], table["GroupEnd"], comm):
            for fn, args in r.calls:
                table[fn](*args, stream=s)
    else:
        for fn, args in r.calls:
            table[fn](*args, stream=s)
    work = Work(comm, comm._device, s, r.plan, keep)
    if outer:
        st.pending.append(work._settle)
    else:
        work._record()
    return work
