"""How ``ncclpy run`` copies the ranks' output: whole prefixed lines, whatever the reads return.

The splitting is driven deterministically (every cut of the bytes into reads, no timing), then
through real pipes and the real launcher."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from itertools import combinations_with_replacement

import pytest

from ncclpy.launch.launcher import _Sink
from ncclpy.launch.output import READ_CHUNK, Lines, pump
from test_launcher import _env, _script, run

pytestmark = pytest.mark.timeout(60)

P = b"[rank 7] "
STREAMS = [b"line 0\npartial", b"a\n\nbc\n", b"x", b"\n", b"\n\n", b"no newline at all",
           b"\r\n\xff\xfe bin\x00ary\nend\n", b"one\ntwo\nthree"]


def _expected(data: bytes, prefix: bytes = P) -> bytes:
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return b"".join(prefix + x + b"\n" for x in lines)


def _feed(chunks, cap=None) -> list[bytes]:
    lines = Lines(P) if cap is None else Lines(P, cap)
    pieces = [lines.feed(c) for c in chunks] + [lines.end()]
    return [p for p in pieces if p]


def _whole(piece: bytes, prefix: bytes = P) -> bool:
    """``piece`` is whole prefixed lines: it starts at a line and ends with a newline."""
    return piece.endswith(b"\n") and all(x.startswith(prefix)
                                         for x in piece[:-1].split(b"\n"))


@pytest.mark.parametrize("data", STREAMS, ids=range(len(STREAMS)))
def test_every_cut_into_three_reads_gives_whole_prefixed_lines(data):
    for i, j in combinations_with_replacement(range(len(data) + 1), 2):
        chunks = [data[:i], data[i:j], data[j:]]
        pieces = _feed(chunks)
        assert b"".join(pieces) == _expected(data), chunks
        assert all(_whole(p) for p in pieces), (chunks, pieces)


@pytest.mark.parametrize("data", STREAMS, ids=range(len(STREAMS)))
def test_byte_by_byte_reads_give_whole_prefixed_lines(data):
    pieces = _feed([data[k:k + 1] for k in range(len(data))])
    assert b"".join(pieces) == _expected(data)
    assert all(_whole(p) for p in pieces)
    # a piece is written as soon as its newline is read: one per line, none held back
    assert len(pieces) == len(_expected(data).split(b"\n")) - 1


def test_a_line_over_the_cap_is_cut_into_prefixed_pieces_whatever_the_reads():
    for data in (b"abcdefghij\nk", b"abcd\nefgh", b"abcdefgh\n\nabcde", b"abc"):
        want = b"".join(P + x[i:i + 4] + b"\n" for x in data.split(b"\n")
                        for i in range(0, max(len(x), 1), 4))
        for i, j in combinations_with_replacement(range(len(data) + 1), 2):
            chunks = [data[:i], data[i:j], data[j:]]
            pieces = _feed(chunks, cap=4)
            assert b"".join(pieces) == want, chunks
            assert all(_whole(p) for p in pieces), (chunks, pieces)
    assert _feed([b"abcdefghij\nk"], cap=4) == [P + b"abcd\n" + P + b"efgh\n" + P + b"ij\n",
                                                P + b"k\n"]
    with pytest.raises(ValueError, match="cap: expected a positive number of bytes, got 0"):
        Lines(P, 0)


class _Record:
    """A sink that keeps each write apart."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def _pump_bytes(data: bytes, prefix=P) -> list[bytes]:
    r, w = os.pipe()
    sink = _Record()
    t = threading.Thread(target=pump, args=(os.fdopen(r, "rb"), sink, prefix))
    t.start()
    with os.fdopen(w, "wb") as f:
        f.write(data)
    t.join(30)
    assert not t.is_alive()
    return sink.writes


