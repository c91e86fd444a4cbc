"""The per-rank worker of ``ncclpy check``: one case at a time, torch side and ncclpy side.

Every rank walks the same case list.  For each case it builds every rank's seeded input
(:func:`ncclpy.semantics.numerics.verifiable_input`, so each rank can compute the whole reference
locally), runs the collective through torch.distributed and, with a GPU (or on ncclpy's CPU
backend, ``--backend cpu``: torch CPU tensors, ``ncclpy.init(device="cpu")``), through ncclpy on
copies of the same input, and compares its own outputs byte for byte with each other and with
:mod:`ncclpy.reference`.  The rank's whole run (rank 0 gathering the verdicts, the report,
the JSON) is :mod:`ncclpy.check.session`, which imports this module; this module never imports it.

Test-only corruption: ``NCCLPY_CHECK_INJECT="collective:rank[:side[:how]][,...]"`` (rank may be
``*``; side ``torch`` (default), ``ncclpy`` or ``reference``; how ``bit`` (default), ``invert`` or
``sign``) corrupts that side's output on that rank before it is compared: torch's, ncclpy's, or
the reference the harness expects.  It lives here, in the harness, never in the library; a side
the run does not have (ncclpy without a GPU) is refused at start.

Every wait is bounded by ``--timeout``: torch's process group timeout, ncclpy's init and
``Work.wait(timeout=...)``.
"""
from __future__ import annotations

import datetime
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..semantics import numerics as nm
from ..semantics import registry
from ..semantics.dtypes import LOGICAL
from . import cases as C
from . import divergences as D
from .compare import INJECT_ENV, INJECT_KINDS, INJECT_SIDES, compare, corrupt, with_side
from . import exact as X
from .inputs import block_input
from .nccl_log import call_rows

