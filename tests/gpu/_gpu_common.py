"""Shared by the GPU test workers (ranks started by :func:`ncclpy.spawn`).

Each worker records one JSON line per check in ``<outdir>/rank<r>.jsonl`` as it goes (so a crash
or a hang still leaves the record of what ran), and after every check the ranks agree through
the bootstrap store whether all of them passed; when one did not, the communicator is aborted
and a fresh one is created, so a failure cannot desynchronise the checks that follow.  A
watchdog ends a rank whose check makes no progress for ``HANG_S`` seconds.

Inputs are small integers (and quarters) that every dtype holds exactly, and every partial sum
or product stays exactly representable, so results are compared for equality with values
computed here in numpy.  The one exception: ``avg`` of floats on a world size that is not a
power of two (NCCL pre-multiplies by 1/n, which rounds), compared with a per-dtype tolerance.
"""
from __future__ import annotations

import json
import os
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from _op_rules import must_work

HANG_S = 150.0
WAIT_S = 60.0
OPS = ("sum", "prod", "max", "min", "avg", "premul_sum")
PREMUL_SCALAR = 2.0
CUPY_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bool", "complex64", "complex128")
RAW_DTYPES = ("bfloat16", "float8_e4m3", "float8_e5m2")   # CuPy has no such dtype: ncclpy.Buffer
ALL_DTYPES = CUPY_DTYPES + RAW_DTYPES


class Skip(Exception):
    """A check that does not apply here (recorded as ok with the reason)."""


def need_nccl(s: Any, code: int, what: str) -> None:
    """Skip the check where the session's NCCL predates ``code``, in the words the GPU ledger
    reads as "skipped for its NCCL version" (``NCCL 2.28.9 < 2.29.2: ...``)."""
    if s.comm.nccl_version < code:
        from ncclpy.semantics.ops import format_version as fmt
        raise Skip(f"NCCL {fmt(s.comm.nccl_version)} < {fmt(code)}: {what} needs it")


# -- recording ----------------------------------------------------------------------------

