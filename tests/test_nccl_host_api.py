"""NCCL 2.22-2.32's host API on CPU: the parameter API and ncclSetEncryption against the real
libnccl (they answer without a GPU); per-collective config, simulated groups and scalable init
through ncclpy's own logic over the STAND-IN for libnccl and CUDA (tests/nccl_standin.py) and
a real store.  What needs a GPU is in tests/gpu/test_host_api_gpu.py."""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import ncclpy
from ncclpy import errors
from ncclpy._nccl.collconfig import CollConfig, CollConfigStruct, coll_struct_size
from ncclpy._nccl.config import Config
from ncclpy.debug.checked import compare, fingerprint
from ncclpy.comm import Communicator
from ncclpy.comm.resolver import Resolver
from ncclpy.plan.types import PlanContext

from nccl_standin import DevArray, run_ranks, standin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UID = bytes(range(128))


def _lib_or_skip():
    from ncclpy._nccl import lib as L
    try:
        lib = L.get_lib()
    except errors.MissingDependencyError as e:
        pytest.skip(f"no libnccl here: {e}")
    from ncclpy._nccl.params import has_param_api
    if not has_param_api(lib):
        pytest.skip(f"NCCL {lib.version} has no parameter API (needs 2.30.4)")
    return lib


# -- the parameter API, real libnccl ------------------------------------------------------

def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    e.update(PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120)


def test_nccl_params_are_what_nccl_resolved():
    _lib_or_skip()
    code = ("import json, ncclpy; p = ncclpy.nccl_params(); "
            "print(json.dumps([p, ncclpy.nccl_param('NCCL_DEBUG_SUBSYS', 'u64'), "
            "ncclpy.nccl_params(['NCCL_DEBUG_SUBSYS'])]))")
    plain = json.loads(_py(code).stdout.strip().splitlines()[-1])
    set_ = json.loads(_py(code, NCCL_DEBUG_SUBSYS="COLL").stdout.strip().splitlines()[-1])
    assert "NCCL_DEBUG" in plain[0] and len(plain[0]) >= 5
    assert plain[0]["NCCL_DEBUG_SUBSYS"] != "COLL" and set_[0]["NCCL_DEBUG_SUBSYS"] == "COLL"
    assert set_[2] == {"NCCL_DEBUG_SUBSYS": "COLL"}
    assert plain[1] != set_[1] and set_[1] > 0      # the typed read of the same parameter


def test_nccl_param_refuses_precisely():
    _lib_or_skip()
    from ncclpy._nccl.params import nccl_param, nccl_params
    with pytest.raises(errors.ArgumentError, match="no parameter 'NCCL_DEBGU'.*NCCL_DEBUG"):
        nccl_param("NCCL_DEBGU")
    with pytest.raises(errors.ArgumentError, match="no parameter 'NCCL_NOPE'"):
        nccl_params(["NCCL_DEBUG", "NCCL_NOPE"])
    with pytest.raises(errors.ArgumentError, match="cannot be read as kind='i32'.*own C type"):
        nccl_param("NCCL_DEBUG_SUBSYS", "i32")          # it is a uint64_t
    with pytest.raises(errors.ArgumentError, match="kind='f32' is not a parameter type"):
        nccl_param("NCCL_DEBUG", "f32")
    with pytest.raises(errors.ArgumentTypeError, match="expected a str"):
        nccl_param(7)
    assert isinstance(nccl_param("NCCL_DEBUG", "raw"), bytes)
    assert nccl_param("NCCL_DEBUG_SUBSYS", "u64") > 0
    assert nccl_param("NCCL_DEBUG_FILE", "str") == ""


def test_info_params_prints_them_without_a_gpu():
    _lib_or_skip()
    r = _py("import sys; from ncclpy.cli import main; sys.exit(main(['info', '--params']))",
            NCCL_DEBUG="WARN")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert any(x.split("=")[0].strip() == "NCCL_DEBUG" and x.split("=", 1)[1].strip() == "WARN"
               for x in lines), r.stdout
    assert lines[-2].startswith("# ") and "parameters of the parameter registry" in lines[-2]
    r = _py("import sys; from ncclpy.cli import main; sys.exit(main(['info', '--params', "
            "'--json']))")
    assert r.returncode == 0 and "NCCL_DEBUG" in json.loads(r.stdout)
    r = _py("import sys; from ncclpy.cli import main; sys.exit(main(['info', '--params', "
            "'--all-ranks']))")
    assert r.returncode == 2 and "separate reports" in r.stderr and "Traceback" not in r.stderr


