"""How ``ncclpy run`` copies a rank's stdout/stderr: whole lines, each with the rank's prefix.

A reader thread per pipe reads what the rank wrote and writes it to the launcher's stream (a
sink shared by every rank's reader of that stream, serialised by a lock).  With a prefix, each
write holds whole lines only (:class:`Lines`): a read that returns part of a line keeps it back
until its newline (or EOF, where it is terminated with one), so another rank's line never lands
inside it and no empty line is left behind.  Without a prefix the bytes pass as read.
"""
from __future__ import annotations

from typing import IO, Any, Optional

__all__ = ["Lines", "pump", "READ_CHUNK", "LINE_CAP"]

#: the most bytes one read of a rank's pipe returns
READ_CHUNK = 1 << 16
#: the longest prefixed line held back for its newline; a longer one is cut into prefixed pieces
LINE_CAP = 1 << 20


class Lines:
    """Cut one rank's output stream into whole lines, each with ``prefix`` at its start.

    :meth:`feed` takes the bytes as they arrive (cut anywhere) and returns the lines they
    complete, as one piece to write at once; :meth:`end` returns, at EOF, the last line that
    had no newline, terminated with one.  A line over ``cap`` bytes is cut into prefixed
    pieces of ``cap`` bytes (memory stays bounded whatever a rank writes)."""

    def __init__(self, prefix: bytes, cap: int = LINE_CAP) -> None:
        if cap < 1:
            raise ValueError(f"cap: expected a positive number of bytes, got {cap}")
        self.prefix, self.cap = prefix, cap
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        """The prefixed lines that ``data`` completes (b"" if none)."""
        buf = self.pending + data
        cut = buf.rfind(b"\n") + 1
        whole, self.pending = buf[:cut], buf[cut:]
        n = self.cap
        out = [self.prefix + line[i:i + n] + b"\n" for line in whole.split(b"\n")[:-1]
               for i in range(0, max(len(line), 1), n)]
        while len(self.pending) > n:      # a line of exactly ``cap`` bytes waits for its end
            out.append(self.prefix + self.pending[:n] + b"\n")
            self.pending = self.pending[n:]
        return b"".join(out)

    def end(self) -> bytes:
        """At EOF: the last line without its newline, prefixed and terminated (b"" if none)."""
        tail, self.pending = self.pending, b""
        return self.prefix + tail + b"\n" if tail else b""


def pump(pipe: IO[bytes], sink: Any, prefix: Optional[bytes]) -> None:
    """Copy a rank's ``pipe`` to ``sink`` (``sink.write(bytes)``, never raising) until EOF:
    whole lines with ``prefix`` at each (:class:`Lines`), each write at once, or the bytes as
    read when ``prefix`` is None; closes ``pipe``."""
    lines = None if prefix is None else Lines(prefix)
    try:
        while True:
            chunk = pipe.readline(READ_CHUNK)
            if not chunk:
                break
            if lines is not None:
                chunk = lines.feed(chunk)
            if chunk:
                sink.write(chunk)
    except (OSError, ValueError):   # the pipe broke or was closed: keep what was read
        pass
    finally:
        if lines is not None:
            tail = lines.end()
            if tail:
                sink.write(tail)
        try:
            pipe.close()
        except OSError:
            pass
