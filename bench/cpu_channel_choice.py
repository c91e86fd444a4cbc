"""Why the CPU backend moves data through shared memory, not sockets: 64 MiB from one process to
another, both ways measured end to end (best of 5).

* Unix socket: the sender's ``sendall`` and the receiver's ``recv_into`` run concurrently
  (two copies through the kernel, a syscall per chunk).
* shared memory: the sender copies into a mapping both processes share, then signals; the
  receiver copies out (what :mod:`ncclpy.cpu.channel` does; the signal here is a pipe).

Run: ``python bench/cpu_channel_choice.py`` (Linux; a CPU figure, not an NCCL one).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import socket
import time

import numpy as np

N = 64 << 20
REPS = 5


def _socket(src: np.ndarray, dst: np.ndarray) -> float:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        b.close()
        for _ in range(REPS):
            os.read(go_r, 1)
            a.sendall(memoryview(src))
        os._exit(0)
    a.close()
    best = float("inf")
    for _ in range(REPS):
        mv, got = memoryview(dst), 0
        t = time.perf_counter()
        os.write(go_w, b"g")
        while got < N:
            got += b.recv_into(mv[got:], N - got)
        best = min(best, time.perf_counter() - t)
    os.waitpid(pid, 0)
    return best


def _shared(src: np.ndarray, dst: np.ndarray) -> float:
    mm = mmap.mmap(-1, N)                 # shared with the child across fork
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        anchor = ctypes.c_char.from_buffer(mm)
        for _ in range(REPS):
            os.read(go_r, 1)
            ctypes.memmove(ctypes.addressof(anchor), src.ctypes.data, N)
            os.write(done_w, b"d")
        os._exit(0)
    view = np.frombuffer(mm, np.uint8)
    best = float("inf")
    for _ in range(REPS):
        t = time.perf_counter()
        os.write(go_w, b"g")
        os.read(done_r, 1)
        dst[:] = view
        best = min(best, time.perf_counter() - t)
    os.waitpid(pid, 0)
    return best


def main() -> None:
    src = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
    dst = np.empty(N, np.uint8)
    s, m = _socket(src, dst), _shared(src, dst)
    assert (dst == src).all()
    print(f"64 MiB, one process to another (best of {REPS}; CPU figures, not NCCL):")
    print(f"  Unix socket     {N / s / 1e9:5.2f} GB/s  ({s * 1e3:6.1f} ms)")
    print(f"  shared memory   {N / m / 1e9:5.2f} GB/s  ({m * 1e3:6.1f} ms)")


if __name__ == "__main__":
    main()