def test_the_last_line_without_newline_is_one_write_at_eof():
    # the bug: "[rank 7] partial" then "\n" apart, with another rank's line in between
    assert _pump_bytes(b"line 0\npartial") == [P + b"line 0\n", P + b"partial\n"]
    assert _pump_bytes(b"line 0\npartial", prefix=None) == [b"line 0\n", b"partial"]
    assert _pump_bytes(b"") == []


def test_a_line_longer_than_one_read_is_one_write():
    data = b"x" * (3 * READ_CHUNK + 5) + b"\nshort\n"
    assert _pump_bytes(data) == [P + b"x" * (3 * READ_CHUNK + 5) + b"\n", P + b"short\n"]


class _Interleave:
    """The launcher's sink, with rank 1's reader made to write between any two writes of rank
    0's (events, no timing): rank 1 writes only after rank 0's first write, and rank 0 goes on
    only after rank 1 wrote again (or finished)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.sink = _Sink(self.buf)
        self.cond = threading.Condition()
        self.writes = {"r0": 0, "r1": 0}
        self.r1_done = False

    def write(self, data: bytes) -> None:
        me = threading.current_thread().name
        with self.cond:
            if me == "r1":
                assert self.cond.wait_for(lambda: self.writes["r0"] > 0, 30)
            self.sink.write(data)
            self.writes[me] += 1
            self.cond.notify_all()
            if me == "r0":
                seen = self.writes["r1"]
                assert self.cond.wait_for(lambda: self.writes["r1"] > seen or self.r1_done, 30)


def test_another_ranks_line_never_lands_inside_a_partial_line():
    sink = _Interleave()
    pipes = [os.pipe() for _ in range(2)]
    for (_, w), data in zip(pipes, (b"partial", b"line 0\nline 1\nline 2\n")):
        os.write(w, data)
        os.close(w)
    ts = [threading.Thread(target=pump, name=f"r{k}",
                           args=(os.fdopen(r, "rb"), sink, f"[rank {k}] ".encode()))
          for k, (r, _) in enumerate(pipes)]
    for t in ts:
        t.start()
    ts[1].join(30)
    with sink.cond:
        sink.r1_done = True
        sink.cond.notify_all()
    ts[0].join(30)
    assert not any(t.is_alive() for t in ts)
    assert sorted(sink.buf.getvalue().decode().splitlines()) == [
        "[rank 0] partial", "[rank 1] line 0", "[rank 1] line 1", "[rank 1] line 2"]


def test_no_prefix_and_partial_lines(tmp_path):
    prog = _script(tmp_path, """
        import os, sys
        sys.stdout.write("line " + os.environ["RANK"] + "\\n")
        sys.stdout.write("partial")
        sys.stderr.write("e-partial")
    """)
    cp = run(["-n", 1, "--no-prefix", prog])
    assert cp.returncode == 0
    assert cp.stdout == "line 0\npartial"
    assert cp.stderr.endswith("e-partial") and "[rank" not in cp.stderr

    cp = run(["-n", 2, prog])
    assert cp.returncode == 0
    assert sorted(cp.stdout.splitlines()) == ["[rank 0] line 0", "[rank 0] partial",
                                              "[rank 1] line 1", "[rank 1] partial"]
    assert cp.stdout.endswith("\n")
    assert sorted(x for x in cp.stderr.splitlines() if x.startswith("[")) == [
        "[rank 0] e-partial", "[rank 1] e-partial"]


def test_long_line_and_binary_output(tmp_path):
    prog = _script(tmp_path, """
        import sys
        sys.stdout.buffer.write(b"x" * 200000 + b"\\n" + b"\\xff\\xfe bytes\\n")
    """)
    cp = subprocess.run([sys.executable, "-m", "ncclpy", "run", "-n", "1", "--no-prefix",
                         str(prog)], env=_env(), capture_output=True, timeout=30)
    assert cp.returncode == 0
    assert cp.stdout == b"x" * 200000 + b"\n\xff\xfe bytes\n"
