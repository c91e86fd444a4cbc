"""The STAND-IN forgives nothing (issue 40, part 3): every ``standin()`` block must end with no
violation but those it names; ranks that disagree on a collective's root, op, datatype or count
are a violation (never rank 0's choice); a collective whose send and recv buffers overlap other
than in NCCL's in-place form is a violation (ncclpy/cpu/RULES.md E5, E8, E9).  Raw NCCL calls on
thread-rank communicators of ncclpy, so ncclpy's own refusals (it never makes these calls)
cannot hide the stand-in's.  PreMulSum ops (P6, P7): tests/nccl_rules_scenarios.py."""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest

from ncclpy._nccl.config import Config
from ncclpy.comm import Communicator

from nccl_standin import DevArray, check_violations, run_ranks, standin

UID = bytes(range(128))
F32, I32 = 7, 2                 # ncclFloat32, ncclInt32
SUM, MAX = 0, 2


def _raw(n: int, body: Callable[[int, Any, int, DevArray], None],
         expect: Tuple[str, ...] = (), **kw: Any) -> List[np.ndarray]:
    """``body(rank, fn, handle, mem)`` on ``n`` thread-ranks (``fn``: the stand-in's declared
    NCCL functions; ``mem``: 16 float32 of the rank's "device" memory, rank r holding
    ``(1..16) * 10**r``), inside ``standin(expect_violations=expect)``; every rank's memory
    once all ranks have closed their communicators (their work done)."""
    mems = [DevArray((np.arange(16, dtype=np.float32) + 1) * 10 ** r, device=r)
            for r in range(n)]

    def rank(r: int) -> None:
        c = Communicator(n, r, UID, r, Config(blocking=True))
        try:
            body(r, eng.nccl.fn, c.handle, mems[r])
        finally:
            c.close()
    with standin(expect_violations=expect, **kw) as eng:
        run_ranks(n, rank)
    return [m.a.copy() for m in mems]


# -- every block is checked ---------------------------------------------------------------------
def _free_junk(expect: Tuple[str, ...] = ()) -> None:
    junk = ctypes.create_string_buffer(16)
    with standin(expect_violations=expect) as eng:
        assert eng.nccl.fn("ncclMemFree")(ctypes.addressof(junk)) == 1
        assert eng.violations == [f"ncclMemFree of unknown memory {ctypes.addressof(junk)}"]


def test_a_block_that_ends_with_a_violation_fails_unless_it_names_it_exactly():
    with pytest.raises(AssertionError, match="broke NCCL's rules.*ncclMemFree of unknown"):
        _free_junk()
    _free_junk(("ncclMemFree of unknown memory",))
    with pytest.raises(AssertionError, match="no violation matching 'ncclCommFinalize'"):
        _free_junk(("ncclMemFree of unknown memory", "ncclCommFinalize"))
    with pytest.raises(AssertionError, match="no violation matching 'destroyed'"):
        _free_junk(("destroyed",))
    with pytest.raises(TypeError, match="not one string"):
        with standin(expect_violations="ncclMemFree"):
            pass


def test_check_violations_matches_each_pattern_to_one_violation():
    check_violations(["a x", "a y"], ["a", "a"])
    with pytest.raises(AssertionError, match=r"violations\): \['a y'\]"):
        check_violations(["a x", "a y"], ["a"])
    with pytest.raises(AssertionError, match="no violation matching 'a'"):
        check_violations(["a x"], ["a", "a"])


