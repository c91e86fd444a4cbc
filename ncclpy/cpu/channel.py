"""One rank's end of a communicator across processes: its control block and payloads in shared
memory, its view of its peers' (the CPU engine's data channel; the store never carries data).

Protocol (every field has one writer, so no cross-process atomics are needed; on x86 stores
become visible in program order, and each flag is written after the data it announces):

* each rank posts one stream item at a time: it copies what its peers need (a collective's
  send buffer, a send's bytes) into its payload area, writes a descriptor (JSON: one entry
  per operation, with its key, what must agree, offset and size), then bumps ``seq``;
* a peer whose own stream head holds the matching operation reads the entry (a collective once
  every rank posted it; a recv once its send is posted), computes its own result with
  :mod:`ncclpy.reference` and, once it has consumed every entry meant for it, writes
  ``acks[poster] = seq`` in its own control block;
* the poster's item is complete when its own results are written and every reader acked; only
  then may it post the next one (so a payload is never overwritten while a peer reads it).

Each rank's control block and payloads are one file (:class:`ncclpy.cpu.shm.Segment`, named
``<prefix>-<rank>-p<pid>``): the control block, then (from the next page) the payload area,
which grows in place (a new item's bytes are written only once the last one is acked).  Every
peer opens the file once, keeps its descriptor (it maps more of the payload area as it grows,
and tests its owner's lock with it), and says so in its own control block (``attached``): once
every peer has, the owner unlinks the name, so nothing of a connected communicator is named in
/dev/shm.  A peer whose owner's lock is gone while its control block was never closed died
(:meth:`Channel.dead_peers`: asked only while waiting, never on a fast path).  The descriptor
is written under a seqlock (``seq`` negative while it changes) and carries its own ``seq``.

A collective whose function, dtype, count, root or op differ between ranks never matches: the
ranks wait, as NCCL would hang, and the first sight of it is logged.  A pair's first send/recv
connects it on the host, as NCCL's preconnect does: each side raises its bit in ``p2p[peer]``
(1: a send to the peer, 2: a receive from it) and waits for the peer's matching bit
(:meth:`Channel.want`, :meth:`Channel.met`).  Control block (int64): ``HDR`` fields, then
``acks[N]``, ``attached[N]``, ``p2p[N]``, then the descriptor bytes.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from .shm import SHM_DIR, Mapping, Segment, ShmFull, sweep

__all__ = ["Channel", "DESC_MAX", "segment_prefix", "stable_id", "sweep"]

log = logging.getLogger(__name__)

HDR = 16
F_MAGIC, F_SEQ, F_GEN, F_DLEN, F_PID, F_N, F_CLOSED = range(7)
F_VOTE = 8                      # two vote slots of (seq, color, key): fields 8..13
MAGIC = 0x6E63636C70790004      # "ncclpy" v4 (v3: the seqlocked descriptor; v4: one file)
#: the descriptor bytes a control block holds (a bigger one goes after the payloads)
DESC_MAX = 1 << 16
_MIN_DATA = 1 << 16
#: the bits of ``p2p[peer]``: this rank's side of the pair's connection is posted
P2P_SEND, P2P_RECV = 1, 2
#: ``F_CLOSED``: the communicator was closed (destroyed, aborted), or its process exited
#: without closing it
CLOSED, EXITED = 1, 2


def _ints(n: int) -> int:
    """The int64 fields of an ``n``-rank control block before its descriptor."""
    return HDR + 3 * n


def _data_at(n: int) -> int:
    """Where an ``n``-rank file's payload area starts: the page after its control block."""
    g = mmap.ALLOCATIONGRANULARITY
    return (_ints(n) * 8 + DESC_MAX + g - 1) // g * g


def stable_id(uid: bytes) -> int:
    """A communicator's id from its unique id, the same in every process."""
    return int.from_bytes(hashlib.blake2b(bytes(uid), digest_size=6).digest(), "little")


def segment_prefix(uid: bytes) -> str:
    """The shared-memory name prefix of the communicator with unique id ``uid``."""
    return "/ncclpy-" + hashlib.blake2b(bytes(uid), digest_size=8).hexdigest()