def _info_params(*extra: str, **env: str) -> subprocess.CompletedProcess:
    return _py("import sys; from ncclpy.cli import main; "
               f"sys.exit(main(['info', '--params', *{list(extra)!r}]))", **env)


def _listed(out: str) -> dict:
    return {ln.split(" = ", 1)[0].strip(): ln.split(" = ", 1)[1]
            for ln in out.splitlines() if " = " in ln and not ln.startswith("#")}


def test_info_params_says_what_a_value_nccl_cannot_give_is():
    _lib_or_skip()
    r = _info_params()                                 # no NCCL_* variable set
    assert r.returncode == 0, r.stderr
    rows = _listed(r.stdout)
    assert rows["NCCL_DEBUG"] == "not set" and rows["NCCL_DEBUG_FILE"] == "not set"
    assert "<unknown>" not in r.stdout
    assert rows["NCCL_DEBUG_TIMESTAMP_FORMAT"] == "'[%F %T] '"      # its trailing space shown
    doc = json.loads(_info_params("--json").stdout)
    assert doc["NCCL_DEBUG"] is None and doc["NCCL_DEBUG_FILE"] is None
    # set: the value NCCL resolved; set but refused by NCCL: said, with NCCL's default
    r = _info_params(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE="", NCCL_SET_THREAD_NAME="maybe")
    rows = _listed(r.stdout)
    assert rows["NCCL_DEBUG"] == "INFO" and rows["NCCL_DEBUG_FILE"] == "''"
    assert rows["NCCL_SET_THREAD_NAME"] == ("FALSE (NCCL's default - NCCL_SET_THREAD_NAME='maybe' "
                                            "in the environment is not a value NCCL accepts)")
    rows = _listed(_info_params(NCCL_DEBUG="LOUD").stdout)
    assert rows["NCCL_DEBUG"] == ("NCCL's default - NCCL_DEBUG='LOUD' in the environment is not a "
                                  "value NCCL accepts")


def test_info_params_footer_promises_what_nccl_param_dump_all_gives():
    _lib_or_skip()
    r = _info_params()
    assert r.returncode == 0, r.stderr
    published = set(_listed(r.stdout))
    foot = [ln for ln in r.stdout.splitlines() if ln.startswith("# ")]
    assert foot[0].startswith(f"# {len(published)} published parameters of the parameter "
                              f"registry of NCCL ")
    assert "more after" not in r.stdout
    m = re.search(r"NCCL_PARAM_DUMP_ALL=true adds its (\d+) private ones?(?:: (.*))?$", foot[0])
    assert m, foot[0]
    private = set(m.group(2).split(", ")) if m.group(2) else set()
    assert len(private) == int(m.group(1))
    r = _info_params(NCCL_PARAM_DUMP_ALL="true")
    assert r.returncode == 0, r.stderr
    assert set(_listed(r.stdout)) == published | private            # exactly what it promised
    assert f"# {len(published | private)} parameters, published and private" in r.stdout
    # every private one reads by name without the variable
    got = json.loads(_py("import json, ncclpy; print(json.dumps(ncclpy.nccl_params("
                         f"{sorted(private)!r})))").stdout.strip().splitlines()[-1])
    assert set(got) == private


def test_param_rows_name_nccls_own_text():
    lib = _lib_or_skip()
    from ncclpy._nccl.params import NOT_SET, UNNAMED, param_rows
    rows = {r.key: r for r in param_rows(lib)}
    d = rows["NCCL_DEBUG"]
    if os.environ.get("NCCL_DEBUG") is None:
        assert (d.nccl_text, d.value, d.shown, d.set_by) == (UNNAMED, None, NOT_SET, "Default")


