"""Where the real headers are: NCCL's nccl.h (beside the libnccl CuPy loaded) and CUDA's
include directory (``CUDA_HOME`` or /usr/local/cuda), for the compiler-checked tests."""
from __future__ import annotations

import os
from typing import List

__all__ = ["header_dirs"]


def header_dirs() -> List[str]:
    """[nccl include dir, CUDA include dir], the ones found."""
    from ncclpy import errors
    from ncclpy._nccl import lib as L
    inc = []
    try:
        lib = L.get_lib()
        cand = os.path.join(os.path.dirname(os.path.dirname(lib.path)), "include")
        if os.path.exists(os.path.join(cand, "nccl.h")):
            inc.append(cand)
    except errors.MissingDependencyError:
        pass
    for cuda in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if cuda and os.path.exists(os.path.join(cuda, "include", "cuda_runtime.h")):
            inc.append(os.path.join(cuda, "include"))
            break
    return inc