class _Peer:
    """What this rank maps of one peer: its file (control block, descriptor kept) and the part
    of its payload area mapped so far."""

    def __init__(self, ctl: Segment, n: int) -> None:
        self.ctl = ctl
        self.f = (ctypes.c_int64 * _ints(n)).from_address(ctl.addr)
        self.pid = 0                       # read once its MAGIC says the header is written
        self.data: Optional[Mapping] = None
        self.desc_seq = 0                  # nothing posted yet
        self.desc: Dict[str, Dict[str, Any]] = {}
        self.mine: Set[str] = set()        # entries of its posted item meant for this rank
        self.consumed: Set[str] = set()


class Channel:
    """Rank ``rank`` of the ``n``-rank communicator with unique id ``uid``, in this process."""

    def __init__(self, uid: bytes, rank: int, n: int) -> None:
        self.rank, self.n = rank, n
        self.prefix = segment_prefix(uid)
        self.size = _ints(n) * 8 + DESC_MAX
        self.off = _data_at(n)
        try:
            self.ctl = Segment.create(f"{self.prefix}-{rank}-p{os.getpid()}",
                                      self.off + _MIN_DATA, head=self.size)
        except ShmFull as e:
            e.rank = rank
            raise
        self.f = (ctypes.c_int64 * _ints(n)).from_address(self.ctl.addr)
        self.f[F_PID], self.f[F_N] = os.getpid(), n
        self.f[F_MAGIC] = MAGIC
        self.peers: Dict[int, _Peer] = {}
        self.connected = n == 1
        if self.connected:
            self.ctl.unlink()
        self.data: Mapping = self.ctl.map(self.off, _MIN_DATA)
        self.seq = 0
        self.posted: Optional[int] = None  # the posted item's id
        self.readers: Set[int] = set()
        self.nvotes = 0
        self.warned: Set[str] = set()
        self.closed = False
        #: peers seen dead (rank -> pid), when they were last looked at, and those reported (a
        #: communicator's work needed them)
        self.dead: Dict[int, int] = {}
        self.looked = 0.0
        self.reported: Dict[int, int] = {}
        self._find_at, self._find_every = 0.0, 0.0

    # -- connecting ---------------------------------------------------------------------------
    def connect_step(self) -> bool:
        """Open the peers' files that exist, announce it; True once every peer opened this
        rank's too (then its name is unlinked: nothing of the channel stays named)."""
        if self.connected:
            return True
        if len(self.peers) < self.n - 1:
            for p, name in self._find().items():
                seg = Segment.attach(name, self.size)
                if seg is None:
                    continue
                peer = _Peer(seg, self.n)
                if peer.f[F_MAGIC] != MAGIC:     # created, not yet initialised
                    seg.close()
                    continue
                if peer.f[F_N] != self.n:
                    log.warning("CPU backend: rank %d of %s says %d ranks, this rank %d", p,
                                self.prefix, peer.f[F_N], self.n)
                    seg.close()
                    continue
                peer.pid = int(peer.f[F_PID])
                self.peers[p] = peer
                self.f[HDR + self.n + p] = 1
                self._find_every = 0.0
        if len(self.peers) < self.n - 1:
            return False
        if all(peer.f[HDR + self.n + self.rank] for peer in self.peers.values()):
            self.ctl.unlink()
            self.connected = True
        return self.connected

    def _find(self) -> Dict[int, str]:
        """The names of the unopened peers' files in /dev/shm (``<prefix>-<rank>-p<pid>``):
        one directory listing, less often while none appears (1 ms, doubling up to 50 ms)."""
        now = time.monotonic()
        if now < self._find_at:
            return {}
        self._find_every = min(max(self._find_every * 2, 0.001), 0.05)
        self._find_at = now + self._find_every
        head = self.prefix.lstrip("/") + "-"
        found: Dict[int, str] = {}
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return found
        for name in names:
            if not name.startswith(head):
                continue
            rank, sep, pid = name[len(head):].partition("-p")
            if sep and rank.isdigit() and pid.isdigit():
                p = int(rank)
                if p != self.rank and p < self.n and p not in self.peers:
                    found[p] = "/" + name
        return found

    def missing(self) -> List[int]:
        """The ranks not mapped yet (for a timeout's message)."""
        return [p for p in range(self.n) if p != self.rank and p not in self.peers]

    # -- posting --------------------------------------------------------------------------------
    def post(self, item_id: int, entries: List[Tuple[Dict[str, Any], int, int]]) -> bool:
        """Post a stream item: ``entries`` of (descriptor entry, source address, bytes); False
        while the previous item is not acked.  A descriptor too big for the control block goes
        after the payloads (the control block then points at it)."""
        if self.posted is not None:
            return False
        off, desc, spans = 0, [], []
        for entry, src, nb in entries:
            spans.append((off, src, nb))
            desc.append(dict(entry, o=off, b=nb))
            off += (nb + 63) & ~63
        seq = self.seq + 1
        raw = json.dumps({"s": seq, "e": desc}, separators=(",", ":")).encode()
        need = off + (len(raw) if len(raw) > DESC_MAX else 0)
        if self.data.size < need:
            self._grow(need)
        for o, src, nb in spans:
            if nb:
                ctypes.memmove(self.data.addr + o, src, nb)
        if len(raw) > DESC_MAX:          # too big for the control block: after the payloads
            ctypes.memmove(self.data.addr + off, raw, len(raw))
            raw = json.dumps({"s": seq, "x": [off, len(raw)]}).encode()
        self.f[F_SEQ] = -seq              # a seqlock: odd state "being written" (negative)
        ctypes.memmove(self.ctl.addr + _ints(self.n) * 8, raw, len(raw))
        self.f[F_DLEN] = len(raw)
        self.seq = seq
        self.f[F_SEQ] = seq               # last: the announcement
        self.posted = item_id
        self.readers = set()
        for entry in desc:
            to = entry["to"]              # -1: every rank; -2: nobody (a recv)
            self.readers.update(range(self.n) if to == -1 else () if to < 0 else (to,))
        self.readers.discard(self.rank)
        return True

    def _grow(self, need: int) -> None:
        """Grow the payload area in place (the same file: peers map more of it through their
        descriptors); only between items, once every reader acked the last one.
        :class:`ncclpy.cpu.shm.ShmFull` (naming this rank) when /dev/shm has no room."""
        size = _MIN_DATA
        while size < need:
            size *= 2
        try:
            self.ctl.grow(self.off + size)
        except ShmFull as e:
            e.rank = self.rank
            raise
        old, self.data = self.data, self.ctl.map(self.off, size)
        old.close()

    def unacked(self) -> List[int]:
        """The readers of the posted item that have not acked it yet."""
        if self.posted is None:
            return []
        return [p for p in self.readers if self.peers[p].f[HDR + self.rank] < self.seq]

    def acked(self) -> bool:
        """Whether every reader of the posted item acked it; then the slot is free."""
        if self.posted is None:
            return True
        for p in self.readers:
            if self.peers[p].f[HDR + self.rank] < self.seq:
                return False
        self.posted = None
        return True

    # -- reading --------------------------------------------------------------------------------
    def entry(self, p: int, key: str) -> Optional[Dict[str, Any]]:
        """Peer ``p``'s posted entry ``key`` not consumed yet (None: not posted, or being
        posted right now)."""
        peer = self.peers[p]
        seq = peer.f[F_SEQ]
        if seq != peer.desc_seq and seq > 0:
            desc = self._read_desc(p, peer, seq)
            if desc is None:
                return None
            peer.desc = {e["k"]: e for e in desc}
            peer.mine = {e["k"] for e in desc if e["to"] in (-1, self.rank)}
            peer.consumed = set()
            peer.desc_seq = seq
        elif seq != peer.desc_seq:        # being written: its old items are all acked
            return None
        if key in peer.consumed:
            return None
        return peer.desc.get(key)

    def _read_desc(self, p: int, peer: "_Peer", seq: int) -> Optional[List[Dict[str, Any]]]:
        """Peer ``p``'s descriptor of item ``seq``, or None when it changed while read (the
        seqlock: ``seq`` again after the copy, and the descriptor's own ``s``)."""
        n = peer.f[F_DLEN]
        raw = ctypes.string_at(peer.ctl.addr + _ints(self.n) * 8, n)
        if peer.f[F_SEQ] != seq:
            return None
        try:
            d = json.loads(raw)
        except ValueError:
            return None
        if d.get("s") != seq:
            return None
        if "x" in d:                      # a big descriptor, after the payloads
            off, length = d["x"]
            raw = ctypes.string_at(self.address(p, {"o": off, "b": length}), length)
            d = json.loads(raw)
            if d.get("s") != seq:
                return None
        return d["e"]

    def address(self, p: int, e: Dict[str, Any]) -> int:
        """Where the payload of peer ``p``'s entry ``e`` (offset ``o``, ``b`` bytes) is mapped
        in this process: its payload area is mapped again, all of it, once it has grown past
        what is mapped (through the descriptor kept: the file has no name any more)."""
        peer = self.peers[p]
        end = e["o"] + e["b"]
        if peer.data is None or peer.data.size < end:
            size = peer.ctl.file_size() - self.off
            if size < end:
                raise RuntimeError(f"CPU backend: rank {p}'s payload area holds {size} bytes, "
                                   f"its descriptor points at byte {end}")
            if peer.data is not None:
                peer.data.close()
            peer.data = peer.ctl.map(self.off, size)
        return peer.data.addr + e["o"]

    def consume(self, p: int, key: str) -> None:
        """Entry ``key`` of peer ``p`` was read; ack its item once all meant for us were."""
        peer = self.peers[p]
        peer.consumed.add(key)
        if peer.mine <= peer.consumed:
            self.f[HDR + p] = peer.desc_seq

    # -- connecting a pair for send/recv (NCCL's p2p preconnect) -------------------------------
    def want(self, peer: int, bit: int) -> None:
        """Post this rank's side of its connection with ``peer`` (P2P_SEND or P2P_RECV)."""
        i = HDR + 2 * self.n + peer
        self.f[i] = self.f[i] | bit

    def met(self, peer: int, bit: int) -> bool:
        """Whether ``peer`` posted the side that meets this rank's ``bit`` (its receive from
        this rank for a send, its send for a receive)."""
        other = P2P_RECV if bit == P2P_SEND else P2P_SEND
        return bool(self.peers[peer].f[HDR + 2 * self.n + self.rank] & other)

    # -- peers that died ----------------------------------------------------------------------
    def dead_peers(self) -> Dict[int, int]:
        """The opened peers found dead by this look (rank -> pid): the owner's lock on its file
        is gone while its control block was never closed -- or closed only as its process
        exited (``F_CLOSED`` 2) -- so its process ended (a signal, a crash, an exit without
        closing the communicator).  A slow, stopped or swapping peer still holds its lock: it
        is never taken for dead.  A few system calls per peer: ask while waiting."""
        self.looked = time.monotonic()
        found: Dict[int, int] = {}
        for p, peer in self.peers.items():
            if p in self.dead or peer.f is None or peer.f[F_CLOSED] == CLOSED:
                continue
            # F_CLOSED is written before the lock goes: read it again after the test
            if peer.ctl.holder_gone() and peer.f[F_CLOSED] != CLOSED:
                found[p] = peer.pid
        if found:
            self.dead.update(found)
            sweep(pids=found.values())    # its file, if still named (it died connecting)
        return found

    def warn_once(self, what: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning("CPU backend: %s", what)

    # -- votes (ncclCommSplit's colour and key, exchanged before the child exists) ------------
    def vote(self, tag: int, color: int, key: int) -> None:
        """Post this rank's vote for the split ``tag`` (the parent's call sequence, +1)."""
        slot = F_VOTE + 3 * (self.nvotes % 2)
        self.nvotes += 1
        self.f[slot + 1], self.f[slot + 2] = color, key
        self.f[slot] = tag

    def votes(self, tag: int, nth: int) -> Optional[Dict[int, Tuple[int, int]]]:
        """Every peer's vote for split number ``nth`` (``tag``), or None while one is missing."""
        slot = F_VOTE + 3 * (nth % 2)
        out = {}
        for p, peer in self.peers.items():
            if peer.f[slot] != tag:
                return None
            out[p] = (int(peer.f[slot + 1]), int(peer.f[slot + 2]))
        return out

    # -- closing --------------------------------------------------------------------------------
    def close(self, at_exit: bool = False) -> None:
        """Unlink and unmap everything (idempotent); no address from it may be used after.
        ``at_exit``: the process is exiting without having closed the communicator (its
        peers, if they wait on it, take it for dead)."""
        if self.closed:
            return
        self.closed = True
        self.f[F_CLOSED] = EXITED if at_exit else CLOSED
        for peer in self.peers.values():
            if peer.data is not None:
                peer.data.close()
            peer.f = None
            peer.ctl.close()
        self.peers.clear()
        self.data.close()
        self.f = None
        self.ctl.close()
