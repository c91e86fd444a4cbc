"""Wire format of the two server-held tables: heartbeats (``BEAT``) and votes (``VOTE``).

Why they exist: a job's control plane must cost the store O(1) requests per rank per period.
Reading N peers' heartbeat keys one by one is N requests per rank (N² on the store); comparing
checked-mode fingerprints through keys is several round trips per rank per call and leaves keys
behind.  The server instead keeps, per group, the table itself and answers in one reply.

``BEAT`` (one per rank per heartbeat period)::

    request  flags u8 | rank u32 | world u32 | stale_ms u32 | count u64 | str32 group
             | str32 watch | value (rest)
    reply    epoch i64 | never u32 | closed u32 | stale u32 | aborted u32 | behind u32
             | k u32 | k x (rank u32, age_ms u32) | j u32 | j x rank u32
             [| rank u32 | str32 value]                 when aborted > 0: the first to abort
             [| b u32 | b x (rank u32, count u64)]       with BEAT_BEHIND
             [| world x (age_ms u32, state u8, str32 value)]     with BEAT_FULL

A BEAT records ``rank``'s beat in ``group`` (a table of ``world`` ranks; ``value`` is the rank's
own text, e.g. its progress; ``count`` its progress counter, the calls it issued) and answers:
``epoch``, the integer value of the key ``watch`` (0 when missing or empty; the launcher bumps
such a counter on every death); how many ranks never beat, closed, and aborted; how many ranks'
last beat is older than ``stale_ms`` on the server's clock, with up to :data:`MAX_LISTED` of
them (oldest first, with their ages) and up to :data:`MAX_LISTED` of the never-seen ranks.
``BEAT_CLOSE`` marks the rank closed (never stale again); ``BEAT_ABORT`` (with ``BEAT_CLOSE``)
marks it aborted, ``value`` then its verdict: every later reply carries the first aborted rank
and its verdict, so that peers follow that verdict instead of taking the aborted rank's silence
for a new one.  ``BEAT_PEEK`` reads without beating; ``BEAT_BEHIND`` (a peek) lists the ranks
whose counter is at most ``count`` (up to :data:`MAX_LISTED`, with how many there are: who has
not issued call number ``count`` yet; one scan of the table per threshold per half second,
shared by every rank that asks);
``BEAT_FULL`` appends every rank's age (``NEVER`` if it never beat), state (bit 0 closed, bit 1
aborted) and value -- O(world), for ``ncclpy status``, never a rank's periodic request.  The
server's clock advances only while its loop runs (a stalled server does not age anyone): see
:class:`~ncclpy.store.tables.Tables`.

``VOTE`` (one per rank per checked call)::

    request  timeout_ms u32 | group u32 | rank u32 | flags u8 | hash u64 | sum u64 | key (rest)
    reply    verdict u8 | arrived u32 | m u32 | m x rank u32

Every rank of a ``group``-rank vote on ``key`` sends a ``hash`` that must be equal on all ranks
and a ``sum`` that must add up to 0 (mod 2**64) over all of them; ``VOTE_BAD`` says the rank
found a problem of its own.  The reply comes when all ``group`` ranks voted: ``verdict`` 0
(agreed) or a combination of :data:`HASH_DIFFERS`, :data:`SUM_NONZERO`, :data:`SOMEONE_BAD`;
the server then forgets the vote (no key is left).  A vote that times out answers
:data:`TIMED_OUT` with the ranks that never voted.
"""
from __future__ import annotations

import struct
from typing import List, NamedTuple, Optional, Tuple

__all__ = ["BEAT_CLOSE", "BEAT_PEEK", "BEAT_FULL", "BEAT_ABORT", "BEAT_BEHIND", "NEVER", "MAX_LISTED", "BeatReply",
           "pack_beat", "parse_beat", "pack_beat_reply", "unpack_beat_request",
           "VOTE_BAD", "HASH_DIFFERS", "SUM_NONZERO", "SOMEONE_BAD", "TIMED_OUT",
           "pack_vote", "unpack_vote_request", "pack_vote_reply", "parse_vote", "VoteReply"]

