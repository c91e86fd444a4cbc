"""Where the real headers are: NCCL's nccl.h (beside the libnccl CuPy loaded) and CUDA's
include directory (``CUDA_HOME`` or /usr/local/cuda), for the compiler-checked tests."""
from __future__ import annotations

import os
from typing import List

__all__ = ["header_dirs", "header_version", "older_header_reason"]


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


def header_version(include_dir: str) -> int:
    """nccl.h's NCCL_VERSION_CODE (e.g. 23203), 0 when it does not say."""
    import re
    with open(os.path.join(include_dir, "nccl.h")) as f:
        m = re.search(r"#define NCCL_VERSION_CODE (\d+)", f.read())
    return int(m.group(1)) if m else 0


def older_header_reason(include_dir: str) -> str:
    """Why ``include_dir``'s nccl.h cannot prove every binding ("" when it can): it predates the
    newest NCCL API ncclpy binds (torch 2.15 pins nvidia-nccl-cu13 2.30.7, whose header lacks
    2.32's declarations).  The proof then needs a newer header: CI's install has one."""
    from ncclpy._nccl.functions import FUNCTIONS
    have = header_version(include_dir)
    newest = max(need for _r, _a, need in FUNCTIONS.values())
    if have >= newest:
        return ""
    return (f"nccl.h in {include_dir} is NCCL {have}, older than {newest}, the newest NCCL API "
            f"ncclpy binds: its declarations cannot be proven against this header (install "
            f"nvidia-nccl-cu13 >= {newest // 10000}.{newest // 100 % 100} to run the gate)")
