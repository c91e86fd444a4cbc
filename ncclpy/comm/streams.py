"""Which CUDA stream a call runs on.

``stream=`` accepts a CuPy stream (``.ptr``), a torch stream (``.cuda_stream``), any object with
``__cuda_stream__`` (the CUDA stream protocol: returns ``(version, handle)``) or a raw integer
``cudaStream_t``.  Without it, a call runs on the caller's current stream of the buffers'
framework: torch's current stream for torch tensors (torch is only touched when a buffer is a
tensor), the ``stream`` of a ``__cuda_array_interface__`` v3 export when it carries one, and
CuPy's current stream otherwise (CuPy arrays, raw :class:`ncclpy.Buffer` pointers).  In host
memory mode (the CPU backend, :func:`ncclpy.buffers.buffer.set_host_memory`) every buffer is host
memory and runs on the CPU runtime's current stream (``ncclpy._nccl.cuda.cuda()``'s): torch is
not asked.
Inside ``with group():`` each call keeps its own stream; Works are recorded at the outermost
group end.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, Optional, Tuple

from ..buffers import buffer as _buffers
from .._nccl.cuda import cuda
from ..buffers.buffer import type_kind
from ..errors import ArgumentTypeError

__all__ = ["as_stream_handle", "default_stream", "resolve_stream", "cupy_stream",
           "stream_handle", "default_stream_of", "torch_stream", "cai_stream", "torch_keep",
           "keep_memory", "torch_record"]


def as_stream_handle(stream: Any, name: str = "stream") -> int:
    """The raw ``cudaStream_t`` (an int) of a stream-like object."""
    if isinstance(stream, bool):
        raise ArgumentTypeError(f"{name}: expected a CUDA stream, got the bool {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise ArgumentTypeError(f"{name}: a raw stream handle must be >= 0, got {stream}")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        if not (isinstance(value, tuple) and len(value) == 2):
            raise ArgumentTypeError(f"{name}: __cuda_stream__ of {type(stream).__name__} returned "
                                    f"{value!r}; expected a (version, handle) tuple")
        return int(value[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, CuPy, cuda.core
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    raise ArgumentTypeError(
        f"{name}: {type(stream).__name__} is not a CUDA stream; expected a CuPy or torch stream, "
        f"an object with __cuda_stream__, or a raw cudaStream_t int")


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and "torch" in sys.modules


def _cai_stream(obj: Any) -> Optional[int]:
    try:
        cai = obj.__cuda_array_interface__
    except Exception:
        return None
    return cai_stream(cai)


def cai_stream(cai: Any) -> Optional[int]:
    """The stream a ``__cuda_array_interface__`` export ``cai`` (already read) names, as a
    handle, or None when it names none."""
    if type(cai) is not dict and not isinstance(cai, dict):
        return None
    s = cai.get("stream")
    if s is None or isinstance(s, bool) or not isinstance(s, int):
        return None
    return 0 if s == 1 else s  # 1 = legacy default stream (handle 0); 2 = per-thread default


def cupy_stream(device: int) -> int:
    """CuPy's current stream on ``device`` (through the CUDA boundary, so a stand-in's)."""
    return cuda().current_stream(device)


def torch_stream(device: int) -> int:
    """torch's current stream on ``device`` (the raw handle, without making a Stream object
    where torch offers that); in host memory mode, the CPU runtime's (torch.cuda is not
    touched: a CPU tensor has no CUDA stream)."""
    if _buffers._host:
        return cuda().current_stream(device)
    torch = sys.modules.get("torch")
    if torch is None:  # pragma: no cover - a tensor implies torch is imported
        import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def default_stream(buffers: Iterable[Any], device: int) -> int:
    """The caller's current stream for the first buffer (see module docstring)."""
    if _buffers._host:
        return cupy_stream(device)
    for spec in buffers:
        if spec is None:
            continue
        obj = getattr(spec, "obj", spec)
        fw = str(getattr(spec, "framework", "") or "").lower()
        if fw == "torch" or _is_torch(obj):
            return torch_stream(device)
        if fw != "cupy" and not type(obj).__module__.startswith("cupy"):
            s = _cai_stream(obj)
            if s is not None:
                return s
        break
    return cupy_stream(device)


