"""The per-rank worker of ``ncclpy check``: one case at a time, torch side and ncclpy side.

Every rank walks the same case list.  For each case it builds every rank's seeded input
(:func:`ncclpy.numerics.verifiable_input`, so each rank can compute the whole reference
locally), runs the collective through torch.distributed and, with a GPU, through ncclpy on
copies of the same input, and compares its own outputs byte for byte with each other and with
:mod:`ncclpy.reference`.  Rank 0 gathers the per-rank verdicts over a gloo group, prints the table
line, and at the end the summary and the JSON.

Test-only corruption: ``NCCLPY_CHECK_INJECT="collective:rank[,collective:rank...]"`` (rank may be
``*``) flips one bit of *torch's* output on that rank before it is compared.  It lives here, in
the harness, never in the library.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np

from .. import numerics as nm
from .. import registry
from ..dtypes import LOGICAL
from . import cases as C
from . import report as R
from .compare import INJECT_ENV, compare, flip_one_bit, merge

__all__ = ["worker", "run_case_torch", "to_torch", "from_torch", "case_inputs",
           "reference_outputs", "INJECT_ENV", "parse_inject"]



# -- numpy <-> torch ------------------------------------------------------------------------
def _torch_dtype(torch: Any, name: str) -> Any:
    lg = LOGICAL[name]
    if name in ("bool", "complex32", "complex64", "complex128"):
        return getattr(torch, name)
    return getattr(torch, lg.wire.torch)


def _int_view(torch: Any, itemsize: int) -> Any:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def to_torch(torch: Any, arr: np.ndarray, name: str, device: Any = "cpu") -> Any:
    """A 1-D torch tensor of logical dtype ``name`` holding exactly the bits of ``arr``."""
    lg = LOGICAL[name]
    bits = nm.as_bits(arr, name).reshape(-1)
    if bits.size == 0:  # torch cannot view an empty tensor as a wider dtype
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "ComplexHalf support is experimental"
            return torch.empty(0, dtype=_torch_dtype(torch, name), device=device)
    signed = bits.view(f"int{8 * lg.wire.itemsize}") if lg.wire.itemsize > 1 else bits
    t = torch.from_numpy(signed.copy()).view(_torch_dtype(torch, name))
    return t.to(device) if str(device) != "cpu" else t


def from_torch(torch: Any, t: Any, name: str) -> np.ndarray:
    """The logical numpy array of a torch tensor (bits preserved; bf16/fp8 as uint views)."""
    lg = LOGICAL[name]
    t = t.detach().contiguous().cpu().reshape(-1)
    if t.numel() == 0:
        bits = np.zeros(0, dtype=lg.wire.view)
    else:
        bits = t.view(_int_view(torch, lg.wire.itemsize)).numpy().view(lg.wire.view)
    if name == "complex32":
        return bits.view(np.float16).reshape(-1, 2)
    return nm.from_bits(bits, name)


# -- inputs and reference -------------------------------------------------------------------
def _blocks(case: C.Case, n: int, rank: int) -> List[int]:
    """Element counts of the blocks rank ``rank``'s input is made of."""
    coll, c = case.collective, case.count
    if coll in ("reduce_scatter", "scatter"):
        return [c] * n
    if coll == "all_to_all":
        return C.uneven_counts(c, n)[rank] if case.variant == "uneven" else [c] * n
    return [c]


def _needed(case: C.Case, n: int, me: Optional[int], s: int, b: int) -> bool:
    """Whether rank ``me`` needs block b of rank s's input (for its own run or its reference
    output); ``me`` None: every block."""
    if me is None or s == me:
        return True
    coll, root = case.collective, case.root
    if coll in ("all_reduce", "all_gather"):
        return True
    if coll in ("reduce", "gather"):
        return me == root
    if coll == "broadcast":
        return s == root
    if coll in ("reduce_scatter", "all_to_all"):
        return b == me
    if coll == "scatter":
        return s == root and b == me
    if coll == "send_recv":
        return s == (me - 1) % n
    return True


