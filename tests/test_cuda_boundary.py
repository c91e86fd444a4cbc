"""The CUDA side of ncclpy's native boundary (``ncclpy._nccl.cuda``) on CPU: its one ctypes
declaration proven against CUDA's cuda.h by the compiler, the stand-in switch, and what the
real runtime object says without a driver."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from ncclpy._nccl import cuda as C

CUDA_INCLUDE = next((d for d in (os.path.join(os.environ.get("CUDA_HOME", ""), "include"),
                                 "/usr/local/cuda/include")
                     if d and os.path.exists(os.path.join(d, "cuda.h"))), None)


def test_capture_mode_binding_matches_cuda_h(tmp_path):
    """``cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode*) -> CUresult``, bound as
    (POINTER(c_int)) -> c_int, with THREAD_LOCAL = 1: compiled against the real header (a
    mismatch is a compile error)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or CUDA_INCLUDE is None:
        pytest.skip("needs a C compiler and CUDA's cuda.h")
    src = tmp_path / "mode.c"
    src.write_text("\n".join([
        "#include <cuda.h>",
        "typedef CUresult (*fn_t)(CUstreamCaptureMode *);",
        "static fn_t f = cuThreadExchangeStreamCaptureMode;",
        f"_Static_assert(sizeof(CUresult) == {ctypes.sizeof(ctypes.c_int)}, \"CUresult\");",
        f"_Static_assert(sizeof(CUstreamCaptureMode) == {ctypes.sizeof(ctypes.c_int)}, "
        "\"mode\");",
        f"_Static_assert(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL == {C.CAPTURE_MODE_THREAD_LOCAL}, "
        "\"THREAD_LOCAL\");",
        "int main(void) { return f == 0; }"]))
    r = subprocess.run([cc, f"-I{CUDA_INCLUDE}", "-c", str(src), "-o", str(tmp_path / "m.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_use_puts_a_stand_in_in_place_and_restores():
    class StandIn:
        name = "standin"
    before = C.cuda()
    with C.use(StandIn()) as s:
        assert C.cuda() is s
    assert C.cuda() is before and before.name == "cupy"


def test_without_a_driver_the_capture_mode_call_says_it_could_not():
    """This machine has no libcuda.so.1 (no driver): False, not an exception."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert C.CupyRuntime().thread_capture_mode_local() is False
    else:  # pragma: no cover - a machine with a driver
        pytest.skip("a CUDA driver is present here")