# -- ncclSetEncryption, real libnccl ----------------------------------------------------------

def test_set_encryption_reaches_nccl():
    lib = _lib_or_skip()
    from ncclpy._nccl.encryption import encryption_struct
    if lib.version < 23200:     # e.g. the NCCL 2.30.7 torch 2.15 pins: refused, naming why
        with pytest.raises(errors.VersionError, match="ncclSetEncryption needs NCCL >= 2.32.0"):
            ncclpy.set_encryption("k" * 32)
        return
    with pytest.raises(errors.NcclInvalidArgument, match="at least 32 bytes"):
        ncclpy.set_encryption("short")                   # NCCL's own check, its own words
    ncclpy.set_encryption("k" * 32)
    ncclpy.set_encryption(None)                          # back to plaintext
    with pytest.raises(errors.ArgumentTypeError, match="psk"):
        ncclpy.set_encryption(b"x" * 32)
    with pytest.raises(errors.ArgumentError, match="NUL"):
        ncclpy.set_encryption("a\x00" * 20)
    s = encryption_struct("p" * 40)
    assert s.mode == 1 and s.psk == b"p" * 40 and s.magic == 0xCAFEBEEF


# -- CollConfig ---------------------------------------------------------------------------------

def test_coll_config_fields_and_refusals():
    c = CollConfig(algorithm="^nvls,ring", force_algorithm=False, min_ctas=2, max_ctas=8,
                   cta_policy="zero", profiler_tag=7)
    s = c.to_struct(23203)
    assert (s.minCTAs, s.maxCTAs, s.CTAPolicy, s.forceAlgSelection) == (2, 8, 2, 0)
    assert s.algSelection == b"^nvls,ring" and s.userProfilerTag == 7 and s.version == 23200
    assert s.size == ctypes.sizeof(CollConfigStruct) and coll_struct_size(23100) < s.size
    assert c.to_struct(23100).size == CollConfigStruct.launchCompletionEvent.offset
    assert CollConfig().to_struct().forceAlgSelection == 1      # NCCL's initializer: 1
    assert c == CollConfig(algorithm="^nvls,ring", force_algorithm=False, min_ctas=2,
                           max_ctas=8, cta_policy=2, profiler_tag=7) and hash(c)
    assert c.describe() == {"algorithm": "^nvls,ring", "force_algorithm": False, "min_ctas": 2,
                            "max_ctas": 8, "cta_policy": 2, "profiler_tag": 7}
    e = CollConfig(launch_completion_event=0x1234)
    assert e.describe() == {"launch_completion_event": True}
    with pytest.raises(errors.VersionError, match="launch_completion_event needs NCCL >= 2.32"):
        e.to_struct(23105)
    with pytest.raises(errors.VersionError, match="needs NCCL >= 2.31"):
        CollConfig().to_struct(22809)
    for kw, cls, words in (({"algorithm": "rnig"}, errors.ArgumentError, "'rnig'"),
                           ({"algorithm": ""}, errors.ArgumentError, "empty"),
                           ({"algorithm": 3}, errors.ArgumentTypeError, "a str"),
                           ({"min_ctas": 9, "max_ctas": 2}, errors.ArgumentError, "min_ctas=9"),
                           ({"max_ctas": 0}, errors.ArgumentError, "1..2147483647"),
                           ({"cga_cluster_size": 9}, errors.ArgumentError, "0..8"),
                           ({"cta_policy": "fast"}, errors.ArgumentError, "not a CTA policy"),
                           ({"profiler_tag": 2 ** 63}, errors.ArgumentError, "profiler_tag"),
                           ({"force_algorithm": 1}, errors.ArgumentTypeError, "True, False"),
                           ({"launch_completion_event": "ev"}, errors.ArgumentTypeError,
                            "CUDA event")):
        with pytest.raises(cls, match=words):
            CollConfig(**kw)
    assert CollConfig(algorithm="allreduce:tree;broadcast:^ring").algorithm