BEAT_CLOSE, BEAT_PEEK, BEAT_FULL, BEAT_ABORT, BEAT_BEHIND = 0x01, 0x02, 0x04, 0x08, 0x10
#: BEAT_FULL state bits
STATE_CLOSED, STATE_ABORTED = 0x01, 0x02
NEVER = 0xFFFFFFFF
MAX_LISTED = 32
VOTE_BAD = 0x01
HASH_DIFFERS, SUM_NONZERO, SOMEONE_BAD, TIMED_OUT = 0x01, 0x02, 0x04, 0x80

_BEAT_HEAD = struct.Struct("!BIIIQ")
_U32 = struct.Struct("!I")
_PAIR = struct.Struct("!II")
_REPLY_HEAD = struct.Struct("!qIIIII")
_BEHIND = struct.Struct("!IQ")
_ENTRY = struct.Struct("!IBI")
_VOTE = struct.Struct("!IIIBQQ")
_VOTE_REPLY = struct.Struct("!BII")
_NONE_LISTED = bytes(8)
_BEAT_FIXED = struct.Struct("!BIIIQI")


class BeatReply(NamedTuple):
    """A parsed BEAT reply: ``stale`` [(rank, age s)] oldest first, ``never_listed`` ranks,
    ``first_aborted`` (rank, verdict) when a rank aborted, ``behind`` [(rank, count)] with
    BEAT_BEHIND, ``full`` [(age s or None, state bits, value)] per rank when asked for."""

    epoch: int
    never: int
    closed: int
    nstale: int
    stale: List[Tuple[int, float]]
    never_listed: List[int]
    full: Optional[List[Tuple[Optional[float], int, bytes]]]
    aborted: int = 0
    first_aborted: Optional[Tuple[int, bytes]] = None
    nbehind: int = 0
    behind: Optional[List[Tuple[int, int]]] = None


def pack_beat(group: bytes, rank: int, world: int, stale_s: float, value: bytes,
              watch: bytes = b"", flags: int = 0, count: int = 0) -> bytes:
    """The body of a BEAT request."""
    return (_BEAT_HEAD.pack(flags, rank, world, max(0, min(int(stale_s * 1000), NEVER - 1)),
                            max(0, min(int(count), (1 << 64) - 1)))
            + _U32.pack(len(group)) + group + _U32.pack(len(watch)) + watch + value)


def unpack_beat_request(body: bytes) -> Tuple[int, int, int, int, int, bytes, bytes, bytes]:
    """(flags, rank, world, stale_ms, count, group, watch, value); ValueError when
    malformed."""
    if len(body) < _BEAT_HEAD.size + 8:
        raise ValueError("BEAT body too short")
    flags, rank, world, stale, count, n = _BEAT_FIXED.unpack_from(body, 0)
    off = _BEAT_FIXED.size + n
    if off + 4 <= len(body):                                  # the common case
        (m,) = _U32.unpack_from(body, off)
        if off + 4 + m <= len(body):
            return (flags, rank, world, stale, count, body[_BEAT_FIXED.size:off],
                    body[off + 4:off + 4 + m], body[off + 4 + m:])
    off = _BEAT_HEAD.size
    out = []
    for _ in range(2):
        if off + 4 > len(body):
            raise ValueError("BEAT: truncated length field")
        (n,) = _U32.unpack_from(body, off)
        off += 4
        if off + n > len(body):
            raise ValueError("BEAT: a length field runs past the end of the body")
        out.append(bytes(body[off:off + n]))
        off += n
    return flags, rank, world, stale, count, out[0], out[1], bytes(body[off:])