__all__ = ["run_case_torch", "windowed", "WINDOW_COLLECTIVES", "to_torch", "from_torch",
           "case_inputs", "reference_outputs", "INJECT_ENV", "parse_inject", "run_case",
           "run_case_ncclpy", "PHASES", "torch_groups"]


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
    """Every rank's input for ``case`` (of its input kind, :mod:`.inputs`), deterministic in
    (seed, case, rank, block); a case's
    in-place and out-of-place variants have the same inputs (:attr:`Case.input_key`).

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
                parts.append(block_input(case.inputs, case.dtype, k, op=case.op, world_size=n,
                                         seed=seed, rank=s, tag=f"{case.input_key}|{b}",
                                         movement=movement, scalar=case.scalar))
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
                   device: Any, timeout: float = 300.0, group: Any = None) -> Optional[np.ndarray]:
    """Run ``case`` through torch.distributed on this rank; its output (None: no output).
    ``group``: the process group (None: the default one; ``--torch-backend`` runs one group per
    backend, each over every rank, so global ranks are group ranks).  Blocking calls are bounded
    by the process group's timeout, the p2p waits by ``timeout``."""
    name, c = case.dtype, case.count
    g = {"group": group}
    t = to_torch(torch, inp, name, device)
    empty = (lambda k: torch.empty(k, dtype=t.dtype, device=t.device))
    coll = case.collective
    if coll == "all_reduce":
        dist.all_reduce(t, op=_torch_op(dist, case), **g)
        out = t
    elif coll == "reduce":
        dist.reduce(t, dst=case.root, op=_torch_op(dist, case), **g)
        out = t
    elif coll == "broadcast":
        dist.broadcast(t, src=case.root, **g)
        out = t
    elif coll == "all_gather":
        out = empty(n * c)
        if case.in_place:
            mine = out[rank * c:(rank + 1) * c]
            mine.copy_(t)
            dist.all_gather_into_tensor(out, mine, **g)
        else:
            dist.all_gather_into_tensor(out, t, **g)
    elif coll == "reduce_scatter":
        if case.in_place:
            out = t[rank * c:(rank + 1) * c]
        else:
            out = empty(c)
        dist.reduce_scatter_tensor(out, t, op=_torch_op(dist, case), **g)
    elif coll == "all_to_all":
        if case.variant == "uneven":
            counts = C.uneven_counts(c, n)
            send = counts[rank]
            recv = [counts[s][rank] for s in range(n)]
            out = empty(sum(recv))
            dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send, **g)
        else:
            out = empty(n * c)
            dist.all_to_all_single(out, t, **g)
    elif coll == "gather":
        lst = [empty(c) for _ in range(n)] if rank == case.root else None
        dist.gather(t, gather_list=lst, dst=case.root, **g)
        out = torch.cat(lst) if lst is not None else None
    elif coll == "scatter":
        out = empty(c)
        lst = [t[i * c:(i + 1) * c] for i in range(n)] if rank == case.root else None
        dist.scatter(out, scatter_list=lst, src=case.root, **g)
    elif coll == "send_recv":
        out = empty(c)
        ops = [dist.P2POp(dist.isend, t, (rank + 1) % n, **g),
               dist.P2POp(dist.irecv, out, (rank - 1) % n, **g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait(datetime.timedelta(seconds=timeout))
    else:
        raise ValueError(f"no torch call for {coll}")
    if out is None:
        return None
    if str(device) != "cpu":
        torch.cuda.synchronize()
    return from_torch(torch, out, name)


# -- the ncclpy side (GPU, or the CPU backend on host tensors) ---------------------------------
#: ``--window``: the collectives whose buffers every rank holds alike, run on symmetric
#: windows (NCCL memory registered with NCCL_WIN_COLL_SYMMETRIC); gather, scatter and
#: send/recv (buffers on some ranks only) and uneven all_to_all run as without it
WINDOW_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                      "all_to_all")


def windowed(case: C.Case) -> bool:
    """Whether ``--window`` runs ``case``'s ncclpy side on windows."""
    return case.collective in WINDOW_COLLECTIVES and case.variant != "uneven" and case.count > 0


def run_case_ncclpy(torch: Any, comm: Any, case: C.Case, inp: np.ndarray, rank: int, n: int,
                    device: Any, timeout: float = 300.0, window: bool = False,
                    seen: Optional[List[bool]] = None) -> Optional[np.ndarray]:
    """Run ``case`` through the ncclpy communicator on copies of the same input (torch CUDA
    tensors; on the CPU backend, ``device`` "cpu", torch CPU tensors; in-place variants as NCCL
    defines them); the wait is bounded by ``timeout``.
    ``window``: where :func:`windowed`, every buffer is NCCL memory registered as a window
    (every rank the same ones, in the same order), deregistered after the call; ``seen``
    gets, per window, whether NCCL registered it (False: no symmetric support here)."""
    name = case.dtype
    t = to_torch(torch, inp, name, device)
    lg = LOGICAL[name]
    wins: List[Any] = []
    if window and windowed(case):
        from .._nccl.memory import nccl_empty

        def raw(k: int) -> Any:            # k elements of t's dtype in NCCL memory, a window
            b = nccl_empty(k * t.element_size(), "uint8", framework="torch").zero_()
            wins.append(comm.register_window(b))
            return b.view(t.dtype)
        t = raw(t.numel()).copy_(t)
    else:
        raw = None

    def empty(k: int) -> Any:   # zero-filled (an untouched buffer stays recognisable)
        if k == 0:
            return torch.empty(0, dtype=t.dtype, device=t.device)
        if raw is not None:
            return raw(k)
        z = torch.zeros(k * lg.factor, dtype=_int_view(torch, lg.wire.itemsize), device=t.device)
        return z.view(t.dtype)
    try:
        return _ncclpy_call(torch, comm, case, t, empty, rank, n, timeout)
    finally:
        if seen is not None:
            seen.extend(w.registered for w in wins)
        for w in reversed(wins):
            w.close()


def _ncclpy_call(torch: Any, comm: Any, case: C.Case, t: Any, empty: Any, rank: int, n: int,
                 timeout: float) -> Optional[np.ndarray]:
    name, c = case.dtype, case.count
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
        w.wait(timeout=timeout)       # raises a timeout error instead of hanging
    _synchronize(torch, t.device, timeout)
    return None if out is None else from_torch(torch, out, name)


def _synchronize(torch: Any, device: Any, timeout: float) -> None:
    """Wait for every stream of this process: the GPU's, or the CPU backend's queues."""
    if getattr(device, "type", str(device)) == "cpu":
        from ..cpu import synchronize
        synchronize(timeout)
    else:
        torch.cuda.synchronize()


# -- one case -------------------------------------------------------------------------------
def parse_inject(spec: Optional[str]) -> List[tuple]:
    """'all_reduce:1,gather:*:reference:invert' -> [("all_reduce", 1, "torch", "bit"),
    ("gather", None, "reference", "invert")]."""
    out = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        coll, rk, side, how = (part.split(":") + ["", "", ""])[:4]
        side, how = side or "torch", how or "bit"
        if side not in INJECT_SIDES or how not in INJECT_KINDS:
            raise ValueError(f"{INJECT_ENV}: {part!r}: side must be one of "
                             f"{', '.join(INJECT_SIDES)} and how one of {', '.join(INJECT_KINDS)}")
        out.append((registry.get(coll).name, None if rk in ("", "*") else int(rk), side, how))
    return out


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


def _typed_refusal(e: BaseException) -> bool:
    """ncclpy's deliberate refusals (they name what is missing)."""
    from ..errors import UnsupportedError, VersionError
    return isinstance(e, (UnsupportedError, VersionError))


def _shared_inputs(ctx: Dict[str, Any], case: C.Case, n: int, rank: int) -> List[np.ndarray]:
    """The case's inputs, built once for its in-place and out-of-place variants (the last few
    cells are kept: variants and roots interleave); read-only, so no case can change them for
    the next."""
    cache = ctx.setdefault("_inputs", {})
    ins = cache.get(case.input_key)
    if ins is None:
        ins = case_inputs(case, n, ctx["seed"], rank)
        for a in ins:
            a.setflags(write=False)
        if len(cache) >= 8:
            cache.pop(next(iter(cache)))
        cache[case.input_key] = ins
    return ins


#: the phases of a case whose seconds a run adds up (``ctx["phases"]``, the JSON's ``phases_s``):
#: building the inputs, the reference, the torch side, the ncclpy side, the comparisons; the
#: session adds "sync" (gathering the verdicts at rank 0)
PHASES = ("inputs", "reference", "torch", "ncclpy", "compare", "sync")


def run_case(ctx: Dict[str, Any], case: C.Case) -> Dict[str, Any]:
    """This rank's verdicts for ``case`` (a small dict that rank 0 gathers).  The seconds of
    each phase are added to ``ctx["phases"]`` (see :data:`PHASES`)."""
    torch, dist = ctx["torch"], ctx["dist"]
    n, rank, tmo = ctx["n"], ctx["rank"], float(ctx.get("timeout", 300.0))
    ph = ctx.setdefault("phases", dict.fromkeys(PHASES, 0.0))
    clock = time.perf_counter
    res: Dict[str, Any] = {"rank": rank}
    if case.collective == "barrier":
        return _run_barrier(ctx)
    t = clock()
    ins = _shared_inputs(ctx, case, n, rank)
    t1 = clock()
    ref = reference_outputs(case, ins, n)[rank]
    ph["inputs"] += t1 - t
    ph["reference"] += clock() - t1
    torch_ref = ref
    family = C.torch_family(ctx["backend"])
    if case.collective == "reduce" and rank != case.root:
        # torch's reduce is in place by nature; NCCL leaves non-roots untouched, gloo uses
        # them as scratch (undefined in torch's contract)
        torch_ref = ins[rank] if family == "nccl" else None
    true_torch_ref = torch_ref          # kept from the reference-side corruption below
    n_out = None
    ex = X.for_case(ctx, case)          # NCCL's order where the model predicts the call
    skip = C.torch_not_called(ctx["backend"], case)
    sides: Dict[str, List[Any]] = {}    # torch backend -> [its output, its verdicts]
    tail = ctx.get("nccl_tail") if ex.kind == X.NCCL_ORDER else None
    if tail is not None:                # rank 0 on a GPU: the lines of torch's calls
        tail.skip()
    t = clock()
    for bname, group in torch_groups(ctx):
        part: Dict[str, Any] = {}
        t_out = None
        if skip is not None:
            part["torch_not_called"] = skip
        else:
            try:
                t_out = run_case_torch(torch, dist, case, ins[rank], rank, n, ctx["device"], tmo,
                                       group)
            except Exception as e:  # noqa: BLE001 - classified at rank 0 (refusal or error)
                part["torch_exc"] = _short(e)
                if ctx.get("verbose"):
                    traceback.print_exc()
        sides[bname] = [t_out, part]
    t1 = clock()
    ph["torch"] += t1 - t
    if tail is not None:                # then those of this ncclpy call
        res["torch_nccl_calls"] = call_rows(tail.calls())
    if ctx.get("comm") is not None:
        try:
            n_out = run_case_ncclpy(torch, ctx["comm"], case, ins[rank], rank, n, ctx["device"],
                                    tmo, bool(ctx.get("window")),
                                    ctx.setdefault("window_seen", []))
        except Exception as e:  # noqa: BLE001
            res["ncclpy_exc"], res["ncclpy_typed"] = _short(e), _typed_refusal(e)
            if ctx.get("verbose"):
                traceback.print_exc()
    if tail is not None:
        res["nccl_calls"] = call_rows(tail.calls())
    t = clock()
    ph["ncclpy"] += t - t1
    ref_how = None
    for coll, rk, side, how in ctx["inject"]:
        if coll != case.collective or rk not in (None, rank):
            continue
        if side == "torch" and any(o is not None and o.size for o, _ in sides.values()):
            for sd in sides.values():
                if sd[0] is not None and sd[0].size:
                    sd[0] = corrupt(sd[0], how)
        elif side == "ncclpy" and n_out is not None and n_out.size:
            n_out = corrupt(n_out, how)
        elif side == "reference" and ref is not None and ref.size:
            same = torch_ref is ref
            ref, ref_how = corrupt(ref, how), how
            torch_ref = ref if same else (None if torch_ref is None else corrupt(torch_ref, how))
        else:
            continue
        res["injected"] = f"{side}:{how}"
    name = case.dtype
    div = D.divergence(family, case, n)
    predicted = div is not None and any(o is not None for o, _ in sides.values())
    pred = D.predicted_outputs(div, case, ins, n, family, rank=rank)[rank] \
        if predicted else None          # None also where the prediction leaves it undefined
    for t_out, part in sides.values():
        part["t_ref"] = compare(t_out, torch_ref, name).as_dict()
        if predicted and t_out is not None:
            part["t_pred"] = compare(t_out, pred, name).as_dict()
            # whether the divergence shows on these inputs at all (prediction != NCCL semantics)
            part["p_ref"] = compare(pred, true_torch_ref, name).as_dict()
        if ctx.get("comm") is not None:
            # only where both sides have a defined output (e.g. not an out-of-place reduce's
            # non-root buffer, which NCCL never writes)
            both = ref is not None and torch_ref is not None
            part["n_t"] = compare(n_out if both else None, t_out, name).as_dict()
    if ctx.get("comm") is not None:
        res["n_ref"] = compare(n_out, ref, name).as_dict()
    X.judge_rank(ctx, case, ex, ins, ref, torch_ref, n_out, list(sides.values()), res,
                 ref_how)
    _put_sides(res, {b: sd[1] for b, sd in sides.items()})
    ph["compare"] += clock() - t
    return res


def torch_groups(ctx: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """(torch backend name, process group) of every torch side of the run: the default group
    alone, or with ``--torch-backend a,b`` one group per backend (the session sets them)."""
    return ctx.get("torch_groups") or [(ctx["backend"], None)]


def _put_sides(res: Dict[str, Any], parts: Dict[str, Dict[str, Any]]) -> None:
    """One torch side: its verdicts in ``res`` itself (as before ``--torch-backend``); several:
    under ``res["by_torch_backend"][name]`` (:func:`ncclpy.check.compare.backend_parts`
    takes them apart at rank 0)."""
    if len(parts) == 1:
        res.update(with_side(res, next(iter(parts.values()))))
    else:
        res["by_torch_backend"] = parts


def _run_barrier(ctx: Dict[str, Any]) -> Dict[str, Any]:
    """E29's check: rank r arrives r*50 ms late; nobody may leave before the last arrival
    (through every torch backend of the run, then ncclpy)."""
    dist, rank = ctx["dist"], ctx["rank"]
    res: Dict[str, Any] = {"rank": rank, "barrier": {}}
    parts: Dict[str, Dict[str, Any]] = {}
    sides: List[Tuple[str, str, Any]] = [("torch", b, g) for b, g in torch_groups(ctx)]
    if ctx.get("comm") is not None:
        sides.append(("ncclpy", "", None))
    for side, bname, group in sides:
        into = parts.setdefault(bname, {"barrier": {}}) if side == "torch" else res
        time.sleep(0.05 * rank)
        t_in = time.time()
        try:
            if side == "torch":
                dist.barrier(group=group)
            else:
                ctx["comm"].barrier()
        except Exception as e:  # noqa: BLE001
            into[f"{side}_error"] = _short(e)
        into["barrier"][side] = (t_in, time.time())
        dist.barrier(group=ctx["ctrl"])
    _put_sides(res, parts)
    return res