def _with_config(r: int, n: int, cfg, bad) -> list:
    c = Communicator(n, r, UID, r, Config(blocking=True))
    x = DevArray(np.arange(4, dtype=np.float32) + r, device=r)
    c.all_reduce(x, config=cfg).wait()
    c.all_reduce(x, config=cfg).wait()          # the second: from the resolver's cache
    g = DevArray(np.zeros(2 * n, np.float32), device=r)
    with c.group():
        w = c.all_gather(DevArray(np.array([r, r], np.float32), device=r), g, config=cfg)
    w.wait()
    errs = []
    for call in bad:
        try:
            call(c, r, n)
        except errors.NcclpyError as e:
            errs.append((type(e).__name__, str(e)))
    c.close()
    return [x.a.copy(), g.a.copy(), errs]


def test_collectives_with_a_config_call_the_config_variants():
    cfg = CollConfig(algorithm="ring", max_ctas=4)
    sends, recvs = ([1, 2], [1, 1]), ([1, 1], [2, 1])       # uneven: grouped send/recv
    bad = [lambda c, r, n: c.all_to_all(DevArray(np.zeros(3 - r, np.float32), device=r),
                                        DevArray(np.zeros(2 + r, np.float32), device=r),
                                        send_counts=sends[r], recv_counts=recvs[r],
                                        config=cfg),
           lambda c, r, n: c.all_reduce(DevArray(np.zeros(1, np.float32), device=r),
                                        config={"algorithm": "ring"}),
           lambda c, r, n: c.prepare("all_reduce", DevArray(np.zeros(1, np.float32), device=r),
                                     config=cfg)]
    with standin(version=23203) as eng:
        outs = run_ranks(2, _with_config, 2, cfg, bad)
    assert eng.violations == []
    for r, (x, g, errs) in enumerate(outs):
        assert x.tolist() == [2.0, 6.0, 10.0, 14.0]        # in place, summed twice
        assert g.tolist() == [0.0, 0.0, 1.0, 1.0]
        assert [e[0] for e in errs] == ["UnsupportedError", "ArgumentTypeError",
                                        "ArgumentTypeError"], errs
        assert "takes no ncclCollConfig_t" in errs[0][1] and "CollConfig or None" in errs[1][1]
        assert "takes no config=" in errs[2][1]
    names = [c[0] for c in eng.configs]
    assert names.count("AllReduce") == 4 and names.count("AllGather") == 2
    assert {addr for _, addr in eng.configs} == {ctypes.addressof(cfg.to_struct(23203))}
    assert not any(c[0] in ("ncclAllReduce", "ncclAllGather") for c in eng.calls)


def test_a_config_needs_nccl_2_31():
    def one(r, n):
        c = Communicator(n, r, UID, r, Config(blocking=True))
        try:
            with pytest.raises(errors.VersionError, match="needs NCCL >= 2.31"):
                c.all_reduce(DevArray(np.zeros(2, np.float32), device=r), config=CollConfig())
        finally:
            c.close()
    with standin(version=22809):
        run_ranks(2, one, 2)


def test_checked_mode_compares_the_config_across_ranks():
    x = ncclpy.Buffer(0x100000, 16, "float32", 0)
    plans = [Resolver(PlanContext(r, 2, nccl_version=23203)).resolve(
        "all_reduce", 0, x, None, ("sum",), CollConfig(algorithm=a)).plan
        for r, a in ((0, "ring"), (1, "tree"))]
    f0, f1 = fingerprint([plans[0]], 0), fingerprint([plans[1]], 0)
    assert f0["calls"][0]["nccl"] == "AllReduceConfig"
    assert f0["calls"][0]["config"] == {"algorithm": "ring"}
    assert compare({0: f0, 1: f1}) == ["rank 1: call 0 differs from rank 0's in config"]
    assert compare({0: f0, 1: fingerprint([plans[0]], 0)}) == []


# -- group(simulate=True) --------------------------------------------------------------------