def pack_beat_reply(epoch: int, never: int, closed: int, nstale: int,
                    stale: List[Tuple[int, int]], never_listed: List[int],
                    full: Optional[List[Tuple[int, int, bytes]]] = None, aborted: int = 0,
                    first_aborted: Optional[Tuple[int, bytes]] = None, nbehind: int = 0,
                    behind: Optional[List[Tuple[int, int]]] = None) -> bytes:
    """The body of a BEAT reply (ages in ms)."""
    head = _REPLY_HEAD.pack(epoch, never, closed, nstale, aborted, nbehind)
    if not stale and not never_listed and full is None and not aborted and behind is None:
        return head + _NONE_LISTED                          # the common case
    parts = [head, _U32.pack(len(stale))]
    parts.extend(_PAIR.pack(r, min(a, NEVER - 1)) for r, a in stale)
    parts.append(_U32.pack(len(never_listed)))
    parts.extend(_U32.pack(r) for r in never_listed)
    if aborted:
        r, v = first_aborted if first_aborted is not None else (NEVER, b"")
        parts.append(_PAIR.pack(r, len(v)) + v)
    if behind is not None:
        parts.append(_U32.pack(len(behind)))
        parts.extend(_BEHIND.pack(r, c) for r, c in behind)
    if full is not None:
        parts.extend(_ENTRY.pack(a, c, len(v)) + v for a, c, v in full)
    return b"".join(parts)


def parse_beat(body: bytes, world: int = 0, full: bool = False,
               behind: bool = False) -> BeatReply:
    """A BEAT reply (``full``: with the table of ``world`` entries; ``behind``: with the
    BEAT_BEHIND list); ValueError when malformed."""
    try:
        epoch, never, closed, nstale, aborted, nbehind = _REPLY_HEAD.unpack_from(body, 0)
        off = _REPLY_HEAD.size
        (k,) = _U32.unpack_from(body, off)
        off += 4
        stale = []
        for _ in range(k):
            r, a = _PAIR.unpack_from(body, off)
            stale.append((r, a / 1000.0))
            off += 8
        (j,) = _U32.unpack_from(body, off)
        off += 4
        never_listed = [_U32.unpack_from(body, off + 4 * i)[0] for i in range(j)]
        off += 4 * j
        first = None
        if aborted:
            r, n = _PAIR.unpack_from(body, off)
            off += 8
            first = (r, bytes(body[off:off + n]))
            off += n
        rows = None
        if behind:
            (b,) = _U32.unpack_from(body, off)
            off += 4
            rows = []
            for _ in range(b):
                rows.append(_BEHIND.unpack_from(body, off))
                off += _BEHIND.size
        table = None
        if full:
            table = []
            for _ in range(world):
                a, c, n = _ENTRY.unpack_from(body, off)
                off += _ENTRY.size
                table.append((None if a == NEVER else a / 1000.0, c,
                              bytes(body[off:off + n])))
                off += n
    except struct.error as e:
        raise ValueError(f"malformed BEAT reply ({len(body)} bytes): {e}") from None
    return BeatReply(epoch, never, closed, nstale, stale, never_listed, table, aborted, first,
                     nbehind, rows)


class VoteReply(NamedTuple):
    """A parsed VOTE reply: ``verdict`` bits, how many voted, the ranks that never did."""

    verdict: int
    arrived: int
    missing: List[int]


def pack_vote(key: bytes, group: int, rank: int, hash_: int, sum_: int, flags: int,
              timeout_ms: int) -> bytes:
    """The body of a VOTE request."""
    return _VOTE.pack(timeout_ms, group, rank, flags, hash_ & (2**64 - 1),
                      sum_ & (2**64 - 1)) + key


def unpack_vote_request(body: bytes) -> Tuple[int, int, int, int, int, int, bytes]:
    """(timeout_ms, group, rank, flags, hash, sum, key); ValueError when malformed."""
    if len(body) < _VOTE.size:
        raise ValueError("VOTE body too short")
    return (*_VOTE.unpack_from(body, 0), bytes(body[_VOTE.size:]))


def pack_vote_reply(verdict: int, arrived: int, missing: List[int] = ()) -> bytes:
    return _VOTE_REPLY.pack(verdict, arrived, len(missing)) + b"".join(
        _U32.pack(r) for r in missing)


def parse_vote(body: bytes) -> VoteReply:
    try:
        verdict, arrived, m = _VOTE_REPLY.unpack_from(body, 0)
        missing = [_U32.unpack_from(body, _VOTE_REPLY.size + 4 * i)[0] for i in range(m)]
    except struct.error as e:
        raise ValueError(f"malformed VOTE reply ({len(body)} bytes): {e}") from None
    return VoteReply(verdict, arrived, missing)
