"""GPU checks of issue 24 (NCCL 2.22-2.32's host API), on real NCCL: every new Config field
accepted by a real init (one communicator per field, and one with all of them); a simulated
group's estimate against the measured time of the same call within a loose factor; each
collective with a per-collective config (ncclXxxConfig) giving the same result as without, a
forced algorithm accepted, an unsatisfiable forced one refused by NCCL, a mismatched config
across ranks refused by checked mode before NCCL; scalable init with 2 unique ids; the
parameter API after init.  A check whose NCCL is too old records Skip with the version."""
from __future__ import annotations

import time
from typing import Any

from _gpu_common import WAIT_S, Session, Skip, need_nccl


def chk_config_fields(s: Session) -> None:
    from ncclpy._nccl.config import CONFIG_FIELDS
    values = {"graph_usage_mode": 1, "num_rma_ctx": 1, "max_p2p_peers": 8,
              "graph_stream_ordering": True, "launch_order_implicit": True, "num_rma_sig": 1,
              "rma_eager_init": False, "host_cft_mode": "fallback", "nvls_host_mode": 0}
    v = s.comm.nccl_version
    usable = {k: x for k, x in values.items() if CONFIG_FIELDS[k][2] <= v}
    if not usable:
        from ncclpy.semantics.ops import format_version as fmt
        raise Skip(f"NCCL {fmt(v)} < 2.29.0: no 2.29+ Config field is read by it")
    import cupy
    for i, (field, value) in enumerate(list(usable.items()) + [("all", None)]):
        cfg = s.ncclpy.Config(**(usable if field == "all" else {field: value}))
        comm = s.ncclpy.init(name=f"cfg{s.gen}.{i}", config=cfg, timeout=WAIT_S)
        try:
            x = cupy.full(64, s.rank + 1, cupy.float32)
            comm.all_reduce(x).wait()
            assert float(x[0]) == s.n * (s.n + 1) / 2, (field, float(x[0]))
        finally:
            comm.close()


def chk_simulate_vs_measured(s: Session) -> None:
    need_nccl(s, 22200, "ncclGroupSimulateEnd")
    import cupy
    x = cupy.ones(1 << 24, cupy.float32)          # 64 MiB: far above launch latency
    before = x.copy()
    with s.comm.group(simulate=True) as g:
        w = s.comm.all_reduce(x)
    assert bool((x == before).all()), "a simulated call changed the buffer"
    try:
        w.wait()
        raise AssertionError("the Work of a simulated call completed")
    except s.ncclpy.NotLaunchedError:
        pass
    est = g.estimated_time_us
    assert est is not None and est > 0, g
    s.comm.all_reduce(x).wait()                   # warm up, connect
    cupy.cuda.Device(s.dev).synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        s.comm.all_reduce(x)
    cupy.cuda.Device(s.dev).synchronize()
    measured = (time.perf_counter() - t0) / 5 * 1e6
    assert est / 20 < measured < est * 20, f"estimated {est:.1f} us, measured {measured:.1f} us"


def chk_coll_config(s: Session) -> None:
    need_nccl(s, 23100, "ncclCollConfig_t")
    import cupy
    C = s.ncclpy.CollConfig
    n, r = s.n, s.rank
    for cfg in (C(), C(algorithm="ring", max_ctas=4, profiler_tag=42), C(cta_policy="default")):
        x = cupy.full(256, r + 1, cupy.float32)
        s.comm.all_reduce(x, config=cfg).wait()
        assert float(x[0]) == n * (n + 1) / 2
        b = cupy.full(8, r, cupy.int32)
        s.comm.broadcast(b, root=n - 1, config=cfg).wait()
        assert int(b[0]) == n - 1
        g = cupy.zeros(8 * n, cupy.float32)
        s.comm.all_gather(cupy.full(8, r, cupy.float32), g, config=cfg).wait()
        assert [float(g[8 * k]) for k in range(n)] == list(map(float, range(n)))
        rs = cupy.zeros(8, cupy.float32)
        s.comm.reduce_scatter(cupy.ones(8 * n, cupy.float32), rs, config=cfg).wait()
        assert float(rs[0]) == n
        rd = cupy.zeros(8, cupy.float32)
        s.comm.reduce(cupy.ones(8, cupy.float32), rd, root=0, config=cfg).wait()
        assert r != 0 or float(rd[0]) == n


def chk_coll_config_refused(s: Session) -> None:
    need_nccl(s, 23100, "ncclCollConfig_t")
    import cupy
    x = cupy.ones(64, cupy.float32)
    try:      # CollNet is absent on one node: a forced, unsatisfiable selection is an error
        s.comm.all_reduce(x, config=s.ncclpy.CollConfig(algorithm="collnetdirect")).wait()
        raise AssertionError("NCCL accepted a forced CollNetDirect without CollNet")
    except s.ncclpy.NcclError as e:
        assert "ncclAllReduceConfig" in str(e), e
    chk = s.ncclpy.init(name=f"chk{s.gen}", checked=True, timeout=WAIT_S)
    try:
        cfg = s.ncclpy.CollConfig(algorithm="ring" if s.rank == 0 else "tree")
        try:
            chk.all_reduce(x, config=cfg).wait()
            raise AssertionError("checked mode let a mismatched config through")
        except s.ncclpy.CallMismatchError as e:
            assert "config" in str(e), e
    finally:
        chk.abort()


def chk_scalable_init(s: Session) -> None:
    need_nccl(s, 22300, "ncclCommInitRankScalable")
    import cupy
    comm = s.ncclpy.init(name=f"scal{s.gen}", unique_ids=2, timeout=WAIT_S)
    try:
        x = cupy.full(32, s.rank + 1, cupy.float32)
        comm.all_reduce(x).wait()
        assert float(x[0]) == s.n * (s.n + 1) / 2
    finally:
        comm.close()


def chk_params_after_init(s: Session) -> None:
    need_nccl(s, 23004, "the parameter API")
    # NCCL's registry parameters are registered when libnccl loads (NCCL 2.30's sources: global
    # ncclParam objects), so init adds none that ncclpy knows of; the published ones all read
    p = s.comm.nccl_params()
    from ncclpy._nccl.params import param_keys
    assert "NCCL_DEBUG" in p and set(param_keys()) <= set(p), sorted(p)[:20]
    assert all(isinstance(v, str) for v in p.values()), p


def host_api_worker(rank: int, outdir: str) -> Any:
    s = Session(rank, outdir, "hostapi")
    for name, fn in (("config_fields", chk_config_fields),
                     ("simulate_vs_measured", chk_simulate_vs_measured),
                     ("coll_config", chk_coll_config),
                     ("coll_config_refused", chk_coll_config_refused),
                     ("scalable_init", chk_scalable_init),
                     ("params_after_init", chk_params_after_init)):
        s.check(name, fn)
    s.finish()