def _simulated(r: int, n: int) -> list:
    c = Communicator(n, r, UID, r, Config(blocking=True))
    x = DevArray(np.ones(4, np.float32), device=r)
    with c.group(simulate=True) as g:
        assert g.estimated_time is None                # not ended yet
        w1 = c.all_reduce(x)
        w2 = c.broadcast(x, root=0)
    out = [g.estimated_time_us, g.estimated_time, x.a.tolist()]
    for w in (w1, w2):
        with pytest.raises(errors.NotLaunchedError, match="simulate=True"):
            w.wait()
    with c.group():
        with pytest.raises(errors.UnsupportedError, match="outermost"):
            c.group(simulate=True).__enter__()
    with pytest.raises(errors.ArgumentTypeError, match="True or False"):
        c.group(simulate=1)
    with ncclpy.group(simulate=True) as g2:
        c.all_reduce(x)
    out.append(g2.estimated_time_us)
    c.all_reduce(x).wait()                              # a plain call afterwards runs
    out.append(x.a.tolist())
    c.close()
    return out


def test_a_simulated_group_estimates_and_launches_nothing():
    with standin(version=23203) as eng:
        outs = run_ranks(2, _simulated, 2)
    assert eng.violations == []
    for est_us, est_s, before, est2, after in outs:
        assert est_us == 2.0 and est_s == pytest.approx(2e-6)   # the stand-in: 1 us a call
        assert before == [1.0] * 4 and est2 == 1.0 and after == [2.0] * 4
    assert sum(1 for c in eng.calls if c[0] == "ncclGroupSimulateEnd") == 4


def test_simulate_needs_nccl_2_22():
    def one(r, n):
        c = Communicator(n, r, UID, r, Config(blocking=True))
        try:
            with pytest.raises(errors.VersionError, match="ncclGroupSimulateEnd needs NCCL"):
                c.group(simulate=True)
        finally:
            c.close()
    with standin(version=22105):
        run_ranks(2, one, 2)


# -- scalable init -----------------------------------------------------------------------------

def test_unique_ids_travel_through_the_store():
    from ncclpy.bootstrap import Bootstrap
    from ncclpy.rendezvous.scalable import exchange_unique_ids, root_ranks
    from ncclpy.store import StoreServer, TCPStore
    n, k = 6, 3
    assert root_ranks(n, k) == [0, 2, 4]
    srv = StoreServer("127.0.0.1", 0).start()
    out, errs = [None] * n, []
    try:
        def rank(r):
            st = TCPStore("127.0.0.1", srv.port, timeout=30)
            try:
                bs = Bootstrap(rank=r, world_size=n, local_rank=r, device=0, uid=UID,
                               name="sc", generation=0, store=st, info=None)
                out[r] = exchange_unique_ids(bs, k, 30.0)
            except BaseException as e:  # noqa: B902 - reported below
                errs.append(e)
            finally:
                st.close()
        ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        st = TCPStore("127.0.0.1", srv.port, timeout=30)
        left = st.check([f"ncclpy/uids/sc/0/{p}" for p in ("1", "2", "all", "read")])
        st.close()
    finally:
        srv.close()
    assert not errs, errs
    assert all(o == out[0] for o in out) and len(out[0]) == k and out[0][0] == UID
    assert len(set(out[0])) == k and all(len(u) == 128 for u in out[0])
    assert not left                                     # every key deleted after use


def _scalable(r: int, n: int, ids) -> int:
    c = Communicator(n, r, ids, r)
    x = DevArray(np.ones(2, np.float32), device=r)
    c.all_reduce(x).wait()
    c.close()
    return int(x.a[0])


def test_several_ids_make_the_communicator_with_init_rank_scalable():
    ids = [UID, bytes(range(1, 129)), bytes(128)]
    with standin(version=23203) as eng:
        assert run_ranks(3, _scalable, 3, ids) == [3, 3, 3]
    assert sorted(r for r, _ in eng.scalable_ids) == [0, 1, 2]
    assert all(raw == b"".join(ids) for _, raw in eng.scalable_ids)
    with standin(version=22209):
        with pytest.raises(errors.VersionError, match="ncclCommInitRankScalable needs"):
            run_ranks(2, _scalable, 2, ids[:2])
    with pytest.raises(errors.ArgumentError, match="3 unique ids for 2 ranks"):
        Communicator(2, 0, ids, 0)