def case_inputs(case: C.Case, n: int, seed: int, rank: Optional[int] = None) -> List[np.ndarray]:
    """Every rank's input for ``case``, deterministic in (seed, case, rank, block).

    With ``rank`` given, only the blocks that rank needs (its own input, and what its reference
    output depends on) are generated; the rest are zeros, which cannot change that rank's
    reference output.  This keeps n ranks from each generating n full inputs.
    """
    movement = case.op is None
    lg = LOGICAL[case.dtype]
    out = []
    for s in range(n):
        parts = []
        for b, k in enumerate(_blocks(case, n, s)):
            if _needed(case, n, rank, s, b):
                parts.append(nm.verifiable_input(case.dtype, k, op=case.op, world_size=n,
                                                 seed=seed, rank=s, tag=f"{case.key}|{b}",
                                                 random_bits=movement))
            else:
                shape = (k, 2) if case.dtype == "complex32" else (k,)
                parts.append(nm.from_bits(np.zeros(k * lg.factor, lg.wire.view), case.dtype)
                             .reshape(shape) if case.dtype != "complex32"
                             else np.zeros(shape, np.float16))
        out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
    return out


def reference_outputs(case: C.Case, inputs: List[np.ndarray], n: int) -> list:
    """Per-rank reference outputs for ``case`` (registry -> ncclpy.reference)."""
    kw: Dict[str, Any] = {"dtype": case.dtype, "world_size": n, "in_place": case.in_place}
    if case.op is not None:
        kw["op"] = case.op_obj()
    if case.root is not None:
        kw["root"] = case.root
    if case.variant == "uneven":
        kw["send_counts"] = C.uneven_counts(case.count, n)
    return registry.get(case.collective).ref(inputs, **kw)


# -- the torch side -------------------------------------------------------------------------
def _torch_op(dist: Any, case: C.Case) -> Any:
    if case.op == "premul_sum":
        return dist._make_nccl_premul_sum(case.scalar)
    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}[case.op]