def resolve_stream(stream: Any, buffers: Iterable[Any], device: int) -> int:
    """``stream`` as a handle, or the default stream for ``buffers`` when it is None."""
    if stream is None:
        return default_stream(buffers, device)
    return as_stream_handle(stream)


def stream_handle(stream: Any) -> int:
    """:func:`as_stream_handle`, with a raw handle (a non-negative int) taken as it is."""
    if type(stream) is int and stream >= 0:
        return stream
    return as_stream_handle(stream)


def default_stream_of(obj: Any, device: int) -> int:
    """:func:`default_stream` for one user object (the call's first buffer), by its type:
    CuPy's current stream for CuPy arrays and raw Buffers, torch's for tensors, the
    ``__cuda_array_interface__`` stream or CuPy's for anything else; the CPU runtime's for
    everything in host memory mode."""
    if _buffers._host:
        return cupy_stream(device)
    kind = type_kind(type(obj))
    if kind == "cupy" or kind == "raw" or kind == "cupy-cai":
        return cupy_stream(device)
    if kind == "other":         # a __cuda_array_interface__ v3 export may name its stream
        try:
            s = cai_stream(obj.__cuda_array_interface__)
        except Exception:
            s = None
        return cupy_stream(device) if s is None else s
    if kind == "torch":
        return torch_stream(device)
    return default_stream((obj,), device)


#: device -> a stream of torch's own that a call on a stream torch does not own is recorded on
_GUARDS: Dict[int, Any] = {}


def _tensors(x: Any) -> Iterable[Any]:
    """The torch tensors in buffer argument ``x``: a tensor, a BufferSpec of one, or a list
    or tuple of those (the list forms)."""
    if type(x) is list or type(x) is tuple:
        for y in x:
            yield from _tensors(y)
        return
    k = type_kind(type(x))
    if k == "spec":
        x = getattr(x, "obj", None)
        k = type_kind(type(x))
    if k == "torch":
        yield x


def torch_keep(a: Any, b: Any) -> Tuple[Any, ...]:
    """What a call on torch tensors in ``a``, ``b`` keeps until the GPU ran it: the buffers
    and each tensor's storage, so a tensor re-pointed with ``set_()`` while the call is in
    flight leaves its old memory kept, not freed (:func:`torch_record` does the rest)."""
    keep = [a, b]
    for x in (a, b):
        for t in _tensors(x):
            try:
                keep.append(t.untyped_storage())
            except Exception:  # noqa: BLE001 - an exotic tensor: the tensor stays kept
                pass
    return tuple(keep)


def torch_record(keep: Tuple[Any, ...], work: Any) -> None:
    """Record the torch CUDA tensors of ``keep`` with torch's caching allocator for ``work``'s
    call: a storage freed in place while the call is in flight (``resize_(0)``, FSDP's idiom)
    frees the block whoever keeps the storage, and the allocator hands it out again on the
    stream it was allocated on -- unless the block was recorded on the call's stream
    (``record_stream``, what torch.distributed does for its NCCL stream; a no-op where the two
    are the same).  A stream torch owns (its current one) is recorded as it is; any other
    (CuPy's, a raw handle: it may be destroyed before the memory is freed, when torch records
    an event on it) through a stream of torch's own per device, made to wait for the call.  A
    call captured into a CUDA graph is not recorded (its memory is the graph's)."""
    if _buffers._host or work is None or work._owned:
        return
    tensors = [t for x in keep for t in _tensors(x) if getattr(t, "is_cuda", False)]
    if not tensors:
        return
    import torch
    device, stream = work._device, work._stream
    if stream == torch_stream(device):
        on = torch.cuda.current_stream(device)
    else:
        on = _GUARDS.get(device)
        if on is None:
            on = _GUARDS[device] = torch.cuda.Stream(device=device)
        work.wait(on.cuda_stream)           # ordered after the call (no host block)
    for t in tensors:
        t.record_stream(on)


def keep_memory(keep: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """``keep`` (a general-path call's ``(sendbuf, recvbuf, ...)``) with :func:`torch_keep`
    applied to its two buffers when either holds a torch tensor (or a BufferSpec of one, or
    a list of them)."""
    if type(keep) is not tuple or len(keep) < 2:
        return keep
    for x in (keep[0], keep[1]):
        for _ in _tensors(x):
            return torch_keep(keep[0], keep[1]) + keep[2:]
    return keep