def test_init_refuses_bad_unique_ids_before_any_rendezvous():
    for v, cls, words in ((0, errors.ArgumentError, ">= 1"),
                          (True, errors.ArgumentTypeError, "an int"),
                          ("2", errors.ArgumentTypeError, "an int")):
        with pytest.raises(cls, match=f"unique_ids.*{words}"):
            ncclpy.init(unique_ids=v, rank=0, world_size=1)


# -- the bench: --algo and --predict ----------------------------------------------------------

def test_bench_refuses_algo_and_predict_where_they_cannot_work(monkeypatch):
    import bench.cli as cli
    monkeypatch.setattr(cli, "_no_gpu_reason", lambda: "")     # parse as on a GPU machine
    cfg = cli.parse_args(["all_reduce", "--device", "cuda", "--algo", "Ring"])
    assert [c.env() for c in cfg.combos] == [{"NCCL_ALGO": "Ring"}]    # bench/combos.py
    cfg = cli.parse_args(["all_reduce", "--device", "cuda", "--predict"])
    assert cfg.predict and cfg.combos == []
    for argv, words in ((["all_reduce", "--device", "cuda", "--algo", "rnig"],
                         "--algo: expected a comma-separated list of .*, got 'rnig'"),
                        (["all_reduce", "--device", "cuda", "--backend", "torch", "--algo",
                          "ring"], "--algo ring: needs --backend ncclpy or cupy"),
                        (["all_reduce", "--device", "cuda", "--backend", "ncclpy,torch",
                          "--predict"], "--predict: needs --backend ncclpy"),
                        (["all_reduce", "--algo", "ring", "--device", "cpu", "--backend",
                          "gloo"], "--algo ring: needs --backend ncclpy or cupy .*; "
                                   "torch.distributed's gloo runs no NCCL")):
        with pytest.raises(errors.ArgumentError, match=words):
            cli.parse_args(argv)


def test_bench_prints_and_writes_the_predicted_time(tmp_path):
    import jsonschema
    from bench import output
    from bench.output import Row, Side
    rows = [Row("ncclpy", 1024, 256, "float", "float32", "sum", -1, Side(12.5, 0.1, 0.1, 0),
                Side(11.0, 0.1, 0.1, 0), 20, {"predicted_us": 9.75}),
            Row("ncclpy", 2048, 512, "float", "float32", "sum", -1, Side(13.0, 0.2, 0.2, 0),
                Side(12.0, 0.2, 0.2, 0), 20, {"predicted_us": None})]
    head = output.table_header(False, True)
    assert "predict" in head[1] + head[2] + head[3]
    assert output.format_row(rows[0]).split()[-1] == "9.75"
    assert output.format_row(rows[1]).split()[-1] == "N/A"
    doc = output.build_json(rows_by_backend={"ncclpy": rows}, args=["x"], nccl_version=23203,
                            config={}, devices=[], start_time=output.now(),
                            extension={"bench_version": "0", "collective": "all_reduce",
                                       "program": "all_reduce_perf", "world_size": 2,
                                       "device": "cuda", "average": "avg", "timer": "host",
                                       "backends": [{"name": "ncclpy", "label": "ncclpy",
                                                     "nccl_version": 23203}],
                                       "skipped": [], "algorithm": "ring"})
    assert doc["ncclpy"]["predicted"] == [
        {"backend": "ncclpy", "size": 1024, "type": "float", "redop": "sum", "root": -1,
         "predicted_us": 9.75, "measured_us": 12.5},
        {"backend": "ncclpy", "size": 2048, "type": "float", "redop": "sum", "root": -1,
         "predicted_us": None, "measured_us": 13.0}]
    schema = json.load(open(os.path.join(ROOT, "bench", "schema.json")))
    jsonschema.validate(doc["ncclpy"], {**schema["properties"]["ncclpy"],
                                        "$defs": schema["$defs"]})
    output.write_csv(str(tmp_path / "r.csv"), rows, collective="all_reduce", nranks=2, graph=0,
                     device="cuda")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].endswith(",predicted_us") and lines[1].endswith(",9.750")
    assert lines[2].endswith(",")
