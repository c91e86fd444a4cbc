"""The CPU libnccl of a :class:`ncclpy.cpu.transport.ProcEngine`: the parts of NCCL's host API
that meet other processes' ranks (init, split's votes, the first send/recv's connection,
finalize and destroy flushing queued work, a group's launch) go through the communicator's
channel (:mod:`ncclpy.cpu.channel`); grow and windows between processes are refused in one line.
Each rule and its NCCL source: ncclpy/cpu/RULES.md (rows X1-X10, E7).  Each host wait on peers
(init, a pair's connection, finalize, destroy) also looks whether they died
(:meth:`ncclpy.cpu.transport.ProcEngine.check_peers`): init, the connection and finalize then
return ncclRemoteError (6) naming them; destroy stops waiting for work that cannot complete.
A rank whose /dev/shm has no room for its channel fails its init with ncclSystemError (2).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Tuple

from .channel import P2P_RECV, P2P_SEND, Channel, stable_id
from .codes import IN_PROGRESS, INTERNAL, INVALID_USAGE, SUCCESS, SYSTEM
from .core import _Item, _Op, _World
from .nccl import CpuNccl
from .shm import ShmFull

__all__ = ["ProcNccl", "INIT_TIMEOUT"]

log = logging.getLogger(__name__)

#: seconds ncclCommInitRank waits for every rank's channel (ncclpy's rendezvous came first)
INIT_TIMEOUT = 120.0


class ProcNccl(CpuNccl):
    """The CPU libnccl of a :class:`ProcEngine`: communicators get a channel."""

    e: Any        # the ncclpy.cpu.transport.ProcEngine (which imports this module)
    split_wait = None                 # as NCCL: the other ranks' votes are waited for

    def _join(self, nranks: int, uid: bytes, rank: int, nonblocking: bool) -> int:
        e = self.e
        with e.lock:
            if uid not in e.worlds:
                w = _World(uid, nranks)
                w.id = stable_id(uid)
                e.worlds[uid] = w
        h = super()._join(nranks, uid, rank, nonblocking)
        if nranks > 1:
            with e.lock:
                try:
                    e.channels[h] = Channel(uid, rank, nranks)
                except ShmFull as err:     # this rank's own failure: one line, no traceback
                    log.error("%s", err)
                    self.last_text = str(err).encode()
                    c = e.comms[h]
                    c.async_state = c.init_failed = SYSTEM
                    return h
                e.members[(e.comms[h].world.id, rank)] = h
            e.kick()
        return h

    def _wait_world(self, c: Any, timeout: float = INIT_TIMEOUT) -> int:
        ch = self.e.channels.get(c.handle)
        if getattr(c, "init_failed", 0):
            return c.init_failed
        if ch is None:
            return super()._wait_world(c, timeout)
        deadline = time.monotonic() + timeout
        while True:
            with self.e.lock:
                self.e.progress()
                if ch.connected:
                    return self._init_result(c)
            if c.abort_flag:
                return INTERNAL
            code = self.e.check_peers(c.handle)
            if code:
                return code
            if time.monotonic() > deadline:
                self.last_text = (f"CPU backend: ranks {ch.missing()} of {ch.n} never joined "
                                  f"within {timeout:g} s").encode()
                return SYSTEM
            time.sleep(0.001)

    def _connect(self, ops: List[Tuple[Any, int, _Op]]) -> int:
        """group.cc groupLaunch -> ncclP2PPreconnectFunc -> transport.cc
        ncclTransportP2pSetup: a pair's first send (recv) marks its connector in
        p2pTaskAppend, and the launch exchanges the connection with the peer through the
        bootstrap, waiting on the host for the peer's matching side.  Modelled on blocking
        communicators only (a nonblocking one's launch thread is not).  0; INTERNAL: aborted;
        REMOTE: a peer died (the text names it)."""
        e, wants = self.e, []
        for c, _stream, op in ops:
            ch = e.channels.get(c.handle)
            if ch is None or c.nonblocking or op.kind != "p2p" or op.key[4] != 0:
                continue
            _w, _p2p, src, dst = op.key[:4]
            peer, bit = (dst, P2P_SEND) if c.rank == src else (src, P2P_RECV)
            if peer == c.rank:
                continue
            with e.lock:
                if not ch.closed:
                    ch.want(peer, bit)
            wants.append((c, ch, peer, bit))
        while wants:
            with e.lock:
                for w in list(wants):
                    c, ch = w[0], w[1]
                    if c.abort_flag or ch.closed:
                        self.last_text = (f"CPU backend: communicator aborted while rank "
                                          f"{c.rank} waited for rank {w[2]} to connect its "
                                          f"send/recv").encode()
                        return INTERNAL
                    if ch.met(w[2], w[3]):
                        wants.remove(w)
            for c, _ch, peer, _bit in wants:
                code = e.check_peers(c.handle, {peer})
                if code:
                    return code
            if wants:
                time.sleep(0.001)
        return SUCCESS

    def _call(self, fn: str, h: int, stream: int, **args: Any) -> int:
        if "op" in args:
            args["_opdesc"] = self._opdesc(args["op"], args["dtype"])
        return super()._call(fn, h, stream, **args)

    def _opdesc(self, op: int, dtype: int) -> Any:
        """What must agree about a reduction op between processes: a PreMulSum's handle is
        local and its scalar each rank's own ("pre-multiplies input values by a given scalar
        locally", nccl.h): only its type."""
        if op in self.e.premul:            # the scalar is each rank's own: only its type
            return ["premul", self.e.premul[op][1]]
        return op

    def _ncclCommSplit(self, h: int, color: int, key: int, out: Any, cfg: Any) -> int:
        """The votes (colour, key) go through the channel; the rest is the engine's split
        (init.cc ncclCommSplit: EnsureReady first, so a refused split casts no vote)."""
        e = self.e
        c = e.comms.get(int(h or 0))
        ch = e.channels.get(int(h or 0))
        if c is not None and ch is not None and not c.freed and self._ready(c) == SUCCESS:
            with e.lock:
                tag = (c.world.id, "split", c.coll_seq)
                sw = e.worlds.setdefault(repr(tag).encode(), _World(repr(tag).encode(), 0))
                nth = ch.nvotes
                ch.vote(c.coll_seq + 1, int(color), int(key))
                e.splits.append((ch, c.coll_seq + 1, nth, sw, c.world.nranks))
            e.kick()
        return super()._ncclCommSplit(h, color, key, out, cfg)

    def _submit(self, ops: List[Tuple[Any, int, _Op]]) -> int:
        """A group's work: a send to this rank itself needs its recv in the same group
        (enqueue.cc 2.28.9: "Trying to send to self without a matching recv" -> 5); a
        communicator's work on several streams is one launch, on the first stream, after
        every other stream's earlier work, and those streams wait for it (enqueue.cc joins
        the group's streams)."""
        e = self.e
        by_comm: Dict[int, List[Tuple[Any, int, _Op]]] = {}
        for c, stream, op in ops:
            by_comm.setdefault(c.handle, []).append((c, stream, op))
        for h, lst in by_comm.items():
            selfp = {}
            for c, _s, op in lst:
                if op.kind == "p2p" and op.key[2] == op.key[3]:
                    selfp[op.key] = selfp.get(op.key, 0) + (1 if op.args["dir"] == "send" else -1)
            if any(selfp.values()):
                self.last_text = b"Trying to send to self without a matching recv"
                return self._group_err(INVALID_USAGE)
        code = self._connect(ops)         # the pairs whose first send/recv this launch holds
        if code:
            return code
        plain: List[Tuple[Any, int, _Op]] = []
        code = SUCCESS
        for h, lst in by_comm.items():
            streams = list(dict.fromkeys(s for _c, s, _op in lst))
            c = lst[0][0]
            if len(streams) == 1 or h not in e.channels or any(
                    e.skey(s, c.device) in e.capturing for s in streams):
                plain.extend(lst)
                continue
            holder: List[_Item] = []
            joins = [e.enqueue(s, lambda holder=holder: _Item(
                "wait", ready=lambda: bool(holder) and holder[0].done), device=c.device)
                for s in streams[1:]]
            batch = [op for _c, _s, op in lst]

            def make(batch: List[_Op] = batch, joins: List[_Item] = joins) -> _Item:
                it = _Item("nccl", ops=batch, pre=[j for j in joins if j is not None])
                holder.append(it)
                return it
            e.enqueue(streams[0], make, device=c.device)
            code = max(code, self._in_progress(c))
        if plain:
            code = max(code, super()._submit(plain))
        return code

    def _refuse(self, h: int, call: str) -> int:
        if int(h or 0) in self.e.channels:
            self.last_text = (f"{call}: not supported by ncclpy's CPU backend between "
                              f"processes").encode()
            return INVALID_USAGE
        return -1

    def _ncclCommGrow(self, h: int, *a: Any) -> int:
        code = self._refuse(h, "ncclCommGrow")
        return code if code >= 0 else super()._ncclCommGrow(h, *a)

    def _ncclCommWindowRegister(self, h: int, *a: Any) -> int:
        code = self._refuse(h, "ncclCommWindowRegister")
        return code if code >= 0 else super()._ncclCommWindowRegister(h, *a)

    def _close_channel(self, h: int) -> None:
        with self.e.lock:
            ch = self.e.channels.get(int(h or 0))
            if ch is not None:
                ch.close()

    def _ncclCommFinalize(self, h: int) -> int:
        """init.cc ncclCommFinalize -> commFinalize: "flush all uncompleted operations" -- the
        call (blocking) or its group job (nonblocking: in progress meanwhile) ends once the
        communicator's queued work has run; an abort ends the wait."""
        code = super()._ncclCommFinalize(h)
        e = self.e
        c = e.comms.get(int(h or 0))
        if c is None or int(h) not in e.channels or code not in (SUCCESS, IN_PROGRESS):
            return code
        if c.nonblocking:
            def drained() -> int:
                return IN_PROGRESS if e.queued_for(c.handle) else SUCCESS
            with e.lock:
                c.pending = getattr(c, "pending", []) + [drained]
                c.async_state, c.polls_left = IN_PROGRESS, 0
            e.kick()
            return IN_PROGRESS
        while True:
            with e.lock:
                e.progress()
                if not e.queued_for(c.handle):
                    return code
            if c.abort_flag:
                return INTERNAL
            dead = e.check_peers(c.handle)
            if dead:
                return dead
            e.kick()
            time.sleep(0.001)

    def _ncclCommDestroy(self, h: int) -> int:
        """init.cc commReclaim: without a finalize, commDestroySync synchronises the device
        stream first -- queued work runs before the communicator goes."""
        e = self.e
        c = e.comms.get(int(h or 0))
        if c is not None and int(h) in e.channels and not c.freed and not c.finalized:
            while not c.abort_flag and not e.check_peers(c.handle):   # dead: it never runs
                with e.lock:
                    e.progress()
                    if not e.queued_for(c.handle):
                        break
                e.kick()
                time.sleep(0.001)
        code = super()._ncclCommDestroy(h)
        if code == SUCCESS:
            self._close_channel(h)
        return code

    def _ncclCommAbort(self, h: int) -> int:
        code = super()._ncclCommAbort(h)
        self._close_channel(h)
        return code