# -- ranks that disagree --------------------------------------------------------------------------
#: name -> (what rank r calls: (NCCL function, its arguments after the two buffers), the
#: violation); the buffers: send = mem[0:], recv = mem[8:], count 2 unless said
_MISMATCH: Dict[str, Tuple[Callable[[int], Tuple[str, tuple]], str]] = {
    "root": (lambda r: ("ncclBroadcast", (2, F32, r)),
             r"mismatched collective: root differs across ranks: rank 0 0, rank 1 1$"),
    "reduce-root": (lambda r: ("ncclReduce", (2, F32, SUM, r)),
                    r"mismatched collective: root differs across ranks: rank 0 0, rank 1 1$"),
    "op": (lambda r: ("ncclAllReduce", (2, F32, (SUM, MAX)[r])),
           r"mismatched collective: op differs across ranks: rank 0 0, rank 1 2$"),
    "dtype": (lambda r: ("ncclAllReduce", (2, (F32, I32)[r], SUM)),
              r"mismatched collective: dtype differs across ranks: rank 0 7, rank 1 2$"),
    "count": (lambda r: ("ncclAllGather", (1 + r, F32)),
              r"mismatched collective: count differs across ranks: rank 0 1, rank 1 2$"),
    "function": (lambda r: (("ncclAllGather", "ncclAlltoAll")[r], (1, F32)),
                 r"mismatched collective: fn differs across ranks: rank 0 'AllGather', "
                 r"rank 1 'AlltoAll'$"),
}


@pytest.mark.parametrize("what", sorted(_MISMATCH))
def test_ranks_that_disagree_are_a_violation_and_nothing_is_written(what):
    call, violation = _MISMATCH[what]

    def body(r, fn, h, mem):
        name, rest = call(r)
        assert fn(name)(mem.ptr, mem.ptr + 32, *rest, h, None) == 0
    outs = _raw(2, body, (violation,))
    for r, got in enumerate(outs):             # no rank's choice was carried out
        assert got.tolist() == ((np.arange(16) + 1) * 10 ** r).tolist()


def test_a_premul_sum_against_a_sum_is_an_op_mismatch_and_two_scalars_are_not():
    def body(r, fn, h, mem, mixed):
        op = ctypes.c_int(SUM)
        scalar = (ctypes.c_float * 2)((0.5, 2.0)[r], 0.0)
        if r == 0 or not mixed:
            assert fn("ncclRedOpCreatePreMulSum")(ctypes.byref(op), ctypes.addressof(scalar),
                                                  F32, 1, h) == 0
        assert fn("ncclAllReduce")(mem.ptr, mem.ptr + 32, 2, F32, op.value, h, None) == 0
        if op.value != SUM:
            assert fn("ncclRedOpDestroy")(op.value, h) == 0   # its scalar was taken
    outs = _raw(2, lambda *a: body(*a, True), (
        r"mismatched collective: op differs across ranks: rank 0 \('premul_sum', 7\), rank 1 0$",))
    assert [o[8:10].tolist() for o in outs] == [[9, 10], [90, 100]]       # untouched
    outs = _raw(2, lambda *a: body(*a, False))
    assert [o[8:10].tolist() for o in outs] == [[20.5, 41]] * 2   # 0.5*[1, 2] + 2*[10, 20]


# -- overlapping buffers ---------------------------------------------------------------------
#: collective -> (its arguments after the two buffers, its pointers (send, recv) in bytes from the
#: rank's memory: in place (or, AlltoAll, disjoint: it has no in-place form) and overlapping,
#: the ranks whose pair counts, the literal results in place at recv (rank -> values))
_OVERLAP: Dict[str, Tuple[Callable[[int], tuple], Callable[[int], Tuple[int, int]],
                          Callable[[int], Tuple[int, int]], Tuple[int, ...],
                          Dict[int, List[float]]]] = {
    "ncclAllReduce": (lambda r: (2, F32, SUM), lambda r: (0, 0), lambda r: (0, 4), (0, 1),
                      {0: [11, 22], 1: [11, 22]}),
    "ncclBroadcast": (lambda r: (2, F32, 0), lambda r: (0, 0), lambda r: (0, 4), (0,),
                      {0: [1, 2], 1: [1, 2]}),
    "ncclReduce": (lambda r: (2, F32, SUM, 0), lambda r: (0, 0), lambda r: (0, 4), (0,),
                   {0: [11, 22], 1: [10, 20]}),
    "ncclReduceScatter": (lambda r: (2, F32, SUM), lambda r: (0, 8 * r), lambda r: (0, 4),
                          (0, 1), {0: [11, 22], 1: [33, 44]}),
    "ncclAllGather": (lambda r: (2, F32), lambda r: (8 * r, 0), lambda r: (4, 0), (0, 1),
                      {0: [1, 2, 30, 40], 1: [1, 2, 30, 40]}),
    "ncclGather": (lambda r: (2, F32, 0), lambda r: (0, 0), lambda r: (4, 0), (0,),
                   {0: [1, 2, 10, 20], 1: [10, 20, 30, 40]}),
    "ncclScatter": (lambda r: (2, F32, 0), lambda r: (0, 0), lambda r: (0, 4), (0,),
                    {0: [1, 2], 1: [3, 4]}),
    "ncclAlltoAll": (lambda r: (1, F32), lambda r: (0, 32), lambda r: (0, 0), (0, 1),
                     {0: [1, 10], 1: [2, 20]}),
}