def run_case_torch(torch: Any, dist: Any, case: C.Case, inp: np.ndarray, rank: int, n: int,
                   device: Any) -> Optional[np.ndarray]:
    """Run ``case`` through torch.distributed on this rank; its output (None: no output)."""
    name, c = case.dtype, case.count
    t = to_torch(torch, inp, name, device)
    empty = (lambda k: torch.empty(k, dtype=t.dtype, device=t.device))
    coll = case.collective
    if coll == "all_reduce":
        dist.all_reduce(t, op=_torch_op(dist, case))
        out = t
    elif coll == "reduce":
        dist.reduce(t, dst=case.root, op=_torch_op(dist, case))
        out = t
    elif coll == "broadcast":
        dist.broadcast(t, src=case.root)
        out = t
    elif coll == "all_gather":
        out = empty(n * c)
        if case.in_place:
            mine = out[rank * c:(rank + 1) * c]
            mine.copy_(t)
            dist.all_gather_into_tensor(out, mine)
        else:
            dist.all_gather_into_tensor(out, t)
    elif coll == "reduce_scatter":
        if case.in_place:
            out = t[rank * c:(rank + 1) * c]
        else:
            out = empty(c)
        dist.reduce_scatter_tensor(out, t, op=_torch_op(dist, case))
    elif coll == "all_to_all":
        if case.variant == "uneven":
            counts = C.uneven_counts(c, n)
            send = counts[rank]
            recv = [counts[s][rank] for s in range(n)]
            out = empty(sum(recv))
            dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send)
        else:
            out = empty(n * c)
            dist.all_to_all_single(out, t)
    elif coll == "gather":
        lst = [empty(c) for _ in range(n)] if rank == case.root else None
        dist.gather(t, gather_list=lst, dst=case.root)
        out = torch.cat(lst) if lst is not None else None
    elif coll == "scatter":
        out = empty(c)
        lst = [t[i * c:(i + 1) * c] for i in range(n)] if rank == case.root else None
        dist.scatter(out, scatter_list=lst, src=case.root)
    elif coll == "send_recv":
        out = empty(c)
        ops = [dist.P2POp(dist.isend, t, (rank + 1) % n),
               dist.P2POp(dist.irecv, out, (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    else:
        raise ValueError(f"no torch call for {coll}")
    if out is None:
        return None
    if str(device) != "cpu":
        torch.cuda.synchronize()
    return from_torch(torch, out, name)


# -- the ncclpy side (GPU) ------------------------------------------------------------------
def run_case_ncclpy(torch: Any, comm: Any, case: C.Case, inp: np.ndarray, rank: int, n: int,
                    device: Any) -> Optional[np.ndarray]:
    """Run ``case`` through the ncclpy communicator on copies of the same input (torch CUDA
    tensors; in-place variants as NCCL defines them)."""
    name, c = case.dtype, case.count
    t = to_torch(torch, inp, name, device)
    lg = LOGICAL[name]

    def empty(k: int) -> Any:   # zero-filled (an untouched buffer stays recognisable)
        if k == 0:
            return torch.empty(0, dtype=t.dtype, device=t.device)
        z = torch.zeros(k * lg.factor, dtype=_int_view(torch, lg.wire.itemsize), device=t.device)
        return z.view(t.dtype)
    coll, ip, op = case.collective, case.in_place, case.op_obj()
    out = None
    if coll == "all_reduce":
        out = t if ip else empty(c)
        w = comm.all_reduce(t, None if ip else out, op=op)
    elif coll == "reduce":
        out = t if ip else empty(c)
        w = comm.reduce(t, None if ip else out, root=case.root, op=op)
    elif coll == "broadcast":
        out = t if ip else empty(c)
        w = comm.broadcast(t, None if ip else out, root=case.root)
    elif coll == "all_gather":
        out = empty(n * c)
        if ip:
            out[rank * c:(rank + 1) * c].copy_(t)
            w = comm.all_gather(None, out)
        else:
            w = comm.all_gather(t, out)
    elif coll == "reduce_scatter":
        if ip:
            out = t[rank * c:(rank + 1) * c]
            w = comm.reduce_scatter(t, None, op=op)
        else:
            out = empty(c)
            w = comm.reduce_scatter(t, out, op=op)
    elif coll == "all_to_all":
        if case.variant == "uneven":
            counts = C.uneven_counts(c, n)
            recv = [counts[s][rank] for s in range(n)]
            out = empty(sum(recv))
            w = comm.all_to_all(t, out, send_counts=counts[rank], recv_counts=recv)
        elif ip:
            out = t
            w = comm.all_to_all(t, None)
        else:
            out = empty(n * c)
            w = comm.all_to_all(t, out)
    elif coll == "gather":
        if rank == case.root:
            out = empty(n * c)
            if ip:
                out[rank * c:(rank + 1) * c].copy_(t)
                w = comm.gather(out[rank * c:(rank + 1) * c], out, root=case.root)
            else:
                w = comm.gather(t, out, root=case.root)
        else:
            w = comm.gather(t, None, root=case.root)
    elif coll == "scatter":
        if rank == case.root and ip:
            out = t[rank * c:(rank + 1) * c]
            w = comm.scatter(t, out, root=case.root)
        else:
            out = empty(c)
            w = comm.scatter(t if rank == case.root else None, out, root=case.root)
    elif coll == "send_recv":
        out = empty(c)
        w = comm.send_recv(t, out, (rank + 1) % n, (rank - 1) % n)
    else:
        raise ValueError(f"no ncclpy call for {coll}")
    if w is not None and hasattr(w, "wait"):
        w.wait()
    torch.cuda.synchronize()
    return None if out is None else from_torch(torch, out, name)


# -- one case -------------------------------------------------------------------------------
def parse_inject(spec: Optional[str]) -> List[tuple]:
    """'all_reduce:1,gather:*' -> [("all_reduce", 1), ("gather", None)]."""
    out = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        coll, _, rk = part.partition(":")
        out.append((registry.get(coll).name, None if rk in ("", "*") else int(rk)))
    return out


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:200]


def _unsupported_error(e: BaseException) -> bool:
    from ..errors import UnsupportedError, VersionError
    return isinstance(e, (UnsupportedError, VersionError, NotImplementedError))


def run_case(ctx: Dict[str, Any], case: C.Case) -> Dict[str, Any]:
    """This rank's verdicts for ``case`` (a small dict that rank 0 gathers)."""
    torch, dist = ctx["torch"], ctx["dist"]
    n, rank = ctx["n"], ctx["rank"]
    res: Dict[str, Any] = {"rank": rank}
    if case.collective == "barrier":
        return _run_barrier(ctx)
    ins = case_inputs(case, n, ctx["seed"], rank)
    refs = reference_outputs(case, ins, n)
    ref = refs[rank]
    torch_ref = ref
    if case.collective == "reduce" and rank != case.root:
        # torch's reduce is in place by nature; NCCL leaves non-roots untouched, gloo uses
        # them as scratch (undefined in torch's contract)
        torch_ref = ins[rank] if ctx["backend"] == "nccl" else None
    t_out = n_out = None
    try:
        t_out = run_case_torch(torch, dist, case, ins[rank], rank, n, ctx["device"])
    except Exception as e:  # noqa: BLE001 - reported per case
        key = "torch_unsupported" if ctx["backend"] == "nccl" else "torch_error"
        res[key] = _short(e)
    for coll, rk in ctx["inject"]:
        if coll == case.collective and rk in (None, rank) and t_out is not None:
            t_out = flip_one_bit(t_out)
            res["injected"] = True
    if ctx.get("comm") is not None:
        try:
            n_out = run_case_ncclpy(torch, ctx["comm"], case, ins[rank], rank, n, ctx["device"])
        except Exception as e:  # noqa: BLE001
            res["ncclpy_unsupported" if _unsupported_error(e) else "ncclpy_error"] = _short(e)
            if ctx.get("verbose"):
                traceback.print_exc()
    name = case.dtype
    res["t_ref"] = compare(t_out, torch_ref, name).as_dict()
    if ctx.get("comm") is not None:
        res["n_ref"] = compare(n_out, ref, name).as_dict()
        # only where both sides have a defined output (e.g. not an out-of-place reduce's
        # non-root buffer, which NCCL never writes)
        both = ref is not None and torch_ref is not None
        res["n_t"] = compare(n_out if both else None, t_out, name).as_dict()
    return res


def _run_barrier(ctx: Dict[str, Any]) -> Dict[str, Any]:
    """E29's check: rank r arrives r*50 ms late; nobody may leave before the last arrival."""
    dist, rank = ctx["dist"], ctx["rank"]
    res: Dict[str, Any] = {"rank": rank, "barrier": {}}
    for side in ("torch", "ncclpy"):
        if side == "ncclpy" and ctx.get("comm") is None:
            continue
        time.sleep(0.05 * rank)
        t_in = time.time()
        try:
            if side == "torch":
                dist.barrier()
            else:
                ctx["comm"].barrier()
        except Exception as e:  # noqa: BLE001
            res[f"{side}_error"] = _short(e)
        res["barrier"][side] = (t_in, time.time())
        dist.barrier(group=ctx["ctrl"])
    return res


# -- the worker -----------------------------------------------------------------------------
def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _setup_torch(rank: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)   # reduce_scatter_tensor et al.
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
    import torch
    import torch.distributed as dist
    n, backend = cfg["world_size"], cfg["backend"]
    timeout = datetime.timedelta(seconds=float(cfg.get("timeout", 300)))
    ctx: Dict[str, Any] = {"torch": torch, "dist": dist, "n": n, "rank": rank, "backend": backend,
                           "seed": int(cfg.get("seed", 0)), "device": "cpu", "comm": None,
                           "verbose": cfg.get("verbose", False),
                           "inject": parse_inject(os.environ.get(INJECT_ENV))}
    header: Dict[str, Any] = {"world_size": n, "backend": backend, "torch": torch.__version__,
                              "seed": ctx["seed"], "pinned": cfg.get("pinned", []),
                              "kept": cfg.get("kept", [])}
    if backend == "nccl":
        ndev = torch.cuda.device_count()
        dev = int(os.environ.get("NCCLPY_DEVICE") or os.environ.get("LOCAL_RANK") or rank) % ndev
        torch.cuda.set_device(dev)
        ctx["device"] = torch.device("cuda", dev)
        dist.init_process_group("nccl", rank=rank, world_size=n, timeout=timeout,
                                device_id=ctx["device"])
        ctx["ctrl"] = dist.new_group(backend="gloo", timeout=timeout)
        x = torch.ones(1, device=ctx["device"])
        dist.all_reduce(x)
        torch.cuda.synchronize()
        from .._nccl.lib import loaded_nccl_paths
        header["torch_libnccl"] = loaded_nccl_paths()
        tv = torch.cuda.nccl.version()
        header["torch_nccl_version"] = (".".join(str(v) for v in tv) if isinstance(tv, tuple)
                                        else str(tv))
        header["device"] = torch.cuda.get_device_name(dev)
        ok = True
        try:
            import ncclpy
            ctx["comm"] = ncclpy.init()
            from .._nccl.lib import get_lib
            from ..ops import format_version
            header["ncclpy_libnccl"] = get_lib().path
            header["ncclpy_nccl_version"] = format_version(ctx["comm"].nccl_version)
        except Exception as e:  # noqa: BLE001 - reported in the header, the torch side still runs
            ok = False
            header["ncclpy_error"] = _short(e)
        flags: List[Any] = [None] * n
        dist.all_gather_object(flags, ok, group=ctx["ctrl"])
        if not all(flags) and ctx["comm"] is not None:
            header.setdefault("ncclpy_error", "ncclpy.init failed on another rank")
            ctx["comm"] = None
        header["all_libnccl"] = loaded_nccl_paths()
        env_keys = sorted(k for k in os.environ if k.startswith(("NCCL_", "TORCH_NCCL_"))
                          or k == "ENABLE_INTRA_NODE_COMM")
        header["nccl_env"] = {k: os.environ[k] for k in env_keys}
    else:
        dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timeout)
        ctx["ctrl"] = dist.group.WORLD
        header["ncclpy_error"] = cfg.get("no_gpu_reason") or "no GPU: the ncclpy column needs one"
    ctx["header"] = header
    return ctx


def _print_header(ctx: Dict[str, Any], ncases: int, skipped: List[dict]) -> None:
    h = ctx["header"]
    _emit(f"ncclpy check: {h['world_size']} ranks, torch {h['torch']} backend {h['backend']}, "
          f"seed {h['seed']}, {ncases} cases, {len(skipped)} combinations skipped")
    if h["backend"] == "nccl":
        _emit(f"  device: {h.get('device')}")
        _emit(f"  torch libnccl:  {', '.join(h.get('torch_libnccl') or ['?'])} "
              f"(NCCL {h.get('torch_nccl_version')})")
        if "ncclpy_libnccl" in h:
            _emit(f"  ncclpy libnccl: {h['ncclpy_libnccl']} (NCCL {h.get('ncclpy_nccl_version')})")
            same = len(h.get("all_libnccl") or []) == 1
            both = "yes" if same else "NO: " + str(h["all_libnccl"])
            _emit(f"  same libnccl on both sides: {both}")
        pinned = ", ".join(h.get("pinned") or []) or "nothing"
        _emit(f"  pinned for both sides: {pinned}")
        if h.get("kept"):
            _emit(f"  kept from your environment: {', '.join(h['kept'])}")
        _emit("  NCCL env: " + (" ".join(f"{k}={v}" for k, v in h.get("nccl_env", {}).items())
                                or "(none)"))
    if h.get("ncclpy_error"):
        _emit(f"  ncclpy column: needs GPU ({h['ncclpy_error']})")
    if skipped and h["backend"] == "gloo":
        _emit("  skipped: what gloo refuses (see --list-skips for each reason)")
    _emit("  exact inputs (integers; floats = integer mantissas x 2^-2) are compared bit for "
          "bit; otherwise the max ULP must stay <= world_size")
    _emit(R.format_header_row())


def worker(rank: int, cfg: Dict[str, Any]) -> int:
    """Run the whole matrix as ``rank``; returns the exit code (the same on every rank)."""
    os.environ.update({k: str(v) for k, v in (cfg.get("env") or {}).items()})
    t0 = time.time()
    ctx = _setup_torch(rank, cfg)
    dist = ctx["dist"]
    cases, skipped = C.build_matrix(
        ctx["n"], backend=ctx["backend"], collectives=cfg.get("collectives"),
        dtypes=cfg.get("dtypes"), ops=cfg.get("ops"), sizes=cfg.get("sizes"),
        roots=cfg.get("roots"), in_place=cfg.get("in_place"),
        premul_scalar=cfg.get("premul_scalar", C.PREMUL_SCALAR))
    quiet = cfg.get("quiet", False)
    if rank == 0:
        _print_header(ctx, len(cases), skipped)
    records: List[Dict[str, Any]] = []
    for case in cases:
        part = run_case(ctx, case)
        parts: Optional[List[Any]] = [None] * ctx["n"] if rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=ctx["ctrl"])
        if rank == 0:
            rec = merge(case, parts, ctx)
            records.append(rec)
            if not quiet or rec["status"] not in ("pass",):
                _emit(R.format_row(rec))
    rc = 0
    if rank == 0:
        counts = R.summarize(records, len(skipped))
        rc = 1 if counts["failed"] else 0
        _emit(R.summary_line(counts, time.time() - t0, ctx["backend"], ctx["n"]))
        doc = {"header": ctx["header"], "summary": counts, "exit_code": rc,
               "seconds": round(time.time() - t0, 3), "cases": records, "skipped": skipped}
        if cfg.get("json"):
            R.write_json(cfg["json"], doc)
        if cfg.get("result_file"):
            R.write_json(cfg["result_file"], {"exit_code": rc, "summary": counts})
    box = [rc]
    dist.broadcast_object_list(box, src=0, group=ctx["ctrl"])
    if ctx.get("comm") is not None:
        try:
            ctx["comm"].close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    dist.destroy_process_group()
    return int(box[0])


def spawn_entry(rank: int, cfg: Dict[str, Any]) -> None:
    """Entry point for :func:`ncclpy.spawn` / multiprocessing children (exit code via file)."""
    worker(rank, cfg)
