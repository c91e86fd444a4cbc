"""torch.distributed: the NCCL process group on CUDA tensors, gloo on CPU tensors.

torch's all_reduce, reduce and broadcast work in place only, so their out-of-place column here is
a device copy into the output followed by the in-place call: what a torch user pays for
out-of-place semantics.  The process group gets its own torch TCPStore (rank 0 picks a free port
and publishes it through the harness's store), so no port is shared with ncclpy's store.

In ``python -m bench.overhead`` torch gets the other backends' stream and memory in its own
forms: the stream as torch's current stream (``torch.cuda.ExternalStream`` over the same
handle; torch's collectives take no stream argument), the buffers as zero-copy tensors over
the same CuPy arrays (:meth:`TorchBackend.adopt` checks the pointers).
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ncclpy.semantics.dtypes import DTYPES
from ncclpy.errors import MissingDependencyError

from . import Backend, Buffers, host_dtype

__all__ = ["TorchBackend"]

#: dtypes ProcessGroupGloo refuses ("Invalid scalar type")
_GLOO_NO_DTYPES = {"uint32", "uint64", "float8_e4m3", "float8_e5m2"}


class TorchBackend(Backend):
    name = "torch"
    label = "torch"
    defaults = "torch.distributed's defaults (ProcessGroupNCCL)"
    stream_form = ("torch's current stream set to torch.cuda.ExternalStream(the same handle): "
                   "torch takes no stream argument; ProcessGroupNCCL waits on it and runs NCCL "
                   "on its own internal stream")

    def setup(self, rank, world, device, store, *, master_addr="127.0.0.1", timeout=300.0):
        super().setup(rank, world, device, store, master_addr=master_addr, timeout=timeout)
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            raise MissingDependencyError(f"the torch backend needs torch ({e})") from None
        self.torch, self.dist = torch, dist
        self.cuda = device is not None
        self.pg_backend = "nccl" if self.cuda else "gloo"
        self.label = f"torch/{self.pg_backend}"
        self.defaults = (f"torch.distributed's defaults (ProcessGroup"
                         f"{'NCCL' if self.cuda else 'Gloo'})")
        if not self.cuda:
            self.note = ("torch.distributed's gloo on CPU tensors: gloo figures, not NCCL "
                         "figures; no GPU ran")
        if self.cuda:
            torch.cuda.set_device(device)
            self.tdevice = torch.device("cuda", device)
        else:
            self.tdevice = torch.device("cpu")
        td = datetime.timedelta(seconds=timeout)
        key = "bench/torch/port"
        if rank == 0:
            self.tstore = dist.TCPStore(master_addr, 0, world, True, td, wait_for_workers=False)
            store.set(key, str(self.tstore.port))
        else:
            port = int(store.get(key, timeout=timeout))
            self.tstore = dist.TCPStore(master_addr, port, world, False, td)
        dist.init_process_group(self.pg_backend, store=dist.PrefixStore("bench", self.tstore),
                                rank=rank, world_size=world, timeout=td)
        # torch >= 2.13 renamed the tensor forms (the old names warn)
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = (getattr(dist, "reduce_scatter_single", None)
                                or dist.reduce_scatter_tensor)
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "avg": dist.ReduceOp.AVG}

    def teardown(self) -> None:
        dist = getattr(self, "dist", None)
        if dist is not None and dist.is_initialized():
            self.sync()
            dist.destroy_process_group()
        self.tstore = None
        if getattr(self, "ext_stream", None) is not None:   # the shared stream is not torch's
            self.torch.cuda.set_stream(self.torch.cuda.default_stream(self.tdevice))
            self.ext_stream = None

    def nccl_version(self) -> int:
        if not self.cuda:
            return 0
        v = self.torch.cuda.nccl.version()
        if isinstance(v, tuple):
            major, minor, patch = (list(v) + [0, 0, 0])[:3]
            return major * 10000 + minor * 100 + patch
        return int(v)

    def device_info(self) -> Dict[str, str]:
        if not self.cuda:
            import platform
            return {"device_hex": "0000:00:00", "device_info": f"cpu ({platform.machine()})"}
        p = self.torch.cuda.get_device_properties(self.device)
        bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:" \
              f"{getattr(p, 'pci_device_id', 0):02x}"
        return {"device_hex": bus, "device_info": p.name}

    def unsupported(self, collective: str, dtype: str, op: str) -> Optional[str]:
        if not getattr(self.torch, DTYPES[dtype].torch, None):
            return f"this torch has no {dtype}"
        if not self.cuda and dtype in _GLOO_NO_DTYPES:
            return f"gloo does not support {dtype}"
        return None

    def checks_in_place(self, collective: str) -> bool:
        # all_to_all_single and a send/recv ring shift on one tensor are not defined in place
        return collective not in ("all_to_all", "send_recv")

    def output_defined(self, collective: str, rank: int, root: int, in_place: bool) -> bool:
        # torch.distributed.reduce specifies only dst's tensor; gloo uses the others as scratch
        # (NCCL's ncclReduce never writes a non-root send buffer: the reference says so)
        return not (collective == "reduce" and rank != root)

    # ---- arrays -------------------------------------------------------------------------
    def _tdtype(self, dtype: str):
        return getattr(self.torch, DTYPES[dtype].torch)

    def empty(self, n: int, dtype: str) -> Any:
        return self.torch.zeros(max(n, 0), dtype=self._tdtype(dtype), device=self.tdevice)

    def zero(self, arr: Any) -> None:
        if arr.numel():
            arr.view(self.torch.uint8).zero_()

    def upload(self, arr: Any, host: np.ndarray) -> None:
        if arr.numel():
            src = self.torch.from_numpy(np.ascontiguousarray(host).view(np.uint8).copy())
            arr.view(self.torch.uint8).copy_(src)

    def download(self, arr: Any) -> np.ndarray:
        raw = arr.view(self.torch.uint8).cpu().numpy()
        return raw.view(host_dtype(self._dtype_of(arr)))

    def _dtype_of(self, arr: Any) -> str:
        name = str(arr.dtype).replace("torch.", "")
        for k, d in DTYPES.items():
            if d.torch == name:
                return k
        raise ValueError(f"unexpected tensor dtype {arr.dtype}")

    def alloc(self, collective: str, total: int, dtype: str) -> Buffers:
        bufs = super().alloc(collective, total, dtype)
        if collective in ("gather", "scatter"):
            n = bufs.layout.count
            for key, src in (("lists", bufs.recv if collective == "gather" else bufs.send),
                             ("ip_lists", bufs.whole)):
                bufs.extra[key] = [src[p * n:(p + 1) * n] for p in range(self.world)]
        return bufs

    def sync(self) -> None:
        if getattr(self, "cuda", False):
            self.torch.cuda.synchronize(self.device)

    # ---- the shared stream and buffers of bench.overhead --------------------------------------
    def use_stream(self, stream: Any) -> None:
        if not self.cuda:
            super().use_stream(stream)
        torch = self.torch
        self.ext_stream = torch.cuda.ExternalStream(int(stream.ptr), device=self.tdevice)
        torch.cuda.set_stream(self.ext_stream)

    def adopt(self, bufs: Buffers) -> Buffers:
        if not self.cuda:
            return super().adopt(bufs)
        keys = ("send", "recv", "whole", "ip_send", "ip_recv")
        tensors = {k: self._over(getattr(bufs, k), k) for k in keys}
        out = Buffers(bufs.collective, bufs.dtype, bufs.layout, **tensors)
        if bufs.collective in ("gather", "scatter"):
            n = out.layout.count
            for key, src in (("lists", out.recv if bufs.collective == "gather" else out.send),
                             ("ip_lists", out.whole)):
                out.extra[key] = [src[p * n:(p + 1) * n] for p in range(self.world)]
        return out

    def _over(self, arr: Any, what: str) -> Any:
        """A tensor over CuPy array ``arr``'s memory (``__cuda_array_interface__``, no copy)."""
        t = self.torch.as_tensor(arr, device=self.tdevice)
        if int(arr.size) and int(t.data_ptr()) != int(arr.data.ptr):
            raise RuntimeError(f"torch copied the {what} buffer ({t.data_ptr():#x} != "
                               f"{int(arr.data.ptr):#x}): the backends would not share memory")
        return t

    # ---- collectives ----------------------------------------------------------------------
    def run(self, collective: str, bufs: Buffers, op: str, root: int, in_place: bool) -> None:
        d = self.dist
        send, recv = bufs.pair(in_place)
        rop = self._ops.get(op, d.ReduceOp.SUM)
        me, n = self.rank, self.world
        if collective in ("all_reduce", "reduce", "broadcast"):
            if not in_place and (collective != "broadcast" or me == root):
                recv.copy_(send)
            if collective == "all_reduce":
                d.all_reduce(recv, op=rop)
            elif collective == "reduce":
                d.reduce(recv, dst=root, op=rop)
            else:
                d.broadcast(recv, src=root)
        elif collective == "all_gather":
            self._all_gather(recv, send)
        elif collective == "reduce_scatter":
            self._reduce_scatter(recv, send, op=rop)
        elif collective == "all_to_all":
            d.all_to_all_single(recv, send)
        elif collective == "gather":
            lists = bufs.extra["ip_lists" if in_place else "lists"]
            d.gather(send, lists if me == root else None, dst=root)
        elif collective == "scatter":
            lists = bufs.extra["ip_lists" if in_place else "lists"]
            d.scatter(recv, lists if me == root else None, src=root)
        elif collective == "send_recv":
            ops = [d.P2POp(d.isend, send, (me + 1) % n), d.P2POp(d.irecv, recv, (me - 1) % n)]
            for w in d.batch_isend_irecv(ops):
                w.wait()
        else:  # pragma: no cover
            raise ValueError(f"collective {collective!r} is not benchmarked")

    # ---- CUDA graphs and events -------------------------------------------------------------
    @property
    def supports_graphs(self) -> bool:  # type: ignore[override]
        return bool(getattr(self, "cuda", False))

    @property
    def supports_events(self) -> bool:  # type: ignore[override]
        return bool(getattr(self, "cuda", False))

    def capture(self, fn: Callable[[], None]) -> Any:
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def replay(self, graph: Any) -> None:
        graph.replay()

    def release(self, graph: Any) -> None:
        graph.reset()       # frees the graph and its exec now, not at garbage collection

    def event_timer(self) -> Tuple[Callable[[], None], Callable[[], float]]:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def begin() -> None:
            start.record()

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return begin, stop

    def event_marks(self, n: int) -> Tuple[Callable[[int], None], Callable[[int, int], float]]:
        if not self.cuda:
            return super().event_marks(n)          # refused: gloo has no CUDA events
        torch = self.torch
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]

        def record(k: int) -> None:
            events[k].record()          # torch's current stream, as event_timer's

        def elapsed(j: int, k: int) -> float:
            events[k].synchronize()
            return events[j].elapsed_time(events[k]) / 1e3

        return record, elapsed