@pytest.mark.parametrize("name", sorted(_OVERLAP))
def test_in_place_is_allowed_and_a_partial_overlap_is_a_violation(name):
    rest, good, bad, flagged, want = _OVERLAP[name]

    def body(r, fn, h, mem, ptrs):
        s, d = ptrs(r)
        assert fn(name)(mem.ptr + s, mem.ptr + d, *rest(r), h, None) == 0
    outs = _raw(2, lambda *a: body(*a, good))
    got = {r: o[good(r)[1] // 4:][:len(want[r])].tolist() for r, o in enumerate(outs)}
    assert got == want
    pattern = (r"overlap, not in place \(NCCL's in-place form: none exists\)"
               if name == "ncclAlltoAll" else r"overlap, not in place \(NCCL's in-place form: "
               r"sendbuff == recvbuff [+-]\d+ bytes\)")
    _raw(2, lambda *a: body(*a, bad),
         tuple(rf"^{name} \(rank {r}\): sendbuff 0x[0-9a-f]+ .*{pattern}$" for r in flagged))


def test_disjoint_buffers_and_a_non_roots_unused_pair_are_never_flagged():
    def body(r, fn, h, mem):
        assert fn("ncclAllReduce")(mem.ptr + 32, mem.ptr + 40, 2, F32, SUM, h, None) == 0
        s, d = (4, 4) if r == 0 else (0, 4)     # rank 1's pair overlaps, but only the root's
        assert fn("ncclBroadcast")(mem.ptr + s, mem.ptr + d, 2, F32, 0, h, None) == 0
    outs = _raw(2, body)
    assert outs[0][:12].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99, 110]   # 9+90, 10+100
    assert outs[1][:12].tolist() == [10, 2, 3, 40, 50, 60, 70, 80, 90, 100, 99, 110]


# -- refusals that depend on the communicator and on the NCCL version (RULES.md E4) -------------
E4M3, BF16, AVG = 10, 9, 4


def test_a_float8_premul_sum_on_one_rank_is_refused_as_nccl_does():
    """ncclLaunchOneRank has no float8 PreMulSum on the host (src/device/onerank.cu): avg on
    float8 -> 4 on a one-rank comm, after the empty-collective discard; sum is fine."""
    def body(r, fn, h, mem):
        assert fn("ncclAllReduce")(mem.ptr, mem.ptr + 32, 2, E4M3, AVG, h, None) == 4
        assert fn("ncclAllReduce")(mem.ptr, mem.ptr + 32, 0, E4M3, AVG, h, None) == 0
        assert fn("ncclAllReduce")(mem.ptr, mem.ptr + 32, 2, E4M3, SUM, h, None) == 0
        assert fn("ncclAllReduce")(mem.ptr, mem.ptr + 32, 2, F32, AVG, h, None) == 0
    _raw(1, body, (r"float8 PreMulSum \(op 4\) on a one-rank communicator",))


@pytest.mark.parametrize("version,dtype,op,code", [
    (22309, E4M3, SUM, 4), (22309, BF16, AVG, 0), (22403, E4M3, SUM, 0), (22809, E4M3, AVG, 0),
    (22809, 12, SUM, 4)])
def test_datatypes_and_ops_exist_from_their_nccl_version(version, dtype, op, code):
    def body(r, fn, h, mem):
        assert fn("ncclAllReduce")(mem.ptr, mem.ptr + 32, 2, dtype, op, h, None) == code
    _raw(2, body, version=version)
