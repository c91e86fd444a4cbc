"""Which of torch's backends ``ncclpy check`` runs (``--torch-backend``), and which
implementation each one really is.

torch 2.15's ``"nccl"`` is a new implementation (``ProcessGroupNCCL2``, built on torchcomms;
``TORCH_DIST_USE_NCCL2=0`` turns it back) and ``"nccl-legacy"`` keeps the previous one
(``ProcessGroupNCCL``); older torch has only ``"nccl"`` (``ProcessGroupNCCL``).  The name a
user asks for therefore does not say which code ran: :func:`implementation` asks the process
group for the class of its backend, and the check's header and JSON record both.

:func:`offered_backends` reads, without importing torch, which NCCL backends the installed torch
offers: ``"nccl"`` is built in, the others are the entry points torch registers in the group
``torch.distributed.backends``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any, List, Optional, Tuple

__all__ = ["TORCH_NCCL_BACKENDS", "DEFAULT", "offered_backends", "parse_torch_backends",
           "refusal", "implementation"]

#: torch's names for its NCCL backends that ``--torch-backend`` accepts
TORCH_NCCL_BACKENDS = ("nccl", "nccl-legacy", "nccl2", "nccl-lazy")
#: what a GPU run compares when ``--torch-backend`` is not given
DEFAULT = "nccl"


def offered_backends() -> Tuple[Optional[str], List[str]]:
    """(torch's version or None when torch is not installed, the names of
    :data:`TORCH_NCCL_BACKENDS` this torch offers, in that order; none for a CPU build)."""
    if importlib.util.find_spec("torch") is None:
        return None, []
    from ..info import torch_build
    build = torch_build()
    version = build["version"]
    if build["build"] == "CPU":       # a CPU wheel registers "nccl" but cannot run it
        return version, []
    try:
        eps = {ep.name.lower() for ep in
               importlib.metadata.entry_points(group="torch.distributed.backends")}
    except Exception:  # noqa: BLE001 - unreadable metadata: only the built-in name
        eps = set()
    return version, [b for b in TORCH_NCCL_BACKENDS if b == "nccl" or b in eps]


def parse_torch_backends(text: str) -> List[str]:
    """``"nccl,nccl-legacy"`` -> ``["nccl", "nccl-legacy"]``; ValueError (the message says what
    was given and what is expected) for an empty list, a name that is not one of torch's NCCL
    backends, or a name given twice."""
    items = [t.strip().lower() for t in text.split(",")]
    if not any(items):
        raise ValueError(f"no backend given in {text!r}; expected a comma list of "
                         f"{', '.join(TORCH_NCCL_BACKENDS)}")
    out: List[str] = []
    for it in items:
        if not it:
            continue
        if it not in TORCH_NCCL_BACKENDS:
            hint = " (the CPU check: --backend gloo)" if it == "gloo" else ""
            raise ValueError(f"{it!r} is not one of torch's NCCL backends; expected a comma list "
                             f"of {', '.join(TORCH_NCCL_BACKENDS)}{hint}")
        if it in out:
            raise ValueError(f"{it!r} is given twice in {text!r}; each backend runs once")
        out.append(it)
    return out


def refusal(names: List[str], version: Optional[str], offered: List[str]) -> Optional[str]:
    """Why this torch cannot run ``names`` (None: it can): the first name it lacks."""
    if version is None and not offered:
        return "torch is not installed (pip install torch)"
    if not offered:
        return f"torch {version or '?'} is a CPU build: it has no NCCL backend"
    for b in names:
        if b not in offered:
            newer = " (torch 2.15 and newer have it)" if b in ("nccl-legacy", "nccl2",
                                                              "nccl-lazy") else ""
            return (f"torch {version or '?'} has no {b!r} backend{newer}; its NCCL backends: "
                    f"{', '.join(offered)}")
    return None


def implementation(group: Any, device: Any) -> str:
    """The class of the backend that ``group`` (a torch ProcessGroup) runs on ``device``:
    ``ProcessGroupNCCL``, ``ProcessGroupNCCL2``, ``ProcessGroupGloo``; "unknown" if torch
    does not say."""
    try:
        return type(group._get_backend(device)).__name__
    except Exception:  # noqa: BLE001 - an older or newer torch without _get_backend
        return "unknown"