class Recorder:
    """One JSON line per check in ``<outdir>/rank<r>.jsonl``, and a watchdog thread that ends
    the rank when a check makes no progress for ``hang_s``.  :meth:`close` ends both: a pooled
    rank (tests/rank_pool.py) runs many workers, one after another."""

    def __init__(self, outdir: str, rank: int, hang_s: float = HANG_S) -> None:
        self._f = open(os.path.join(outdir, f"rank{rank}.jsonl"), "a", buffering=1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.current: Optional[str] = None
        self.started = 0.0
        self.hang_s = hang_s
        threading.Thread(target=self._watch, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._f.close()

    def write(self, rec: Dict[str, Any]) -> None:
        with self._lock:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            cur, t0 = self.current, self.started
            if cur is not None and time.monotonic() - t0 > self.hang_s:
                self.write({"name": cur, "ok": False,
                            "error": f"HANG: no progress for {self.hang_s:g} s"})
                os._exit(3)

    def run(self, name: str, fn: Callable, *args: Any) -> bool:
        self.started = time.monotonic()
        self.current = name
        rec: Dict[str, Any] = {"name": name, "ok": True}
        try:
            fn(*args)
        except Skip as e:
            rec["skip"] = str(e)
        except BaseException:  # noqa: B902 - recorded, the session recovers
            rec = {"name": name, "ok": False, "error": traceback.format_exc(limit=12)[-5000:]}
        rec["s"] = round(time.monotonic() - self.started, 4)
        self.current = None
        self.write(rec)
        return rec["ok"]


class Session:
    """This rank's communicator, the store, and the check/agree/recover loop."""

    def __init__(self, rank: int, outdir: str, name: str, hang_s: float = HANG_S) -> None:
        import cupy
        import ncclpy
        self.ncclpy = ncclpy
        self.rec = Recorder(outdir, rank, hang_s)
        self.name = name
        self.gen = 0
        self.k = 0
        self.comm = ncclpy.init(name=f"{name}.0")
        self.rank = self.comm.rank
        self.n = self.comm.world_size
        self.dev = self.comm.device
        self.store = self.comm.bootstrap.store
        cupy.cuda.Device(self.dev).use()
        cc = int(cupy.cuda.Device(self.dev).compute_capability)
        self.fp8_reductions = cc >= 90
        self.rec.write({"name": "_info", "ok": True, "rank": self.rank, "n": self.n,
                        "device": self.dev, "nccl": self.comm.nccl_version, "cc": cc})

    def agree(self, tag: str, ok: bool) -> bool:
        key = f"ncclpy-gpu-test/{self.name}/{tag}"
        self.store.set(f"{key}/{self.rank}", b"1" if ok else b"0")
        return all(self.store.get(f"{key}/{r}") == b"1" for r in range(self.n))

    def check(self, name: str, fn: Callable, *args: Any) -> bool:
        ok = self.rec.run(name, fn, self, *args)
        self.k += 1
        if not self.agree(str(self.k), ok):
            self.recover()
        return ok

    def recover(self) -> None:
        try:
            self.comm.abort()
        except Exception as e:  # recorded, then carry on with a fresh communicator
            self.rec.write({"name": "_abort", "ok": False, "error": repr(e)})
        self.gen += 1
        self.comm = self.ncclpy.init(name=f"{self.name}.{self.gen}")

    def finish(self) -> None:
        self.agree("done", True)   # rank 0 hosts the store: nobody leaves before all are done
        try:
            self.comm.close()
        except Exception as e:
            self.rec.write({"name": "_close", "ok": False, "error": repr(e)})
        self.rec.close()


def warm_up(rank: int) -> None:
    """A pooled rank's one-time start-up (tests/rank_pool.py): the imports and the CUDA context
    every worker would otherwise pay for.  Best effort: without a GPU it warms what it can."""
    import ncclpy.comm  # noqa: F401 - the communicator's modules
    try:
        import torch  # noqa: F401 - several workers use it; importing it takes seconds
    except Exception:  # noqa: BLE001 - not installed: the workers that need it say so
        pass
    try:
        import cupy
        cupy.cuda.Device(int(os.environ.get("NCCLPY_DEVICE", "0"))).use()
        cupy.zeros(1)                   # creates the context on this rank's device
    except Exception:  # noqa: BLE001 - no CUDA here: the workers skip or fail with the reason
        pass


# -- dtypes: host encoding, device placement, expected values -----------------------------

def _fp8_table(exp_bits: int, man_bits: int, bias: int, fn: bool) -> np.ndarray:
    vals = np.zeros(256)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if fn and e == (1 << exp_bits) - 1 and m == (1 << man_bits) - 1:
            vals[b] = np.nan
        elif not fn and e == (1 << exp_bits) - 1:
            vals[b] = np.nan if m else s * np.inf
        elif e == 0:
            vals[b] = s * (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            vals[b] = s * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return vals


_FP8 = {"float8_e4m3": _fp8_table(4, 3, 7, True), "float8_e5m2": _fp8_table(5, 2, 15, False)}


class DT:
    """One dtype: its kind, how it is stored on the device, exact encode/decode."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.raw = name in RAW_DTYPES
        if name == "bool":
            self.kind = "bool"
        elif name.startswith("complex"):
            self.kind = "complex"
        elif name.startswith("float") or name == "bfloat16":
            self.kind = "float"
        elif name.startswith("uint"):
            self.kind = "uint"
        else:
            self.kind = "int"
        raw_storage = {"bfloat16": np.uint16, "float8_e4m3": np.uint8, "float8_e5m2": np.uint8}
        self.storage = raw_storage[name] if self.raw else np.dtype(name).type
        self.signed = self.kind in ("int", "float", "complex")

    def encode(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v)
        if self.name == "bfloat16":
            f = v.astype(np.float32)
            bits = (f.view(np.uint32) >> 16).astype(np.uint16)
            assert np.array_equal(self.decode(bits), f.astype(np.float64)), "not exact in bf16"
            return bits
        if self.name in _FP8:
            table = _FP8[self.name]
            out = np.empty(v.shape, np.uint8)
            for idx, x in np.ndenumerate(v.astype(np.float64)):
                hits = np.nonzero(table == x)[0]
                assert len(hits), f"{x} is not exact in {self.name}"
                out[idx] = hits[0]
            return out
        return v.astype(self.storage)

    def decode(self, a: np.ndarray) -> np.ndarray:
        if self.name == "bfloat16":
            return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if self.name in _FP8:
            return _FP8[self.name][a.astype(np.int64)]
        if self.kind in ("int", "uint"):
            return a.astype(np.int64)
        if self.kind == "float":
            return a.astype(np.float64)
        return a

    def sentinel(self, count: int) -> np.ndarray:
        return np.full(count, True if self.kind == "bool" else 3.0)


def dev_buf(s: Session, dt: DT, values: np.ndarray):
    """(cupy array holding the encoded values, the object handed to ncclpy)."""
    import cupy
    arr = cupy.asarray(dt.encode(values))
    if dt.raw:
        return arr, s.ncclpy.Buffer(int(arr.data.ptr), int(arr.size), dt.name, s.dev)
    return arr, arr


def sub(s: Session, dt: DT, arr: Any, start: int, stop: int) -> Any:
    """Elements [start, stop) of ``arr`` as an ncclpy-acceptable buffer (a view, same memory)."""
    if dt.raw:
        return s.ncclpy.Buffer(int(arr.data.ptr) + start * arr.itemsize, stop - start, dt.name,
                               s.dev)
    return arr[start:stop]


def host(dt: DT, arr: Any) -> np.ndarray:
    import cupy
    return dt.decode(cupy.asnumpy(arr))


def gen(dt: DT, rank: int, count: int, op: str = "sum", salt: int = 0) -> np.ndarray:
    """Per-rank inputs whose every partial reduction is exact in ``dt`` (world size <= 4)."""
    i = np.arange(count)
    if dt.kind == "bool":
        return (i + rank + salt) % 3 == 0
    if op == "prod":
        v = ((i + rank + salt) % 2) + 1.0
        if dt.signed:
            v = np.where((i * 3 + rank + salt) % 5 == 0, -v, v)
        return v
    if dt.signed:
        v = ((i * 7 + rank * 3 + salt) % 5) - 2.0
    else:
        v = ((i * 7 + rank * 3 + salt) % 3) * 1.0
    if dt.kind == "complex":
        v = v + 1j * (((i * 5 + rank + salt) % 5) - 2.0)
    return v


def expected_reduce(dt: DT, op: str, xs: List[np.ndarray]) -> np.ndarray:
    x = np.stack([np.asarray(v) for v in xs])
    n = len(xs)
    if dt.kind == "bool":
        o = {"sum": "max", "prod": "min"}.get(op, op)
        return (x.max(0) if o == "max" else x.min(0)).astype(bool)
    if op == "sum":
        return x.sum(0)
    if op == "prod":
        return x.prod(0)
    if op == "max":
        return x.max(0)
    if op == "min":
        return x.min(0)
    if op == "premul_sum":
        return (x * PREMUL_SCALAR).sum(0)
    if op == "avg":
        if dt.kind in ("int", "uint"):
            t = x.astype(np.int64).sum(0)
            return np.where(t >= 0, t // n, -((-t) // n))   # C division: toward zero
        return x.sum(0) / n
    raise ValueError(op)


_AVG_TOL = {"float16": 4e-3, "bfloat16": 4e-2, "float32": 1e-5, "float64": 1e-12,
            "complex64": 1e-5, "complex128": 1e-12, "float8_e4m3": 0.3, "float8_e5m2": 0.6}


def tolerance(dt: DT, op: str, n: int) -> float:
    if op != "avg" or dt.kind in ("int", "uint", "bool") or n in (1, 2, 4):
        return 0.0
    return _AVG_TOL[dt.name]


def same(dt: DT, got: np.ndarray, want: np.ndarray, what: str, tol: float = 0.0) -> None:
    want = np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    ok = np.array_equal(got, want) if tol == 0.0 else np.allclose(got, want, rtol=tol, atol=tol)
    if not ok:
        bad = np.nonzero(~(np.isclose(got, want, rtol=tol, atol=tol) if tol else got == want))[0]
        raise AssertionError(f"{what}: {len(bad)} of {got.size} elements differ; first at "
                             f"{bad[:6].tolist()}: got {got[bad[:6]].tolist()} expected "
                             f"{want[bad[:6]].tolist()}")


def op_arg(s: Session, op: str) -> Any:
    return s.ncclpy.premul_sum(PREMUL_SCALAR) if op == "premul_sum" else op


def supported(s: Session, dt: DT, op: str) -> bool:
    """Whether ncclpy must accept ``op`` on ``dt`` here (else it must raise UnsupportedError):
    NCCL's and torch's rules as ``_op_rules`` writes them out, never ncclpy's own answer."""
    return must_work(dt.name, op, s.comm.nccl_version, s.n)


def done(w: Any) -> None:
    w.wait(timeout=WAIT_S)
    assert w.is_completed()


C = 37      # elements per rank for reductions
B = 5       # elements per block for the data-movement collectives


def a2a_data(dt: DT, src: int, dst: int, count: int) -> np.ndarray:
    k = np.arange(count)
    if dt.kind == "bool":
        return (src + dst + k) % 2 == 0
    if dt.signed:
        return ((src * 5 + dst * 3 + k) % 5) - 2.0
    return ((src * 5 + dst * 3 + k) % 3) * 1.0


def uneven_count(src: int, dst: int) -> int:
    """Elements ``src`` sends to ``dst`` in the uneven all_to_all (0, 1 or 2)."""
    return (src + 2 * dst + 1) % 3
